"""``window_cov``: the covariances between the taps of each max-pooling window, from the conv that
feeds the pool (inserted by the planner, :mod:`pyro2pfp.correlated_pools`; never converted from torch).

Inside a pooling window the conv outputs are strongly correlated: the same Gaussian weights act on
overlapping, often nearly equal input patches.  Clark's max of *independent* Gaussians then
over-states the mean of the max and under-states its variance; the correlated fold
(:func:`pyro2pfp.moments.correlated_window_max`) needs, per window, the covariance of every pair of
taps.  For a conv ``a[P] = Σ_k W_k·x[s·P + k] + b`` (``k`` over input channels and kernel offsets,
``s`` the conv stride, ``x`` zero-padded) with independent Gaussian weights and mean-field inputs
``x ~ N(μ, v)``, two outputs of the same channel at ``P`` and ``Q = P + d`` (``d ≠ 0``) have

    Cov(a[P], a[Q]) = Σ_k Var(W_k)·μ[s·P + k]·μ[s·P + s·d + k]          (a shared weight)
                    + Σ_k E[W_k]·E[W_{k − s·d}]·v[s·P + k]               (a shared input element)
                    + Var(b)

(exact under those assumptions; the first term alone, plus ``Var(b)``, for a deterministic input).
So each in-window offset ``d`` costs two convolutions: of the product image ``μ·shift(μ, s·d)`` with
the weight variances, and of the input variance with the kernel ``W·shift(W, −s·d)``; they are
evaluated at the positions of the first tap of each pair only.  Source: the second-moment algebra of
a linear map of independent variables (as in Wu et al. 2019, "Deterministic Variational Inference for
Robust Bayesian Neural Networks", for dense layers); the pooling fold is Clark (1961).

Output: ``(batch, C, P, OH, OW)``, ``P`` the window's pairs in :func:`pyro2pfp.moments.window_pairs`
order, ``(OH, OW)`` the pooled shape; pairs with a tap outside the conv output (pool padding,
ceil-mode overhang) hold 0 (such a tap is the fold's identity).  It is a plain tensor, carried as a
deterministic edge.  The TVM kernel and schedule: ``tvm_backend/ops/window_covariance.py``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import moments
from ..graph import Repr
from ..onnx_builder import OnnxActivation, OnnxContext, Sym, exporter
from ..plan import PlannedLayer
from ..reference import Activation, reference
from ..reference.arrays import conv2d_nchw, padded, window_views
from ..registry import Contract, OpDef, register_op

D = Repr.DETERMINISTIC

WINDOW_COV = register_op(OpDef(
    "window_cov", modules="(inserted by the planner before a max pool fed by a conv)",
    moments="exact for a conv with independent Gaussian weights and mean-field inputs",
    assumptions="mean-field conv input", internal=True,
    contract=Contract(Repr.VARIANCE, Repr.DETERMINISTIC, keeps_deterministic=True),
    no_shared_rule="inserted only into mean-field plans (correlated max pooling), never beside shared factors"))


def taps(kernel: list[int]) -> list[tuple[int, int]]:
    """The window's tap offsets in row-major order (the fold's order)."""
    return [(r, c) for r in range(kernel[0]) for c in range(kernel[1])]


def pair_offsets(kernel: list[int]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Per pair of :func:`pyro2pfp.moments.window_pairs`: (first tap's offset, offset of the second from it)."""
    t = taps(kernel)
    return [(t[i], (t[j][0] - t[i][0], t[j][1] - t[i][1])) for i, j in moments.window_pairs(len(t))]


