"""The default CPU schedule of the shared-factor kernels (:mod:`pyro2pfp.backends.tvm.shared_factor`):
:func:`schedule_shared`, registered for each ``sf_<part>`` op beside the rule that emits it."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import tvm
from tvm import s_tir

from ...planning.plan import PlannedLayer
from .emit import OP_ATTR
from .ops.winograd import schedule_weight_transforms
from .schedules import (
    divisor_at_most,
    extent,
    pow2_divisor,
    register_budget,
    simd_lanes,
    static_extent,
    vector_width,
    vectorizable,
    vectorize_inner,
)

MATMUL_BLOCKS = ("beta", "prop")
"""Blocks ``out[b, o, n] = Σ_r x[b, o|r, r]·y[b, r, n]`` whose last axis ``n`` is unit-stride in the
operand that depends on it (``β`` reads ``g_in`` transposed; the loadings' ``prop`` reads ``g_in``):
register tiles, :func:`tiled_product`."""

ROW_LOCAL_OPS = ("sf_relu", "sf_add", "sf_scale")
"""Kernels whose every block is indexed ``(batch, row, ...)`` and reads only its own row of the
other blocks' results: all their loop nests are merged into one parallel loop over (batch x row)
(``Schedule.merge``), so a row's intermediates (Stein's terms, the loading) stay in a thread-private
tile instead of a (B, R, ...) buffer written and re-read by the next nest."""

ROW_GROUPS = {
    "sf_conv_load": (("cols0", "bar0", "cols1", "bar1", "amap", "widened"),),
    "sf_dense_load": (("inj", "loading", "peak", "inv_peak", "sq", "g_scale", "g", "norm", "pn", "ws2", "var", "s"),),
}
"""Per op, groups of blocks whose consecutive loop nests are each indexed ``(batch, row, ...)`` over the
same rows and read only their own row of each other's results: each group's nests are merged into one
parallel loop over (batch x row), like the nests of a :data:`ROW_LOCAL_OPS` kernel: one parallel loop
(an LLVM function, its closure and its launch) instead of several.  ``sf_conv_load``: the pooled views
of ``μ`` and ``s_in``, ``A = W·m̄s`` and ``g_in`` widened (a row per input channel); ``sf_dense_load``:
its loading, normalisation, variance and profile (a row per output).  ``sf_conv_load``'s loading and
normalisation (:func:`normalised`) are not merged: per row they are one chain of dependent
reductions (``max |ℓ|``, then ``Σ (ℓ/p)²``, each ending in a sum of 16 lanes), which a loop over the
rows of each stage overlaps and one loop over rows does not (merged, the kernel is slower; tiles of
rows would win the overlap back only with unrolled copies that cost as much code as the separate
loops)."""

VECTOR_ROW_BLOCKS = ("wsum", "amap")
"""Blocks ``out[.., o] = Σ_{c,i,j} x[.., c, i, j]·W[c, i, j, o]`` whose last (output-channel) axis is
unit-stride in the ``(C, KH, KW, O)`` weights: a vector over ``o``, :func:`vector_rows`."""


@dataclass
class _Merge:
    """Loop nests to be merged into one parallel loop (:func:`schedule_shared`): the leading (batch x
    row) loop of each, and the reduction blocks whose init is split off after the merge, each with
    the position of its loop from the innermost (``decompose_reduction`` at ``get_loops(block)[-depth]``)."""

    leads: list[Any]
    deferred: list[tuple[Any, int]]

    def finish(self, sch: s_tir.Schedule) -> None:
        """Merge the leads, parallelise the merged loop, then split off the deferred inits (parallel
        first: a loop over an init block and its update block, which write the same buffer, does
        not pass parallel's dataflow check)."""
        if not self.leads:
            return
        sch.parallel(sch.merge(*self.leads) if len(self.leads) > 1 else self.leads[0])
        for block, depth in self.deferred:
            sch.decompose_reduction(block, sch.get_loops(block)[-depth])


def _depth(sch: s_tir.Schedule, block: Any, loop: Any) -> int:
    """Position of ``loop`` among the loops of ``block``, counted from the innermost (1)."""
    refs = [sch.get_sref(lp) for lp in sch.get_loops(block)]
    target = sch.get_sref(loop)
    return len(refs) - next(k for k, ref in enumerate(refs) if ref.same_as(target))


def schedule_shared(sch: s_tir.Schedule, layer: PlannedLayer | None, target: tvm.target.Target) -> None:
    """Every loop nest of a shared-factor kernel.  The pooling blocks (``cols*``/``bar*`` of
    ``sf_conv_load``) get :func:`schedule_pooling`, the products of :data:`MATMUL_BLOCKS`
    :func:`tiled_product`, those of :data:`VECTOR_ROW_BLOCKS` :func:`vector_rows`, row sums
    :func:`vector_reduction`; any other nest has its first two data-parallel loops (the batch and
    the channel/row axis) fused into one parallel loop and, if elementwise, its last axis vectorised
    (split by the largest power of two dividing it, up to the SIMD width).  The nests of a
    :data:`ROW_LOCAL_OPS` kernel, and those of each :data:`ROW_GROUPS` group, are then merged into
    one parallel loop.  The Winograd weight transforms of ``sf_conv_weights`` (and the weights they
    transform) get :func:`~.winograd.schedule_weight_transforms` instead."""
    lanes = simd_lanes(target)
    done = schedule_weight_transforms(sch, lanes)  # Winograd-transformed conv weights (sf_conv_weights)
    attrs = sch.mod["main"].attrs
    op = str(attrs.get(OP_ATTR, "")) if attrs is not None else ""
    everything = _Merge([], []) if op in ROW_LOCAL_OPS else None  # a row-local kernel: all its nests
    groups: dict[str, _Merge] = {}  # block name -> its group's merge
    for names in ROW_GROUPS.get(op, ()):
        shared = _Merge([], [])
        groups.update({name: shared for name in names})

    def merge_of(name: str) -> _Merge | None:
        return everything if everything is not None else groups.get(name)

    root = sch.get_sblock("root")
    for block in list(sch.get_child_blocks(root)):
        name = sch.get(block).name_hint
        if name.startswith("bar"):
            _schedule_pooling(sch, block, lanes, merge_of(name))
    nests: dict[Any, Any] = {}
    for block in sch.get_child_blocks(root):
        name = sch.get(block).name_hint
        if name.startswith(("bar", "cols")) or name in done:
            continue
        nests.setdefault(sch.get_sref(sch.get_loops(block)[0]), block)
    for block in nests.values():
        loops = sch.get_loops(block)  # now: an rfactor of an earlier nest renews the loops of the others
        name = sch.get(block).name_hint
        merge = merge_of(name)
        if name in MATMUL_BLOCKS and len(loops) == 4:
            _tiled_product(sch, block, lanes)
            continue
        if name in VECTOR_ROW_BLOCKS:
            _vector_rows(sch, block, lanes, merge)
            continue
        if _vector_reduction(sch, block, loops, lanes, merge=merge):
            continue
        spatial = sum(1 for iv in sch.get(block).iter_vars if int(iv.iter_type) == 0)
        lead = loops[:max(1, min(2, spatial))]
        fused = sch.fuse(*lead) if len(lead) > 1 else lead[0]
        if merge is not None:
            merge.leads.append(fused)
        else:
            sch.parallel(fused)
        if spatial == len(loops) > 2 and vectorizable(sch, [block]):  # elementwise: vectorise the last axis
            last = loops[-1]
            if len(loops) == 4 and pow2_divisor(static_extent(sch, loops[2]) * static_extent(sch, last), lanes
                                                ) > pow2_divisor(static_extent(sch, last), lanes):
                last = sch.fuse(loops[2], last)  # a row's 8 x 8 positions: vectors of 16, not 8
            vec = vector_width(sch, last, lanes)  # the factor axis may be symbolic (k16 * 16)
            if vec > 1:
                sch.vectorize(sch.split(last, [None, vec])[1])
    merges = [everything] if everything is not None else list({id(m): m for m in groups.values()}.values())
    for group in merges:
        group.finish(sch)


def _schedule_pooling(sch: s_tir.Schedule, bar: Any, lanes: int, merge: _Merge | None = None) -> None:
    """One pooled view of ``sf_conv_load`` (``cols`` → ``bar``): one parallel loop over (batch x
    channel) computing that channel's ``cols`` (``KH x W``, a thread-private stack tile: the
    output-row sum with the rows outer and the unit-stride ``x`` vectorised, no horizontal sums)
    and its ``KH x KW`` means (the ``x`` reduction with vector partial sums,
    :func:`vector_reduction`).  Reads each input once, memory-bound.  ``merge``: the (batch x
    channel) loop is left serial and added to it (as are the inits to split off)."""
    cols = sch.get_producers(bar)[0]
    if not _vector_reduction(sch, bar, sch.get_loops(bar), lanes, merge=merge):
        b, ch, *_ = sch.get_loops(bar)
        fused = sch.fuse(b, ch)
        if merge is None:
            sch.parallel(fused)
        else:
            merge.leads.append(fused)
    fused = sch.get_loops(bar)[0]
    sch.compute_at(cols, fused)
    xx, y = sch.get_loops(cols)[-2:]  # (kernel row,) x, output row (a kernel row of 1 has no loop)
    sch.reorder(y, xx)
    if vectorizable(sch, [cols]):
        vec = pow2_divisor(static_extent(sch, xx), lanes)
        if vec > 1:
            sch.vectorize(sch.split(xx, [None, vec])[1])
    if merge is None:
        sch.decompose_reduction(cols, y)
    else:
        merge.deferred.append((cols, _depth(sch, cols, y)))


def _vector_rows(sch: s_tir.Schedule, block: Any, lanes: int, merge: _Merge | None = None) -> None:
    """A :data:`VECTOR_ROW_BLOCKS` block ``(lead..., o | reductions)``: the reductions moved outside
    ``o``, which is vectorised (and its vectors unrolled), the accumulators a thread-private tile of
    one row of ``o`` (``cache_write``), the leading loops fused into the parallel loop (``merge``:
    into a serial loop added to it, the init split off after the merge)."""
    loops = sch.get_loops(block)
    n_spatial = sum(1 for iv in sch.get(block).iter_vars if int(iv.iter_type) == 0)
    *lead, last = loops[:n_spatial]
    reductions = loops[n_spatial:]
    n = static_extent(sch, last)
    vec = pow2_divisor(n, lanes) if vectorizable(sch, [block]) else 1
    tile = sch.cache_write(block, 0, "global")
    sch.reorder(*lead, *reductions, last)
    par = sch.fuse(*lead) if len(lead) > 1 else lead[0]
    if merge is None:
        sch.parallel(par)
    else:
        merge.leads.append(par)
    sch.reverse_compute_at(tile, par)
    vectorize_inner(sch, tile, lanes, below=par)
    if vec > 1:
        outer, inner = sch.split(last, [None, vec])
        if n // vec <= register_budget(lanes):
            sch.unroll(outer)
        sch.vectorize(inner)
    if merge is None:
        sch.decompose_reduction(block, reductions[0])
    else:
        merge.deferred.append((block, _depth(sch, block, reductions[0])))


def _tiled_product(sch: s_tir.Schedule, block: Any, lanes: int) -> None:
    """A :data:`MATMUL_BLOCKS` product ``out[b, o, n] = Σ_r x[b, o, r]·y[b, r, n]`` as register
    tiles: ``om`` rows x ``jm`` vectors of the unit-stride ``n`` accumulated over the whole ``r``
    in a thread-private tile (``cache_write``, written back after the reduction), rows and vectors
    unrolled; the parallel loop runs over (batch x row tiles x column tiles), so batch 1 has
    ``O/om · N/(jm·vec)`` tasks.  Per ``r``: ``jm`` vector loads of ``y``, ``om`` broadcasts of
    ``x``, ``om·jm`` FMAs -- instead of a load and a store of the accumulator per FMA when a whole
    row of ``n`` is the accumulator, which makes these products compute-bound instead of bound by the
    accumulator's memory traffic."""
    b, o, n, r = sch.get_loops(block)
    n_ext, o_ext = extent(sch, n), static_extent(sch, o)  # n: a factor axis may be symbolic (k16 * 16)
    vec = vector_width(sch, n, lanes) if vectorizable(sch, [block]) else 1
    jm = divisor_at_most(n_ext // vec, 2) if n_ext is not None else 1
    om = divisor_at_most(o_ext, max(1, register_budget(lanes) // jm))
    tile = sch.cache_write(block, 0, "global")
    oo, oi = sch.split(o, [None, om])
    no, nm, nv = sch.split(n, [None, jm, vec])
    sch.reorder(b, oo, no, r, oi, nm, nv)
    par = sch.fuse(b, oo, no)
    sch.parallel(par)
    sch.reverse_compute_at(tile, par)
    vectorize_inner(sch, tile, lanes, below=par)
    sch.unroll(oi)
    sch.unroll(nm)
    if vec > 1:
        sch.vectorize(nv)
    sch.decompose_reduction(block, r)


def _vector_reduction(sch: s_tir.Schedule, block: Any, loops: list[Any], lanes: int,
                      merge: _Merge | None = None) -> bool:
    """Schedule a block whose reductions are its innermost loops (a row sum: the positions' mean of
    Stein's terms, ``‖ℓ‖²`` over the factors, a branch's mean profile, the weight-variance sum over
    channels and kernel offsets; several reduction loops are fused into one) with ``vec`` partial sums:
    the reduction split into ``(r_o, r_i)`` with ``r_i`` the largest power of two dividing it (up to
    the SIMD width), ``rfactor`` over ``r_i`` so the partial sums are a vector (``r_i`` vectorised,
    ``r_o`` serial), then the ``vec`` partial sums added per row under the same parallel loop.  A
    serial float32 sum is one dependent add per element (the adder's latency, ~4 cycles); this is
    ``vec`` independent ones per vector, so a long row sum runs at the adder's throughput instead.
    Changes the summation order only.  False (nothing done) for any other block.

    ``merge``: the loop is neither parallelised nor the partial sums' init split off; the loop and
    the partial-sum block are added to ``merge``, which does both after merging its loop nests."""
    kinds = [int(iv.iter_type) for iv in sch.get(block).iter_vars]
    n_spatial = kinds.index(2) if 2 in kinds else len(kinds)
    if (len(kinds) != len(loops) or n_spatial == 0 or n_spatial == len(kinds)
            or any(k != 0 for k in kinds[:n_spatial]) or any(k != 2 for k in kinds[n_spatial:])):
        return False
    sizes = [extent(sch, loop) for loop in loops[n_spatial:]]
    if None in sizes:  # a symbolic factor axis (k16 * 16): vectors if it is the only reduction
        if len(sizes) > 1:
            return False
        vec = vector_width(sch, loops[n_spatial], lanes)
        length = 2 * vec  # at least one vector (the widths are >= FACTOR_ALIGN)
    else:
        length = math.prod(s for s in sizes if s is not None)
        vec = pow2_divisor(length, lanes)
    if vec < 4 or length < 2 * vec or not vectorizable(sch, [block]):
        return False
    # several trailing reductions (e.g. over channel and kernel offsets) are one row-major sum
    reduction = sch.fuse(*loops[n_spatial:]) if len(loops) - n_spatial > 1 else loops[-1]
    inner = sch.split(reduction, [None, vec])[1]
    partial = sch.rfactor(inner, factor_axis=n_spatial)  # loops: spatial..., r_o, r_i (new handles)
    lead = sch.get_loops(partial)[:min(2, n_spatial)]
    fused = sch.fuse(*lead) if len(lead) > 1 else lead[0]
    if merge is None:
        sch.parallel(fused)
    sch.vectorize(sch.get_loops(partial)[-1])
    if merge is None:
        sch.decompose_reduction(partial, sch.get_loops(partial)[-2])
    else:
        merge.leads.append(fused)
        merge.deferred.append((partial, 2))
    sch.reverse_compute_at(block, fused)
    # the sum of the partial sums: lanes innermost, so each output sums one contiguous vector (with
    # the lanes outer, LLVM turns the loop over several outputs, e.g. the 3 x 3 of a pooled view,
    # into gathers: more code and a slower kernel)
    loops = sch.get_loops(block)
    inner = loops[len(loops) - _depth(sch, block, fused) + 1:]  # (lane, spatial...)
    if len(inner) > 1:
        sch.reorder(*inner[1:], inner[0])
    return True
