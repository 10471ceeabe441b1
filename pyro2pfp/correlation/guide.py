"""A correlated guide's global factors in shared-factor PFP (float64): a factor source beside the
scheme's per-layer blocks.

A low-rank or full-covariance guide is ``w = mean + F·z + rest`` over all weights at once
(:mod:`pyro2pfp.frontend.posterior.correlated`): ``z ~ N(0, I_k)`` are global factors, the same in every
layer, and ``rest`` is independent per weight with variance ``d² = var − Σ_f F_f²``.  They are the
first ``k`` columns of every edge's ``g`` (:attr:`~pyro2pfp.correlation.factors.FactorPlan.guide`);
everything else of the scheme is unchanged: the rules that propagate the factors through
activations, pools, adds and reshapes are the scheme's own.  A compute layer adds, beside its
mean-field moments (computed with the marginal variance ``V = d² + Σ_f F_f²``):

* dense (``x`` the input, ``ℓ_in = s·g`` its loadings): ``ℓ[o, f] += Σ_i F_f[o, i]·μ_i + F_b,f[o]``
  (the weights' own part ``F·z`` through the input mean: exact), and the variance
  ``v += ‖ℓ‖² − Σ_i W²·s² − Σ_i (Σ_f F_f²)[o, i]·(μ_i² + s_i²·|g_i|²_guide) − Σ_f F_b,f²``: the
  coherent loading in place of the mean-field terms that counted the same noise as independent
  (``(Σ_f F_f²)·μ²``: the guide part of ``V·μ²``; ``·s²``: the product of the weights' and the
  input's guide noise counted as independent per weight), plus that product's own variance: it is the
  quadratic form ``zᵀA_o z`` with ``A_o = Σ_i F[o, i]ᵀ·ℓ_in[i]`` (guide × guide; row ``f`` the weights'
  loading on ``z_f``, column ``h`` the input's on ``z_h``), whose mean is ``tr A_o`` (the mean shift,
  :func:`mean_shift`) and whose variance is ``2‖(A_o + A_oᵀ)/2‖²_F`` (Isserlis' theorem; it is
  uncorrelated with the terms linear in ``z``, odd moments of ``z`` vanishing) -- the closure does not
  carry it as a factor, it joins the independent variance (:func:`dense_terms`).  Counting it
  per weight instead (``Σ_i |F[o, i]|²·|ℓ_in[i]|²``) misses that every weight's noise meets its input's
  through the same factors: the logits of a trained full-covariance MLP lose half their variance;
* conv2d: the pooled loading ``ℓ[o, f] += Σ_{c,k} F_f[o, c, k]·m̄μ_k[c] + F_b,f[o]`` and the profile
  ``s[o, p] += Σ_{c,k} G[o, c, k]·μ[c, p + k] + Σ_f g[o, f]·F_b,f[o]`` with ``G = Σ_f g[o, f]·F_f[o]``
  (the exact covariance of ``out[o, p]`` with the channel's normal ``η_o`` from the guide's part);
  the per-position variance: the mean-field rule counted the guide's noise inside one receptive field as
  independent per weight; :func:`conv_variance` re-sums it with its correlations, exactly (below).

The conv's per-position variance (:func:`conv_variance`).  At an output ``(o, p)`` the receptive field's
elements ``i = (c, κ)`` (channel, kernel tap; input position ``p + κ``) have weights ``w_i = W_i + F_i·z + e_i``
and inputs ``x_i = μ_i + L_i·z + u_i`` with ``L_i = s_in[c, p + κ]·g_in[c, :guide]`` (the closure), ``e_i``,
``u_i`` independent of ``z`` and across ``i``.  Then ``out − E[out]`` is the sum of

* the terms linear in ``z``: ``λ_p·z`` with ``λ_p[f] = Σ_i (W_i·L_i[f] + μ_i·F_i[f]) + F_b,f[o]``, variance
  ``|λ_p|²``; mean-field counted ``Σ_i (W_i²·|L_i|² + μ_i²·|F_i|²) + |F_b|²``;
* the product of the weights' and the input's guide noise, the quadratic form ``zᵀA_p z − tr A_p`` with
  ``A_p[f, h] = Σ_i F_i[f]·L_i[h]`` (guide × guide): variance ``2‖(A_p + A_pᵀ)/2‖²_F`` (Isserlis' theorem:
  ``E[z_a z_b z_c z_d] = δ_ab δ_cd + δ_ac δ_bd + δ_ad δ_bc``); mean-field counted ``Σ_i |F_i|²·|L_i|²``;
* terms in ``e``, ``u`` (mean-field's own, unchanged).

Odd moments of ``z`` vanish, so the linear terms, the quadratic form and the rest are uncorrelated, and
``v_p += |λ_p|² + 2‖sym A_p‖² − Σ_i ((W_i² + |F_i|²)·|L_i|² + μ_i²·|F_i|²) − |F_b|²`` is the exact variance
given the closure -- the dense rule's correction (above) at every position.  On a trained low-rank CNN the
linear terms' coherence inside a receptive field is most of it, the product's share is small
(``benchmarks/correlated_guides.py``).

Each term is one formula over a back end ``bk`` for the float64 reference and the ONNX export
(:mod:`.shared_algebra`), called by the dense and conv2d rules (``ops/compute.py``) and, for the mean shift, by
both back ends' layer steps; the compiled kernels: ``backends/tvm/ops/compute_shared.py`` (dense) and
``backends/tvm/guide_factor.py`` (conv2d).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..planning.plan import PlannedLayer
from ..planning.registry import OPS
from .factors import FactorPlan
from .shared import Shared
from .shared_algebra import batch_zeros, conv_taps, mix, total


def guide_tensors(t: dict[str, np.ndarray], out_channels: int, fp: FactorPlan
                  ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The layer's ``(weight_factors, bias_factors)`` (None where absent), or ``(None, None)`` when the plan
    carries no guide factors."""
    if not fp.guide:
        return None, None
    return t.get("weight_factors"), t.get("bias_factors")


