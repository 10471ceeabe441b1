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

from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm
from tvm import relax, s_tir, te, tirx

from ....moments import window_pairs
from ....ops.window_covariance import (
    closure_mask,
    hermite_terms,
    mehler_covariance,
    shift_product_kernel,
    tap_masks,
    taps,
)
from ....planning.graph import Repr
from ....planning.plan import PlannedLayer
from ....planning.registry import shared_kernel
from ..emit import EmitContext, RelaxActivation, activation_out, kernel, variance_of
from ..fast_math import F32
from ..schedules import divisor_at_most, flat_nests, schedule, schedule_flat, simd_lanes, static_extent
from ..shared_factor import emit_part
from ..shared_factor_schedule import schedule_shared
from ..te_let import te_shared

PAD = "pad"
SUM = "window_cov_sum"
STACK = "window_cov"


@dataclass(frozen=True)
class _Geometry:
    """The index arithmetic shared by the ``window_cov`` kernels: the conv's stride and padding, the pool's,
    the zero-padded copy of the conv input every sum reads (``pad``: the conv's padding plus the pool's, so
    the reductions load without bounds checks) and the window's pairs."""

    conv_stride: tuple[int, int]
    top: int
    left: int
    rows: int
    cols: int
    pool_stride: tuple[int, int]
    first: list[tuple[int, int]]
    second: list[tuple[int, int]]
    in_hw: tuple[int, int]

    @classmethod
    def of(cls, layer: PlannedLayer, in_hw: tuple[int, int]) -> _Geometry:
        a = layer.layer.attrs
        (cs_h, cs_w), (cp_h, cp_w) = a["conv"]["stride"], a["conv"]["padding"]
        pool = a["pool"]
        (ps_h, ps_w), (pp_h, pp_w), kernel_hw = pool["stride"], pool["padding"], pool["kernel"]
        _, _, oh, ow = layer.layer.out_shape
        kh, kw = layer.tensors["weight_mean"].shape[2:]
        tap_list = taps(kernel_hw)
        pairs = window_pairs(len(tap_list))
        return cls((cs_h, cs_w), cp_h + cs_h * pp_h, cp_w + cs_w * pp_w,
                   cs_h * (ps_h * (oh - 1) + kernel_hw[0] - 1) + kh, cs_w * (ps_w * (ow - 1) + kernel_hw[1] - 1) + kw,
                   (ps_h, ps_w), [tap_list[i] for i, _ in pairs], [tap_list[j] for _, j in pairs], in_hw)

    def shifts(self) -> list[tuple[int, int]]:
        """The distinct input offsets of the pairs' second taps from their first."""
        (cs_h, cs_w) = self.conv_stride
        return sorted({(cs_h * (t2[0] - t1[0]), cs_w * (t2[1] - t1[1])) for t1, t2 in zip(self.first, self.second)})

    def pad(self, srcs: list[te.Tensor], n_in: int) -> list[te.Tensor]:
        in_h, in_w = self.in_hw

        def padded(b, c, y, xx):
            h, w = y - self.top, xx - self.left
            inside = tirx.all(h >= 0, h < in_h, w >= 0, w < in_w)
            return tuple(tirx.if_then_else(inside, s[b, c, h, w], tirx.const(0.0, F32)) for s in srcs)

        pads = te.compute((srcs[0].shape[0], n_in, self.rows, self.cols), padded, name=PAD)
        return list(pads) if isinstance(pads, list | tuple) else [pads]


def _in_hw(ctx: EmitContext, layer: PlannedLayer) -> tuple[int, int]:
    """The spatial size of the layer's input."""
    shape = ctx.shapes[layer.inputs[0]]
    return int(shape[-2]), int(shape[-1])


def _pick(p: Any, values: list[int]) -> Any:
    """``values[p]`` for a loop variable ``p`` (a chain of selects between integer constants)."""
    out = tirx.const(values[-1], "int32")
    for k in range(len(values) - 2, -1, -1):
        out = tirx.Select(p == k, tirx.const(values[k], "int32"), out)
    return out


