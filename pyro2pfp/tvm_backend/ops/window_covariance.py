"""The ``window_cov`` kernel and its default CPU schedule.  (The op, its math, reference and ONNX
export: ``pyro2pfp/ops/window_covariance.py``.)

One reduction stage ``window_cov_sum[b, p, i, j, o]`` over all pairs ``p`` of window taps (output
channels innermost: the weights are stored ``(c, r, s, o)``, so the sums are vector FMAs over ``o``): the
sums of ``Var(W)·μ·μ'`` (and, for a random input, ``W·W'·v``) over the conv's input channels and kernel
offsets at the pair's first tap, read from one zero-padded copy of the input (``pad`` stage: the conv's
padding plus the pool's, so the reductions load without bounds checks).  The pair's tap offsets are
selected from constants by ``p``, an outer loop, so they are loop-invariant integers in the inner
loops.  A last elementwise stage ``window_cov`` moves the channels to their place, adds the bias
variance and zeroes pairs with a tap outside the conv output.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import tvm
from tvm import s_tir, te, tirx

from ...moments import window_pairs
from ...ops.window_covariance import shift_product_kernel, tap_masks, taps
from ...plan import PlannedLayer
from ..emit import EmitContext, RelaxActivation, activation_out, kernel
from ..fast_math import F32
from ..schedules import flat_nests, schedule, simd_lanes, static_extent

PAD = "pad"
SUM = "window_cov_sum"
STACK = "window_cov"


@kernel("window_cov")
def window_cov(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    a, t, x = layer.layer.attrs, layer.tensors, inputs[0]
    (cs_h, cs_w), (cp_h, cp_w) = a["conv"]["stride"], a["conv"]["padding"]
    pool = a["pool"]
    (ps_h, ps_w), (pp_h, pp_w), kernel_hw = pool["stride"], pool["padding"], pool["kernel"]
    _, n_pairs, oh, ow = layer.layer.out_shape
    n_out, n_in, kh, kw = t["weight_mean"].shape
    in_h, in_w = ctx.shapes[layer.inputs[0]][1:]
    top, left = cp_h + cs_h * pp_h, cp_w + cs_w * pp_w
    rows = cs_h * (ps_h * (oh - 1) + kernel_hw[0] - 1) + kh
    cols = cs_w * (ps_w * (ow - 1) + kernel_hw[1] - 1) + kw
    tap_list = taps(kernel_hw)
    pairs = window_pairs(len(tap_list))
    random = x.second is not None
    consts = [ctx.const(t["weight_var"].transpose(1, 2, 3, 0)), ctx.const(tap_masks(layer))]
    bias_var = t.get("bias_var", np.zeros(n_out))
    consts.append(ctx.const(bias_var))
    if random:
        shifts = sorted({(cs_h * (tap_list[j][0] - tap_list[i][0]), cs_w * (tap_list[j][1] - tap_list[i][1]))
                         for i, j in pairs})
        shift_index = {d: k for k, d in enumerate(shifts)}
        consts.append(ctx.const(np.stack([shift_product_kernel(t["weight_mean"], d).transpose(1, 2, 3, 0)
                                          for d in shifts])))

    def fn(*args: te.Tensor) -> te.Tensor:
        if random:
            m, v, wv, mask, bv, wpair = args
        else:
            (m, wv, mask, bv), v, wpair = args, None, None
        srcs = [m] if v is None else [m, v]

        def padded(b, c, y, xx):
            h, w = y - top, xx - left
            inside = tirx.all(h >= 0, h < in_h, w >= 0, w < in_w)
            return tuple(tirx.if_then_else(inside, s[b, c, h, w], tirx.const(0.0, F32)) for s in srcs)

        pads = te.compute((m.shape[0], n_in, rows, cols), padded, name=PAD)
        pads = list(pads) if isinstance(pads, list | tuple) else [pads]
        mp = pads[0]
        first = [tap_list[i] for i, _ in pairs]
        second = [tap_list[j] for _, j in pairs]

        def pick(p: Any, values: list[int]) -> Any:
            """``values[p]`` for a loop variable ``p`` (a chain of selects between integer constants)."""
            out = tirx.const(values[-1], "int32")
            for k in range(len(values) - 2, -1, -1):
                out = tirx.Select(p == k, tirx.const(values[k], "int32"), out)
            return out

        def pair_sum(b, p, i, j, o):
            c = te.reduce_axis((0, n_in), name="c")
            r = te.reduce_axis((0, kh), name="r")
            s = te.reduce_axis((0, kw), name="s")
            r1, q1 = pick(p, [t[0] for t in first]), pick(p, [t[1] for t in first])
            r2, q2 = pick(p, [t[0] for t in second]), pick(p, [t[1] for t in second])
            y1, x1 = cs_h * (ps_h * i + r1) + r, cs_w * (ps_w * j + q1) + s
            y2, x2 = cs_h * (ps_h * i + r2) + r, cs_w * (ps_w * j + q2) + s
            term = wv[c, r, s, o] * mp[b, c, y1, x1] * mp[b, c, y2, x2]
            if wpair is not None:
                d = pick(p, [shift_index[(cs_h * (t2[0] - t1[0]), cs_w * (t2[1] - t1[1]))]
                             for t1, t2 in zip(first, second)])
                term = term + wpair[d, c, r, s, o] * pads[1][b, c, y1, x1]
            return te.sum(term, axis=[c, r, s])

        sums = te.compute((m.shape[0], n_pairs, oh, ow, n_out), pair_sum, name=SUM)
        return te.compute((m.shape[0], n_out, n_pairs, oh, ow),
                          lambda b, o, p, i, j: (sums[b, p, i, j, o] + bv[o]) * mask[p, i, j], name=STACK)

    return activation_out(ctx.emit_te(fn, x.tensors() + consts, layer), layer)


@schedule("window_cov")
def schedule_window_cov(sch: s_tir.Schedule, layer: Any, target: tvm.target.Target) -> None:
    """The padded copy and the last stage are elementwise nests; the pair reduction runs parallel
    over (batch, pair, output row), the output channels innermost as one vector and the kernel's
    columns unrolled."""
    lanes = simd_lanes(target)
    root = sch.get_sblock("root")
    blocks = list(sch.get_child_blocks(root))
    names = [sch.get(b).name_hint for b in blocks]
    flat_nests(sch, [b for b, n in zip(blocks, names) if n.startswith(PAD)], lanes)
    blk = sch.get_sblock(SUM)
    b, p, i, j, o, c, r, s = sch.get_loops(blk)
    sch.reorder(b, p, i, j, c, r, s, o)
    sch.parallel(sch.fuse(b, p, i))
    if static_extent(sch, s) <= 8:
        sch.unroll(s)
    if static_extent(sch, o) <= 4 * lanes:
        sch.vectorize(o)
    sch.decompose_reduction(blk, c)
    flat_nests(sch, [sch.get_sblock(STACK)], lanes)
