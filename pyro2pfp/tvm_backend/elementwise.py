"""Elementwise PFP kernels: ReLU moment matching and representation conversions."""
from __future__ import annotations

from tvm import te, tirx

from .. import moments
from ..graph import Repr
from ..plan import PlannedLayer
from ._core import F32, TE_OPS, EmitContext, RelaxActivation, activation_out, epilogue, kernel


def variance_of(mean, second, repr_: Repr):
    """TE expression of the variance of an input element given in ``repr_``."""
    if repr_ is Repr.SECOND_MOMENT:
        return moments.second_to_variance(mean, second, TE_OPS)
    return second


@kernel("relu")
def relu(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    x = inputs[0]
    if x.repr is Repr.DETERMINISTIC:
        fn = lambda m: te.compute(m.shape, lambda *i: te.max(m[i], tirx.const(0.0, F32)), name="relu")
        return activation_out(ctx.emit_te(fn, [x.mean], layer), layer)

    def fn(m: te.Tensor, s: te.Tensor) -> list[te.Tensor]:
        def f(*i):
            mean, var = moments.relu_moments(m[i], variance_of(m[i], s[i], x.repr), TE_OPS)
            return epilogue(mean, var, layer)

        return te.compute(m.shape, f, name="relu")

    return activation_out(ctx.emit_te(fn, x.tensors(), layer), layer)


@kernel("convert")
def convert(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    x = inputs[0]

    def fn(m: te.Tensor, s: te.Tensor) -> list[te.Tensor]:
        return te.compute(m.shape, lambda *i: epilogue(m[i], variance_of(m[i], s[i], x.repr), layer),
                          name="convert")

    return activation_out(ctx.emit_te(fn, x.tensors(), layer), layer)