def guide_columns(bk: Any, g: Any, guide: int) -> Any:
    """``g[..., :guide]``: the guide's columns of a loading matrix (B, R, K)."""
    return bk.slice(g, 2, 0, guide)


def dense_terms(bk: Any, mu: Any, sh: Shared | None, rows: int, wf: np.ndarray | None, bf: np.ndarray | None,
                k: int) -> tuple[Any, Any]:
    """``(injection (B, O, K), counted (B, O))`` of a dense layer with input mean ``mu`` (B, n): the guide's
    loading ``Σ_i F_f[o, i]·μ_i + F_b,f[o]`` (its columns first, zeros up to ``K``) and what the mean-field
    variance counted of the guide's noise as independent (to subtract, module docstring): ``Σ_i (Σ_f F_f²)[o, i]·
    (μ_i² + s_i²·|g_i[:guide]|²) + Σ_f F_b,f²``, less the variance of the product of the weights' and the input's
    guide noise (:func:`product_variance`)."""
    guide = (wf if wf is not None else bf).shape[-1]  # type: ignore[union-attr]
    inj: Any = None
    counted: Any = None
    if wf is not None:
        n = wf.shape[1]
        inj = bk.einsum("bi,oif->bof", mu, bk.tensor(wf, "guide_w"))
        second = mu * mu
        if sh is not None:
            gg = guide_columns(bk, sh.g, guide)  # (B, rows, guide)
            share = bk.reshape(bk.rsum(gg * gg, 2), (rows, 1))
            s = bk.reshape(sh.s, (rows, n // rows))
            second = second + bk.reshape(s * s * share, (n,))
        counted = bk.dense(second, (wf**2).sum(-1), "guide_w2")
        if sh is not None:  # less the variance of the product of the weights' and the input's guide noise
            counted = counted - product_variance(bk, s, gg, wf, rows)
    if bf is not None:
        bias = bk.tensor(bf, "guide_b")
        inj = bias + batch_zeros(bk, mu, 2) if inj is None else inj + bias
        bias_sq = bk.tensor((bf**2).sum(-1), "guide_b2")
        counted = bias_sq + batch_zeros(bk, mu, 1) if counted is None else counted + bias_sq
    return bk.widened(inj, guide, k), counted


def product_variance(bk: Any, s: Any, gg: Any, wf: np.ndarray, rows: int) -> Any:
    """``Var(zᵀA_o z) = 2‖(A_o + A_oᵀ)/2‖²_F = Σ_{f,h} A[f, h]·(A[f, h] + A[h, f])`` (B, O) with ``A_o[f, h] =
    Σ_i F_f[o, i]·ℓ_in[i, h]`` (guide × guide): the variance of the product of the weights' and the input's guide
    noise (Isserlis' theorem, module docstring); ``s`` (B, rows, n/rows) the input's profile, ``gg`` (B, rows,
    guide) its loadings' guide columns."""
    o, n, guide = wf.shape
    a = bk.einsum("brq,brh,orqf->bofh", s, gg, bk.tensor(wf.reshape(o, rows, n // rows, guide), "guide_w"))
    return bk.einsum("bofh,bofh->bo", a, a) + bk.einsum("bofh,bohf->bo", a, a)


def conv_injection(bk: Any, mbar: list[Any], wf: np.ndarray | None, bf: np.ndarray | None, k: int) -> Any:
    """The pooled guide loading ``Σ_{c,k} F_f[o, c, k]·m̄μ_k[c] + F_b,f[o]`` (B, O, K) from the pooled views
    ``mbar`` (one (B, C) per kernel tap, row-major)."""
    guide = (wf if wf is not None else bf).shape[-1]  # type: ignore[union-attr]
    terms = []
    if wf is not None:
        o, c = wf.shape[:2]
        taps = wf.reshape(o, c, -1, guide)
        terms += [bk.einsum("bc,ocf->bof", m, bk.tensor(taps[:, :, n], "guide_w")) for n, m in enumerate(mbar)]
    if bf is not None:
        terms.append(bk.tensor(bf, "guide_b") + batch_zeros(bk, mbar[0], 2))
    return bk.widened(total(terms), guide, k)


def conv_profile_terms(bk: Any, g: Any, mu_taps: list[Any], wf: np.ndarray | None, bf: np.ndarray | None,
                       shape: tuple[int, int, int, int]) -> list[Any]:
    """The guide's part of a conv's profile ``Cov(out[o, p], η_o)``: ``Σ_{c,k} (Σ_f g[o, f]·F_f[o, c, k])·
    μ[c, p + k] + Σ_f g[o, f]·F_b,f[o]`` as terms (B, O, OH, OW) (or (B, O, 1, 1)) to sum; ``shape`` =
    (O, C, OH, OW)."""
    guide = (wf if wf is not None else bf).shape[-1]  # type: ignore[union-attr]
    gg = guide_columns(bk, g, guide)  # (B, O, guide)
    o = shape[0]
    terms = []
    if wf is not None:
        taps = wf.reshape(o, wf.shape[1], -1, guide)
        for n, tp in enumerate(mu_taps):
            terms.append(mix(bk, bk.einsum("bof,ocf->boc", gg, bk.tensor(taps[:, :, n], "guide_w")), tp, shape))
    if bf is not None:
        terms.append(bk.reshape(bk.einsum("bof,of->bo", gg, bk.tensor(bf, "guide_b")), (o, 1, 1)))
    return terms


def mean_shift(bk: Any, layer: PlannedLayer, sh: Shared | None, fp: FactorPlan) -> Any:
    """The mean of the product of a compute layer's guide noise with its input's (``E[(F·z)ᵀ(x − μ)]``,
    the input's loadings on the guide columns ``ℓ_in = s·g[:guide]``): dense ``Σ_i Σ_f F_f[o, i]·ℓ_in[i, f]``;
    conv2d ``Σ_{c,k} G[o, c, k]·s[c, p + k]`` with ``G = Σ_f F_f[o, c, k]·g_in[c, f]`` (the closure).
    None where there is none (no guide factors, or an input without a shared part)."""
    wf = layer.tensors.get("weight_factors") if fp.guide else None
    if wf is None or sh is None:
        return None
    guide = wf.shape[-1]
    gg = guide_columns(bk, sh.g, guide)
    o, n = wf.shape[:2]
    if not OPS[layer.op].positions_share_weights:  # a dense layer
        rows = fp.rows[layer.inputs[0]]
        s = bk.reshape(sh.s, (rows, n // rows))
        return bk.einsum("brq,brf,orqf->bo", s, gg, bk.tensor(wf.reshape(o, rows, n // rows, guide), "guide_w"))
    kh, kw = wf.shape[2:4]
    taps = wf.reshape(o, n, kh * kw, guide)
    shape = (o, n, *layer.layer.out_shape[1:])
    return total([mix(bk, bk.einsum("bcf,ocf->boc", gg, bk.tensor(taps[:, :, kk], "guide_w")), tp, shape)
                  for kk, tp in enumerate(conv_taps(bk, sh.s, layer, (kh, kw)))])


def conv_variance(bk: Any, layer: PlannedLayer, x_mean: Any, taps: tuple[list[Any], list[Any]], sh: Shared | None,
                  wm: np.ndarray, wf: np.ndarray | None, bf: np.ndarray | None) -> Any:
    """What a conv's per-position variance gains from a correlated guide (B, O, OH, OW), module docstring:
    ``|λ_p|² + 2‖sym A_p‖² − Σ_i ((W_i² + |F_i|²)·|L_i|² + μ_i²·|F_i|²) − |F_b|²`` (Isserlis' theorem for the
    quadratic form).  ``taps``: the kernel taps (B, C, OH, OW) of the input mean and profile (row-major; no
    profile taps without a shared input); ``wm`` the weight mean (O, C, KH, KW)."""
    mu_taps, s_taps = taps
    o, c, kh, kw = wm.shape
    guide = (wf if wf is not None else bf).shape[-1]  # type: ignore[union-attr]
    oh, ow = layer.layer.out_shape[1:]
    attrs = layer.layer.attrs
    lam: list[Any] = []
    counted: list[Any] = []
    if wf is not None:
        taps_f = wf.reshape(o, c, kh * kw, guide)
        lam += [bk.einsum("ocf,bcyx->bofyx", bk.tensor(taps_f[:, :, n], "guide_w"), tp) for n, tp in enumerate(mu_taps)]
        counted.append(bk.conv2d(x_mean * x_mean, (wf**2).sum(-1), attrs, "guide_w2"))
    product = None
    if sh is not None:
        gg = guide_columns(bk, sh.g, guide)  # (B, C, guide)
        # per channel first (the taps' sums of W·s_in and F_f·s_in), then over the channels with g_in: L = s_in·g_in
        w_taps = wm.reshape(o, c, kh * kw)
        per_w = total([bk.einsum("oc,bcyx->bocyx", bk.tensor(w_taps[:, :, n], "w"), tp)
                       for n, tp in enumerate(s_taps)])
        lam.append(bk.einsum("bocyx,bch->bohyx", per_w, gg))
        share = bk.reshape(bk.rsum(gg * gg, 2), (c, 1, 1))
        counted.append(bk.conv2d(sh.s * sh.s * share, (wf**2).sum(-1) + wm**2 if wf is not None else wm**2, attrs,
                                 "guide_wm2"))
        if wf is not None:
            per_f = total([bk.einsum("ocf,bcyx->bocfyx", bk.tensor(taps_f[:, :, n], "guide_w"), tp)
                           for n, tp in enumerate(s_taps)])
            a = bk.einsum("bocfyx,bch->bofhyx", per_f, gg)
            product = bk.einsum("bofhyx,bofhyx->boyx", a, a) + bk.einsum("bofhyx,bohfyx->boyx", a, a)
    if bf is not None:
        bias = bk.tensor(bf.reshape(o, guide, 1, 1), "guide_b")
        lam.append(bias if lam else bias + batch_zeros(bk, bk.reshape(mu_taps[0], (c * oh * ow,)), 4))
        counted.append(bk.tensor((bf**2).sum(-1).reshape(o, 1, 1), "guide_b2"))
    lam_t = total(lam)
    gain = bk.rsum(lam_t * lam_t, 2) - total(counted)
    return gain if product is None else gain + product