def shift_product_kernel(weight: np.ndarray, shift: tuple[int, int]) -> np.ndarray:
    """``K[o, c, r, q] = W[o, c, r, q]·W[o, c, r − dr, q − dq]`` (0 where ``(r − dr, q − dq)`` leaves the
    kernel): the weights of the shared-input-element term for an input offset ``(dr, dq)``."""
    kh, kw = weight.shape[2:]
    dr, dq = shift
    shifted = np.zeros_like(weight)
    r0, r1, q0, q1 = max(dr, 0), min(kh, kh + dr), max(dq, 0), min(kw, kw + dq)
    if r0 < r1 and q0 < q1:
        shifted[:, :, r0:r1, q0:q1] = weight[:, :, r0 - dr:r1 - dr, q0 - dq:q1 - dq]
    return weight * shifted


def _shifted(x: np.ndarray, shift: tuple[int, int]) -> np.ndarray:
    """``y[..., i, j] = x[..., i + dr, j + dq]`` (0 outside ``x``)."""
    dr, dq = shift
    h, w = x.shape[2:]
    out = np.zeros_like(x)
    r0, r1, q0, q1 = max(-dr, 0), min(h, h - dr), max(-dq, 0), min(w, w - dq)
    if r0 < r1 and q0 < q1:
        out[:, :, r0:r1, q0:q1] = x[:, :, r0 + dr:r1 + dr, q0 + dq:q1 + dq]
    return out


def tap_masks(layer: PlannedLayer) -> np.ndarray:
    """``(P, OH, OW)``: 1 where both taps of the pair lie inside the conv output, else 0."""
    a = layer.layer.attrs
    pool, out_hw = a["pool"], tuple(layer.layer.out_shape[2:])
    ones = padded(np.ones((1, 1, *a["conv_out_hw"])), pool, out_hw, 0.0)
    inside = [v[0, 0] for v in window_views(ones, pool["kernel"], pool["stride"], out_hw)]
    return np.stack([inside[i] * inside[j] for i, j in moments.window_pairs(len(inside))])


# ------------------------------------------------------------------------------------ reference
@reference("window_cov")
def window_cov(layer: PlannedLayer, inputs: list[Activation]) -> Activation:
    a, t, x = layer.layer.attrs, layer.tensors, inputs[0]
    conv, pool = a["conv"], a["pool"]
    stride, pad = conv["stride"], conv["padding"]
    out_hw = tuple(layer.layer.out_shape[2:])

    def pad_input(v: np.ndarray) -> np.ndarray:
        return np.pad(v, ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))

    mean = pad_input(x.mean)
    var = None if x.repr is D else pad_input(x.variance())
    bias_var = t["bias_var"][None, :, None, None] if "bias_var" in t else 0.0
    at_offset: dict[tuple[int, int], np.ndarray] = {}
    covs = []
    for tap, d in pair_offsets(pool["kernel"]):
        if d not in at_offset:  # Cov(a[P], a[P + d]) at every conv output position P
            shift = (stride[0] * d[0], stride[1] * d[1])
            full = conv2d_nchw(mean * _shifted(mean, shift), t["weight_var"], stride, [0, 0], [1, 1], 1)
            if var is not None:
                full = full + conv2d_nchw(var, shift_product_kernel(t["weight_mean"], shift), stride, [0, 0], [1, 1], 1)
            at_offset[d] = full + bias_var
        views = window_views(padded(at_offset[d], pool, out_hw, 0.0), pool["kernel"], pool["stride"], out_hw)
        covs.append(next(v for k, v in enumerate(views) if taps(pool["kernel"])[k] == tap))
    cov = np.stack(covs, axis=2) * tap_masks(layer)[None, None]
    return Activation(cov, None, D)


# ------------------------------------------------------------------------------------ ONNX
def _slice(ctx: OnnxContext, x: Sym, starts: list[int], ends: list[int], steps: list[int]) -> Sym:
    return x.nary("Slice", ctx.b.ints(starts, "starts"), ctx.b.ints(ends, "ends"), ctx.b.ints([2, 3], "axes"),
                  ctx.b.ints(steps, "steps"))


