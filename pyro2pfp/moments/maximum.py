"""Clark's moments of the maximum of Gaussians (max pooling): independent, correlated, and folded
over a window of jointly Gaussian taps (Clark 1961)."""
from __future__ import annotations

from typing import Any

from .normal import _g, _standardise, _std_normal_terms
from .ops import NUMPY


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


def correlated_max_moments(mean1: Any, var1: Any, mean2: Any, var2: Any, cov: Any, ops: Any = NUMPY
                           ) -> tuple[Any, Any, Any, Any]:
    """Mean and variance of ``max(X1, X2)`` for jointly Gaussian ``X1, X2`` with covariance ``cov``,
    and the weights ``(Φ(α), Φ(−α))`` of the covariance update (Clark 1961, exact moments).

    ``θ² = v1 + v2 − 2·c12`` (clamped at 0), ``α = (μ1 − μ2)/θ``; the mean and the centred variance
    are those of :func:`max_moments` with this ``θ`` (the centred form uses only ``μ1 − μ2 = αθ``, so
    it holds for correlated inputs too).  For any ``Y`` jointly Gaussian with ``X1, X2``:
    ``Cov(max(X1, X2), Y) = Cov(X1, Y)·Φ(α) + Cov(X2, Y)·Φ(−α)`` (exact; Clark's eq. for the
    correlation of the maximum with a third variable), which :func:`correlated_window_max` uses
    to fold a window.  ``θ → 0`` (perfectly correlated, equal variances) gives the larger mean with
    its variance, never NaN; ``cov = 0`` gives :func:`max_moments`.
    """
    theta2 = ops.maximum(var1 + var2 - ops.const(2.0) * cov, ops.const(0.0))
    theta = ops.sqrt(theta2)
    alpha, cdf, cdf_neg, pdf = _std_normal_terms(_standardise(mean1 - mean2, theta, ops), ops)
    out_mean = mean1 * cdf + mean2 * cdf_neg + theta * pdf
    out_var = ops.maximum(
        var1 * cdf + var2 * cdf_neg + theta2 * _g(alpha, cdf, cdf_neg, pdf), ops.const(0.0))
    return out_mean, out_var, cdf, cdf_neg


def window_pairs(taps: int) -> list[tuple[int, int]]:
    """The pairs ``(i, j)``, ``i < j``, of a window's ``taps`` (row-major tap order), in the order
    the in-window covariances are stored: ``(0, 1), (0, 2), …, (1, 2), …``."""
    return [(i, j) for i in range(taps) for j in range(i + 1, taps)]


def correlated_window_max(taps: list[tuple[Any, Any]], cov: dict[tuple[int, int], Any], ops: Any = NUMPY
                          ) -> tuple[Any, Any]:
    """Clark's max folded over a window of jointly Gaussian taps, left to right (Clark 1961).

    ``taps[t] = (μ_t, v_t)``; ``cov[(i, j)]`` (``i < j``) the covariance of taps ``i`` and ``j``.  The
    running maximum ``M`` is treated as Gaussian with its exact first two moments; its covariance
    with every later tap is carried along, ``Cov(max(M, X_t), X_j) = Cov(M, X_j)·Φ(α) +
    Cov(X_t, X_j)·Φ(−α)``, so each step is Clark's correlated max (:func:`correlated_max_moments`).
    Exact for two taps; with all covariances 0 it is the independent fold of :func:`max_moments`.
    """
    mean, var = taps[0]
    carried = {j: cov[(0, j)] for j in range(1, len(taps))}
    for t in range(1, len(taps)):
        m2, v2 = taps[t]
        mean, var, cdf, cdf_neg = correlated_max_moments(mean, var, m2, v2, carried.pop(t), ops)
        carried = {j: c * cdf + cov[(t, j)] * cdf_neg for j, c in carried.items()}
    return mean, var
