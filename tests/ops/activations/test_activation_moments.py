"""Gaussian moment rules of the smooth and clipped activations (pyro2pfp.moments, issue 16).

* Monte Carlo: pure sampling bounds (``tests/support/stats.py``: z·se from the sample, Bonferroni over all
  points) for every rule on a grid of (μ, v); the rules that are exact (clipped Gaussian, ELU,
  GELU up to its 20-point Gauss–Legendre) and the quadrature rules (sigmoid, tanh, SiLU,
  softplus, ~1e-6) must both pass, and the check must reject the probit sigmoid.
* Deterministic: adaptive quadrature (``pyro2pfp_experiments.activation_reference``) at points
  that include the tails, tiny and huge variances, against the bounds measured by
  ``benchmarks/activation_accuracy.py``.
* Limits: ``v = 0`` gives exactly the deterministic activation; huge means and variances stay
  finite with the right limits; tiny variances keep their relative accuracy; NumPy never warns.
* Back ends: the same functions evaluated in float32 by a vectorised TVM TE kernel (through
  ``te_shared``, as the elementwise kernels do) and on ONNX symbols (onnxruntime), against the
  float64 NumPy evaluation.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import scipy.special as sp

from pyro2pfp import moments as M
from pyro2pfp_experiments import activation_reference as R
from tests.support.stats import assert_check_rejects, assert_moments_agree


class Case:
    """One activation: reference, moment rule ``rule(m, v, ops)``, deterministic ``exact(x, ops)``,
    ``f'`` (for the tiny-variance limit) and the quadrature bounds (mean error in output sd,
    relative variance error) — a few times the maxima measured by the benchmark."""

    def __init__(self, ref: R.Activation, rule: Callable, exact: Callable, deriv: Callable,
                 mean_bound: float, var_bound: float) -> None:
        self.ref, self.rule, self.exact, self.deriv = ref, rule, exact, deriv
        self.mean_bound, self.var_bound = mean_bound, var_bound


def _silu_d(x: np.ndarray) -> np.ndarray:
    return sp.expit(x) * (1 + x * sp.expit(-x))


CASES = {
    "sigmoid": Case(R.SIGMOID, M.sigmoid_moments, M.sigmoid_exact,
                    lambda x: sp.expit(x) * sp.expit(-x), 2e-6, 5e-6),
    "tanh": Case(R.TANH, M.tanh_moments, M.tanh_exact, lambda x: 4 * sp.expit(2 * x) * sp.expit(-2 * x),
                 2e-6, 5e-6),
    "silu": Case(R.SILU, M.silu_moments, M.silu_exact, _silu_d, 1e-6, 2e-5),
    "softplus": Case(R.SOFTPLUS, M.softplus_moments, M.softplus_exact, sp.expit, 1e-6, 2e-6),
    "gelu": Case(R.GELU, M.gelu_moments, M.gelu_exact,
                 lambda x: sp.ndtr(x) + x * np.exp(-x * x / 2) / math.sqrt(2 * math.pi), 1e-8, 1e-5),
    "elu": Case(R.elu(1.0), lambda m, v, ops=M.NUMPY: M.elu_moments(m, v, 1.0, ops),
                lambda x, ops=M.NUMPY: M.elu_exact(x, 1.0, ops), lambda x: np.where(x > 0, 1.0, np.exp(x)),
                1e-8, 1e-9),
    "elu(0.5)": Case(R.elu(0.5), lambda m, v, ops=M.NUMPY: M.elu_moments(m, v, 0.5, ops),
                     lambda x, ops=M.NUMPY: M.elu_exact(x, 0.5, ops),
                     lambda x: np.where(x > 0, 1.0, 0.5 * np.exp(x)), 1e-8, 1e-9),
    "relu6": Case(R.hardtanh(0.0, 6.0), M.relu6_moments, lambda x, ops=M.NUMPY: M.hardtanh_exact(x, 0.0, 6.0, ops),
                  lambda x: ((x > 0) & (x < 6)).astype(float), 1e-10, 1e-9),
    "hardtanh": Case(R.hardtanh(-1.0, 1.0), lambda m, v, ops=M.NUMPY: M.hardtanh_moments(m, v, -1.0, 1.0, ops),
                     lambda x, ops=M.NUMPY: M.hardtanh_exact(x, -1.0, 1.0, ops),
                     lambda x: ((x > -1) & (x < 1)).astype(float), 1e-10, 1e-9),
}
NAMES = list(CASES)


def _rule64(case: Case, mean: Any, var: Any) -> tuple[np.ndarray, np.ndarray]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # overflow / invalid in an unselected branch is a bug too
        m, v = case.rule(np.asarray(mean, np.float64), np.asarray(var, np.float64))
    return np.asarray(m, np.float64), np.asarray(v, np.float64)


# -- Monte Carlo ------------------------------------------------------------------------------

# (points where every activation's output still varies in a 200k sample: the far tails, where a
# sample would be constant, are the quadrature test's)
MC_POINTS = [(0.0, 1.0), (-2.0, 0.5), (1.5, 2.0), (-4.0, 4.0), (0.9, 0.02), (-1.3, 0.2), (0.5, 25.0),
             (-10.0, 100.0), (4.5, 2.25), (0.3, 0.001), (-0.7, 9.0), (2.0, 1e4)]


@pytest.mark.parametrize("name", NAMES)
def test_moments_match_monte_carlo(name: str) -> None:
    case = CASES[name]
    mu, var = (np.array(c) for c in zip(*MC_POINTS, strict=True))
    rng = np.random.default_rng(16)
    x = mu + np.sqrt(var) * rng.standard_normal((200_000, len(mu)))
    assert_moments_agree(case.ref.f(x), *_rule64(case, mu, var))


def test_monte_carlo_check_rejects_the_probit_sigmoid() -> None:
    """The check has the power to see a rule that is off: the probit sigmoid at μ = −5, v = 1."""
    mu, var = np.array([-5.0, -3.0]), np.array([1.0, 1.0])
    lam2 = math.pi / 8
    h = math.sqrt(lam2) * mu / np.sqrt(1 + lam2 * var)
    probit_mean = sp.expit(mu / np.sqrt(1 + lam2 * var))
    probit_var = M._bvn_equal_excess(h, lam2 * var, M.NUMPY)
    x = mu + np.sqrt(var) * np.random.default_rng(3).standard_normal((200_000, 2))
    assert_check_rejects(sp.expit(x), probit_mean, probit_var)


# -- deterministic quadrature -----------------------------------------------------------------

QUAD_POINTS = [(-30.0, 1e-12), (-20.0, 4.0), (-8.0, 0.04), (-3.0, 0.06), (-1.28, 0.049), (-0.5, 1.5),
               (0.0, 1.0), (1e-3, 1e-3), (0.7, 1.1), (2.0, 1.21), (8.0, 0.3), (30.0, 1e-6), (-12.0, 100.0),
               (3.0, 1e3)]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_moments_match_quadrature_within_the_stated_bounds(name: str) -> None:
    case = CASES[name]
    mu, var = (np.array(c) for c in zip(*QUAD_POINTS, strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quad's roundoff notes
        truth = np.array([R.moments(case.ref, m, v) for m, v in QUAD_POINTS])
    got_m, got_v = _rule64(case, mu, var)
    # mean: within mean_bound output sd, or 1e-12 relative (a deep tail's rounding, e.g. e^{−450})
    mean_ok = np.abs(got_m - truth[:, 0]) <= case.mean_bound * np.sqrt(truth[:, 1]) + 1e-12 * np.abs(truth[:, 0])
    rep = truth[:, 1] > 1e-290
    var_err = np.abs(got_v[rep] / truth[rep, 1] - 1)
    assert mean_ok.all(), (name, np.array(QUAD_POINTS)[~mean_ok], got_m[~mean_ok], truth[~mean_ok, 0])
    assert var_err.max() <= case.var_bound, (name, np.array(QUAD_POINTS)[rep][var_err.argmax()], var_err.max())


# -- beyond the clamp (|μ| > moments._A_CLAMP): the limit rules and their corrections ----------

LOGISTIC = ("sigmoid", "tanh", "silu", "softplus")
#: where the logistic-family functions vary (x): the quadrature cuts there, a narrow feature in z when σ ≫ 1
LOGISTIC_CUTS = (0.0, -1.0, 1.0, -3.0, 3.0, -10.0, 10.0, -40.0, 40.0)
#: |μ| just beyond the clamp, and far beyond it; σ from 1e-2·|μ| (the far side's mass e^{-5000}: 0) to
#: 1e2·|μ| (σ ≫ |μ|: the Gaussian's mass straddles 0, the case the clamp got wrong)
FAR_MEANS = (1e3 * (1 + 1e-6), 1e4, 1e6)
FAR_RATIOS = (1e-2, 0.03, 0.1, 0.3, 1.0, 10.0, 1e2)
FAR_POINTS = [(sign * m, (r * m) ** 2) for m in FAR_MEANS for r in FAR_RATIOS for sign in (-1.0, 1.0)]


@pytest.mark.slow
@pytest.mark.parametrize("name", LOGISTIC)
def test_beyond_the_clamp_matches_quadrature(name: str) -> None:
    """Mean and variance for |μ| > 1000 (tanh: > 500) against adaptive quadrature, to within 1e-8 output sd
    and 1e-7 relative (measured ≤ 3e-14 sd and 6e-9; moments._far_corrections) -- plus 1e-200·(1 + |μ|)
    absolute: where |μ|/v ≥ 1 (μ = −1000, σ = 30) the correction series diverges and only the absolute
    error of those far-side moments (< 1e-215 there) is kept.  The clamped rule (μ taken as ±1000 whatever
    σ) was off by up to 4 output sd in the mean and 6e+241 relative in the variance here."""
    case = CASES[name]
    mu, var = (np.array(c) for c in zip(*FAR_POINTS, strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quad's roundoff notes
        truth = np.array([R.moments(case.ref, m, v, cuts=LOGISTIC_CUTS) for m, v in FAR_POINTS])
    got_m, got_v = _rule64(case, mu, var)
    floor = 1e-200 * (1 + np.abs(mu))
    mean_err = np.abs(got_m - truth[:, 0])
    var_err = np.abs(got_v - truth[:, 1])
    mean_ok = mean_err <= 1e-8 * np.sqrt(truth[:, 1]) + 1e-12 * np.abs(truth[:, 0]) + floor
    var_ok = var_err <= 1e-7 * truth[:, 1] + floor
    pts = np.array(FAR_POINTS)
    assert mean_ok.all(), (name, pts[~mean_ok], got_m[~mean_ok], truth[~mean_ok, 0])
    assert var_ok.all(), (name, pts[~var_ok], got_v[~var_ok], truth[~var_ok, 1])


CUTS_01 = (-80.0, -40.0, -20.0, -10.0, -5.0, -2.0, 0.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0)


@pytest.mark.parametrize("name", ["sigmoid", "silu", "softplus"])
def test_far_rule_constants_are_the_integrals(name: str) -> None:
    """The moments ``∫ x^j r dx``, ``r = f − f_L``, and ``∫ x^j q dx``, ``q = f² − f_L²``, of
    moments._far_corrections (closed forms in Dirichlet's η) against quadrature of their definitions
    (written without cancellation: ``σ(x) − 1 = −σ(−x)`` for x > 0, ``ℓ(x) = log(1 + e^{−|x|})``)."""
    import scipy.integrate as si

    def ell(x: float) -> float:
        return math.log1p(math.exp(-abs(x)))

    r, q = {  # (r, q) on x < 0 and on x > 0
        "sigmoid": ((sp.expit, lambda x: -sp.expit(-x)),
                    (lambda x: sp.expit(x) ** 2, lambda x: -sp.expit(-x) * (1 + sp.expit(x)))),
        "silu": ((lambda x: x * sp.expit(x), lambda x: -x * sp.expit(-x)),
                 (lambda x: (x * sp.expit(x)) ** 2, lambda x: -x * x * sp.expit(-x) * (1 + sp.expit(x)))),
        "softplus": ((ell, ell), (lambda x: ell(x) ** 2, lambda x: 2 * x * ell(x) + ell(x) ** 2)),
    }[name]
    r_coeffs, q_coeffs = {"sigmoid": M._FAR_SIGMOID, "silu": M._FAR_SILU, "softplus": M._FAR_SOFTPLUS}[name]
    for j in range(M._FAR_TERMS + 1):
        for coeffs, (left, right) in ((r_coeffs, r), (q_coeffs, q)):
            pieces = [si.quad(lambda x, n, g: x**n * g(x), a, b, args=(j, left if b <= 0 else right), epsabs=0.0,
                              epsrel=1e-13, limit=400)[0] for a, b in zip(CUTS_01[:-1], CUTS_01[1:], strict=True)]
            assert abs(coeffs[j] * math.factorial(j) - sum(pieces)) <= 1e-12 * sum(map(abs, pieces)), (name, j)


def test_beyond_the_clamp_is_continuous_and_bit_identical_within() -> None:
    """At |μ| = 1000 (tanh 500) the far rule continues the quadrature rule (to its ~1e-6 accuracy), and
    within the clamp the rules do not use it (a far rule evaluated there would differ in the last bits)."""
    var = np.array([0.06, 1.0, 100.0, 1e4, 1e6, 1e8])
    for name in LOGISTIC:
        edge = 500.0 if name == "tanh" else 1000.0
        for sign in (-1.0, 1.0):
            inside = _rule64(CASES[name], np.full_like(var, sign * edge), var)
            beyond = _rule64(CASES[name], np.full_like(var, sign * np.nextafter(edge, 2 * edge)), var)
            np.testing.assert_allclose(beyond[0], inside[0], rtol=1e-9, atol=1e-6 * np.sqrt(inside[1]).max(),
                                       err_msg=name)
            np.testing.assert_allclose(beyond[1], inside[1], rtol=2e-5, atol=1e-290, err_msg=name)


# -- limits -----------------------------------------------------------------------------------

HUGE = 1e30


@pytest.mark.parametrize("name", NAMES)
def test_zero_variance_is_the_deterministic_activation(name: str) -> None:
    case = CASES[name]
    mu = np.array([-HUGE, -1e6, -745.0, -40.0, -8.0, -1.3, -1e-3, -1e-30, 0.0, 1e-30, 1e-3, 0.7, 1.0, 6.0,
                   7.0, 40.0, 1e6, HUGE])
    got_m, got_v = _rule64(case, mu, np.zeros_like(mu))
    np.testing.assert_array_equal(got_m, case.exact(mu))
    np.testing.assert_array_equal(got_v, 0.0)
    assert np.all(np.isfinite(case.exact(mu)))


@pytest.mark.parametrize("name", NAMES)
def test_tiny_variance_keeps_relative_accuracy(name: str) -> None:
    """v = 1e-20: Var f = f'(μ)²·v to first order (the next term is 1e-20 smaller)."""
    case = CASES[name]
    mu = np.array([-30.0, -5.0, -2.0, -0.5, 0.3, 0.9, 2.5, 5.5, 12.0])
    got_m, got_v = _rule64(case, mu, np.full_like(mu, 1e-20))
    want = case.deriv(mu) ** 2 * 1e-20
    np.testing.assert_allclose(got_v, want, rtol=1e-9, atol=0)
    np.testing.assert_allclose(got_m, case.exact(mu), rtol=1e-12, atol=0)


LIMITS = {  # (μ, v) → (mean, var) to 1e-6 relative (the rules are exact or ReLU-like there)
    "sigmoid": {(HUGE, 1.0): (1.0, 0.0), (-HUGE, 1.0): (0.0, 0.0), (0.0, HUGE): (0.5, 0.25)},
    "tanh": {(HUGE, 1.0): (1.0, 0.0), (-HUGE, 1.0): (-1.0, 0.0), (0.0, HUGE): (0.0, 1.0)},
    "silu": {(HUGE, 1.0): (HUGE, 1.0), (-HUGE, 1.0): (0.0, 0.0)},
    "softplus": {(HUGE, 1.0): (HUGE, 1.0), (-HUGE, 1.0): (0.0, 0.0)},
    "gelu": {(HUGE, 1.0): (HUGE, 1.0), (-HUGE, 1.0): (0.0, 0.0)},
    "elu": {(HUGE, 1.0): (HUGE, 1.0), (-HUGE, 1.0): (-1.0, 0.0), (-HUGE, HUGE): (-1.0, 0.0)},
    "elu(0.5)": {(HUGE, 1.0): (HUGE, 1.0), (-HUGE, 1.0): (-0.5, 0.0)},
    "relu6": {(HUGE, 1.0): (6.0, 0.0), (-HUGE, HUGE): (0.0, 0.0), (3.0, HUGE): (3.0, 9.0)},
    "hardtanh": {(HUGE, HUGE): (1.0, 0.0), (0.0, HUGE): (0.0, 1.0)},
}
RELU_LIKE = ("silu", "softplus", "gelu", "elu", "elu(0.5)")


@pytest.mark.parametrize("name", NAMES)
def test_huge_means_and_variances_stay_finite_with_their_limits(name: str) -> None:
    case = CASES[name]
    grid = [(m, v) for m in (-HUGE, -1e6, -50.0, 0.0, 50.0, 1e6, HUGE) for v in (1e-30, 1.0, 1e6, 1e12, 1e13, 1e14,
                                                                                HUGE)]
    mu, var = (np.array(c) for c in zip(*grid, strict=True))
    got_m, got_v = _rule64(case, mu, var)
    assert np.all(np.isfinite(got_m)) and np.all(np.isfinite(got_v)) and np.all(got_v >= 0)
    for (m, v), (want_m, want_v) in LIMITS[name].items():
        gm, gv = _rule64(case, np.array([m]), np.array([v]))
        np.testing.assert_allclose([gm[0], gv[0]], [want_m, want_v], rtol=1e-6, atol=1e-300)
    if name in RELU_LIKE:  # huge variance: the ReLU moments σ/√(2π), v·(1/2 − 1/(2π))
        gm, gv = _rule64(case, np.array([0.0]), np.array([HUGE]))
        np.testing.assert_allclose([gm[0], gv[0]], [math.sqrt(HUGE / (2 * math.pi)), HUGE * (0.5 - 0.5 / math.pi)],
                                   rtol=1e-6)


def test_symmetries() -> None:
    mu, var = np.array([-3.0, -0.4, 0.0, 1.1, 7.0]), np.array([0.01, 0.3, 1.0, 5.0, 60.0])
    m1, v1 = M.sigmoid_moments(mu, var)
    m2, v2 = M.sigmoid_moments(-mu, var)
    np.testing.assert_allclose(m1, 1 - m2, rtol=0, atol=1e-15)
    np.testing.assert_allclose(v1, v2, rtol=1e-13)
    t1, w1 = M.tanh_moments(mu, var)
    t2, w2 = M.tanh_moments(-mu, var)
    np.testing.assert_allclose(t1, -t2, rtol=0, atol=1e-15)
    np.testing.assert_allclose(w1, w2, rtol=1e-13)
    h1, u1 = M.hardtanh_moments(mu, var, -1.0, 1.0)
    h2, u2 = M.hardtanh_moments(-mu, var, -1.0, 1.0)
    np.testing.assert_allclose(h1, -h2, rtol=0, atol=1e-15)
    np.testing.assert_allclose(u1, u2, rtol=1e-12)


def test_clipped_gaussian_with_infinite_upper_bound_is_relu() -> None:
    """(Not in the far left tail: relu_moments' g(α) form loses relative accuracy there, 2e-9 at
    α = −20 in float64, while the clipped-Gaussian form keeps it; see the quadrature test.)"""
    mu = np.array([-6.0, -1.0, 0.0, 0.5, 3.0, 40.0])
    for v in (0.0, 1e-10, 0.5, 4.0, 1e6):
        var = np.full_like(mu, v)
        hm, hv = M.hardtanh_moments(mu, var, 0.0, math.inf)
        rm, rv = M.relu_moments(mu, var)
        np.testing.assert_allclose(hm, rm, rtol=1e-11, atol=1e-300)
        np.testing.assert_allclose(hv, rv, rtol=1e-9, atol=1e-15 * v)


def test_bad_attributes_are_named() -> None:
    with pytest.raises(ValueError, match="hardtanh_moments.*lo < hi"):
        M.hardtanh_moments(np.zeros(1), np.ones(1), 1.0, 1.0)
    with pytest.raises(ValueError, match="elu_moments.*alpha > 0"):
        M.elu_moments(np.zeros(1), np.ones(1), 0.0)


def test_erfcx_rational_accuracy() -> None:
    """The float32 back ends' erfcx (Numerical Recipes' erfcc fit) is within 1.2e-7 of erfcx."""
    x = np.concatenate([np.linspace(0.0, 40.0, 200_001), np.logspace(-12, 30, 2_000)])
    assert np.max(np.abs(M.erfcx_rational(x, M.NUMPY) / sp.erfcx(x) - 1)) < 1.2e-7


# -- the same functions in float32 (TVM TE) and on ONNX symbols -------------------------------

BACKEND_GRID = [(m, v) for m in (-30.0, -20.0, -8.0, -3.0, -1.28, -0.3, 0.0, 1e-3, 0.8, 2.0, 6.5, 30.0)
                for v in (0.0, 1e-8, 1e-3, 0.04, 0.06, 0.5, 1.2, 4.0, 10.0, 100.0, 1e4)]
BACKEND_GRID += [(HUGE, 1.0), (-HUGE, 1.0), (0.0, HUGE), (HUGE, HUGE), (-HUGE, HUGE), (3.0, 1e20), (-1e6, 1e13)]
#: the logistic family beyond its clamp (GELU's float32 variance is off at these scales: its own issue)
FAR_GRID = [(m, v) for m, v in FAR_POINTS if v <= 1e14] + [(-1001.0, 1e4), (1001.0, 1e6), (-HUGE, 1e14)]


def _backend_grid(name: str) -> list[tuple[float, float]]:
    return BACKEND_GRID + (FAR_GRID if name in LOGISTIC else [])
# float32 against float64: measured maxima (benchmarks/activation_accuracy.py --te) with headroom;
# variances below 1e-30 (not representable in float32 with 7 digits) only have to be tiny
F32_MEAN_TOL, F32_VAR_TOL = 2e-5, 5e-3


def _compare_f32(name: str, got_m: np.ndarray, got_v: np.ndarray) -> None:
    mu, var = (np.array(c) for c in zip(*_backend_grid(name), strict=True))
    ref_m, ref_v = _rule64(CASES[name], mu, var)
    assert np.all(np.isfinite(got_m)) and np.all(np.isfinite(got_v)) and np.all(got_v >= 0)
    scale = np.maximum(np.abs(ref_m), np.sqrt(ref_v))
    assert np.all(np.abs(got_m - ref_m) <= F32_MEAN_TOL * scale + 1e-30), name
    big = ref_v > 1e-30
    assert np.all(np.abs(got_v[big] - ref_v[big]) <= F32_VAR_TOL * ref_v[big]), name
    assert np.all(got_v[~big] <= 1e-28), name


@pytest.fixture(scope="module")
def tvm_build() -> Callable:
    tvm = pytest.importorskip("tvm")
    from tvm import s_tir, te

    from pyro2pfp.backends.tvm.te_let import te_shared

    target = tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})

    def run(rule: Callable, grid: list[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
        mu, var = (np.array(c, np.float32) for c in zip(*grid, strict=True))
        n = len(mu) + (-len(mu)) % 8
        m = te.placeholder((n,), "float32", name="m")
        v = te.placeholder((n,), "float32", name="v")
        outs = te.compute((n,), lambda i: te_shared(lambda ops: list(rule(m[i], v[i], ops))), name="moments")
        sch = s_tir.Schedule(te.create_prim_func([m, v, *outs]))
        first = sch.get(sch.get_child_blocks(sch.get_sblock("root"))[0]).name_hint
        (loop,) = sch.get_loops(sch.get_sblock(first))
        sch.vectorize(sch.split(loop, [None, 8])[1])  # the blocks share the loop
        lib = tvm.tirx.build(sch.mod, target=target)
        args = [np.pad(mu, (0, n - len(mu))), np.pad(var, (0, n - len(var)))]
        res = [tvm.runtime.tensor(np.zeros(n, np.float32)) for _ in range(2)]
        lib(*(tvm.runtime.tensor(a) for a in args), *res)
        return tuple(r.numpy()[: len(mu)].astype(np.float64) for r in res)

    return run


# (hardtanh and elu(0.5) run the same code as relu6 and elu with other constants; they are left
# out here to keep the TVM builds, ~1-5 s each, to one per code path)
@pytest.mark.slow
@pytest.mark.parametrize("name", ["sigmoid", "tanh", "silu", "softplus", "gelu", "elu", "relu6"])
def test_float32_te_kernel_matches_float64(name: str, tvm_build: Callable) -> None:
    _compare_f32(name, *tvm_build(CASES[name].rule, _backend_grid(name)))


@pytest.mark.parametrize("name", ["sigmoid", "tanh", "silu", "softplus", "gelu", "elu", "relu6"])
def test_onnx_symbols_match_float64(name: str) -> None:
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    from pyro2pfp.backends.onnx.builder import Sym, _Builder, _onnx_ops

    b = _Builder()
    mean, var = Sym(b, "m"), Sym(b, "v")
    out_m, out_v = CASES[name].rule(mean, var, _onnx_ops(b))
    b.nodes += [helper.make_node("Identity", [out.name], [key]) for out, key in ((out_m, "mean"), (out_v, "var"))]
    io = [helper.make_tensor_value_info(k, TensorProto.FLOAT, ["n"]) for k in ("m", "v", "mean", "var")]
    graph = helper.make_graph(b.nodes, name, io[:2], io[2:], initializer=b.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    mu, var_ = (np.array(c, np.float32) for c in zip(*_backend_grid(name), strict=True))
    got_m, got_v = sess.run(["mean", "var"], {"m": mu, "v": var_})
    _compare_f32(name, got_m.astype(np.float64), got_v.astype(np.float64))