def _pair_sums(geo: _Geometry, layer: PlannedLayer, pads: list[te.Tensor], wv: te.Tensor, wpair: te.Tensor | None,
               profile: te.Tensor | None) -> te.Tensor:
    """``window_cov_sum[b, p, i, j, o]``: per pair ``p`` at pooled position ``(i, j)``, the sums of
    ``Var(W)·(μ·μ' [+ s̃·s̃'])`` and (``wpair``: a random input, the residual or variance in ``pads[1]``)
    ``W·W'·v`` over the conv's input channels and kernel offsets at the pair's first tap."""
    _, n_pairs, oh, ow = layer.layer.out_shape
    n_out, n_in, kh, kw = layer.tensors["weight_mean"].shape
    (cs_h, cs_w), (ps_h, ps_w) = geo.conv_stride, geo.pool_stride
    shift_index = {d: k for k, d in enumerate(geo.shifts())}
    mp = pads[0]

    def pair_sum(b, p, i, j, o):
        c = te.reduce_axis((0, n_in), name="c")
        r = te.reduce_axis((0, kh), name="r")
        s = te.reduce_axis((0, kw), name="s")
        r1, q1 = _pick(p, [t[0] for t in geo.first]), _pick(p, [t[1] for t in geo.first])
        r2, q2 = _pick(p, [t[0] for t in geo.second]), _pick(p, [t[1] for t in geo.second])
        y1, x1 = cs_h * (ps_h * i + r1) + r, cs_w * (ps_w * j + q1) + s
        y2, x2 = cs_h * (ps_h * i + r2) + r, cs_w * (ps_w * j + q2) + s
        products = mp[b, c, y1, x1] * mp[b, c, y2, x2]
        if profile is not None:
            products = products + profile[b, c, y1, x1] * profile[b, c, y2, x2]
        term = wv[c, r, s, o] * products
        if wpair is not None:
            d = _pick(p, [shift_index[(cs_h * (t2[0] - t1[0]), cs_w * (t2[1] - t1[1]))]
                          for t1, t2 in zip(geo.first, geo.second)])
            term = term + wpair[d, c, r, s, o] * pads[1][b, c, y1, x1]
        return te.sum(term, axis=[c, r, s])

    return te.compute((mp.shape[0], n_pairs, oh, ow, n_out), pair_sum, name=SUM)


def _constants(ctx: EmitContext, layer: PlannedLayer, geo: _Geometry, random: bool) -> list[relax.Expr]:
    """The kernels' constants: ``Var(W)`` as ``(c, r, s, o)``, the pair mask, the bias variance and (a random
    input) the shift-product kernels ``W·shift(W)`` per distinct shift."""
    t = layer.tensors
    consts = [ctx.const(t["weight_var"].transpose(1, 2, 3, 0)), ctx.const(tap_masks(layer)),
              ctx.const(t.get("bias_var", np.zeros(t["weight_mean"].shape[0])))]
    if random:
        consts.append(ctx.const(np.stack([shift_product_kernel(t["weight_mean"], d).transpose(1, 2, 3, 0)
                                          for d in geo.shifts()])))
    return consts


