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
  :func:`dense_mean_shift`) and whose variance is ``2‖(A_o + A_oᵀ)/2‖²_F`` (Isserlis' theorem; it is
  uncorrelated with the terms linear in ``z``, odd moments of ``z`` vanishing) -- the closure does not
  carry it as a factor, it joins the independent variance (:func:`dense_product_variance`).  Counting it
  per weight instead (``Σ_i |F[o, i]|²·|ℓ_in[i]|²``) misses that every weight's noise meets its input's
  through the same factors: the logits of a trained full-covariance MLP lose half their variance;
* conv2d: the pooled loading ``ℓ[o, f] += Σ_{c,k} F_f[o, c, k]·m̄μ_k[c] + F_b,f[o]`` and the profile
  ``s[o, p] += Σ_{c,k} G[o, c, k]·μ[c, p + k] + Σ_f g[o, f]·F_b,f[o]`` with ``G = Σ_f g[o, f]·F_f[o]``
  (the exact covariance of ``out[o, p]`` with the channel's normal ``η_o`` from the guide's part);
  the per-position variance keeps the mean-field ``(Σ_f F_f²)·μ²`` (the guide's correlations inside
  one receptive field are not re-summed: that would take ``k`` convolutions).

The same terms in the float32 back ends: :mod:`.guide_onnx` (ONNX export) and the compiled rules
(``backends/tvm/ops/compute_shared.py``: the dense kernel; ``backends/tvm/guide_factor.py``: conv2d's).
"""
from __future__ import annotations

import numpy as np

from ..backends.reference.arrays import conv_views
from ..planning.plan import PlannedLayer
from .factors import FactorPlan
from .shared import Shared


def guide_tensors(t: dict[str, np.ndarray], out_channels: int, fp: FactorPlan
                  ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The layer's ``(weight_factors, bias_factors)`` (None where absent), or ``(None, None)`` when the plan
    carries no guide factors."""
    if not fp.guide:
        return None, None
    return t.get("weight_factors"), t.get("bias_factors")


def dense_injection(mu: np.ndarray, wf: np.ndarray | None, bf: np.ndarray | None, k: int) -> np.ndarray | None:
    """``Σ_i F_f[o, i]·μ_i + F_b,f[o]`` (B, O, k) for a dense layer's input mean ``μ`` (B, n)."""
    if wf is None and bf is None:
        return None
    b = mu.shape[0]
    out = np.einsum("oif,bi->bof", wf, mu.reshape(b, -1)) if wf is not None else 0.0
    if bf is not None:
        out = out + bf[None]
    loading = np.zeros((b, bf.shape[0] if bf is not None else wf.shape[0], k))  # type: ignore[union-attr]
    loading[..., :(wf if wf is not None else bf).shape[-1]] = out  # type: ignore[union-attr]
    return loading


def dense_guide_variance(mu: np.ndarray, s: np.ndarray | None, g: np.ndarray | None, wf: np.ndarray | None,
                         bf: np.ndarray | None, guide: int) -> np.ndarray:
    """What the mean-field variance counted of the guide's noise as independent (to subtract, module
    docstring): ``Σ_i (Σ_f F_f²)[o, i]·(μ_i² + s_i²·|g_i[:guide]|²) + Σ_f F_b,f²`` (B, O)."""
    b = mu.shape[0]
    total = 0.0
    if wf is not None:
        second = mu.reshape(b, -1) ** 2
        if s is not None and g is not None:
            flat = s.reshape(b, -1)
            rows = g.shape[1]
            share = (g[..., :guide] ** 2).sum(-1)  # (B, rows)
            second = second + (flat.reshape(b, rows, -1) ** 2 * share[..., None]).reshape(b, -1)
        total = second @ (wf**2).sum(-1).T
    if bf is not None:
        total = total + (bf**2).sum(-1)[None]
    return np.asarray(total)


def dense_mean_shift(s: np.ndarray, g: np.ndarray, wf: np.ndarray, guide: int) -> np.ndarray:
    """``E[(F·z)ᵀ(x − μ)] = Σ_i Σ_f F_f[o, i]·ℓ_in[i, f]`` (B, O): the mean of the product of the
    weights' and the input's guide noise (``ℓ_in = s·g``, guide columns)."""
    b = s.shape[0]
    rows = g.shape[1]
    flat = s.reshape(b, rows, -1)
    loading = flat[..., None] * g[:, :, None, :guide]  # (B, rows, group, guide)
    return np.einsum("oif,bif->bo", wf, loading.reshape(b, -1, guide))


def dense_product_variance(s: np.ndarray, g: np.ndarray, wf: np.ndarray, guide: int) -> np.ndarray:
    """``Var(zᵀA_o z) = 2‖(A_o + A_oᵀ)/2‖²_F`` (B, O) with ``A_o[f, h] = Σ_i F_f[o, i]·ℓ_in[i, h]``: the variance of
    the product of the weights' and the input's guide noise (module docstring; ``ℓ_in = s·g[:guide]``)."""
    b = s.shape[0]
    rows = g.shape[1]
    loading = (s.reshape(b, rows, -1)[..., None] * g[:, :, None, :guide]).reshape(b, -1, guide)
    a = np.einsum("oif,bih->bofh", wf, loading)
    return np.asarray((a * a).sum((2, 3)) + (a * np.swapaxes(a, 2, 3)).sum((2, 3)))


def conv_pooled_injection(mbar: np.ndarray, wf: np.ndarray | None, bf: np.ndarray | None, k: int, o: int
                          ) -> np.ndarray | None:
    """The pooled guide loading ``Σ_{c,k} F_f[o, c, k]·m̄μ_k[c] + F_b,f[o]`` (B, O, k); ``mbar`` (B, C, taps)."""
    if wf is None and bf is None:
        return None
    b = mbar.shape[0]
    loading = np.zeros((b, o, k))
    if wf is not None:
        loading[..., :wf.shape[-1]] += np.einsum("octf,bct->bof", wf.reshape(o, wf.shape[1], -1, wf.shape[-1]), mbar)
    if bf is not None:
        loading[..., :bf.shape[-1]] += bf[None]
    return loading


def mean_shift(layer: PlannedLayer, x_mean: np.ndarray, sh: Shared | None, fp: FactorPlan) -> np.ndarray | None:
    """The mean of the product of a compute layer's guide noise with its input's (``E[(F·z)ᵀ(x − μ)]``,
    the input's loadings on the guide columns ``ℓ_in = s·g[:guide]``): dense ``Σ_i Σ_f F_f[o, i]·ℓ_in[i, f]``;
    conv2d ``Σ_{c,k} G[o, c, k]·s[c, p + k]`` with ``G = Σ_f F_f[o, c, k]·g_in[c, f]`` (the closure).
    None where there is none (no guide factors, or an input without a shared part)."""
    wf = layer.tensors.get("weight_factors") if fp.guide else None
    if wf is None or sh is None:
        return None
    guide = wf.shape[-1]
    g = sh.g[..., :guide]
    if layer.op == "dense":
        return dense_mean_shift(sh.s, sh.g, wf, guide)

    o, c, kh, kw = wf.shape[:4]
    gw = np.einsum("octf,bcf->boct", wf.reshape(o, c, kh * kw, guide), g)
    s_in = sh.s.reshape(x_mean.shape)
    out = 0.0
    for kk, view in enumerate(conv_views(s_in, layer, (kh, kw))):
        out = out + np.einsum("bchw,boc->bohw", view, gw[..., kk])
    return np.asarray(out)
