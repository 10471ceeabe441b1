"""The numerical engines of the smooth activations: the Gaussian delta (Taylor) series, Gauss–Legendre
nodes, 16-node Gauss–Hermite, and the split Gauss–Laguerre rule for the logistic family's integrands."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .normal import _INV_SQRT_2PI, _SQRT_PI, _cdfs, _phi
from .ops import _share

_SMALL_VAR = 0.05  # below it the logistic-family rules use their delta (Taylor) series, see _delta_series
_TINY = 1e-30  # a denominator floor that is a normal float32 (never selected where it matters)
_HUGE_VAR = 1e12  # beyond it (σ > 1e6) GELU, SiLU and softplus are ReLU-like to 1e-6 (ReLU moments)


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


_GH_T, _GH_W = np.polynomial.hermite.hermgauss(16)
_GH_NODES = tuple(float(t) * math.sqrt(2.0) for t in _GH_T)  # E f(b + σZ) ≈ Σ W_i f(b + σ·x_i)
_GH_WEIGHTS = tuple(float(w) / _SQRT_PI for w in _GH_W)
_LAG_SCALE = 2.0  # Laguerre variable u = 2y: the nodes resolve the logistic tails e^{−y}, e^{−2y}
_LAG_U, _LAG_W = np.polynomial.laguerre.laggauss(16)
_LAG_NODES = tuple(float(u) / _LAG_SCALE for u in _LAG_U)  # ∫_0^∞ g(y) dy ≈ Σ W̃_j g(y_j)
_LAG_WEIGHTS = tuple(float(w * math.exp(u)) / _LAG_SCALE for u, w in zip(_LAG_U, _LAG_W, strict=True))
_GH_MAX_SIGMA = 1.1  # Gauss–Hermite for σ < 1.1, the split Laguerre rule beyond (both ~1e-7 there)


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
