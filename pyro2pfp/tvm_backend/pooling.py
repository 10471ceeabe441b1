"""PFP max pooling: Clark's pairwise Gaussian max folded over each window in row-major order
(the same order as the NumPy reference).

The fold is a TE reduction with a tuple ``comm_reducer`` whose combiner is the Clark max; its
identity ``(−FLT_MAX, 0)`` is exact (``max_moments(−FLT_MAX, 0, μ, v) = (μ, v)`` bit for bit), and
the reduction loops run sequentially in row-major order.  (Writing the fold out as nested
expressions would duplicate sub-expressions exponentially in the window size.)
"""
from __future__ import annotations

import numpy as np
from tvm import te, tirx

from .. import moments
from ..graph import Repr
from ..plan import PlannedLayer
from ._core import TE_OPS, EmitContext, RelaxActivation, activation_out, epilogue, kernel

_LOWEST = float(np.finfo(np.float32).min)

gaussian_max = te.comm_reducer(
    lambda a, b: moments.max_moments(a[0], a[1], b[0], b[1], TE_OPS),
    lambda t0, t1: (tirx.const(_LOWEST, t0), tirx.const(0.0, t1)),
    name="gaussian_max",
)


@kernel("max_pool2d")
def max_pool2d(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    x = inputs[0]
    a = layer.layer.attrs
    (kh, kw), (sh, sw) = a["kernel"], a["stride"]
    c, oh, ow = layer.layer.out_shape

    def axes():
        return te.reduce_axis((0, kh), name="rp"), te.reduce_axis((0, kw), name="rq")

    if x.repr is Repr.DETERMINISTIC:
        def fn(m: te.Tensor) -> te.Tensor:
            rp, rq = axes()
            return te.compute((m.shape[0], c, oh, ow),
                              lambda b, ch, i, j: te.max(m[b, ch, i * sh + rp, j * sw + rq], axis=[rp, rq]),
                              name="max_pool2d")

        return activation_out(ctx.emit_te(fn, [x.mean], layer), layer)

    assert x.repr is Repr.VARIANCE, x.repr  # the plan delivers variances to max pooling

    def fn(m: te.Tensor, v: te.Tensor) -> list[te.Tensor]:
        rp, rq = axes()

        def body(b, ch, i, j):
            pos = (b, ch, i * sh + rp, j * sw + rq)
            return gaussian_max((m[pos], v[pos]), axis=[rp, rq])

        acc = te.compute((m.shape[0], c, oh, ow), body, name="max_pool2d")
        return te.compute(acc[0].shape, lambda *i: epilogue(acc[0][i], acc[1][i], layer), name="epilogue")

    return activation_out(ctx.emit_te(fn, x.tensors(), layer), layer)



