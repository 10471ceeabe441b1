"""PFP pooling kernels and their default CPU schedules.  (The op definitions, converters, reference and
ONNX export: ``pyro2pfp/ops/pooling.py``.)

Max pooling: Clark's pairwise Gaussian max folded over each window in row-major order (the same
order as the NumPy reference).  Windows that tile the input (kernel == stride, no padding or
overhang: LeNet's pools) fold ``K − 1`` Clark steps starting from the first tap, one ``te.compute``
stage per step (:func:`clark_chain`; the schedule computes the stages at one loop nest, in small
``local`` buffers).  Other windows: the fold is a TE reduction with a tuple ``comm_reducer`` whose
combiner is the Clark max (its shared sub-expressions let-bound, :func:`te_shared`); its identity
``(−FLT_MAX, 0)`` is exact (``max_moments(−FLT_MAX, 0, μ, v) = (μ, v)``: ``fast_exp`` gives exactly
0 for the far tail), the reduction loops run sequentially in row-major order, and window positions
outside the input (padding, ceil-mode overhang) contribute the identity.  (Writing the fold out as
one expression -- even with let-bound partial results -- makes TVM's LLVM code generator, which
substitutes every let value into the next, blow up exponentially in the window size; separate
stages do not, since each stage's value is stored before the next reads it.)

Average pooling: ``μ = Σμ/d``, ``v = Σv/d²`` with torch's divisor per output position.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import tvm
from tvm import s_tir, te, tirx

from .... import moments
from ....planning.graph import Repr
from ....planning.plan import PlannedLayer
from ...reference.arrays import average_divisor
from ..emit import EmitContext, RelaxActivation, activation_out, epilogue, kernel
from ..fast_math import F32
from ..schedules import (
    divisor_at_most,
    epilogue_at,
    extent,
    flat_nests,
    has_block,
    pow2_divisor,
    schedule,
    simd_lanes,
    stage_inputs,
    static_extent,
    vectorizable,
)
from ..te_let import te_shared
from .compute import CONV_MAX_UNROLLED_WINDOW

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


class Windows:
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

    def padded(self, tensors: list[te.Tensor], fills: list[float]) -> list[te.Tensor]:
        """``tensors`` (B, C, H, W) as one ``pad`` stage covering every window position: the input
        shifted by the padding, ``fill`` outside it (padding, ceil-mode overhang); the tensors
        themselves when no window overhangs (then there is no padding).  Read with
        :meth:`load_padded`.  A Clark fold (a TE reduction whose combiner uses each tap several
        times) must read its taps this way, not through :meth:`load`: TVM substitutes the tap
        expression into every use, and the bounds check in each copy multiplies LLVM's compile time
        of an overhanging pool (a 3x3 / stride-2 / padding-1 pool, say) many times over."""
        if not self.overhangs:
            return list(tensors)
        rows = (self.out_shape[1] - 1) * self.stride[0] + self.kernel[0]
        cols = (self.out_shape[2] - 1) * self.stride[1] + self.kernel[1]
        (ph, pw), (hi, wi) = self.padding, self.in_hw

        def f(b, c, y, x):
            h, w = y - ph, x - pw
            inside = tirx.all(h >= 0, h < hi, w >= 0, w < wi)
            return tuple(tirx.if_then_else(inside, t[b, c, h, w], tirx.const(fill, F32))
                         for t, fill in zip(tensors, fills, strict=True))

        out = te.compute((tensors[0].shape[0], tensors[0].shape[1], rows, cols), f, name=PAD)
        return list(out) if isinstance(out, list | tuple) else [out]

    def load_padded(self, t: te.Tensor, b, c, i, j, rp, rq):
        """A window tap of a tensor :meth:`padded` returned (no bounds check)."""
        return t[b, c, i * self.stride[0] + rp, j * self.stride[1] + rq]


PAD = "pad"
"""Name of the padded-input stage of an overhanging max pool (:meth:`Windows.padded`; blocks
``pad_v0``, ``pad_v1``, ...): scheduled as its own elementwise nests."""


DEINTERLEAVE = "deinterleave"
"""Name of the copy stage of the non-overlapping Gaussian max pool (blocks ``deinterleave_v0/_v1``)."""
FLAT_PAD = 64
"""The flattened output axis of the non-overlapping Gaussian max pool is padded to a multiple of
this: :data:`POOL_REGISTER_TILE` whole vectors of the widest fp32 SIMD vector (AVX-512, 16 lanes),
so the fold always runs on whole register tiles (a few per cent more work on a LeNet-sized pool;
padding to one vector only would leave vector counts that allow a tile of only 2)."""


def _gaussian_max_pool_deinterleaved(win: Windows, layer: PlannedLayer, m: te.Tensor, v: te.Tensor
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
    acc = clark_chain(m.shape[0], padded, kh * kw, lambda t, b, p: (xd[0][b, t // kw, t % kw, p],
                                                                    xd[1][b, t // kw, t % kw, p]))
    return te.compute((m.shape[0], n_c, oh, ow), lambda b, c, i, j: epilogue(
        acc[0][b, c * plane + i * ow + j], acc[1][b, c * plane + i * ow + j], layer), name="epilogue")


CHAIN = "max_pool2d"
"""Name prefix of the Clark fold stages of the non-overlapping Gaussian max pool: ``max_pool2d_1``
... ``max_pool2d_{K−2}`` (blocks ``…_v0/_v1``) and the last one ``max_pool2d``."""


def clark_chain(batch: Any, n: int, taps: int, tap: Any) -> list[te.Tensor]:
    """Clark's max folded over ``taps`` window taps in order, one ``te.compute`` per fold step.

    ``tap(t, b, p)`` is the (mean, variance) pair of tap ``t`` at ``[b, p]``;  stage 1 is
    ``max(tap 0, tap 1)``, stage ``k`` is ``max(stage k−1, tap k)`` (the reference's left fold
    :func:`pyro2pfp.moments.max_moments` in row-major window order), the last stage is named
    :data:`CHAIN` and returned as ``[mean, variance]`` of shape ``(batch, n)``.  ``taps − 1``
    Clark steps (a reduction from the identity ``(−FLT_MAX, 0)`` takes ``taps``), each its own
    stage: one expression with the steps nested would make TVM's LLVM code generator substitute
    every let value into the next (exponential in the window size, module docstring).  One tap
    is the tap itself (a copy).
    """
    if taps == 1:
        return te.compute((batch, n), lambda b, p: list(tap(0, b, p)), name=CHAIN)
    def step(t: int, prev: Any) -> Any:
        def body(b, p):
            m1, v1 = tap(0, b, p) if prev is None else (prev[0][b, p], prev[1][b, p])
            m2, v2 = tap(t, b, p)
            return te_shared(lambda ops: moments.max_moments(m1, v1, m2, v2, ops))
        return body

    prev: Any = None
    for t in range(1, taps):
        prev = te.compute((batch, n), step(t, prev), name=CHAIN if t == taps - 1 else f"{CHAIN}_{t}")
    return list(prev)


CORRELATED = "correlated_max"
"""Name prefix of the stages of the correlated Clark fold (:func:`correlated_max_pool`)."""
TAPS = "window_taps"
"""Name of the correlated fold's copy of its inputs in tap-major layout ``(b, c, rp, rq, i, j)`` (windows that
tile the input: :func:`correlated_max_pool`; blocks ``window_taps_v0``, ...)."""


def correlated_max_pool(win: Windows, layer: PlannedLayer, m: te.Tensor, v: te.Tensor, cov: te.Tensor | None,
                         profile: te.Tensor | None = None) -> list[te.Tensor]:
    """Clark's correlated max folded over each window (:func:`pyro2pfp.moments.correlated_window_max`).

    Stage ``t`` (``correlated_max_<t>``, one ``te.compute`` per fold step, as :func:`clark_chain`)
    outputs the running maximum's (mean, variance) after tap ``t`` and its covariance with every
    later tap; ``cov[b, c, k, i, j]`` holds the covariance of the window's pair ``k``
    (:func:`pyro2pfp.moments.window_pairs`; None: all 0, the independent fold).  Taps outside the input are
    the fold's identity (read through :meth:`Windows.padded`), their covariances 0.  ``profile`` (the
    shared-factor plan's ``s``): carried with the same weights, ``Φ(α)·s_M + Φ(−α)·s_t``, and returned
    after the output pair (unclipped)."""
    kh, kw = win.kernel
    n_taps = kh * kw
    pair_index = {pair: k for k, pair in enumerate(moments.window_pairs(n_taps))}
    taps_of = [m, v] if profile is None else [m, v, profile]
    shape = (m.shape[0], *win.out_shape)
    carry = 2 if profile is None else 3  # the running (mean, variance[, profile]) before the covariances
    zero = tirx.const(0.0, F32)
    if win.tiles_exactly():  # tap-major copies: a vector of pooled positions reads each tap contiguously
        n_c, oh, ow = win.out_shape
        split = te.compute((m.shape[0], n_c, kh, kw, oh, ow), lambda b, c, rp, rq, i, j: tuple(
            x[b, c, i * kh + rp, j * kw + rq] for x in taps_of), name=TAPS)
        split = list(split) if isinstance(split, list | tuple) else [split]

        def tap(t: int, b, c, i, j):
            return [x[b, c, t // kw, t % kw, i, j] for x in split]
    else:
        padded = win.padded(taps_of, [_LOWEST, 0.0, 0.0][:len(taps_of)])

        def tap(t: int, b, c, i, j):
            return [win.load_padded(x, b, c, i, j, t // kw, t % kw) for x in padded]

    def pair_cov(b, c, k, i, j):
        return zero if cov is None else cov[b, c, k, i, j]

    def fold_step(t: int, prev: Any) -> Any:
        def step(b, c, i, j):
            if prev is None:
                first = tap(0, b, c, i, j)
                carried = [pair_cov(b, c, pair_index[(0, u)], i, j) for u in range(1, n_taps)]
            else:
                first = [prev[n][b, c, i, j] for n in range(carry)]
                carried = [prev[carry + k][b, c, i, j] for k in range(n_taps - t)]
            second = tap(t, b, c, i, j)

            def build(ops):
                mean, var, cdf, cdf_neg = moments.correlated_max_moments(first[0], first[1], second[0], second[1],
                                                                         carried[0], ops)
                later = [carried[1 + k] * cdf + pair_cov(b, c, pair_index[(t, u)], i, j) * cdf_neg
                         for k, u in enumerate(range(t + 1, n_taps))]
                kept = [] if profile is None else [cdf * first[2] + cdf_neg * second[2]]
                return [mean, var, *kept, *later]

            return te_shared(build)

        return step

    prev: Any = None
    for t in range(1, n_taps):
        prev = te.compute(shape, fold_step(t, prev), name=f"{CORRELATED}_{t}")
        prev = list(prev) if isinstance(prev, list | tuple) else [prev]
    out = te.compute(shape, lambda *i: epilogue(prev[0][i], prev[1][i], layer), name="epilogue")
    return list(out) + ([] if profile is None else [prev[2]])


def _input_shape(ctx: EmitContext, layer: PlannedLayer) -> tuple[int, ...]:
    return ctx.shapes[layer.inputs[0]]


@kernel("max_pool2d")
def max_pool2d(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    x = inputs[0]
    win = Windows(layer, _input_shape(ctx, layer))

    if x.repr is Repr.DETERMINISTIC:
        def exact(m: te.Tensor) -> te.Tensor:
            rp, rq = win.axes()
            return te.compute((m.shape[0], *win.out_shape),
                              lambda b, c, i, j: te.max(win.load(m, b, c, i, j, rp, rq, _LOWEST), axis=[rp, rq]),
                              name="max_pool2d")

        return activation_out(ctx.emit_te(exact, [x.mean], layer), layer)

    assert x.repr is Repr.VARIANCE, x.repr  # the plan delivers variances to max pooling

    if len(inputs) == 2:  # in-window covariances (window_cov): Clark's correlated fold
        return activation_out(ctx.emit_te(lambda m, v, cov: correlated_max_pool(win, layer, m, v, cov),
                                          x.tensors() + [inputs[1].mean], layer), layer)

    # windows that tile the input: deinterleaved (contiguous taps, also where vectors of channels
    # with strided taps would be possible)
    if win.tiles_exactly():
        return activation_out(ctx.emit_te(lambda m, v: _gaussian_max_pool_deinterleaved(win, layer, m, v),
                                          x.tensors(), layer), layer)

    def fn(m: te.Tensor, v: te.Tensor) -> list[te.Tensor]:
        rp, rq = win.axes()
        m, v = win.padded([m, v], [_LOWEST, 0.0])  # plain loads in the Clark combiner (see Windows.padded)

        def body(b, c, i, j):
            return gaussian_max(tuple(win.load_padded(t, b, c, i, j, rp, rq) for t in (m, v)), axis=[rp, rq])

        acc = te.compute((m.shape[0], *win.out_shape), body, name="max_pool2d")
        return te.compute(acc[0].shape, lambda *i: epilogue(acc[0][i], acc[1][i], layer), name="epilogue")

    return activation_out(ctx.emit_te(fn, x.tensors(), layer), layer)


@kernel("avg_pool2d")
def avg_pool2d(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    x = inputs[0]
    in_shape = _input_shape(ctx, layer)
    win = Windows(layer, in_shape)
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


# ------------------------------------------------------------------------------------ max_pool2d
POOL_REGISTER_TILE = 4
"""Deinterleaved pool: SIMD vectors of (mean, variance) pairs folded side by side, as one vector of
``4 × lanes`` (LLVM splits it into independent chains that hide each other's latency: a Clark
step is a ~100-flop dependency chain).  Four chains hide the latency; more gain nothing, and
writing them as an unrolled loop of vectors instead of one wide vector is slower to run and
several times slower for LLVM to compile."""
GAUSSIAN_WINDOW_ROLLED = True
"""Clark's max pool keeps its window loops as loops (a plain max unrolls them).  The fold over the
window is a dependency chain of ~100-flop Clark steps, so unrolling it buys no parallelism, only
code: unrolled, the pools take most of LLVM's time in a LeNet-5 build.  Rolled, the latency is the
same within timing noise and the build is shorter (``benchmarks/latency.py`` prints compile times)."""


@schedule("max_pool2d")
def schedule_max_pool2d(sch: s_tir.Schedule, layer: PlannedLayer | None, target: tvm.target.Target) -> None:
    """Max pooling: a ``max_pool2d`` reduction over the window (Clark's Gaussian max, or a plain
    max for a deterministic input) plus an ``epilogue`` when the input is probabilistic.

    The window loops ``rp, rq`` (unrolled for a plain max, rolled for Clark's: see
    :data:`GAUSSIAN_WINDOW_ROLLED`) always sit outside the vector loop, so each vector of running
    (mean, variance) pairs is folded over the window in row-major order (the reference's
    order).  The vector axis (vectorizable bodies: plain max; Clark's max unless the window
    overhangs the input, whose ``if_then_else`` loads stay serial) is the one with the widest
    power-of-two divisor:

    * **deinterleaved windows** (kernel == stride, no padding/overhang, Gaussian input: LeNet
      pool1 and pool2): the kernel copies the input into a window-tap-major, flattened layout
      first (``deinterleave`` blocks) and folds with a chain of stages, see
      :func:`_schedule_deinterleaved_pool` (contiguous taps: faster than either of the layouts
      below for these pools);
    * **channels** (16 channels, rows of 5): parallel over (b, channel tile, i), serial ``j``;
      taps are strided loads (stride H·W), the epilogue writes the tile (a rectangle) from the
      stack;
    * **the flattened output** ``(c, i, j)`` when it is at least 4x wider (e.g. 6x14x14
      = 8·147: 8 lanes where channels and rows give 2): the taps are gathers with per-lane index
      arithmetic (Clark's max, ~100 flops per tap, still dominates) and the epilogue is its own
      elementwise nest (a tile of the flat axis is no rectangle, so it cannot be computed at it);
    * **output columns** ``j`` otherwise (parallel over rows ``(b, c, i)``); a serial body gets its
      input rows staged (see the module docstring).
    """
    lanes = simd_lanes(target)
    if has_block(sch, "deinterleave_v0"):
        _schedule_deinterleaved_pool(sch, lanes)
        return
    if has_block(sch, f"{CORRELATED}_1") or has_block(sch, f"{CORRELATED}_1_v0"):
        if CORRELATED_ONE_NEST[-1] and not has_block(sch, f"{PAD}_v0"):
            _schedule_correlated_fold(sch, lanes)
        else:  # every stage (and the padded input) an elementwise nest of its own
            flat_nests(sch, list(sch.get_child_blocks(sch.get_sblock("root"))), lanes)
        return
    if has_block(sch, f"{PAD}_v0"):  # the padded input of overhanging windows: its own elementwise nest
        flat_nests(sch, [b for b in sch.get_child_blocks(sch.get_sblock("root"))
                         if sch.get(b).name_hint.startswith(f"{PAD}_v")], lanes)
    blk = sch.get_sblock("max_pool2d")
    b, c, i, j, *window = sch.get_loops(blk)
    vectorize = vectorizable(sch, [blk])
    vec_c = pow2_divisor(static_extent(sch, c), lanes) if vectorize else 1
    vec_j = pow2_divisor(static_extent(sch, j), lanes) if vectorize else 1
    per_sample = static_extent(sch, c) * static_extent(sch, i) * static_extent(sch, j)
    vec_flat = pow2_divisor(per_sample, lanes) if vectorize else 1
    if vec_flat >= 4 * max(vec_c, vec_j):  # a vector of the flattened output (gathered taps)
        fo, fv = sch.split(sch.fuse(c, i, j), [None, vec_flat])
        sch.reorder(b, fo, *window, fv)
        sch.parallel(sch.fuse(b, fo))
        if not (sch.get_consumers(blk) and GAUSSIAN_WINDOW_ROLLED):
            for loop in window:
                sch.unroll(loop)
        sch.vectorize(fv)
        sch.decompose_reduction(blk, window[0])
        flat_nests(sch, sch.get_consumers(blk), lanes)  # the epilogue: its own nest (no rectangle tile)
        return
    if vec_c > vec_j:  # a vector of channels: (b, channel tile, i) | j, window, channels
        co, cv = sch.split(c, [None, vec_c])
        sch.reorder(b, co, i, j, *window, cv)
        par, vector = sch.fuse(b, co, i), cv
    else:  # a vector of columns: (b, c, i) | window, j
        sch.reorder(b, c, i, *window, j)
        par, vector = sch.fuse(b, c, i), None
        if vec_j > 1:
            _, vector = sch.split(j, [None, vec_j])
    sch.parallel(par)
    gaussian = bool(sch.get_consumers(blk))  # Clark's max has an epilogue; a plain max has none
    if gaussian:
        epilogue_at(sch, blk, par, lanes)  # the tile of one `par` iteration is a rectangle
    if not (gaussian and GAUSSIAN_WINDOW_ROLLED):
        for loop in window:
            sch.unroll(loop)
    if vector is not None:
        sch.vectorize(vector)
    if not vectorize:
        stage_inputs(sch, [blk], par)
    sch.decompose_reduction(blk, window[0] if vec_c <= vec_j else j)


CORRELATED_ONE_NEST = [True]
"""Whether the correlated fold of windows that do not overhang is scheduled as one loop nest
(:func:`_schedule_correlated_fold`) rather than one elementwise nest per stage (a list: benchmarks
and tests compare the two)."""


STAGE_ONE_LOOP = [True]
"""Whether the outputs of one fold stage (the running pair and its covariances, one block each) share one
loop over the pooled positions, so that the stage's Clark max (erf, exp) is computed once per position
rather than once per output (a list: benchmarks and tests compare the two)."""


def _schedule_correlated_fold(sch: s_tir.Schedule, lanes: int) -> None:
    """The correlated Clark fold of windows that do not overhang (``_correlated_max_pool``): one loop
    nest, parallel over ``(batch, channel)``.  Each fold stage ``correlated_max_t`` (the running
    (mean, variance) and its covariances with the later taps) is one block per output, each binding the
    same Clark max; all of them and the ``epilogue`` blocks are computed at the parallel loop, stage after
    stage, and the outputs of one stage share one loop over the pooled positions (:data:`STAGE_ONE_LOOP`:
    LLVM then computes the stage's erf and exp once for all its outputs, not once per output), vectorised
    by the widest power of two dividing the plane.  Windows that tile the input are read from a
    tap-major copy (``window_taps``, computed at the parallel loop), so a vector of pooled positions
    loads each tap contiguously (no gather).  A plane of no power-of-two size (LeNet's 5x5) takes vectors
    of channels instead (:func:`_schedule_correlated_fold_channels`)."""
    root = sch.get_sblock("root")
    every = list(sch.get_child_blocks(root))
    taps = [blk for blk in every if sch.get(blk).name_hint.startswith(TAPS)]
    blocks = [blk for blk in every if sch.get(blk).name_hint.startswith((f"{CORRELATED}_", "epilogue"))]
    epilogue = [blk for blk in blocks if sch.get(blk).name_hint.startswith("epilogue")]
    b, c, i, j = sch.get_loops(epilogue[0])  # the epilogue blocks share one nest
    can = vectorizable(sch, blocks)
    vec = pow2_divisor(static_extent(sch, i) * static_extent(sch, j), lanes) if can else 1
    vec_c = pow2_divisor(static_extent(sch, c), lanes) if can else 1
    if vec < 4 <= vec_c:  # a plane of no power-of-two size (5x5): vectors of channels (strided taps)
        _schedule_correlated_fold_channels(sch, blocks, epilogue, vec_c)
    else:
        par = sch.fuse(b, c)
        sch.parallel(par)
        for blk in reversed([blk for blk in blocks if blk not in epilogue]):  # consumers first
            sch.compute_at(blk, par, preserve_unit_loops=True)  # (i, j) loops even for one row (a 1-D pool)
        _vectorize_stages(sch, blocks, vec)
    for blk in taps:  # the tap-major copy: one (batch, channel tile) slice at a time, before the fold reads it
        sch.compute_at(blk, sch.get_loops(epilogue[0])[0], preserve_unit_loops=True)


def _vectorize_stages(sch: s_tir.Schedule, blocks: list[Any], vec: int) -> None:
    """Each fold stage's outputs in one loop over the pooled positions (:data:`STAGE_ONE_LOOP`), vectorised."""
    for members in _stages(sch, blocks).values():
        nests: dict[Any, list[Any]] = {}  # (the epilogue's outputs share one nest already)
        for blk in members:
            loops = sch.get_loops(blk)
            nests.setdefault(sch.get_sref(loops[-2]), loops[-2:])
        planes = [sch.fuse(*loops) for loops in nests.values()]
        if len(planes) > 1 and STAGE_ONE_LOOP[-1]:
            planes = [sch.merge(*planes)]
        for plane in planes:  # (one vector loop per stage: merged across stages TVM 0.27 vectorises the fold wrongly)
            if vec > 1:
                _, v = sch.split(plane, [None, vec])
                sch.vectorize(v)


def _stages(sch: s_tir.Schedule, blocks: list[Any]) -> dict[str, list[Any]]:
    """The fold's blocks by stage: a stage's outputs (blocks ``<stage>_v<k>``) share its Clark max."""
    stages: dict[str, list[Any]] = {}
    for blk in blocks:
        stages.setdefault(sch.get(blk).name_hint.rsplit("_v", 1)[0], []).append(blk)
    return stages


def _schedule_correlated_fold_channels(sch: s_tir.Schedule, blocks: list[Any], epilogue: list[Any], vec: int
                                       ) -> None:
    """:func:`_schedule_correlated_fold` with a vector of ``vec`` channels in place of a vector of pooled
    positions: parallel over ``(batch, channel tile)``, each stage's outputs in one loop over the pooled
    positions and one vector loop of channels."""
    b, c, i, j = sch.get_loops(epilogue[0])
    co, cv = sch.split(c, [None, vec])
    sch.reorder(b, co, i, j, cv)
    par = sch.fuse(b, co)
    sch.parallel(par)
    for blk in reversed([blk for blk in blocks if blk not in epilogue]):  # consumers first
        sch.compute_at(blk, par, preserve_unit_loops=True)
    for members in _stages(sch, blocks).values():
        nests: dict[Any, Any] = {}
        for blk in members:
            loops = sch.get_loops(blk)
            if blk in epilogue:  # (i, j, channels) already; the epilogue's outputs share one nest
                if not nests:
                    nests[0] = (sch.fuse(*loops[-3:-1]), loops[-1])
                continue
            cl, il, jl = loops[-3:]
            sch.reorder(il, jl, cl)
            nests[sch.get_sref(cl)] = (sch.fuse(il, jl), cl)
        planes = [plane for plane, _ in nests.values()]
        vectors = [v for _, v in nests.values()]
        if len(planes) > 1 and STAGE_ONE_LOOP[-1]:
            sch.merge(*planes)
            vectors = [sch.merge(*vectors)]
        for v in vectors:
            sch.vectorize(v)


def _schedule_deinterleaved_pool(sch: s_tir.Schedule, lanes: int) -> None:
    """The non-overlapping Gaussian max pool (``pooling._gaussian_max_pool_deinterleaved``):
    three loop nests, each parallel over the batch and a static outer axis.

    * ``deinterleave`` ``(b, rp, rq, p)``: ``p`` is split ``(c, i, j)`` by the output plane
      (so the copy's ``p // (OH·OW)``, ``p % OW``... can simplify to the loop variables when
      lowered), parallel over ``(b, rp, rq, c)``; serial (strided reads; the padding lanes'
      guard is an ``if_then_else``);
    * the Clark fold (:func:`clark_chain`): the last stage ``max_pool2d`` ``(b, p)`` has ``p``
      split ``(po, pw)``, ``pw`` one vector of :data:`POOL_REGISTER_TILE` SIMD vectors (``p``
      is padded to a multiple of :data:`FLAT_PAD`), parallel over ``(b, po)``; every earlier
      stage is computed at ``po`` (its ``pw`` values in a ``local`` buffer, vectorised the same
      way), so one ``po`` iteration is straight-line vector code, stage after stage in fold
      order;
    * ``epilogue`` ``(b, c, i, j)``: :func:`flat_nest` (it reads the flat ``p`` back as
      ``c·OH·OW + (i·OW + j)``, contiguous along the fused ``(i, j)``).
    """
    copy = sch.get_sblock("deinterleave_v0")
    last = [sch.get_sblock(f"{CHAIN}_v0"), sch.get_sblock(f"{CHAIN}_v1")]
    consumers = list(sch.get_consumers(last[0]))
    # the copy: (b, rp, rq, c, i, j) with c*OH*OW + i*OW + j = p (output plane from the epilogue)
    _, _, oh, ow = (extent(sch, loop) for loop in sch.get_loops(consumers[0]))  # (batch, c, oh, ow)
    b, rp, rq, p = sch.get_loops(copy)
    _, i, j = sch.split(p, [None, oh, ow])
    sch.parallel(sch.fuse(b, rp, rq, sch.get_loops(copy)[3]))
    # the fold: earlier stages, last first (each is computed where its consumer now is)
    stages = []
    producers = list(sch.get_producers(last[0]))
    while True:
        earlier = [blk for blk in producers if sch.get(blk).name_hint.startswith(f"{CHAIN}_")]
        if not earlier:
            break
        stages.append(sorted(earlier, key=lambda blk: sch.get(blk).name_hint))
        producers = list(sch.get_producers(earlier[0]))
    b, p = sch.get_loops(last[0])
    n = static_extent(sch, p)
    vectorize = vectorizable(sch, last)
    vec = pow2_divisor(n, lanes) if vectorize else 1
    tile = divisor_at_most(n // vec, POOL_REGISTER_TILE)
    width = tile * vec  # vectorised: one vector of `tile` registers (LLVM splits it: independent chains)
    po, pw = sch.split(p, [None, width])
    par = sch.fuse(b, po)
    sch.parallel(par)
    if vec > 1:
        sch.vectorize(pw)
    for stage in stages:
        for blk in stage:
            sch.compute_at(blk, par, preserve_unit_loops=True)
            sch.set_scope(blk, 0, "local")
            if vec > 1:
                sch.vectorize(sch.get_loops(blk)[-1])
    flat_nests(sch, consumers, lanes)  # the epilogue: its own nest (a tile of p is no rectangle of (c, i, j))


@schedule("avg_pool2d")
def schedule_avg_pool2d(sch: s_tir.Schedule, layer: PlannedLayer | None, target: tvm.target.Target) -> None:
    """Average pooling: the window-sum reduction ``avg_pool2d`` (one or two outputs: mean and
    variance) runs parallel over (batch, channel) with the window loops unrolled inside the output
    columns (row-major window order, as the reference sums), the output columns vectorised when the
    body allows; the ``epilogue`` (scaling by the divisor) is an elementwise nest of its own."""
    lanes = simd_lanes(target)
    blk = sch.get_sblock("avg_pool2d" if has_block(sch, "avg_pool2d") else "avg_pool2d_v0")
    epilogues = list(sch.get_consumers(blk))
    b, c, i, j, rp, rq = sch.get_loops(blk)
    sch.reorder(b, c, i, rp, rq, j)
    sch.parallel(sch.fuse(b, c))
    window = static_extent(sch, rp) * static_extent(sch, rq)
    if window <= CONV_MAX_UNROLLED_WINDOW:
        sch.unroll(rp)
        sch.unroll(rq)
    sch.decompose_reduction(blk, rp)
    flat_nests(sch, epilogues, lanes)
