"""Beyond the clamp (``|μ| > _A_CLAMP``): the limit of a logistic-family activation plus the density
expansion of its difference from that limit.

The quadrature rules of :mod:`~pyro2pfp.moments.logistic` evaluate at ``a' = −|μ|`` clamped to
``≥ −_A_CLAMP`` (their tilts and nodes assume a bounded ``a'``).  That is exact only while the Gaussian
has no mass near 0 (``|μ|/σ ≳ 38``); with σ of the order of ``|μ|`` the clamped value would be wrong,
and its μ-derivative (the Stein slope of :mod:`pyro2pfp.correlation.stein`) 0 instead of ``≈ Φ(μ/σ)``.
Beyond the clamp the rules use the limit of the activation instead, which is accurate there because
``f`` differs from it only within ``|x| ≲ 40`` of 0, plus the correction from that difference.

Write ``f = f_L + r`` with ``f_L`` the limit (sigmoid → Heaviside ``H``, tanh → sign via the sigmoid,
SiLU and softplus → ReLU), ``r = f − f_L`` (``|r| ≤ (1+|x|)·e^{−|x|}``) and ``q = f² − f_L² = 2·f_L·r +
r²`` (as fast).  For ``X ~ N(μ, v)`` with density ``n(x) = c·e^{kx − x²/(2v)}``, ``c = n(0) = φ(α)/σ``,
``α = μ/σ``, ``k = μ/v = α/σ``, Taylor's expansion of ``n`` about 0 gives::

    E g(X) = c·Σ_j h_j·G_j/j!,   G_j = ∫ x^j g(x) dx,   h_0 = 1, h_1 = k, h_{j+1} = k·h_j − (j/v)·h_{j−1}

(``h_j = n⁽ʲ⁾(0)/n(0)``, the Hermite polynomials of the Gaussian), and then
``E f = E f_L + E r``, ``Var f = Var f_L + E q − 2·E f_L·E r − (E r)²``.
The first term is the leading correction, e.g. ``E SiLU(X) ≈ E ReLU(X) − (π²/6)·φ(α)/σ``
(``∫ (SiLU − ReLU) dx = −π²/6``), ``E σ(X) ≈ Φ(α) − (π²/6)·c·k`` (``r`` odd: ``G_0 = 0``).  Where the
rule is used (``|μ| > 1000``), ``c > 0`` in float64 needs ``|α| < 38``, so ``σ > 26`` and the terms fall
like ``|k|^j`` with ``|k| = |α|/σ < 1.5``.  The moments ``G_j`` (``y = |x|``, ``η`` the Dirichlet eta
function, ``∫_0^∞ y^n σ(−y) dy = n!·η(n+1)``, ``∫_0^∞ y^n σ'(y) dy = n!·η(n)`` for ``n ≥ 1`` (by parts),
``∫_0^∞ y^n log(1 + e^{−y}) dy = n!·η(n+2)``):

* sigmoid (``r = σ(x) − H(x)``, odd): ``R_j = −2·j!·η(j+1)`` (j odd; ``R_1 = −π²/6``), 0 (j even);
  ``q = σ² − H``: ``Q_0 = −1``, ``Q_j = −2·j!·η(j)`` (j ≥ 2 even), ``−2·j!·η(j+1)`` (j odd);
* SiLU (``r = −|x|·σ(−|x|)``, even): ``R_j = −2·(j+1)!·η(j+2)`` (j even; ``R_0 = −π²/6``), 0 (j odd);
  ``Q_j = −2·(j+2)!·η(j+2)`` (j even; ``Q_0 = −π²/3``), ``−2·(j+2)!·η(j+3)`` (j odd);
* softplus (``r = log(1 + e^{−|x|})``, even): ``R_j = 2·j!·η(j+2)`` (j even; ``R_0 = π²/6``), 0 (j odd);
  ``Q_j = 2·(j+1)!·η(j+3) + 2·L_j`` (j even; ``Q_0 = 2ζ(3)``), ``2·(j+1)!·η(j+3)`` (j odd), with
  ``L_j = ∫_0^∞ y^j·log²(1 + e^{−y}) dy`` (mpmath, 30 digits; ``L_0 = ζ(3)/4``).

(``tests/ops/activations/test_activation_moments.py`` checks each ``G_j`` against quadrature of its definition.)
Truncated after ``j = _FAR_TERMS = 6``, the error is that of the next terms, ``c·O(|k|⁷ + |k|⁵/v)`` (the
limit moments themselves are exact): means within 2e-13 output sd and variances within 5e-8 relative
of quadrature for ``|μ| ≥ 1000`` and any σ.  For ``|k| ≥ 1`` (the series' radius: ``e^{kx}`` against
``r``'s ``e^{−|x|}``) it diverges, but the far-side moments there are below ``c < e^{−|μ|/2} ≈ 1e-217``
and their absolute error is of that order.
"""
from __future__ import annotations

import math
from typing import Any

import scipy.special

from .normal import ALPHA_MAX, _upper_tail_and_pdf
from .ops import _share

