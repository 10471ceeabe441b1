"""PFP pooling kernels.

Max pooling: Clark's pairwise Gaussian max folded over each window in row-major order (the same
order as the NumPy reference).  The fold is a TE reduction with a tuple ``comm_reducer`` whose
combiner is the Clark max (its shared sub-expressions let-bound, :func:`te_shared`); its identity
``(−FLT_MAX, 0)`` is exact (``max_moments(−FLT_MAX, 0, μ, v) = (μ, v)``: ``fast_exp`` gives exactly
0 for the far tail), the reduction loops run sequentially in row-major order, and window positions
outside the input (padding, ceil-mode overhang) contribute the identity.  (Writing the fold out as
one expression -- even with let-bound partial results -- makes TVM's LLVM code generator, which
substitutes every let value into the next, blow up exponentially in the window size.)

Average pooling: ``μ = Σμ/d``, ``v = Σv/d²`` with torch's divisor per output position.
"""
from __future__ import annotations

import numpy as np
from tvm import te, tirx

from .. import moments
from ..graph import Repr
from ..plan import PlannedLayer
from ..reference.pooling import average_divisor
from ._core import F32, EmitContext, RelaxActivation, activation_out, epilogue, kernel, te_shared

_LOWEST = float(np.finfo(np.float32).min)

gaussian_max = te.comm_reducer(
    lambda a, b: tuple(te_shared(lambda ops: moments.max_moments(a[0], a[1], b[0], b[1], ops))),
    lambda t0, t1: (tirx.const(_LOWEST, t0), tirx.const(0.0, t1)),
    name="gaussian_max",
)
pair_sum = te.comm_reducer(
    lambda a, b: (a[0] + b[0], a[1] + b[1]),
    lambda t0, t1: (tirx.const(0, t0), tirx.const(0, t1)),
    name="pool_sum",
)


class _Windows:
    """Index arithmetic of a pooling layer's windows (with padding / overhang checks when needed)."""

    def __init__(self, layer: PlannedLayer, in_shape: tuple[int, ...]) -> None:
        a = layer.layer.attrs
        self.kernel, self.stride, self.padding = a["kernel"], a["stride"], a["padding"]
        self.in_hw = in_shape[1:]
        self.out_shape = layer.layer.out_shape
        out_hw = self.out_shape[1:]
        self.overhangs = any(p > 0 for p in self.padding) or any(
            (o - 1) * s + k > n for o, s, k, n in zip(out_hw, self.stride, self.kernel, self.in_hw))

    def tiles_exactly(self) -> bool:
        """Whether the windows tile the input without overlap or gaps inside it (kernel ==
        stride, no padding, no overhang; a remainder row/column the floor mode drops is fine)."""
        return not self.overhangs and tuple(self.kernel) == tuple(self.stride)

    def axes(self):
        return te.reduce_axis((0, self.kernel[0]), name="rp"), te.reduce_axis((0, self.kernel[1]), name="rq")

    def load(self, t: te.Tensor, b, c, i, j, rp, rq, outside: float):
        h = i * self.stride[0] - self.padding[0] + rp
        w = j * self.stride[1] - self.padding[1] + rq
        if not self.overhangs:
            return t[b, c, h, w]
        inside = tirx.all(h >= 0, h < self.in_hw[0], w >= 0, w < self.in_hw[1])
        return tirx.if_then_else(inside, t[b, c, h, w], tirx.const(outside, F32))


DEINTERLEAVE = "deinterleave"
"""Name of the copy stage of the non-overlapping Gaussian max pool (blocks ``deinterleave_v0/_v1``)."""
FLAT_PAD = 16
"""The flattened output axis of the non-overlapping Gaussian max pool is padded to a multiple of
this (the widest fp32 SIMD vector, AVX-512), so the reduction runs on whole vectors."""


