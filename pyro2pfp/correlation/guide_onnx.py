"""A correlated guide's global factors in the ONNX export of shared-factor PFP: the terms the dense and conv2d
exporters (``ops/compute.py``) add beside the scheme's own, the float32 ONNX form of
:mod:`pyro2pfp.correlation.guide` (its docstring has the formulas).

The guide's factors are the first ``guide`` columns of every edge's ``g`` (``FactorPlan.guide``); each helper
returns Syms in the export's layout: loadings (B, O, K) with the guide's columns first and zeros up to ``K``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..backends.onnx.builder import Sym

if TYPE_CHECKING:
    from .onnx_step import OnnxShared, OnnxSharedStep


def guide_columns(step: OnnxSharedStep, g: Sym, guide: int) -> Sym:
    """``g[..., :guide]``: the guide's columns of a loading matrix (B, R, K)."""
    return g.nary("Slice", step.b.ints([0], "starts"), step.b.ints([guide], "ends"), step.b.ints([2], "axes"))


def dense_terms(step: OnnxSharedStep, mu: Sym, sh: OnnxShared | None, rows: int, wf: np.ndarray | None,
                bf: np.ndarray | None, k: int) -> tuple[Sym, Sym, Sym | None]:
    """``(injection (B, O, K), counted (B, O), mean shift (B, O) or None)`` of a dense layer with input mean
    ``mu`` (B, n): the guide's loading ``Σ_i F_f[o, i]·μ_i + F_b,f[o]`` (:func:`~.guide.dense_injection`), what
    the mean-field variance counted of it as independent (:func:`~.guide.dense_guide_variance`) and the mean of
    the product of the weights' and the input's guide noise (:func:`~.guide.dense_mean_shift`); ``counted`` less
    that product's variance (:func:`~.guide.dense_product_variance`)."""
    guide = (wf if wf is not None else bf).shape[-1]  # type: ignore[union-attr]
    inj: Sym | None = None
    counted: Sym | None = None
    shift: Sym | None = None
    product: Sym | None = None
    if wf is not None:
        o, n = wf.shape[:2]
        inj = step.einsum("bi,oif->bof", mu, step.t(wf, "guide_w"))
        second = mu * mu
        if sh is not None:
            gg = guide_columns(step, sh.g, guide)  # (B, rows, guide)
            share = step.rsum(gg * gg, [2])  # (B, rows, 1)
            s = step.view_as(sh.s, rows, n // rows)
            second = second + step.view_as(s * s * share, n)
            shift = step.einsum("brq,brf,orqf->bo", s, gg, step.t(wf.reshape(o, rows, n // rows, guide), "guide_w"))
            a = step.einsum("brq,brh,orqf->bofh", s, gg, step.t(wf.reshape(o, rows, n // rows, guide), "guide_w"))
            product = step.rsum(a * a + a * a.nary("Transpose", perm=[0, 1, 3, 2]), [2, 3])
        counted = second.nary("MatMul", step.t((wf**2).sum(-1).T, "guide_w2_t"))
        if product is not None:
            counted = counted - step.view_as(product, o)
    if bf is not None:
        bias = step.view_as(step.t(bf, "guide_b"), bf.shape[0], guide)
        inj = bias if inj is None else inj + bias
        bias_sq = step.t((bf**2).sum(-1), "guide_b2")
        counted = bias_sq if counted is None else counted + bias_sq
    assert inj is not None and counted is not None
    return step.widened(inj, guide, k), counted, shift


def conv_injection(step: OnnxSharedStep, mbar: list[Sym], wf: np.ndarray | None, bf: np.ndarray | None,
                   k: int) -> Sym:
    """The pooled guide loading ``Σ_{c,k} F_f[o, c, k]·m̄μ_k[c] + F_b,f[o]`` (B, O, K) from the pooled views
    ``mbar`` (one (B, C) per kernel tap, row-major; :func:`~.guide.conv_pooled_injection`)."""
    guide = (wf if wf is not None else bf).shape[-1]  # type: ignore[union-attr]
    inj: Sym | None = None
    if wf is not None:
        o, c = wf.shape[:2]
        taps = wf.reshape(o, c, -1, guide)
        inj = step.total([step.einsum("bc,ocf->bof", m, step.t(taps[:, :, n], "guide_w")) for n, m in enumerate(mbar)])
    if bf is not None:
        bias = step.view_as(step.t(bf, "guide_b"), bf.shape[0], guide)
        inj = bias if inj is None else inj + bias
    assert inj is not None
    return step.widened(inj, guide, k)


def conv_profile_terms(step: OnnxSharedStep, g: Sym, mu_taps: list[Sym], wf: np.ndarray | None,
                       bf: np.ndarray | None) -> list[Sym]:
    """The guide's part of a conv's profile ``Cov(out[o, p], η_o)``: ``Σ_{c,k} (Σ_f g[o, f]·F_f[o, c, k])·
    μ[c, p + k] + Σ_f g[o, f]·F_b,f[o]`` as terms (B, O, OH, OW) (or (B, O, 1, 1)) to sum."""
    guide = (wf if wf is not None else bf).shape[-1]  # type: ignore[union-attr]
    gg = guide_columns(step, g, guide)  # (B, O, guide)
    terms = []
    if wf is not None:
        o, c = wf.shape[:2]
        taps = wf.reshape(o, c, -1, guide)
        for n, tp in enumerate(mu_taps):
            gw = step.einsum("bof,ocf->boc", gg, step.t(taps[:, :, n], "guide_w"))
            terms.append(step.einsum("bchw,boc->bohw", tp, gw))
    if bf is not None:
        o = bf.shape[0]
        terms.append(step.view_as(step.einsum("bof,of->bo", gg, step.t(bf, "guide_b")), o, 1, 1))
    return terms


def conv_mean_shift(step: OnnxSharedStep, sh: OnnxShared, s_taps: list[Sym], wf: np.ndarray) -> Sym:
    """``Σ_{c,k} G[o, c, k]·s[c, p + k]`` with ``G = Σ_f F_f[o, c, k]·g_in[c, f]`` (B, O, OH, OW): the mean of
    the product of the weights' and the input's guide noise (:func:`~.guide.mean_shift`)."""
    o, c = wf.shape[:2]
    guide = wf.shape[-1]
    taps = wf.reshape(o, c, -1, guide)
    gg = guide_columns(step, sh.g, guide)  # (B, C, guide)
    terms = []
    for n, tp in enumerate(s_taps):
        gw = step.einsum("bcf,ocf->boc", gg, step.t(taps[:, :, n], "guide_w"))
        terms.append(step.einsum("bchw,boc->bohw", tp, gw))
    return step.total(terms)
