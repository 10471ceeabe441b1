"""Ground truth for the activation moment rules of :mod:`pyro2pfp.moments`: adaptive quadrature.

``E f(X)`` and ``Var f(X)`` for ``X ~ N(μ, v)`` by :func:`scipy.integrate.quad` against the
Gaussian density, in the standard variable ``z`` over ``[−39, 39]`` cut at the activation's kinks
and into unit pieces (each to a relative tolerance of 1e-13).  The variance is integrated about
the deterministic value ``f(μ)`` with a *difference function* ``f(x) − f(μ)`` written without
cancellation (e.g. ``σ(x) − σ(μ) = σ(x)·σ(−μ)·(1 − e^{μ−x})``), then centred on the mean in a
second pass, so tiny variances (``v = 1e-12``) and far tails (``σ(−30)``) keep their relative
accuracy.  Used by ``tests/ops/activations/test_activation_moments.py`` and ``benchmarks/activation_accuracy.py``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import scipy.integrate
import scipy.special as sp

Z_MAX = 39.0  # φ(39) < 1e-330: nothing beyond it is representable in float64


@dataclass(frozen=True)
class Activation:
    """``f`` and an accurate ``diff(x, μ) = f(x) − f(μ)``; ``kinks`` are the non-smooth points."""

    name: str
    f: Callable[[np.ndarray], np.ndarray]
    diff: Callable[[np.ndarray, float], np.ndarray]
    kinks: tuple[float, ...] = ()


def _sigmoid_diff(x: np.ndarray, mu: float) -> np.ndarray:
    """``σ(x) − σ(μ) = σ(x)·σ(−μ)·(1 − e^{μ−x})`` near μ (no cancellation), the plain
    difference of the tail-accurate ``expit`` values of the same sign far away."""
    d = np.asarray(x) - mu
    near = np.abs(d) < 1.0
    close = sp.expit(x) * sp.expit(-mu) * -np.expm1(-np.where(near, d, 0.0))
    far = sp.expit(x) - sp.expit(mu) if mu < 0 else sp.expit(-mu) - sp.expit(-np.asarray(x))
    return np.where(near, close, far)


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def _softplus_diff(x: np.ndarray, mu: float) -> np.ndarray:
    """``sp(x) − sp(μ) = log1p(σ(μ)·(e^{x−μ} − 1))`` near μ, the plain difference far away."""
    d = x - mu
    near = np.abs(d) < 1.0
    close = np.log1p(sp.expit(mu) * np.expm1(np.where(near, d, 0.0)))
    return np.where(near, close, _softplus(x) - _softplus(mu))


def _silu_diff(x: np.ndarray, mu: float) -> np.ndarray:
    return (x - mu) * sp.expit(x) + mu * _sigmoid_diff(x, mu)


def _ndtr_diff(x: np.ndarray, mu: float) -> np.ndarray:
    """``Φ(x) − Φ(μ)`` from the tails on μ's side."""
    return sp.ndtr(x) - sp.ndtr(mu) if mu < 0 else sp.ndtr(-mu) - sp.ndtr(-x)


def _gelu_diff(x: np.ndarray, mu: float) -> np.ndarray:
    return (x - mu) * sp.ndtr(x) + mu * _ndtr_diff(x, mu)


def elu(alpha: float) -> Activation:
    def f(x: np.ndarray) -> np.ndarray:
        return np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0.0)))

    def diff(x: np.ndarray, mu: float) -> np.ndarray:
        if mu > 0:
            return np.where(x > 0, x - mu, alpha * np.expm1(np.minimum(x, 0.0)) - mu)
        # α·(e^x − e^μ) = α·e^μ·expm1(x − μ) on the left
        left = alpha * np.exp(mu) * np.expm1(np.minimum(x, 0.0) - mu)
        return np.where(x > 0, x - alpha * np.expm1(mu), left)

    return Activation(f"elu(alpha={alpha:g})", f, diff, (0.0,))


def hardtanh(lo: float, hi: float) -> Activation:
    def f(x: np.ndarray) -> np.ndarray:
        return np.clip(x, lo, hi)

    return Activation(f"hardtanh({lo:g}, {hi:g})", f, lambda x, mu: f(x) - f(np.asarray(mu)),
                      tuple(k for k in (lo, hi) if np.isfinite(k)))


SIGMOID = Activation("sigmoid", sp.expit, _sigmoid_diff)
TANH = Activation("tanh", np.tanh, lambda x, mu: 2.0 * _sigmoid_diff(2.0 * x, 2.0 * mu))
SILU = Activation("silu", lambda x: x * sp.expit(x), _silu_diff)
SOFTPLUS = Activation("softplus", _softplus, _softplus_diff)
GELU = Activation("gelu", lambda x: x * sp.ndtr(x), _gelu_diff)


def _integrate(g: Callable[[float], float], edges: list[float]) -> float:
    total = 0.0
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        cuts = np.linspace(a, b, max(1, int(np.ceil(b - a))) + 1)
        for c, d in zip(cuts[:-1], cuts[1:], strict=True):
            total += scipy.integrate.quad(g, c, d, epsabs=0.0, epsrel=1e-13, limit=200)[0]
    return total


def moments(act: Activation, mu: float, var: float, cuts: tuple[float, ...] = ()) -> tuple[float, float]:
    """``(E f(X), Var f(X))`` for ``X ~ N(mu, var)`` by adaptive quadrature (see the module doc).

    ``cuts``: further points ``x`` to cut the integral at, besides the kinks (e.g. ``0, ±1, ±10, ±40``,
    where a logistic-family function varies, when σ is so large that this is a narrow feature in ``z``)."""
    mu, var = float(mu), float(var)
    f_mu = float(act.f(np.asarray(mu)))
    if var == 0.0:
        return f_mu, 0.0
    s = np.sqrt(var)
    points = sorted({0.0, *((k - mu) / s for k in (*act.kinks, *cuts))})
    edges = [-Z_MAX] + [p for p in points if -Z_MAX < p < Z_MAX] + [Z_MAX]
    norm = 1.0 / np.sqrt(2.0 * np.pi)

    def d(z: float) -> float:
        return float(act.diff(np.asarray(mu + s * z), mu))

    shift = _integrate(lambda z: d(z) * np.exp(-0.5 * z * z) * norm, edges)
    spread = _integrate(lambda z: (d(z) - shift) ** 2 * np.exp(-0.5 * z * z) * norm, edges)
    return f_mu + shift, spread
