"""Elementwise Gaussian moment formulas shared by the NumPy reference and the TE kernels.

Each function takes an ``ops`` namespace (:data:`NUMPY` here, ``TE_OPS`` in the TVM back end) so
that the *same* formula runs on float64 arrays and on TE expressions.

Numerics (the limit cases of ``docs/math.md`` "Activations"):

* ``α = μ/σ`` is clamped to ``±ALPHA_MAX``, beyond which ``Φ`` is exactly 0 or 1 in float32 and
  float64; at ``σ = 0`` it is set to ``±ALPHA_MAX`` by the sign of ``μ`` (0 for ``μ = 0``) instead of
  dividing, so zero variance gives the exact deterministic result (``max(0, μ)``, ``max(μ1, μ2)``) at
  every scale of ``μ`` and never ``0/0``.
* Variances are computed in a centred form, ``v = v1·Φ(α) + v2·Φ(−α) + θ²·g(α)`` with the bounded
  ``g(α) = α²Φ(α)Φ(−α) + αφ(α)(Φ(−α) − Φ(α)) − φ(α)²`` (algebraically equal to Clark's
  ``s − μ²``), so huge means do not cancel catastrophically; ``Φ(−α)`` is its own term
  (``ndtr(−α)`` in NumPy), never ``1 − Φ(α)`` computed in a separate rounding step.

Smooth and clipped activations (every rule ``xxx_moments(mean, var, [attrs,] ops)``
returns ``(mean, var)`` of the activation of ``N(mean, var)``, ``xxx_exact(x, [attrs,] ops)`` is
the deterministic activation, and ``var = 0`` returns exactly ``xxx_exact(mean)``):

==========  ===================================================  =============================
rule        method                                               exact?
==========  ===================================================  =============================
hardtanh,   clipped-Gaussian moments (law of total variance)     exact
relu6
elu         lognormal partial expectations + ReLU moments        exact
gelu        Stein + bivariate normal CDF (Plackett, 20-pt GL)    exact up to the GL rule
sigmoid,    delta series (v < 0.05), Gauss–Hermite (σ < 1.1),    numerical, ~1e-6 relative
tanh, silu, tilted split Gauss–Laguerre (σ ≥ 1.1); for |μ| > 1000
softplus    (tanh 500) the Heaviside / ReLU limit + the density
            expansion of its difference (``_far_corrections``)
==========  ===================================================  =============================

The errors against adaptive quadrature are printed by ``benchmarks/activation_accuracy.py`` (and
quoted in each docstring).  The ``ops`` primitives these rules use: ``where``, ``exp``, ``sqrt``,
``maximum``, ``minimum``, ``const``, ``erfcx`` (``e^{x²}·erfc(x)`` for ``x ≥ 0``: scipy in
:data:`NUMPY`, :func:`erfcx_rational` in the float32 back ends), ``<``/``>`` comparisons and
``+ − * /`` and unary minus; ``ops.bind`` (``te_shared``) is used when present.  For the TE back
end they avoid comparisons of deep select/min/max trees and selects inside values that are used
many times: TVM 0.27's simplifier substitutes let-bound values, and such patterns made single
kernels take minutes to build (now 0.3-5 s each).
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
    erfcx=scipy.special.erfcx,  # e^{x²}·erfc(x) (x ≥ 0); the float32 back ends: erfcx_rational
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


def gaussian_terms(mean: Any, var: Any, ops: Any = NUMPY) -> tuple[Any, Any, Any, Any, Any]:
    """``(σ, α, Φ(α), Φ(−α), φ(α))`` of ``a ~ N(mean, var)``: ``σ = √var``, ``α = mean/σ`` clamped to
    ``±ALPHA_MAX`` (its ``σ → 0`` limit where ``σ = 0``).  The terms of the ReLU and leaky ReLU
    moments; the TVM back end's shared-factor ReLU kernel evaluates them once for those moments and
    for Stein's lemma (``tvm_backend/ops/correlation.py``)."""
    sigma = ops.sqrt(var)
    return (sigma, *_std_normal_terms(_standardise(mean, sigma, ops), ops))


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


def variance_to_second(mean: Any, var: Any, ops: Any = NUMPY) -> Any:
    """``s = μ² + v``."""
    return mean * mean + var


def second_to_variance(mean: Any, second: Any, ops: Any = NUMPY) -> Any:
    """``v = s − μ²``, clamped at 0 (rounding can make it slightly negative)."""
    return ops.maximum(second - mean * mean, ops.const(0.0))


# =============================================================================================
# Smooth and clipped activations.  Every formula below is written against ``ops``
# only, like the ReLU rules above, so that the same code runs on float64 NumPy arrays, on TE
# float32 expressions and on ONNX symbols.  The accuracy numbers quoted in the docstrings are
# printed by ``benchmarks/activation_accuracy.py``.
# =============================================================================================

_SQRT_PI = math.sqrt(math.pi)
_SQRT_HALF_PI = math.sqrt(0.5 * math.pi)
_SMALL_VAR = 0.05  # below it the logistic-family rules use their delta (Taylor) series, see _delta_series
_TINY = 1e-30  # a denominator floor that is a normal float32 (never selected where it matters)
_HUGE_VAR = 1e12  # beyond it (σ > 1e6) GELU, SiLU and softplus are ReLU-like to 1e-6 (ReLU moments)


def _share(value: Any, ops: Any) -> Any:
    """Name ``value`` once when the back end can share sub-expressions (``te_shared``'s ``bind``)."""
    bind = getattr(ops, "bind", None)
    return value if bind is None else bind(value)


def _horner(x: Any, coeffs: tuple[float, ...], ops: Any) -> Any:
    """``c0·x^n + c1·x^(n−1) + … + cn`` (coefficients from the highest degree down), or ``ops.horner``
    where the namespace has one (the dual numbers of :mod:`pyro2pfp.correlation.stein`: the derivative
    as ``p'(x)·x'``, linear in the degree, where the product rule at every step of Horner's scheme
    writes the accumulator out again)."""
    own = getattr(ops, "horner", None)
    if own is not None:
        return own(x, coeffs)
    acc = ops.const(coeffs[0])
    for c in coeffs[1:]:
        acc = acc * x + ops.const(c)
    return acc


def _abs(x: Any, ops: Any) -> Any:
    """``|x|`` as ``max(x, −x)``, or ``ops.abs`` where the namespace has one (the dual numbers of
    :mod:`pyro2pfp.correlation.stein`, whose derivative of ``|x|`` at 0 must follow the sign of ``x'``)."""
    own = getattr(ops, "abs", None)
    return ops.maximum(x, -x) if own is None else own(x)


def _all(conditions: list[Any], ops: Any) -> Any:
    """Logical and of comparison results as ``Π where(c, 1, 0) > ½`` (float selects only: ONNX
    runtimes lack ``Where`` on booleans)."""
    one, zero = ops.const(1.0), ops.const(0.0)
    prod = ops.where(conditions[0], one, zero)
    for c in conditions[1:]:
        prod = prod * ops.where(c, one, zero)
    return prod > ops.const(0.5)


def _clamp(x: Any, lo: float, hi: float, ops: Any) -> Any:
    return ops.minimum(ops.maximum(x, ops.const(lo)), ops.const(hi))


# Numerical Recipes' erfcc (Press et al., §6.2; a Chebyshev fit): erfc(x) = t·exp(−x² + P(t)),
# t = 1/(1 + x/2), relative error < 1.2e-7 for x ≥ 0, so erfcx(x) = t·exp(P(t)) with one exp.
_NR_ERFCC = (0.17087277, -0.82215223, 1.48851587, -1.13520398, 0.27886807, -0.18628806, 0.09678418,
             0.37409196, 1.00002368, -1.26551223)


def erfcx_rational(x: Any, ops: Any) -> Any:
    """The scaled complementary error function ``e^{x²}·erfc(x)`` for ``x ≥ 0``, to 1.2e-7
    relative: the ``erfcx`` of the float32 back ends (``TE_OPS``, ONNX), one ``exp`` and a
    degree-9 polynomial in ``t = 1/(1 + x/2)`` (vectorisable; bounded, ``≈ 1/(√π·x)`` for large x).
    NumPy's :data:`NUMPY` uses ``scipy.special.erfcx`` (exact in float64)."""
    t = ops.const(1.0) / (ops.const(1.0) + ops.const(0.5) * x)
    return t * ops.exp(_horner(t, _NR_ERFCC, ops))


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


_EXPM1_TAYLOR = tuple(1.0 / math.factorial(k) for k in range(14, 0, -1))  # 1/14!, …, 1/1!


def _expm1(x: Any, ops: Any) -> Any:
    """``e^x − 1``, relatively accurate near 0 (degree-14 Taylor polynomial on |x| < ½, error < 1e-16)."""
    xs = _clamp(x, -0.5, 0.5, ops)
    series = _horner(xs, _EXPM1_TAYLOR, ops) * xs
    return ops.where(_abs(x, ops) < ops.const(0.5), series, ops.exp(x) - ops.const(1.0))


