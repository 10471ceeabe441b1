"""Shared-factor PFP, the NumPy rules (float64): mean-field moments plus, per channel, the part of
the noise that is shared by all positions and, across channels, by the same upstream weight noise.

Why
---
Mean-field PFP (``docs/math.md``) keeps per element ``(μ, v)`` and treats all elements as
independent.  Its per-position variances match sampling even in a ResNet-20 (``pyro2pfp.diagnose``:
every layer's median PFP/MC variance ratio 0.95–1.08), but a conv weight is shared by all
positions and every channel mixes all upstream channels, so *sums* over positions (global average
pooling, flatten → dense) lose most of the variance (ResNet-20 logit variance ratio 0.17).  The
scheme keeps the mean-field ``(μ, v)`` and carries beside them the covariance of every activation
with a few normals per channel, used where positions and channels are summed.  Prediction stays a
single forward pass without sampling; nothing is fitted to Monte Carlo.

Representation (per edge, per input ``b``; ``C`` channels, ``P`` positions)
-------------------------------------------------------------------------------
* ``μ, v`` (B, C, P): the mean-field plan's moments, unchanged except at average pooling (pooled
  variance), dense layers (output variance) and residual adds (branch covariance).
* factors ``ζ_1 … ζ_K``: independent standard normals.  The planner
  (:func:`~pyro2pfp.correlation.factors.plan_factors`) gives every layer that creates shared noise a
  block of columns: one factor per output channel of every Bayesian conv2d/dense (its weight and bias
  noise), one per channel of every ReLU (its second Hermite term, ``hermite='factor'``).
* ``g`` (B, C, K), unit rows: the channel's normal ``η_c = Σ_f g[c, f]·ζ_f``.
* ``s`` (B, C, P), signed: ``s[c, p] = Cov(a[c, p], η_c)``, the regression profile of the channel on
  its normal.  The one approximation every rule shares is the rank-1-per-channel closure
  ``Cov(a[c, p], ζ_f) ≈ s[c, p]·g[c, f]`` (what is carried of an activation's covariance with the
  factors is its component along its channel's normal), so ``Cov(a[c, p], a[c', q]) ≈
  s[c, p]·s[c', q]·⟨g[c], g[c']⟩`` for ``(c, p) ≠ (c', q)``; the rest of ``v`` (``v − s²``) is
  independent across elements, as in mean-field.  Mean-field is the special case ``s ≡ 0``.
* A flattened edge keeps ``g`` per channel and ``s`` flat (``group = P`` elements per channel).

Rules (``m̄``: mean over the output positions; ``W, V``: weight mean and variance; ``⊕ x·e_o``: x
in the layer's own factor column; Φ, φ the normal CDF/PDF; ``(μ, v)`` are mean-field unless said)
----------------------------------------------------------------------------------------------------------
* conv2d (stride/padding/dilation, groups 1).  Pooled loading ``ℓ[o] = Σ_c A[o, c]·g_in[c] ⊕
  w̄[o]·e_o`` with ``A[o, c] = Σ_k W[o, c, k]·m̄ s_in[c, p+k]`` (the input's shared parts through
  the mean weights, exact given the closure) and ``w̄² = Σ_{c,k} V[o, c, k]·((m̄ μ_in[c, p+k])² +
  (m̄ s_in[c, p+k])²) + v_bias`` (the variance of the spatial mean of the weight and bias noise:
  the weight-variance term evaluated on the pooled input, exact for a deterministic input; the
  input's pooled variance taken as its shared part).  ``g = ℓ/‖ℓ‖``; profile ``s[o, p] =
  Σ_{c,k} W[o, c, k]·⟨g_in[c], g[o]⟩·s_in[c, p+k] + (g[o, e_o]/w̄)·(Σ_{c,k} V[o, c, k]·(m̄μ_k·μ_in[c, p+k]
  + m̄s_k·s_in[c, p+k]) + v_bias)`` — the exact covariance of ``out[o, p]`` with ``η'_o`` given the
  closure (``injection='regression'``).  ``injection='rescaled'`` replaces the second sum by the
  mean-field weight-variance term's square root rescaled to the same spatial mean (no extra
  convolution; measured ResNet-20 median 0.92 instead of 0.97).  ``m̄ s = ‖ℓ‖`` by construction.
* dense: ``ℓ[o] = Σ_c (Σ_p W[o, (c, p)]·s[c, p])·g[c] ⊕ √(Σ V·E[x²] + v_bias)·e_o``,
  ``v_out = v_mf + ‖Σ_c (…)·g[c]‖² − Σ_i W[o, i]²·s_i²`` (the shared parts summed with their
  correlations instead of as independent); ``s = ‖ℓ‖``, ``g = ℓ/‖ℓ‖`` (each unit its own channel).
* affine (BatchNorm eval, scale ``a``): ``s ↦ a·s``; ``g`` unchanged.
* relu / leaky_relu (slope ``λ``), ``α = μ/σ``: Stein's lemma, exact for a Gaussian pre-activation
  jointly Gaussian with the factors: ``lin = Cov(f(a_p), η) = (Φ(α) + λ(1 − Φ(α)))·s_p``.  Second
  Hermite (Mehler) term: ``h = Cov(f(a_p), (η² − 1)/√2) = (1 − λ)·φ(α)/σ·s_p²/√2``, exact for a
  Gaussian ``a``; ``(η² − 1)/√2`` is uncorrelated with every ``ζ``, so it is a new factor of the
  channel (its correlation ``ρ²`` with other channels' Hermite terms is dropped; measured negligible,
  ``|ρ| ≈ 0.07``).  ``ℓ = m̄(lin)·g ⊕ m̄(h)·e_c``, ``s = (m̄(lin)·lin + m̄(h)·h)/‖ℓ‖``.
  ``hermite='none'`` keeps ``lin`` only (measured ResNet-20 median 0.89 instead of 0.97).
* any other elementwise activation with an :class:`~pyro2pfp.registry.ActivationRule` (the
  generic rule, :func:`shared_activation`): Stein's lemma ``lin = E[f'(a)]·s`` with ``E[f'(a)] =
  ∂E[f(a)]/∂μ`` (differentiate ``E[f(μ + σz)]`` under the integral), the exact derivative of the
  rule's own mean moment by forward-mode AD (:mod:`pyro2pfp.correlation.stein`; exact for a
  Gaussian ``a`` up to the mean rule's own accuracy, in float32 too); no second-Hermite factor
  (``s`` keeps the linear response only).
* add (residual): ``ℓ = m̄ s_a·g_a + m̄ s_b·g_b`` — branches that share upstream factors (both
  functions of the block input) add coherently; ``g = ℓ/‖ℓ‖``, ``s = s_a·⟨g_a, g⟩ + s_b·⟨g_b, g⟩``;
  ``v = v_a + v_b + 2·s_a·s_b·⟨g_a, g_b⟩`` (the branch covariance; exact in a linear Gaussian net).
* avg_pool2d / global average pool (divisor ``n``): ``s ↦`` window mean of ``s`` (exact);
  ``v = Σ(v − s²)/n² + s_out²`` (the shared part summed coherently, the remainder as independent:
  an approximation — directly after a conv with a deterministic input the remainder sums to zero and
  this over-states the pooled variance; after ReLUs it stands in for what the closure misses;
  measured better than dropping it).
* max_pool2d: Clark's fold for ``(μ, v)``; ``s`` by the linear response of the pairwise maximum,
  ``Cov(max(A, B), η) = Φ(α)·Cov(A, η) + Φ(−α)·Cov(B, η)`` (exact for jointly Gaussian ``A, B, η``;
  ``α`` from the mean-field ``θ = √(v_A + v_B)``, i.e. ignoring ``Cov(A, B)``).
* reshape/flatten: ``s`` reshaped, ``g`` kept per channel (reshapes must keep or flatten the
  channel axis); convert: identity.
* compaction: where a layer's output is the only live edge (every ResNet block boundary) and
  ``K ≥ 4·C``, ``g`` (C × K) becomes ``Rᵀ`` from ``gᵀ = Q·R`` (C × C).  Exact (only ``g·gᵀ``
  matters from there on; later factors are new).  Bounds K by ~5·C instead of growing with depth.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import ndtr

from .. import moments
from ..graph import Repr
from ..plan import PlannedLayer
from ..reference import Activation
from ..reference.arrays import LOWEST, average_divisor, conv2d_nchw, padded, window_views
from .factors import FactorPlan, weight_var
from .stein import stein_slope

_SQRT2PI = float(np.sqrt(2.0 * np.pi))


@dataclass
class Shared:
    """The shared part of one edge: ``s`` (B, C, *spatial) or flat (B, C·group), ``g`` (B, C, K)."""

    s: np.ndarray
    g: np.ndarray

    def widened(self, k: int) -> np.ndarray:
        """``g`` with zero columns appended up to ``k``."""
        extra = k - self.g.shape[2]
        return self.g if extra <= 0 else np.concatenate([self.g, np.zeros((*self.g.shape[:2], extra))], axis=2)


def _safe_div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)


def _spatial_mean(t: np.ndarray) -> np.ndarray:
    return t.reshape(t.shape[0], t.shape[1], -1).mean(axis=2)


def _expand(t: np.ndarray, ndim: int) -> np.ndarray:
    return t.reshape(t.shape + (1,) * (ndim - t.ndim))


def _normalised(loading: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    norm = np.sqrt((loading**2).sum(axis=2))
    return norm, loading / np.where(norm > 0, norm, 1.0)[..., None]


def _conv_views(t: np.ndarray, layer: PlannedLayer, kernel: tuple[int, int]) -> Iterator[np.ndarray]:
    """The strided input view of every kernel offset (row-major), each (B, C, OH, OW)."""
    a = layer.layer.attrs
    stride, pad, dil = a["stride"], a["padding"], a["dilation"]
    oh, ow = layer.layer.out_shape[1:]
    tp = np.pad(t, ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))
    for p in range(kernel[0]):
        for q in range(kernel[1]):
            r0, c0 = p * dil[0], q * dil[1]
            yield tp[:, :, r0:r0 + stride[0] * (oh - 1) + 1:stride[0], c0:c0 + stride[1] * (ow - 1) + 1:stride[1]]


def shared_conv2d(layer: PlannedLayer, x: Activation, sh: Shared | None, fp: FactorPlan) -> Shared | None:
    """conv2d rule (module docstring; ``fp.injection`` picks the weight-noise profile); ``x`` the
    input's mean-field activation, ``sh`` its shared part (None: none)."""
    t, a = layer.tensors, layer.layer.attrs
    injection = fp.injection
    wm, wv = t["weight_mean"], weight_var(t)
    o, c, kh, kw = wm.shape
    k = fp.width[layer.name]
    offset = fp.offsets.get(layer.name)
    mu = x.mean
    b = mu.shape[0]
    if sh is None and offset is None:
        return None
    s_in = np.zeros_like(mu) if sh is None else sh.s.reshape(mu.shape)
    mbar = np.stack([_spatial_mean(v) for v in _conv_views(mu, layer, (kh, kw))], axis=2)  # (B, C, k)
    sbar = np.stack([_spatial_mean(v) for v in _conv_views(s_in, layer, (kh, kw))], axis=2)
    loading = np.zeros((b, o, k))
    if sh is not None:
        amap = np.einsum("ock,bck->boc", wm.reshape(o, c, -1), sbar)
        loading += amap @ sh.widened(k)
    if offset is not None:
        pooled_w = np.einsum("ock,bck->bo", wv.reshape(o, c, -1), mbar**2 + sbar**2)
        if "bias_var" in t:
            pooled_w = pooled_w + t["bias_var"][None]
        wbar = np.sqrt(np.maximum(pooled_w, 0.0))
        loading[:, np.arange(o), offset + np.arange(o)] += wbar
    norm, g = _normalised(loading)
    if not norm.any():
        return None
    s_out = np.zeros((b, o, *layer.layer.out_shape[1:]))
    if sh is not None:
        beta = np.einsum("bcf,bof->boc", sh.widened(k), g)  # ⟨g_in[c], g[o]⟩
        for kk, view in enumerate(_conv_views(s_in, layer, (kh, kw))):
            i, j = divmod(kk, kw)
            s_out += np.einsum("bchw,boc->bohw", view, wm[None, :, :, i, j] * beta)
    if offset is not None and injection == "rescaled":
        ex2 = x.second_moment() if x.repr is not Repr.DETERMINISTIC else mu**2
        prof = conv2d_nchw(ex2, wv, a["stride"], a["padding"], a["dilation"], 1)
        if "bias_var" in t:
            prof = prof + t["bias_var"].reshape(1, -1, 1, 1)
        root = np.sqrt(np.maximum(prof, 0.0))
        scale = g[:, np.arange(o), offset + np.arange(o)] * _safe_div(wbar, _spatial_mean(root))
        s_out += scale[..., None, None] * root
    elif offset is not None:
        # Cov(noise[o, p], pooled noise[o]) = Σ_{c,k} V·(m̄μ_k·μ_{p+k} + m̄s_k·s_{p+k}) + v_bias
        reg = np.zeros_like(s_out)
        for kk, (vm, vs) in enumerate(zip(_conv_views(mu, layer, (kh, kw)), _conv_views(s_in, layer, (kh, kw)))):
            i, j = divmod(kk, kw)
            reg += np.einsum("bchw,boc->bohw", vm, wv[None, :, :, i, j] * mbar[:, None, :, kk])
            reg += np.einsum("bchw,boc->bohw", vs, wv[None, :, :, i, j] * sbar[:, None, :, kk])
        if "bias_var" in t:
            reg += t["bias_var"].reshape(1, -1, 1, 1)
        s_out += _safe_div(g[:, np.arange(o), offset + np.arange(o)], wbar)[..., None, None] * reg
    return Shared(s_out, g)