@kernel("window_cov")
def window_cov(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    x = inputs[0]
    n_in = layer.tensors["weight_mean"].shape[1]
    geo = _Geometry.of(layer, _in_hw(ctx, layer))
    random = x.second is not None

    def fn(*args: te.Tensor) -> te.Tensor:
        if random:
            m, v, wv, mask, bv, wpair = args
        else:
            (m, wv, mask, bv), v, wpair = args, None, None
        pads = geo.pad([m] if v is None else [m, v], n_in)
        sums = _pair_sums(geo, layer, pads, wv, wpair, None)
        return te.compute((m.shape[0], *layer.layer.out_shape),
                          lambda b, o, p, i, j: (sums[b, p, i, j, o] + bv[o]) * mask[p, i, j], name=STACK)

    return activation_out(ctx.emit_te(fn, x.tensors() + _constants(ctx, layer, geo, random), layer), layer)


@shared_kernel("window_cov")
def window_cov_shared_kernel(step: Any, ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation],
                             shared: list[Any], out: RelaxActivation | None) -> tuple[None, RelaxActivation]:
    """:func:`pyro2pfp.ops.window_covariance.window_cov_shared` as one kernel ``sf_window_cov`` (its whole
    output: called with ``out=None``): the padded copies of ``μ``, the residual ``r = v − s̃²`` and the
    profile ``s̃ = s·‖g_c‖``; the pair sums of the mean-field kernel with ``s̃·s̃'`` beside ``μ·μ'`` and ``r`` in
    place of ``v``; ``u`` (``mean_weight_map``: the profile through the mean weights, per input channel, at
    every conv position the windows read), ``G·u`` (``mixed``, ``G = g·gᵀ``) and their product at each pair
    (``factor_part``)."""
    x, sh = inputs[0], shared[0]
    assert out is None and sh is not None and x.second is not None and x.repr is Repr.VARIANCE, x.repr
    wm = layer.tensors["weight_mean"]
    n_out, n_in, kh, kw = wm.shape
    geo = _Geometry.of(layer, _in_hw(ctx, layer))
    (cs_h, cs_w), (ps_h, ps_w) = geo.conv_stride, geo.pool_stride
    _, n_pairs, oh, ow = layer.layer.out_shape
    kernel_hw = layer.layer.attrs["pool"]["kernel"]
    u_rows, u_cols = ps_h * (oh - 1) + kernel_hw[0], ps_w * (ow - 1) + kernel_hw[1]

    def fn(m: te.Tensor, v: te.Tensor, s: te.Tensor, g: te.Tensor, wv: te.Tensor, mask: te.Tensor, bv: te.Tensor,
           wpair: te.Tensor, w: te.Tensor) -> te.Tensor:
        batch, k = m.shape[0], g.shape[2]
        f = te.reduce_axis((0, k), name="f")
        sq = te.compute((batch, n_in), lambda b, c: te.sum(g[b, c, f] * g[b, c, f], axis=f), name="sq")
        prof = te.compute(m.shape, lambda b, c, y, xx: s[b, c, y, xx] * te.sqrt(sq[b, c]), name="profile")
        resid = te.compute(m.shape, lambda b, c, y, xx: te.max(v[b, c, y, xx] - prof[b, c, y, xx] * prof[b, c, y, xx],
                                                               tirx.const(0.0, F32)), name="resid")
        mp, rp, pp = geo.pad([m, resid, prof], n_in)
        sums = _pair_sums(geo, layer, [mp, rp], wv, wpair, pp)
        r = te.reduce_axis((0, kh), name="r")
        q = te.reduce_axis((0, kw), name="q")
        u = te.compute((batch, n_out, n_in, u_rows, u_cols), lambda b, o, c, y, xx: te.sum(
            w[o, c, r, q] * pp[b, c, cs_h * y + r, cs_w * xx + q], axis=[r, q]), name="mean_weight_map")
        f2 = te.reduce_axis((0, k), name="f2")
        gram = te.compute((batch, n_in, n_in), lambda b, c, d: te.sum(g[b, c, f2] * g[b, d, f2], axis=f2),
                          name="gram")
        d = te.reduce_axis((0, n_in), name="d")
        mixed = te.compute((batch, n_out, n_in, u_rows, u_cols), lambda b, o, c, y, xx: te.sum(
            gram[b, c, d] * u[b, o, d, y, xx], axis=d), name="mixed")
        c2 = te.reduce_axis((0, n_in), name="c2")

        def factor(b, p, i, j, o):
            y1, x1 = ps_h * i + _pick(p, [t[0] for t in geo.first]), ps_w * j + _pick(p, [t[1] for t in geo.first])
            y2, x2 = ps_h * i + _pick(p, [t[0] for t in geo.second]), ps_w * j + _pick(p, [t[1] for t in geo.second])
            return te.sum(u[b, o, c2, y1, x1] * mixed[b, o, c2, y2, x2], axis=c2)

        part = te.compute((batch, n_pairs, oh, ow, n_out), factor, name="factor_part")
        return te.compute((batch, *layer.layer.out_shape), lambda b, o, p, i, j: (
            sums[b, p, i, j, o] + part[b, p, i, j, o] + bv[o]) * mask[p, i, j], name=STACK)

    consts = _constants(ctx, layer, geo, True) + [ctx.const(wm)]
    cov = emit_part(ctx, fn, [x.mean, x.second, sh.s, sh.g, *consts], layer, "window_cov")[0]
    return None, RelaxActivation(cov, None, Repr.DETERMINISTIC)


