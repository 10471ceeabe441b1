"""``window_cov``: the covariances between the taps of each max-pooling window, from the conv that
feeds the pool (inserted by the planner, :mod:`pyro2pfp.planning.correlated_pools`; never converted from torch).

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
deterministic edge.  The TVM kernel and schedule: ``backends/tvm/ops/window_covariance.py``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import moments
from ..backends.onnx.builder import OnnxActivation, OnnxContext, Sym, exporter
from ..backends.reference import Activation, reference
from ..backends.reference.arrays import conv2d_nchw, padded, window_views
from ..correlation.factors import FactorPlan
from ..correlation.onnx_step import OnnxShared, OnnxSharedStep
from ..correlation.shared import Shared
from ..correlation.stein import mean_and_slope
from ..planning.graph import Layer, Repr
from ..planning.plan import PlannedLayer, stored_variance
from ..planning.registry import (
    OPS,
    CompactSpec,
    Contract,
    FactorSpec,
    OpDef,
    register_op,
    shared_exporter,
    shared_reference,
)

D = Repr.DETERMINISTIC


def _covariance_op(name: str, modules: str, moments: str, assumptions: str,
                   stored_tensors: Callable[..., dict[str, np.ndarray]] | None = None,
                   compact_spec: CompactSpec | None = None) -> OpDef:
    """An op the planner inserts before a max pool: a deterministic tensor of in-window covariances."""
    return register_op(OpDef(name, modules=modules, moments=moments, assumptions=assumptions, internal=True,
                             contract=Contract(Repr.VARIANCE, Repr.DETERMINISTIC, keeps_deterministic=True),
                             factor_spec=FactorSpec(covariance=True), stored_tensors=stored_tensors,
                             compact_spec=compact_spec or CompactSpec()))


def _conv_tensors(layer: Layer, input_repr: Repr, calibration: float) -> dict[str, np.ndarray]:
    """The feeding conv's weight means and calibrated variances, and its bias variances if random."""
    tensors = {"weight_mean": layer.params["weight"].mean,
               "weight_var": stored_variance(layer.params["weight"].var, calibration)}
    bias = layer.params.get("bias")
    if bias is not None and not bias.is_deterministic:
        tensors["bias_var"] = stored_variance(bias.var, calibration)
    return tensors


WINDOW_COV = _covariance_op(
    "window_cov", "(inserted by the planner before a max pool fed by a conv)",
    "exact for a conv with independent Gaussian weights and mean-field inputs",
    "mean-field conv input, or the shared-factor plan's covariance of it", stored_tensors=_conv_tensors,
    # its linear map: 2 products of the conv's size (1 on a deterministic input); its output carries no loadings
    compact_spec=CompactSpec(mean_field_products=(1, 2), macs=lambda layer, plan, columns, blocks: (0, 0, (0, 0))))


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
    h, w = x.shape[-2:]
    out = np.zeros_like(x)
    r0, r1, q0, q1 = max(-dr, 0), min(h, h - dr), max(-dq, 0), min(w, w - dq)
    if r0 < r1 and q0 < q1:
        out[..., r0:r1, q0:q1] = x[..., r0 + dr:r1 + dr, q0 + dq:q1 + dq]
    return out


def tap_masks(layer: PlannedLayer) -> np.ndarray:
    """``(P, OH, OW)``: 1 where both taps of the pair lie inside the conv output, else 0."""
    a = layer.layer.attrs
    pool, out_hw = a["pool"], tuple(layer.layer.out_shape[2:])
    ones = padded(np.ones((1, 1, *a["conv_out_hw"])), pool, out_hw, 0.0)
    inside = [v[0, 0] for v in window_views(ones, pool["kernel"], pool["stride"], out_hw)]
    return np.stack([inside[i] * inside[j] for i, j in moments.window_pairs(len(inside))])


