"""The schedule of elementwise kernels (no reduction): a parallel outer loop over the flattened
static axes, vectorised inside when the body is vectorisable, serial staged tiles otherwise."""
from __future__ import annotations

from typing import Any

from tvm import s_tir

from .primitives import divisor_at_most, pow2_divisor, stage_inputs, static_extent, vectorizable

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
        # gather with per-lane 64-bit division, slower than scalar code)
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