class _PoolTaps:
    """The window taps of a ``(B, C, H, W)`` tensor at the pooled positions of a ``window_closure`` /
    ``window_activation`` layer (bounds-checked loads; a pair's taps selected by the pair index)."""

    def __init__(self, layer: PlannedLayer) -> None:
        pool = layer.layer.attrs["pool"]
        self.stride, self.padding = pool["stride"], pool["padding"]
        self.in_hw = layer.layer.attrs["in_hw"]
        tap_list = taps(pool["kernel"])
        pairs = window_pairs(len(tap_list))
        self.first = [tap_list[i] for i, _ in pairs]
        self.second = [tap_list[j] for _, j in pairs]

    def load(self, t: te.Tensor, b: Any, c: Any, i: Any, j: Any, r: Any, q: Any) -> Any:
        h, w = i * self.stride[0] - self.padding[0] + r, j * self.stride[1] - self.padding[1] + q
        inside = tirx.all(h >= 0, h < self.in_hw[0], w >= 0, w < self.in_hw[1])
        return tirx.if_then_else(inside, t[b, c, te.min(te.max(h, 0), self.in_hw[0] - 1),
                                           te.min(te.max(w, 0), self.in_hw[1] - 1)], tirx.const(0.0, F32))

    def pair(self, t: te.Tensor, b: Any, c: Any, p: Any, i: Any, j: Any) -> tuple[Any, Any]:
        """Pair ``p``'s two taps of ``t`` (0 outside the input)."""
        first = self.load(t, b, c, i, j, _pick(p, [x[0] for x in self.first]), _pick(p, [x[1] for x in self.first]))
        second = self.load(t, b, c, i, j, _pick(p, [x[0] for x in self.second]),
                           _pick(p, [x[1] for x in self.second]))
        return first, second


@kernel("window_closure")
def window_closure(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    """Zeros (no shared parts)."""
    def fn(m: te.Tensor) -> te.Tensor:
        return te.compute((m.shape[0], *layer.layer.out_shape), lambda *i: tirx.const(0.0, F32), name=STACK)

    return activation_out(ctx.emit_te(fn, [inputs[0].mean], layer), layer)


@shared_kernel("window_closure")
def window_closure_shared_kernel(step: Any, ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation],
                                 shared: list[Any], out: RelaxActivation | None) -> tuple[None, RelaxActivation]:
    """:func:`pyro2pfp.ops.window_covariance.window_closure_shared` as one kernel ``sf_window_closure``."""
    if any(sh is None for sh in shared):
        return None, window_closure(ctx, layer, inputs)
    tap = _PoolTaps(layer)
    two = len(shared) == 2

    def fn(*args: te.Tensor) -> te.Tensor:
        s_a, g_a, s_b, g_b = (*args, None, None) if not two else args
        g_b = g_a if g_b is None else g_b
        k = te.min(g_a.shape[2], g_b.shape[2]) if two else g_a.shape[2]
        f = te.reduce_axis((0, k), name="f")
        dot = te.compute(g_a.shape[:2], lambda b, c: te.sum(g_a[b, c, f] * g_b[b, c, f], axis=f), name="dot")

        def pair(b, c, p, i, j):
            a1, a2 = tap.pair(s_a, b, c, p, i, j)
            if s_b is None:
                return a1 * a2 * dot[b, c]
            b1, b2 = tap.pair(s_b, b, c, p, i, j)
            return (a1 * b2 + b1 * a2) * dot[b, c]

        return te.compute((s_a.shape[0], *layer.layer.out_shape), pair, name=STACK)

    args = [t for sh in shared for t in (sh.s, sh.g)]
    cov = emit_part(ctx, fn, args, layer, "window_closure")[0]
    return None, RelaxActivation(cov, None, Repr.DETERMINISTIC)