# ------------------------------------------------------------------------------------ reference
def _covariances(layer: PlannedLayer, mean: np.ndarray, var: np.ndarray | None, profile: np.ndarray | None = None,
                 factor_map: Any = None) -> np.ndarray:
    """The ``(batch, C, P, OH, OW)`` in-window covariances of the conv: per in-window offset ``d``, the sums of
    the module docstring at every conv output position, with the input ``mean`` (and ``profile``: its products
    join the mean's in the weight-variance term), the shared-element term on ``var`` (None: a deterministic
    input) and ``factor_map(d)`` (the factors' part at offset ``d``, (batch, O, H', W'), or None); each
    evaluated at the first tap of each pair, pairs with a tap outside the conv output zeroed."""
    a, t = layer.layer.attrs, layer.tensors
    conv, pool = a["conv"], a["pool"]
    stride, pad = conv["stride"], conv["padding"]
    out_hw = tuple(layer.layer.out_shape[2:])

    def pad_input(v: np.ndarray) -> np.ndarray:
        return np.pad(v, ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))

    mean = pad_input(mean)
    var = None if var is None else pad_input(var)
    profile = None if profile is None else pad_input(profile)
    bias_var = t["bias_var"][None, :, None, None] if "bias_var" in t else 0.0
    at_offset: dict[tuple[int, int], np.ndarray] = {}
    covs = []
    for tap, d in pair_offsets(pool["kernel"]):
        if d not in at_offset:  # Cov(a[P], a[P + d]) at every conv output position P
            shift = (stride[0] * d[0], stride[1] * d[1])
            products = mean * _shifted(mean, shift)
            if profile is not None:
                products = products + profile * _shifted(profile, shift)
            full = conv2d_nchw(products, t["weight_var"], stride, [0, 0], [1, 1], 1)
            if var is not None:
                full = full + conv2d_nchw(var, shift_product_kernel(t["weight_mean"], shift), stride, [0, 0], [1, 1], 1)
            if factor_map is not None:
                full = full + factor_map(d)
            at_offset[d] = full + bias_var
        views = window_views(padded(at_offset[d], pool, out_hw, 0.0), pool["kernel"], pool["stride"], out_hw)
        covs.append(next(v for k, v in enumerate(views) if taps(pool["kernel"])[k] == tap))
    return np.stack(covs, axis=2) * tap_masks(layer)[None, None]


@reference("window_cov")
def window_cov(layer: PlannedLayer, inputs: list[Activation]) -> Activation:
    x = inputs[0]
    return Activation(_covariances(layer, x.mean, None if x.repr is D else x.variance()), None, D)


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


def _onnx_covariances(ctx: OnnxContext, layer: PlannedLayer, mean: Sym, var: Sym | None, profile: Sym | None = None,
                      factor_map: Any = None) -> Sym:
    """:func:`_covariances` in ONNX: ``Pad``/``Slice`` (shifts), ``Mul`` and ``Conv`` per in-window offset, each
    evaluated at full resolution and sliced at the first tap of each pair; ``Concat`` over the pairs.
    ``factor_map(d)``: the factors' part at offset ``d`` at the conv's output resolution."""
    a, t = layer.layer.attrs, layer.tensors
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

    mean = pad_input(mean)
    var = None if var is None else pad_input(var)
    profile = None if profile is None else pad_input(profile)
    pool_pads = [0, 0, *pool["padding"], 0, 0,
                 *(max(0, (o - 1) * s + k - n - p) for o, s, k, n, p in
                   zip(out_hw, pool["stride"], pool["kernel"], a["conv_out_hw"], pool["padding"]))]
    at_offset: dict[tuple[int, int], Sym] = {}
    covs = []
    for tap, d in pair_offsets(pool["kernel"]):
        if d not in at_offset:
            shift = (stride[0] * d[0], stride[1] * d[1])
            products = mean * _onnx_shifted(ctx, mean, hw, shift)
            if profile is not None:
                products = products + profile * _onnx_shifted(ctx, profile, hw, shift)
            full = ctx.conv2d(products, t["weight_var"], no_pad, "weight_var")
            if var is not None:
                full = full + ctx.conv2d(var, shift_product_kernel(t["weight_mean"], shift), no_pad, "weight_pair")
            if factor_map is not None:
                full = full + factor_map(d)
            if "bias_var" in t:
                full = full + ctx.tensor(t["bias_var"][:, None, None], "bias_var")
            if any(pool_pads):
                full = full.nary("Pad", ctx.b.ints(pool_pads, "pads"), Sym(ctx.b, value=0.0), mode="constant")
            at_offset[d] = full
        ends = [tap[k] + pool["stride"][k] * (out_hw[k] - 1) + 1 for k in (0, 1)]
        view = _slice(ctx, at_offset[d], list(tap), ends, list(pool["stride"]))
        covs.append(view.nary("Unsqueeze", ctx.b.ints([2], "axes")))
    stacked = covs[0].nary("Concat", *covs[1:], axis=2) if len(covs) > 1 else covs[0]
    return stacked * ctx.tensor(tap_masks(layer)[None], "pair_mask")


