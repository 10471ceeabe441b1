"""Default CPU schedules for the PFP PrimFuncs (applied before building).

Every PFP layer becomes one PrimFunc ``pfp_<op>_<layer>`` whose first axis is the *symbolic*
batch.  MetaSchedule only tunes static shapes, so these are hand-written, shape-generic
``tvm.s_tir.Schedule`` programs.  They only ever split *static* axes; the batch axis is fused into
the parallel loop, so one compiled kernel serves every batch size and no split of the batch needs
a predicate (a split of the symbolic batch by a register-tile factor was measured slower at every
batch size because of the predicate it puts in the inner loop).

Rules shared by all schedules, and why:

* **Parallel over an outer axis**: ``fuse(batch, <outer static tiles>)`` -> ``parallel``, so batch
  1 still gives both cores work and large batches give many evenly divided chunks.
* **Vectorise a unit-stride inner axis by a width that divides it**.  A split that does not divide
  its extent puts a predicate inside the vector loop and TVM falls back to scalar code (measured
  2-4x slower); a width that is not a power of two (e.g. a whole row of 20 or 50) makes LLVM
  shuffle the accumulators lane by lane.  So the width is the largest power of two dividing the
  extent, capped at the SIMD width (16 fp32 lanes with AVX-512, 8 with AVX, else 4), and several
  such vectors are unrolled side by side to form a register tile.
* **Only vectorise what TVM can vectorise** (:func:`_vectorizable`): a call without a vector form
  (e.g. ``if_then_else`` loads of padded pooling windows, a libm call) makes ``VectorizeLoop``
  scalarise the loop, which in TVM 0.27 is *miscompiled* when the block binds ``T.let`` values
  (all lanes get the last lane's value).  Such loops stay serial.  ``erf`` and ``exp`` are
  ``_core.fast_erf``/``fast_exp`` (plain arithmetic), so ReLU moments and Clark's max vectorise.
* **Vector accesses must stay contiguous**: a vector over several fused axes is only contiguous
  if TVM simplifies the flattened index back to ``outer*vec + lane``; it reliably does for a
  fusion of two axes but not always for three, and otherwise emits a gather with per-lane 64-bit
  division (measured 10x slower than the scalar loop it replaces).
* **Small reduction loops unrolled** (kernel window, a small factor of the dense ``k`` loop).
* **Accumulators in registers**: the reduction's consumers (the ``epilogue`` blocks: bias,
  variance clamp, representation conversion) are moved under the parallel loop with
  ``reverse_compute_at``; buffer compaction then shrinks the ``(batch, ...)`` intermediate to one
  tile that lives on the stack (TVM 0.27 puts small ``global``-scope allocations on the stack
  but sends *every* ``local`` one through ``TVMBackendAllocWorkspace``, so no ``set_scope``).
  The tile is always a *rectangle* of the output: ``reverse_compute_at`` covers the bounding
  box of what the loop produces, so a non-rectangular tile (a split of several fused axes)
  would make it write elements the tile never computed.
* **Reduction init hoisted** with ``decompose_reduction`` at the outermost reduction loop, after
  ``vectorize`` (the other order fails).
* **Convolution padding** (one ``pad`` block per input tensor) is computed at the parallel loop:
  only the ``KH`` padded input rows one output row needs, in a small thread-private buffer.
* **Inputs of libm-bound kernels staged** (``cache_read`` + ``compute_at`` the parallel loop): in
  a parallel loop body the input pointers come out of the closure, so LLVM must assume that each
  ``erff`` call (which may write ``errno``) clobbers them; it then reloads the inputs after every
  call and shares fewer ``erf``/``exp`` values between the mean and the variance output (measured
  up to 2.3x slower per thread than the serial kernel; 10-15 % with the row tiles used here).
  Reading from a thread-private stack tile (< 1 KiB) avoids that.

Everything fails soft: if a primitive raises for a function, a warning names the function and the
unscheduled (correct, slower) PrimFunc is kept.  Ops without an entry in :data:`SCHEDULES` stay
unscheduled.  Scheduled functions carry the ``tirx.is_scheduled`` attribute.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from ..registry import add_to

ScheduleFn = Callable[[s_tir.Schedule, Any, tvm.target.Target], None]

SCHEDULES: dict[str, ScheduleFn] = {}
"""``{op: fn(sch, planned_layer, target)}``: the default CPU schedule of each PFP op.  A schedule
registered next to its kernel with ``tvm_backend.schedule(op)`` (``_core.SCHEDULES``) overrides
the one here."""


def _schedule_fn(op: str | None) -> ScheduleFn | None:
    from . import _core

    if op is None:
        return None
    return _core.SCHEDULES.get(op) or SCHEDULES.get(op)


#: ``@_register(op, ...)`` registers the default CPU schedule of PFP ops (once each).
_register = add_to(SCHEDULES, "CPU schedule of op")


# ------------------------------------------------------------------------------------ helpers
def simd_lanes(target: tvm.target.Target) -> int:
    """fp32 lanes of the target's widest SIMD register (16 AVX-512, 8 AVX, else 4)."""
    try:
        features = set(tvm.target.codegen.llvm_get_cpu_features(target))
    except Exception:  # noqa: BLE001 -- non-LLVM target or no feature query: assume 128-bit SIMD
        return 4
    if "avx512f" in features:
        return 16
    if "avx" in features:
        return 8
    return 4