def shared_dense(layer: PlannedLayer, x: Activation, sh: Shared | None, fp: FactorPlan, var: np.ndarray
                 ) -> tuple[Shared | None, np.ndarray]:
    """dense rule: ``(shared part of the output, corrected output variance)``."""
    t = layer.tensors
    wm, wv = t["weight_mean"], weight_var(t)
    b, o = x.mean.shape[0], wm.shape[0]
    k = fp.width[layer.name]
    offset = fp.offsets.get(layer.name)
    loading = np.zeros((b, o, k))
    if sh is not None:
        s = sh.s.reshape(b, -1)
        rows = sh.g.shape[1]
        coef = np.einsum("ocp,bcp->boc", wm.reshape(o, rows, -1), s.reshape(b, rows, -1))
        loading += coef @ sh.widened(k)
        var = np.maximum(var + (loading**2).sum(axis=2) - s**2 @ (wm**2).T, 0.0)
    if offset is not None:
        ex2 = x.second_moment() if x.repr is not Repr.DETERMINISTIC else x.mean**2
        inj = ex2.reshape(b, -1) @ wv.T + (t["bias_var"][None] if "bias_var" in t else 0.0)
        loading[:, np.arange(o), offset + np.arange(o)] += np.sqrt(np.maximum(inj, 0.0))
    norm, g = _normalised(loading)
    if not norm.any():
        return None, var
    return Shared(norm, g), var


