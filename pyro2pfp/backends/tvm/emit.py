"""The Relax emitter: the kernel table, the context a kernel emitter gets, the kernel attributes
schedules, tuning and profiling read, and :func:`emit_module`, which emits a planned network as a
Relax IRModule.

The kernels are registered from ``backends/tvm/ops/<family>.py`` (loaded by ``backends/tvm/__init__``)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import tvm
from tvm import relax, te, tirx

from ... import moments
from ...errors import ArgumentError, PFPError
from ...planning import protocols
from ...planning.graph import INPUT, Repr
from ...planning.plan import PlannedGraph, PlannedLayer
from ...planning.registry import add_to
from .fast_math import F32, TE_OPS
from .fusion import fused_activations
from .te_let import te_shared

# A sum over pairs: one reduction computing mean and second component together.
pair_sum = te.comm_reducer(
    lambda a, b: (a[0] + b[0], a[1] + b[1]),
    lambda t0, t1: (tirx.const(0, t0), tirx.const(0, t1)),
    name="pair_sum",
)
# ... and over triples (the conv's mean, variance and weight-noise sums: ops/compute.py)
triple_sum = te.comm_reducer(
    lambda a, b: (a[0] + b[0], a[1] + b[1], a[2] + b[2]),
    lambda t0, t1, t2: (tirx.const(0, t0), tirx.const(0, t1), tirx.const(0, t2)),
    name="triple_sum",
)


@dataclass
class RelaxActivation:
    """A batch of independent Gaussians in the Relax graph: ``second`` is None when deterministic."""

    mean: relax.Expr
    second: relax.Expr | None
    repr: Repr
    #: a conv2d layer's weight-noise term ``Σ V·E[x²] + v_bias`` (B, *out shape; not clamped), the part
    #: of the mean-field variance that the weight and bias variances contribute -- set only where the
    #: emitter asked for it (:attr:`EmitContext.weight_noise`), for the shared-factor rule to reuse
    weight_noise: relax.Expr | None = None

    def tensors(self) -> list[relax.Expr]:
        return [self.mean] if self.second is None else [self.mean, self.second]


@dataclass
class EmitContext:
    """What a kernel emitter gets besides its inputs."""

    bb: relax.BlockBuilder
    batch: tirx.Var
    shapes: dict[str, tuple[int, ...]]  # per-sample shape of every edge (input and layer outputs)
    activation: PlannedLayer | None = None  # a ReLU fused into the compute kernel being emitted
    # called with (name, PrimFunc) of each kernel as soon as it is emitted (build_network's KernelStream)
    on_kernel: Callable[[str, tirx.PrimFunc], None] | None = None
    # the compute kernel being emitted also returns its weight-noise term (RelaxActivation.weight_noise)
    weight_noise: bool = False

    def const(self, array: np.ndarray) -> relax.Constant:
        return relax.const(np.ascontiguousarray(array, dtype=np.float32))

    def emit_te(self, fn: Callable[..., Any], args: list[relax.Expr], layer: PlannedLayer) -> list[relax.Expr]:
        """Emit one TE function as one PrimFunc named after the layer (``pfp_<op>_<layer>``, plus
        ``_<relu layer>`` when a ReLU is fused into it); returns its output tensors."""
        name = f"pfp_{layer.op}_{layer.name}"
        attrs = {OP_ATTR: layer.op, LAYER_ATTR: layer.name}
        if self.activation is not None:
            name += f"_{self.activation.name}"
            attrs[FUSED_ATTR] = self.activation.name
        return self.emit_kernel(fn, args, name, attrs)

    def emit_kernel(self, fn: Callable[..., Any], args: list[relax.Expr], name: str, attrs: dict[str, Any]
                    ) -> list[relax.Expr]:
        """``bb.emit_te`` of ``fn`` as the PrimFunc ``name`` with ``attrs``, announced to
        :attr:`on_kernel`; returns its output tensors."""
        call = self.bb.call_te(fn, *args, primfunc_name_hint=name, primfunc_attrs=attrs)
        self.announce(call.args[0])
        return self.emit_outputs(call)

    def emit_outputs(self, call: relax.Call) -> list[relax.Expr]:
        """Emit ``call`` (a ``call_tir``) and return its output tensors, each bound on its own."""
        out = self.bb.emit(call)
        if isinstance(out.ty, relax.TupleType):
            return [self.bb.emit(relax.TupleGetItem(out, i)) for i in range(len(out.ty.fields))]
        return [out]

    def announce(self, gv: relax.GlobalVar) -> None:
        """Hand the PrimFunc ``gv`` of the module being built to :attr:`on_kernel`, if any."""
        if self.on_kernel is not None:
            self.on_kernel(gv.name_hint, self.bb.get()[gv])


def activation_out(outs: list[relax.Expr], layer: PlannedLayer) -> RelaxActivation:
    if layer.out_repr is Repr.DETERMINISTIC:
        return RelaxActivation(outs[0], None, layer.out_repr)
    return RelaxActivation(outs[0], outs[1], layer.out_repr)


def variance_of(mean: Any, second: Any, repr_: Repr) -> Any:
    """TE expression of the variance of an input element given in ``repr_`` (variance or raw moment)."""
    if repr_ is Repr.SECOND_MOMENT:
        return moments.second_to_variance(mean, second, TE_OPS)
    return second


def epilogue(mean: Any, var: Any, layer: PlannedLayer) -> list[Any]:
    """TE expressions of the layer's output pair in the representation it must emit."""
    if layer.out_repr is Repr.SECOND_MOMENT:
        return [mean, moments.variance_to_second(mean, var, TE_OPS)]
    return [mean, var]


