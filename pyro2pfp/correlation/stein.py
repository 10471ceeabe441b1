"""Stein's lemma for any elementwise activation: the exact slope ``E[f'(a)] = ∂E[f(a)]/∂μ`` of an
:class:`~pyro2pfp.planning.registry.ActivationRule`, by forward-mode automatic differentiation of the rule's
own mean formula, on any back end's ``ops`` namespace.

Why
---
Shared-factor PFP (:mod:`pyro2pfp.correlation.shared`) carries ``s = Cov(a, η)`` of every activation
with its channel's normal ``η``.  For ``y = f(a)`` with ``(a, η)`` jointly Gaussian, Stein's lemma
(Stein 1981, *Ann. Statist.* 9(6); the ReLU rule's identity ``Cov(g(a), η) = E[g'(a)]·Cov(a, η)``)
gives ``Cov(f(a), η) = E[f'(a)]·s``, and differentiating ``E[f(μ + σZ)]`` under the integral gives
``E[f'(a)] = ∂E[f(a)]/∂μ`` at fixed ``σ``.  So the slope is the ``μ``-derivative of the mean the
rule already computes -- but a finite difference of it is useless in float32 (``σ`` tiny, ``|μ|/σ``
large: the step is below the rounding of ``μ``) and loses half the digits in float64.

How
---
Forward-mode AD with dual numbers (Griewank & Walther, *Evaluating Derivatives*, 2nd ed., SIAM
2008, ch. 3): :func:`dual_ops` wraps a back end's ``ops`` namespace (``moments.NUMPY``, the TE ops of
``backends.tvm.te_let.te_shared``, the ONNX exporter's symbolic ops) into one whose values are
:class:`Dual` pairs ``(value, d/dμ)``; the rule runs unchanged on ``Dual(μ, 1)`` and
``Dual(v, 0)`` (the variance is a constant), and the mean it returns carries ``∂E[f(a)]/∂μ`` --
the derivative of the very approximation the back end evaluates (its selects, clamps, quadrature
nodes and series), with no step and no cancellation beyond the formula's own.  Each primitive is
differentiated by its mathematical derivative in the back end's arithmetic:

* ``+ − * / **`` (constant exponent), unary minus: the sum, product and quotient rules;
* comparisons (``<``, ``>``, ``<=``, ``>=``) give the back end's condition on the values, with a
  tie decided as at ``μ + ε`` where both derivatives are constants of the formula (``x − y`` linear
  in ``μ``, :meth:`DualOps.less`): the kinks where a rule's pieces meet are of that kind (``μ = 0``
  for ``−|μ|`` and ``μ > 0`` in the reflected rules, ``μ = lo, hi`` for hardtanh), so every select,
  max/min and ``|x|`` there takes the piece just right of ``μ`` and the result is the right
  derivative -- the derivative, for a rule smooth in ``μ`` however its pieces are written.  Ties of
  other intermediates are decided by the values alone (``<``: one comparison per select; the TE
  simplifier is slow on anything more, and such ties are exact float coincidences);
* ``where(c, a, b)``: both parts selected by ``c``; ``maximum``/``minimum``: the derivative of
  the argument selected (as above at a tie); ``|x|`` (``moments._abs`` uses ``ops.abs``): ``±x'``;
* ``exp``: ``e^x·x'``; ``sqrt``: ``x'/(2√x)`` (0 where ``√x = 0``); ``log``: ``x'/x``; ``tanh``:
  ``(1 − tanh²)·x'``; ``erf``/``erfc``: ``±(2/√π)·e^{−x²}·x'``; ``normal_cdfs`` ``(Φ(α), Φ(−α))``:
  ``±φ(α)·α'``;
* ``erfcx``: in float64 (``scipy.special.erfcx``) its derivative ``2x·erfcx(x) − 2/√π``, from the
  asymptotic series ``−(2/√π)·(1/(2x²) − 3/(4x⁴) + 15/(8x⁶) − 105/(16x⁸))`` for ``x > 50``, where the
  difference cancels; in the float32 back ends the rational form they evaluate
  (:func:`~pyro2pfp.moments.erfcx_rational`) is itself differentiated (no cancellation for large x);
* polynomials (``moments._horner`` calls ``ops.horner``): ``p'(x)·x'``, both by Horner's scheme on
  ``x``'s value (the product rule at each step would write the accumulator out again, so the TE
  expression, and with it the compile time, would grow several-fold);
* ``const``: derivative 0 (stored as ``None``: no work); ``bind`` (``te_shared``) names both parts.

A function of ``ops`` not listed raises :class:`UnsupportedDualOp` naming it.  Where a rule names a
sub-expression once (``ops.bind``, TE's ``te_shared``), its derivative is named too.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import scipy.special

from .. import moments
from ..errors import PFPError

_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_ERFCX_ASYMPTOTIC = 50.0  # beyond it, erfcx' from its asymptotic series (4 terms: < 1e-16 relative)
#: the float64 erfcx implementations whose derivative is taken analytically (others: differentiate
#: the rational form :func:`moments.erfcx_rational`, which is what the float32 back ends evaluate)
_ANALYTIC_ERFCX: tuple[Any, ...] = (scipy.special.erfcx,)


class UnsupportedDualOp(PFPError, AttributeError):
    """A rule called a function of ``ops`` that the dual-number layer has no derivative for (or that the
    wrapped back end lacks).  An ``AttributeError`` too, so ``getattr(ops, name, None)`` still works."""


class Dual:
    """``value + derivative·ε`` over a back end's values (arrays, TE expressions, ONNX symbols);
    ``d is None``: derivative 0 (a constant)."""

    __slots__ = ("v", "d", "ops")
    __array_ufunc__ = None  # NumPy arrays defer to our reflected operators

    def __init__(self, v: Any, d: Any, ops: DualOps) -> None:
        self.v, self.d, self.ops = v, d, ops

    # -- arithmetic (the derivative rules)
    def __add__(self, o: Any) -> Dual:
        o = self.ops.lift(o)
        return self.ops._new(self.v + o.v, _plus(self.d, o.d))

    __radd__ = __add__

    def __sub__(self, o: Any) -> Dual:
        o = self.ops.lift(o)
        return self.ops._new(self.v - o.v, _minus(self.d, o.d))

    def __rsub__(self, o: Any) -> Dual:
        return self.ops.lift(o) - self

    def __neg__(self) -> Dual:
        return self.ops._new(-self.v, None if self.d is None else -self.d)

    def __mul__(self, o: Any) -> Dual:
        o = self.ops.lift(o)
        d = _plus(None if self.d is None else self.d * o.v, None if o.d is None else self.v * o.d)
        return self.ops._new(self.v * o.v, d)

    __rmul__ = __mul__

    def __truediv__(self, o: Any) -> Dual:
        o = self.ops.lift(o)
        q = self.ops._new(self.v / o.v, None)
        if self.d is None and o.d is None:
            return q
        # (a/b)' = (a' − q·b')/b
        num = _minus(self.d, None if o.d is None else q.v * o.d)
        return self.ops._new(q.v, num / o.v)

    def __rtruediv__(self, o: Any) -> Dual:
        return self.ops.lift(o) / self

    def __pow__(self, p: Any) -> Dual:
        if not isinstance(p, (int, float)):
            raise UnsupportedDualOp(f"correlation.stein: Dual ** {type(p).__name__}: only constant exponents")
        if p == 2:
            return self * self
        value = self.v ** p
        return self.ops._new(value, None if self.d is None else self.ops.inner.const(float(p)) * self.v ** (p - 1)
                             * self.d)

    # -- comparisons: the back end's condition on the values, a tie decided as at μ + ε where the
    # derivatives are constants (DualOps.less)
    def __lt__(self, o: Any) -> Any:
        return self.ops.less(self, o)

    def __gt__(self, o: Any) -> Any:
        return self.ops.less(o, self)

    def __le__(self, o: Any) -> Any:
        return self.ops.less(o, self, negate=True)

    def __ge__(self, o: Any) -> Any:
        return self.ops.less(self, o, negate=True)

    def __bool__(self) -> bool:
        raise UnsupportedDualOp("correlation.stein: a Dual has no truth value (a rule branched in Python on a "
                                "value; use ops.where)")

    def __repr__(self) -> str:
        return f"Dual({self.v!r}, {self.d!r})"


def _static(d: Any) -> float | None:
    """A derivative's value when it is a constant of the formula (``None``: 0; a Python number, a TIR
    ``FloatImm`` or a folded ONNX scalar), else None (an array or an expression)."""
    if d is None:
        return 0.0
    if isinstance(d, (int, float)):
        return float(d)
    value = getattr(d, "value", None)
    return float(value) if isinstance(value, (int, float)) else None


def _plus(a: Any, b: Any) -> Any:
    if a is None:
        return b
    return a if b is None else a + b


def _minus(a: Any, b: Any) -> Any:
    if b is None:
        return a
    return -b if a is None else a - b


class DualOps:
    """The ``ops`` namespace of :mod:`pyro2pfp.moments` on :class:`Dual` values over ``inner`` (see
    the module docstring for the derivative of each function)."""

    #: the functions of ``ops`` with a derivative here (``bind`` too, where ``inner`` has it)
    SUPPORTED = ("const", "where", "maximum", "minimum", "abs", "horner", "exp", "sqrt", "log", "tanh", "erf", "erfc",
                 "erfcx", "normal_cdfs")

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._bind: Callable[[Any], Any] | None = getattr(inner, "bind", None)
        if self._bind is not None:
            self.bind = self._bind_dual

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "bind":
            raise AttributeError(name)
        raise UnsupportedDualOp(f"correlation.stein: ops.{name} has no forward-mode derivative (supported: "
                                f"{', '.join(self.SUPPORTED)}); add its rule to pyro2pfp/correlation/stein.py")

    def _inner(self, name: str) -> Any:
        fn = getattr(self.inner, name, None)
        if fn is None:
            raise UnsupportedDualOp(f"correlation.stein: the wrapped back end has no ops.{name}")
        return fn

    # -- construction
    def lift(self, x: Any) -> Dual:
        """``x`` as a :class:`Dual` (a Python number: the back end's constant; any other value: a constant)."""
        if isinstance(x, Dual):
            return x
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            return Dual(self.inner.const(float(x)), None, self)
        return Dual(x, None, self)

    def _new(self, v: Any, d: Any) -> Dual:
        return Dual(v, d, self)

    def horner(self, x: Any, coeffs: tuple[float, ...]) -> Dual:
        """The polynomial ``p(x)`` of :func:`moments._horner` and its derivative ``p'(x)·x'`` (both by
        Horner's scheme on the values, ``x`` named once): linear in the degree."""
        x = self.lift(x)
        xv = x.v if x.d is None or self._bind is None else self._bind(x.v)
        value = moments._horner(xv, coeffs, self.inner)
        degree = len(coeffs) - 1
        if x.d is None or degree == 0:
            return Dual(value, None, self)
        slope = moments._horner(xv, tuple(c * (degree - k) for k, c in enumerate(coeffs[:-1])), self.inner)
        return Dual(value, slope * x.d, self)

    def _bind_dual(self, x: Any) -> Dual:
        x = self.lift(x)
        assert self._bind is not None
        return Dual(self._bind(x.v), None if x.d is None else self._bind(x.d), self)

    def _chain(self, value: Any, x: Dual, deriv: Callable[[], Any]) -> Dual:
        """``f(x)`` with value ``value`` and derivative ``deriv()·x'`` (``deriv`` not called for a constant)."""
        return self._new(value, None if x.d is None else deriv() * x.d)

    # -- the ops functions
    def const(self, c: float) -> Dual:
        return Dual(self.inner.const(c), None, self)

    def less(self, x: Any, y: Any, negate: bool = False) -> Any:
        """The back end's condition ``x < y`` (``x ≥ y`` with ``negate``) at ``μ + ε``: where both
        derivatives are constants when the formula is built (``x − y`` linear in ``μ``: the kinks of the
        rules, ``μ = 0``, ``μ = lo``, ...), a tie is decided by their difference (``≤`` instead of ``<``
        where ``x − y`` falls); elsewhere by the values alone (``<``)."""
        x, y = self.lift(x), self.lift(y)
        dx, dy = _static(x.d), _static(y.d)
        falling = dx is not None and dy is not None and dx < dy  # x − y decreasing in μ
        if negate:  # not (x < y at μ + ε)
            return y.v < x.v if falling else y.v <= x.v
        return x.v <= y.v if falling else x.v < y.v

    def where(self, cond: Any, a: Any, b: Any) -> Dual:
        if isinstance(cond, Dual):
            raise UnsupportedDualOp("correlation.stein: ops.where needs a condition, got a Dual value")
        a, b = self.lift(a), self.lift(b)
        where = self.inner.where
        d = None
        if a.d is not None or b.d is not None:
            zero = self.inner.const(0.0)
            d = where(cond, zero if a.d is None else a.d, zero if b.d is None else b.d)
        return Dual(where(cond, a.v, b.v), d, self)

    def _pick(self, take_b: Any, a: Dual, b: Dual, value: Any) -> Dual:
        """``value`` (``a`` or ``b``) with the derivative of the argument ``take_b`` selects."""
        if a.d is None and b.d is None:
            return Dual(value, None, self)
        zero = self.inner.const(0.0)
        return Dual(value, self.inner.where(take_b, zero if b.d is None else b.d, zero if a.d is None else a.d),
                    self)

    def maximum(self, a: Any, b: Any) -> Dual:
        a, b = self.lift(a), self.lift(b)
        return self._pick(self.less(a, b), a, b, self.inner.maximum(a.v, b.v))

    def minimum(self, a: Any, b: Any) -> Dual:
        a, b = self.lift(a), self.lift(b)
        return self._pick(self.less(b, a), a, b, self.inner.minimum(a.v, b.v))

    def abs(self, x: Any) -> Dual:
        """``|x|`` (``moments._abs``) as ``max(x, −x)``, derivative ``∓x'`` by the sign of ``x`` at ``μ + ε``
        (:meth:`less`)."""
        x = self.lift(x)
        value = self.inner.maximum(x.v, -x.v)
        if x.d is None:
            return Dual(value, None, self)
        return Dual(value, self.inner.where(self.less(x, 0.0), -x.d, x.d), self)

    def exp(self, x: Any) -> Dual:
        x = self.lift(x)
        e = self._inner("exp")(x.v)
        if x.d is not None and self._bind is not None:
            e = self._bind(e)
        return self._chain(e, x, lambda: e)

    def sqrt(self, x: Any) -> Dual:
        x = self.lift(x)
        s = self._inner("sqrt")(x.v)
        if x.d is None:
            return Dual(s, None, self)
        inner = self.inner
        zero, one = inner.const(0.0), inner.const(1.0)
        pos = s > zero
        return self._new(s, inner.where(pos, inner.const(0.5) / inner.where(pos, s, one), zero) * x.d)

    def log(self, x: Any) -> Dual:
        x = self.lift(x)
        return self._chain(self._inner("log")(x.v), x, lambda: self.inner.const(1.0) / x.v)

    def tanh(self, x: Any) -> Dual:
        x = self.lift(x)
        t = self._inner("tanh")(x.v)
        return self._chain(t, x, lambda: self.inner.const(1.0) - t * t)

    def _gauss(self, x: Any) -> Any:
        return self.inner.exp(-(x * x)) * self.inner.const(_TWO_OVER_SQRT_PI)

    def erf(self, x: Any) -> Dual:
        x = self.lift(x)
        return self._chain(self._inner("erf")(x.v), x, lambda: self._gauss(x.v))

    def erfc(self, x: Any) -> Dual:
        x = self.lift(x)
        return self._chain(self._inner("erfc")(x.v), x, lambda: -self._gauss(x.v))

    def erfcx(self, x: Any) -> Dual:
        x = self.lift(x)
        fn = self._inner("erfcx")
        if not any(fn is f for f in _ANALYTIC_ERFCX):
            return self.lift(moments.erfcx_rational(x, self))  # what the float32 back ends evaluate
        value = fn(x.v)
        return self._chain(value, x, lambda: _erfcx_derivative(x.v, value, self.inner))

    def normal_cdfs(self, alpha: Any) -> tuple[Dual, Dual]:
        alpha = self.lift(alpha)
        cdf, cdf_neg = self._inner("normal_cdfs")(alpha.v)
        if alpha.d is None:
            return Dual(cdf, None, self), Dual(cdf_neg, None, self)
        inner = self.inner
        pdf = inner.exp(inner.const(-0.5) * alpha.v * alpha.v) * inner.const(_INV_SQRT_2PI)
        if self._bind is not None:
            pdf = self._bind(pdf)
        return self._new(cdf, pdf * alpha.d), self._new(cdf_neg, -pdf * alpha.d)


def _erfcx_derivative(x: Any, value: Any, ops: Any) -> Any:
    """``erfcx'(x) = 2x·erfcx(x) − 2/√π`` (``x ≥ 0``), from its asymptotic series for ``x > 50``."""
    c = ops.const
    big = x > c(_ERFCX_ASYMPTOTIC)
    direct = c(2.0) * x * value - c(_TWO_OVER_SQRT_PI)
    xb = ops.maximum(x, c(_ERFCX_ASYMPTOTIC))
    r = c(1.0) / (xb * xb)
    series = c(-_TWO_OVER_SQRT_PI) * r * (c(0.5) + r * (c(-0.75) + r * (c(15.0 / 8.0) + r * c(-105.0 / 16.0))))
    return ops.where(big, series, direct)


def dual_ops(ops: Any) -> DualOps:
    """``ops`` (a back end's namespace of :mod:`pyro2pfp.moments`) on :class:`Dual` values."""
    return ops if isinstance(ops, DualOps) else DualOps(ops)


def mean_and_slope(rule: Any, mean: Any, var: Any, attrs: dict[str, Any], ops: Any) -> tuple[Any, Any]:
    """``(E[f(a)], E[f'(a)])`` for ``a ~ N(mean, var)``: ``rule.moments``' mean (an
    :class:`~pyro2pfp.planning.registry.ActivationRule`) and its exact ``μ``-derivative at fixed ``var``,
    evaluated by ``ops`` (values of its back end in, out; the slope may be a scalar constant)."""
    dops = dual_ops(ops)
    out = rule.moments(Dual(mean, ops.const(1.0), dops), Dual(var, None, dops), attrs, dops)[0]
    out = dops.lift(out)
    return out.v, ops.const(0.0) if out.d is None else out.d


def stein_slope(rule: Any, mean: Any, var: Any, attrs: dict[str, Any], ops: Any) -> Any:
    """``E[f'(a)] = ∂E[f(a)]/∂μ`` for ``a ~ N(mean, var)``: :func:`mean_and_slope`'s slope."""
    return mean_and_slope(rule, mean, var, attrs, ops)[1]
