"""Elementwise Gaussian moment formulas shared by the NumPy reference and the TE kernels.

Each function takes an ``ops`` namespace (:data:`NUMPY` here, ``TE_OPS`` in the TVM back end) so
that the *same* formula runs on float64 arrays and on TE expressions.

Numerics (the limit cases of ``pfp-math.md``):

* ``α = μ/σ`` is clamped to ``±ALPHA_MAX``, beyond which ``Φ`` is exactly 0 or 1 in float32 and
  float64; at ``σ = 0`` it is set to ``±ALPHA_MAX`` by the sign of ``μ`` (0 for ``μ = 0``) instead of
  dividing, so zero variance gives the exact deterministic result (``max(0, μ)``, ``max(μ1, μ2)``) at
  every scale of ``μ`` and never ``0/0``.
* Variances are computed in a centred form, ``v = v1·Φ(α) + v2·Φ(−α) + θ²·g(α)`` with the bounded
  ``g(α) = α²Φ(α)Φ(−α) + αφ(α)(Φ(−α) − Φ(α)) − φ(α)²`` (algebraically equal to Clark's
  ``s − μ²``), so huge means do not cancel catastrophically; ``Φ(−α)`` is its own term
  (``ndtr(−α)`` in NumPy), never ``1 − Φ(α)`` computed in a separate rounding step.
"""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import scipy.special

ALPHA_MAX = 40.0  # |α| beyond which Φ(α) ∈ {0, 1} exactly in float32 and float64
INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)

def _numpy_normal_cdfs(alpha: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return scipy.special.ndtr(alpha), scipy.special.ndtr(-alpha)


NUMPY = SimpleNamespace(
    where=np.where,
    normal_cdfs=_numpy_normal_cdfs,  # (Φ(α), Φ(−α)), each accurate in its own tail
    exp=np.exp,
    sqrt=np.sqrt,
    maximum=np.maximum,
    minimum=np.minimum,
    const=float,
)


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


def relu_moments(mean: Any, var: Any, ops: Any = NUMPY) -> tuple[Any, Any]:
    """Mean and variance of ``max(0, a)`` for ``a ~ N(mean, var)`` (exact moments).

    ``μ = μa·Φ(α) + σ·φ(α)`` and ``v = va·(Φ(α) + g(α))`` with ``α = μa/σ``.
    """
    sigma = ops.sqrt(var)
    alpha, cdf, cdf_neg, pdf = _std_normal_terms(_standardise(mean, sigma, ops), ops)
    out_mean = mean * cdf + sigma * pdf
    out_var = ops.maximum(var * (cdf + _g(alpha, cdf, cdf_neg, pdf)), ops.const(0.0))
    return out_mean, out_var


def leaky_relu_moments(mean: Any, var: Any, slope: float, ops: Any = NUMPY) -> tuple[Any, Any]:
    """Mean and variance of ``leaky(a) = s·a + (1 − s)·max(0, a)`` for ``a ~ N(mean, var)`` (exact).

    With ``r = max(0, a)`` (moments from :func:`relu_moments`) and Stein's lemma
    ``Cov(a, r) = var·Φ(α)``: ``μ = s·μa + (1−s)·μr``,
    ``v = s²·va + (1−s)²·vr + 2s(1−s)·va·Φ(α)``.
    """
    sigma = ops.sqrt(var)
    alpha, cdf, cdf_neg, pdf = _std_normal_terms(_standardise(mean, sigma, ops), ops)
    relu_mean = mean * cdf + sigma * pdf
    relu_var = var * (cdf + _g(alpha, cdf, cdf_neg, pdf))
    s, t = ops.const(slope), ops.const(1.0 - slope)
    out_mean = s * mean + t * relu_mean
    out_var = s * s * var + t * t * relu_var + ops.const(2.0 * slope * (1.0 - slope)) * var * cdf
    return out_mean, ops.maximum(out_var, ops.const(0.0))


def max_moments(mean1: Any, var1: Any, mean2: Any, var2: Any, ops: Any = NUMPY) -> tuple[Any, Any]:
    """Mean and variance of ``max(X1, X2)`` for independent Gaussians (Clark 1961, exact moments).

    ``θ = √(v1 + v2)``, ``α = (μ1 − μ2)/θ``, ``μ = μ1·Φ(α) + μ2·Φ(−α) + θ·φ(α)``,
    ``v = v1·Φ(α) + v2·Φ(−α) + θ²·g(α)``.
    """
    theta2 = var1 + var2
    theta = ops.sqrt(theta2)
    alpha, cdf, cdf_neg, pdf = _std_normal_terms(_standardise(mean1 - mean2, theta, ops), ops)
    out_mean = mean1 * cdf + mean2 * cdf_neg + theta * pdf
    out_var = ops.maximum(
        var1 * cdf + var2 * cdf_neg + theta2 * _g(alpha, cdf, cdf_neg, pdf), ops.const(0.0))
    return out_mean, out_var


def variance_to_second(mean: Any, var: Any, ops: Any = NUMPY) -> Any:
    """``s = μ² + v``."""
    return mean * mean + var


def second_to_variance(mean: Any, second: Any, ops: Any = NUMPY) -> Any:
    """``v = s − μ²``, clamped at 0 (rounding can make it slightly negative)."""
    return ops.maximum(second - mean * mean, ops.const(0.0))
