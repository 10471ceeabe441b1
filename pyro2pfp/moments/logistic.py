"""The logistic family: sigmoid, tanh, SiLU and softplus (numerical quadrature, ~1e-6 relative).

With ``a' = −|μ|``: the fifth-order delta series for small ``v``, 16-node Gauss–Hermite for ``σ < 1.1``,
the tilted split Gauss–Laguerre rule beyond (:mod:`~pyro2pfp.moments.quadrature`), and for ``|μ| >
_A_CLAMP`` the Heaviside / ReLU limit plus its density-expansion correction
(:mod:`~pyro2pfp.moments.far_tail`)."""
from __future__ import annotations

from typing import Any

import numpy as np

from .far_tail import (
    _A_CLAMP,
    _FAR_CF_DEPTH,
    _FAR_CF_SWITCH,
    _FAR_SILU,
    _FAR_SOFTPLUS,
    _far_corrections,
    _far_moments,
    _sigmoid_far,
)
from .normal import _standard
from .ops import NUMPY, _abs, _clamp, _expm1, _horner, _share
from .quadrature import (
    _GH_MAX_SIGMA,
    _HUGE_VAR,
    _SMALL_VAR,
    _delta_series,
    _gh_mean_var,
    _gh_nodes,
    _Integrand,
    _laguerre_split,
)
from .relu import _relu_tail, relu_moments


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
      quadrature for any σ (absolutely below 1e-215 where ``|μ|/v ≥ 1``; :mod:`~pyro2pfp.moments.far_tail`).

    Accuracy (μ ∈ [−30, 30] × v ∈ [0, 1e3], 418 points,
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

    Accuracy (μ ∈ [−30, 30] × v ∈ [0, 1e3]): variance
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

    Accuracy (μ ∈ [−30, 30] × v ∈ [0, 1e3]): variance
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

