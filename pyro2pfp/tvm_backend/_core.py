"""Kernel registry, TE math namespace and the Relax emitter loop.

The kernels are registered from ``tvm_backend/ops/<family>.py`` (loaded by ``tvm_backend/__init__``)."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Protocol

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, te, tirx

from .. import moments
from ..errors import PFPError
from ..graph import INPUT, Repr
from ..plan import PlannedGraph, PlannedLayer
from ..registry import add_to

F32 = "float32"


def _const(value: float) -> tirx.PrimExpr:
    return tirx.const(value, F32)


# Eigen's rational float32 erf on [-4, 4] (|error| of a few ulp; erf(±4) = ±1 in float32).  Unlike a
# libm ``erff`` call it vectorises, which makes ReLU and max pooling several times faster.
_ERF_NUM = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
            -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_ERF_DEN = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
            -1.42647390514189e-02)


def _no_bind(e: tirx.PrimExpr) -> tirx.PrimExpr:
    return e


def fast_erf(x: tirx.PrimExpr, bind: Callable[[tirx.PrimExpr], tirx.PrimExpr] = _no_bind) -> tirx.PrimExpr:
    """erf(x) in float32 as ``x·P(x²)/Q(x²)`` (vectorisable, no libm call).

    ``bind`` (see :func:`te_shared`) names the sub-expressions used several times."""
    x = bind(te.min(te.max(x, _const(-4.0)), _const(4.0)))
    x2 = bind(x * x)
    num = _const(_ERF_NUM[0])
    for c in _ERF_NUM[1:]:
        num = num * x2 + _const(c)
    den = _const(_ERF_DEN[0])
    for c in _ERF_DEN[1:]:
        den = den * x2 + _const(c)
    return x * num / den


# Cephes' float32 expf: exp(x) = 2^n·exp(r), n = round(x·log2 e), r = x − n·ln 2 (ln 2 split in a
# hi part exact in float32 and a lo correction), exp(r) on |r| ≤ ln2/2 by a degree-6 polynomial.
_EXP_LOG2E = 1.44269504088896341
_EXP_LN2_HI = 0.693359375
_EXP_LN2_LO = -2.12194440e-4
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
             5.0000001201e-1)
EXP_MIN = -87.33654022216797
"""The least float32 above ln(FLT_MIN) = −87.3365447…: below it exp(x) is denormal and ``fast_exp``
returns 0.  (It was ``-87.33654475``, which rounds to the float32 *below* ln(FLT_MIN): a lane
clamped there computed the denormal ``0.99999·2^−126`` before the select threw it away, and x86
arithmetic producing denormals runs microcode -- the Gaussian-max and ReLU kernels, whose far tails
clamp every lane with zero variance, ran 2x slower on LeNet-5's activations:
``benchmarks/kernel_profile.py --net lenet --batch 10 --static --threads 1``, relu1 59 -> 33 us.
Clamped here, the lane computes ``1.0000045·2^−126``, a normal float.)"""
EXP_MAX = 88.37626266  # 127.5·ln 2: the largest x with 2^n a normal float32 (results saturate there)


def fast_exp(x: tirx.PrimExpr, bind: Callable[[tirx.PrimExpr], tirx.PrimExpr] = _no_bind) -> tirx.PrimExpr:
    """exp(x) in float32, within 1 ulp of the exact value (vectorisable, no libm call).

    ``llvm.exp`` (``te.exp``) becomes one libm ``expf`` call per lane; this is plain arithmetic
    plus a ``reinterpret`` of the biased exponent ``(n + 127) << 23`` as the float ``2^n``.
    ``exp(0) = 1`` exactly; ``x < EXP_MIN`` (including ``-inf``) gives exactly 0 (the exact value
    is a denormal < FLT_MIN); ``x > EXP_MAX`` saturates at ``exp(EXP_MAX) ≈ 2.4e38`` (never inf).
    ``bind`` (see :func:`te_shared`) names the sub-expressions used several times.
    """
    x = bind(x)
    xc = te.min(te.max(x, _const(EXP_MIN)), _const(EXP_MAX))
    n = bind(tirx.floor(xc * _const(_EXP_LOG2E) + _const(0.5)))
    r = bind(xc - n * _const(_EXP_LN2_HI) - n * _const(_EXP_LN2_LO))
    poly = _const(_EXP_POLY[0])
    for c in _EXP_POLY[1:]:
        poly = poly * r + _const(c)
    exp_r = poly * (r * r) + r + _const(1.0)
    biased = tirx.Cast("int32", n) + tirx.const(127, "int32")
    two_n = tirx.reinterpret(F32, tirx.shift_left(biased, tirx.const(23, "int32")))
    return tirx.Select(x < _const(EXP_MIN), _const(0.0), exp_r * two_n)


def _normal_cdfs(alpha: tirx.PrimExpr, bind: Callable[[tirx.PrimExpr], tirx.PrimExpr] = _no_bind
                 ) -> tuple[tirx.PrimExpr, tirx.PrimExpr]:
    """(Φ(α), Φ(−α)) from one erf evaluation."""
    half_erf = bind(_const(0.5) * fast_erf(alpha * _const(moments.INV_SQRT2), bind))
    return bind(_const(0.5) + half_erf), bind(_const(0.5) - half_erf)


def fast_erfcx(x: tirx.PrimExpr, bind: Callable[[tirx.PrimExpr], tirx.PrimExpr] = _no_bind) -> tirx.PrimExpr:
    """``e^{x²}·erfc(x)`` for ``x ≥ 0`` in float32: :func:`moments.erfcx_rational` on ``fast_exp``
    (one exp, a degree-9 polynomial; 1.2e-7 relative, vectorisable)."""
    return moments.erfcx_rational(x, SimpleNamespace(const=_const, exp=lambda e: bind(fast_exp(e, bind))))


TE_OPS = SimpleNamespace(
    where=tirx.Select,
    normal_cdfs=_normal_cdfs,
    exp=fast_exp,
    erfcx=fast_erfcx,
    sqrt=te.sqrt,
    maximum=te.max,
    minimum=te.min,
    const=_const,
)
"""The :mod:`pyro2pfp.moments` formulas evaluated on TE expressions (float32)."""

_LEAVES = (tirx.Var, tirx.IntImm, tirx.FloatImm, te.tensor.TensorSlice)


def _is_leaf(value: Any) -> bool:
    """Constants, variables and tensor loads: as cheap to repeat as a variable."""
    return isinstance(value, _LEAVES) or (isinstance(value, tvm.ir.expr.Call) and isinstance(value.op, tvm.ir.Op)
                                          and value.op.name == "te.tensor_load")


def te_shared(build: Callable[[SimpleNamespace], Any], reuse: bool = False) -> list[tirx.PrimExpr]:
    """``build(ops)`` -- a sequence of TE expressions computed with ``ops``, e.g. ``lambda ops:
    moments.relu_moments(m, v, ops)`` -- with its shared sub-expressions computed once.

    The :mod:`pyro2pfp.moments` formulas use ``α``, ``σ``, ``Φ(±α)`` and ``φ(α)`` several times
    each, and ``fast_erf``/``fast_exp`` their argument many times; as plain TE expressions these
    are trees (TIR passes do not share the nodes of a DAG), so one ReLU or Clark max would be
    thousands of nodes that every TIR pass processes copy by copy (LeNet took 18 s to compile
    instead of 8).  Here ``ops`` is :data:`TE_OPS` whose ``sqrt``, ``minimum`` (the clamp of
    ``α``), ``normal_cdfs`` and ``exp`` return fresh variables (``ops.bind(e)`` names any other
    expression ``e`` the same way), and each returned expression is
    wrapped in the ``Let`` bindings it uses.  ``build`` runs once per output, so every output has
    its own variables: TIR requires each variable to be defined once per function, and a
    multi-output compute becomes one block per output.  (The lets are plain values: they
    vectorise, and a loop that is not vectorised evaluates them per element; see
    ``schedules._vectorizable`` for the one case where lets miscompile.)

    ``reuse``: a call of ``sqrt``, ``minimum``, ``exp``, ``erfcx`` or ``normal_cdfs`` on an argument
    structurally equal to an earlier call's (in the same run of ``build``) returns that call's
    variables instead of binding the value again -- so ``build`` may evaluate the same formula twice
    (e.g. :func:`moments.gaussian_terms` inside a moment rule and again for another output) and get
    one ``erf``/``exp`` per element.  Off by default (every other kernel is emitted as before).
    """
    outs = []
    index = 0
    while True:
        bindings: list[tuple[tirx.Var, tirx.PrimExpr]] = []

        def bind(value: tirx.PrimExpr) -> tirx.PrimExpr:  # used within this iteration only
            if _is_leaf(value):
                return value
            var = tirx.Var(f"s{len(bindings)}", value.ty)  # noqa: B023
            bindings.append((var, value))  # noqa: B023
            return var

        ops = SimpleNamespace(**vars(TE_OPS))
        ops.bind = bind  # for callers: name an intermediate result used several times
        ops.sqrt = lambda x: bind(te.sqrt(x))
        ops.minimum = lambda a, b: bind(te.min(a, b))
        ops.exp = lambda x: bind(fast_exp(x, bind))
        ops.erfcx = lambda x: bind(fast_erfcx(x, bind))
        ops.normal_cdfs = lambda alpha: _normal_cdfs(alpha, bind)
        if reuse:
            for name in ("sqrt", "minimum", "exp", "erfcx", "normal_cdfs"):
                setattr(ops, name, _reusing(getattr(ops, name)))
        built = list(build(ops))
        outs.append(_with_lets(built[index], bindings))
        index += 1
        if index == len(built):
            return outs


def _reusing(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` that returns its first result again for arguments structurally equal to earlier ones
    (:func:`te_shared` with ``reuse``; free variables must be the same objects)."""
    calls: list[tuple[list[Any], Any]] = []

    def call(*args: Any) -> Any:
        for earlier, result in calls:
            if tvm_ffi.structural_equal(earlier, list(args)):
                return result
        result = fn(*args)
        calls.append((list(args), result))
        return result

    return call


