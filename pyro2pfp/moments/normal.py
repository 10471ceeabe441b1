"""Standard normal quantities written against ``ops``: standardised ratios, ``Φ``, ``φ``, tails and
the Mills ratio, each relatively accurate in its own tail (in float32 too)."""
from __future__ import annotations

import math
from typing import Any

from .ops import NUMPY, _abs, _clamp, _share

ALPHA_MAX = 40.0  # |α| beyond which Φ(α) ∈ {0, 1} exactly in float32 and float64
INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_PI = math.sqrt(math.pi)
_SQRT_HALF_PI = math.sqrt(0.5 * math.pi)


def _standardise(num: Any, sigma: Any, ops: Any) -> Any:
    """``α = num/σ`` clamped to ``±ALPHA_MAX``; its ``σ → 0`` limit where ``σ = 0``."""
    zero, limit = ops.const(0.0), ops.const(ALPHA_MAX)
    positive = sigma > zero
    ratio = num / ops.where(positive, sigma, ops.const(1.0))
    at_zero = ops.where(num > zero, limit, ops.where(num < zero, -limit, zero))
    return ops.minimum(ops.maximum(ops.where(positive, ratio, at_zero), -limit), limit)


def _std_normal_terms(alpha: Any, ops: Any) -> tuple[Any, Any, Any, Any]:
    """α, Φ(α), Φ(−α), φ(α) for a clamped α."""
    cdf, cdf_neg = ops.normal_cdfs(alpha)
    pdf = ops.exp(ops.const(-0.5) * alpha * alpha) * ops.const(_INV_SQRT_2PI)
    return alpha, cdf, cdf_neg, pdf


def _g(alpha: Any, cdf: Any, cdf_neg: Any, pdf: Any) -> Any:
    """g(α) = α²Φ(α)Φ(−α) + αφ(α)(Φ(−α) − Φ(α)) − φ(α)², bounded in [−1/(2π), 0]."""
    return alpha * alpha * cdf * cdf_neg + alpha * pdf * (cdf_neg - cdf) - pdf * pdf


def gaussian_terms(mean: Any, var: Any, ops: Any = NUMPY) -> tuple[Any, Any, Any, Any, Any]:
    """``(σ, α, Φ(α), Φ(−α), φ(α))`` of ``a ~ N(mean, var)``: ``σ = √var``, ``α = mean/σ`` clamped to
    ``±ALPHA_MAX`` (its ``σ → 0`` limit where ``σ = 0``).  The terms of the ReLU and leaky ReLU
    moments; the TVM back end's shared-factor ReLU kernel evaluates them once for those moments and
    for Stein's lemma (``backends/tvm/ops/activation.py``)."""
    sigma = ops.sqrt(var)
    return (sigma, *_std_normal_terms(_standardise(mean, sigma, ops), ops))


def _erfcx(x: Any, ops: Any) -> Any:
    """``e^{x²}·erfc(x)`` for ``x ≥ 0`` through the back end's ``erfcx`` primitive.

    Bounded (``erfcx(0) = 1``, ``≈ 1/(√π·x)`` for large ``x``), it keeps Gaussian tails
    (``Φ(−t) = ½·erfcx(t/√2)·e^{−t²/2}``, the Mills ratio) relatively accurate.
    """
    return ops.erfcx(x)


def _mills(t: Any, ops: Any) -> Any:
    """Mills ratio ``R(t) = Φ(−t)/φ(t) = √(π/2)·erfcx(t/√2)`` for ``t ≥ 0`` (bounded by √(π/2))."""
    return ops.const(_SQRT_HALF_PI) * _erfcx(t * ops.const(INV_SQRT2), ops)


def _phi(x: Any, ops: Any) -> Any:
    """Standard normal density ``φ(x)`` (``x`` clamped to ±ALPHA_MAX, where it is 0 in float64)."""
    xc = _clamp(x, -ALPHA_MAX, ALPHA_MAX, ops)
    return ops.exp(ops.const(-0.5) * xc * xc) * ops.const(_INV_SQRT_2PI)


def _cdfs(alpha: Any, ops: Any, negative: Any = None) -> tuple[Any, Any]:
    """``(Φ(α), Φ(−α))``, each relatively accurate in its own tail, in float32 too.

    ``Φ(−|α|) = ½·erfcx(|α|/√2)·e^{−α²/2}`` and the other one is ``1 − Φ(−|α|)``; ``α`` is
    clamped to ±ALPHA_MAX (``Φ(−40) < 1e-300``).  ``negative`` (``α < 0``) may be given as a
    comparison of simpler expressions of the same sign: TVM's simplifier is slow on comparisons
    of deep select/min/max trees such as a clamped ratio.
    """
    upper, lower, _ = _cdfs_and_tail(alpha, ops, negative)
    return upper, lower


def _upper_tail(t: Any, ops: Any) -> Any:
    """``Φ(−t)`` for ``t ≥ 0`` (clamped at ALPHA_MAX), relatively accurate."""
    return _upper_tail_and_pdf(t, ops)[0]


def _upper_tail_and_pdf(t: Any, ops: Any) -> tuple[Any, Any]:
    """``(Φ(−t), φ(t))`` for ``t ≥ 0`` from one exponential (``t`` clamped at ALPHA_MAX)."""
    tc = ops.minimum(t, ops.const(ALPHA_MAX))
    gauss = _share(ops.exp(ops.const(-0.5) * tc * tc), ops)
    return ops.const(0.5) * _erfcx(tc * ops.const(INV_SQRT2), ops) * gauss, gauss * ops.const(_INV_SQRT_2PI)


def _cdfs_and_tail(alpha: Any, ops: Any, negative: Any = None) -> tuple[Any, Any, Any]:
    """``(Φ(α), Φ(−α), Φ(−|α|))`` (see :func:`_cdfs`)."""
    return _cdfs_tail_pdf(alpha, ops, negative)[:3]


def _cdfs_tail_pdf(alpha: Any, ops: Any, negative: Any = None) -> tuple[Any, Any, Any, Any]:
    """``(Φ(α), Φ(−α), Φ(−|α|), φ(α))`` (see :func:`_cdfs`), sharing one exponential."""
    small, pdf = _upper_tail_and_pdf(_abs(alpha, ops), ops)
    small = _share(small, ops)
    big = ops.const(1.0) - small
    if negative is None:
        negative = alpha < ops.const(0.0)
    return ops.where(negative, small, big), ops.where(negative, big, small), small, pdf


def _normal_pdf(x: Any, var: Any, ops: Any) -> Any:
    """Density of ``N(0, var)`` at ``x`` (``var > 0``), i.e. ``φ(x/√var)/√var``."""
    z2 = _clamp(x * x / var, 0.0, 2.0 * ALPHA_MAX * ALPHA_MAX, ops)
    return ops.exp(ops.const(-0.5) * z2) * ops.const(_INV_SQRT_2PI) / ops.sqrt(var)


def _standard(num: Any, sigma: Any, ops: Any) -> Any:
    """``num/σ`` clamped to ±ALPHA_MAX, and its σ → 0 limit (the sign of ``num``) where σ = 0."""
    return _standardise(num, sigma, ops)
