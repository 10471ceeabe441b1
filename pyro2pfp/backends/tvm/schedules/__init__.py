"""Default CPU schedules for the PFP PrimFuncs (applied before building).  Each op's schedule is
registered next to its kernel in ``backends/tvm/ops/<family>.py``; this package holds the table
(:mod:`~.table`), the shared scheduling helpers (:mod:`~.primitives`), the elementwise schedule
(:mod:`~.elementwise`), the work estimates (:mod:`~.work`) and the driver (:mod:`~.driver`), and
re-exports their names.

Every PFP layer becomes one PrimFunc ``pfp_<op>_<layer>`` whose first axis is the *symbolic*
batch.  MetaSchedule only tunes static shapes, so these are hand-written, shape-generic
``tvm.s_tir.Schedule`` programs.  They only ever split *static* axes; the batch axis is fused into
the parallel loop, so one compiled kernel serves every batch size and no split of the batch needs
a predicate (a split of the symbolic batch by a register-tile factor is slower at every batch size
because of the predicate it puts in the inner loop).

Rules shared by all schedules, and why:

* **Parallel over an outer axis**: ``fuse(batch, <outer static tiles>)`` -> ``parallel``, so batch
  1 still gives both cores work and large batches give many evenly divided chunks.
* **Vectorise a unit-stride inner axis by a width that divides it**.  A split that does not divide
  its extent puts a predicate inside the vector loop and TVM falls back to scalar code; a width that is
  not a power of two (e.g. a whole row of 20 or 50) makes LLVM
  shuffle the accumulators lane by lane.  So the width is the largest power of two dividing the
  extent, capped at the SIMD width (16 fp32 lanes with AVX-512, 8 with AVX, else 4), and several
  such vectors are unrolled side by side to form a register tile.
* **Only vectorise what TVM can vectorise** (:func:`vectorizable`): a call without a vector form
  (e.g. ``if_then_else`` loads of padded pooling windows, a libm call) makes ``VectorizeLoop``
  scalarise the loop, which in TVM 0.27 is *miscompiled* when the block binds ``T.let`` values
  (all lanes get the last lane's value).  Such loops stay serial.  ``erf`` and ``exp`` are
  ``fast_math.fast_erf``/``fast_exp`` (plain arithmetic), so ReLU moments and Clark's max vectorise.
* **Vector accesses must stay contiguous**: a vector over several fused axes is only contiguous
  if TVM simplifies the flattened index back to ``outer*vec + lane``; it reliably does for a
  fusion of two axes but not always for three, and otherwise emits a gather with per-lane 64-bit
  division (slower than the scalar loop it replaces).
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
  call and shares fewer ``erf``/``exp`` values between the mean and the variance output.  Reading from a
  thread-private stack tile (< 1 KiB) avoids that.

Everything fails soft: if a primitive raises for a function, a warning names the function and the
unscheduled (correct, slower) PrimFunc is kept.  Ops without an entry in :data:`SCHEDULES` stay
unscheduled.  Scheduled functions carry the ``tirx.is_scheduled`` attribute.
"""
from __future__ import annotations

from .driver import (
    NEST_SERIAL_WORK,
    SERIAL_BYTES,
    SERIAL_WORK,
    _ParallelFilter,
    _Unchecked,
    layers_by_name,
    schedule_function,
    schedule_kernel,
    schedule_module,
)
from .elementwise import ELEMENTWISE_TILE, flat_nest, flat_nests, schedule_flat
from .primitives import (
    ALWAYS_VECTORIZABLE,
    divisor_at_most,
    epilogue_at,
    extent,
    has_block,
    pow2_divisor,
    register_budget,
    simd_lanes,
    stage_inputs,
    static_extent,
    vector_width,
    vectorizable,
    vectorize_inner,
    walk,
)
from .table import SCHEDULES, ScheduleFn, _schedule_fn, schedule
from .work import kernel_bytes, kernel_work, loop_work

__all__ = [
    "ALWAYS_VECTORIZABLE", "ELEMENTWISE_TILE", "NEST_SERIAL_WORK", "SCHEDULES", "SERIAL_BYTES", "SERIAL_WORK",
    "ScheduleFn", "divisor_at_most", "epilogue_at", "extent", "flat_nest", "flat_nests", "has_block",
    "kernel_bytes", "kernel_work", "layers_by_name", "loop_work", "pow2_divisor", "register_budget",
    "schedule", "schedule_flat", "schedule_function", "schedule_kernel", "schedule_module", "simd_lanes",
    "stage_inputs", "static_extent", "vector_width", "vectorizable", "vectorize_inner", "walk",
    "_ParallelFilter", "_Unchecked", "_schedule_fn",
]