def _extent(sch: s_tir.Schedule, loop: Any) -> int | None:
    """Static extent of a loop, or None for a symbolic (batch) extent."""
    ext = sch.get(loop).extent
    return int(ext) if isinstance(ext, tirx.IntImm | int) else None


def _static_extent(sch: s_tir.Schedule, loop: Any) -> int:
    """Static extent of a loop that is not the batch axis (a symbolic one is a bug of the caller)."""
    ext = _extent(sch, loop)
    if ext is None:
        raise ValueError(f"loop {sch.get(loop)} has a symbolic extent; only the batch axis may")
    return ext


def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two that divides ``n`` and is at most ``cap``."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def _divisor_at_most(n: int, cap: int) -> int:
    """Largest divisor of ``n`` that is at most ``cap`` (at least 1)."""
    for d in range(max(1, min(n, cap)), 0, -1):
        if n % d == 0:
            return d
    return 1


_ALWAYS_VECTORIZABLE = {"prim.likely", "tirx.reinterpret"}  # VectorizeLoop handles these itself


def _vectorizable(sch: s_tir.Schedule, blocks: list[Any]) -> bool:
    """Whether ``VectorizeLoop`` turns the bodies of ``blocks`` into real vector code.

    A call without the ``TVectorizable`` op attribute (``erf``, which becomes a libm ``erff``
    call; ``if_then_else``) makes TVM scalarise the vector loop.  That gains nothing and, in TVM
    0.27, is wrong for blocks that bind ``T.let`` values (the scalarised lets are followed by a
    store of the *last* lane's value broadcast to every lane), so such loops stay serial.
    """
    ok = True

    def visit(node: Any, visitor: Any) -> None:
        nonlocal ok
        if isinstance(node, tvm.ir.expr.Call) and isinstance(node.op, tvm.ir.Op):
            if node.op.name not in _ALWAYS_VECTORIZABLE and not node.op.get_attr("TVectorizable"):
                ok = False
        visitor.default_visit(node)

    for block in blocks:
        tvm_ffi.structural_visit(sch.get(block), visit)
    return ok


def _vectorize_inner(sch: s_tir.Schedule, block: Any, lanes: int, below: Any = None) -> None:
    """Split the innermost loop of ``block`` by a power-of-two width that divides it and vectorise
    that part, if the block is vectorizable (otherwise leave it serial).  With ``below`` (a loop
    around the block, e.g. the parallel loop it was computed at) only a loop nested strictly
    inside ``below`` is considered: a block left with no loop of its own there (extent-1 axes at
    a static batch) must not vectorise the parallel loop, which it shares with other blocks."""
    loops = list(sch.get_loops(block))
    if below is not None:
        srefs = [sch.get_sref(loop) for loop in loops]
        target = sch.get_sref(below)
        depth = next((k for k, ref in enumerate(srefs) if ref.same_as(target)), None)
        if depth is None or depth == len(loops) - 1:
            return
    inner = loops[-1]
    n = _extent(sch, inner)
    if n is None or n < 2 or not _vectorizable(sch, [block]):
        return
    vec = _pow2_divisor(n, lanes)
    if vec > 1:
        _, vi = sch.split(inner, [None, vec])
        sch.vectorize(vi)


