"""Elementwise PFP kernels: ReLU/LeakyReLU moment matching, batch-norm affine, residual add and
representation conversions."""
from __future__ import annotations

from typing import Any

from tvm import te, tirx

from .. import moments
from ..graph import Repr
from ..plan import PlannedLayer
from ._core import F32, TE_OPS, EmitContext, RelaxActivation, activation_out, epilogue, kernel, te_shared


def variance_of(mean, second, repr_: Repr):
    """TE expression of the variance of an input element given in ``repr_``."""
    if repr_ is Repr.SECOND_MOMENT:
        return moments.second_to_variance(mean, second, TE_OPS)
    return second


def _activation(ctx: EmitContext, layer: PlannedLayer, x: RelaxActivation, deterministic, matched
                ) -> RelaxActivation:
    """An elementwise activation: ``deterministic(μ)`` for exact inputs, else the moment-matched
    ``matched(μ, v, ops) -> (μ', v')``, emitted in the representation the plan asks for (with its
    shared sub-expressions computed once, :func:`te_shared`)."""
    if x.repr is Repr.DETERMINISTIC:
        def exact(m: te.Tensor) -> te.Tensor:
            return te.compute(m.shape, lambda *i: deterministic(m[i]), name=layer.op)

        return activation_out(ctx.emit_te(exact, [x.mean], layer), layer)

    def fn(m: te.Tensor, s: te.Tensor) -> list[te.Tensor]:
        def moments_at(i: tuple, ops: Any) -> list[Any]:
            mean, var = matched(m[i], variance_of(m[i], s[i], x.repr), ops)
            return epilogue(mean, var, layer)

        return te.compute(m.shape, lambda *i: te_shared(lambda ops: moments_at(i, ops)), name=layer.op)

    return activation_out(ctx.emit_te(fn, x.tensors(), layer), layer)


@kernel("relu")
def relu(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    return _activation(ctx, layer, inputs[0], lambda m: te.max(m, tirx.const(0.0, F32)),
                       lambda m, v, ops: moments.relu_moments(m, v, ops))


@kernel("convert")
def convert(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    x = inputs[0]

    def fn(m: te.Tensor, s: te.Tensor) -> list[te.Tensor]:
        return te.compute(m.shape, lambda *i: epilogue(m[i], variance_of(m[i], s[i], x.repr), layer),
                          name="convert")

    return activation_out(ctx.emit_te(fn, x.tensors(), layer), layer)


@kernel("leaky_relu")
def leaky_relu(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    slope = layer.layer.attrs["slope"]
    zero, s = tirx.const(0.0, F32), tirx.const(slope, F32)
    return _activation(ctx, layer, inputs[0], lambda m: tirx.Select(m > zero, m, s * m),
                       lambda m, v, ops: moments.leaky_relu_moments(m, v, slope, ops))


@kernel("affine")
def affine(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    """Per-channel ``μ ↦ a·μ + c``, ``v ↦ a²·v`` (channel axis 1)."""
    x = inputs[0]
    consts = [ctx.const(layer.tensors["scale"]), ctx.const(layer.tensors["shift"])]
    if x.repr is Repr.DETERMINISTIC:
        def det(m: te.Tensor, a: te.Tensor, c: te.Tensor) -> te.Tensor:
            return te.compute(m.shape, lambda *i: m[i] * a[i[1]] + c[i[1]], name="affine")

        return activation_out(ctx.emit_te(det, [x.mean] + consts, layer), layer)

    def fn(m: te.Tensor, s: te.Tensor, a: te.Tensor, c: te.Tensor) -> list[te.Tensor]:
        def f(*i):
            scale = a[i[1]]
            return epilogue(m[i] * scale + c[i[1]], variance_of(m[i], s[i], x.repr) * scale * scale, layer)

        return te.compute(m.shape, f, name="affine")

    return activation_out(ctx.emit_te(fn, x.tensors() + consts, layer), layer)


@kernel("add")
def add(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    """Sum of two independent Gaussians: means and variances add."""
    a, b = inputs
    if a.repr is Repr.DETERMINISTIC and b.repr is Repr.DETERMINISTIC:
        def det(x: te.Tensor, y: te.Tensor) -> te.Tensor:
            return te.compute(x.shape, lambda *i: x[i] + y[i], name="add")

        return activation_out(ctx.emit_te(det, [a.mean, b.mean], layer), layer)
    n_a = len(a.tensors())

    def fn(*t: te.Tensor) -> list[te.Tensor]:
        ta, tb = t[:n_a], t[n_a:]

        def var(ts, r, i):
            return variance_of(ts[0][i], ts[1][i], r) if len(ts) > 1 else tirx.const(0.0, F32)

        return te.compute(t[0].shape, lambda *i: epilogue(ta[0][i] + tb[0][i], var(ta, a.repr, i) + var(tb, b.repr, i),
                                                           layer), name="add")

    return activation_out(ctx.emit_te(fn, a.tensors() + b.tensors(), layer), layer)
