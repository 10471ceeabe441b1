"""The schedule of kernels made of many operators (the compact factor rules: ``backends/tvm/compact_factor.py``).

Such a kernel is one PrimFunc of many blocks, each one TE operator (``topi``: an elementwise op, a
slice, a reshape, an ``einsum``, a ``conv2d``, a sum), every intermediate tensor a buffer of its own.
:func:`schedule_fused`:

* **inlines** into elementwise consumers the blocks that only move data (slices, reshapes, transposes,
  padding, concatenations: no floating-point arithmetic) and any other elementwise block that its one
  consumer reads once -- never a block read twice (inlining would compute it twice, and a chain of such
  blocks -- a fold over a pooling window -- exponentially often), never into a consumer of more
  iterations than the block (a broadcast, e.g. a unit's slope applied to each of its factor columns,
  would compute it once per column), and nothing into a reduction: a
  reduction reads each input many times, from a plain contiguous buffer (an inlined concatenation is a
  chain of selects per read);
* **reductions** (``einsum``, ``conv2d``, sums) accumulate in registers: a tile of a few vectors of the
  innermost spatial axis times a few rows of the axis above it goes inside the reduction axes (the
  classic CPU matrix-product micro-kernel: every reduction step loads one row of vectors and
  multiply-adds it into each row's accumulators, which stay in registers for the whole reduction);
* **elementwise nests** are vectorised on their innermost axis where the body vectorises (fused with the
  axis above it when that widens the vector);
* a nest runs on the thread pool only when one example's share is large (:data:`PARALLEL_WORK`):
  most nests of a compact rule are a few hundred elements per example, where waking the pool costs
  more than the work.

Every step fails soft per block (the block keeps its naive, correct loops)."""
from __future__ import annotations

from typing import Any

import tvm
from tvm import s_tir, tirx

from ....planning.plan import PlannedLayer
from .primitives import divisor_at_most, extent, pow2_divisor, register_budget, simd_lanes, vectorizable, walk

REDUCTION_TILE = 4
"""At most this many vectors of a reduction's innermost output axis accumulate side by side (in registers)."""

PARALLEL_WORK = 32768
"""A loop nest runs in parallel when its static (per-example) iterations times its arithmetic reach this
many operations: below it a fork-join of the thread pool costs more than splitting the work saves."""

_FLOAT_ARITH = (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.Max, tirx.Min)


def _is_copy(block: Any) -> bool:
    """Whether ``block`` only moves data: no floating-point arithmetic and no call but ``if_then_else``."""
    ok = True

    def check(node: Any) -> None:
        nonlocal ok
        if isinstance(node, _FLOAT_ARITH) and "float" in str(node.ty):
            ok = False
        elif isinstance(node, tvm.ir.expr.Call) and isinstance(node.op, tvm.ir.Op) \
                and node.op.name != "tirx.if_then_else":
            ok = False

    walk(block.body, check)
    return ok


def _is_spatial(block: Any) -> bool:
    return all(iv.iter_type == tirx.IterVar.DataPar for iv in block.iter_vars)


def _iterations(block: Any) -> int:
    """The block's static iterations (a symbolic -- batch -- extent counts 1)."""
    n = 1
    for iv in block.iter_vars:
        ext = iv.dom.extent
        n *= int(ext) if isinstance(ext, tirx.IntImm | int) else 1
    return n


def _loads_of(block: Any, buffer: Any) -> int:
    count = 0

    def tally(node: Any) -> None:
        nonlocal count
        if isinstance(node, tvm.ir.expr.TensorLoad) and node.source.same_as(buffer):
            count += 1

    walk(block.body, tally)
    return count


def inline_blocks(sch: s_tir.Schedule) -> None:
    """Inline the blocks :func:`schedule_fused` may inline (module docstring), last first, so that a chain
    of them collapses into its final consumer."""
    params = list(sch.mod["main"].params)
    for block in reversed(list(sch.get_child_blocks(sch.get_sblock("root")))):
        stmt = sch.get(block)
        if not _is_spatial(stmt) or len(stmt.writes) != 1 or any(stmt.writes[0].source.same_as(p) for p in params):
            continue
        consumers = [sch.get(c) for c in sch.get_consumers(block)]
        if not consumers or not all(_is_spatial(c) for c in consumers):
            continue
        if not _is_copy(stmt):
            buffer = stmt.writes[0].source
            if len(consumers) != 1 or not _is_spatial(consumers[0]) or _loads_of(consumers[0], buffer) != 1 \
                    or _iterations(consumers[0]) > _iterations(stmt):  # a broadcast: it would compute it again
                continue
        try:
            sch.compute_inline(block)
        except Exception:  # noqa: BLE001 -- e.g. a consumer that reads a region: keep the block
            continue


