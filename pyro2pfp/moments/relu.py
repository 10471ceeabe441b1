"""ReLU and leaky ReLU moments, and the conversions between variance and second moment."""
from __future__ import annotations

from typing import Any

from .normal import _g, _mills, _phi, _upper_tail, gaussian_terms
from .ops import NUMPY, _abs, _share


def relu_moments(mean: Any, var: Any, ops: Any = NUMPY) -> tuple[Any, Any]:
    """Mean and variance of ``max(0, a)`` for ``a ~ N(mean, var)`` (exact moments).

    ``μ = μa·Φ(α) + σ·φ(α)`` and ``v = va·(Φ(α) + g(α))`` with ``α = μa/σ``.
    """
    sigma, alpha, cdf, cdf_neg, pdf = gaussian_terms(mean, var, ops)
    out_mean = mean * cdf + sigma * pdf
    out_var = ops.maximum(var * (cdf + _g(alpha, cdf, cdf_neg, pdf)), ops.const(0.0))
    return out_mean, out_var


def leaky_relu_moments(mean: Any, var: Any, slope: float, ops: Any = NUMPY) -> tuple[Any, Any]:
    """Mean and variance of ``leaky(a) = s·a + (1 − s)·max(0, a)`` for ``a ~ N(mean, var)`` (exact).

    With ``r = max(0, a)`` (moments from :func:`relu_moments`) and Stein's lemma
    ``Cov(a, r) = var·Φ(α)``: ``μ = s·μa + (1−s)·μr``,
    ``v = s²·va + (1−s)²·vr + 2s(1−s)·va·Φ(α)``.
    """
    sigma, alpha, cdf, cdf_neg, pdf = gaussian_terms(mean, var, ops)
    relu_mean = mean * cdf + sigma * pdf
    relu_var = var * (cdf + _g(alpha, cdf, cdf_neg, pdf))
    s, t = ops.const(slope), ops.const(1.0 - slope)
    out_mean = s * mean + t * relu_mean
    out_var = s * s * var + t * t * relu_var + ops.const(2.0 * slope * (1.0 - slope)) * var * cdf
    return out_mean, ops.maximum(out_var, ops.const(0.0))


def variance_to_second(mean: Any, var: Any, ops: Any = NUMPY) -> Any:
    """``s = μ² + v``."""
    return mean * mean + var


def second_to_variance(mean: Any, second: Any, ops: Any = NUMPY) -> Any:
    """``v = s − μ²``, clamped at 0 (rounding can make it slightly negative)."""
    return ops.maximum(second - mean * mean, ops.const(0.0))


_CF_SWITCH = 3.5  # Laplace's continued fraction beyond it (30 levels: < 1e-11), closed forms below
_CF_DEPTH = 30


def _relu_tail(mean: Any, var: Any, sigma: Any, m: Any, ops: Any, switch: float = _CF_SWITCH,
               depth: int = _CF_DEPTH, tail_from_mills: bool = False) -> tuple[Any, Any, Any]:
    """ReLU moments (as :func:`relu_moments`) with the variance *relatively* accurate in both
    tails, in float32 too (the ``g(α)`` form loses it for ``α ≪ 0``).

    With ``t = |μ/σ|`` and the truncated moments ``E[(Z−t)^k; Z>t] = φ(t)·J_k(t)``:
    ``J1 = 1 − tR(t)``, ``J2 = (1+t²)R(t) − t`` (``R`` the Mills ratio), which cancel for large ``t``
    and are taken there from Laplace's continued fraction ``R = 1/(t + D1)``,
    ``D_k = k/(t + D_{k+1})``: ``J1 = D1/(t + D1)``, ``J2 = D2/((t + D2)(t + D1))``.  Then
    ``relu(X) = σ·(Z − t)⁺`` for μ < 0, and ``relu(X) = X + relu(−X)`` (Stein:
    ``Cov(X, relu(−X)) = −v·Φ(−t)``) for μ ≥ 0.  Returns ``φ(t)`` too.  ``switch``, ``depth``: where
    the continued fraction starts and its levels (``depth = 0``: the closed forms everywhere, which lose
    about ``t⁴/2`` ulps in ``J2``: 1e-10 relative at t = 38 in float64, 2e-3 at t = 13 in float32, beyond
    which ``φ(t)`` is 0 there); ``tail_from_mills``: ``Φ(−t) = φ(t)·R(t)`` from the ``R`` above instead
    of its own ``erfcx`` (the same value to the fraction's accuracy; a smaller kernel).
    """
    zero, one = ops.const(0.0), ops.const(1.0)
    t = _share(_abs(m, ops), ops)
    tc = ops.minimum(t, ops.const(switch))
    r = _mills(tc, ops)
    j1_near, j2_near = one - tc * r, (one + tc * tc) * r - tc
    if depth == 0:  # the closed forms only (switch ≥ ALPHA_MAX, the clamp of t)
        j1, j2, mills = _share(j1_near, ops), j2_near, r
    else:
        tf = ops.maximum(t, ops.const(switch))
        d = zero
        d2 = zero
        for k in range(depth, 0, -1):
            d = ops.const(float(k)) / (tf + d)
            if k == 2:
                d2 = _share(d, ops)
        d1 = _share(d, ops)
        j1_far = d1 / (tf + d1)
        j2_far = d2 / ((tf + d2) * (tf + d1))
        far = t > ops.const(switch)
        j1 = _share(ops.where(far, j1_far, j1_near), ops)
        j2 = ops.where(far, j2_far, j2_near)
        mills = ops.where(far, one / (tf + d1), r)
    pdf = _share(_phi(t, ops), ops)
    base_mean = sigma * pdf * j1
    base_var = var * pdf * ops.maximum(j2 - pdf * j1 * j1, zero)
    tail = pdf * mills if tail_from_mills else _upper_tail(t, ops)  # Φ(−t) (= φ(t)·R(t))
    positive = mean > zero
    out_mean = ops.where(positive, mean + base_mean, base_mean)
    out_var = ops.where(positive, var * (one - ops.const(2.0) * tail) + base_var, base_var)
    return out_mean, ops.maximum(out_var, zero), pdf
