"""The ``window_cov`` kernel and its default CPU schedule.  (The op, its math, reference and ONNX
export: ``pyro2pfp/ops/window_covariance.py``.)

One reduction stage per pair of window taps, ``window_cov_<k>[b, i, j, o]`` (output channels
innermost: the weights are stored ``(c, r, s, o)``, so the sums are vector FMAs over ``o``): the sums of
``Var(W)·μ·μ'`` (and, for a random input, ``W·W'·v``) over the conv's input channels and kernel
offsets at the first tap's position, read from one zero-padded copy of the input (``pad`` stage:
the conv's padding plus the pool's, so the reductions load without bounds checks).  A last
elementwise stage ``window_cov`` stacks the pairs, adds the bias variance and zeroes pairs with a tap
outside the conv output.  The pair's offsets are Python constants of each stage (no index tables).
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
        covs = []
        def pair_sum(first: tuple[int, int], second: tuple[int, int]) -> Any:
            (r1, q1), (r2, q2) = first, second

            def body(b, i, j, o):
                c = te.reduce_axis((0, n_in), name="c")
                r = te.reduce_axis((0, kh), name="r")
                s = te.reduce_axis((0, kw), name="s")
                y1, x1 = cs_h * (ps_h * i + r1) + r, cs_w * (ps_w * j + q1) + s
                y2, x2 = cs_h * (ps_h * i + r2) + r, cs_w * (ps_w * j + q2) + s
                term = wv[c, r, s, o] * mp[b, c, y1, x1] * mp[b, c, y2, x2]
                if wpair is not None:
                    d = shift_index[(cs_h * (r2 - r1), cs_w * (q2 - q1))]
                    term = term + wpair[d, c, r, s, o] * pads[1][b, c, y1, x1]
                return te.sum(term, axis=[c, r, s])

            return body

        for k, (i1, i2) in enumerate(pairs):
            covs.append(te.compute((m.shape[0], oh, ow, n_out), pair_sum(tap_list[i1], tap_list[i2]),
                                   name=f"{STACK}_{k}"))

        def stack(b, o, p, i, j):
            value = covs[-1][b, i, j, o]
            for k in range(n_pairs - 2, -1, -1):
                value = tirx.Select(p == k, covs[k][b, i, j, o], value)
            return (value + bv[o]) * mask[p, i, j]

        return te.compute((m.shape[0], n_out, n_pairs, oh, ow), stack, name=STACK)

    return activation_out(ctx.emit_te(fn, x.tensors() + consts, layer), layer)


@schedule("window_cov")
def schedule_window_cov(sch: s_tir.Schedule, layer: Any, target: tvm.target.Target) -> None:
    """The padded copy and the stacking stage are elementwise nests; each pair's reduction runs
    parallel over (batch, output row), the output channels innermost as one vector and the kernel's
    columns unrolled."""
    lanes = simd_lanes(target)
    root = sch.get_sblock("root")
    blocks = list(sch.get_child_blocks(root))
    names = [sch.get(b).name_hint for b in blocks]
    flat_nests(sch, [b for b, n in zip(blocks, names) if n.startswith(PAD)], lanes)
    for blk, name in zip(blocks, names):
        if not name.startswith(f"{STACK}_"):
            continue
        b, i, j, o, c, r, s = sch.get_loops(blk)
        sch.reorder(b, i, j, c, r, s, o)
        sch.parallel(sch.fuse(b, i))
        if static_extent(sch, s) <= 8:
            sch.unroll(s)
        if static_extent(sch, o) <= 4 * lanes:
            sch.vectorize(o)
        sch.decompose_reduction(blk, c)
    flat_nests(sch, [sch.get_sblock(STACK)], lanes)