def _with_lets(expr: tirx.PrimExpr, bindings: list[tuple[tirx.Var, tirx.PrimExpr]]) -> tirx.PrimExpr:
    """``expr`` preceded by the bindings it uses (directly or through other bindings)."""
    needed = set(tirx.analysis.undefined_vars(expr))
    used = []
    for var, value in reversed(bindings):
        if var in needed:
            used.append((var, value))
            needed |= set(tirx.analysis.undefined_vars(value))
    for var, value in used:  # innermost (last bound) first
        expr = tirx.Let(var, value, expr)
    return expr


# A sum over pairs: one reduction computing mean and second component together.
pair_sum = te.comm_reducer(
    lambda a, b: (a[0] + b[0], a[1] + b[1]),
    lambda t0, t1: (tirx.const(0, t0), tirx.const(0, t1)),
    name="pair_sum",
)


@dataclass
class RelaxActivation:
    """A batch of independent Gaussians in the Relax graph: ``second`` is None when deterministic."""

    mean: relax.Expr
    second: relax.Expr | None
    repr: Repr

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

class SchemeStep(Protocol):
    """The kernels of a correlation scheme, emitted layer by layer (:data:`SCHEME_STEPS`)."""

    def emits_mean_field(self, layer: PlannedLayer) -> bool:
        """Whether the step's kernel for ``layer`` also computes its mean-field outputs (then
        :func:`emit_module` emits no mean-field kernel for it and passes ``out=None``)."""
        ...

    def __call__(self, ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation],
                 out: RelaxActivation | None) -> RelaxActivation:
        ...