def _epilogue_at(sch: s_tir.Schedule, producer: Any, loop: Any, lanes: int) -> None:
    """Move the consumers of ``producer`` (the epilogue) under ``loop`` -- whose iterations must
    each produce a rectangle of the intermediate -- and vectorise their innermost loop."""
    consumers = list(sch.get_consumers(producer))
    for block in consumers:
        sch.reverse_compute_at(block, loop)
    for block in consumers:
        _vectorize_inner(sch, block, lanes, below=loop)


def _stage_inputs(sch: s_tir.Schedule, blocks: list[Any], loop: Any) -> None:
    """Copy the tile of every function input read by ``blocks`` that one iteration of ``loop``
    needs into a thread-private buffer computed at ``loop`` (``cache_read`` + ``compute_at``)."""
    params = list(sch.mod["main"].params)
    staged: list[Any] = []
    while True:
        todo = None
        for block in blocks:
            for index, region in enumerate(sch.get(block).reads):
                buf = region.source
                if any(buf.same_as(p) for p in params) and not any(buf.same_as(s) for s in staged):
                    todo = (block, index, buf)
                    break
            if todo:
                break
        if todo is None:
            return
        block, index, buf = todo
        readers = [b for b in blocks if any(r.source.same_as(buf) for r in sch.get(b).reads)]
        cache = sch.cache_read(block, index, "global", consumer_blocks=readers)
        sch.compute_at(cache, loop)
        staged.append(buf)


# ------------------------------------------------------------------------------------ dense
DENSE_K_UNROLL = 4
DENSE_K_CHUNK = 32  # rows of the weight tile kept in L1 while every example of the batch uses it


