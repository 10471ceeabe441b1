"""The compact factor plan (:mod:`pyro2pfp.correlation.compact`) in the TVM back end.

After each layer's mean-field kernel, :class:`CompactStep` runs the layer's compact factor rule -- the same
formula the float64 reference and the ONNX export run (:data:`~pyro2pfp.planning.registry.COMPACT_EXPORTERS`, through
:func:`~pyro2pfp.correlation.loadings.compact_layer`) -- with :class:`TeBackend` as its back end: the rule's
tensor algebra becomes TE computations (TVM's ``topi``: ``einsum``, ``conv2d_nchw``, ``strided_slice``,
elementwise ops) over the layer's input tensors, and the whole rule is **one kernel** (op ``compact``) with the
default schedule of :func:`~.schedules.fused.schedule_fused` (data movement inlined, reductions accumulating in
vector registers over their contiguous outputs, large nests parallel).  Block columns stay block columns
((B, C, P, r) tensors, no zeros); every width is static, the batch axis symbolic.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import numpy as np
from tvm import relax, te, tirx, topi
from tvm.sym import Analyzer

from ... import moments
from ...correlation.compact import compact_plan
from ...correlation.loadings import Loadings, compact_layer
from ...planning.graph import INPUT, Repr
from ...planning.plan import PlannedGraph, PlannedLayer
from ...planning.registry import COMPACT_EXPORTERS
from ..onnx.builder import LOWEST32
from .emit import LAYER_ATTR, OP_ATTR, SCHEME_STEPS, EmitContext, RelaxActivation
from .fast_math import fast_erf, fast_exp
from .schedules import schedule
from .schedules.fused import schedule_fused

F32 = "float32"
#: the op attribute of a compact rule's kernel (:meth:`CompactStep.__call__`)
COMPACT_OP = "compact"
_INV_SQRT2 = float(1.0 / np.sqrt(2.0))


def _value(x: Any) -> Any:
    """A TE tensor or a float32 scalar expression of ``x`` (a :class:`TT` or a number)."""
    if isinstance(x, TT):
        return x.t
    if isinstance(x, (int, float, np.floating, np.integer)):
        return tirx.const(float(x), F32)
    raise TypeError(f"cannot combine a TE tensor with {type(x).__name__}")


class TT:
    """A TE tensor (or a scalar expression) with Python operators; numbers become float32 immediates."""

    __array_priority__ = 1000  # numpy scalars defer to the reflected operators

    def __init__(self, t: Any) -> None:
        self.t = t

    def _binary(self, fn: Any, other: Any, swap: bool = False) -> TT:
        a, c = self.t, _value(other)
        return TT(fn(c, a) if swap else fn(a, c))

    def __add__(self, o: Any) -> TT:
        return self._binary(topi.add, o)

    def __radd__(self, o: Any) -> TT:
        return self._binary(topi.add, o, swap=True)

    def __sub__(self, o: Any) -> TT:
        return self._binary(topi.subtract, o)

    def __rsub__(self, o: Any) -> TT:
        return self._binary(topi.subtract, o, swap=True)

    def __mul__(self, o: Any) -> TT:
        return self._binary(topi.multiply, o)

    def __rmul__(self, o: Any) -> TT:
        return self._binary(topi.multiply, o, swap=True)

    def __truediv__(self, o: Any) -> TT:
        return self._binary(topi.divide, o)

    def __rtruediv__(self, o: Any) -> TT:
        return self._binary(topi.divide, o, swap=True)

    def __neg__(self) -> TT:
        return TT(topi.negative(self.t)) if isinstance(self.t, te.Tensor) else TT(-self.t)

    def __gt__(self, o: Any) -> TT:
        return self._binary(topi.greater, o)

    def __lt__(self, o: Any) -> TT:
        return self._binary(topi.less, o)

    def __le__(self, o: Any) -> TT:
        return self._binary(topi.less_equal, o)

    def __pow__(self, p: int) -> TT:
        if p != 2:
            raise ValueError("only squares are needed")
        return self * self


@dataclasses.dataclass
class _Input:
    """A layer input as the rules read it (``mean``, and the variance through :meth:`TeBackend.variance`)."""

    mean: TT
    second: TT | None
    repr: Repr


class TeBackend:
    """The tensor algebra of the compact factor rules on TE tensors (``backends.reference.NumpyBackend`` and
    ``backends.onnx.builder.OnnxContext`` have the same members; every shape is per sample, the batch axis first).

    ``constant(array)``: a constant array's tensor (:meth:`CompactStep.__call__` makes it a kernel argument)."""

    lowest = LOWEST32

    def __init__(self, constant: Any) -> None:
        self.constant = constant

        def where(c: Any, a: Any, b: Any) -> TT:
            cond = _value(c)
            shape = cond.shape if isinstance(cond, te.Tensor) else None
            a, b = (_value(v) for v in (a, b))
            if shape is not None:  # topi.where takes tensors: a number becomes a (constant) one
                a, b = (v if isinstance(v, te.Tensor) else topi.full(shape, F32, v) for v in (a, b))
            return TT(topi.where(cond, a, b) if shape is not None else tirx.Select(cond, a, b))

        def unary(fn: Any, scalar: Any) -> Any:
            def apply(x: Any) -> TT:
                v = _value(x)
                return TT(fn(v) if isinstance(v, te.Tensor) else scalar(v))
            return apply

        def binary(fn: Any) -> Any:
            return lambda x, y: TT(fn(_value(x), _value(y)))

        def elementwise(fn: Any) -> Any:
            """``fn`` (a scalar TE expression builder) applied elementwise to a tensor."""
            return lambda t: te.compute(t.shape, lambda *i: fn(t(*i)), name="rule_math", tag="elementwise")

        # erf and exp as plain float32 arithmetic (fast_math: no libm call, so the nests vectorise)
        erf = unary(elementwise(fast_erf), fast_erf)

        def normal_cdfs(alpha: TT) -> tuple[TT, TT]:
            """(Φ(α), Φ(−α)) from one erf, as the TE kernels compute them."""
            half_erf = erf(alpha * _INV_SQRT2) * 0.5
            return 0.5 + half_erf, 0.5 - half_erf

        ns = SimpleNamespace(
            where=where, normal_cdfs=normal_cdfs, erf=erf, erfc=lambda x: 1.0 - erf(x),
            exp=unary(elementwise(fast_exp), fast_exp), sqrt=unary(topi.sqrt, tirx.sqrt),
            maximum=binary(topi.maximum), minimum=binary(topi.minimum),
            const=lambda v: TT(tirx.const(float(v), F32)))
        ns.erfcx = lambda x: moments.erfcx_rational(x, ns)
        self.ops = ns

    def variance(self, x: _Input) -> TT | None:
        if x.repr is Repr.DETERMINISTIC or x.second is None:
            return None
        if x.repr is Repr.VARIANCE:
            return x.second
        return self.ops.maximum(x.second - x.mean * x.mean, self.ops.const(0.0))

    def tensor(self, array: np.ndarray, hint: str) -> TT:
        return self.constant(np.ascontiguousarray(array, dtype=np.float32), hint)

    def dense(self, x: TT, weight: np.ndarray, hint: str) -> TT:
        """``x @ weight.T`` (weight in torch layout (out, in)); ``x`` (B, in)."""
        return TT(topi.nn.dense(x.t, self.tensor(weight, hint).t))

    def conv2d(self, x: TT, weight: np.ndarray, attrs: dict, hint: str) -> TT:
        ph, pw = attrs["padding"]
        groups = int(attrs.get("groups", 1))
        w = self.tensor(weight, hint).t
        args = (list(attrs["stride"]), [ph, pw, ph, pw], list(attrs["dilation"]))
        return TT(topi.nn.conv2d_nchw(x.t, w, *args) if groups == 1 else topi.nn.group_conv2d_nchw(x.t, w, *args,
                                                                                                     groups))

    def reshape(self, t: TT, shape: tuple[int, ...]) -> TT:
        """``t`` reshaped to ``(batch, *shape)``."""
        return self.rows(t, shape)

    def rows(self, t: TT, shape: tuple[int, ...]) -> TT:
        """``t`` reshaped to ``(-1, *shape)`` (:func:`reshape_rows`)."""
        return TT(reshape_rows(t.t, tuple(int(n) for n in shape)))

    def concat(self, ts: list[TT], axis: int) -> TT:
        """``ts`` joined along per-sample axis ``axis``."""
        return ts[0] if len(ts) == 1 else TT(topi.concatenate([t.t for t in ts], axis + 1))

    def einsum(self, equation: str, *ts: TT) -> TT:
        return TT(topi.einsum(equation, *[t.t for t in ts]))

    def permute(self, t: TT, perm: tuple[int, ...]) -> TT:
        return TT(topi.transpose(t.t, list(perm)))

    def rsum(self, t: TT, axis: int) -> TT:
        return TT(topi.sum(t.t, axis=[axis], keepdims=False))

    def slice(self, t: TT, axis: int, start: int, stop: int) -> TT:
        return TT(topi.strided_slice(t.t, [start], [stop], [1], axes=[axis]))

    def taps(self, t: TT, kernel: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int],
             begin: tuple[int, int], end: tuple[int, int], out_hw: tuple[int, int], fill: float) -> list[TT]:
        """The strided (B, C, OH, OW) view of ``t`` (B, C, H, W) at every kernel offset (row-major), ``t``
        padded by ``begin``/``end`` rows and columns of ``fill`` first."""
        x = t.t
        if any(begin) or any(end):
            x = topi.nn.pad(x, [0, 0, begin[0], begin[1]], [0, 0, end[0], end[1]], pad_value=float(fill))
        out = []
        for i in range(kernel[0]):
            for j in range(kernel[1]):
                r0, c0 = i * dilation[0], j * dilation[1]
                ends = [r0 + stride[0] * (out_hw[0] - 1) + 1, c0 + stride[1] * (out_hw[1] - 1) + 1]
                out.append(TT(topi.strided_slice(x, [r0, c0], ends, list(stride), axes=[2, 3])))
        return out

    def unfold(self, t: TT, channels: int, kernel: tuple[int, int], stride: tuple[int, int],
               dilation: tuple[int, int], begin: tuple[int, int], end: tuple[int, int], out_hw: tuple[int, int],
               fill: float) -> TT:
        """``(B, C·KH·KW, OH·OW)``: the views of :meth:`taps` as rows, channel-major (row ``c·KH·KW + tap``),
        as one copy that reads ``t`` at each row's tap (not a concatenation of the views, whose reads
        would go through a chain of selects, one per tap)."""
        x = t.t
        if any(begin) or any(end):
            x = topi.nn.pad(x, [0, 0, begin[0], begin[1]], [0, 0, end[0], end[1]], pad_value=float(fill))
        kh, kw = kernel
        ow = out_hw[1]

        def at(b: Any, d: Any, q: Any) -> Any:
            c, tap = tirx.floordiv(d, kh * kw), tirx.floormod(d, kh * kw)
            return x[b, c, tirx.floordiv(tap, kw) * dilation[0] + tirx.floordiv(q, ow) * stride[0],
                     tirx.floormod(tap, kw) * dilation[1] + tirx.floormod(q, ow) * stride[1]]

        return TT(te.compute((x.shape[0], *_i64((channels * kh * kw, out_hw[0] * ow))), at, name="rule_unfold",
                             tag="injective"))

    def zeros_like(self, t: TT) -> TT:
        return TT(topi.full_like(t.t, 0.0))