@exporter("window_cov")
def window_cov_onnx(ctx: OnnxContext, layer: PlannedLayer, inputs: list[OnnxActivation]) -> OnnxActivation:
    """The reference's sums (:func:`_onnx_covariances`)."""
    x = inputs[0]
    return OnnxActivation(_onnx_covariances(ctx, layer, x.mean, None if x.repr is D else ctx.random_variance(x)),
                          None, D)


def stored_tensors(params: dict[str, Any], calibration: float) -> dict[str, np.ndarray]:
    """What :func:`window_cov` reads: the conv's weight means, calibrated weight variances and bias variance."""
    weight = params["weight"]
    tensors = {"weight_mean": weight.mean, "weight_var": calibration * weight.var}
    bias = params.get("bias")
    if bias is not None and not bias.is_deterministic:
        tensors["bias_var"] = calibration * bias.var
    return tensors


# ------------------------------------------------------------------------------------ shared-factor rule
def _mean_weight_map(layer: PlannedLayer, profile: np.ndarray) -> np.ndarray:
    """``u[b, o, c, P] = Σ_k W̄[o, c, k]·s̃[b, c, s·P + k]`` (batch, O, C, H', W'): each input channel's profile
    through the mean weights, not summed over the channels (a grouped convolution, one group per input
    channel)."""
    a, wm = layer.layer.attrs["conv"], layer.tensors["weight_mean"]
    o, c, kh, kw = wm.shape
    grouped = np.swapaxes(wm, 0, 1).reshape(c * o, 1, kh, kw)  # output channel c·O + o reads input channel c
    u = conv2d_nchw(profile, grouped, a["stride"], a["padding"], [1, 1], c)
    return np.swapaxes(u.reshape(u.shape[0], c, o, *u.shape[2:]), 1, 2)


