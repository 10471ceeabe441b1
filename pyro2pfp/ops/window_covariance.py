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
from ..backends.reference.arrays import padded, window_views
from ..correlation.factors import FactorPlan
from ..correlation.shared import Shared
from ..correlation.shared_algebra import SharedAlgebra
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
)
from ._formula import formula, shared_formula

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


def shifted(bk: Any, x: Any, hw: tuple[int, int], shift: tuple[int, int]) -> Any:
    """``y[..., i, j] = x[..., i + dr, j + dq]`` (0 outside ``x``; ``x`` (B, C, *hw)): a pad and a window."""
    (dr, dq) = shift
    if not dr and not dq:
        return x
    grown = bk.pad2d(x, (max(-dr, 0), max(-dq, 0)), (max(dr, 0), max(dq, 0)))
    return bk.window(grown, (max(dr, 0), max(dq, 0)), (1, 1), hw)


def tap_masks(layer: PlannedLayer) -> np.ndarray:
    """``(P, OH, OW)``: 1 where both taps of the pair lie inside the conv output, else 0."""
    a = layer.layer.attrs
    pool, out_hw = a["pool"], tuple(layer.layer.out_shape[2:])
    ones = padded(np.ones((1, 1, *a["conv_out_hw"])), pool, out_hw, 0.0)
    inside = [v[0, 0] for v in window_views(ones, pool["kernel"], pool["stride"], out_hw)]
    return np.stack([inside[i] * inside[j] for i, j in moments.window_pairs(len(inside))])


# ------------------------------------------------------------------------------------ reference and ONNX export
def _covariances(bk: Any, layer: PlannedLayer, mean: Any, var: Any, in_hw: tuple[int, ...], profile: Any = None,
                 factor_map: Any = None) -> Any:
    """The ``(batch, C, P, OH, OW)`` in-window covariances of the conv: per in-window offset ``d``, the sums of
    the module docstring at every conv output position, with the input ``mean`` (and ``profile``: its products
    join the mean's in the weight-variance term), the shared-element term on ``var`` (None: a deterministic
    input) and ``factor_map(d)`` (the factors' part at offset ``d``, (batch, O, H', W'), or None); each
    evaluated at the first tap of each pair, pairs with a tap outside the conv output zeroed.  A formula over
    ``bk`` (the float64 reference, the ONNX export: pads, windows, products and a convolution per offset)."""
    a, t = layer.layer.attrs, layer.tensors
    conv, pool = a["conv"], a["pool"]
    stride, pad = tuple(conv["stride"]), tuple(conv["padding"])
    c, _, oh, ow = layer.layer.out_shape
    hw = (in_hw[0] + 2 * pad[0], in_hw[1] + 2 * pad[1])
    no_pad = {"stride": stride, "padding": [0, 0], "dilation": [1, 1], "groups": 1}
    mean = bk.pad2d(mean, pad, pad)
    var = None if var is None else bk.pad2d(var, pad, pad)
    profile = None if profile is None else bk.pad2d(profile, pad, pad)
    pool_end = tuple(max(0, (o - 1) * s + k - n - p) for o, s, k, n, p in
                     zip((oh, ow), pool["stride"], pool["kernel"], a["conv_out_hw"], pool["padding"]))
    at_offset: dict[tuple[int, int], Any] = {}
    covs = []
    for tap, d in pair_offsets(pool["kernel"]):
        if d not in at_offset:  # Cov(a[P], a[P + d]) at every conv output position P
            shift = (stride[0] * d[0], stride[1] * d[1])
            products = mean * shifted(bk, mean, hw, shift)
            if profile is not None:
                products = products + profile * shifted(bk, profile, hw, shift)
            full = bk.conv2d(products, t["weight_var"], no_pad, "weight_var")
            if var is not None:
                full = full + bk.conv2d(var, shift_product_kernel(t["weight_mean"], shift), no_pad, "weight_pair")
            if factor_map is not None:
                full = full + factor_map(d)
            if "bias_var" in t:
                full = full + bk.tensor(t["bias_var"][:, None, None], "bias_var")
            at_offset[d] = bk.pad2d(full, tuple(pool["padding"]), pool_end)
        covs.append(bk.reshape(bk.window(at_offset[d], tap, tuple(pool["stride"]), (oh, ow)), (c, 1, oh, ow)))
    return bk.concat(covs, 1) * bk.tensor(tap_masks(layer)[None], "pair_mask")


@formula("window_cov")
def window_cov(bk: Any, layer: PlannedLayer, inputs: list[Any]) -> Any:
    """The module docstring's sums (:func:`_covariances`)."""
    x = inputs[0]
    in_hw = tuple(bk.edge_shape(x, layer.inputs[0])[1:])
    return bk.deterministic(_covariances(bk, layer, x.mean, None if x.repr is D else bk.variance(x), in_hw))


def stored_tensors(params: dict[str, Any], calibration: float) -> dict[str, np.ndarray]:
    """What :func:`window_cov` reads: the conv's weight means, calibrated weight variances and bias variance."""
    weight = params["weight"]
    tensors = {"weight_mean": weight.mean, "weight_var": calibration * weight.var}
    bias = params.get("bias")
    if bias is not None and not bias.is_deterministic:
        tensors["bias_var"] = calibration * bias.var
    return tensors


