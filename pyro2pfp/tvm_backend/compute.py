"""Joint PFP dense and conv2d TE kernels: one reduction computes mean and variance together.

Deterministic input ``x``:      ``μ = Σ μw·x``,   ``v = Σ vw·x²``                   (weights: μw, vw)
Variance input ``(μx, vx)``:    ``μ = Σ μw·μx``,  ``v = Σ vw·(μx² + vx) + μw²·vx``  (weights: μw, vw)
Raw-moment input ``(μx, sx)``:  ``μ = Σ μw·μx``,  ``v = Σ sw·sx − (μw·μx)²``        (weights: μw, sw = E[w²])

The epilogue adds the bias (mean and, if probabilistic, variance), clamps the variance at 0 and
converts to the representation the plan asks for.  Dense weights are stored transposed (K, M) so
the output axis is unit-stride; conv weights are stored (C/groups, KH, KW, O) for the same reason.
Dense weights are also zero-padded to whole vectors (:func:`dense_padded_columns`): the
accumulation runs over whole SIMD vectors (a width that divides ``M`` -- 4 for ``M = 100`` -- would
leave most of an AVX-512 register idle), and the epilogue reads only the ``M`` real columns.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from tvm import te, tirx

from .. import moments
from ..graph import Repr
from ..plan import PlannedLayer
from ._core import F32, EmitContext, RelaxActivation, activation_out, epilogue, kernel, pair_sum, te_shared


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
                    activation: PlannedLayer | None = None) -> list[te.Tensor]:
    """Bias, variance clamp and representation conversion of the accumulated sums; ``shape``
    (default: the accumulators') may cut off padding columns.  With a fused ``activation`` (a
    ReLU layer, see ``_core.fused_activations``) the ReLU's output moments are emitted instead,
    in its representation."""
    def f(*idx):
        mean, var = acc_mean[idx], acc_var[idx]
        if bias:
            mean = mean + bias[0][idx[channel_axis]]
        if len(bias) > 1:
            var = var + bias[1][idx[channel_axis]]
        var = te.max(var, tirx.const(0.0, F32))
        if activation is None:
            return epilogue(mean, var, layer)
        return te_shared(lambda ops: epilogue(*moments.relu_moments(mean, var, ops), activation))

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


def _pad(x: te.Tensor, padding: list[int]) -> te.Tensor:
    ph, pw = padding
    if ph == 0 and pw == 0:
        return x
    n, c, h, w = x.shape

    def f(b, ch, i, j):
        inside = tirx.all(i >= ph, i < h + ph, j >= pw, j < w + pw)
        return tirx.if_then_else(inside, x[b, ch, i - ph, j - pw], tirx.const(0.0, F32))

    return te.compute((n, c, h + 2 * ph, w + 2 * pw), f, name="pad")


@kernel("conv2d")
def conv2d(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    x = inputs[0]
    a = layer.layer.attrs
    deterministic = x.repr is Repr.DETERMINISTIC
    n_x = len(x.tensors())
    out_c, out_h, out_w = layer.layer.out_shape

    def fn(*tensors: te.Tensor) -> list[te.Tensor]:
        x_mean = _pad(tensors[0], a["padding"])
        x_second = None if deterministic else _pad(tensors[1], a["padding"])
        w_mean, w_second = tensors[n_x:n_x + 2]
        bias = list(tensors[n_x + 2:])
        c_per_group, kh, kw, _ = (int(d) for d in w_mean.shape)
        o_per_group = out_c // a["groups"]
        rc = te.reduce_axis((0, c_per_group), name="rc")
        rp = te.reduce_axis((0, kh), name="rp")
        rq = te.reduce_axis((0, kw), name="rq")
        (sh, sw), (dh, dw) = a["stride"], a["dilation"]

        def body(b, o, i, j):
            c = (o // o_per_group) * c_per_group + rc if a["groups"] > 1 else rc
            pos = (b, c, i * sh + rp * dh, j * sw + rq * dw)
            xs = None if x_second is None else x_second[pos]
            return pair_sum(_terms(x_mean[pos], xs, w_mean[rc, rp, rq, o], w_second[rc, rp, rq, o], x.repr),
                            axis=[rc, rp, rq])

        acc = te.compute((tensors[0].shape[0], out_c, out_h, out_w), body, name="conv2d")
        return _epilogue_stage(acc[0], acc[1], bias, 1, layer, activation=ctx.activation)

    outs = ctx.emit_te(fn, x.tensors() + _weights_and_bias(ctx, layer, (1, 2, 3, 0)), layer)  # (C, KH, KW, O)
    return activation_out(outs, ctx.activation or layer)