@shared_reference("window_cov")
def window_cov_shared(layer: PlannedLayer, inputs: list[Activation], shared: list[Shared | None], fp: FactorPlan,
                      var: np.ndarray) -> tuple[Shared | None, Activation]:
    """The in-window covariances of a conv whose input carries shared factors (``docs/math.md`` section 6,
    max pooling).  The input's covariance in the scheme is ``Cov(x_i, x_j) = s̃_i·s̃_j·⟨ĝ_i, ĝ_j⟩``
    for ``i ≠ j`` plus the residual ``r_i = v_i − s̃_i²`` on the diagonal (``s̃ = s·‖g_c‖``, ``ĝ`` the unit
    rows of ``g``), so the conv's taps ``P``, ``Q = P + d`` have, exactly under that covariance,

        Cov(a_P, a_Q) = Σ_k V_k·(μ_{P+k}·μ_{Q+k} + s̃_{P+k}·s̃_{Q+k})      (a shared weight)
                      + Σ_k W̄_k·W̄_{k−s·d}·r_{P+k}                        (a shared residual element)
                      + ⟨ℓ_P, ℓ_Q⟩ + Var(b),                              (the factors, through the mean weights)

    ``ℓ_P = Σ_{c,k} W̄[o, c, k]·s̃[c, P+k]·ĝ_c`` -- computed as ``u_Pᵀ·G·u_Q`` with ``u`` of
    :func:`_mean_weight_map` and ``G = g·gᵀ`` (per input).  The first two lines are the mean-field
    :func:`window_cov` with the profile's products beside the mean's and the residual in place of the
    variance: the part of the input's noise that the factors do not carry, so nothing is counted twice.
    Returns ``(None, the covariances)``: the output is a deterministic tensor and carries no shared part."""
    x, sh = inputs[0], shared[0]
    mean = x.mean
    if sh is None:
        return None, Activation(_covariances(layer, mean, None if x.repr is D else x.variance()), None, D)
    norms = np.sqrt((sh.g**2).sum(axis=2))  # (B, C): 1 for a unit row, 0 for an empty one
    profile = sh.s.reshape(mean.shape) * norms[:, :, None, None]
    resid = np.maximum(x.variance() - profile**2, 0.0)
    u = _mean_weight_map(layer, profile)
    gram = np.einsum("bcf,bdf->bcd", sh.g, sh.g)
    mixed = np.einsum("bcd,bodhw->bochw", gram, u)

    def factor_map(d: tuple[int, int]) -> np.ndarray:
        return np.einsum("bochw,bochw->bohw", u, _shifted(mixed, d))

    return None, Activation(_covariances(layer, mean, resid, profile, factor_map), None, D)


@shared_exporter("window_cov")
def window_cov_shared_onnx(step: OnnxSharedStep, ctx: OnnxContext, layer: PlannedLayer, inputs: list[OnnxActivation],
                           shared: list[OnnxShared | None], out: OnnxActivation | None
                           ) -> tuple[OnnxShared | None, OnnxActivation]:
    """:func:`window_cov_shared` in ONNX: ``u`` as a grouped ``Conv`` (one group per input channel, a static
    count), ``G·u`` and the factors' part per offset as Einsums."""
    x, sh = inputs[0], shared[0]
    assert sh is not None and x.second is not None
    wm = layer.tensors["weight_mean"]
    o, c, kh, kw = wm.shape
    conv = layer.layer.attrs["conv"]
    out_h, out_w = layer.layer.attrs["conv_out_hw"]
    norms = step.rsum(sh.g * sh.g, [2]).unary("Sqrt")  # (B, C, 1)
    profile = sh.s * step.view_as(norms, c, 1, 1)
    resid = (step.var(x) - profile * profile).nary("Max", step.c(0.0))
    grouped = np.swapaxes(wm, 0, 1).reshape(c * o, 1, kh, kw)
    u = ctx.conv2d(profile, grouped, {"stride": conv["stride"], "padding": conv["padding"], "dilation": [1, 1],
                                      "groups": c}, "mean_weight_map")  # (B, C·O, H', W'), channel c·O + o
    gram = step.einsum("bcf,bdf->bcd", sh.g, sh.g)
    u5 = step.view_as(u, c, o, out_h, out_w)
    mixed = step.view_as(step.einsum("bcd,bdohw->bcohw", gram, u5), c * o, out_h, out_w)

    def factor_map(d: tuple[int, int]) -> Sym:
        shifted = step.view_as(_onnx_shifted(ctx, mixed, (out_h, out_w), d), c, o, out_h, out_w)
        return step.einsum("bcohw,bcohw->bohw", u5, shifted)

    return None, OnnxActivation(_onnx_covariances(ctx, layer, x.mean, resid, profile, factor_map), None, D)


# ------------------------------------------------------------------------------------ pools not fed by a conv
WINDOW_CLOSURE = _covariance_op(
    "window_closure", "(inserted by the planner before a max pool of a shared-factor plan)",
    "the shared-factor scheme's covariance of two elements of a channel", "the scheme's rank-1-per-channel closure")

