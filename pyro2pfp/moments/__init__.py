"""Elementwise Gaussian moment formulas shared by the NumPy reference and the float32 back ends.

Each function takes an ``ops`` namespace (:data:`NUMPY` here, ``TE_OPS`` in the TVM back end, symbols
in the ONNX exporter; see :mod:`~pyro2pfp.moments.ops`) so that the *same* formula runs on float64
arrays, on TE expressions and on ONNX graphs.

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

The accuracy each docstring states is against adaptive quadrature, as printed by
``benchmarks/activation_accuracy.py``.  For the TE back end the rules avoid comparisons of deep
select/min/max trees and selects inside values that are used many times: TVM's simplifier
substitutes let-bound values, and such patterns make single kernels slow to build.

Modules, by job: :mod:`~pyro2pfp.moments.ops` (the ``ops`` namespaces and generic helpers),
:mod:`~pyro2pfp.moments.normal` (``Φ``, ``φ``, tails), :mod:`~pyro2pfp.moments.relu` (ReLU, leaky
ReLU, variance ↔ second moment), :mod:`~pyro2pfp.moments.maximum` (Clark's max),
:mod:`~pyro2pfp.moments.clipped` (hardtanh, ReLU6), :mod:`~pyro2pfp.moments.gelu`,
:mod:`~pyro2pfp.moments.quadrature` (delta series, Gauss–Hermite, split Gauss–Laguerre),
:mod:`~pyro2pfp.moments.logistic` (sigmoid, tanh, SiLU, softplus), :mod:`~pyro2pfp.moments.far_tail`
(their limits for huge ``|μ|``) and :mod:`~pyro2pfp.moments.elu`.  Every name is re-exported here.
"""
from __future__ import annotations

from .clipped import hardtanh_exact, hardtanh_moments, relu6_moments
from .elu import elu_exact, elu_moments
from .far_tail import _A_CLAMP, _FAR_SIGMOID, _FAR_SILU, _FAR_SOFTPLUS, _FAR_TERMS, _far_corrections
from .gelu import _bvn_equal_excess, gelu_exact, gelu_moments
from .logistic import (
    sigmoid_exact,
    sigmoid_moments,
    silu_exact,
    silu_moments,
    softplus_exact,
    softplus_moments,
    tanh_exact,
    tanh_moments,
)
from .maximum import correlated_max_moments, correlated_window_max, max_moments, window_pairs
from .normal import ALPHA_MAX, INV_SQRT2, gaussian_terms
from .ops import NUMPY, _abs, _horner, erfcx_rational
from .relu import leaky_relu_moments, relu_moments, second_to_variance, variance_to_second

__all__ = [
    "ALPHA_MAX", "INV_SQRT2", "NUMPY", "correlated_max_moments", "correlated_window_max", "elu_exact",
    "elu_moments", "erfcx_rational", "gaussian_terms", "gelu_exact", "gelu_moments", "hardtanh_exact",
    "hardtanh_moments", "leaky_relu_moments", "max_moments", "relu6_moments", "relu_moments",
    "second_to_variance", "sigmoid_exact", "sigmoid_moments", "silu_exact", "silu_moments", "softplus_exact",
    "softplus_moments", "tanh_exact", "tanh_moments", "variance_to_second", "window_pairs",
    # used by the back ends and the tests
    "_A_CLAMP", "_FAR_SIGMOID", "_FAR_SILU", "_FAR_SOFTPLUS", "_FAR_TERMS", "_abs", "_bvn_equal_excess",
    "_far_corrections", "_horner",
]
