"""Default CPU schedules for the PFP PrimFuncs (applied before building): the table, the shared
scheduling helpers and the driver.  Each op's schedule is registered next to its kernel in
``tvm_backend/ops/<family>.py``.

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
* **Only vectorise what TVM can vectorise** (:func:`vectorizable`): a call without a vector form
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

import functools
import warnings
from collections.abc import Callable
from typing import Any

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.sym.analyzer import Analyzer

from ..registry import add_to

ScheduleFn = Callable[[s_tir.Schedule, Any, tvm.target.Target], None]

SCHEDULES: dict[str, ScheduleFn] = {}
"""``{op: fn(sch, planned_layer, target)}``: the default CPU schedule of each PFP op, registered
next to its kernel (``tvm_backend/ops/<family>.py``) with :func:`schedule`."""


def _schedule_fn(op: str | None) -> ScheduleFn | None:
    return None if op is None else SCHEDULES.get(op)


#: ``@schedule(op, ...)`` registers the default CPU schedule of PFP ops (once each).
schedule = add_to(SCHEDULES, "CPU schedule of op")


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


# ------------------------------------------------------------------------------------ elementwise
ELEMENTWISE_TILE = 128  # elements per parallel iteration at most (a staged fp32 tile < 1 KiB: stack)


def flat_nest(sch: s_tir.Schedule, loops: list[Any], lanes: int) -> None:
    """Schedule one elementwise loop nest ``(batch, *static axes)`` (all blocks in it): see
    :func:`schedule_flat`."""
    blocks = list(sch.get_child_blocks(loops[0]))
    batch, *dims = loops
    if not dims:
        raise ValueError("expected one batch axis followed by static axes")
    extents = [static_extent(sch, d) for d in dims]
    per_sample = 1
    for e in extents:
        per_sample *= e
    if vectorizable(sch, blocks):
        # fuse the trailing axes whose product has the widest power-of-two divisor, at most two:
        # TVM simplifies the flattened index of a fusion of two axes back to ``outer*vec + lane``
        # (a contiguous vector access), but not always one of three or more (it then emits a
        # gather with per-lane 64-bit division, measured 10x slower)
        n_fused = 2 if len(dims) >= 2 and pow2_divisor(extents[-1] * extents[-2], lanes) > pow2_divisor(
            extents[-1], lanes) else 1
        lead, tail = dims[:-n_fused], dims[-n_fused:]
        size = 1
        for e in extents[-n_fused:]:
            size *= e
        vec = pow2_divisor(size, lanes)
        flat = sch.fuse(*tail) if len(tail) > 1 else tail[0]
        outer, inner = sch.split(flat, [None, vec])
        sch.parallel(sch.fuse(batch, *lead, outer))
        if vec > 1:
            sch.vectorize(inner)
    else:
        # a serial tile of at most ELEMENTWISE_TILE elements and half an example, inputs staged
        flat = sch.fuse(*dims) if len(dims) > 1 else dims[0]
        tile = divisor_at_most(per_sample, max(1, min(ELEMENTWISE_TILE, per_sample // 2)))
        outer, _ = sch.split(flat, [None, tile])
        par = sch.fuse(batch, outer)
        sch.parallel(par)
        stage_inputs(sch, blocks, par)


def flat_nests(sch: s_tir.Schedule, blocks: Any, lanes: int) -> None:
    """:func:`flat_nest` for each distinct loop nest holding one of ``blocks`` (the blocks of a
    multi-output compute share one nest)."""
    nests: dict[Any, list[Any]] = {}
    for block in blocks:
        loops = sch.get_loops(block)
        nests.setdefault(sch.get_sref(loops[0]), loops)
    for loops in nests.values():
        flat_nest(sch, loops, lanes)


def schedule_flat(sch: s_tir.Schedule, lanes: int) -> None:
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
    flat_nests(sch, sch.get_child_blocks(sch.get_sblock("root")), lanes)


# ------------------------------------------------------------------------------------ driver
SERIAL_WORK = 1e6
"""A kernel with static shapes (a static-batch executable: ``net.compile(batch_sizes=...)``, tuning)
whose arithmetic (:func:`kernel_work`) is below this many operations runs on
one thread: its schedule's ``parallel`` calls are dropped (:class:`_ParallelFilter`).  Waking the
thread pool and joining it costs more than splitting a few microseconds of work saves.  Measured
(median ``exe(x)`` of 300 calls, three runs each, 2 threads, quiet machine), shared-factor
ResNet-20, static batch 1: 2.20-2.37 ms with every kernel parallel, 2.01-2.07 ms with the 39 of
72 distinct kernels under 1e6 serial.  Kernels with a symbolic batch (the any-batch executable)
keep their parallel loops: their work is not known when they are compiled."""


SERIAL_BYTES = 1e5
"""A static kernel under :data:`SERIAL_WORK` operations keeps its parallel loops all the same when its
arguments (:func:`kernel_bytes`) reach this many bytes: a kernel that streams that much data with
little arithmetic per byte (a dense layer at batch 1 reads each weight once) runs faster with each core
reading part of it (from its own cache) than on one core.  Measured (median of the VM's ``main`` call,
static batch, the executables A/B in one process, 2 threads, znver4 VM, 2026-11-26), with this
threshold at inf / 1e6 / 5e5 / 2.5e5 / 1e5 bytes: MLP b1 10.9 / 10.8 /
7.7 / 7.7 / 7.7 µs (its 784x100 layer: 0.41 MB, 0.48 M operations), LeNet-5 b1 68.7 / 68.8 / 68.0 /
67.3 / 66.7 µs; at inf / 2.5e5 / 1e5 MLP b10 30.2 / 29.9 / 29.8 µs, LeNet-5 b10 271.5 / 272.5 /
272.0 µs; shared-factor ResNet-20 b1 3.23-3.36 / 3.23-3.33 / 3.18-3.31 ms and ResNet-8 b1 1.10 /
1.10 / 1.09 ms (fast phases of the VM) -- unchanged within the noise."""

NEST_SERIAL_WORK = 1e5
"""In a static-shape kernel that stays parallel, a parallel loop whose blocks do less than this many
operations (:func:`loop_work`) runs serially, as a whole kernel does under :data:`SERIAL_WORK`: a
kernel of many small loop nests (``sf_conv_load``: 15 parallel loops, most of 1e2-1e5 operations at
batch 1) otherwise wakes and joins the thread pool once per nest.  See :func:`schedule_function`.
The best threshold depends on the machine (how fast a core computes against what a fork-join costs).
Measured (median ``exe(x)``, static batch, the executables A/B in one process, 2 threads):
on the znver5 VM (2026-11-25, loaded, which favours serial code) shared-factor ResNet-20 b1 2.72-2.74 ms
with every loop parallel, 2.46 / 2.41 / 2.38 ms with this threshold at 1e5 / 3e5 / 1e6, LeNet-5 b10
0.291 / 0.286 / 0.280 / 0.277 ms; on the znver4 VM (2026-11-26, quiet; AVX-512 at half the width), with
both thresholds set to 0 / 1e5 / 3e5 / 1e6: LeNet-5 b10 0.269 / 0.271 / 0.282 / 0.325 ms, ResNet-20 b1
3.41-3.47 / 3.31-3.37 / 3.29-3.37 / 3.33-3.41 ms; with :data:`SERIAL_WORK` 1e6 and this one 1e5, LeNet-5
b10 0.269 ms (this threshold is what mattered) and ResNet-8 b10 13.2 ms against 13.8-14.0 at 1e6.  1e5 is
within 3 % of the best on both machines; 1e6 cost LeNet-5 20 % on the second."""


class _Unchecked:
    """A ``tvm.s_tir.Schedule`` whose primitives skip TVM's Python-side argument type checks.

    TVM wraps every ``Schedule`` primitive in ``s_tir.schedule._type_checker.type_checked``, which binds
    the call's arguments with ``inspect.Signature.bind`` and checks each against its annotation
    (formatting an error message for every alternative of a ``Union`` that does not match) before the
    C++ primitive runs.  For the default schedules that costs about as much as the primitives
    themselves (shared-factor ResNet-20, cProfile of ``schedule_module``: 1.8 of 2.1 s under the
    checked wrappers, the checks ~0.9 s of it).  The schedules here are fixed code, tested on every
    op: each primitive is called through the wrapper's ``__wrapped__`` (set by ``functools.wraps``),
    so the C++ primitive still validates its arguments and raises on misuse."""

    def __init__(self, sch: s_tir.Schedule) -> None:
        self._sch = sch
        self._methods: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        method = self._methods.get(name)
        if method is None:
            attr = getattr(type(self._sch), name, None)
            code = getattr(attr, "__code__", None)
            raw = getattr(attr, "__wrapped__", None)
            if raw is None or code is None or not code.co_filename.endswith("_type_checker.py"):
                return getattr(self._sch, name)  # not a type-checked primitive: as it is
            method = self._methods[name] = functools.partial(raw, self._sch)
        return method


class _ParallelFilter(_Unchecked):
    """A ``tvm.s_tir.Schedule`` (primitives unchecked, :class:`_Unchecked`) whose ``parallel``
    primitive is recorded (``self.loops``, in call order) and applied only where ``keep(i)`` of the
    call's index ``i`` is true (else the loop stays serial); every other primitive is the schedule's own."""

    def __init__(self, sch: s_tir.Schedule, keep: Callable[[int], bool] = lambda _i: True) -> None:
        super().__init__(sch)
        self._keep = keep
        self.loops: list[Any] = []

    def parallel(self, loop: Any) -> None:
        """Make ``loop`` parallel, unless its call is not kept."""
        index = len(self.loops)
        self.loops.append(loop)
        if self._keep(index):
            _Unchecked.__getattr__(self, "parallel")(loop)


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


def _blocks_work(sch: s_tir.Schedule, blocks: Any) -> float | None:
    total = 0.0
    count = 0

    def tally(node: Any) -> None:
        nonlocal count
        if isinstance(node, _ARITHMETIC + (tirx.Let,)):
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
        total += iterations * max(count, 1)
    return total


def schedule_function(func: tirx.PrimFunc, op: str, layer: Any, target: tvm.target.Target
                      ) -> tirx.PrimFunc:
    """``func`` with the default schedule of PFP op ``op`` (``layer``: its planned layer, may be
    None; the schedules only read shapes from the PrimFunc itself); raises if a primitive fails.
    A static-shape kernel whose :func:`kernel_work` is below :data:`SERIAL_WORK` and whose arguments
    are below :data:`SERIAL_BYTES` gets the schedule without its parallel loops; in the other
    static-shape kernels, the parallel loops doing less than
    :data:`NEST_SERIAL_WORK` operations in the scheduled kernel are left serial (the schedule is
    made again, skipping those ``parallel`` calls: a loop's work is known only once every block
    computed under it is in place)."""
    fn = _schedule_fn(op)
    if fn is None:
        raise KeyError(f"no schedule registered for PFP op {op!r}")
    sch = s_tir.Schedule(func)
    work = kernel_work(sch)
    if work is None:  # a symbolic extent (any batch): the work is unknown, every parallel loop stays
        fn(_Unchecked(sch), layer, target)
    elif work < SERIAL_WORK and kernel_bytes(sch) < SERIAL_BYTES:
        fn(_ParallelFilter(sch, keep=lambda _i: False), layer, target)
    else:
        recorded = _ParallelFilter(sch)
        fn(recorded, layer, target)
        small = set()
        for index, loop in enumerate(recorded.loops):
            try:
                loop_ops = loop_work(sch, loop)
            except Exception:  # noqa: BLE001 -- a loop handle a later primitive replaced: keep it parallel
                continue
            if loop_ops is not None and loop_ops < NEST_SERIAL_WORK:
                small.add(index)
        if small:
            sch = s_tir.Schedule(func)
            fn(_ParallelFilter(sch, keep=lambda i: i not in small), layer, target)
    out = sch.mod["main"]
    if "global_symbol" not in (func.attrs or {}) and "global_symbol" in (out.attrs or {}):
        out = out.without_attr("global_symbol")
    return out.with_attr("tirx.is_scheduled", True)


def schedule_module(mod: tvm.IRModule, plan: Any, target: tvm.target.Target,
                    on_scheduled: Callable[[str, tirx.PrimFunc], None] | None = None) -> tvm.IRModule:
    """Apply each op's registered default schedule to its PrimFunc (unregistered ops stay naive).

    PrimFuncs are matched to planned layers by their ``pfp.op`` / ``pfp.layer`` attributes
    (:func:`~pyro2pfp.tvm_backend._core.kernel_info`); functions that are already scheduled
    (``tirx.is_scheduled``) are left alone.  Returns a new module (``mod`` is not modified).  A
    schedule that raises leaves its function unscheduled and emits a ``RuntimeWarning`` naming it.
    ``on_scheduled(name, func)`` is called with each function as soon as it is scheduled, and with each
    function that came scheduled (e.g. :meth:`~pyro2pfp.tvm_backend.build.KernelPool.add`: LLVM compiles
    it while the next is scheduled).
    """
    if not isinstance(target, tvm.target.Target):
        target = tvm.target.Target(target)
    out = mod.clone()
    layers = layers_by_name(plan)
    for gv in mod.get_global_vars():
        func = mod[gv]
        if not isinstance(func, tirx.PrimFunc):
            continue
        scheduled = schedule_kernel(gv.name_hint, func, layers, target)
        if scheduled is None:
            continue
        if scheduled is not func:
            out[gv] = scheduled
        if on_scheduled is not None:
            on_scheduled(gv.name_hint, scheduled)
    return out


def layers_by_name(plan: Any) -> dict[str, Any]:
    """``{layer name: planned layer}`` of ``plan`` (what :func:`schedule_kernel` looks layers up in)."""
    return {layer.name: layer for layer in getattr(plan, "layers", ())}


def schedule_kernel(name: str, func: tirx.PrimFunc, layers: dict[str, Any], target: tvm.target.Target
                    ) -> tirx.PrimFunc | None:
    """Kernel ``name`` with its op's default schedule (:func:`schedule_function`; the op and layer
    from its attributes, ``layers`` from :func:`layers_by_name`): ``func`` itself if it came scheduled
    (hand-written TIR such as ``sf_cholesky``), None if its op has no schedule or the schedule raised
    (fail soft: the naive kernel is correct; a ``RuntimeWarning`` names it)."""
    from ._core import kernel_info

    if func.attrs is not None and func.attrs.get("tirx.is_scheduled", False):
        return func
    op, layer_name = kernel_info(func)
    layer = layers.get(layer_name) if layer_name is not None else None
    if op is None or _schedule_fn(op) is None:
        return None
    try:
        return schedule_function(func, op, layer, target)
    except Exception as err:  # noqa: BLE001 -- fail soft: keep the correct naive kernel
        lines = str(err).strip().splitlines()
        warnings.warn(f"pyro2pfp: the default schedule of {name} ({op}) failed, "
                      f"keeping it unscheduled: {type(err).__name__}: {lines[-1] if lines else ''}",
                      RuntimeWarning, stacklevel=3)
        return None