@kernel("window_activation")
def window_activation(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    """:func:`pyro2pfp.ops.window_covariance.window_activation`: the Hermite terms per element (stage
    ``hermite``, the activation's moment rule and Stein slope let-bound once), Mehler's covariance per pair."""
    x, cov = inputs
    tap = _PoolTaps(layer)
    mask = ctx.const(closure_mask(layer))

    def fn(m: te.Tensor, v: te.Tensor, c_in: te.Tensor, mk: te.Tensor) -> te.Tensor:
        terms = te.compute(m.shape, lambda *i: te_shared(lambda ops: list(hermite_terms(
            layer, m[i], variance_of(m[i], v[i], x.repr), ops))), name="hermite")

        def pair(b, c, p, i, j):
            first = [tap.pair(t, b, c, p, i, j)[0] for t in terms]
            second = [tap.pair(t, b, c, p, i, j)[1] for t in terms]
            return te_shared(lambda ops: [mehler_covariance(tuple(first), tuple(second), c_in[b, c, p, i, j], ops)
                                          * mk[p, i, j]])[0]

        return te.compute((m.shape[0], *layer.layer.out_shape), pair, name=STACK)

    return activation_out(ctx.emit_te(fn, [x.mean, x.second, cov.mean, mask], layer), layer)


@shared_kernel("window_activation")
def window_activation_shared_kernel(step: Any, ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation],
                                    shared: list[Any], out: RelaxActivation | None) -> tuple[None, RelaxActivation]:
    """The same as without shared factors (the input covariances carry them)."""
    return None, window_activation(ctx, layer, inputs)


WINDOW_COV_COLUMNS = 8
"""At most this many pooled columns share one pass over the kernel taps (their channel vectors are the
register tile: each weight vector is loaded once for all of them)."""


@schedule("window_cov")
def schedule_window_cov(sch: s_tir.Schedule, layer: PlannedLayer | None, target: tvm.target.Target) -> None:
    """The padded copy and the last stage are elementwise nests; the pair reduction runs parallel
    over (batch, pair, output row), the output channels innermost as one vector, a tile of up to
    :data:`WINDOW_COV_COLUMNS` pooled columns around it (their accumulators in registers) and the
    kernel's columns unrolled."""
    lanes = simd_lanes(target)
    root = sch.get_sblock("root")
    blocks = list(sch.get_child_blocks(root))
    names = [sch.get(b).name_hint for b in blocks]
    flat_nests(sch, [b for b, n in zip(blocks, names) if n.startswith(PAD)], lanes)
    blk = sch.get_sblock(SUM)
    b, p, i, j, o, c, r, s = sch.get_loops(blk)
    jo, ji = sch.split(j, [None, divisor_at_most(static_extent(sch, j), WINDOW_COV_COLUMNS)])
    sch.reorder(b, p, i, jo, c, r, s, ji, o)
    sch.parallel(sch.fuse(b, p, i))
    if static_extent(sch, s) <= 8:
        sch.unroll(s)
    sch.unroll(ji)
    if static_extent(sch, o) <= 4 * lanes:
        sch.vectorize(o)
    sch.decompose_reduction(blk, c)
    flat_nests(sch, [sch.get_sblock(STACK)], lanes)


schedule("sf_window_cov", "sf_window_closure")(schedule_shared)


@schedule("window_closure", "window_activation")
def schedule_window_pairs(sch: s_tir.Schedule, layer: PlannedLayer | None, target: tvm.target.Target) -> None:
    """Elementwise nests (the Hermite terms per element, the pairs): :func:`~.schedules.schedule_flat`."""
    schedule_flat(sch, simd_lanes(target))
