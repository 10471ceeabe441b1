"""Joint PFP dense and conv2d TE kernels (one reduction computes mean and variance together) and their
default CPU schedules.  (The op definitions, converters, reference and ONNX export: ``pyro2pfp/ops/compute.py``.)

Deterministic input ``x``:      ``μ = Σ μw·x``,   ``v = Σ vw·x²``                   (weights: μw, vw)
Variance input ``(μx, vx)``:    ``μ = Σ μw·μx``,  ``v = Σ vw·(μx² + vx) + μw²·vx``  (weights: μw, vw)
Raw-moment input ``(μx, sx)``:  ``μ = Σ μw·μx``,  ``v = Σ sw·sx − (μw·μx)²``        (weights: μw, sw = E[w²])

The epilogue adds the bias (mean and, if probabilistic, variance), clamps the variance at 0 and
converts to the representation the plan asks for.  Dense weights are stored transposed (K, M) so
the output axis is unit-stride; conv weights are stored (C/groups, KH, KW, O) for the same reason.
Dense weights are also zero-padded to whole vectors (:func:`dense_padded_columns`): the
accumulation runs over whole SIMD vectors (a width that divides ``M`` -- 4 for ``M = 100`` -- would
leave most of an AVX-512 register idle), and the epilogue reads only the ``M`` real columns.

The 3x3 stride-1 convs of a variance input with >= 16 channels (the ResNet block convs) use the
Winograd F(2x2, 3x3) kernel of ``winograd.py`` instead (:func:`~.winograd.use_winograd`; same op,
same schedule entry point).

Asked for it (``ctx.weight_noise``: the shared-factor rule of ``injection='rescaled'`` reads it), the
conv kernel also returns its weight-noise term ``Σ vw·E[x²] + vb`` (``RelaxActivation.weight_noise``):
with a variance input its reduction keeps the two variance sums ``Σ vw·(μx² + vx)`` and ``Σ μw²·vx``
apart (a three-sum reduction, the same multiply-adds) and the epilogue writes the first ``+ vb`` as a
third output; with a deterministic input the term is the variance output itself (``Σ vw·x² + vb``).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tvm
from tvm import s_tir, te, tirx

from ....errors import PFPError
from ....planning.graph import Repr
from ....planning.plan import PlannedLayer
from ..emit import EmitContext, RelaxActivation, activation_out, epilogue_fused, kernel, pair_sum, triple_sum
from ..fast_math import F32
from ..schedules import (
    divisor_at_most,
    epilogue_at,
    has_block,
    pow2_divisor,
    register_budget,
    schedule,
    simd_lanes,
    static_extent,
    vectorizable,
    vectorize_inner,
)
from .winograd import schedule_winograd, use_winograd, winograd_conv


def _terms(x_mean: Any, x_second: Any, w_mean: Any, w_second: Any, x_repr: Repr) -> tuple[Any, Any]:
    """Per-term (mean, variance) contributions for an input in representation ``x_repr``.

    ``w_second`` is the weight variance (deterministic or variance input) or ``E[w²]`` (raw moment).
    """
    prod = x_mean * w_mean
    if x_repr is Repr.DETERMINISTIC:
        return prod, x_mean * x_mean * w_second
    if x_repr is Repr.VARIANCE:
        return prod, w_second * (x_mean * x_mean + x_second) + w_mean * w_mean * x_second
    return prod, x_second * w_second - prod * prod


DENSE_COLUMN_MULTIPLE = 16
"""Dense weights get zero columns up to a multiple of this (16 fp32 = one AVX-512 register) --
of twice this when there are more than this many, so that the columns split into two parallel
tiles of whole vectors (both cores busy at batch 1, each streaming half of the weights)."""


def dense_padded_columns(m: int) -> int:
    """Columns of the padded dense weights for ``m`` outputs (see :data:`DENSE_COLUMN_MULTIPLE`)."""
    multiple = DENSE_COLUMN_MULTIPLE if m <= DENSE_COLUMN_MULTIPLE else 2 * DENSE_COLUMN_MULTIPLE
    return -(-m // multiple) * multiple


def _weights_and_bias(ctx: EmitContext, layer: PlannedLayer, axes: tuple[int, ...],
                      padded_columns: int | None = None) -> list:
    """Weight (mean, second) transposed by ``axes`` so the output channel is the unit-stride axis,
    zero-padded along it to ``padded_columns``."""
    t = layer.tensors
    second = t["weight_var"] if "weight_var" in t else t["weight_second_moment"]
    ws = [np.transpose(w, axes) for w in (t["weight_mean"], second)]
    extra = 0 if padded_columns is None else padded_columns - ws[0].shape[-1]
    if extra:
        ws = [np.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, extra)]) for w in ws]
    args = [ctx.const(w) for w in ws]
    for key in ("bias_mean", "bias_var"):
        if key in t:
            args.append(ctx.const(t[key]))
    return args


def _epilogue_stage(acc_mean: te.Tensor, acc_var: te.Tensor, bias: list[te.Tensor], channel_axis: int,
                    layer: PlannedLayer, shape: tuple | None = None,
                    activation: PlannedLayer | None = None,
                    index: Callable[..., tuple] | None = None,
                    acc_noise: te.Tensor | None = None) -> list[te.Tensor]:
    """Bias, variance clamp and representation conversion of the accumulated sums; ``shape``
    (default: the accumulators') may cut off padding columns.  With a fused ``activation`` (a
    ReLU layer, see ``fusion.fused_activations``) the ReLU's output moments are emitted instead,
    in its representation.  ``index`` maps an output index to the accumulators' (default: the
    same; the Winograd conv's accumulators are NHWC).  ``acc_noise``: the weight-noise sum
    ``Σ vw·(μx² + vx)`` kept apart from ``acc_var`` (then ``Σ μw²·vx``): the variance is their sum,
    and ``acc_noise + vb`` is a third output (the module docstring)."""
    def f(*idx):
        at = idx if index is None else index(*idx)
        mean, var = acc_mean[at], acc_var[at]
        noise = None
        if acc_noise is not None:
            noise = acc_noise[at]
            var = noise + var
        if bias:
            mean = mean + bias[0][idx[channel_axis]]
        if len(bias) > 1:
            var = var + bias[1][idx[channel_axis]]
            noise = noise + bias[1][idx[channel_axis]] if noise is not None else None
        outs = epilogue_fused(mean, te.max(var, tirx.const(0.0, F32)), layer, activation)
        return outs if noise is None else [*outs, noise]

    return te.compute(acc_mean.shape if shape is None else shape, f, name="epilogue")


@kernel("dense")
def dense(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    x = inputs[0]
    deterministic = x.repr is Repr.DETERMINISTIC
    n_x = len(x.tensors())

    def fn(*tensors: te.Tensor) -> list[te.Tensor]:
        x_mean = tensors[0]
        x_second = None if deterministic else tensors[1]
        w_mean, w_second = tensors[n_x:n_x + 2]
        bias = list(tensors[n_x + 2:])
        k_dim, m_padded = w_mean.shape
        k = te.reduce_axis((0, k_dim), name="k")

        def body(i, j):
            xs = None if x_second is None else x_second[i, k]
            return pair_sum(_terms(x_mean[i, k], xs, w_mean[k, j], w_second[k, j], x.repr), axis=k)

        acc = te.compute((x_mean.shape[0], m_padded), body, name="dense")
        return _epilogue_stage(acc[0], acc[1], bias, 1, layer, (x_mean.shape[0], layer.layer.out_shape[0]),
                               ctx.activation)

    weights = _weights_and_bias(ctx, layer, (1, 0), dense_padded_columns(layer.layer.out_shape[0]))  # (K, M')
    outs = ctx.emit_te(fn, x.tensors() + weights, layer)
    return activation_out(outs, ctx.activation or layer)


def _pad(x: te.Tensor, padding: list[int], extra_right: int = 0) -> te.Tensor:
    """``x`` zero-padded by ``padding`` (rows, columns) and ``extra_right`` more zero columns."""
    ph, pw = padding
    if ph == 0 and pw == 0 and extra_right == 0:
        return x
    n, c, h, w = x.shape

    def f(b, ch, i, j):
        inside = tirx.all(i >= ph, i < h + ph, j >= pw, j < w + pw)
        return tirx.if_then_else(inside, x[b, ch, i - ph, j - pw], tirx.const(0.0, F32))

    return te.compute((n, c, h + 2 * ph, w + 2 * pw + extra_right), f, name="pad")


CONV_WIDE_LANES = 16
"""The direct conv computes its output rows :func:`computed_width` columns wide: whole vectors of this
many fp32 lanes (AVX-512's) where that is what makes the output columns the vector axis."""
CONV_WIDE_WASTE = 0.25
"""... and only where the extra columns are at most this fraction of the real ones."""


def computed_width(out_channels: int, out_w: int) -> int:
    """Output columns the direct conv kernel computes (its epilogue writes the first ``out_w``).

    The default schedule vectorises a conv over its output columns when they have the larger
    power-of-two divisor (:func:`schedule_conv2d`); a width such as LeNet conv1's 28 then gives
    4-lane vectors on a 16-lane CPU.  Rounding the computed row up to a multiple of
    :data:`CONV_WIDE_LANES` (28 -> 32: 14 % more multiply-adds, on zero padding) gives whole 16-lane
    vectors.  Only where the output channels do not fill a vector themselves (else the schedule
    vectorises them) and the extra columns are at most :data:`CONV_WIDE_WASTE` of the row.  The emitted
    module is target-independent, so a 4-lane target (NEON) computes the extra columns for nothing.
    ``benchmarks/kernel_profile.py --net lenet --batch 10 --static --kernels`` times the kernels."""
    lanes = CONV_WIDE_LANES
    wide = -(-out_w // lanes) * lanes
    if out_w % lanes == 0 or pow2_divisor(out_channels, lanes) >= lanes or wide - out_w > CONV_WIDE_WASTE * out_w:
        return out_w
    return wide


@kernel("conv2d")
def conv2d(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    x = inputs[0]
    a = layer.layer.attrs
    deterministic = x.repr is Repr.DETERMINISTIC
    n_x = len(x.tensors())
    out_c, out_h, out_w = layer.layer.out_shape
    # the weight-noise term as a third output (module docstring); a deterministic input's is the variance
    split = ctx.weight_noise and x.repr is Repr.VARIANCE and "weight_var" in layer.tensors
    if ctx.weight_noise and not split and x.repr is not Repr.DETERMINISTIC:
        raise PFPError(f"{layer.layer.source}: the weight-noise term of conv2d '{layer.name}' needs a variance or "
                       f"deterministic input and stored weight variances (input: {x.repr.name.lower()}); "
                       "plan with moment_form='variance'")
    if use_winograd(layer, x.repr):
        outs = winograd_conv(ctx, layer, x, _epilogue_stage, split)
        return _with_noise(activation_out(outs, ctx.activation or layer), ctx.weight_noise, outs)

    def fn(*tensors: te.Tensor) -> list[te.Tensor]:
        w_mean, w_second = tensors[n_x:n_x + 2]
        bias = list(tensors[n_x + 2:])
        c_per_group, kh, kw, _ = (int(d) for d in w_mean.shape)
        (sh, sw), (dh, dw) = a["stride"], a["dilation"]
        wide = computed_width(out_c, out_w)
        in_w = int(tensors[0].shape[3]) + 2 * a["padding"][1]
        extra = max(0, (wide - 1) * sw + (kw - 1) * dw + 1 - in_w)  # zero columns the wide row reads
        x_mean = _pad(tensors[0], a["padding"], extra)
        x_second = None if deterministic else _pad(tensors[1], a["padding"], extra)
        o_per_group = out_c // a["groups"]
        rc = te.reduce_axis((0, c_per_group), name="rc")
        rp = te.reduce_axis((0, kh), name="rp")
        rq = te.reduce_axis((0, kw), name="rq")

        def body(b, o, i, j):
            c = (o // o_per_group) * c_per_group + rc if a["groups"] > 1 else rc
            pos = (b, c, i * sh + rp * dh, j * sw + rq * dw)
            xs = None if x_second is None else x_second[pos]
            wm, wv = w_mean[rc, rp, rq, o], w_second[rc, rp, rq, o]
            if split:  # (mean, Σ μw²·vx, weight noise Σ vw·(μx² + vx))
                xm = x_mean[pos]
                return triple_sum((xm * wm, wm * wm * xs, wv * (xm * xm + xs)), axis=[rc, rp, rq])
            return pair_sum(_terms(x_mean[pos], xs, wm, wv, x.repr), axis=[rc, rp, rq])

        batch = tensors[0].shape[0]
        acc = te.compute((batch, out_c, out_h, wide), body, name="conv2d")
        return _epilogue_stage(acc[0], acc[1], bias, 1, layer, shape=(batch, out_c, out_h, out_w),
                               activation=ctx.activation, acc_noise=acc[2] if split else None)

    outs = ctx.emit_te(fn, x.tensors() + _weights_and_bias(ctx, layer, (1, 2, 3, 0)), layer)  # (C, KH, KW, O)
    return _with_noise(activation_out(outs, ctx.activation or layer), ctx.weight_noise, outs)


def _with_noise(out: RelaxActivation, wanted: bool, outs: list[Any] | None = None) -> RelaxActivation:
    """``out`` with its weight-noise term (``wanted``): the kernel's third output, or -- for a
    deterministic input, whose kernel has two -- the variance itself."""
    if not wanted:
        return out
    noise = outs[2] if outs is not None and len(outs) > 2 else out.second
    return RelaxActivation(out.mean, out.second, out.repr, weight_noise=noise)


# ------------------------------------------------------------------------------------ dense
DENSE_K_UNROLL = 4
DENSE_K_CHUNK = 32  # rows of the weight tile kept in L1 while every example of the batch uses it


@schedule("dense")
def schedule_dense(sch: s_tir.Schedule, layer: PlannedLayer | None, target: tvm.target.Target) -> None:
    """Dense ``(batch, K) x (K, M)``: one tuple-reduction block ``dense`` (mean and variance sums
    together) + the ``epilogue`` blocks.

    The weights are stored ``(K, M)``, so the output feature ``j`` is the unit-stride axis, and
    zero-padded to whole vectors (``compute.dense_padded_columns``: 16 columns, or a multiple of
    32 above 16), so ``jv`` is a whole SIMD register.  ``j`` is split ``jo x jm x jv``: ``jv``
    vectorised, ``jm`` unrolled -- a register tile of ``jm`` mean and ``jm`` variance vector
    accumulators (at most 8 + 8 of the 32 AVX-512 registers, 4 + 4 of 16 otherwise, and at most
    half the columns) -- and ``jo`` is the parallel loop: at least two tiles when ``M > 16``, so
    batch 1 keeps both cores busy, each streaming its own columns of the weights.

    ``k`` is split ``ko x km x ki`` (``km*ki`` = a divisor of ``K`` up to :data:`DENSE_K_CHUNK`,
    ``ki`` unrolled).  Order ``jo | ko, batch, km, ki, jm, jv``: a chunk of ``km*ki`` weight rows
    of the tile (2 x 32 x 64 floats: 16 KiB) stays in L1 while every example of the batch
    accumulates over it, instead of the whole weight matrix streaming from L2 once per example
    (the weights are not reused across examples otherwise; at batch 1 there is nothing to reuse and
    the order costs nothing).  The accumulators are a ``(batch, tile)`` buffer
    (re-read once per chunk); the epilogue writes each column tile after its reduction.
    """
    lanes = simd_lanes(target)
    blk = sch.get_sblock("dense")
    i, j, k = sch.get_loops(blk)
    m, kk = static_extent(sch, j), static_extent(sch, k)
    vectorize = vectorizable(sch, [blk])
    vec = pow2_divisor(m, lanes) if vectorize else 1
    n_vec = m // vec
    # register tile: at most a third of the vector registers per accumulator, and at least two
    # tiles when there are two vectors or more (both cores busy at batch 1)
    jm = divisor_at_most(n_vec, min(register_budget(lanes) // 3, max(1, n_vec // 2)))
    jo, jmm, jv = sch.split(j, [None, jm, vec])
    chunk = divisor_at_most(kk, DENSE_K_CHUNK)
    ko, km, ki = sch.split(k, [None, chunk // divisor_at_most(chunk, DENSE_K_UNROLL),
                               divisor_at_most(chunk, DENSE_K_UNROLL)])
    sch.reorder(jo, ko, i, km, ki, jmm, jv)
    sch.parallel(jo)
    epilogue_at(sch, blk, jo, lanes)
    sch.unroll(ki)
    sch.unroll(jmm)
    if vec > 1:
        sch.vectorize(jv)
    sch.decompose_reduction(blk, ko)


# ------------------------------------------------------------------------------------ conv2d
CONV_TILE_COLUMNS = 4  # output columns per register tile when vectorising over output channels
CONV_MAX_UNROLLED_WINDOW = 64  # unroll the kernel window only up to this many taps


@schedule("conv2d")
def schedule_conv2d(sch: s_tir.Schedule, layer: PlannedLayer | None, target: tvm.target.Target) -> None:
    """Conv2d NCHW/OIHW: optional ``pad`` block(s) (one per input tensor), the tuple-reduction
    ``conv2d`` block and the ``epilogue``.  (A Winograd conv -- a ``wino_gemm`` block, see
    ``winograd.py`` -- gets :func:`~.winograd.schedule_winograd` instead.)

    A register tile of (output channels x output columns) of one output row is accumulated over
    ``rc`` and the unrolled ``rp x rq`` window; the parallel loop runs over batch x channel tiles
    x output rows (x column tiles).  The vector axis is the one with the larger power-of-two
    divisor (see the module docstring):

    * **output channels** (e.g. LeNet conv2, 16 channels, 10 columns): the weights are first
      copied once per call into a ``(C, KH, KW, O)`` layout (``cache_read`` +
      ``transform_layout``; 2x|w| floats, ~1 us) so a vector of output channels' weights is one
      contiguous load, and each input element is a broadcast scalar reused by the whole vector;
    * **output columns** (e.g. conv1, 6 channels, 28 columns): ``x[.., i+rp, j+rq]`` is read as
      contiguous vectors and each weight is a broadcast scalar shared by the row.

    The padding blocks are computed at the parallel loop (just the ``KH`` padded input rows the
    output row needs, in a small thread-private buffer, instead of a padded copy of the whole
    batch) and the epilogue writes the tile from the accumulators.

    Tile sizes: a tile of 2 columns x one vector of channels keeps its accumulators in registers;
    wider tiles (10 columns of 16 channels) spill them and lose the whole gain of the schedule.
    """
    if has_block(sch, "wino_gemm"):
        schedule_winograd(sch, target)
        return
    lanes = simd_lanes(target)
    budget = register_budget(lanes)
    blk = sch.get_sblock("conv2d")
    # accumulators per output: 2 (mean, variance; the shared-factor profile's single sum keeps that
    # tile), 3 with the weight-noise term
    n_acc = max(2, len(sch.get(blk).writes))
    pads = list(sch.get_producers(blk))
    b, o, i, j, rc, rp, rq = sch.get_loops(blk)
    n_o, ow = static_extent(sch, o), static_extent(sch, j)
    vectorize = vectorizable(sch, [blk])
    vec_o = pow2_divisor(n_o, lanes) if vectorize else 1
    vec_j = pow2_divisor(ow, lanes) if vectorize else 1
    if vec_o > 1 and vec_o >= vec_j:
        _transpose_conv_weights(sch, blk)
        oo, ov = sch.split(o, [None, vec_o])
        jo, jm = sch.split(j, [None, divisor_at_most(ow, CONV_TILE_COLUMNS)])
        sch.reorder(b, oo, i, jo, rc, rp, rq, jm, ov)
        par = sch.fuse(b, oo, i, jo)
        unrolled: tuple[Any, ...] = (rp, rq, jm)
        vector = ov
    else:
        jm = divisor_at_most(ow // vec_j, 4)
        ot = divisor_at_most(n_o, max(1, budget // (n_acc * jm)))
        oo, oi = sch.split(o, [None, ot])
        jo, jmm, jv = sch.split(j, [None, jm, vec_j])
        sch.reorder(b, oo, i, jo, rc, rp, rq, oi, jmm, jv)
        par = sch.fuse(b, oo, i, jo)
        unrolled, vector = (rp, rq, oi, jmm), (jv if vec_j > 1 else None)
    sch.parallel(par)
    epilogue_at(sch, blk, par, lanes)
    for pad in pads:
        sch.compute_at(pad, par)
        vectorize_inner(sch, pad, lanes)
    window = static_extent(sch, rp) * static_extent(sch, rq)
    for loop in unrolled:
        if window <= CONV_MAX_UNROLLED_WINDOW or not (loop.same_as(rp) or loop.same_as(rq)):
            sch.unroll(loop)
    if vector is not None:
        sch.vectorize(vector)
    sch.decompose_reduction(blk, rc)


def _transpose_conv_weights(sch: s_tir.Schedule, blk: Any) -> None:
    """Read the conv weights -- the function inputs the block indexes by its output-channel iter
    var in the first dimension -- through a copy in ``(C, KH, KW, O)`` layout, made once per call
    before the main loop."""
    params = list(sch.mod["main"].params)
    v_o = sch.get(blk).iter_vars[1].var
    done: list[Any] = []
    while True:
        todo = None
        for index, region in enumerate(sch.get(blk).reads):
            buf = region.source
            if (len(region.region) == 4 and region.region[0].min.same_as(v_o)
                    and any(buf.same_as(p) for p in params) and not any(buf.same_as(d) for d in done)):
                todo = (index, buf)
                break
        if todo is None:
            return
        index, buf = todo
        cache = sch.cache_read(blk, index, "global")
        sch.transform_layout(cache, ("write", 0), lambda o, c, p, q: (c, p, q, o))
        done.append(buf)