# ------------------------------------------------------------------------------------ shared-factor rule
@shared_formula("window_cov")
def window_cov_shared(bk: SharedAlgebra, layer: PlannedLayer, inputs: list[Any], shared: list[Shared | None],
                      fp: FactorPlan, var: Any) -> tuple[Shared | None, Any]:
    """The in-window covariances of a conv whose input carries shared factors (``docs/math.md`` section 6,
    max pooling).  The input's covariance in the scheme is ``Cov(x_i, x_j) = s̃_i·s̃_j·⟨ĝ_i, ĝ_j⟩``
    for ``i ≠ j`` plus the residual ``r_i = v_i − s̃_i²`` on the diagonal (``s̃ = s·‖g_c‖``, ``ĝ`` the unit
    rows of ``g``), so the conv's taps ``P``, ``Q = P + d`` have, exactly under that covariance,

        Cov(a_P, a_Q) = Σ_k V_k·(μ_{P+k}·μ_{Q+k} + s̃_{P+k}·s̃_{Q+k})      (a shared weight)
                      + Σ_k W̄_k·W̄_{k−s·d}·r_{P+k}                        (a shared residual element)
                      + ⟨ℓ_P, ℓ_Q⟩ + Var(b),                              (the factors, through the mean weights)

    ``ℓ_P = Σ_{c,k} W̄[o, c, k]·s̃[c, P+k]·ĝ_c`` -- computed as ``u_Pᵀ·G·u_Q`` with ``u[b, c, o, P] =
    Σ_k W̄[o, c, k]·s̃[b, c, s·P + k]`` (each input channel's profile through the mean weights, not summed over
    the channels: a grouped convolution, one group per input channel) and ``G = g·gᵀ`` (per input).  The first
    two lines are the mean-field :func:`window_cov` with the profile's products beside the mean's and the
    residual in place of the variance: the part of the input's noise that the factors do not carry, so nothing
    is counted twice.  Returns ``(None, the covariances)``: the output is a deterministic tensor and carries no
    shared part."""
    x, sh = inputs[0], shared[0]
    if sh is None:
        return None, window_cov(bk, layer, inputs)
    ops = bk.ops
    wm = layer.tensors["weight_mean"]
    o, c, kh, kw = wm.shape
    conv = layer.layer.attrs["conv"]
    out_hw = tuple(layer.layer.attrs["conv_out_hw"])
    in_hw = tuple(bk.edge_shape(x, layer.inputs[0])[1:])
    norms = ops.sqrt(bk.rsum(sh.g * sh.g, 2))  # (B, C): 1 for a unit row, 0 for an empty one
    profile = bk.reshape(sh.s, (c, *in_hw)) * bk.reshape(norms, (c, 1, 1))
    resid = ops.maximum(bk.variance(x) - profile * profile, ops.const(0.0))
    grouped = np.swapaxes(wm, 0, 1).reshape(c * o, 1, kh, kw)
    u = bk.conv2d(profile, grouped, {"stride": conv["stride"], "padding": conv["padding"], "dilation": [1, 1],
                                     "groups": c}, "mean_weight_map")  # (B, C·O, H', W'), channel c·O + o
    u5 = bk.reshape(u, (c, o, *out_hw))
    gram = bk.einsum("bcf,bdf->bcd", sh.g, sh.g)
    mixed = bk.reshape(bk.einsum("bcd,bdohw->bcohw", gram, u5), (c * o, *out_hw))

    def factor_map(d: tuple[int, int]) -> Any:
        return bk.einsum("bcohw,bcohw->bohw", u5, bk.reshape(shifted(bk, mixed, out_hw, d), (c, o, *out_hw)))

    return None, bk.deterministic(_covariances(bk, layer, x.mean, resid, in_hw, profile, factor_map))


# ------------------------------------------------------------------------------------ pools not fed by a conv
WINDOW_CLOSURE = _covariance_op(
    "window_closure", "(inserted by the planner before a max pool of a shared-factor plan)",
    "the shared-factor scheme's covariance of two elements of a channel", "the scheme's rank-1-per-channel closure")

WINDOW_ACTIVATION = _covariance_op(
    "window_activation", "(inserted by the planner before a max pool that reads an activation)",
    "Mehler's expansion of the bivariate normal to second order", "jointly Gaussian pre-activations")


def _pool_taps(bk: Any, layer: PlannedLayer, t: Any, fill: float = 0.0) -> list[Any]:
    """The window taps (row-major) of a ``(B, C, H, W)`` tensor ``t`` at the pooled positions of ``layer``'s pool
    (padded by the pool's padding and overhang)."""
    pool, out_hw, in_hw = layer.layer.attrs["pool"], tuple(layer.layer.out_shape[2:]), layer.layer.attrs["in_hw"]
    ends = tuple(max(0, (o - 1) * s + k - n - p) for o, s, k, n, p in
                 zip(out_hw, pool["stride"], pool["kernel"], in_hw, pool["padding"]))
    return bk.taps(t, tuple(pool["kernel"]), tuple(pool["stride"]), (1, 1), tuple(pool["padding"]), ends, out_hw,
                   fill)