_A_CLAMP = 1000.0  # |μ| beyond which the logistic-family rules use their limits (_far_corrections)

_FAR_TERMS = 6
# The ReLU moments of the SiLU and softplus far rules (_relu_tail) use its closed forms alone, without
# the continued fraction ELU uses beyond |α| = 3.5: relatively accurate enough here (1e-10 in float64,
# 2e-3 in float32 where φ(α) is representable), and a smaller kernel.
_FAR_CF_SWITCH, _FAR_CF_DEPTH = ALPHA_MAX, 0


def _eta(s: int) -> float:
    """Dirichlet's ``η(s) = Σ_{n≥1} (−1)^{n+1}/n^s = (1 − 2^{1−s})·ζ(s)`` (``η(1) = log 2``)."""
    return math.log(2.0) if s == 1 else (1.0 - 2.0 ** (1 - s)) * float(scipy.special.zeta(s))


_SOFTPLUS_L = (0.30051422578989857135, 0.0, 0.19574558819987625344, 0.0, 0.66798401988988460988, 0.0,
               5.3298899845735854164)  # L_j = ∫_0^∞ y^j·log²(1 + e^{−y}) dy (j even)


def _far_constants(kind: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(R_j/j!, Q_j/j!)``, ``j = 0 … _FAR_TERMS``, of ``r = f − f_L`` and ``q = f² − f_L²`` (module
    docstring)."""
    f, rs, qs = math.factorial, [], []
    for j in range(_FAR_TERMS + 1):
        even = j % 2 == 0
        if kind == "sigmoid":
            r = 0.0 if even else -2.0 * f(j) * _eta(j + 1)
            q = (-1.0 if j == 0 else -2.0 * f(j) * _eta(j)) if even else -2.0 * f(j) * _eta(j + 1)
        elif kind == "silu":
            r = -2.0 * f(j + 1) * _eta(j + 2) if even else 0.0
            q = -2.0 * f(j + 2) * _eta(j + 2) if even else -2.0 * f(j + 2) * _eta(j + 3)
        else:  # softplus
            r = 2.0 * f(j) * _eta(j + 2) if even else 0.0
            q = 2.0 * f(j + 1) * _eta(j + 3) + (2.0 * _SOFTPLUS_L[j] if even else 0.0)
        rs.append(r / f(j))
        qs.append(q / f(j))
    return tuple(rs), tuple(qs)


_FAR_SIGMOID, _FAR_SILU, _FAR_SOFTPLUS = (_far_constants(k) for k in ("sigmoid", "silu", "softplus"))


def _far_corrections(alpha: Any, pdf: Any, sigma: Any, var: Any, consts: tuple[tuple[float, ...], tuple[float, ...]],
                     ops: Any) -> tuple[Any, Any]:
    """``(E r(X), E q(X))`` for ``X ~ N(μ, var)`` by the density expansion (module docstring), from ``α = μ/σ``
    (clamped at ±ALPHA_MAX, where ``φ(α) = pdf`` is 0), ``σ`` and ``var`` (both ``> 0``)."""
    c = _share(pdf / sigma, ops)
    k = _share(alpha / sigma, ops)
    inv_v = _share(ops.const(1.0) / var, ops)
    h = [ops.const(1.0), k]
    for j in range(1, _FAR_TERMS):
        h.append(_share(k * h[j] - ops.const(float(j)) * inv_v * h[j - 1], ops))
    sums = []
    for coeffs in consts:
        terms = [ops.const(g) * hj for g, hj in zip(coeffs, h, strict=True) if g != 0.0]
        sums.append(c * sum(terms[1:], terms[0]))
    return sums[0], sums[1]


def _far_moments(mean_l: Any, var_l: Any, e_r: Any, e_q: Any, ops: Any) -> tuple[Any, Any]:
    """``(E f, Var f)`` from the limit's moments and the corrections: ``E f = E f_L + E r``,
    ``Var f = Var f_L + E q − 2·E f_L·E r − (E r)²`` (clamped at 0)."""
    out_var = var_l + e_q - ops.const(2.0) * mean_l * e_r - e_r * e_r
    return mean_l + e_r, ops.maximum(out_var, ops.const(0.0))


def _sigmoid_far(a: Any, var: Any, ops: Any) -> tuple[Any, Any]:
    """``(E σ(X), Var σ(X))`` for ``X ~ N(a, var)``, ``a < −_A_CLAMP``, ``var ≥ 0.05``: the Heaviside
    moments ``Φ(α)``, ``Φ(α)·Φ(−α)`` (``α = a/σ``, tail-accurate) and the corrections."""
    sigma = _share(ops.sqrt(var), ops)
    alpha = _share(ops.maximum(a / sigma, ops.const(-ALPHA_MAX)), ops)
    cdf, pdf = _upper_tail_and_pdf(-alpha, ops)  # Φ(α), φ(α)
    cdf = _share(cdf, ops)
    e_r, e_q = _far_corrections(alpha, pdf, sigma, var, _FAR_SIGMOID, ops)
    return _far_moments(cdf, cdf * (ops.const(1.0) - cdf), e_r, e_q, ops)
