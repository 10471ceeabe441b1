"""Vectorisable float32 math for the TE kernels: ``erf``, ``exp`` and ``erfcx`` as plain arithmetic (no
libm call, so the loops that use them vectorise), and :data:`TE_OPS`, the :mod:`pyro2pfp.moments`
``ops`` namespace on TE expressions."""
from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

from tvm import te, tirx

from ... import moments

F32 = "float32"


def _const(value: float) -> tirx.PrimExpr:
    return tirx.const(value, F32)


# Eigen's rational float32 erf on [-4, 4] (|error| of a few ulp; erf(±4) = ±1 in float32).  Unlike a
# libm ``erff`` call it vectorises, which makes ReLU and max pooling several times faster.
_ERF_NUM = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
            -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_ERF_DEN = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
            -1.42647390514189e-02)


def _no_bind(e: tirx.PrimExpr) -> tirx.PrimExpr:
    return e


def fast_erf(x: tirx.PrimExpr, bind: Callable[[tirx.PrimExpr], tirx.PrimExpr] = _no_bind) -> tirx.PrimExpr:
    """erf(x) in float32 as ``x·P(x²)/Q(x²)`` (vectorisable, no libm call).

    ``bind`` (see :func:`te_shared`) names the sub-expressions used several times."""
    x = bind(te.min(te.max(x, _const(-4.0)), _const(4.0)))
    x2 = bind(x * x)
    num = _const(_ERF_NUM[0])
    for c in _ERF_NUM[1:]:
        num = num * x2 + _const(c)
    den = _const(_ERF_DEN[0])
    for c in _ERF_DEN[1:]:
        den = den * x2 + _const(c)
    return x * num / den


# Cephes' float32 expf: exp(x) = 2^n·exp(r), n = round(x·log2 e), r = x − n·ln 2 (ln 2 split in a
# hi part exact in float32 and a lo correction), exp(r) on |r| ≤ ln2/2 by a degree-6 polynomial.
_EXP_LOG2E = 1.44269504088896341
_EXP_LN2_HI = 0.693359375
_EXP_LN2_LO = -2.12194440e-4
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
             5.0000001201e-1)
EXP_MIN = -87.33654022216797
"""The least float32 above ln(FLT_MIN) = −87.3365447…: below it exp(x) is denormal and ``fast_exp``
returns 0.  A lane clamped here computes ``1.0000045·2^−126``, a normal float, before the select
discards it; clamped at the float32 just below ln(FLT_MIN) it would compute a denormal, and x86
arithmetic producing denormals runs in microcode (slow), which the Gaussian-max and ReLU kernels,
whose far tails clamp every lane with zero variance, would pay on every such lane."""
EXP_MAX = 88.37626266  # 127.5·ln 2: the largest x with 2^n a normal float32 (results saturate there)


def fast_exp(x: tirx.PrimExpr, bind: Callable[[tirx.PrimExpr], tirx.PrimExpr] = _no_bind) -> tirx.PrimExpr:
    """exp(x) in float32, within 1 ulp of the exact value (vectorisable, no libm call).

    ``llvm.exp`` (``te.exp``) becomes one libm ``expf`` call per lane; this is plain arithmetic
    plus a ``reinterpret`` of the biased exponent ``(n + 127) << 23`` as the float ``2^n``.
    ``exp(0) = 1`` exactly; ``x < EXP_MIN`` (including ``-inf``) gives exactly 0 (the exact value
    is a denormal < FLT_MIN); ``x > EXP_MAX`` saturates at ``exp(EXP_MAX) ≈ 2.4e38`` (never inf).
    ``bind`` (see :func:`te_shared`) names the sub-expressions used several times.
    """
    x = bind(x)
    xc = te.min(te.max(x, _const(EXP_MIN)), _const(EXP_MAX))
    n = bind(tirx.floor(xc * _const(_EXP_LOG2E) + _const(0.5)))
    r = bind(xc - n * _const(_EXP_LN2_HI) - n * _const(_EXP_LN2_LO))
    poly = _const(_EXP_POLY[0])
    for c in _EXP_POLY[1:]:
        poly = poly * r + _const(c)
    exp_r = poly * (r * r) + r + _const(1.0)
    biased = tirx.Cast("int32", n) + tirx.const(127, "int32")
    two_n = tirx.reinterpret(F32, tirx.shift_left(biased, tirx.const(23, "int32")))
    return tirx.Select(x < _const(EXP_MIN), _const(0.0), exp_r * two_n)


def _normal_cdfs(alpha: tirx.PrimExpr, bind: Callable[[tirx.PrimExpr], tirx.PrimExpr] = _no_bind
                 ) -> tuple[tirx.PrimExpr, tirx.PrimExpr]:
    """(Φ(α), Φ(−α)) from one erf evaluation."""
    half_erf = bind(_const(0.5) * fast_erf(alpha * _const(moments.INV_SQRT2), bind))
    return bind(_const(0.5) + half_erf), bind(_const(0.5) - half_erf)


def fast_erfcx(x: tirx.PrimExpr, bind: Callable[[tirx.PrimExpr], tirx.PrimExpr] = _no_bind) -> tirx.PrimExpr:
    """``e^{x²}·erfc(x)`` for ``x ≥ 0`` in float32: :func:`moments.erfcx_rational` on ``fast_exp``
    (one exp, a degree-9 polynomial; 1.2e-7 relative, vectorisable)."""
    return moments.erfcx_rational(x, SimpleNamespace(const=_const, exp=lambda e: bind(fast_exp(e, bind))))


TE_OPS = SimpleNamespace(
    where=tirx.Select,
    normal_cdfs=_normal_cdfs,
    exp=fast_exp,
    erfcx=fast_erfcx,
    sqrt=te.sqrt,
    maximum=te.max,
    minimum=te.min,
    const=_const,
)
"""The :mod:`pyro2pfp.moments` formulas evaluated on TE expressions (float32)."""
