"""How much a static-shape kernel computes and moves: the estimates the driver's serial/parallel
decision reads."""
from __future__ import annotations

from typing import Any

import tvm
from tvm import s_tir, tirx

from .primitives import extent, walk

_ARITHMETIC = (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.FloorDiv, tirx.Min, tirx.Max, tirx.Select,
               tvm.ir.expr.Call)


def kernel_work(sch: s_tir.Schedule) -> float | None:
    """The arithmetic of a static-shape kernel (the function of ``sch``, before it is scheduled): over
    its blocks, the iterations (product of the enclosing loop extents) times the arithmetic nodes of
    the block (a let-bound value counted once, as it is computed once); ``None`` when a loop extent
    is symbolic (the batch of an any-batch kernel).  (``tvm.s_tir.analysis.estimate_tir_flops``
    counts the same but rejects ``T.let``, which every ReLU and Clark max kernel binds.)"""
    return _blocks_work(sch, sch.get_child_blocks(sch.get_sblock("root")))


def kernel_bytes(sch: s_tir.Schedule) -> float:
    """Bytes of the buffers a static-shape kernel (the function of ``sch``) reads or writes that it
    does not allocate itself -- its arguments; ``inf`` if a shape is symbolic."""
    root = sch.get_sblock("root")
    seen = list(sch.get(root).alloc_buffers)  # intermediates: not counted
    total = 0.0
    for block in sch.get_child_blocks(root):
        for region in (*sch.get(block).reads, *sch.get(block).writes):
            buf = region.source
            if any(buf.same_as(b) for b in seen):
                continue
            seen.append(buf)
            size = float(tvm.DataType(buf.dtype).bits // 8)
            for dim in buf.shape:
                if not isinstance(dim, tirx.IntImm):
                    return float("inf")
                size *= int(dim)
            total += size
    return total


def loop_work(sch: s_tir.Schedule, loop: Any) -> float | None:
    """:func:`kernel_work` of the blocks under ``loop`` (each block's whole iteration space runs inside it)."""
    return _blocks_work(sch, sch.get_child_blocks(loop))


def _is_arithmetic(node: Any) -> bool:
    return isinstance(node, _ARITHMETIC + (tirx.Let,))


def _is_float_multiply(node: Any) -> bool:
    return isinstance(node, tirx.Mul) and "float" in str(node.ty)  # not index arithmetic


def _blocks_work(sch: s_tir.Schedule, blocks: Any, counted: Any = _is_arithmetic, least: int = 1) -> float | None:
    """Over ``blocks``: the iterations times the nodes of the block that are ``counted`` (at least
    ``least``); None when a loop extent is symbolic."""
    total = 0.0
    count = 0

    def tally(node: Any) -> None:
        nonlocal count
        if counted(node):
            count += 1

    for block in blocks:
        iterations = 1.0
        for loop in sch.get_loops(block):
            ext = extent(sch, loop)
            if ext is None:
                return None
            iterations *= ext
        count = 0
        walk(sch.get(block).body, tally)
        total += iterations * max(count, least)
    return total


def kernel_multiplies(func: tirx.PrimFunc) -> float | None:
    """Multiplications of a static-shape kernel as defined (before it is scheduled): over its blocks,
    the iterations times the floating-point ``Mul`` nodes of the block (a let-bound value counted once;
    index arithmetic not counted); ``None`` when a loop extent is symbolic.  What a profile calls a
    kernel's multiply-adds where no op-level count applies
    (:func:`pyro2pfp.backends.tvm.kernel_work.kernel_multiply_adds`)."""
    sch = s_tir.Schedule(func)
    return _blocks_work(sch, sch.get_child_blocks(sch.get_sblock("root")), _is_float_multiply, least=0)