def _i64(shape: Any) -> list[Any]:
    """Static extents as int64 immediates, like the Relax shapes (a kernel whose buffers mix int32 and int64
    extents cannot be specialised to a static batch)."""
    return [tirx.IntImm("int64", int(n)) if isinstance(n, (int, np.integer)) else n for n in shape]


def _ravel(index: list[Any], shape: tuple[int, ...]) -> Any:
    flat: Any = 0
    for i, n in zip(index, shape):
        flat = flat * n + i
    return flat


def _unravel(flat: Any, shape: tuple[int, ...]) -> list[Any]:
    """The index into ``shape`` of ``flat`` (< its size): the outermost axis without a modulo."""
    out: list[Any] = []
    for k in range(len(shape) - 1, 0, -1):
        out.append(tirx.floormod(flat, shape[k]) if shape[k] != 1 else 0)
        flat = tirx.floordiv(flat, shape[k]) if shape[k] != 1 else flat
    out.append(flat)
    return list(reversed(out))


def reshape_rows(x: te.Tensor, shape: tuple[int, ...]) -> te.Tensor:
    """``x`` (N, *static) reshaped to ``(M, *shape)`` (row-major, ``M`` from the sizes), its indices computed
    with static divisors only: the leading (batch) axis is never unravelled (``topi.reshape`` divides by the
    symbolic extent, which makes every kernel that inlines a reshape slower to schedule and compile)."""
    rest = tuple(int(n) for n in x.shape[1:])
    s_in, s_out = int(np.prod(rest)), int(np.prod(shape))
    if s_out >= s_in:
        assert s_out % s_in == 0, (rest, shape)
        lead = tirx.floordiv(x.shape[0], s_out // s_in) if s_out != s_in else x.shape[0]
    else:
        assert s_in % s_out == 0, (rest, shape)
        lead = x.shape[0] * (s_in // s_out)
    lead = Analyzer().simplify(lead)  # (B·k)/k: B again -- a kernel's outputs have the batch as their first axis

    def at(j: Any, *i: Any) -> Any:
        r = _ravel(list(i), shape)
        if s_out == s_in:
            row, rem = j, r
        elif s_out > s_in:
            m = s_out // s_in
            row, rem = j * m + tirx.floordiv(r, s_in), tirx.floormod(r, s_in)
        else:
            m = s_in // s_out
            row, rem = tirx.floordiv(j, m), tirx.floormod(j, m) * s_out + r
        return x[(row, *_unravel(rem, rest))]

    return te.compute((lead, *_i64(shape)), at, name="rule_reshape", tag="injective")


class CompactStep:
    """The compact factor plan's step of :func:`~.emit.emit_module` (``SCHEME_STEPS["compact-factor"]``): after
    each layer's mean-field kernel, the layer's rule as one kernel; keeps each edge's loadings."""

    def __init__(self, graph: PlannedGraph) -> None:
        self.plan = compact_plan(graph)
        self.loads: dict[str, Loadings | None] = {INPUT: None}

    def emits_mean_field(self, layer: PlannedLayer) -> bool:
        return False

    def needs_weight_noise(self, layer: PlannedLayer) -> bool:
        return False

    def __call__(self, ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation],
                 out: RelaxActivation | None) -> RelaxActivation:
        assert out is not None
        loads = [self.loads[n] for n in layer.inputs]
        creates = layer.name in self.plan.directions or layer.name in self.plan.residual
        if all(ld is None for ld in loads) and not creates:
            self.loads[layer.name] = None
            return out
        # the kernel's arguments: the Relax tensors it reads (a placeholder each) and its constant arrays
        args: list[relax.Expr] = []
        holders: list[te.Tensor] = []
        by_expr: dict[int, TT] = {}

        def param(e: relax.Expr) -> TT:
            if id(e) not in by_expr:
                shape = list(e.ty.shape.values)
                holders.append(te.placeholder(shape, F32, f"in{len(holders)}"))
                args.append(e)
                by_expr[id(e)] = TT(holders[-1])
            return by_expr[id(e)]

        def constant(array: np.ndarray, hint: str) -> TT:
            holders.append(te.placeholder(_i64(array.shape), F32, hint))
            args.append(relax.const(array))
            return TT(holders[-1])

        def as_param(a: RelaxActivation) -> _Input:
            return _Input(param(a.mean), None if a.second is None else param(a.second), a.repr)

        def loads_as_params(ld: Loadings | None) -> Loadings | None:
            if ld is None:
                return None
            return Loadings({k: param(v) for k, v in ld.glob.items()}, {k: param(v) for k, v in ld.block.items()},
                            dict(ld.glob_width), dict(ld.block_shape))

        ins = [as_param(a) for a in inputs]
        own = as_param(out)
        bk = TeBackend(constant)
        var = bk.variance(own)
        ld, mean, new_var = compact_layer(bk, COMPACT_EXPORTERS, layer, ins, [loads_as_params(x) for x in loads],
                                          self.plan, own.mean, var)
        if layer.out_repr is Repr.SECOND_MOMENT:
            second = None if new_var is var and mean is own.mean else new_var + mean * mean
        elif layer.out_repr is Repr.VARIANCE:
            second = None if new_var is var else new_var
        else:
            second = None
        results: list[TT] = [mean, *([] if second is None else [second])]
        if ld is not None:
            results += [*ld.glob.values(), *ld.block.values()]
        # what the kernel computes: each tensor once, not one of its arguments
        main_of: dict[int, relax.Expr] = {id(t): e for t, e in zip(holders, args)}
        computed: list[te.Tensor] = []
        for r in results:
            if id(r.t) not in main_of and all(r.t is not c for c in computed):
                computed.append(r.t)
        if computed:
            func = te.create_prim_func([*holders, *computed]).without_attr("global_symbol").with_attrs(
                {OP_ATTR: COMPACT_OP, LAYER_ATTR: layer.name})
            gv = ctx.bb.add_func(func, f"compact_{layer.name}")
            ctx.announce(gv)
            call = relax.call_tir(gv, args, [relax.TensorType(list(c.shape), F32) for c in computed])
            main_of.update(zip([id(c) for c in computed], ctx.emit_outputs(call)))

        def main(r: TT) -> relax.Expr:
            return main_of[id(r.t)]

        if ld is not None:
            ld = Loadings({k: main(v) for k, v in ld.glob.items()}, {k: main(v) for k, v in ld.block.items()},
                          dict(ld.glob_width), dict(ld.block_shape))
        self.loads[layer.name] = ld
        if layer.out_repr is Repr.DETERMINISTIC:
            return RelaxActivation(main(mean), None, Repr.DETERMINISTIC)
        return RelaxActivation(main(mean), out.second if second is None else main(second), layer.out_repr)


SCHEME_STEPS["compact-factor"] = CompactStep
schedule(COMPACT_OP)(schedule_fused)