def _onnx_shifted(ctx: OnnxContext, x: Sym, hw: tuple[int, int], shift: tuple[int, int]) -> Sym:
    """:func:`_shifted` as ``Pad`` + ``Slice``."""
    (dr, dq), (h, w) = shift, hw
    pads = [0, 0, max(-dr, 0), max(-dq, 0), 0, 0, max(dr, 0), max(dq, 0)]
    if not any(pads):
        return x
    grown = x.nary("Pad", ctx.b.ints(pads, "pads"), Sym(ctx.b, value=0.0), mode="constant")
    return _slice(ctx, grown, [max(dr, 0), max(dq, 0)], [max(dr, 0) + h, max(dq, 0) + w], [1, 1])


@exporter("window_cov")
def window_cov_onnx(ctx: OnnxContext, layer: PlannedLayer, inputs: list[OnnxActivation]) -> OnnxActivation:
    """The reference's sums as ``Pad``/``Slice`` (shifts), ``Mul`` and ``Conv`` per in-window offset, each
    evaluated at full resolution and sliced at the first tap of each pair; ``Concat`` over the pairs."""
    a, t, x = layer.layer.attrs, layer.tensors, inputs[0]
    conv, pool = a["conv"], a["pool"]
    stride, pad = conv["stride"], conv["padding"]
    out_hw = tuple(layer.layer.out_shape[2:])
    in_hw = tuple(ctx.shapes[layer.inputs[0]][1:])
    hw = (in_hw[0] + 2 * pad[0], in_hw[1] + 2 * pad[1])
    no_pad = {"stride": stride, "padding": [0, 0], "dilation": [1, 1], "groups": 1}

    def pad_input(v: Sym) -> Sym:
        if not any(pad):
            return v
        return v.nary("Pad", ctx.b.ints([0, 0, pad[0], pad[1], 0, 0, pad[0], pad[1]], "pads"),
                      Sym(ctx.b, value=0.0), mode="constant")

    mean = pad_input(x.mean)
    var = None if x.repr is D else pad_input(ctx.random_variance(x))
    pool_pads = [0, 0, *pool["padding"], 0, 0,
                 *(max(0, (o - 1) * s + k - n - p) for o, s, k, n, p in
                   zip(out_hw, pool["stride"], pool["kernel"], a["conv_out_hw"], pool["padding"]))]
    at_offset: dict[tuple[int, int], Sym] = {}
    covs = []
    for tap, d in pair_offsets(pool["kernel"]):
        if d not in at_offset:
            shift = (stride[0] * d[0], stride[1] * d[1])
            full = ctx.conv2d(mean * _onnx_shifted(ctx, mean, hw, shift), t["weight_var"], no_pad, "weight_var")
            if var is not None:
                full = full + ctx.conv2d(var, shift_product_kernel(t["weight_mean"], shift), no_pad, "weight_pair")
            if "bias_var" in t:
                full = full + ctx.tensor(t["bias_var"][:, None, None], "bias_var")
            if any(pool_pads):
                full = full.nary("Pad", ctx.b.ints(pool_pads, "pads"), Sym(ctx.b, value=0.0), mode="constant")
            at_offset[d] = full
        ends = [tap[k] + pool["stride"][k] * (out_hw[k] - 1) + 1 for k in (0, 1)]
        view = _slice(ctx, at_offset[d], list(tap), ends, list(pool["stride"]))
        covs.append(view.nary("Unsqueeze", ctx.b.ints([2], "axes")))
    stacked = covs[0].nary("Concat", *covs[1:], axis=2) if len(covs) > 1 else covs[0]
    return OnnxActivation(stacked * ctx.tensor(tap_masks(layer)[None], "pair_mask"), None, D)


def stored_tensors(params: dict[str, Any], calibration: float) -> dict[str, np.ndarray]:
    """What :func:`window_cov` reads: the conv's weight means, calibrated weight variances and bias variance."""
    weight = params["weight"]
    tensors = {"weight_mean": weight.mean, "weight_var": calibration * weight.var}
    bias = params.get("bias")
    if bias is not None and not bias.is_deterministic:
        tensors["bias_var"] = calibration * bias.var
    return tensors
