"""The scheduling helpers every op's schedule uses: SIMD width, divisors, vectorisability, inner-loop
vectorisation, epilogues under the parallel loop, staged inputs."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.sym.analyzer import Analyzer


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


def extent(sch: s_tir.Schedule, loop: Any) -> int | None:
    """Static extent of a loop, or None for a symbolic (batch) extent."""
    ext = sch.get(loop).extent
    return int(ext) if isinstance(ext, tirx.IntImm | int) else None


def static_extent(sch: s_tir.Schedule, loop: Any) -> int:
    """Static extent of a loop that is not the batch axis (a symbolic one is a bug of the caller)."""
    ext = extent(sch, loop)
    if ext is None:
        raise ValueError(f"loop {sch.get(loop)} has a symbolic extent; only the batch axis may")
    return ext


def vector_width(sch: s_tir.Schedule, loop: Any, lanes: int) -> int:
    """The largest power of two up to ``lanes`` that divides the loop's extent -- for a symbolic
    extent, one the arithmetic analyser proves divides it (a factor width ``k16 * 16``), else 1."""
    ext = sch.get(loop).extent
    if isinstance(ext, tirx.IntImm | int):
        return pow2_divisor(int(ext), lanes)
    analyzer = Analyzer()
    width = lanes
    while width > 1 and not analyzer.can_prove(tirx.floormod(ext, width) == 0):
        width //= 2
    return width


def pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two that divides ``n`` and is at most ``cap``."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def divisor_at_most(n: int, cap: int) -> int:
    """Largest divisor of ``n`` that is at most ``cap`` (at least 1)."""
    for d in range(max(1, min(n, cap)), 0, -1):
        if n % d == 0:
            return d
    return 1


ALWAYS_VECTORIZABLE = {"prim.likely", "tirx.reinterpret"}  # VectorizeLoop handles these itself


def vectorizable(sch: s_tir.Schedule, blocks: list[Any]) -> bool:
    """Whether ``VectorizeLoop`` turns the bodies of ``blocks`` into real vector code.

    A call without the ``TVectorizable`` op attribute (``erf``, which becomes a libm ``erff``
    call; ``if_then_else``) makes TVM scalarise the vector loop.  That gains nothing and, in TVM
    0.27, is wrong for blocks that bind ``T.let`` values (the scalarised lets are followed by a
    store of the *last* lane's value broadcast to every lane), so such loops stay serial.
    """
    ok = True

    def check(node: Any) -> None:
        nonlocal ok
        if isinstance(node, tvm.ir.expr.Call) and isinstance(node.op, tvm.ir.Op):
            if node.op.name not in ALWAYS_VECTORIZABLE and not node.op.get_attr("TVectorizable"):
                ok = False

    for block in blocks:
        walk(sch.get(block), check)
    return ok


def walk(root: Any, fn: Callable[[Any], None]) -> None:
    """``fn(node)`` for every node of the TIR tree ``root``.  A chain of lets (``te_shared`` binds
    hundreds in the smooth activations) is walked in a loop, since recursing through it in the
    Python callback exceeds Python's recursion limit."""
    def visit(node: Any, visitor: Any) -> None:
        while isinstance(node, tirx.Let):
            fn(node)
            tvm_ffi.structural_visit(node.value, visit)
            node = node.body
        fn(node)
        visitor.default_visit(node)

    tvm_ffi.structural_visit(root, visit)


def vectorize_inner(sch: s_tir.Schedule, block: Any, lanes: int, below: Any = None) -> None:
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
    n = extent(sch, inner)
    if n is None or n < 2 or not vectorizable(sch, [block]):
        return
    vec = pow2_divisor(n, lanes)
    if vec > 1:
        _, vi = sch.split(inner, [None, vec])
        sch.vectorize(vi)


def epilogue_at(sch: s_tir.Schedule, producer: Any, loop: Any, lanes: int) -> None:
    """Move the consumers of ``producer`` (the epilogue) under ``loop`` -- whose iterations must
    each produce a rectangle of the intermediate -- and vectorise their innermost loop."""
    consumers = list(sch.get_consumers(producer))
    for block in consumers:
        sch.reverse_compute_at(block, loop)
    for block in consumers:
        vectorize_inner(sch, block, lanes, below=loop)


def stage_inputs(sch: s_tir.Schedule, blocks: list[Any], loop: Any) -> None:
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


def register_budget(lanes: int) -> int:
    """Vector registers a register tile of accumulators may use (32 with AVX-512, else 16),
    leaving a few for operands."""
    return 24 if lanes >= 16 else 12


def has_block(sch: s_tir.Schedule, name: str) -> bool:
    return any(sch.get(block).name_hint == name for block in sch.get_child_blocks(sch.get_sblock("root")))

