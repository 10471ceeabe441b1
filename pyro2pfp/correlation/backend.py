"""The per-layer dispatch shared by the float32 back ends of shared-factor PFP (the TVM kernels,
``tvm_backend/ops/correlation.py``, and the ONNX export, :mod:`pyro2pfp.correlation.onnx_rules`):
after each layer's mean-field output, the rule of its op turns the inputs' shared parts into the
output's and may correct the output variance.  A back end subclasses :class:`FixedKStep` and
implements one method per rule family on its own tensor type."""
from __future__ import annotations

from typing import Any

from ..errors import PFPError
from ..graph import INPUT, Repr
from ..plan import PlannedGraph, PlannedLayer
from ..registry import OPS
from .factors import TERMINAL_OPS, fixed_k_plan


class FixedKStep:
    """``step(ctx, layer, inputs, out) -> out`` for a shared-factor plan in a float32 back end
    (``out=None`` where :meth:`emits_mean_field`).

    ``self.fp``: the fixed-K factor plan (:func:`~pyro2pfp.correlation.factors.fixed_k_plan`);
    ``self.shared[edge]``: the back end's shared part of each edge (None: none).  ``out`` and the
    returned activation are the back end's ``(mean, second)`` activations; the methods return the
    output's shared part (and, for dense/add/average pooling, the activation with the corrected
    variance)."""

    what = "this back end"
    #: the back end implements :meth:`compact` (else its plan has no compaction points: ``K`` grows)
    compaction = False
    #: the back end's relu/leaky_relu rule computes the layer's mean-field outputs too
    #: (:meth:`relu_with_moments`; the emitter asks :meth:`emits_mean_field`)
    fused_relu = False

    def __init__(self, graph: PlannedGraph) -> None:
        self.fp = fixed_k_plan(graph, self.what, compaction=self.compaction)
        self.shared: dict[str, Any] = {INPUT: None}

    def emits_mean_field(self, layer: PlannedLayer) -> bool:
        """Whether this step computes ``layer``'s mean-field outputs itself, in its rule's kernel: a
        relu/leaky_relu layer with a random output and an input with a shared part (where the relu
        rule runs) in a back end with :attr:`fused_relu`.  The emitter then emits no mean-field
        kernel for the layer and calls the step with ``out=None``.  Asked in layer order, after the
        step has run on the layer's inputs."""
        return (self.fused_relu and layer.op in ("relu", "leaky_relu") and layer.out_repr is not Repr.DETERMINISTIC
                and self.shared[layer.inputs[0]] is not None)

    def __call__(self, ctx: Any, layer: PlannedLayer, inputs: list[Any], out: Any) -> Any:
        shs = [self.shared[n] for n in layer.inputs]
        op = layer.op
        sh = None
        if out is None:  # emits_mean_field(layer): the rule's kernel computes the mean-field outputs too
            if not self.emits_mean_field(layer):
                raise PFPError(f"{layer.layer.source}: {self.what} needs the mean-field outputs of layer "
                                 f"'{layer.name}' (op '{op}')")
            sh, out = self.relu_with_moments(ctx, layer, inputs[0], shs[0])
        elif out.repr is Repr.DETERMINISTIC or op in TERMINAL_OPS:
            pass  # nothing shared out (a terminal op: the head reads only its input's corrected moments)
        elif op in ("conv2d", "dense") and shs[0] is None and layer.name not in self.fp.offsets:
            pass  # no shared part in, no weight noise: none out
        elif op == "conv2d":
            sh = self.conv2d(ctx, layer, inputs[0], shs[0], out)
        elif op == "dense":
            sh, out = self.dense(ctx, layer, inputs[0], shs[0], out)
        elif op == "add" and (shs[0] is None or shs[1] is None):
            sh = shs[1] if shs[0] is None else shs[0]  # one branch without a shared part: nothing to combine
        elif op == "add":
            sh, out = self.add(ctx, layer, shs[0], shs[1], out)
        elif shs[0] is None:
            pass
        elif op in ("affine", "scale"):
            sh = self.linear(ctx, layer, shs[0], out)
        elif op in ("relu", "leaky_relu"):
            sh = self.relu(ctx, layer, inputs[0], shs[0], out)
        elif op in OPS and OPS[op].activation is not None:
            sh = self.activation(ctx, layer, inputs[0], shs[0], out)
        elif op == "avg_pool2d":
            sh, out = self.avg_pool(ctx, layer, inputs[0], shs[0], out)
        elif op == "max_pool2d":
            sh = self.max_pool(ctx, layer, inputs[0], shs[0], out)
        elif op in ("reshape", "convert"):
            sh = self.view(ctx, layer, shs[0])
        if sh is not None and layer.name in self.fp.compact_at:
            sh = self.compact(ctx, layer, sh)
        self.shared[layer.name] = sh
        return out

    # one method per rule (see pyro2pfp.correlation.rules); conv2d/dense get ``sh`` None when their
    # input has no shared part (then the layer has weight noise)
    def conv2d(self, ctx: Any, layer: PlannedLayer, x: Any, sh: Any, out: Any) -> Any:
        raise NotImplementedError

    def dense(self, ctx: Any, layer: PlannedLayer, x: Any, sh: Any, out: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    def add(self, ctx: Any, layer: PlannedLayer, sa: Any, sb: Any, out: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    def linear(self, ctx: Any, layer: PlannedLayer, sh: Any, out: Any) -> Any:
        raise NotImplementedError

    def relu(self, ctx: Any, layer: PlannedLayer, x: Any, sh: Any, out: Any) -> Any:
        raise NotImplementedError

    def activation(self, ctx: Any, layer: PlannedLayer, x: Any, sh: Any, out: Any) -> Any:
        """The generic activation rule (any op with an ``ActivationRule`` but relu, leaky_relu and
        scale): ``clip(E[f'(a)]·s)`` per element, the slope by
        :func:`~pyro2pfp.correlation.stein.stein_slope` on the back end's ``ops``; ``g`` unchanged."""
        raise NotImplementedError

    def relu_with_moments(self, ctx: Any, layer: PlannedLayer, x: Any, sh: Any) -> tuple[Any, Any]:
        """The relu rule and the layer's mean-field outputs ``out`` (back ends with
        :attr:`fused_relu`): ``(shared part, out)``."""
        raise NotImplementedError

    def avg_pool(self, ctx: Any, layer: PlannedLayer, x: Any, sh: Any, out: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    def max_pool(self, ctx: Any, layer: PlannedLayer, x: Any, sh: Any, out: Any) -> Any:
        raise NotImplementedError

    def view(self, ctx: Any, layer: PlannedLayer, sh: Any) -> Any:
        raise NotImplementedError

    def compact(self, ctx: Any, layer: PlannedLayer, sh: Any) -> Any:
        """``sh`` with ``g`` (B, C, K) replaced by a (B, C, aligned(C)) matrix with the same ``g·gᵀ``
        (only where ``self.fp.compact_at`` says; called only if :attr:`compaction`)."""
        raise NotImplementedError