@_register("dense")
def schedule_dense(sch: s_tir.Schedule, layer: Any, target: tvm.target.Target) -> None:
    """Dense ``(batch, K) x (K, M)``: one tuple-reduction block ``dense`` (mean and variance sums
    together) + the ``epilogue`` blocks.

    The weights are stored ``(K, M)``, so the output feature ``j`` is the unit-stride axis, and
    zero-padded to whole vectors (``compute.dense_padded_columns``: 16 columns, or a multiple of
    32 above 16), so ``jv`` is a whole SIMD register.  ``j`` is split ``jo x jm x jv``: ``jv``
    vectorised, ``jm`` unrolled -- a register tile of ``jm`` mean and ``jm`` variance vector
    accumulators (at most 8 + 8 of the 32 AVX-512 registers, 4 + 4 of 16 otherwise, and at most
    half the columns) -- and ``jo`` is the parallel loop: at least two tiles when ``M > 16``, so
    batch 1 keeps both cores busy, each streaming its own columns of the weights.

    ``k`` is split ``ko x km x ki`` (``km*ki`` = a divisor of ``K`` up to :data:`DENSE_K_CHUNK`,
    ``ki`` unrolled).  Order ``jo | ko, batch, km, ki, jm, jv``: a chunk of ``km*ki`` weight rows
    of the tile (2 x 32 x 64 floats: 16 KiB) stays in L1 while every example of the batch
    accumulates over it, instead of the whole weight matrix streaming from L2 once per example
    (the weights are not reused across examples otherwise: measured 2-2.5x faster at batch 10 and
    100 for 784x100, the same at batch 1).  The accumulators are a ``(batch, tile)`` buffer
    (re-read once per chunk); the epilogue writes each column tile after its reduction.
    """
    lanes = simd_lanes(target)
    blk = sch.get_sblock("dense")
    i, j, k = sch.get_loops(blk)
    m, kk = _static_extent(sch, j), _static_extent(sch, k)
    vectorize = _vectorizable(sch, [blk])
    vec = _pow2_divisor(m, lanes) if vectorize else 1
    n_vec = m // vec
    # register tile: at most a third of the vector registers per accumulator, and at least two
    # tiles when there are two vectors or more (both cores busy at batch 1)
    jm = _divisor_at_most(n_vec, min(_register_budget(lanes) // 3, max(1, n_vec // 2)))
    jo, jmm, jv = sch.split(j, [None, jm, vec])
    chunk = _divisor_at_most(kk, DENSE_K_CHUNK)
    ko, km, ki = sch.split(k, [None, chunk // _divisor_at_most(chunk, DENSE_K_UNROLL),
                               _divisor_at_most(chunk, DENSE_K_UNROLL)])
    sch.reorder(jo, ko, i, km, ki, jmm, jv)
    sch.parallel(jo)
    _epilogue_at(sch, blk, jo, lanes)
    sch.unroll(ki)
    sch.unroll(jmm)
    if vec > 1:
        sch.vectorize(jv)
    sch.decompose_reduction(blk, ko)


# ------------------------------------------------------------------------------------ conv2d
CONV_TILE_COLUMNS = 4  # output columns per register tile when vectorising over output channels
CONV_MAX_UNROLLED_WINDOW = 64  # unroll the kernel window only up to this many taps


def _register_budget(lanes: int) -> int:
    """Vector registers a register tile of accumulators may use (32 with AVX-512, else 16),
    leaving a few for operands."""
    return 24 if lanes >= 16 else 12


@_register("conv2d")
def schedule_conv2d(sch: s_tir.Schedule, layer: Any, target: tvm.target.Target) -> None:
    """Conv2d NCHW/OIHW: optional ``pad`` block(s) (one per input tensor), the tuple-reduction
    ``conv2d`` block and the ``epilogue``.

    A register tile of (output channels x output columns) of one output row is accumulated over
    ``rc`` and the unrolled ``rp x rq`` window; the parallel loop runs over batch x channel tiles
    x output rows (x column tiles).  The vector axis is the one with the larger power-of-two
    divisor (see the module docstring):

    * **output channels** (e.g. LeNet conv2, 16 channels, 10 columns): the weights are first
      copied once per call into a ``(C, KH, KW, O)`` layout (``cache_read`` +
      ``transform_layout``; 2x|w| floats, ~1 us) so a vector of output channels' weights is one
      contiguous load, and each input element is a broadcast scalar reused by the whole vector;
    * **output columns** (e.g. conv1, 6 channels, 28 columns): ``x[.., i+rp, j+rq]`` is read as
      contiguous vectors and each weight is a broadcast scalar shared by the row.

    The padding blocks are computed at the parallel loop (just the ``KH`` padded input rows the
    output row needs, in a small thread-private buffer, instead of a padded copy of the whole
    batch) and the epilogue writes the tile from the accumulators.

    Tile sizes, measured on LeNet's conv2 (AVX-512, one thread, batch 1): 2 columns x 16 channels
    14.7 us, 5 columns 15-20 us, 10 columns 300 us (register spills); unscheduled 300 us.
    """
    lanes = simd_lanes(target)
    budget = _register_budget(lanes)
    blk = sch.get_sblock("conv2d")
    pads = list(sch.get_producers(blk))
    b, o, i, j, rc, rp, rq = sch.get_loops(blk)
    n_o, ow = _static_extent(sch, o), _static_extent(sch, j)
    vectorize = _vectorizable(sch, [blk])
    vec_o = _pow2_divisor(n_o, lanes) if vectorize else 1
    vec_j = _pow2_divisor(ow, lanes) if vectorize else 1
    if vec_o > 1 and vec_o >= vec_j:
        _transpose_conv_weights(sch, blk)
        oo, ov = sch.split(o, [None, vec_o])
        jo, jm = sch.split(j, [None, _divisor_at_most(ow, CONV_TILE_COLUMNS)])
        sch.reorder(b, oo, i, jo, rc, rp, rq, jm, ov)
        par = sch.fuse(b, oo, i, jo)
        unrolled: tuple[Any, ...] = (rp, rq, jm)
        vector = ov
    else:
        jm = _divisor_at_most(ow // vec_j, 4)
        ot = _divisor_at_most(n_o, max(1, budget // (2 * jm)))
        oo, oi = sch.split(o, [None, ot])
        jo, jmm, jv = sch.split(j, [None, jm, vec_j])
        sch.reorder(b, oo, i, jo, rc, rp, rq, oi, jmm, jv)
        par = sch.fuse(b, oo, i, jo)
        unrolled, vector = (rp, rq, oi, jmm), (jv if vec_j > 1 else None)
    sch.parallel(par)
    _epilogue_at(sch, blk, par, lanes)
    for pad in pads:
        sch.compute_at(pad, par)
        _vectorize_inner(sch, pad, lanes)
    window = _static_extent(sch, rp) * _static_extent(sch, rq)
    for loop in unrolled:
        if window <= CONV_MAX_UNROLLED_WINDOW or not (loop.same_as(rp) or loop.same_as(rq)):
            sch.unroll(loop)
    if vector is not None:
        sch.vectorize(vector)
    sch.decompose_reduction(blk, rc)


def _transpose_conv_weights(sch: s_tir.Schedule, blk: Any) -> None:
    """Read the conv weights -- the function inputs the block indexes by its output-channel iter
    var in the first dimension -- through a copy in ``(C, KH, KW, O)`` layout, made once per call
    before the main loop."""
    params = list(sch.mod["main"].params)
    v_o = sch.get(blk).iter_vars[1].var
    done: list[Any] = []
    while True:
        todo = None
        for index, region in enumerate(sch.get(blk).reads):
            buf = region.source
            if (len(region.region) == 4 and region.region[0].min.same_as(v_o)
                    and any(buf.same_as(p) for p in params) and not any(buf.same_as(d) for d in done)):
                todo = (index, buf)
                break
        if todo is None:
            return
        index, buf = todo
        cache = sch.cache_read(blk, index, "global")
        sch.transform_layout(cache, ("write", 0), lambda o, c, p, q: (c, p, q, o))
        done.append(buf)


# ------------------------------------------------------------------------------------ max_pool2d
POOL_REGISTER_TILE = 3  # deinterleaved pool: independent (mean, variance) vectors folded side by side


@_register("max_pool2d")
def schedule_max_pool2d(sch: s_tir.Schedule, layer: Any, target: tvm.target.Target) -> None:
    """Max pooling: a ``max_pool2d`` reduction over the window (Clark's Gaussian max, or a plain
    max for a deterministic input) plus an ``epilogue`` when the input is probabilistic.

    The unrolled window loops ``rp, rq`` always sit outside the vector loop, so each vector of
    running (mean, variance) pairs is folded over the window in row-major order (the reference's
    order).  The vector axis (vectorizable bodies: plain max; Clark's max unless the window
    overhangs the input, whose ``if_then_else`` loads stay serial) is the one with the widest
    power-of-two divisor:

    * **channels** (LeNet pool2, 16 channels, rows of 5): parallel over (b, channel tile, i),
      serial ``j``; taps are strided loads (stride H·W), the epilogue writes the tile (a
      rectangle) from the stack.  (An unrolled register tile of 5 columns inside the window loops
      measured 20 -> 14 us at batch 10 but doubled LeNet's compile time: not done);
    * **deinterleaved windows** (kernel == stride, no padding/overhang, Gaussian input with a
      channel count that is no multiple of 16, e.g. LeNet pool1): the kernel copies the input
      into a window-tap-major, flattened layout first (``deinterleave`` blocks), see
      :func:`_schedule_deinterleaved_pool` (pool1: 109 -> 46 us at batch 10);
    * **the flattened output** ``(c, i, j)`` when it is at least 4x wider (LeNet pool1, 6x14x14
      = 8·147: 8 lanes where channels and rows give 2): the taps are gathers with per-lane index
      arithmetic (Clark's max, ~100 flops per tap, still dominates) and the epilogue is its own
      elementwise nest (a tile of the flat axis is no rectangle, so it cannot be computed at it);
    * **output columns** ``j`` otherwise (parallel over rows ``(b, c, i)``); a serial body gets its
      input rows staged (see the module docstring).
    """
    lanes = simd_lanes(target)
    blk = sch.get_sblock("max_pool2d")
    if _has_block(sch, "deinterleave_v0"):
        _schedule_deinterleaved_pool(sch, blk, lanes)
        return
    b, c, i, j, *window = sch.get_loops(blk)
    vectorize = _vectorizable(sch, [blk])
    vec_c = _pow2_divisor(_static_extent(sch, c), lanes) if vectorize else 1
    vec_j = _pow2_divisor(_static_extent(sch, j), lanes) if vectorize else 1
    per_sample = _static_extent(sch, c) * _static_extent(sch, i) * _static_extent(sch, j)
    vec_flat = _pow2_divisor(per_sample, lanes) if vectorize else 1
    if vec_flat >= 4 * max(vec_c, vec_j):  # a vector of the flattened output (gathered taps)
        fo, fv = sch.split(sch.fuse(c, i, j), [None, vec_flat])
        sch.reorder(b, fo, *window, fv)
        sch.parallel(sch.fuse(b, fo))
        for loop in window:
            sch.unroll(loop)
        sch.vectorize(fv)
        sch.decompose_reduction(blk, window[0])
        _flat_nests(sch, sch.get_consumers(blk), lanes)  # the epilogue: its own nest (no rectangle tile)
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
    if sch.get_consumers(blk):
        _epilogue_at(sch, blk, par, lanes)  # the tile of one `par` iteration is a rectangle
    for loop in window:
        sch.unroll(loop)
    if vector is not None:
        sch.vectorize(vector)
    if not vectorize:
        _stage_inputs(sch, [blk], par)
    sch.decompose_reduction(blk, window[0] if vec_c <= vec_j else j)


def _has_block(sch: s_tir.Schedule, name: str) -> bool:
    return any(sch.get(block).name_hint == name for block in sch.get_child_blocks(sch.get_sblock("root")))


def _schedule_deinterleaved_pool(sch: s_tir.Schedule, blk: Any, lanes: int) -> None:
    """The non-overlapping Gaussian max pool (``pooling._gaussian_max_pool_deinterleaved``):
    three loop nests, each parallel over the batch and a static outer axis.

    * ``deinterleave`` ``(b, rp, rq, p)``: ``p`` is split ``(c, i, j)`` by the output plane
      (so the copy's ``p // (OH·OW)``, ``p % OW``... can simplify to the loop variables when
      lowered), parallel over ``(b, rp, rq, c)``; serial (strided reads; the padding lanes'
      guard is an ``if_then_else``);
    * ``max_pool2d`` ``(b, p | rp, rq)``: ``p`` split ``(po, pu, pv)``, ``pv`` a whole vector
      (``p`` is padded to a multiple of 16), ``pu`` unrolled inside the window loops so
      :data:`POOL_REGISTER_TILE` independent Clark chains hide each other's latency; the fold
      over ``rp, rq`` stays sequential and row-major; parallel over ``(b, po)``;
    * ``epilogue`` ``(b, c, i, j)``: :func:`_flat_nest` (it reads the flat ``p`` back as
      ``c·OH·OW + (i·OW + j)``, contiguous along the fused ``(i, j)``).
    """
    copy = sch.get_sblock("deinterleave_v0")
    consumers = list(sch.get_consumers(blk))
    # the copy: (b, rp, rq, c, i, j) with c*OH*OW + i*OW + j = p (output plane from the epilogue)
    _, _, oh, ow = (_extent(sch, loop) for loop in sch.get_loops(consumers[0]))  # (batch, c, oh, ow)
    b, rp, rq, p = sch.get_loops(copy)
    _, i, j = sch.split(p, [None, oh, ow])
    sch.parallel(sch.fuse(b, rp, rq, sch.get_loops(copy)[3]))
    # the reduction
    b, p, rp, rq = sch.get_loops(blk)
    n = _static_extent(sch, p)
    vectorize = _vectorizable(sch, [blk])
    vec = _pow2_divisor(n, lanes) if vectorize else 1
    tile = _divisor_at_most(n // vec, POOL_REGISTER_TILE)
    po, pu, pv = sch.split(p, [None, tile, vec])
    sch.reorder(b, po, rp, rq, pu, pv)
    sch.parallel(sch.fuse(b, po))
    for loop in (rp, rq, pu):
        sch.unroll(loop)
    if vec > 1:
        sch.vectorize(pv)
    sch.decompose_reduction(blk, rp)
    _flat_nests(sch, consumers, lanes)  # the epilogue: its own nest (a tile of p is no rectangle of (c, i, j))


# ------------------------------------------------------------------------------------ elementwise
ELEMENTWISE_TILE = 128  # elements per parallel iteration at most (a staged fp32 tile < 1 KiB: stack)


def _flat_nest(sch: s_tir.Schedule, loops: list[Any], lanes: int) -> None:
    """Schedule one elementwise loop nest ``(batch, *static axes)`` (all blocks in it): see
    :func:`_schedule_flat`."""
    blocks = list(sch.get_child_blocks(loops[0]))
    batch, *dims = loops
    if not dims:
        raise ValueError("expected one batch axis followed by static axes")
    extents = [_static_extent(sch, d) for d in dims]
    per_sample = 1
    for e in extents:
        per_sample *= e
    if _vectorizable(sch, blocks):
        # fuse the trailing axes whose product has the widest power-of-two divisor, at most two:
        # TVM simplifies the flattened index of a fusion of two axes back to ``outer*vec + lane``
        # (a contiguous vector access), but not always one of three or more (it then emits a
        # gather with per-lane 64-bit division, measured 10x slower)
        n_fused = 2 if len(dims) >= 2 and _pow2_divisor(extents[-1] * extents[-2], lanes) > _pow2_divisor(
            extents[-1], lanes) else 1
        lead, tail = dims[:-n_fused], dims[-n_fused:]
        size = 1
        for e in extents[-n_fused:]:
            size *= e
        vec = _pow2_divisor(size, lanes)
        flat = sch.fuse(*tail) if len(tail) > 1 else tail[0]
        outer, inner = sch.split(flat, [None, vec])
        sch.parallel(sch.fuse(batch, *lead, outer))
        if vec > 1:
            sch.vectorize(inner)
    else:
        # a serial tile of at most ELEMENTWISE_TILE elements and half an example, inputs staged
        flat = sch.fuse(*dims) if len(dims) > 1 else dims[0]
        tile = _divisor_at_most(per_sample, max(1, min(ELEMENTWISE_TILE, per_sample // 2)))
        outer, _ = sch.split(flat, [None, tile])
        par = sch.fuse(batch, outer)
        sch.parallel(par)
        _stage_inputs(sch, blocks, par)


def _flat_nests(sch: s_tir.Schedule, blocks: Any, lanes: int) -> None:
    """:func:`_flat_nest` for each distinct loop nest holding one of ``blocks`` (the blocks of a
    multi-output compute share one nest)."""
    nests: dict[Any, list[Any]] = {}
    for block in blocks:
        loops = sch.get_loops(block)
        nests.setdefault(sch.get_sref(loops[0]), loops)
    for loops in nests.values():
        _flat_nest(sch, loops, lanes)


def _schedule_flat(sch: s_tir.Schedule, lanes: int) -> None:
    """Schedule every loop nest ``(batch, *static axes)`` of an elementwise kernel (no reduction;
    a multi-output compute is one nest with one block per output).

    The body does not care about the layout, so (vectorizable bodies) the last two static axes
    are fused when that widens the vector (e.g. LeNet relu1, 6x28x28: 28x28 = 16·49 -> 16 lanes
    where the row of 28 gave 4; not three axes, see the module docstring) and split ``(outer,
    vector)`` with ``vector`` the largest power of two dividing it up to the SIMD width; the
    batch, the leading axes and ``outer`` form the parallel loop (TVM hands each thread a
    contiguous range of it, so batch 1 keeps both cores busy).  A body that is not vectorizable
    gets serial tiles of at most :data:`ELEMENTWISE_TILE` elements and half an example over the
    fused static axes, with staged inputs.  The vector loop is always inside the static
    per-example axes, never the batch, whatever the batch (symbolic or a static 1).
    """
    _flat_nests(sch, sch.get_child_blocks(sch.get_sblock("root")), lanes)


@_register("avg_pool2d")
def schedule_avg_pool2d(sch: s_tir.Schedule, layer: Any, target: tvm.target.Target) -> None:
    """Average pooling: the window-sum reduction ``avg_pool2d`` (one or two outputs: mean and
    variance) runs parallel over (batch, channel) with the window loops unrolled inside the output
    columns (row-major window order, as the reference sums), the output columns vectorised when the
    body allows; the ``epilogue`` (scaling by the divisor) is an elementwise nest of its own."""
    lanes = simd_lanes(target)
    blk = sch.get_sblock("avg_pool2d" if _has_block(sch, "avg_pool2d") else "avg_pool2d_v0")
    epilogues = list(sch.get_consumers(blk))
    b, c, i, j, rp, rq = sch.get_loops(blk)
    sch.reorder(b, c, i, rp, rq, j)
    sch.parallel(sch.fuse(b, c))
    window = _static_extent(sch, rp) * _static_extent(sch, rq)
    if window <= CONV_MAX_UNROLLED_WINDOW:
        sch.unroll(rp)
        sch.unroll(rq)
    sch.decompose_reduction(blk, rp)
    _flat_nests(sch, epilogues, lanes)


@_register("relu", "convert", "leaky_relu", "affine", "add")
def schedule_elementwise(sch: s_tir.Schedule, layer: Any, target: tvm.target.Target) -> None:
    """Elementwise ops (ReLU/LeakyReLU moment matching, per-channel affine maps, sums of independent
    Gaussians, representation conversions): :func:`_schedule_flat`.

    A two-output ``te.compute`` lowers to two blocks (``<name>_v0``, ``<name>_v1``) in one loop
    nest.  ReLU moments (``fast_erf``, ``fast_exp``: no libm call, see ``_core``) vectorise like
    the conversions.
    """
    _schedule_flat(sch, simd_lanes(target))


# ------------------------------------------------------------------------------------ driver
def schedule_function(func: tirx.PrimFunc, op: str, layer: Any, target: tvm.target.Target
                      ) -> tirx.PrimFunc:
    """``func`` with the default schedule of PFP op ``op`` (``layer``: its planned layer, may be
    None; the schedules only read shapes from the PrimFunc itself); raises if a primitive fails."""
    fn = _schedule_fn(op)
    if fn is None:
        raise KeyError(f"no schedule registered for PFP op {op!r}")
    sch = s_tir.Schedule(func)
    fn(sch, layer, target)
    out = sch.mod["main"]
    if "global_symbol" not in (func.attrs or {}) and "global_symbol" in (out.attrs or {}):
        out = out.without_attr("global_symbol")
    return out.with_attr("tirx.is_scheduled", True)


def schedule_module(mod: tvm.IRModule, plan: Any, target: tvm.target.Target) -> tvm.IRModule:
    """Apply each op's registered default schedule to its PrimFunc (unregistered ops stay naive).

    PrimFuncs are matched to planned layers by their ``pfp.op`` / ``pfp.layer`` attributes
    (:func:`~pyro2pfp.tvm_backend._core.kernel_info`); functions that are already scheduled
    (``tirx.is_scheduled``) are left alone.  Returns a new module (``mod`` is not modified).  A
    schedule that raises leaves its function unscheduled and emits a ``RuntimeWarning`` naming it.
    """
    if not isinstance(target, tvm.target.Target):
        target = tvm.target.Target(target)
    from ._core import kernel_info

    out = mod.clone()
    layers = {layer.name: layer for layer in getattr(plan, "layers", ())}
    for gv in mod.get_global_vars():
        func = mod[gv]
        if not isinstance(func, tirx.PrimFunc):
            continue
        op, layer_name = kernel_info(func)
        layer = layers.get(layer_name) if layer_name is not None else None
        if op is None or _schedule_fn(op) is None:
            continue
        if func.attrs is not None and func.attrs.get("tirx.is_scheduled", False):
            continue
        try:
            out[gv] = schedule_function(func, op, layer, target)
        except Exception as err:  # noqa: BLE001 -- fail soft: keep the correct naive kernel
            lines = str(err).strip().splitlines()
            warnings.warn(f"pyro2pfp: the default schedule of {gv.name_hint} ({op}) failed, "
                          f"keeping it unscheduled: {type(err).__name__}: {lines[-1] if lines else ''}",
                          RuntimeWarning, stacklevel=2)
    return out