SCHEME_STEPS: dict[str, Callable[[PlannedGraph], SchemeStep]] = {}
"""``{correlation scheme: step factory}`` for plans that are not mean-field: ``factory(graph)``
returns a :class:`SchemeStep` ``step(ctx, layer, inputs, out) -> out`` which emits the scheme's
kernels after each layer's mean-field kernel and returns the layer's (possibly variance-corrected)
output -- or, where ``step.emits_mean_field(layer)``, instead of it (``out=None``: one kernel computes
both).  ``"shared-factor"``: ``tvm_backend/ops/correlation.py`` (its ReLU kernels compute the
mean-field ReLU moments too, from the op's rule: ``ops.activation.activation_moments``)."""


FUSABLE_PRODUCERS = ("dense", "add")
"""Kernels whose epilogue also computes a following ReLU's moments: dense, and the residual ``add``
(an elementwise pass either way: fused, the block's last ReLU costs no kernel launch and no extra
pass over the tensor pair).  Not conv2d: its
epilogue tile (one output row of a channel block) measured slower with the ReLU in it (LeNet conv1 +
ReLU at batch 10: 206 us fused vs 87 us as two kernels)."""


def fused_activations(graph: PlannedGraph) -> dict[str, PlannedLayer]:
    """``{compute layer name: ReLU layer}`` for every ReLU whose input is a layer of
    :data:`FUSABLE_PRODUCERS` that feeds nothing else (and is not the output), both edges carrying
    variances: the compute kernel's epilogue then evaluates the ReLU moments on its (mean,
    variance) tile while it is in registers -- one kernel launch, one tensor pair and one memory
    pass fewer per ReLU."""
    by_name = {p.name: p for p in graph.layers}
    uses = Counter(name for p in graph.layers for name in p.inputs)
    out = {}
    for p in graph.layers:
        producer = by_name.get(p.inputs[0]) if p.op == "relu" and len(p.inputs) == 1 else None
        if (producer is not None and producer.op in FUSABLE_PRODUCERS and uses[producer.name] == 1
                and producer.name != graph.output and producer.out_repr is Repr.VARIANCE
                and p.in_reprs[0] is Repr.VARIANCE):
            out[producer.name] = p
    return out


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
    if graph.factors is not None:  # shared-factor PFP: its kernels after each layer's (no fusion)
        step = SCHEME_STEPS["shared-factor"](graph)
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
                values[layer.name] = fn(ctx, layer, inputs)
                ctx.activation = None
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