def shared_affine(layer: PlannedLayer, sh: Shared) -> Shared:
    """affine rule: ``s ↦ a·s`` (per channel)."""
    scale = layer.tensors["scale"]
    shape = sh.s.shape
    rows = sh.g.shape[1]
    s = sh.s.reshape(shape[0], rows, -1) * scale.reshape(1, rows, 1)
    return Shared(s.reshape(shape), sh.g)


def shared_relu(layer: PlannedLayer, x: Activation, sh: Shared, fp: FactorPlan) -> Shared:
    """relu/leaky_relu rule: Stein's linear response plus (``hermite='factor'``) the second
    Hermite term as a new factor of the channel."""
    slope = float(layer.layer.attrs["slope"]) if layer.op == "leaky_relu" else 0.0
    var = x.variance()
    sd = np.sqrt(var)
    safe = np.where(sd > 0, sd, 1.0)
    alpha = np.clip(np.where(sd > 0, x.mean / safe, 0.0), -40.0, 40.0)
    cdf = np.where(sd > 0, ndtr(alpha), (x.mean > 0).astype(np.float64))
    s_in = sh.s.reshape(x.mean.shape)
    lin = (cdf + slope * (1.0 - cdf)) * s_in
    offset = fp.offsets.get(layer.name)
    if offset is None:
        return Shared(lin.reshape(sh.s.shape), sh.g)
    k = fp.width[layer.name]
    h = np.where(sd > 0, (1.0 - slope) * np.exp(-0.5 * alpha**2) / _SQRT2PI / safe, 0.0) * s_in**2 / np.sqrt(2.0)
    rows = sh.g.shape[1]
    lin3, h3 = lin.reshape(lin.shape[0], rows, -1), h.reshape(h.shape[0], rows, -1)
    lbar, hbar = lin3.mean(axis=2), h3.mean(axis=2)
    loading = lbar[..., None] * sh.widened(k)
    loading[:, np.arange(rows), offset + np.arange(rows)] += hbar
    norm, g = _normalised(loading)
    s = _safe_div(lbar, norm)[..., None] * lin3 + _safe_div(hbar, norm)[..., None] * h3
    return Shared(s.reshape(sh.s.shape), g)