def _gaussian_max_pool_deinterleaved(win: _Windows, layer: PlannedLayer, m: te.Tensor, v: te.Tensor
                                     ) -> list[te.Tensor]:
    """Clark's max pool for windows that tile the input (kernel == stride, no padding or overhang).

    ``deinterleave`` copies the mean and variance inputs to ``xd[b, rp, rq, p]``, ``p`` the
    flattened output position ``(c, i, j)`` padded to a multiple of :data:`FLAT_PAD` (pad lanes
    hold (0, 0) and are never read back): ``xd[b, rp, rq, (c·OH + i)·OW + j] = x[b, c, i·KH + rp,
    j·KW + rq]``.  The reduction ``max_pool2d[b, p]`` then reads every window tap as a unit-stride
    vector along ``p`` (no per-lane index arithmetic, no gather), folding over ``rp, rq`` in
    row-major order from the exact identity, like the general path; the ``epilogue`` maps ``p``
    back to ``(c, i, j)``.  The copy is cheap next to the ~100 flops of a Clark step.
    """
    (kh, kw), (n_c, oh, ow) = win.kernel, win.out_shape
    plane, flat = oh * ow, n_c * oh * ow
    padded = -(-flat // FLAT_PAD) * FLAT_PAD

    def tap(t: te.Tensor, b, rp, rq, p):
        val = t[b, p // plane, p // ow % oh * kh + rp, p % ow * kw + rq]
        return val if padded == flat else tirx.if_then_else(p < flat, val, tirx.const(0.0, F32))

    xd = te.compute((m.shape[0], kh, kw, padded),
                    lambda b, rp, rq, p: [tap(m, b, rp, rq, p), tap(v, b, rp, rq, p)], name=DEINTERLEAVE)
    rp, rq = win.axes()
    acc = te.compute((m.shape[0], padded),
                     lambda b, p: gaussian_max((xd[0][b, rp, rq, p], xd[1][b, rp, rq, p]), axis=[rp, rq]),
                     name="max_pool2d")
    return te.compute((m.shape[0], n_c, oh, ow), lambda b, c, i, j: epilogue(
        acc[0][b, c * plane + i * ow + j], acc[1][b, c * plane + i * ow + j], layer), name="epilogue")


def _input_shape(ctx: EmitContext, layer: PlannedLayer) -> tuple[int, ...]:
    return ctx.shapes[layer.inputs[0]]


@kernel("max_pool2d")
def max_pool2d(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    x = inputs[0]
    win = _Windows(layer, _input_shape(ctx, layer))

    if x.repr is Repr.DETERMINISTIC:
        def exact(m: te.Tensor) -> te.Tensor:
            rp, rq = win.axes()
            return te.compute((m.shape[0], *win.out_shape),
                              lambda b, c, i, j: te.max(win.load(m, b, c, i, j, rp, rq, _LOWEST), axis=[rp, rq]),
                              name="max_pool2d")

        return activation_out(ctx.emit_te(exact, [x.mean], layer), layer)

    assert x.repr is Repr.VARIANCE, x.repr  # the plan delivers variances to max pooling

    # windows that tile the input, and too few channels to fill a vector by themselves (with
    # a multiple of 16 channels the default schedule vectorises channels: no copy needed)
    if win.tiles_exactly() and win.out_shape[0] % FLAT_PAD != 0:
        return activation_out(ctx.emit_te(lambda m, v: _gaussian_max_pool_deinterleaved(win, layer, m, v),
                                          x.tensors(), layer), layer)

    def fn(m: te.Tensor, v: te.Tensor) -> list[te.Tensor]:
        rp, rq = win.axes()

        def body(b, c, i, j):
            return gaussian_max((win.load(m, b, c, i, j, rp, rq, _LOWEST), win.load(v, b, c, i, j, rp, rq, 0.0)),
                                axis=[rp, rq])

        acc = te.compute((m.shape[0], *win.out_shape), body, name="max_pool2d")
        return te.compute(acc[0].shape, lambda *i: epilogue(acc[0][i], acc[1][i], layer), name="epilogue")

    return activation_out(ctx.emit_te(fn, x.tensors(), layer), layer)


@kernel("avg_pool2d")
def avg_pool2d(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    x = inputs[0]
    in_shape = _input_shape(ctx, layer)
    win = _Windows(layer, in_shape)
    inv = ctx.const(1.0 / average_divisor(layer.layer.attrs, in_shape[1:], layer.layer.out_shape[1:]))

    if x.repr is Repr.DETERMINISTIC:
        def exact(m: te.Tensor, r: te.Tensor) -> te.Tensor:
            rp, rq = win.axes()
            acc = te.compute((m.shape[0], *win.out_shape),
                             lambda b, c, i, j: te.sum(win.load(m, b, c, i, j, rp, rq, 0.0), axis=[rp, rq]),
                             name="avg_pool2d")
            return te.compute(acc.shape, lambda b, c, i, j: acc[b, c, i, j] * r[i, j], name="epilogue")

        return activation_out(ctx.emit_te(exact, [x.mean, inv], layer), layer)

    def fn(m: te.Tensor, v: te.Tensor, r: te.Tensor) -> list[te.Tensor]:
        rp, rq = win.axes()

        def body(b, c, i, j):
            return pair_sum((win.load(m, b, c, i, j, rp, rq, 0.0), win.load(v, b, c, i, j, rp, rq, 0.0)),
                            axis=[rp, rq])

        acc = te.compute((m.shape[0], *win.out_shape), body, name="avg_pool2d")
        return te.compute(acc[0].shape, lambda b, c, i, j: epilogue(
            acc[0][b, c, i, j] * r[i, j], acc[1][b, c, i, j] * r[i, j] * r[i, j], layer), name="epilogue")

    return activation_out(ctx.emit_te(fn, x.tensors() + [inv], layer), layer)
