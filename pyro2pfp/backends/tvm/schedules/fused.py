"""The schedule of kernels made of many operators (the compact factor rules: ``backends/tvm/compact_factor.py``).

Such a kernel is one PrimFunc of many blocks, each one TE operator (``topi``: an elementwise op, a
slice, a reshape, an ``einsum``, a ``conv2d``, a sum), every intermediate tensor a buffer of its own.
:func:`schedule_fused`:

* **inlines** into elementwise consumers the blocks that only move data (slices, reshapes, transposes,
  padding, concatenations: no floating-point arithmetic) and any other elementwise block that its one
  consumer reads once -- never a block read twice (inlining would compute it twice, and a chain of such
  blocks -- a fold over a pooling window -- exponentially often), and nothing into a reduction: a
  reduction reads each input many times, from a plain contiguous buffer (an inlined concatenation is a
  chain of selects per read);
* **reductions** (``einsum``, ``conv2d``, sums) accumulate in their output: the innermost spatial axis
  goes inside the reduction axes and is vectorised (the classic CPU matrix-product loop order: every
  reduction step is one vector multiply-add over contiguous outputs);
* **elementwise nests** are vectorised on their innermost axis where the body vectorises;
* a nest runs on the thread pool only when one example's share is large (:data:`PARALLEL_WORK`):
  most nests of a compact rule are a few hundred elements per example, where waking the pool costs
  more than the work.

Every step fails soft per block (the block keeps its naive, correct loops)."""
from __future__ import annotations

from typing import Any

import tvm
from tvm import s_tir, tirx

from ....planning.plan import PlannedLayer
from .primitives import extent, pow2_divisor, simd_lanes, vectorizable, walk

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
            if len(consumers) != 1 or not _is_spatial(consumers[0]) or _loads_of(consumers[0], buffer) != 1:
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
    """A reduction nest (module docstring): spatial loops outside, then the reduction loops, then the
    innermost spatial loop, vectorised; the accumulator initialised in its own loop."""
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
        sch.reorder(*reduce, inner)
        if vec < n_inner:
            _, vector = sch.split(inner, [None, vec])
        else:
            vector = inner
    else:
        vector = None
    if work >= PARALLEL_WORK and len(spatial) > 1:
        _parallel_outer(sch, list(sch.get_loops(block))[:len(spatial) - 1], 0)
    if vector is not None:  # (parallel and vectorize first: TVM checks them on a whole reduction block)
        sch.vectorize(vector)
        sch.decompose_reduction(block, reduce[0])


def schedule_elementwise(sch: s_tir.Schedule, block: Any, lanes: int) -> None:
    """An elementwise nest: its innermost loop vectorised (when the body vectorises), the outer loops
    parallel when the nest is large (:data:`PARALLEL_WORK`)."""
    loops = list(sch.get_loops(block))
    work = _static_work(sch, loops, block)
    n = extent(sch, loops[-1])
    vectorized = False
    if len(loops) > 1 and n is not None and n >= 4 and vectorizable(sch, [block]):
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