def _gauss_legendre_01(n: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    x, w = np.polynomial.legendre.leggauss(n)
    return tuple(float(t) for t in 0.5 * (x + 1.0)), tuple(float(t) for t in 0.5 * w)


_GL_NODES, _GL_WEIGHTS = _gauss_legendre_01(20)  # on [0, 1]
_GL8_NODES = tuple(float(t) for t in np.polynomial.legendre.leggauss(8)[0])  # on [−1, 1]
_GL8_WEIGHTS = tuple(float(t) for t in np.polynomial.legendre.leggauss(8)[1])


def _delta_series(f0: Any, d: list[Any], var: Any, ops: Any) -> tuple[Any, Any]:
    """Mean and variance of ``f(μ + σZ)`` from the derivatives ``d = [f', f'', …, f⁽¹⁰⁾]`` at ``μ``.

    The Gaussian Taylor (delta-method) series to fifth order in ``v``, with ``fk = f⁽ᵏ⁾(μ)``:
    ``E f = f + Σ_k f_{2k}·v^k/(2^k·k!)`` and ``Var f = Σ_{m,n≥1} f_m·f_n·v^{(m+n)/2}·
    Cov(Z^m, Z^n)/(m!·n!)`` (``Z`` standard normal), i.e.
    ``f1²·v + (f1f3 + f2²/2)·v² + (f1f5/4 + f2f4/2 + 5f3²/12)·v³
    + (f1f7/24 + f2f6/8 + 7f3f5/24 + f4²/6)·v⁴
    + (f1f9/192 + f2f8/48 + f3f7/16 + 5f4f6/48 + 21f5²/320)·v⁵``.
    Used for small ``v`` by the smooth activations: exact at ``v = 0`` (the deterministic
    activation) and keeping the variance *relatively* accurate however small ``v`` is, which the
    closed forms, a difference ``E[f²] − E[f]²``, cannot in float32.
    """
    f1, f2, f3, f4, f5, f6, f7, f8, f9, f10 = d
    v = var
    c = ops.const
    mean = f0 + v * (c(1 / 2) * f2 + v * (c(1 / 8) * f4 + v * (c(1 / 48) * f6 + v * (
        c(1 / 384) * f8 + v * c(1 / 3840) * f10))))
    c2 = f1 * f3 + c(1 / 2) * f2 * f2
    c3 = c(1 / 4) * f1 * f5 + c(1 / 2) * f2 * f4 + c(5 / 12) * f3 * f3
    c4 = c(1 / 24) * f1 * f7 + c(1 / 8) * f2 * f6 + c(7 / 24) * f3 * f5 + c(1 / 6) * f4 * f4
    c5 = (c(1 / 192) * f1 * f9 + c(1 / 48) * f2 * f8 + c(1 / 16) * f3 * f7 + c(5 / 48) * f4 * f6
          + c(21 / 320) * f5 * f5)
    out_var = v * (f1 * f1 + v * (c2 + v * (c3 + v * (c4 + v * c5))))
    return mean, ops.maximum(out_var, ops.const(0.0))


def hardtanh_moments(mean: Any, var: Any, lo: float, hi: float, ops: Any = NUMPY) -> tuple[Any, Any]:
    """Mean and variance of ``clip(a, lo, hi)`` for ``a ~ N(mean, var)`` (exact; ``lo < hi``).

    Hardtanh is ``(−1, 1)``, ReLU6 ``(0, 6)``; ``hi = inf`` gives ReLU (:func:`relu_moments`).
    In standard units ``za = (lo − μ)/σ``, ``zb = (hi − μ)/σ``, ``c = clip(Z, za, zb)``, with
    ``pa = Φ(za)``, ``pb = Φ(−zb)``, ``pm = 1 − pa − pb`` and the truncated-normal moments
    ``E[Z; za<Z<zb] = φ(za) − φ(zb)``, ``E[Z²; za<Z<zb] = pm + za·φ(za) − zb·φ(zb)``:

    * mean ``= k + σ·E[c − k]`` with ``k = clip(μ, lo, hi)`` (the deterministic value, so σ = 0 is
      exact at every scale), ``E[c − k] = (za−k')pa + (zb−k')pb + E[Z; mid] − k'·pm``,
      ``k' = (k − μ)/σ``;
    * variance ``= σ²·(B + W)`` by the law of total variance over the three parts (below, inside,
      above): ``B = pa·pb·(zb−za)² + pa·pm·(mT−za)² + pb·pm·(zb−mT)²`` (``mT`` the truncated
      mean) and the within part ``W = E[Z²; mid] − pm·mT²`` clamped to ``[0, pm·(zb−za)²/4]``.
      Every term is non-negative, so the variance is never negative and keeps its relative
      accuracy for μ inside, outside, and for an interval much narrower than σ.

    Source: the moments of a doubly truncated / censored normal (e.g. Johnson, Kotz & Balakrishnan,
    *Continuous Univariate Distributions* vol. 1, §10.1).  Measured (``benchmarks/
    activation_accuracy.py``, μ ∈ [−30, 30] × v ∈ [0, 1e3], 418 points, against quadrature):
    variance ≤ 1.5e-10 relative, mean ≤ 3.3e-12 output sd (float64); the float32 TE kernel is
    within 6e-8 (median) and 1.2e-3 (max, variances < 1e-20 in the far tails) of float64.
    """
    if not lo < hi:
        raise ValueError(f"moments.hardtanh_moments: needs lo < hi, got lo={lo}, hi={hi}")
    sigma = ops.sqrt(var)
    lo_c, hi_c = ops.const(lo), ops.const(hi)
    num_a, num_b = lo_c - mean, hi_c - mean  # (conditions on these, not on the clamped ratios)
    za = _share(_standard(num_a, sigma, ops), ops)
    zb = _share(_standard(num_b, sigma, ops), ops)
    zero, one = ops.const(0.0), ops.const(1.0)
    pa, _, ta, fa = _cdfs_tail_pdf(za, ops, negative=num_a < zero)  # Φ(za), Φ(−|za|), φ(za)
    _, qb, tb, fb = _cdfs_tail_pdf(zb, ops, negative=num_b < zero)  # Φ(−zb), Φ(−|zb|), φ(zb)
    # inside mass from the two tails that do not cancel: Φ(−za) − Φ(−zb) for μ < lo,
    # Φ(zb) − Φ(za) for μ > hi, 1 − Φ(za) − Φ(−zb) for μ inside (written with the bound tails:
    # nested selects in a reused value make TVM's simplifier slow)
    pm = _share(ops.maximum(ops.where(num_a > zero, ta - tb, ops.where(num_b < zero, tb - ta, one - ta - tb)),
                            zero), ops)
    # φ(za) − φ(zb) = φ(za)·(1 − e^{−(zb²−za²)/2}), factoring out the larger density: no
    # cancellation for an interval much narrower than σ
    half_gap = ops.const(0.5) * (zb - za) * (zb + za)  # (zb² − za²)/2
    d1 = _share(ops.where(half_gap > zero,
                          -fa * _expm1(-ops.maximum(half_gap, zero), ops),
                          fb * _expm1(ops.minimum(half_gap, zero), ops)), ops)
    k = ops.minimum(ops.maximum(mean, lo_c), hi_c)

    def combine(width: Any, pm: Any, centred: Any, within: Any, below: Any, above: Any) -> tuple[Any, Any]:
        """Mean and variance from the width ``zb − za``, the inside mass ``pm``, ``centred =
        E[Z − k'; mid]`` (``k' = (k − μ)/σ = za + k_off``), the within part, ``mT − za``, ``zb − mT``."""
        between = pa * qb * width * width + pa * pm * below * below + qb * pm * above * above
        shift = (width - k_off(width)) * qb - k_off(width) * pa + centred  # E[c − k'], c = clip(Z, za, zb)
        return k + sigma * shift, var * (between + within)

    def k_off(width: Any) -> Any:
        return ops.minimum(ops.maximum(-za, zero), width)

    # analytic truncated-normal moments (zb − za: consistent with the clamps of za, zb)
    width = zb - za
    t_mean = ops.minimum(ops.maximum(d1 / ops.where(pm > zero, pm, one), za), zb)  # (d1 = 0 where pm = 0)
    e2 = pm + za * fa - zb * fb
    within = ops.minimum(ops.maximum(e2 - d1 * t_mean, zero), ops.const(0.25) * pm * width * width)
    mean_a, var_a = combine(width, pm, d1 - (za + k_off(width)) * pm, within, t_mean - za, zb - t_mean)
    # An interval narrow on the scale of the density's variation (σ ≫ hi − lo): E[Z²; mid] − d1·mT
    # cancels there, so pm, mT and W come from 8-point Gauss–Legendre on the interval instead, in
    # the offsets x ∈ [−1, 1] from its centre c: pm = h·Σ w_i f_i, mT = c + h·x̄,
    # W = h³·Σ w_i (x_i − x̄)² f_i with f_i = φ(c + h·x_i).
    # (the width (hi − lo)/σ directly here: zb − za cancels when σ ≫ hi − lo)
    positive = sigma > zero
    width_n = _share(ops.minimum((hi_c - lo_c) / ops.where(positive, sigma, one), ops.const(2.0 * ALPHA_MAX)), ops)
    half_w = _share(ops.const(0.5) * width_n, ops)
    centre = _share(za + half_w, ops)
    narrow = _share(half_w * ops.maximum(one, _abs(centre, ops)), ops) < one
    hn = ops.minimum(half_w, one)  # (the narrow branch is only selected where h < 1)
    dens = [_phi(centre + hn * ops.const(x), ops) for x in _GL8_NODES]
    s0 = _share(sum((ops.const(w) * f for w, f in zip(_GL8_WEIGHTS, dens, strict=True)), zero), ops)
    s1 = _share(sum((ops.const(w * x) * f for w, x, f in zip(_GL8_WEIGHTS, _GL8_NODES, dens, strict=True)),
                    zero), ops)
    xbar = _share(s1 / ops.where(s0 > zero, s0, one), ops)
    # Σ w (x − x̄)² f = Σ w x² f − x̄·Σ w x f (the spread of x ∈ [−1, 1]: no cancellation)
    s2 = sum((ops.const(w * x * x) * f for w, x, f in zip(_GL8_WEIGHTS, _GL8_NODES, dens, strict=True)),
             zero) - xbar * s1
    pm_g = _share(hn * s0, ops)
    below_g = hn * (one + xbar)  # mT − za
    mean_g, var_g = combine(width_n, pm_g, pm_g * (below_g - k_off(width_n)), hn * hn * hn * s2, below_g,
                            hn * (one - xbar))
    return ops.where(narrow, mean_g, mean_a), ops.where(narrow, var_g, var_a)


def relu6_moments(mean: Any, var: Any, ops: Any = NUMPY) -> tuple[Any, Any]:
    """ReLU6 ``= clip(a, 0, 6)``: :func:`hardtanh_moments` with ``(lo, hi) = (0, 6)`` (exact)."""
    return hardtanh_moments(mean, var, 0.0, 6.0, ops)


def hardtanh_exact(x: Any, lo: float = -1.0, hi: float = 1.0, ops: Any = NUMPY) -> Any:
    """Deterministic ``clip(x, lo, hi)``."""
    return ops.minimum(ops.maximum(x, ops.const(lo)), ops.const(hi))


def _bvn_equal_excess(h: Any, var: Any, ops: Any) -> Any:
    """``Φ2(h, h; ρ) − Φ(h)²`` for ``ρ = v/(1+v)`` (``Var Φ(X)`` for ``X ~ N(μ, v)``, ``h = μ/√(1+v)``).

    Plackett's identity ``∂Φ2/∂ρ = φ2`` gives ``∫_0^ρ e^{−h²/(1+r)}/(2π√(1−r²)) dr``; with
    ``r = 2w/(1+w²)`` (so ``dr/√(1−r²) = 2dw/(1+w²)``, no endpoint singularity as ρ → 1) it is
    ``(1/π)∫_0^{w1} exp(−h²(1+w²)/(1+w)²)/(1+w²) dw``, ``w1 = v/(1 + v + √(1+2v))``, evaluated by
    20-point Gauss–Legendre (the integrand is smooth and monotone in ``w``).
    """
    w1 = var / (ops.const(1.0) + var + ops.sqrt(ops.const(1.0) + ops.const(2.0) * var))
    h2 = h * h
    total = ops.const(0.0)
    for x, wt in zip(_GL_NODES, _GL_WEIGHTS, strict=True):
        w = w1 * ops.const(x)
        q = (ops.const(1.0) + w * w)
        opw = ops.const(1.0) + w
        total = total + ops.const(wt) * ops.exp(-h2 * q / (opw * opw)) / q
    return ops.const(1.0 / math.pi) * w1 * total


_GELU_SMALL = 0.03  # the delta series where v·(1+μ²) < this (its error grows like (μ²v)⁵ in the tails)


def _gelu_deriv_polys(n: int) -> list[tuple[float, ...]]:
    """``GELU⁽ᵏ⁾(x) = φ(x)·G_k(x)``, ``k = 2 … n``: ``G_k = (−1)^k (k·He_{k−2} − x·He_{k−1})``."""
    he, pp = np.polynomial.hermite_e, np.polynomial.polynomial
    out = []
    for k in range(2, n + 1):
        g = pp.polysub(k * he.herme2poly(np.eye(k)[k - 2]), pp.polymulx(he.herme2poly(np.eye(k)[k - 1])))
        out.append(tuple(float(c) for c in (g * (-1) ** k)[::-1]))
    return out


_GELU_D = _gelu_deriv_polys(10)


def gelu_exact(x: Any, ops: Any = NUMPY) -> Any:
    """Deterministic GELU ``x·Φ(x)`` (exact erf form, as ``torch.nn.GELU()``)."""
    cdf, _ = _cdfs(x, ops)
    return x * cdf


def gelu_moments(mean: Any, var: Any, ops: Any = NUMPY) -> tuple[Any, Any]:
    """Mean and variance of ``GELU(a) = a·Φ(a)`` for ``a ~ N(mean, var)`` (exact up to quadrature).

    With ``s = √(1+v)``, ``h = μ/s`` (Stein's lemma and Gaussian products; arXiv 2403.16163,
    arXiv 2601.22307):

    * ``E[aΦ(a)] = μ·Φ(h) + (v/s)·φ(h)`` (exact);
    * ``E[a²Φ(a)²] = (μ²+v)·E[Φ²] + 4μv·E[Φφ] + 2v²·E[φ²] − 2v²·E[aΦφ]`` from
      ``E[a²g] = (μ²+v)E g + 2μv E g' + v² E g''`` with ``g = Φ²``, where
      ``E[Φ(a)²] = Φ2(h, h; v/(1+v))`` (bivariate normal CDF, :func:`_bvn_equal_excess`:
      20-point Gauss–Legendre, the only approximation), ``E[Φφ] = φ(h)/s·Φ(g)``,
      ``E[aΦφ] = φ(h)/s·(μ/(1+v)·Φ(g) + v/(1+v)/s_Y·φ(g))`` with ``g = h/√(1+2v)``,
      ``s_Y = √((1+2v)/(1+v))``, and ``E[φ²] = φ(μ/√(½+v))/(2√π·√(½+v))``.

    Numerics: the variance is evaluated at ``μ' = −|μ|`` (where ``E[a²Φ²] − E[aΦ]²`` does not
    cancel) and mapped back with ``GELU(a) = a + GELU(−a)``:
    ``Var(μ) = Var(−μ) + v·(1 − 2Φ(−μ/s)) + 2vμ·φ(μ/s)/(s(1+v))`` (Stein: ``Cov(a, f(−a)) =
    −v·E f'(−a)``).  The fifth-order delta series (:func:`_delta_series`) is used
    instead where ``v·(1+μ²) < 0.03`` (the Gaussian tail makes ``μ²v`` its expansion parameter):
    exact at ``v = 0`` and relatively accurate for tiny ``v`` in float32 too.  Tail terms are clamped
    at ``|h| = 40`` (beyond, they are 0 in float64), so huge means stay finite; for ``v > 1e12``
    the ReLU moments are returned (``0 ≤ ReLU − GELU ≤ 0.17``: relative effect < 1e-6; ``v²``
    would overflow float32).
    Measured (``benchmarks/activation_accuracy.py``, μ ∈ [−30, 30] × v ∈ [0, 1e3], against
    quadrature): variance ≤ 3.6e-6 relative (the largest in the far left tail, where the
    Gauss–Legendre rule for Φ2 is least accurate; median 1e-15), mean ≤ 1.4e-9 output sd; the
    float32 TE kernel is within 1.4e-7 (median) and 9e-4 (max, far-tail variances < 1e-7).
    """
    zero, one = ops.const(0.0), ops.const(1.0)
    xc = _share(_clamp(mean, -ALPHA_MAX, ALPHA_MAX, ops), ops)
    small = var * (one + xc * xc) < ops.const(_GELU_SMALL)

    # --- delta series (v·(1+μ²) < 0.03) at μ
    pdf = _share(_phi(xc, ops), ops)
    cdf, _ = _cdfs(mean, ops)
    d = [cdf + xc * pdf] + [pdf * _horner(xc, c, ops) for c in _GELU_D]
    d_mean, d_var = _delta_series(mean * cdf, d, ops.minimum(var, ops.const(_GELU_SMALL)), ops)

    # --- closed form at a = −|μ|
    v = ops.minimum(var, ops.const(_HUGE_VAR))
    s2 = one + v
    s = _share(ops.sqrt(s2), ops)
    h = _share(ops.maximum(-_abs(mean, ops) / s, ops.const(-ALPHA_MAX)), ops)  # ≤ 0
    a = h * s
    ph = _share(_upper_tail(-h, ops), ops)  # Φ(h), h ≤ 0
    qh = one - ph
    fh = _share(_phi(h, ops), ops)
    m_a = _share(a * ph + v / s * fh, ops)
    g = h / ops.sqrt(one + ops.const(2.0) * v)
    pg = _upper_tail(-g, ops)  # Φ(g), g ≤ 0
    fg = _phi(g, ops)
    n1 = fh / s  # N(a; 0, 1+v)
    e_cdf2 = ph * ph + _bvn_equal_excess(h, v, ops)
    e_cdf_pdf = n1 * pg
    half = ops.const(0.5) + v
    e_pdf2 = _normal_pdf(a, half, ops) * ops.const(0.5 / _SQRT_PI)
    s_y = ops.sqrt((one + ops.const(2.0) * v) / s2)
    e_x_cdf_pdf = n1 * (a / s2 * pg + v / s2 / s_y * fg)
    second = ((a * a + v) * e_cdf2 + ops.const(4.0) * a * v * e_cdf_pdf
              + ops.const(2.0) * v * v * (e_pdf2 - e_x_cdf_pdf))
    var_a = ops.maximum(second - m_a * m_a, zero)
    positive = mean > zero
    c_mean = ops.where(positive, mean + m_a, m_a)
    reflect = v * (qh - ph) - ops.const(2.0) * v * a * fh / (s * s2)
    c_var = ops.where(positive, var_a + reflect, var_a)
    r_mean, r_var = relu_moments(mean, var, ops)
    huge = var > ops.const(_HUGE_VAR)
    out_mean = ops.where(small, d_mean, ops.where(huge, r_mean, c_mean))
    out_var = ops.where(small, d_var, ops.where(huge, r_var, c_var))
    return out_mean, ops.maximum(out_var, zero)


# ---------------------------------------------------------------------------------------------
# The logistic family (sigmoid, tanh, SiLU, softplus): one quadrature engine
# ---------------------------------------------------------------------------------------------

def _sigmoid_deriv_polys(n: int) -> list[tuple[float, ...]]:
    """``σ⁽ᵏ⁾ = P_k(σ)·σ(1−σ)``: the polynomials ``P_1 … P_n`` in ``s = σ``, highest degree first."""
    P = np.polynomial.polynomial
    d = np.array([0.0, 1.0, -1.0])  # s − s² = σ'
    polys, p = [], np.array([1.0])
    for _ in range(n):
        polys.append(tuple(float(c) for c in p[::-1]))
        p = P.polyadd(P.polymul(P.polyder(p), d), P.polymul(p, np.array([1.0, -2.0])))  # (P·D)'/D
    return polys


_SIG_P = _sigmoid_deriv_polys(10)
_GH_T, _GH_W = np.polynomial.hermite.hermgauss(16)
_GH_NODES = tuple(float(t) * math.sqrt(2.0) for t in _GH_T)  # E f(b + σZ) ≈ Σ W_i f(b + σ·x_i)
_GH_WEIGHTS = tuple(float(w) / _SQRT_PI for w in _GH_W)
_LAG_SCALE = 2.0  # Laguerre variable u = 2y: the nodes resolve the logistic tails e^{−y}, e^{−2y}
_LAG_U, _LAG_W = np.polynomial.laguerre.laggauss(16)
_LAG_NODES = tuple(float(u) / _LAG_SCALE for u in _LAG_U)  # ∫_0^∞ g(y) dy ≈ Σ W̃_j g(y_j)
_LAG_WEIGHTS = tuple(float(w * math.exp(u)) / _LAG_SCALE for u, w in zip(_LAG_U, _LAG_W, strict=True))
_GH_MAX_SIGMA = 1.1  # Gauss–Hermite for σ < 1.1, the split Laguerre rule beyond (both ~1e-7 there)


_LOG1P_TERMS = tuple(1.0 / (2 * k + 1) for k in range(16, -1, -1))  # Σ_k s^{2k}/(2k+1), k ≤ 16


def _log1p_ratio(e: Any, ops: Any) -> Any:
    """``log(1+e)/e`` for ``0 ≤ e ≤ 1`` (→ 1 as e → 0), with no ``log`` primitive.

    ``log(1+e) = 2·atanh(s)``, ``s = e/(2+e) ≤ 1/3``, so ``log(1+e)/e = 2/(2+e)·Σ_k s^{2k}/(2k+1)``
    (17 terms: error < 1e-17).  No cancellation for small ``e``, unlike ``log(w)·e/(w−1)``
    with ``w = 1+e`` (Goldberg), whose exact ``w − 1`` TVM's simplifier folds back to ``e``.
    """
    two = ops.const(2.0)
    inv = ops.const(1.0) / (two + e)
    s = e * inv
    return two * inv * _horner(s * s, _LOG1P_TERMS, ops)


class _Node:
    """A fixed Laguerre node ``y ≥ 0`` with ``σ(±y)``, ``e = e^{−y}``, ``log(1+e)/e`` and
    ``ℓ = log(1 + e^{−y})`` (softplus(−y)), folded to constants."""

    def __init__(self, y: float, ops: Any) -> None:
        e = math.exp(-y)
        self.y, self.e = ops.const(y), ops.const(e)
        self.sp, self.sm = ops.const(1.0 / (1.0 + e)), ops.const(e / (1.0 + e))
        self.ratio, self.lg = ops.const(math.log1p(e) / e), ops.const(math.log1p(e))


class _Integrand:
    """``h(y)`` for :func:`_laguerre_split`: ``h → c0 + c1·y + c2·y²`` as ``y → −∞`` (``poly``),
    ``h → 0`` as ``y → +∞``; at nodes ``y ≥ 0`` ``right`` gives ``h(y)`` and ``left`` gives
    ``h(−y) − poly(−y)`` (both decay exponentially; written without cancellation)."""

    def __init__(self, poly: tuple[float, float, float], right: Any, left: Any) -> None:
        self.poly, self.right, self.left = poly, right, left


# σ(−y)^k, y^j·σ(−y)^k (the sigmoid and SiLU tilted tails), q(y) = softplus(y)·e^{−y} and its square
# (the tilted softplus tails) and softplus(−y), softplus(−y)² (the untilted softplus integrals).
_S1 = _Integrand((1.0, 0.0, 0.0), lambda n, o: n.sm, lambda n, o: -n.sm)
_S2 = _Integrand((1.0, 0.0, 0.0), lambda n, o: n.sm * n.sm, lambda n, o: -n.sm * (o.const(1.0) + n.sp))
_YS1 = _Integrand((0.0, 1.0, 0.0), lambda n, o: n.y * n.sm, lambda n, o: n.y * n.sm)
_YS2 = _Integrand((0.0, 1.0, 0.0), lambda n, o: n.y * n.sm * n.sm,
                  lambda n, o: n.y * n.sm * (o.const(1.0) + n.sp))
_Y2S2 = _Integrand((0.0, 0.0, 1.0), lambda n, o: n.y * n.y * n.sm * n.sm,
                   lambda n, o: -n.y * n.y * n.sm * (o.const(1.0) + n.sp))
_Q1 = _Integrand((1.0, 0.0, 0.0), lambda n, o: (n.y + n.lg) * n.e, lambda n, o: n.ratio - o.const(1.0))
_Q2 = _Integrand((1.0, 0.0, 0.0), lambda n, o: (n.y + n.lg) * n.e * (n.y + n.lg) * n.e,
                 lambda n, o: (n.ratio - o.const(1.0)) * (n.ratio + o.const(1.0)))
_SPM1 = _Integrand((0.0, -1.0, 0.0), lambda n, o: n.lg, lambda n, o: n.lg)
_SPM2 = _Integrand((0.0, 0.0, 1.0), lambda n, o: n.lg * n.lg, lambda n, o: (o.const(2.0) * n.y + n.lg) * n.lg)


def _laguerre_split(b: Any, var: Any, sigma: Any, integrands: list[_Integrand], ops: Any) -> list[Any]:
    """``E[h(Y)]``, ``Y ~ N(b, var)``, for each integrand, for σ ≳ 1 (see :func:`_gh_nodes` below it).

    When σ is large, ``h`` is a near step on the scale of σ, which defeats Gauss–Hermite (16 nodes
    give 4-14 % errors at v = 100).  ``h`` is split into its polynomial limit on ``y < 0`` (exact
    truncated-normal moments ``E[Y^j; Y<0]``) plus two exponentially decaying remainders,
    integrated over ``y ≥ 0`` by 16-node Gauss–Laguerre in ``u = 2y`` against the Gaussian weights
    ``N(±y; b, v)``.  Accurate when the remainders decay faster than the Gaussian grows
    (``|b| < k·v`` for a ``σ^k``-type tail), which the callers' exponential tilt (:func:`_tilts`)
    guarantees.  The node functions are constants; each node costs two ``exp``.
    """
    m = _share(b / sigma, ops)  # (σ > 0 here)
    p_neg, _ = _cdfs(-m, ops, negative=b > ops.const(0.0))  # P(Y < 0)
    pdf_m = _phi(m, ops)
    e1 = b * p_neg - sigma * pdf_m  # E[Y; Y<0]
    e2 = (b * b + var) * p_neg - b * sigma * pdf_m  # E[Y²; Y<0]
    sums = []
    for h in integrands:  # the polynomial limit on y < 0 (zero coefficients skipped: b² may be inf)
        terms = [ops.const(c) * t for c, t in zip(h.poly, (p_neg, e1, e2), strict=True) if c != 0.0]
        sums.append(sum(terms[1:], terms[0]))
    inv_two_var = _share(ops.const(0.5) / ops.maximum(var, ops.const(_TINY)), ops)
    norm = _share(ops.const(_INV_SQRT_2PI) / ops.maximum(sigma, ops.const(_TINY)), ops)
    cap = ops.const(2000.0)
    for y, w in zip(_LAG_NODES, _LAG_WEIGHTS, strict=True):
        node = _Node(y, ops)
        up = _share(ops.exp(-ops.minimum((node.y - b) * (node.y - b) * inv_two_var, cap)) * norm, ops)
        down = _share(ops.exp(-ops.minimum((node.y + b) * (node.y + b) * inv_two_var, cap)) * norm, ops)
        sums = [acc + ops.const(w) * (h.right(node, ops) * up + h.left(node, ops) * down)
                for acc, h in zip(sums, integrands, strict=True)]
    return sums


def _gh_nodes(a: Any, sigma: Any, ops: Any) -> list[tuple[float, Any]]:
    """16-node Gauss–Hermite nodes ``(weight, a + σ·x_i)`` for ``E f(X)``, ``X ~ N(a, σ²)``.

    Used for σ < 1.1: the logistic-family functions are analytic with singularities at distance π
    from the real axis, so the rule converges fast while σ is small, and the Gaussian weight makes
    the far tails (``f ≈ e^x``) relatively accurate without tilting.  Variances are summed about
    ``f(a)`` (:func:`_gh_mean_var`), so they keep their relative accuracy for small σ.
    """
    return [(w, _share(a + sigma * ops.const(x), ops)) for x, w in zip(_GH_NODES, _GH_WEIGHTS, strict=True)]


def _gh_mean_var(vals: list[tuple[float, Any]], ref: Any, ops: Any) -> tuple[Any, Any]:
    """``(Σ w f, Σ w (f − m)²)`` from node values, summed about a reference ``ref`` near the mean
    (``f(a)``): ``d = f − ref``, mean ``ref + Σ w d``, variance ``Σ w d² − (Σ w d)²``, which does
    not cancel (``(m − ref)² = O(v²)``) and keeps each node value used once (a centring on the
    sum itself would put the whole sum into every term of the TE expression)."""
    zero = ops.const(0.0)
    devs = [(w, _share(f - ref, ops)) for w, f in vals]
    s1 = _share(sum((ops.const(w) * d for w, d in devs), zero), ops)
    s2 = sum((ops.const(w) * d * d for w, d in devs), zero)
    return ref + s1, ops.maximum(s2 - s1 * s1, zero)


def _logistic(x: Any, ops: Any) -> Any:
    """``σ(x) = 1/(1 + e^{−x})`` with ``e^{−x}`` capped at ``e^{700}`` (no overflow; σ < 1e-304 there)."""
    one = ops.const(1.0)
    return one / (one + ops.exp(ops.minimum(-x, ops.const(700.0))))


def _sigmoid_derivs(x: Any, ops: Any) -> tuple[Any, Any, list[Any]]:
    """``σ(x)``, ``σ(−x)`` and ``[σ', …, σ⁽¹⁰⁾](x)``, each relatively accurate in both tails
    (``P_k(s)`` evaluated at ``min(σ(x), σ(−x))`` with the parity ``P_k(s) = (−1)^{k+1} P_k(1−s)``)."""
    one = ops.const(1.0)
    e = _share(ops.exp(-_abs(x, ops)), ops)
    inv = _share(one / (one + e), ops)
    small = _share(e * inv, ops)  # σ(−|x|) ≤ ½
    neg = x < ops.const(0.0)
    s, sm = ops.where(neg, small, inv), ops.where(neg, inv, small)
    dens = _share(small * inv, ops)  # σ(x)σ(−x)
    derivs = []
    for k, poly in enumerate(_SIG_P, start=1):
        pk = _horner(small, poly, ops)
        derivs.append(dens * (pk if k % 2 == 1 else ops.where(neg, pk, -pk)))
    return _share(s, ops), _share(sm, ops), derivs


def _tilts(a: Any, var: Any, ops: Any) -> tuple[Any, Any, Any, Any, Any, Any]:
    """For ``a ≤ 0``: the tilt decisions, Laguerre means and prefactors for ``σ(X)`` and ``σ(X)²``.

    ``E[e^{kX} g(X)] = e^{ka + k²v/2}·E[g(Y)]``, ``Y ~ N(a + kv, v)`` (exponential tilting).
    Since ``σ(x) = e^{x}σ(−x)``, a left tail of ``σ^k`` becomes an integrand near 1 at the mean
    ``a + kv``: used where ``a < −kv/2``, so every split-rule mean lies in ``(−∞, kv/2]`` and the
    exponentially small results keep their *relative* accuracy.  Untilted, the split rule runs
    at ``b = −a`` on the reflected integrand.
    """
    half = ops.const(0.5)
    t1 = a < -half * var
    t2 = a < -var
    b1 = _share(ops.where(t1, a + var, -a), ops)
    b2 = _share(ops.where(t2, a + ops.const(2.0) * var, -a), ops)
    zero = ops.const(0.0)
    pre1 = ops.where(t1, ops.exp(ops.minimum(a + half * var, zero)), ops.const(1.0))
    pre2 = ops.where(t2, ops.exp(ops.minimum(ops.const(2.0) * (a + var), zero)), ops.const(1.0))
    return t1, t2, b1, b2, _share(pre1, ops), _share(pre2, ops)


def sigmoid_exact(x: Any, ops: Any = NUMPY) -> Any:
    """Deterministic logistic ``σ(x) = 1/(1 + e^{−x})`` (relatively accurate in both tails)."""
    one = ops.const(1.0)
    e = _share(ops.exp(-_abs(x, ops)), ops)
    inv = one / (one + e)
    return ops.where(x < ops.const(0.0), e * inv, inv)


_A_CLAMP = 1000.0  # |μ| beyond which the logistic-family rules use their limits (_far_corrections)


# ---------------------------------------------------------------------------------------------
# Beyond the clamp (|μ| > _A_CLAMP): the limit of the activation plus the density expansion
# ---------------------------------------------------------------------------------------------
#
# The rules above evaluate the quadrature at a' = −|μ| clamped to ≥ −1000 (their tilts and nodes assume a
# bounded a').  That is exact only while the Gaussian has no mass near 0, i.e. |μ|/σ ≳ 38: with σ of the
# order of |μ| (μ = −1e4, v = 1e12) the clamped answer was wrong, and its μ-derivative (the Stein slope of
# correlation/stein.py) exactly 0 instead of ≈ Φ(μ/σ).  Beyond the clamp the rules use instead the limit of
# the activation, which is accurate there because f differs from it only within |x| ≲ 40 of 0, plus
# the correction from that difference:
#
# write f = f_L + r with f_L the limit (sigmoid → Heaviside H, tanh → sign via the sigmoid, SiLU and
# softplus → ReLU), r = f − f_L (|r| ≤ (1+|x|)·e^{−|x|}) and q = f² − f_L² = 2·f_L·r + r² (as fast).
# For X ~ N(μ, v) with density n(x) = c·e^{kx − x²/(2v)}, c = n(0) = φ(α)/σ, α = μ/σ, k = μ/v = α/σ,
# Taylor's expansion of n about 0 gives
#
#     E g(X) = c·Σ_j h_j·G_j/j!,   G_j = ∫ x^j g(x) dx,   h_0 = 1, h_1 = k, h_{j+1} = k·h_j − (j/v)·h_{j−1}
#
# (h_j = n⁽ʲ⁾(0)/n(0), the Hermite polynomials of the Gaussian), and then
# E f = E f_L + E r,  Var f = Var f_L + E q − 2·E f_L·E r − (E r)².
# The first term is the leading correction, e.g. E SiLU(X) ≈ E ReLU(X) − (π²/6)·φ(α)/σ
# (∫ (SiLU − ReLU) dx = −π²/6), E σ(X) ≈ Φ(α) − (π²/6)·c·k (r odd: G_0 = 0).  Where the rule is used
# (|μ| > 1000), c > 0 in float64 needs |α| < 38, so σ > 26 and the terms fall like |k|^j with
# |k| = |α|/σ < 1.5.  The moments G_j (y = |x|, η the Dirichlet eta function, ∫_0^∞ y^n σ(−y) dy =
# n!·η(n+1), ∫_0^∞ y^n σ'(y) dy = n!·η(n) for n ≥ 1 (by parts), ∫_0^∞ y^n log(1 + e^{−y}) dy = n!·η(n+2)):
#
# * sigmoid (r = σ(x) − H(x), odd): R_j = −2·j!·η(j+1) (j odd; R_1 = −π²/6), 0 (j even);
#   q = σ² − H: Q_0 = −1, Q_j = −2·j!·η(j) (j ≥ 2 even), −2·j!·η(j+1) (j odd);
# * SiLU (r = −|x|·σ(−|x|), even): R_j = −2·(j+1)!·η(j+2) (j even; R_0 = −π²/6), 0 (j odd);
#   Q_j = −2·(j+2)!·η(j+2) (j even; Q_0 = −π²/3), −2·(j+2)!·η(j+3) (j odd);
# * softplus (r = log(1 + e^{−|x|}), even): R_j = 2·j!·η(j+2) (j even; R_0 = π²/6), 0 (j odd);
#   Q_j = 2·(j+1)!·η(j+3) + 2·L_j (j even; Q_0 = 2ζ(3)), 2·(j+1)!·η(j+3) (j odd), with
#   L_j = ∫_0^∞ y^j·log²(1 + e^{−y}) dy (mpmath, 30 digits; L_0 = ζ(3)/4).
#
# (tests/test_activation_moments.py checks each G_j against quadrature of its definition.)  Truncated
# after j = _FAR_TERMS = 6 the error is that of the next terms, c·O(|k|⁷ + |k|⁵/v) (the limit moments
# themselves are exact).  Measured against quadrature (μ = ±1000…±1e6, σ = 1e-2…1e2·|μ|):
# means within 2e-13 output sd (the rounding of μ), variances within 5e-8 relative (the largest at
# |k| ≈ 0.1: μ = −1000, σ = 100 or μ = −1e4, σ = 300, far-side variances 7e-24 and 6e-244); for |k| ≥ 1
# (μ = −1000, σ ≤ 30: the series' radius, e^{kx} against r's e^{−|x|}) it diverges, but the far-side
# moments there are below c < e^{−|μ|/2} ≈ 1e-217 and their absolute error is of that order (< 1e-215).

_FAR_TERMS = 6
# the ReLU moments of the SiLU and softplus far rules (_relu_tail) by its closed forms alone, without the
# continued fraction ELU uses beyond |α| = 3.5: relatively accurate enough here (1e-10 in float64, 2e-3 in
# float32 where φ(α) is representable), and the SiLU Stein kernel compiles in ~1.6 s instead of ~1.9 s
# (~1.35 s before the far rule; 2 shared cores, noisy)
_FAR_CF_SWITCH, _FAR_CF_DEPTH = ALPHA_MAX, 0


def _eta(s: int) -> float:
    """Dirichlet's ``η(s) = Σ_{n≥1} (−1)^{n+1}/n^s = (1 − 2^{1−s})·ζ(s)`` (``η(1) = log 2``)."""
    return math.log(2.0) if s == 1 else (1.0 - 2.0 ** (1 - s)) * float(scipy.special.zeta(s))


_SOFTPLUS_L = (0.30051422578989857135, 0.0, 0.19574558819987625344, 0.0, 0.66798401988988460988, 0.0,
               5.3298899845735854164)  # L_j = ∫_0^∞ y^j·log²(1 + e^{−y}) dy (j even)


def _far_constants(kind: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(R_j/j!, Q_j/j!)``, ``j = 0 … _FAR_TERMS``, of ``r = f − f_L`` and ``q = f² − f_L²`` (see above)."""
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
    """``(E r(X), E q(X))`` for ``X ~ N(μ, var)`` by the density expansion above, from ``α = μ/σ``
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
    moments ``Φ(α)``, ``Φ(α)·Φ(−α)`` (``α = a/σ``, tail-accurate) and the corrections above."""
    sigma = _share(ops.sqrt(var), ops)
    alpha = _share(ops.maximum(a / sigma, ops.const(-ALPHA_MAX)), ops)
    cdf, pdf = _upper_tail_and_pdf(-alpha, ops)  # Φ(α), φ(α)
    cdf = _share(cdf, ops)
    e_r, e_q = _far_corrections(alpha, pdf, sigma, var, _FAR_SIGMOID, ops)
    return _far_moments(cdf, cdf * (ops.const(1.0) - cdf), e_r, e_q, ops)


def _sigmoid_closed(a: Any, var: Any, ops: Any) -> tuple[Any, Any]:
    """``(E σ(X), Var σ(X))`` for ``X ~ N(a, v)``, ``a ≤ 0``, ``v ≥ 0.05``."""
    sigma = _share(ops.sqrt(var), ops)
    zero = ops.const(0.0)
    # Gauss–Hermite (σ < 1.1)
    vals = [(w, _logistic(x, ops)) for w, x in _gh_nodes(a, sigma, ops)]
    m_gh, v_gh = _gh_mean_var(vals, _logistic(a, ops), ops)
    # tilted split rule (σ ≥ 1.1)
    t1, t2, b1, b2, pre1, pre2 = _tilts(a, var, ops)
    (e1,) = _laguerre_split(b1, var, sigma, [_S1], ops)
    (e2,) = _laguerre_split(b2, var, sigma, [_S2], ops)
    m_lag = _share(pre1 * e1, ops)
    v_lag = ops.maximum(pre2 * e2 - m_lag * m_lag, zero)
    use_gh = sigma < ops.const(_GH_MAX_SIGMA)
    return ops.where(use_gh, m_gh, m_lag), ops.where(use_gh, v_gh, v_lag)


def _sigmoid_clamped(a: Any, var: Any, ops: Any) -> tuple[Any, Any]:
    """``(E σ(X), Var σ(X))`` for ``X ~ N(a, v)``, ``a ≤ 0``, ``v ≥ 0.05``: :func:`_sigmoid_closed` where
    ``a ≥ −_A_CLAMP``, the Heaviside limit with its corrections (:func:`_sigmoid_far`) beyond."""
    a = _share(a, ops)
    m1, c_var = _sigmoid_closed(ops.maximum(a, ops.const(-_A_CLAMP)), var, ops)
    f_mean, f_var = _sigmoid_far(a, var, ops)
    far = a < ops.const(-_A_CLAMP)
    return ops.where(far, f_mean, m1), ops.where(far, f_var, c_var)


def sigmoid_moments(mean: Any, var: Any, ops: Any = NUMPY) -> tuple[Any, Any]:
    """Mean and variance of the logistic ``σ(a)`` for ``a ~ N(mean, var)`` (numerical quadrature).

    Not the probit approximation ``E σ ≈ σ(μ/√(1+πv/8))`` (MacKay 1992; Murphy eq. 8.68): its
    errors are unbounded in relative terms in the tails (×250 at μ = −20, v = 4) and its
    bivariate-normal variance ``Φ2(h,h;ρ) − Φ(h)²`` misses the logistic's exponential tails
    (99 % low for small v in the tails).  Here, with ``a' = −|μ|`` (``σ(−x) = 1 − σ(x)``):

    * ``v < 0.05``: the fifth-order delta series (:func:`_delta_series`; derivatives
      ``σ⁽ᵏ⁾ = P_k(σ)·σ(1−σ)``) — exact at ``v = 0``, relatively accurate for tiny ``v``;
    * ``σ < 1.1``: 16-node Gauss–Hermite at ``a'`` (:func:`_gh_nodes`);
    * otherwise ``E σ(X)`` and ``E σ(X)²`` from the split Laguerre rule (:func:`_laguerre_split`)
      after exponential tilting (:func:`_tilts`), which keeps the tails relatively accurate;
    * ``|μ| > 1000`` (``_A_CLAMP``, where those rules would need ``a'`` clamped): the Heaviside limit
      ``Φ(α)``, ``Φ(α)·Φ(−α)`` (``α = μ/σ``) plus the density-expansion correction
      (:func:`_far_corrections`; leading term ``−(π²/6)·φ(α)·μ/σ³`` in the mean), within 5e-8 relative of
      quadrature for any σ (absolutely below 1e-215 where ``|μ|/v ≥ 1``, see the comment there).

    Measured (``benchmarks/activation_accuracy.py``, μ ∈ [−30, 30] × v ∈ [0, 1e3], 418 points,
    against adaptive quadrature): variance ≤ 9.5e-7 relative, mean ≤ 1.1e-6 output sd; the
    probit rule on the same grid: variance up to 100 % off (median 8.8 %; 92 % within |μ| ≤ 5),
    mean up to 0.016 absolute; 16-node Gauss–Hermite for v ≥ 10: variance up to 53 % off, mean
    0.2 sd.  The float32 TE kernel is within 2.5e-6 (variance) of the float64 rule.
    """
    zero = ops.const(0.0)
    small = var < ops.const(_SMALL_VAR)
    s, _, d = _sigmoid_derivs(mean, ops)
    d_mean, d_var = _delta_series(s, d, ops.minimum(var, ops.const(_SMALL_VAR)), ops)
    m1, c_var = _sigmoid_clamped(-_abs(mean, ops), ops.maximum(var, ops.const(_SMALL_VAR)), ops)
    c_mean = ops.where(mean > zero, ops.const(1.0) - m1, m1)
    return ops.where(small, d_mean, c_mean), ops.where(small, d_var, c_var)


def _tanh(x: Any, ops: Any) -> Any:
    """``tanh(x) = sign(x)·(1 − e^{−2|x|})/(1 + e^{−2|x|})`` with ``expm1``: relatively accurate near 0."""
    t = ops.const(-2.0) * _abs(x, ops)
    r = -_expm1(t, ops) / (ops.const(1.0) + ops.exp(t))
    return ops.where(x < ops.const(0.0), -r, r)


def tanh_exact(x: Any, ops: Any = NUMPY) -> Any:
    """Deterministic ``tanh(x)``."""
    return _tanh(x, ops)


def tanh_moments(mean: Any, var: Any, ops: Any = NUMPY) -> tuple[Any, Any]:
    """Mean and variance of ``tanh(a)`` for ``a ~ N(mean, var)``: ``tanh(x) = 2σ(2x) − 1``.

    The sigmoid rule (:func:`sigmoid_moments`) at ``(2μ, 4v)``: mean ``2·E σ − 1``, variance
    ``4·Var σ``; for ``4v < 0.05`` the delta series with ``tanh⁽ⁿ⁾(x) = 2ⁿ⁺¹σ⁽ⁿ⁾(2x)`` around the
    exact ``tanh(μ)`` (so ``v = 0`` gives :func:`tanh_exact` to the last bit); for ``|μ| > 500`` the
    sigmoid's far rule (the sign function's moments ``2Φ(α) − 1``, ``4Φ(α)Φ(−α)`` plus the correction,
    :func:`_sigmoid_clamped`).  Measured
    (``benchmarks/activation_accuracy.py``): variance ≤ 1.4e-6 relative, mean ≤ 1.1e-6 output sd
    (float64); float32 TE within 2.7e-6 (variance) of float64.
    """
    zero, two = ops.const(0.0), ops.const(2.0)
    v4 = ops.const(4.0) * var
    small = v4 < ops.const(_SMALL_VAR)
    _, _, d = _sigmoid_derivs(two * mean, ops)
    d = [ops.const(2.0 ** (k + 1)) * dk for k, dk in enumerate(d, start=1)]
    d_mean, d_var = _delta_series(_tanh(mean, ops), d, ops.minimum(var, ops.const(_SMALL_VAR / 4.0)), ops)
    m1, c_var = _sigmoid_clamped(ops.const(-2.0) * _abs(mean, ops), ops.maximum(v4, ops.const(_SMALL_VAR)), ops)
    c_mean = ops.const(1.0) - two * m1
    c_mean = ops.where(mean < zero, -c_mean, c_mean)
    return ops.where(small, d_mean, c_mean), ops.where(small, d_var, ops.const(4.0) * c_var)


def silu_exact(x: Any, ops: Any = NUMPY) -> Any:
    """Deterministic SiLU / Swish ``x·σ(x)``."""
    return x * sigmoid_exact(x, ops)


def _reflected(mean: Any, var: Any, v: Any, sigma: Any, gh: tuple[Any, Any, Any], lag: tuple[Any, Any, Any],
               small: Any, d_mean: Any, d_var: Any, far: tuple[tuple[float, ...], tuple[float, ...]], ops: Any
               ) -> tuple[Any, Any]:
    """The common end of the ReLU-like rules (SiLU, softplus), ``f(x) = relu(x) + g(−|x|)``-style: pick the
    Gauss–Hermite (``σ < _GH_MAX_SIGMA``) or Laguerre result ``(m, v, s)`` of the reflected part (``s`` the
    covariance weight), reflect it for ``μ > 0`` (``c_var = var_a + v·(1 − 2s)``), and select the delta series
    (``small``), the far rule (``|μ| > _A_CLAMP``: ReLU moments and the corrections ``far`` of
    :func:`_far_corrections`) or the ReLU moments (``var > _HUGE_VAR``) where those apply."""
    zero, one = ops.const(0.0), ops.const(1.0)
    use_gh = sigma < ops.const(_GH_MAX_SIGMA)
    m_a = _share(ops.where(use_gh, gh[0], lag[0]), ops)
    var_a = ops.where(use_gh, gh[1], lag[1])
    s_a = ops.where(use_gh, gh[2], lag[2])
    positive = mean > zero
    c_mean = ops.where(positive, mean + m_a, m_a)
    c_var = ops.where(positive, var_a + v * (one - ops.const(2.0) * s_a), var_a)
    r_mean, r_var = relu_moments(mean, var, ops)
    # beyond the clamp (var ≥ 0.05 where selected): the ReLU moments, relatively accurate in both tails
    # in float32 too (relu_moments is not for μ/σ ≪ 0), and the corrections
    vf = _share(ops.maximum(var, ops.const(_SMALL_VAR)), ops)
    sf = _share(ops.sqrt(vf), ops)
    alpha = _share(_standard(mean, sf, ops), ops)
    l_mean, l_var, pdf = _relu_tail(mean, vf, sf, alpha, ops, _FAR_CF_SWITCH, _FAR_CF_DEPTH, tail_from_mills=True)
    e_r, e_q = _far_corrections(alpha, pdf, sf, vf, far, ops)
    f_mean, f_var = _far_moments(_share(l_mean, ops), l_var, e_r, e_q, ops)
    beyond = -_abs(mean, ops) < ops.const(-_A_CLAMP)
    huge = var > ops.const(_HUGE_VAR)
    out_mean = ops.where(small, d_mean, ops.where(beyond, f_mean, ops.where(huge, r_mean, c_mean)))
    out_var = ops.where(small, d_var, ops.where(beyond, f_var, ops.where(huge, r_var, c_var)))
    return out_mean, ops.maximum(out_var, zero)


def silu_moments(mean: Any, var: Any, ops: Any = NUMPY) -> tuple[Any, Any]:
    """Mean and variance of ``SiLU(a) = a·σ(a)`` for ``a ~ N(mean, var)`` (numerical quadrature).

    The true logistic SiLU, not ``a·Φ(√(π/8)·a)`` (the GELU rule on a scaled input): that probit
    surrogate differs from SiLU by up to 0.054 at ``|x| ≈ 3.3`` and by 66 % (relative) at
    ``x = −4``, so it is not even exact at ``v = 0``; its moment errors are in the benchmark's
    baseline rows.  With ``a' = −|μ|`` and ``X' ~ N(a', v)``:

    * ``v < 0.05``: delta series with ``f⁽ⁿ⁾ = x·σ⁽ⁿ⁾ + n·σ⁽ⁿ⁻¹⁾``;
    * otherwise ``E f(X')``, ``Var f(X')`` and ``E f'(X')`` (``f' = σ + x·σ·σ(−·)``) by
      Gauss–Hermite (σ < 1.1) or the tilted split Laguerre rule (``x·σ(x) = x·e^{x}σ(−x)``),
      mapped back to μ with ``SiLU(x) = x + SiLU(−x)``: mean ``μ + E f(X')``, variance
      ``Var f(X') + v·(1 − 2·E f'(X'))`` (Stein's lemma ``Cov(X, g(X)) = v·E g'(X)``).
    * ``v > 1e12`` (``|μ| ≤ 1000``): ReLU moments (``|SiLU − ReLU| ≤ 0.28``, relative effect < 1e-6);
    * ``|μ| > 1000`` (any ``v ≥ 0.05``): ReLU moments (:func:`_relu_tail`, relatively accurate in both
      tails) plus the density-expansion correction (:func:`_far_corrections`; leading term
      ``E SiLU ≈ E ReLU − (π²/6)·φ(α)/σ``), within 5e-8 relative of quadrature for any σ (absolutely
      below 1e-215 where ``|μ|/v ≥ 1``).

    Measured (``benchmarks/activation_accuracy.py``, μ ∈ [−30, 30] × v ∈ [0, 1e3]): variance
    ≤ 1.0e-5 relative (just below the delta-series switch v = 0.05 near SiLU's minimum x ≈ −1.28,
    where the variance is second order in v; median 4e-13), mean ≤ 1.5e-7 output sd (float64);
    the probit surrogate: mean up to 0.052 absolute, variance up to 5.3× off (median 1.3 %);
    float32 TE within 1e-5 (variance) of float64.
    """
    zero, one = ops.const(0.0), ops.const(1.0)
    small = var < ops.const(_SMALL_VAR)
    s, _, d = _sigmoid_derivs(mean, ops)
    sig = [s] + d  # σ, σ', …, σ⁽¹⁰⁾
    xc = _clamp(mean, -_A_CLAMP, _A_CLAMP, ops)
    fd = [xc * sig[n] + ops.const(float(n)) * sig[n - 1] for n in range(1, 11)]
    d_mean, d_var = _delta_series(mean * s, fd, ops.minimum(var, ops.const(_SMALL_VAR)), ops)

    v = _clamp(var, _SMALL_VAR, _HUGE_VAR, ops)
    sigma = _share(ops.sqrt(v), ops)
    a = ops.maximum(-_abs(mean, ops), ops.const(-_A_CLAMP))
    # Gauss–Hermite at a'
    vals, f_gh = [], zero
    for w, x in _gh_nodes(a, sigma, ops):
        sx = _share(_logistic(x, ops), ops)
        vals.append((w, x * sx))
        f_gh = f_gh + ops.const(w) * sx * (one + x * (one - sx))  # E f'(X'), f' = σ + xσσ(−·)
    m_gh, v_gh = _gh_mean_var(vals, a * _logistic(a, ops), ops)
    # tilted split rule
    t1, t2, b1, b2, pre1, pre2 = _tilts(a, v, ops)
    e0, e11, e12 = _laguerre_split(b1, v, sigma, [_S1, _YS1, _YS2], ops)
    (e22,) = _laguerre_split(b2, v, sigma, [_Y2S2], ops)
    m_lag = _share(pre1 * ops.where(t1, e11, -e11), ops)
    v_lag = ops.maximum(pre2 * e22 - m_lag * m_lag, zero)
    f_lag = pre1 * (e0 + ops.where(t1, e12, e12 - e11))
    return _reflected(mean, var, v, sigma, (m_gh, v_gh, f_gh), (m_lag, v_lag, f_lag), small, d_mean, d_var,
                      _FAR_SILU, ops)


def softplus_exact(x: Any, ops: Any = NUMPY) -> Any:
    """Deterministic softplus ``log(1 + e^x) = max(x, 0) + log1p(e^{−|x|})``."""
    e = ops.exp(-_abs(x, ops))
    return ops.maximum(x, ops.const(0.0)) + e * _log1p_ratio(e, ops)


def softplus_moments(mean: Any, var: Any, ops: Any = NUMPY) -> tuple[Any, Any]:
    """Mean and variance of ``softplus(a) = log(1 + e^a)`` for ``a ~ N(mean, var)`` (quadrature).

    No closed form exists.  With ``a' = −|μ|``, ``X' ~ N(a', v)``:

    * ``v < 0.05``: delta series (``softplus⁽ⁿ⁾ = σ⁽ⁿ⁻¹⁾``);
    * otherwise ``E sp(X')``, ``Var sp(X')`` and ``E σ(X')`` by Gauss–Hermite (σ < 1.1) or the
      split Laguerre rule after exponential tilting (``sp(x) = e^{x}·q(x)``, ``q = sp·e^{−x} → 1``
      in the left tail), mapped back with ``sp(x) = x + sp(−x)``: mean ``μ + E sp(X')``,
      variance ``Var sp(X') + v·(1 − 2·E σ(X'))``.
    * ``v > 1e12`` (``|μ| ≤ 1000``): ReLU moments (``0 ≤ sp − ReLU ≤ log 2``);
    * ``|μ| > 1000`` (any ``v ≥ 0.05``): ReLU moments (:func:`_relu_tail`) plus the density-expansion
      correction (:func:`_far_corrections`; leading term ``E sp ≈ E ReLU + (π²/6)·φ(α)/σ``).

    Measured (``benchmarks/activation_accuracy.py``, μ ∈ [−30, 30] × v ∈ [0, 1e3]): variance
    ≤ 4.8e-7 relative, mean ≤ 3.7e-8 output sd (float64); float32 TE within 7.3e-6 (variance).
    """
    zero = ops.const(0.0)
    small = var < ops.const(_SMALL_VAR)
    s, _, d = _sigmoid_derivs(mean, ops)
    d_mean, d_var = _delta_series(softplus_exact(mean, ops), [s] + d[:9],
                                  ops.minimum(var, ops.const(_SMALL_VAR)), ops)

    v = _clamp(var, _SMALL_VAR, _HUGE_VAR, ops)
    sigma = _share(ops.sqrt(v), ops)
    a = ops.maximum(-_abs(mean, ops), ops.const(-_A_CLAMP))
    # Gauss–Hermite at a' (the nodes are ≤ 7.7: e^{−|x|} and σ(x) = 1/(1 + e^{−x}) are safe)
    vals, s_gh = [], zero
    for w, x in _gh_nodes(a, sigma, ops):
        vals.append((w, softplus_exact(x, ops)))
        s_gh = s_gh + ops.const(w) * _logistic(x, ops)  # E σ(X')
    m_gh, v_gh = _gh_mean_var(vals, softplus_exact(a, ops), ops)
    # tilted split rule
    t1, t2, b1, b2, pre1, pre2 = _tilts(a, v, ops)
    e0, eq1, esp1 = _laguerre_split(b1, v, sigma, [_S1, _Q1, _SPM1], ops)
    eq2, esp2 = _laguerre_split(b2, v, sigma, [_Q2, _SPM2], ops)
    m_lag = _share(pre1 * ops.where(t1, eq1, esp1), ops)
    v_lag = ops.maximum(pre2 * ops.where(t2, eq2, esp2) - m_lag * m_lag, zero)
    s_lag = pre1 * e0
    return _reflected(mean, var, v, sigma, (m_gh, v_gh, s_gh), (m_lag, v_lag, s_lag), small, d_mean, d_var,
                      _FAR_SOFTPLUS, ops)


# ---------------------------------------------------------------------------------------------
# ELU (exact)
# ---------------------------------------------------------------------------------------------

_ELU_KINK_SIGMA = 0.05  # below it, within 6σ of the kink, the σ-series form is used
_ELU_KINK_TERMS = 16  # Σ_k (σu)^k/k! to k = 16: |σu| ≤ 0.6 there, error < 1e-16


def _truncated_moment_polys(n: int) -> tuple[list[tuple[float, ...]], list[tuple[float, ...]]]:
    """``E[Z^k; Z<0] = P_k(m)·Φ(−m) − Q_k(m)·φ(m)`` for ``Z ~ N(m, 1)``, ``k ≤ n`` (from
    ``M_k = m·M_{k−1} + (k−1)·M_{k−2}``, ``M_0 = Φ(−m)``, ``M_1 = m·Φ(−m) − φ(m)``)."""
    pp = np.polynomial.polynomial
    p, q = [np.array([1.0]), np.array([0.0, 1.0])], [np.array([0.0]), np.array([1.0])]
    for k in range(2, n + 1):
        p.append(pp.polyadd(pp.polymulx(p[-1]), (k - 1) * p[-2]))
        q.append(pp.polyadd(pp.polymulx(q[-1]), (k - 1) * q[-2]))
    as_tuple = [tuple(float(c) for c in a[::-1]) for a in p], [tuple(float(c) for c in a[::-1]) for a in q]
    return as_tuple


_ELU_P, _ELU_Q = _truncated_moment_polys(_ELU_KINK_TERMS)


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


def elu_exact(x: Any, alpha: float = 1.0, ops: Any = NUMPY) -> Any:
    """Deterministic ``ELU(x) = x`` for ``x > 0``, ``α·(e^x − 1)`` otherwise (``expm1`` near 0)."""
    return ops.where(x > ops.const(0.0), x, ops.const(alpha) * _expm1(ops.minimum(x, ops.const(0.0)), ops))


def _exp_below_zero(k: float, mean: Any, var: Any, sigma: Any, m: Any, pdf_m: Any, ops: Any) -> Any:
    """``A_k = E[e^{kX}; X < 0] = e^{kμ + k²v/2}·Φ(−(m + kσ))`` without overflow.

    Where ``t = m + kσ ≥ 0`` it is ``φ(m)·R(t)`` (``R`` the Mills ratio: the exponential and the
    Gaussian tail cancel exactly, ``e^{kμ+k²v/2}·φ(t) = φ(m)``); elsewhere the exponent
    ``kμ + k²v/2 = kσ(t − kσ/2)`` is negative and the direct product is safe.
    """
    kc = ops.const(k)
    t = m + kc * sigma
    pos = t > ops.const(0.0)
    mills = pdf_m * _mills(ops.maximum(t, ops.const(0.0)), ops)
    _, tail = _cdfs(t, ops, negative=mean + kc * var < ops.const(0.0))  # Φ(−t)
    direct = ops.exp(ops.minimum(kc * mean + ops.const(0.5 * k * k) * var, ops.const(0.0))) * tail
    return ops.where(pos, mills, direct)


def elu_moments(mean: Any, var: Any, alpha: float = 1.0, ops: Any = NUMPY) -> tuple[Any, Any]:
    """Mean and variance of ``ELU(a)`` for ``a ~ N(mean, var)`` (exact, closed form; ``α > 0``).

    ``ELU(x) = relu(x) + α·(g − 1)`` with ``g = e^{min(x, 0)}``; ``relu·(g − 1) = 0`` gives
    ``Cov(relu, g) = E[relu]·d`` with ``d = E[1 − g]``, hence
    ``E = E[relu] − α·d`` and ``Var = Var relu + α²·Var g + 2α·E[relu]·d`` (every term ≥ 0), with
    ``E[e^{kX}; X<0] = e^{kμ+k²v/2}·Φ(−(μ+kv)/σ)`` (the lognormal partial expectation) and the
    ReLU moments (:func:`_relu_tail`, relatively accurate in the tails).  Numerics:

    * the partial expectations use the Mills ratio where the exponential would overflow
      (:func:`_exp_below_zero`), so huge ``μ`` and ``v`` stay finite;
    * for ``μ ≤ −2v`` (mass left of the kink) ``Var g = e^{2μ+2v}·(1 − e^{−v}) − δ2 + 2e^{μ+v/2}·δ1 − δ1²``
      with the small right-tail corrections ``δk = E[e^{kX} − 1; X>0]``, so ``Var g ≈ α²e^{2μ}v``
      keeps its relative accuracy for tiny ``v``;
    * within 6σ of the kink with ``σ < 0.05``: the exact series in σ of ``(e^{σu} − 1)/σ``
      (``u = min(Z', 0)``, ``Z' ~ N(μ/σ, 1)``) over the truncated-normal moments of ``Z'``, which
      replaces the differences of nearby Gaussian tails that cancel there;
    * ``σ = 0`` gives :func:`elu_exact` exactly.

    Source: the lognormal partial expectation ``E[e^X; X<0]`` (e.g. Johnson, Kotz & Balakrishnan
    vol. 1, §14.3) and the truncated-normal moments.  Measured (``benchmarks/
    activation_accuracy.py``, μ ∈ [−30, 30] × v ∈ [0, 1e3], α = 1 and 0.5): variance ≤ 7.8e-11
    relative (float64); float32 TE within 9.2e-6 (variance) of float64.
    """
    if not alpha > 0:
        raise ValueError(f"moments.elu_moments: needs alpha > 0, got {alpha}")
    zero, one, two = ops.const(0.0), ops.const(1.0), ops.const(2.0)
    al = ops.const(alpha)
    sigma = _share(ops.sqrt(var), ops)
    m = _share(_standard(mean, sigma, ops), ops)
    p, q = _cdfs(m, ops, negative=mean < zero)  # P(X>0), P(X<0)
    pdf_m = _share(_phi(m, ops), ops)
    r_mean, r_var, _ = _relu_tail(mean, var, sigma, m, ops)
    r_mean = _share(r_mean, ops)
    a1 = _share(_exp_below_zero(1.0, mean, var, sigma, m, pdf_m, ops), ops)
    a2 = _exp_below_zero(2.0, mean, var, sigma, m, pdf_m, ops)
    # direct form: d = q − A1, Var g = E g² − (E g)² = (A2 − A1²) + p·(q − 2A1) (E g = A1 + p,
    # E g² = A2 + p): no difference of two O(1) numbers when e^{−v} ≪ 1 (large v, mass left)
    d_r = q - a1
    var_g_r = (a2 - a1 * a1) + p * (q - two * a1)
    # left form (μ ≤ −2v): lognormal minus the right-tail corrections
    left = mean < -two * var
    half_exp = _share(ops.exp(ops.minimum(mean + ops.const(0.5) * var, zero)), ops)  # e^{μ+v/2}
    _, up1 = _cdfs(-(m + sigma), ops, negative=mean + var > zero)  # Φ(m + σ)
    _, up2 = _cdfs(-(m + two * sigma), ops, negative=mean + two * var > zero)  # Φ(m + 2σ)
    delta1 = half_exp * up1 - p
    full2 = ops.exp(ops.minimum(two * (mean + var), zero))  # e^{2μ+2v} (≤ e^{−2v} where selected)
    delta2 = full2 * up2 - p
    # Var e^X = e^{2μ+2v}·(1 − e^{−v}), then the right-tail corrections
    var_g_l = full2 * -_expm1(-var, ops) - delta2 + two * half_exp * delta1 - delta1 * delta1
    d_l = -_expm1(ops.minimum(mean + ops.const(0.5) * var, zero), ops) + delta1
    d = ops.where(left, d_l, d_r)
    var_g = ops.maximum(ops.where(left, var_g_l, var_g_r), zero)
    c_mean = r_mean - al * d
    c_var = r_var + al * al * var_g + two * al * r_mean * d

    # kink series (σ < 0.05, |μ| ≤ 6σ), in units of σ
    mk = _clamp(m, -6.0, 6.0, ops)
    pk, qk = _cdfs(mk, ops, negative=mean < zero)
    fk = _phi(mk, ops)
    p1 = mk * pk + fk
    p2 = (mk * mk + one) * pk + mk * fk
    sk = _share(ops.minimum(sigma, ops.const(_ELU_KINK_SIGMA)), ops)
    # M_k = E[Z'^k; Z' < 0] = P_k(m)·Φ(−m) − Q_k(m)·φ(m) (fixed polynomials _ELU_P, _ELU_Q):
    # G1 = Σ_k σ^{k−1}·M_k/k!, G2 = Σ_k (2^k − 2)·σ^{k−2}·M_k/k!, each a polynomial in (m, σ)
    # times Φ(−m) or φ(m), evaluated by Horner in σ (no k-term recursion in the expression).
    def series(weights: list[float], k_min: int, polys: list[tuple[float, ...]]) -> Any:
        """Σ_{k ≥ k_min} weights[k]·σ^{k−k_min}·poly_k(m), by Horner in σ."""
        acc = zero
        for k in range(_ELU_KINK_TERMS, k_min - 1, -1):
            acc = acc * sk + ops.const(weights[k]) * _horner(mk, polys[k], ops)
        return acc
    w1 = [0.0] + [1.0 / math.factorial(k) for k in range(1, _ELU_KINK_TERMS + 1)]
    w2 = [0.0, 0.0] + [(2.0 ** k - 2.0) / math.factorial(k) for k in range(2, _ELU_KINK_TERMS + 1)]
    g1 = series(w1, 1, _ELU_P) * qk - series(w1, 1, _ELU_Q) * fk
    g2 = series(w2, 2, _ELU_P) * qk - series(w2, 2, _ELU_Q) * fk
    k_mean_std = p1 + al * g1
    k_var = var * ops.maximum(p2 + al * al * g2 - k_mean_std * k_mean_std, zero)
    k_mean = sigma * k_mean_std
    use_kink = _all([sigma < ops.const(_ELU_KINK_SIGMA), m < ops.const(6.0), m > ops.const(-6.0)], ops)
    det = elu_exact(mean, alpha, ops)
    at_zero = sigma > zero
    out_mean = ops.where(use_kink, k_mean, c_mean)
    out_var = ops.where(use_kink, k_var, c_var)
    return ops.where(at_zero, out_mean, det), ops.where(at_zero, ops.maximum(out_var, zero), zero)