def epilogue_fused(mean: Any, var: Any, layer: PlannedLayer, relu: PlannedLayer | None) -> list[Any]:
    """:func:`epilogue` of the layer's output pair, or -- with a ReLU fused into the layer's kernel
    (:func:`fused_activations`) -- of the ReLU's output moments, in the ReLU's representation."""
    if relu is None:
        return epilogue(mean, var, layer)
    fused: PlannedLayer = relu
    return te_shared(lambda ops: epilogue(*moments.relu_moments(mean, var, ops), fused))


KernelFn = Callable[[EmitContext, PlannedLayer, list[RelaxActivation]], RelaxActivation]
KERNELS: dict[str, KernelFn] = {}

# Every PFP PrimFunc carries the PFP op and the layer it computes (and a ReLU fused into it):
# schedules, tuning and profiling read these, not the function's name.
OP_ATTR, LAYER_ATTR, FUSED_ATTR = "pfp.op", "pfp.layer", "pfp.fused"


def kernel_info(func: Any) -> tuple[str | None, str | None]:
    """``(op, layer)`` of a PFP PrimFunc (``(None, None)`` for any other function)."""
    attrs = getattr(func, "attrs", None) or {}
    op, layer = attrs.get(OP_ATTR), attrs.get(LAYER_ATTR)
    return (str(op) if op is not None else None, str(layer) if layer is not None else None)


def kernel_table(mod: Any) -> dict[str, tuple[str, str]]:
    """``{function symbol: (op, layer)}`` of the PFP PrimFuncs of an IRModule."""
    table = {}
    for gv in mod.get_global_vars():
        op, layer = kernel_info(mod[gv])
        if op is not None and layer is not None:
            table[gv.name_hint] = (op, layer)
    return table
#: ``@kernel(op)`` registers the Relax/TE emitter of PFP op ``op`` (once).
kernel = add_to(KERNELS, "TVM kernel of op")

class SchemeStep(protocols.SchemeStep["EmitContext", "RelaxActivation"], Protocol):
    """The kernels of a correlation scheme, emitted layer by layer (:data:`SCHEME_STEPS`): a
    :class:`pyro2pfp.planning.protocols.SchemeStep` (``emits_mean_field(layer)``: whether the step's kernel for
    ``layer`` also computes its mean-field outputs; then :func:`emit_module` emits no mean-field kernel for it and
    passes ``out=None``) that also says whether it reads a layer's weight-noise term."""

    def needs_weight_noise(self, layer: PlannedLayer) -> bool:
        """Whether the step reads ``layer``'s weight-noise term (:attr:`RelaxActivation.weight_noise`):
        :func:`emit_module` then asks the layer's mean-field kernel for it (:attr:`EmitContext.weight_noise`)."""
        ...