def _static_work(sch: s_tir.Schedule, loops: list[Any], block: Any) -> float:
    """Iterations of the static loops times the block's arithmetic (per example: symbolic loops count 1)."""
    iterations = 1.0
    for loop in loops:
        n = extent(sch, loop)
        iterations *= 1 if n is None else n
    ops = 0

    def tally(node: Any) -> None:
        nonlocal ops
        if isinstance(node, _FLOAT_ARITH) and "float" in str(node.ty):
            ops += 1

    walk(sch.get(block).body, tally)
    return iterations * max(ops, 1)


def _parallel_outer(sch: s_tir.Schedule, loops: list[Any], keep_inner: int) -> None:
    """The outer loops (all but the last ``keep_inner``; at least the batch loop and one more when there are
    two) fused into one parallel loop."""
    outer = loops[:max(1, min(2, len(loops) - keep_inner))]
    sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])


def schedule_reduction(sch: s_tir.Schedule, block: Any, lanes: int) -> None:
    """A reduction nest (module docstring): spatial loops outside, then the reduction loops, then a
    register tile -- a few vectors of the innermost spatial axis times a few rows of the one above it
    (unrolled) -- the vectors innermost; the accumulators initialised in their own loop."""
    stmt = sch.get(block)
    loops = list(sch.get_loops(block))
    kinds = [iv.iter_type for iv in stmt.iter_vars]
    n_spatial = sum(k == tirx.IterVar.DataPar for k in kinds)
    spatial, reduce = loops[:n_spatial], loops[n_spatial:]
    if len(spatial) + len(reduce) != len(loops) or not reduce or not spatial:
        return
    work = _static_work(sch, loops, block)
    inner = spatial[-1]
    n_inner = extent(sch, inner)
    vec = pow2_divisor(n_inner, lanes) if n_inner is not None and len(spatial) > 1 else 1
    if vec >= 4 and n_inner is not None and all(extent(sch, r) is not None for r in reduce):
        budget = register_budget(lanes)
        tile = divisor_at_most(n_inner // vec, REDUCTION_TILE)
        outer_i, tile_i, vector = sch.split(inner, [None, tile, vec])
        above = spatial[-2] if len(spatial) > 2 else None  # (spatial[0] is the batch)
        n_above = extent(sch, above) if above is not None else None
        rows = divisor_at_most(n_above, budget // tile) if n_above is not None else 1
        if above is not None and rows > 1:
            outer_r, tile_r = sch.split(above, [None, rows])
            sch.reorder(outer_r, outer_i, *reduce, tile_r, tile_i, vector)
            unrolled = [tile_r, tile_i]
        else:
            sch.reorder(outer_i, *reduce, tile_i, vector)
            unrolled = [tile_i]
    else:
        vector, unrolled = None, []
    if work >= PARALLEL_WORK and len(spatial) > 1:
        _parallel_outer(sch, list(sch.get_loops(block))[:len(spatial) - 1], 0)
    if vector is not None:  # (parallel and vectorize first: TVM checks them on a whole reduction block)
        sch.vectorize(vector)
        for loop in unrolled:
            sch.unroll(loop)
        sch.decompose_reduction(block, reduce[0])


def schedule_elementwise(sch: s_tir.Schedule, block: Any, lanes: int) -> None:
    """An elementwise nest: its innermost loop vectorised (when the body vectorises), the outer loops
    parallel when the nest is large (:data:`PARALLEL_WORK`)."""
    loops = list(sch.get_loops(block))
    work = _static_work(sch, loops, block)
    n = extent(sch, loops[-1])
    if len(loops) > 2 and n is not None and pow2_divisor(n, lanes) < 4:
        m = extent(sch, loops[-2])
        if m is not None and pow2_divisor(m * n, lanes) > pow2_divisor(n, lanes):  # e.g. (16, 100, 1), (10, 10)
            loops = [*loops[:-2], sch.fuse(*loops[-2:])]  # (two axes: TVM simplifies their flat index)
            n = m * n
    vectorized = False
    if len(loops) > 1 and n is not None and n >= 4 and vectorizable(sch, [block]) and not _is_copy(sch.get(block)):
        vec = pow2_divisor(n, lanes)
        if vec >= 4:
            if vec < n:
                _, vi = sch.split(loops[-1], [None, vec])
            else:
                vi = loops[-1]
            sch.vectorize(vi)
            vectorized = True
    if work >= PARALLEL_WORK:
        loops = list(sch.get_loops(block))
        outer = loops[:-1] if vectorized else loops
        if len(outer) > 1:
            _parallel_outer(sch, outer, 0)


def schedule_fused(sch: s_tir.Schedule, layer: PlannedLayer | None, target: tvm.target.Target) -> None:
    """The default schedule of a kernel made of many operators (module docstring)."""
    lanes = simd_lanes(target)
    inline_blocks(sch)
    for block in list(sch.get_child_blocks(sch.get_sblock("root"))):
        try:
            if _is_spatial(sch.get(block)):
                schedule_elementwise(sch, block, lanes)
            else:
                schedule_reduction(sch, block, lanes)
        except Exception:  # noqa: BLE001, PERF203 -- fail soft per block: its naive loops are correct
            continue