def shared_add(sa: Shared | None, sb: Shared | None, shape: tuple[int, ...], k: int
               ) -> tuple[Shared | None, np.ndarray | float]:
    """add rule: ``(the two branches' shared parts added with their common factors, the per-position
    covariance of the branches 2·s_a·s_b·⟨g_a, g_b⟩ to add to v_a + v_b)``."""
    if sa is None or sb is None:
        return (sa if sb is None else sb), 0.0
    a_s, b_s = sa.s.reshape(shape), sb.s.reshape(shape)
    ga, gb = sa.widened(k), sb.widened(k)
    cross = 2.0 * a_s * b_s * _expand((ga * gb).sum(axis=2), len(shape))
    loading = _spatial_mean(a_s)[..., None] * ga + _spatial_mean(b_s)[..., None] * gb
    norm, g = _normalised(loading)
    s = a_s * _expand((ga * g).sum(axis=2), len(shape)) + b_s * _expand((gb * g).sum(axis=2), len(shape))
    return Shared(s, g), cross


def shared_pool(layer: PlannedLayer, x: Activation, sh: Shared, var: np.ndarray) -> tuple[Shared, np.ndarray]:
    """avg_pool2d / max_pool2d rules: ``(shared part, output variance)``."""
    a = dict(layer.layer.attrs)
    out_hw = layer.layer.out_shape[1:]
    s_in = sh.s.reshape(x.mean.shape)
    if layer.op == "avg_pool2d":
        a.setdefault("divisor", None)
        a.setdefault("count_include_pad", False)
        div = average_divisor(a, x.mean.shape[2:], out_hw)
        s = sum(window_views(padded(s_in, a, out_hw, 0.0), a["kernel"], a["stride"], out_hw)) / div
        indep = np.maximum(x.variance() - s_in**2, 0.0)
        var = sum(window_views(padded(indep, a, out_hw, 0.0), a["kernel"], a["stride"], out_hw)) / div**2 + s**2
        return Shared(s, sh.g), var
    ms = window_views(padded(x.mean, a, out_hw, LOWEST), a["kernel"], a["stride"], out_hw)
    vs = window_views(padded(x.variance(), a, out_hw, 0.0), a["kernel"], a["stride"], out_hw)
    ss = window_views(padded(s_in, a, out_hw, 0.0), a["kernel"], a["stride"], out_hw)
    mean, v, s = next(ms), next(vs), next(ss)
    for m2, v2, s2 in zip(ms, vs, ss):
        theta = np.sqrt(v + v2)
        cdf = np.where(theta > 0, ndtr(np.clip((mean - m2) / np.where(theta > 0, theta, 1.0), -40, 40)),
                       (mean >= m2).astype(np.float64))
        s = cdf * s + (1.0 - cdf) * s2
        mean, v = moments.max_moments(mean, v, m2, v2)
    return Shared(s, sh.g), var


def shared_activation(layer: PlannedLayer, x: Activation, sh: Shared, rule: Any) -> Shared:
    """The generic activation rule (module docstring): Stein's linear response ``E[f'(a)]·s`` with
    ``E[f'(a)] = ∂E[f(a)]/∂μ`` the exact derivative of ``rule.moments``' mean
    (:func:`~pyro2pfp.correlation.stein.stein_slope`, forward-mode AD)."""
    mu = x.mean
    slope = np.broadcast_to(stein_slope(rule, mu, x.variance(), layer.layer.attrs, moments.NUMPY), mu.shape)
    return Shared((slope * sh.s.reshape(mu.shape)).reshape(sh.s.shape), sh.g)


def compacted(sh: Shared) -> Shared:
    """``g`` (B, C, K) → ``Rᵀ`` (B, C, C) with ``gᵀ = Q·R``: same ``g·gᵀ`` (exact)."""
    _, r = np.linalg.qr(np.swapaxes(sh.g, 1, 2))
    return Shared(sh.s, np.swapaxes(r, 1, 2))