WINDOW_ACTIVATION = _covariance_op(
    "window_activation", "(inserted by the planner before a max pool that reads an activation)",
    "Mehler's expansion of the bivariate normal to second order", "jointly Gaussian pre-activations")


def _pool_taps(layer: PlannedLayer, t: Any, fill: float = 0.0) -> list[Any]:
    """The window taps (row-major) of a ``(B, C, H, W)`` array ``t`` at the pooled positions of ``layer``'s pool."""
    pool, out_hw = layer.layer.attrs["pool"], tuple(layer.layer.out_shape[2:])
    return list(window_views(padded(t, pool, out_hw, fill), pool["kernel"], pool["stride"], out_hw))


def closure_pairs(s_a: list[Any], s_b: list[Any] | None, dot: Any) -> list[Any]:
    """The shared factors' covariance of every pair ``(i, j)`` of a window: ``s_i·s_j·dot`` for one edge
    (``s_b`` None; ``dot = ‖g_c‖²``), ``(s_a,i·s_b,j + s_b,i·s_a,j)·dot`` between two (``dot = ⟨g_a,c, g_b,c⟩``);
    ``s_a``, ``s_b``: the profiles at the window's taps (0 outside the input)."""
    pairs = moments.window_pairs(len(s_a))
    if s_b is None:
        return [s_a[i] * s_a[j] * dot for i, j in pairs]
    return [(s_a[i] * s_b[j] + s_b[i] * s_a[j]) * dot for i, j in pairs]


@reference("window_closure")
def window_closure(layer: PlannedLayer, inputs: list[Activation]) -> Activation:
    """Without shared parts (a mean-field input): 0."""
    return Activation(np.zeros((inputs[0].mean.shape[0], *layer.layer.out_shape)), None, D)


@shared_reference("window_closure")
def window_closure_shared(layer: PlannedLayer, inputs: list[Activation], shared: list[Shared | None],
                          fp: FactorPlan, var: np.ndarray) -> tuple[Shared | None, Activation]:
    """The in-window covariances the shared factors give an edge that is not a conv output (or, with two
    inputs, the covariance between two summands of a residual add): the scheme's closure ``Cov(a[c, P],
    a[c, Q]) = s_P·s_Q·‖g_c‖²`` (one input) and ``Cov(a_P, b_Q) + Cov(b_P, a_Q) = (s_a,P·s_b,Q +
    s_b,P·s_a,Q)·⟨g_a,c, g_b,c⟩`` (two: the branches' covariance through their shared factors, which the
    add rule adds to the variance).  An input without a shared part contributes 0."""
    shape = inputs[0].mean.shape
    present = [sh for sh in shared if sh is not None]
    if len(present) < len(shared):
        return None, window_closure(layer, inputs)
    k = max(sh.g.shape[2] for sh in present)
    gs = [sh.widened(k) for sh in present]
    dot = (gs[0] * gs[-1]).sum(axis=2)[:, :, None, None]
    profiles = [_pool_taps(layer, sh.s.reshape(shape)) for sh in present]
    pairs = closure_pairs(profiles[0], profiles[1] if len(profiles) == 2 else None, dot)
    return None, Activation(np.stack(pairs, axis=2), None, D)


def hermite_terms(layer: PlannedLayer, mean: Any, var: Any, ops: Any) -> tuple[Any, Any, Any]:
    """Per element of a ``window_activation`` layer's pre-activation ``a ~ N(mean, var)``: ``(σ, A_1, R)`` with
    ``A_1 = σ·E[f'(a)]`` (Stein's slope: the exact ``μ``-derivative of the activation rule's own mean,
    :mod:`pyro2pfp.correlation.stein`) and ``R = Var f(a) − A_1²`` (clamped at 0; the rule's variance)."""
    a = layer.layer.attrs
    rule = OPS[a["activation"]].activation
    assert rule is not None
    zero = ops.const(0.0)
    _, slope = mean_and_slope(rule, mean, var, a["attrs"], ops)
    sd = ops.sqrt(ops.maximum(var, zero))
    a1 = sd * slope
    return sd, a1, ops.maximum(rule.moments(mean, var, a["attrs"], ops)[1] - a1 * a1, zero)