def _stacked(bk: Any, layer: PlannedLayer, pairs: list[Any]) -> Any:
    """``(B, C, OH, OW)`` pairs stacked to ``(B, C, P, OH, OW)``."""
    c, _, oh, ow = layer.layer.out_shape
    return bk.concat([bk.reshape(p, (c, 1, oh, ow)) for p in pairs], 1)


def closure_pairs(s_a: list[Any], s_b: list[Any] | None, dot: Any) -> list[Any]:
    """The shared factors' covariance of every pair ``(i, j)`` of a window: ``s_i·s_j·dot`` for one edge
    (``s_b`` None; ``dot = ‖g_c‖²``), ``(s_a,i·s_b,j + s_b,i·s_a,j)·dot`` between two (``dot = ⟨g_a,c, g_b,c⟩``);
    ``s_a``, ``s_b``: the profiles at the window's taps (0 outside the input)."""
    pairs = moments.window_pairs(len(s_a))
    if s_b is None:
        return [s_a[i] * s_a[j] * dot for i, j in pairs]
    return [(s_a[i] * s_b[j] + s_b[i] * s_a[j]) * dot for i, j in pairs]


@formula("window_closure")
def window_closure(bk: Any, layer: PlannedLayer, inputs: list[Any]) -> Any:
    """Without shared parts (a mean-field input): 0."""
    tap = bk.zeros_like(_pool_taps(bk, layer, inputs[0].mean)[0])
    return bk.deterministic(_stacked(bk, layer, [tap] * int(layer.layer.out_shape[1])))


@shared_formula("window_closure")
def window_closure_shared(bk: SharedAlgebra, layer: PlannedLayer, inputs: list[Any], shared: list[Shared | None],
                          fp: FactorPlan, var: Any) -> tuple[Shared | None, Any]:
    """The in-window covariances the shared factors give an edge that is not a conv output (or, with two
    inputs, the covariance between two summands of a residual add): the scheme's closure ``Cov(a[c, P],
    a[c, Q]) = s_P·s_Q·‖g_c‖²`` (one input) and ``Cov(a_P, b_Q) + Cov(b_P, a_Q) = (s_a,P·s_b,Q +
    s_b,P·s_a,Q)·⟨g_a,c, g_b,c⟩`` (two: the branches' covariance through their shared factors, which the
    add rule adds to the variance).  An input without a shared part contributes 0.  Returns ``(None, the
    covariances)``: the output is deterministic and carries no shared part."""
    present = [sh for sh in shared if sh is not None]
    if len(present) < len(shared):
        return None, window_closure(bk, layer, inputs)
    k = max(sh.k for sh in present)
    gs = [bk.widened(sh.g, sh.k, k) for sh in present]
    dot = bk.reshape(bk.rsum(gs[0] * gs[-1], 2), (layer.layer.out_shape[0], 1, 1))
    profiles = [_pool_taps(bk, layer, sh.s) for sh in present]
    pairs = closure_pairs(profiles[0], profiles[1] if len(profiles) == 2 else None, dot)
    return None, bk.deterministic(_stacked(bk, layer, pairs))


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


@formula("window_activation")
def window_activation(bk: Any, layer: PlannedLayer, inputs: list[Any]) -> Any:
    """The Hermite terms per element, their taps, Mehler's covariance per pair (:func:`mehler_covariance`)."""
    x, cov = inputs
    c, _, oh, ow = layer.layer.out_shape
    terms = [_pool_taps(bk, layer, t) for t in hermite_terms(layer, x.mean, bk.variance(x), bk.ops)]
    taps_ = list(zip(*terms))
    pairs = [mehler_covariance(taps_[i], taps_[j], bk.reshape(bk.slice(cov.mean, 2, k, k + 1), (c, oh, ow)), bk.ops)
             for k, (i, j) in enumerate(moments.window_pairs(len(taps_)))]
    return bk.deterministic(_stacked(bk, layer, pairs) * bk.tensor(closure_mask(layer)[None], "pair_mask"))


def closure_mask(layer: PlannedLayer) -> np.ndarray:
    """``(P, OH, OW)``: 1 where both taps of the pair lie inside the pool's input, else 0."""
    pool, out_hw = layer.layer.attrs["pool"], tuple(layer.layer.out_shape[2:])
    ones = padded(np.ones((1, 1, *layer.layer.attrs["in_hw"])), pool, out_hw, 0.0)
    inside = [v[0, 0] for v in window_views(ones, pool["kernel"], pool["stride"], out_hw)]
    return np.stack([inside[i] * inside[j] for i, j in moments.window_pairs(len(inside))])


@shared_formula("window_activation")
def window_activation_shared(bk: SharedAlgebra, layer: PlannedLayer, inputs: list[Any], shared: list[Shared | None],
                             fp: FactorPlan, var: Any) -> tuple[Shared | None, Any]:
    """The same as without shared factors (the input covariances carry them)."""
    return None, window_activation(bk, layer, inputs)
