"""The ``ops`` namespaces the moment formulas are written against, and helpers built on them.

Every formula of :mod:`pyro2pfp.moments` takes an ``ops`` namespace so that the *same* code runs on
float64 NumPy arrays (:data:`NUMPY`), on float32 TE expressions (``TE_OPS`` of the TVM back end) and
on ONNX symbols.  The primitives a namespace provides: ``where``, ``normal_cdfs``, ``exp``, ``erfcx``
(``e^{x²}·erfc(x)`` for ``x ≥ 0``: scipy in :data:`NUMPY`, :func:`erfcx_rational` in the float32 back
ends), ``sqrt``, ``maximum``, ``minimum``, ``const``, and the operators ``< > + − * /`` and unary minus.
Optional: ``bind`` (name a value used several times, ``te_shared``), ``horner`` and ``abs`` (the dual
numbers of :mod:`pyro2pfp.correlation.stein`).
"""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import scipy.special


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


_EXPM1_TAYLOR = tuple(1.0 / math.factorial(k) for k in range(14, 0, -1))  # 1/14!, …, 1/1!


def _expm1(x: Any, ops: Any) -> Any:
    """``e^x − 1``, relatively accurate near 0 (degree-14 Taylor polynomial on |x| < ½, error < 1e-16)."""
    xs = _clamp(x, -0.5, 0.5, ops)
    series = _horner(xs, _EXPM1_TAYLOR, ops) * xs
    return ops.where(_abs(x, ops) < ops.const(0.5), series, ops.exp(x) - ops.const(1.0))
