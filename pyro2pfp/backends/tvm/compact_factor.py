"""The compact factor plan (:mod:`pyro2pfp.correlation.compact`) in the TVM back end.

After each layer's mean-field kernel, :class:`CompactStep` runs the layer's compact factor rule -- the same
formula the float64 reference and the ONNX export run (:data:`~pyro2pfp.planning.registry.COMPACT_EXPORTERS`, through
:func:`~pyro2pfp.correlation.loadings.compact_layer`) -- with :class:`RelaxBackend` as its back end: the rule's
tensor algebra becomes Relax operators (``einsum``, ``nn.conv2d``, ``strided_slice``, elementwise ops), which
the Relax pipeline legalizes into kernels.  Block columns stay block columns ((B, C, P, r) tensors, no zeros);
every width is static, the batch axis symbolic.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import numpy as np
from tvm import relax

from ... import moments
from ...correlation.compact import compact_plan
from ...correlation.loadings import Loadings, compact_layer
from ...planning.graph import INPUT, Repr
from ...planning.plan import PlannedGraph, PlannedLayer
from ...planning.registry import COMPACT_EXPORTERS
from ..onnx.builder import LOWEST32
from .emit import SCHEME_STEPS, EmitContext, RelaxActivation

F32 = "float32"
_INV_SQRT2 = float(1.0 / np.sqrt(2.0))


class RX:
    """A Relax tensor (bound in the dataflow block) with Python operators; scalars become float32 constants."""

    __array_priority__ = 1000  # numpy scalars defer to the reflected operators

    def __init__(self, bb: relax.BlockBuilder, expr: relax.Expr) -> None:
        self.bb = bb
        self.expr = expr

    def wrap(self, other: Any) -> relax.Expr:
        if isinstance(other, RX):
            return other.expr
        if isinstance(other, (int, float, np.floating, np.integer)):
            return relax.const(float(other), F32)
        raise TypeError(f"cannot combine a Relax tensor with {type(other).__name__}")

    def emit(self, expr: relax.Expr) -> RX:
        return RX(self.bb, self.bb.emit(expr))

    def _binary(self, fn: Any, other: Any, swap: bool = False) -> RX:
        a, c = self.expr, self.wrap(other)
        return self.emit(fn(c, a) if swap else fn(a, c))

    def __add__(self, o: Any) -> RX:
        return self._binary(relax.op.add, o)

    def __radd__(self, o: Any) -> RX:
        return self._binary(relax.op.add, o, swap=True)

    def __sub__(self, o: Any) -> RX:
        return self._binary(relax.op.subtract, o)

    def __rsub__(self, o: Any) -> RX:
        return self._binary(relax.op.subtract, o, swap=True)

    def __mul__(self, o: Any) -> RX:
        return self._binary(relax.op.multiply, o)

    def __rmul__(self, o: Any) -> RX:
        return self._binary(relax.op.multiply, o, swap=True)

    def __truediv__(self, o: Any) -> RX:
        return self._binary(relax.op.divide, o)

    def __rtruediv__(self, o: Any) -> RX:
        return self._binary(relax.op.divide, o, swap=True)

    def __neg__(self) -> RX:
        return self.emit(relax.op.negative(self.expr))

    def __gt__(self, o: Any) -> RX:
        return self._binary(relax.op.greater, o)

    def __lt__(self, o: Any) -> RX:
        return self._binary(relax.op.less, o)

    def __le__(self, o: Any) -> RX:
        return self._binary(relax.op.less_equal, o)

    def __pow__(self, p: int) -> RX:
        if p != 2:
            raise ValueError("only squares are needed")
        return self * self


@dataclasses.dataclass
class _Input:
    """A layer input as the rules read it (``mean``, and the variance through :meth:`RelaxBackend.variance`)."""

    mean: RX
    second: RX | None
    repr: Repr


class RelaxBackend:
    """The tensor algebra of the compact factor rules on Relax tensors (``backends.reference.NumpyBackend`` and
    ``backends.onnx.builder.OnnxContext`` have the same members; every shape is per sample, the batch axis first)."""

    lowest = LOWEST32

    def __init__(self, ctx: EmitContext) -> None:
        self.bb = ctx.bb
        bb = self.bb

        def rx(e: Any) -> RX:
            return e if isinstance(e, RX) else RX(bb, relax.const(float(e), F32))

        def where(c: Any, a: Any, b: Any) -> RX:
            return rx(c).emit(relax.op.where(rx(c).expr, rx(a).expr, rx(b).expr))

        def unary(fn: Any) -> Any:
            return lambda x: rx(x).emit(fn(rx(x).expr))

        def binary(fn: Any) -> Any:
            return lambda x, y: rx(x).emit(fn(rx(x).expr, rx(y).expr))

        def normal_cdfs(alpha: RX) -> tuple[RX, RX]:
            """(Φ(α), Φ(−α)) from one erf, as the TE kernels compute them."""
            half_erf = unary(relax.op.erf)(alpha * _INV_SQRT2) * 0.5
            return 0.5 + half_erf, 0.5 - half_erf

        ns = SimpleNamespace(
            where=where, normal_cdfs=normal_cdfs, erf=unary(relax.op.erf),
            erfc=lambda x: 1.0 - unary(relax.op.erf)(x), exp=unary(relax.op.exp), sqrt=unary(relax.op.sqrt),
            maximum=binary(relax.op.maximum), minimum=binary(relax.op.minimum),
            const=lambda v: RX(bb, relax.const(float(v), F32)))
        ns.erfcx = lambda x: moments.erfcx_rational(x, ns)
        self.ops = ns

    def wrap(self, e: relax.Expr) -> RX:
        return RX(self.bb, e)

    def emit(self, e: relax.Expr) -> RX:
        return RX(self.bb, self.bb.emit(e))

    def variance(self, x: _Input) -> RX | None:
        if x.repr is Repr.DETERMINISTIC or x.second is None:
            return None
        if x.repr is Repr.VARIANCE:
            return x.second
        return self.ops.maximum(x.second - x.mean * x.mean, self.ops.const(0.0))

    def tensor(self, array: np.ndarray, hint: str) -> RX:
        return self.wrap(relax.const(np.ascontiguousarray(array, dtype=np.float32)))

    def dense(self, x: RX, weight: np.ndarray, hint: str) -> RX:
        """``x @ weight.T`` (weight in torch layout (out, in))."""
        return self.emit(relax.op.matmul(x.expr, relax.const(np.ascontiguousarray(weight.T, dtype=np.float32))))

    def conv2d(self, x: RX, weight: np.ndarray, attrs: dict, hint: str) -> RX:
        ph, pw = attrs["padding"]
        return self.emit(relax.op.nn.conv2d(x.expr, relax.const(np.ascontiguousarray(weight, dtype=np.float32)),
                                            strides=list(attrs["stride"]), padding=[ph, pw, ph, pw],
                                            dilation=list(attrs["dilation"]), groups=int(attrs.get("groups", 1))))

    def reshape(self, t: RX, shape: tuple[int, ...]) -> RX:
        """``t`` reshaped to ``(batch, *shape)``."""
        return self.rows(t, shape)

    def rows(self, t: RX, shape: tuple[int, ...]) -> RX:
        """``t`` reshaped to ``(-1, *shape)``."""
        return self.emit(relax.op.reshape(t.expr, (-1, *shape)))

    def concat(self, ts: list[RX], axis: int) -> RX:
        """``ts`` joined along per-sample axis ``axis``."""
        return ts[0] if len(ts) == 1 else self.emit(relax.op.concat([t.expr for t in ts], axis=axis + 1))

    def einsum(self, equation: str, *ts: RX) -> RX:
        return self.emit(relax.op.einsum([t.expr for t in ts], equation))

    def permute(self, t: RX, perm: tuple[int, ...]) -> RX:
        return self.emit(relax.op.permute_dims(t.expr, list(perm)))

    def rsum(self, t: RX, axis: int) -> RX:
        return self.emit(relax.op.sum(t.expr, axis=[axis], keepdims=False))

    def slice(self, t: RX, axis: int, start: int, stop: int) -> RX:
        return self.emit(relax.op.strided_slice(t.expr, axes=[axis], begin=[start], end=[stop]))

    def taps(self, t: RX, kernel: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int],
             begin: tuple[int, int], end: tuple[int, int], out_hw: tuple[int, int], fill: float) -> list[RX]:
        """The strided (B, C, OH, OW) view of ``t`` (B, C, H, W) at every kernel offset (row-major), ``t``
        padded by ``begin``/``end`` rows and columns of ``fill`` first."""
        if any(begin) or any(end):
            t = self.emit(relax.op.nn.pad(t.expr, [0, 0, 0, 0, begin[0], end[0], begin[1], end[1]],
                                          pad_value=float(fill)))
        out = []
        for i in range(kernel[0]):
            for j in range(kernel[1]):
                r0, c0 = i * dilation[0], j * dilation[1]
                ends = [r0 + stride[0] * (out_hw[0] - 1) + 1, c0 + stride[1] * (out_hw[1] - 1) + 1]
                out.append(self.emit(relax.op.strided_slice(t.expr, axes=[2, 3], begin=[r0, c0], end=ends,
                                                            strides=list(stride))))
        return out

    def zeros_like(self, t: RX) -> RX:
        return self.emit(relax.op.zeros_like(t.expr))


class CompactStep:
    """The compact factor plan's step of :func:`~.emit.emit_module` (``SCHEME_STEPS["compact-factor"]``): after
    each layer's mean-field kernel, the layer's rule on Relax tensors; keeps each edge's loadings."""

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
        bk = RelaxBackend(ctx)

        def wrapped(a: RelaxActivation) -> _Input:
            return _Input(bk.wrap(a.mean), None if a.second is None else bk.wrap(a.second), a.repr)

        ins = [wrapped(a) for a in inputs]
        own = wrapped(out)
        var = bk.variance(own)
        ld, mean, new_var = compact_layer(bk, COMPACT_EXPORTERS, layer, ins, loads, self.plan, own.mean, var)
        self.loads[layer.name] = ld
        if new_var is var and mean is own.mean:
            return out
        if layer.out_repr is Repr.VARIANCE:
            return RelaxActivation(mean.expr, new_var.expr, Repr.VARIANCE)
        if layer.out_repr is Repr.SECOND_MOMENT:
            return RelaxActivation(mean.expr, (new_var + mean * mean).expr, Repr.SECOND_MOMENT)
        return RelaxActivation(mean.expr, None, Repr.DETERMINISTIC)


SCHEME_STEPS["compact-factor"] = CompactStep