def mehler_covariance(i: tuple[Any, Any, Any], j: tuple[Any, Any, Any], cov: Any, ops: Any) -> Any:
    """``Cov(f(a_i), f(a_j))`` of jointly Gaussian pre-activations with covariance ``cov`` and the
    :func:`hermite_terms` ``i = (σ_i, A_1,i, R_i)``, ``j``: Mehler's expansion ``Σ_{n≥1} ρⁿ/n!·A_n,i·A_n,j``
    (``ρ`` the correlation, ``A_n = σⁿ·E[f⁽ⁿ⁾(a)]`` the Hermite coefficients; Mehler 1866, Kibble 1945) with
    the first term exact and the rest bounded by Cauchy-Schwarz, ``ρ²·√(R_i·R_j)`` (``Σ_{n≥2} A_n²/n! = R``):
    exact for a linear ``f``, to second order in ``ρ`` when ``A_2`` dominates the higher terms, and at
    ``ρ = 1`` for equal taps (then ``Var f(a)``)."""
    zero = ops.const(0.0)
    den = i[0] * j[0]
    rho = ops.where(den > zero, cov / ops.where(den > zero, den, ops.const(1.0)), zero)
    rho = ops.minimum(ops.maximum(rho, ops.const(-1.0)), ops.const(1.0))
    return rho * i[1] * j[1] + rho * rho * ops.sqrt(i[2] * j[2])


@reference("window_activation")
def window_activation(layer: PlannedLayer, inputs: list[Activation]) -> Activation:
    x, cov = inputs
    terms = [_pool_taps(layer, t) for t in hermite_terms(layer, x.mean, x.variance(), moments.NUMPY)]
    taps_ = list(zip(*terms))
    pairs = [mehler_covariance(taps_[i], taps_[j], cov.mean[:, :, k], moments.NUMPY)
             for k, (i, j) in enumerate(moments.window_pairs(len(taps_)))]
    return Activation(np.stack(pairs, axis=2) * closure_mask(layer)[None, None], None, D)


def closure_mask(layer: PlannedLayer) -> np.ndarray:
    """``(P, OH, OW)``: 1 where both taps of the pair lie inside the pool's input, else 0."""
    pool, out_hw = layer.layer.attrs["pool"], tuple(layer.layer.out_shape[2:])
    ones = padded(np.ones((1, 1, *layer.layer.attrs["in_hw"])), pool, out_hw, 0.0)
    inside = [v[0, 0] for v in window_views(ones, pool["kernel"], pool["stride"], out_hw)]
    return np.stack([inside[i] * inside[j] for i, j in moments.window_pairs(len(inside))])


@shared_reference("window_activation")
def window_activation_shared(layer: PlannedLayer, inputs: list[Activation], shared: list[Shared | None],
                             fp: FactorPlan, var: np.ndarray) -> tuple[Shared | None, Activation]:
    """The same as without shared factors (the input covariances carry them)."""
    return None, window_activation(layer, inputs)


def _onnx_pool_taps(ctx: OnnxContext, layer: PlannedLayer, t: Sym, fill: float = 0.0) -> list[Sym]:
    """:func:`_pool_taps` in ONNX: ``Pad`` (the pool's padding and overhang) and one strided ``Slice`` per tap."""
    pool, out_hw = layer.layer.attrs["pool"], tuple(layer.layer.out_shape[2:])
    in_hw = layer.layer.attrs["in_hw"]
    ends = [max(0, (o - 1) * s + k - n - p) for o, s, k, n, p in
            zip(out_hw, pool["stride"], pool["kernel"], in_hw, pool["padding"])]
    if any(pool["padding"]) or any(ends):
        t = t.nary("Pad", ctx.b.ints([0, 0, *pool["padding"], 0, 0, *ends], "pads"), Sym(ctx.b, value=fill),
                   mode="constant")
    return [_slice(ctx, t, list(tap), [tap[k] + pool["stride"][k] * (out_hw[k] - 1) + 1 for k in (0, 1)],
                   list(pool["stride"])) for tap in taps(pool["kernel"])]