SCHEME_STEPS: dict[str, Callable[[PlannedGraph], SchemeStep]] = {}
"""``{correlation scheme: step factory}`` for plans that are not mean-field: ``factory(graph)``
returns a :class:`SchemeStep` ``step(ctx, layer, inputs, out) -> out`` which emits the scheme's
kernels after each layer's mean-field kernel and returns the layer's (possibly variance-corrected)
output -- or, where ``step.emits_mean_field(layer)``, instead of it (``out=None``: one kernel computes
both).  ``"shared-factor"``: ``backends/tvm/shared_factor.py`` (its ReLU kernels compute the
mean-field ReLU moments too, from the op's rule: ``ops.activation.activation_moments``)."""


def emit_module(graph: PlannedGraph, *, fuse: bool = True,
                on_kernel: Callable[[str, tirx.PrimFunc], None] | None = None) -> tvm.IRModule:
    """The planned network as a Relax IRModule.

    ``main(x: (batch, *input_shape) float32[, x_var]) -> (mean, var)`` of the output; weights are
    bound as float32 constants; ``batch`` is symbolic.  ``fuse``: ReLUs that follow a dense layer
    are computed in its kernel (:func:`fused_activations`; not for a shared-factor plan, whose
    kernels of :data:`SCHEME_STEPS` follow every layer's, and replace the mean-field kernel of the
    layers where :meth:`SchemeStep.emits_mean_field`: its ReLUs).  ``on_kernel(name, func)`` is
    called with each PrimFunc as soon as it is emitted (a kernel emitted again under the same name,
    deduplicated by the block builder, may be announced again).
    """
    step = None
    if graph.factors is not None:  # a factor plan: its scheme's kernels after each layer's (no fusion)
        if graph.factors.scheme not in SCHEME_STEPS:
            raise ArgumentError(f"the TVM back end has no kernels for correlation={graph.factors.scheme!r} yet; "
                                "net.reference runs it, or convert with correlation='shared-factor' or 'mean-field'")
        step = SCHEME_STEPS[graph.factors.scheme](graph)
        fuse = False
    batch = tirx.Var("batch", "int64")
    bb = relax.BlockBuilder()
    shapes = {INPUT: graph.input_shape, **{p.name: p.layer.out_shape for p in graph.layers}}
    ctx = EmitContext(bb=bb, batch=batch, shapes=shapes, on_kernel=on_kernel)
    in_type = relax.TensorType((batch, *graph.input_shape), F32)
    params = [relax.Var("x", in_type)]
    if graph.input_repr is not Repr.DETERMINISTIC:
        params.append(relax.Var("x_var", in_type))
    with bb.function("main", params):
        with bb.dataflow():
            values = {INPUT: RelaxActivation(params[0], params[1] if len(params) > 1 else None,
                                             graph.input_repr)}
            fused = fused_activations(graph) if fuse else {}
            fused_names = {relu.name: producer for producer, relu in fused.items()}
            for layer in graph.layers:
                if layer.name in fused_names:  # computed by its producer's kernel
                    values[layer.name] = values[fused_names[layer.name]]
                    continue
                inputs = [values[name] for name in layer.inputs]
                if step is not None and step.emits_mean_field(layer):  # one kernel: the scheme's and the layer's
                    values[layer.name] = step(ctx, layer, inputs, None)
                    continue
                fn = KERNELS.get(layer.op)
                if fn is None:
                    raise PFPError(f"{layer.layer.source}: no TVM kernel for PFP op '{layer.op}'")
                ctx.activation = fused.get(layer.name)
                ctx.weight_noise = step is not None and step.needs_weight_noise(layer)
                values[layer.name] = fn(ctx, layer, inputs)
                if ctx.weight_noise and values[layer.name].weight_noise is None:
                    raise PFPError(f"{layer.layer.source}: the TVM kernel of op '{layer.op}' does not return the "
                                   "weight-noise term the shared-factor rule reads (injection='rescaled'); "
                                   "use injection='regression'")
                ctx.activation, ctx.weight_noise = None, False
                if step is not None:
                    values[layer.name] = step(ctx, layer, inputs, values[layer.name])
            result = values[graph.output]
            if result.repr is Repr.DETERMINISTIC:
                zeros = bb.emit(relax.op.zeros_like(result.mean))
                result = RelaxActivation(result.mean, zeros, Repr.VARIANCE)
            assert result.repr is Repr.VARIANCE, result.repr
            out = bb.emit_output(relax.Tuple([result.mean, result.second]))
        bb.emit_func_output(out)
    return bb.get()
