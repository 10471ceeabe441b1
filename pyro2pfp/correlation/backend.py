"""The per-layer dispatch shared by the float32 back ends of shared-factor PFP (the TVM kernels,
``backends/tvm/shared_factor.py``, and the ONNX export, :mod:`pyro2pfp.correlation.onnx_step`):
after each layer's mean-field output, the rule of its op (from the back end's table,
:data:`~pyro2pfp.planning.registry.SHARED_KERNELS` or :data:`~pyro2pfp.planning.registry.SHARED_EXPORTERS`) turns
the inputs' shared parts into the output's and may correct the output variance.  A back end
subclasses :class:`FixedKStep`, names its table and implements :meth:`FixedKStep.compact` if it
compacts."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import PFPError
from ..planning.graph import INPUT, Repr
from ..planning.plan import PlannedGraph, PlannedLayer
from ..planning.registry import OPS
from .factors import fixed_k_plan, is_noisy

F = TypeVar("F", bound=Callable[..., Any])


def fuses_mean_field(rule: F) -> F:
    """Mark a rule of a back end's table whose kernel computes the layer's mean-field outputs too: the
    emitter emits no mean-field kernel for such a layer (with a shared input) and calls the rule with
    ``out=None`` (:meth:`FixedKStep.emits_mean_field`)."""
    rule.fuses_mean_field = True  # type: ignore[attr-defined]
    return rule


class FixedKStep:
    """``step(ctx, layer, inputs, out) -> out`` for a shared-factor plan in a float32 back end
    (``out=None`` where :meth:`emits_mean_field`).

    ``self.fp``: the fixed-K factor plan (:func:`~pyro2pfp.correlation.factors.fixed_k_plan`);
    ``self.shared[edge]``: the back end's shared part of each edge (None: none).  ``out`` and the
    returned activation are the back end's ``(mean, second)`` activations.  Each rule of
    :attr:`rules` is called as ``rule(step, ctx, layer, inputs, shared, out)`` (``shared``: the
    inputs' shared parts) and returns ``(the output's shared part, out)`` -- ``out`` with the
    corrected variance where the rule corrects it (dense, add, average pooling)."""

    what = "this back end"
    #: the back end implements :meth:`compact` (else its plan has no compaction points: ``K`` grows)
    compaction = False
    #: ``{op: rule}``: the back end's table of rules
    rules: dict[str, Callable[..., Any]] = {}
    #: the compute ops whose rules in :attr:`rules` carry a correlated guide's global factors (None: those
    #: whose ``FactorSpec.guide_factors`` says so)
    guide_ops: frozenset[str] | None = None

    def __init__(self, graph: PlannedGraph) -> None:
        self.fp = fixed_k_plan(graph, self.what, self.rules, compaction=self.compaction, guide_ops=self.guide_ops)
        self.shared: dict[str, Any] = {INPUT: None}

    def emits_mean_field(self, layer: PlannedLayer) -> bool:
        """Whether this step computes ``layer``'s mean-field outputs itself, in its rule's kernel (the
        emitter then emits no mean-field kernel for the layer and calls the step with ``out=None``).
        Asked in layer order, after the step has run on the layer's inputs.  For an op whose output is a
        covariance of its input's shared part (``FactorSpec.covariance``: its rule computes the whole
        output) where that input has one; for a rule marked :func:`fuses_mean_field` (its kernel computes
        the layer's mean-field outputs too: the TVM ReLU's ``sf_relu``, the max pools' folds), for a layer with
        a random output and an input with a shared part (where the rule runs)."""
        rule = self.rules.get(layer.op)
        return self.replaces_output(layer) or (
            getattr(rule, "fuses_mean_field", False) and layer.out_repr is not Repr.DETERMINISTIC
            and self.shared[layer.inputs[0]] is not None)

    def replaces_output(self, layer: PlannedLayer) -> bool:
        """``layer`` is a ``FactorSpec.covariance`` op whose input has a shared part: its rule computes
        its whole output."""
        return (layer.op in OPS and OPS[layer.op].factor_spec.covariance
                and any(self.shared.get(n) is not None for n in layer.inputs))

    def __call__(self, ctx: Any, layer: PlannedLayer, inputs: list[Any], out: Any) -> Any:
        shs = [self.shared[n] for n in layer.inputs]
        sh = None
        if out is None and not self.emits_mean_field(layer):
            raise PFPError(f"{layer.layer.source}: {self.what} needs the mean-field outputs of layer "
                           f"'{layer.name}' (op '{layer.op}')")
        covariance = layer.op in OPS and OPS[layer.op].factor_spec.covariance
        if out is None or ((out.repr is not Repr.DETERMINISTIC or covariance)
                           and (any(s is not None for s in shs) or is_noisy(layer))):
            rule = self.rules.get(layer.op)
            if rule is None:  # fixed_k_plan refuses such plans
                raise PFPError(f"{layer.layer.source}: op '{layer.op}' has no shared-factor rule in {self.what}")
            sh, out = rule(self, ctx, layer, inputs, shs, out)
        if sh is not None and layer.name in self.fp.compact_at:
            sh = self.compact(ctx, layer, sh)
        self.shared[layer.name] = sh
        return out

    def compact(self, ctx: Any, layer: PlannedLayer, sh: Any) -> Any:
        """``sh`` with ``g`` (B, C, K) replaced by a (B, C, aligned(C)) matrix with the same ``g·gᵀ``
        (only where ``self.fp.compact_at`` says; called only if :attr:`compaction`)."""
        raise NotImplementedError