def _onnx_stack(ctx: OnnxContext, pairs: list[Sym]) -> Sym:
    """``(B, C, OH, OW)`` pairs stacked to ``(B, C, P, OH, OW)``."""
    covs = [p.nary("Unsqueeze", ctx.b.ints([2], "axes")) for p in pairs]
    return covs[0].nary("Concat", *covs[1:], axis=2) if len(covs) > 1 else covs[0]


@exporter("window_closure")
def window_closure_onnx(ctx: OnnxContext, layer: PlannedLayer, inputs: list[OnnxActivation]) -> OnnxActivation:
    """Zeros (no shared parts)."""
    tap = _onnx_pool_taps(ctx, layer, inputs[0].mean)[0]
    return OnnxActivation(ctx.zeros_like(_onnx_stack(ctx, [tap] * int(layer.layer.out_shape[1]))), None, D)


@shared_exporter("window_closure")
def window_closure_shared_onnx(step: OnnxSharedStep, ctx: OnnxContext, layer: PlannedLayer,
                               inputs: list[OnnxActivation], shared: list[OnnxShared | None],
                               out: OnnxActivation | None) -> tuple[OnnxShared | None, OnnxActivation]:
    """:func:`window_closure_shared` in ONNX."""
    if any(sh is None for sh in shared):
        return None, window_closure_onnx(ctx, layer, inputs)
    present = [sh for sh in shared if sh is not None]
    k = max(sh.k for sh in present)
    gs = [step.widened(sh.g, sh.k, k) for sh in present]
    dot = step.view_as(step.rsum(gs[0] * gs[-1], [2]), layer.layer.out_shape[0], 1, 1)
    profiles = [_onnx_pool_taps(ctx, layer, sh.s) for sh in present]
    pairs = closure_pairs(profiles[0], profiles[1] if len(profiles) == 2 else None, dot)
    return None, OnnxActivation(_onnx_stack(ctx, pairs), None, D)


@exporter("window_activation")
def window_activation_onnx(ctx: OnnxContext, layer: PlannedLayer, inputs: list[OnnxActivation]) -> OnnxActivation:
    """The reference's pairs: the Hermite terms per element, their taps, Mehler's covariance per pair."""
    x, cov = inputs
    terms = [_onnx_pool_taps(ctx, layer, t) for t in hermite_terms(layer, x.mean, ctx.random_variance(x), ctx.ops)]
    taps_ = list(zip(*terms))
    pairs = [mehler_covariance(taps_[i], taps_[j], _pair_of(ctx, cov.mean, k), ctx.ops)
             for k, (i, j) in enumerate(moments.window_pairs(len(taps_)))]
    return OnnxActivation(_onnx_stack(ctx, pairs) * ctx.tensor(closure_mask(layer)[None], "pair_mask"), None, D)


def _pair_of(ctx: OnnxContext, cov: Sym, k: int) -> Sym:
    """Pair ``k`` of a ``(batch, C, P, OH, OW)`` covariance tensor as ``(batch, C, OH, OW)``."""
    one = cov.nary("Slice", ctx.b.ints([k], "starts"), ctx.b.ints([k + 1], "ends"), ctx.b.ints([2], "axes"))
    return one.nary("Squeeze", ctx.b.ints([2], "axes"))


@shared_exporter("window_activation")
def window_activation_shared_onnx(step: OnnxSharedStep, ctx: OnnxContext, layer: PlannedLayer,
                                  inputs: list[OnnxActivation], shared: list[OnnxShared | None],
                                  out: OnnxActivation | None) -> tuple[OnnxShared | None, OnnxActivation]:
    """The same as without shared factors."""
    return None, window_activation_onnx(ctx, layer, inputs)
