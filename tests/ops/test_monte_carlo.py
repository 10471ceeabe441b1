"""Monte Carlo tests of the PFP moment formulas (float64 NumPy reference).

For a single op with independent Gaussian inputs and (mean-field) Gaussian weights, every PFP
formula of ``docs/math.md`` is the *exact* mean and variance of the op's output.  Each test draws
``N`` independent samples of the output — every draw with **new weights, new bias and new inputs**
— and compares the sample moments with what ``pyro2pfp.backends.reference.REFERENCES[op]`` returns, using
the bound of ``tests/support/stats.py``: ``z·se`` with ``se ∝ 1/√N`` estimated from the same draws and a
Bonferroni ``z`` for a family-wise false-alarm probability of 1e-6 per hypothesis example.

Compute layers (dense, conv2d) are tested in all three input forms the planner can choose:
deterministic input (``v = Σ vw·x² + vb``, weight variances stored), Gaussian input as the raw
moment (``moment_form="raw"``: ``v = Σ sw·sx − (μwμx)² + vb``, ``E[w²]`` stored) and Gaussian input
as the variance (``moment_form="variance"``: ``v = Σ vw·(μx² + vx) + μw²·vx + vb``).

Because the bound is derived rather than hand-picked, each op also has a deterministic
"the check can fail" test: the same check, on the same kind of sample, must reject a deliberately
wrong formula (dense variance without ``vw·vx``, ReLU mean without ``σφ(α)``, Clark's max with
``θ²`` instead of ``θ``, …).

The limit cases (zero variance, huge means, extreme inputs) are tested without sampling, against
exact answers (mpmath where needed).
"""
from __future__ import annotations

import functools
import math
from dataclasses import replace
from fractions import Fraction

import hypothesis.extra.numpy as hnp
import mpmath
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.special import ndtr

from pyro2pfp import moments
from pyro2pfp import ops as ops  # the op registry (contracts, references) that plan and execute read
from pyro2pfp.backends.reference import REFERENCES, Activation, execute
from pyro2pfp.backends.reference.arrays import conv2d_nchw
from pyro2pfp.planning.graph import GaussianParam, Layer, LayerGraph, Repr
from pyro2pfp.planning.plan import PlannedLayer, has_deterministic_weights, plan
from tests.support.op_coverage import MONTE_CARLO, covers
from tests.support.stats import EPS, assert_check_rejects, assert_moments_agree

D, V, S = Repr.DETERMINISTIC, Repr.VARIANCE, Repr.SECOND_MOMENT

N_MC = 200_000  # Monte Carlo draws per check
CHUNK_BYTES = 64 * 2**20  # working-set bound of one sampling chunk

MC_SETTINGS = settings(max_examples=15, deadline=None, derandomize=False,
                       suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FAST_SETTINGS = settings(max_examples=200, deadline=None)

seeds = st.integers(0, 2**63 - 1)


def _phi(x):
    return np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


# --------------------------------------------------------------------------------------------
# Building one-layer planned graphs (the real planner decides the stored tensors and reprs)
# --------------------------------------------------------------------------------------------

def plan_one_layer(layer: Layer, in_shape: tuple[int, ...], input_variance: bool,
                   calibration: float = 1.0, moment_form: str = "variance"):
    graph = LayerGraph(input_shape=in_shape, layers=[layer], output=layer.name,
                       input_variance=input_variance)
    planned = plan(graph, calibration, moment_form=moment_form)
    return planned, planned.layer(layer.name)


def compute_layer(op: str, out_shape, attrs, w_mean, w_var, b_mean=None, b_var=None) -> Layer:
    params = {"weight": GaussianParam(w_mean, w_var, site=f"{op}.weight")}
    if b_mean is not None:
        b_var = np.zeros_like(b_mean) if b_var is None else b_var
        params["bias"] = GaussianParam(b_mean, b_var, site=f"{op}.bias" if np.any(b_var) else None)
    return Layer(name=op, op=op, inputs=["input"], out_shape=tuple(out_shape),
                 source=f"{op} (test_monte_carlo)", attrs=dict(attrs), params=params)


# Input forms of a compute layer: deterministic input, Gaussian input given as the raw second
# moment (the paper's plan, moment_form="raw") or as the variance (moment_form="variance").
FORMS = ("deterministic", "raw", "variance")


def run_compute(op, layer, in_shape, x_mean, x_var, calibration, form):
    """Run ``op`` through REFERENCES on a deterministic / raw-moment / variance input.

    Also checks the plan (stored tensors, representations), the full executor and the
    second-moment epilogue.  Returns (mean, variance) of the output.
    """
    assert form in FORMS and (x_var is None) == (form == "deterministic")
    planned, pl = plan_one_layer(layer, in_shape, x_var is not None, calibration,
                                 "raw" if form == "raw" else "variance")
    t = pl.tensors
    if form == "raw":
        assert pl.in_reprs == [S] and "weight_second_moment" in t and "weight_var" not in t
        inp = Activation(x_mean, x_mean * x_mean + x_var, S)  # the raw second moment E[x²]
    elif form == "variance":
        assert pl.in_reprs == [V] and "weight_var" in t and "weight_second_moment" not in t
        inp = Activation(x_mean, x_var, V)
    else:
        assert pl.in_reprs == [D] and "weight_var" in t and "weight_second_moment" not in t
        inp = Activation(x_mean, None, D)
    if form == "deterministic" and has_deterministic_weights(layer, calibration):
        # zero weight variances and a deterministic input: the layer is planned deterministic
        assert pl.out_repr is D
        out = REFERENCES[op](pl, [inp])
        assert out.repr is D
        ex_mean, ex_var = execute(planned, x_mean, x_var)
        np.testing.assert_allclose(ex_mean, out.mean, rtol=1e-14, atol=0)
        np.testing.assert_array_equal(ex_var, 0.0)
        return out.mean, np.zeros_like(out.mean)
    assert pl.out_repr is V
    out = REFERENCES[op](pl, [inp])
    assert out.repr is V
    # the same through the executor (incl. the inserted input conversion) ...
    ex_mean, ex_var = execute(planned, x_mean, x_var)
    np.testing.assert_allclose(ex_mean, out.mean, rtol=1e-14, atol=0)
    np.testing.assert_allclose(ex_var, out.second, rtol=1e-12, atol=1e-14 * np.max(out.second, initial=0))
    # ... and emitting the raw moment instead is exactly the epilogue s = μ² + v
    out_s = REFERENCES[op](replace(pl, out_repr=S), [inp])
    assert out_s.repr is S
    np.testing.assert_array_equal(out_s.mean, out.mean)
    np.testing.assert_array_equal(out_s.second, moments.variance_to_second(out.mean, out.second))
    return out.mean, out.second


def elementwise_layer(op: str, in_shape, out_shape, attrs=None, out_repr: Repr = V) -> PlannedLayer:
    layer = Layer(name=op, op=op, inputs=["input"], out_shape=tuple(out_shape),
                  source=f"{op} (test_monte_carlo)", attrs=dict(attrs or {}))
    _, pl = plan_one_layer(layer, tuple(in_shape), input_variance=True)
    assert pl.in_reprs == [V]
    return replace(pl, out_repr=out_repr)


# --------------------------------------------------------------------------------------------
# Samplers (each draw: new weights, new bias, new input)
# --------------------------------------------------------------------------------------------

def _chunks(n: int, floats_per_draw: int):
    size = max(1, min(n, CHUNK_BYTES // (8 * max(1, floats_per_draw))))
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


def mc_dense(rng, n, x_mean, x_std, w_mean, w_std, b_mean=None, b_std=None):
    """Draws of ``x @ w.T + b``; ``x_std=None``: deterministic input. Shape (n, B, O)."""
    bsz, k = x_mean.shape
    o = w_mean.shape[0]
    out = np.empty((n, bsz, o))
    for sl in _chunks(n, 3 * (o * k + bsz * k + bsz * o)):
        m = sl.stop - sl.start
        w = w_mean + w_std * rng.standard_normal((m, o, k))
        x = x_mean if x_std is None else x_mean + x_std * rng.standard_normal((m, bsz, k))
        y = np.matmul(x, w.transpose(0, 2, 1))
        if b_mean is not None:
            y = y + (b_mean + b_std * rng.standard_normal((m, 1, o)))
        out[sl] = y
    return out


def conv_by_definition(x, w, stride, padding, dilation, groups):
    """``out[n,o,i,j] = Σ_{c,p,q} w[n,o,c,p,q] · xpad[n, g(o)·C/G + c, i·s + p·d, j·s + q·d]``.

    Per-draw weights ``w`` of shape (n, O, C/G, kh, kw); ``x`` of shape (n, C, H, W).  Written
    from the definition (gather + batched dot), independently of the library's convolution.
    """
    n, c, h, wd = x.shape
    _, o, cg, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (padding[0], padding[0]), (padding[1], padding[1])))
    oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (wd + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    rows = np.arange(oh)[:, None] * stride[0] + np.arange(kh)[None, :] * dilation[0]  # (oh, kh)
    cols = np.arange(ow)[:, None] * stride[1] + np.arange(kw)[None, :] * dilation[1]  # (ow, kw)
    chan = (np.arange(o) // (o // groups))[:, None] * cg + np.arange(cg)[None, :]  # (O, cg)
    # gathered straight into (n, O, oh, ow, cg, kh, kw) order
    patches = xp[:, chan[:, None, None, :, None, None], rows[None, :, None, None, :, None],
                 cols[None, None, :, None, None, :]]
    return np.einsum("noijk,nok->noij", patches.reshape(n, o, oh, ow, cg * kh * kw),
                     w.reshape(n, o, cg * kh * kw))


def mc_conv(rng, n, x_mean, x_std, w_mean, w_std, b_mean, b_std, attrs):
    """Draws of conv2d(x, w) + b, shape (n, B=1, O, OH, OW)."""
    _, c, h, wd = x_mean.shape
    o, cg, kh, kw = w_mean.shape
    s, p, d, g = attrs["stride"], attrs["padding"], attrs["dilation"], attrs["groups"]
    oh = (h + 2 * p[0] - d[0] * (kh - 1) - 1) // s[0] + 1
    ow = (wd + 2 * p[1] - d[1] * (kw - 1) - 1) // s[1] + 1
    out = np.empty((n, 1, o, oh, ow))
    per_draw = 2 * (o * cg * kh * kw * oh * ow + c * (h + 2) * (wd + 2))
    for sl in _chunks(n, per_draw):
        m = sl.stop - sl.start
        w = w_mean + w_std * rng.standard_normal((m, o, cg, kh, kw))
        if x_std is None:
            x = np.broadcast_to(x_mean, (m, c, h, wd))
        else:
            x = x_mean + x_std * rng.standard_normal((m, c, h, wd))
        y = conv_by_definition(x, w, s, p, d, g)
        if b_mean is not None:
            y = y + (b_mean + b_std * rng.standard_normal((m, o)))[:, :, None, None]
        out[sl, 0] = y
    return out


def mc_relu(rng, n, mean, std):
    """Draws of max(0, a), a ~ N(mean, std²) elementwise; returns (samples, importance weights).

    Where ``mean < 0`` the draws come from the proposal N(0, std²) (half of them positive) with
    weights ``p/q = exp(α·ε − α²/2)``, α = mean/std: plain sampling would essentially never see
    a positive value at α = −8 (probability 6e-16).  Where ``mean ≥ 0`` the weights are exactly 1.
    """
    alpha = np.where(mean < 0, mean / std, 0.0)
    center = np.where(mean < 0, 0.0, mean)
    eps = rng.standard_normal((n, *mean.shape))
    x = np.maximum(center + std * eps, 0.0)
    w = np.exp(alpha * eps - 0.5 * alpha * alpha)
    return x, w


def mc_max(rng, n, m1, s1, m2, s2):
    """Draws of max(X1, X2) for independent X1 ~ N(m1, s1²), X2 ~ N(m2, s2²)."""
    x1 = m1 + s1 * rng.standard_normal((n, *np.shape(m1)))
    x2 = m2 + s2 * rng.standard_normal((n, *np.shape(m2)))
    return np.maximum(x1, x2)


# --------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------

def uniform_array(shape, lo, hi):
    """Floats in [lo, hi]; magnitudes below 1e-6 become 0 (products of values like 1e-300 would
    test subnormal underflow, not the moment formulas)."""
    elements = st.floats(lo, hi, allow_subnormal=False).map(lambda v: v if abs(v) >= 1e-6 else 0.0)
    return hnp.arrays(np.float64, shape, elements=elements)


calibrations = st.sampled_from([1.0, 0.3, 0.4]) | st.floats(0.05, 2.0)


@st.composite
def dense_cases(draw):
    form = draw(st.sampled_from(FORMS))
    gaussian_input = form != "deterministic"
    bsz, k, o = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(1, 4))
    sx, sw = 10.0 ** draw(st.integers(-4, 4)), 10.0 ** draw(st.integers(-4, 4))
    x_mean = sx * draw(uniform_array((bsz, k), -2, 2))
    x_std = sx * 10 ** draw(uniform_array((bsz, k), -2, 0.5)) if gaussian_input else None
    w_mean = sw * draw(uniform_array((o, k), -1.5, 1.5))
    w_std = sw * 10 ** draw(uniform_array((o, k), -2.5, 0))
    bias = draw(st.sampled_from(["prob", "prob", "det", "none"]))
    b_mean = b_std = None
    if bias != "none":
        b_mean = sx * sw * draw(uniform_array((o,), -2, 2))
        b_std = (sx * sw * 10 ** draw(uniform_array((o,), -2, 0.5)) if bias == "prob"
                 else np.zeros(o))
    return dict(x_mean=x_mean, x_std=x_std, w_mean=w_mean, w_std=w_std, b_mean=b_mean,
                b_std=b_std, calibration=draw(calibrations), seed=draw(seeds), form=form)


@st.composite
def conv_cases(draw):
    form = draw(st.sampled_from(FORMS))
    gaussian_input = form != "deterministic"
    c, o = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    groups = c if (c == o and c > 1 and draw(st.booleans())) else 1
    h, wd = draw(st.integers(3, 6)), draw(st.integers(3, 6))
    kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    stride = [draw(st.integers(1, 2)), draw(st.integers(1, 2))]
    padding = [draw(st.integers(0, 1)), draw(st.integers(0, 1))]
    dilation = [1, 1]
    if draw(st.integers(0, 3)) == 0:  # dilation 2 where the kernel still fits
        dilation = [2 if 2 * (kh - 1) + 1 <= h + 2 * padding[0] else 1,
                    2 if 2 * (kw - 1) + 1 <= wd + 2 * padding[1] else 1]
    sx, sw = 10.0 ** draw(st.integers(-3, 3)), 10.0 ** draw(st.integers(-3, 3))
    x_mean = sx * draw(uniform_array((1, c, h, wd), -2, 2))
    x_std = sx * 10 ** draw(uniform_array((1, c, h, wd), -2, 0.5)) if gaussian_input else None
    w_mean = sw * draw(uniform_array((o, c // groups, kh, kw), -1.5, 1.5))
    w_std = sw * 10 ** draw(uniform_array((o, c // groups, kh, kw), -2.5, 0))
    b_mean = b_std = None
    if draw(st.booleans()):
        b_mean = sx * sw * draw(uniform_array((o,), -2, 2))
        b_std = sx * sw * 10 ** draw(uniform_array((o,), -2, 0.5))
    attrs = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}
    return dict(x_mean=x_mean, x_std=x_std, w_mean=w_mean, w_std=w_std, b_mean=b_mean,
                b_std=b_std, attrs=attrs, calibration=draw(calibrations), seed=draw(seeds), form=form)


# --------------------------------------------------------------------------------------------
# 1. dense
# --------------------------------------------------------------------------------------------

def dense_reference(case):
    c = case["calibration"]
    w_var = case["w_std"] ** 2
    b_var = None if case["b_mean"] is None else case["b_std"] ** 2
    layer = compute_layer("dense", (case["w_mean"].shape[0],), {}, case["w_mean"], w_var,
                          case["b_mean"], b_var)
    x_var = None if case["x_std"] is None else case["x_std"] ** 2
    return run_compute("dense", layer, (case["x_mean"].shape[1],), case["x_mean"], x_var, c,
                       case["form"])


def dense_samples(case, n=N_MC):
    rc = math.sqrt(case["calibration"])  # the planner multiplies every weight variance by c
    b_std = None if case["b_mean"] is None else rc * case["b_std"]
    return mc_dense(np.random.default_rng(case["seed"]), n, case["x_mean"], case["x_std"],
                    case["w_mean"], rc * case["w_std"], case["b_mean"], b_std)


@pytest.mark.slow
@covers("dense", kind=MONTE_CARLO)
@MC_SETTINGS
@given(dense_cases())
def test_dense_moments_match_monte_carlo(case):
    mean, var = dense_reference(case)
    assert_moments_agree(dense_samples(case), mean, var)


@functools.cache
def fixed_dense_case(form: str):
    rng = np.random.default_rng(20240601)
    bsz, k, o = 2, 5, 3
    return dict(x_mean=rng.uniform(-1, 1, (bsz, k)),
                x_std=None if form == "deterministic" else np.full((bsz, k), 0.5),
                w_mean=rng.uniform(-0.5, 0.5, (o, k)), w_std=np.full((o, k), 0.4),
                b_mean=rng.uniform(-1, 1, o), b_std=np.full(o, 0.3), calibration=1.0, seed=11,
                form=form)


@functools.cache
def fixed_dense_samples(gaussian_input: bool):
    # the same draws serve the raw and the variance form (same distribution, same seed)
    return dense_samples(fixed_dense_case("raw" if gaussian_input else "deterministic"))


def _dense_wrong(name):
    """(mean, var) of a deliberately wrong dense formula on the fixed case."""
    case = fixed_dense_case("deterministic" if name == "sw_for_deterministic_input" else "raw")
    xm, wm, bm = case["x_mean"], case["w_mean"], case["b_mean"]
    vw, vb = case["w_std"] ** 2, case["b_std"] ** 2
    mean = xm @ wm.T + bm
    if name == "sw_for_deterministic_input":  # E[w²] instead of Var[w] with a known input
        return mean, (xm**2) @ (wm**2 + vw).T + vb
    vx = case["x_std"] ** 2
    if name == "no_vw_vx_term":  # Σ vw μx² + μw² vx + vb  (forgets vw·vx)
        return mean, (xm**2) @ vw.T + vx @ (wm**2).T + vb
    if name == "no_bias_variance":
        return mean, (xm**2) @ vw.T + vx @ (wm**2).T + vx @ vw.T
    if name == "variance_for_raw_moment":  # Σ sw·vx − (μwμx)²: variance fed where sx is due
        return mean, np.maximum(vx @ (wm**2 + vw).T - (xm**2) @ (wm**2).T, 0) + vb
    raise KeyError(name)


@pytest.mark.parametrize("form", FORMS)
def test_dense_check_accepts_the_library_on_the_fixed_case(form):
    mean, var = dense_reference(fixed_dense_case(form))
    assert_moments_agree(fixed_dense_samples(form != "deterministic"), mean, var)


@pytest.mark.parametrize("wrong", ["no_vw_vx_term", "no_bias_variance", "variance_for_raw_moment",
                                   "sw_for_deterministic_input"])
def test_dense_check_rejects_wrong_formula(wrong):
    gaussian_input = wrong != "sw_for_deterministic_input"
    mean, var = _dense_wrong(wrong)
    res = assert_check_rejects(fixed_dense_samples(gaussian_input), mean, var)
    assert res.score() > 3, res.report()  # rejected by a wide margin, not by luck


def test_dense_vw_vx_term_is_caught_when_it_is_a_small_fraction():
    """Power: the missing vw·vx term is only ~3% of the output variance here and is still rejected."""
    rng = np.random.default_rng(7)
    k, o = 8, 2
    case = dict(x_mean=rng.choice([-1.0, 1.0], (1, k)) * 2.0, x_std=np.full((1, k), 0.4),
                w_mean=rng.choice([-1.0, 1.0], (o, k)) * 1.0, w_std=np.full((o, k), 0.4),
                b_mean=np.zeros(o), b_std=np.full(o, 0.1), calibration=1.0, seed=3, form="raw")
    mean, var = dense_reference(case)
    samples = dense_samples(case)
    assert_moments_agree(samples, mean, var)
    np.testing.assert_allclose(dense_reference({**case, "form": "variance"})[1], var, rtol=1e-12)
    vw, vx = case["w_std"] ** 2, case["x_std"] ** 2
    missing = vx @ vw.T
    assert np.all(missing / var < 0.04)
    assert_check_rejects(samples, mean, var - missing)


# --------------------------------------------------------------------------------------------
# 2. conv2d
# --------------------------------------------------------------------------------------------

def conv_reference(case):
    o = case["w_mean"].shape[0]
    _, c, h, wd = case["x_mean"].shape
    a = case["attrs"]
    kh, kw = case["w_mean"].shape[2:]
    oh = (h + 2 * a["padding"][0] - a["dilation"][0] * (kh - 1) - 1) // a["stride"][0] + 1
    ow = (wd + 2 * a["padding"][1] - a["dilation"][1] * (kw - 1) - 1) // a["stride"][1] + 1
    b_var = None if case["b_mean"] is None else case["b_std"] ** 2
    layer = compute_layer("conv2d", (o, oh, ow), a, case["w_mean"], case["w_std"] ** 2,
                          case["b_mean"], b_var)
    x_var = None if case["x_std"] is None else case["x_std"] ** 2
    mean, var = run_compute("conv2d", layer, (c, h, wd), case["x_mean"], x_var, case["calibration"],
                            case["form"])
    assert mean.shape == (1, o, oh, ow)
    return mean, var


def conv_samples(case, n=N_MC):
    rc = math.sqrt(case["calibration"])
    b_std = None if case["b_mean"] is None else rc * case["b_std"]
    return mc_conv(np.random.default_rng(case["seed"]), n, case["x_mean"], case["x_std"],
                   case["w_mean"], rc * case["w_std"], case["b_mean"], b_std, case["attrs"])


@pytest.mark.slow
@covers("conv2d", kind=MONTE_CARLO)
@MC_SETTINGS
@given(conv_cases())
def test_conv2d_moments_match_monte_carlo(case):
    mean, var = conv_reference(case)
    assert_moments_agree(conv_samples(case), mean, var)


def test_conv_by_definition_matches_a_plain_convolution():
    """The sampler's convolution agrees with the library's on deterministic arrays (sanity)."""
    rng = np.random.default_rng(5)
    for groups, stride, padding, dilation in [(1, [1, 1], [0, 0], [1, 1]), (2, [2, 1], [1, 0], [1, 2]),
                                              (1, [2, 2], [1, 1], [2, 2])]:
        x = rng.standard_normal((3, 2, 6, 5))
        w = rng.standard_normal((2, 2 // groups, 3, 2))
        ref = conv2d_nchw(x, w, stride, padding, dilation, groups)
        mine = conv_by_definition(x, np.broadcast_to(w, (3, *w.shape)), stride, padding, dilation, groups)
        np.testing.assert_allclose(mine, ref, rtol=1e-12, atol=1e-12)


@functools.cache
def fixed_conv_case():
    rng = np.random.default_rng(99)
    return dict(x_mean=rng.uniform(-1, 1, (1, 2, 5, 5)), x_std=np.full((1, 2, 5, 5), 0.5),
                w_mean=rng.uniform(-0.6, 0.6, (2, 2, 3, 3)), w_std=np.full((2, 2, 3, 3), 0.3),
                b_mean=rng.uniform(-1, 1, 2), b_std=np.full(2, 0.2),
                attrs={"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 1},
                calibration=1.0, seed=12, form="raw")


@functools.cache
def fixed_conv_samples():
    return conv_samples(fixed_conv_case())


def _conv_wrong(name):
    case = fixed_conv_case()
    a = case["attrs"]

    def conv(x, w):
        return conv2d_nchw(x, w, a["stride"], a["padding"], a["dilation"], a["groups"])

    xm, wm, vx, vw = case["x_mean"], case["w_mean"], case["x_std"] ** 2, case["w_std"] ** 2
    bm, vb = case["b_mean"][None, :, None, None], (case["b_std"] ** 2)[None, :, None, None]
    mean = conv(xm, wm) + bm
    var = conv(xm**2, vw) + conv(vx, wm**2) + conv(vx, vw) + vb
    if name == "no_vw_vx_term":
        return mean, var - conv(vx, vw)
    if name == "flipped_kernel":  # convolution instead of cross-correlation
        return conv(xm, wm[:, :, ::-1, ::-1]) + bm, var
    if name == "variance_ignores_padding":  # 'valid' variance map zero-padded back to shape
        inner = conv2d_nchw(xm**2, vw, [1, 1], [0, 0], [1, 1], 1) + conv2d_nchw(
            vx, wm**2 + vw, [1, 1], [0, 0], [1, 1], 1)
        wrong = np.pad(inner, ((0, 0), (0, 0), (1, 1), (1, 1))) + vb
        return mean, wrong
    raise KeyError(name)


@pytest.mark.parametrize("form", [pytest.param("raw", marks=pytest.mark.slow), "variance"])
def test_conv2d_check_accepts_the_library_on_the_fixed_case(form):
    mean, var = conv_reference({**fixed_conv_case(), "form": form})
    assert_moments_agree(fixed_conv_samples(), mean, var)


@pytest.mark.parametrize("wrong", ["no_vw_vx_term", "flipped_kernel", "variance_ignores_padding"])
def test_conv2d_check_rejects_wrong_formula(wrong):
    mean, var = _conv_wrong(wrong)
    res = assert_check_rejects(fixed_conv_samples(), mean, var)
    assert res.score() > 3, res.report()


# --------------------------------------------------------------------------------------------
# 3. ReLU
# --------------------------------------------------------------------------------------------

def relu_reference(mean, var):
    """ReLU through REFERENCES on a (1, k) variance input; also checks the raw-moment output."""
    k = mean.shape[-1]
    pl = elementwise_layer("relu", (k,), (k,), out_repr=V)
    inp = Activation(mean[None], var[None], V)
    out = REFERENCES["relu"](pl, [inp])
    assert out.repr is V
    out_s = REFERENCES["relu"](replace(pl, out_repr=S), [inp])  # ReLU's natural output
    assert out_s.repr is S
    np.testing.assert_array_equal(out_s.mean, out.mean)
    np.testing.assert_array_equal(out_s.second, out.mean**2 + out.second)
    # the shared moment function is what the reference uses
    mm, mv = moments.relu_moments(mean, var)
    np.testing.assert_array_equal(out.mean[0], mm)
    np.testing.assert_array_equal(out.second[0], mv)
    return out.mean[0], out.second[0]


alphas = st.floats(-8, 8) | st.sampled_from([-8.0, 8.0, 0.0, -5.0, 5.0])


@st.composite
def relu_cases(draw):
    k = draw(st.integers(1, 6))
    alpha = np.array(draw(st.lists(alphas, min_size=k, max_size=k)))
    std = 10.0 ** np.array(draw(st.lists(st.floats(-12, 6), min_size=k, max_size=k)))
    return alpha * std, std, draw(seeds)


@pytest.mark.slow
@covers("relu", kind=MONTE_CARLO)
@MC_SETTINGS
@given(relu_cases())
def test_relu_moments_match_monte_carlo(case):
    mean, std, seed = case
    out_mean, out_var = relu_reference(mean, std**2)
    x, w = mc_relu(np.random.default_rng(seed), N_MC, mean, std)
    assert_moments_agree(x, out_mean, out_var, weights=w)


RELU_FIXED_MEAN = np.array([-8.0, -6.0, -3.0, -1.0, -0.2, 0.0, 0.4, 1.5, 3.0, 8.0]) * 1e-10
RELU_FIXED_STD = np.full(10, 1e-10)  # |μ|/σ up to 8, variance 1e-20


def test_relu_extreme_ratio_and_tiny_variance_match_monte_carlo():
    out_mean, out_var = relu_reference(RELU_FIXED_MEAN, RELU_FIXED_STD**2)
    x, w = mc_relu(np.random.default_rng(1), N_MC, RELU_FIXED_MEAN, RELU_FIXED_STD)
    assert_moments_agree(x, out_mean, out_var, weights=w)


@functools.cache
def fixed_relu_case():
    mean = np.array([-2.0, -0.5, 0.0, 0.7, 3.0]) * 1.5
    std = np.full(5, 1.5)
    x, w = mc_relu(np.random.default_rng(13), N_MC, mean, std)
    return mean, std, x, w


def _relu_wrong(name, mean, std):
    var = std**2
    a = mean / std
    cdf, pdf = ndtr(a), _phi(a)
    mu = mean * cdf + std * pdf
    s = (mean**2 + var) * cdf + mean * std * pdf
    if name == "mean_without_sigma_phi":
        return mean * cdf, s - (mean * cdf) ** 2
    if name == "alpha_with_variance":  # α = μ/v instead of μ/σ (σ = 1.5 here)
        a2 = mean / var
        m2 = mean * ndtr(a2) + std * _phi(a2)
        return m2, (mean**2 + var) * ndtr(a2) + mean * std * _phi(a2) - m2**2
    if name == "second_moment_without_mu_sigma_phi":
        return mu, (mean**2 + var) * cdf - mu**2
    if name == "variance_is_var_times_cdf":  # a plausible shortcut: v·Φ(α)
        return mu, var * cdf
    raise KeyError(name)


def test_relu_check_accepts_the_library_on_the_fixed_case():
    mean, std, x, w = fixed_relu_case()
    out_mean, out_var = relu_reference(mean, std**2)
    assert_moments_agree(x, out_mean, out_var, weights=w)
    # sanity of the hand-written formulas used by the wrong variants below
    m, v = _relu_wrong("variance_is_var_times_cdf", mean, std)
    np.testing.assert_allclose(m, out_mean, rtol=1e-13)


@pytest.mark.parametrize("wrong", ["mean_without_sigma_phi", "alpha_with_variance",
                                   "second_moment_without_mu_sigma_phi", "variance_is_var_times_cdf"])
def test_relu_check_rejects_wrong_formula(wrong):
    mean, std, x, w = fixed_relu_case()
    m, v = _relu_wrong(wrong, mean, std)
    res = assert_check_rejects(x, m, v, weights=w)
    assert res.score() > 3, res.report()


def test_relu_check_without_importance_weights_rejects_missing_sigma_phi():
    """The same rejection with plain sampling (no importance weights) at moderate |α|."""
    mean = np.array([-1.0, 0.0, 0.5, 2.0])
    std = np.array([1.0, 2.0, 0.5, 1.0])
    out_mean, out_var = relu_reference(mean, std**2)
    x = np.maximum(mean + std * np.random.default_rng(2).standard_normal((N_MC, 4)), 0.0)
    assert_moments_agree(x, out_mean, out_var)
    m, v = _relu_wrong("mean_without_sigma_phi", mean, std)
    assert_check_rejects(x, m, v)


# --------------------------------------------------------------------------------------------
# 4. max of two Gaussians / max_pool2d over a 2-element window
# --------------------------------------------------------------------------------------------

def pool_pair_reference(m1, v1, m2, v2, vertical: bool):
    """max_pool2d over a (1×2) or (2×1) window holding exactly the two elements, k in the batch."""
    k = m1.shape[0]
    shape = (k, 1, 2, 1) if vertical else (k, 1, 1, 2)
    kernel = [2, 1] if vertical else [1, 2]
    attrs = {"kernel": kernel, "stride": list(kernel), "padding": [0, 0], "dilation": [1, 1],
             "ceil_mode": False}
    pl = elementwise_layer("max_pool2d", shape[1:], (1, 1, 1), attrs, out_repr=V)
    mean = np.stack([m1, m2], axis=1).reshape(shape)
    var = np.stack([v1, v2], axis=1).reshape(shape)
    out = REFERENCES["max_pool2d"](pl, [Activation(mean, var, V)])
    assert out.repr is V and out.mean.shape == (k, 1, 1, 1)
    out_s = REFERENCES["max_pool2d"](replace(pl, out_repr=S), [Activation(mean, var, V)])
    np.testing.assert_array_equal(out_s.second, out.mean**2 + out.second)
    # the reference is Clark's pairwise max of the two window elements
    mm, mv = moments.max_moments(m1, v1, m2, v2)
    np.testing.assert_array_equal(out.mean.reshape(k), mm)
    np.testing.assert_array_equal(out.second.reshape(k), mv)
    return out.mean.reshape(k), out.second.reshape(k)


@st.composite
def max_cases(draw):
    """Pairs with |μ1 − μ2|/θ ≤ 6, std ratio ≤ 10, a common scale 1e-8..1e8 and offset up to 1e6·scale."""
    k = draw(st.integers(1, 4))
    scale = 10.0 ** draw(st.floats(-8, 8))
    m1, s1, m2, s2 = (np.empty(k) for _ in range(4))
    for i in range(k):
        alpha = draw(st.floats(-6, 6) | st.sampled_from([0.0, -6.0, 6.0]))
        ratio = 10.0 ** draw(st.floats(-1, 1))
        offset = draw(st.sampled_from([0.0]) | st.floats(-1, 6).map(lambda e: 10.0**e)
                      | st.floats(-1, 6).map(lambda e: -(10.0**e)))
        sa, sb = scale, scale * ratio
        theta = math.hypot(sa, sb)
        ma = offset * scale
        mb = ma + alpha * theta
        if draw(st.booleans()):
            sa, sb, ma, mb = sb, sa, mb, ma
        m1[i], s1[i], m2[i], s2[i] = ma, sa, mb, sb
    return m1, s1, m2, s2, draw(st.booleans()), draw(seeds)


@pytest.mark.slow
@covers("max_pool2d", kind=MONTE_CARLO)
@MC_SETTINGS
@given(max_cases())
def test_max_pool_pair_matches_monte_carlo(case):
    m1, s1, m2, s2, vertical, seed = case
    mean, var = pool_pair_reference(m1, s1**2, m2, s2**2, vertical)
    samples = mc_max(np.random.default_rng(seed), N_MC, m1, s1, m2, s2)
    assert_moments_agree(samples, mean, var)


@functools.cache
def fixed_max_case():
    # θ = √(0.5 + 1.3) ≈ 1.34, α from −1.5 to 2: Clark's correction terms all matter
    m1 = np.array([0.0, 1.0, -2.0, 3.0, 10.0])
    m2 = m1 - np.array([-1.5, -0.3, 0.0, 0.8, 2.0]) * math.sqrt(1.8)
    v1, v2 = np.full(5, 0.5), np.full(5, 1.3)
    samples = mc_max(np.random.default_rng(14), N_MC, m1, np.sqrt(v1), m2, np.sqrt(v2))
    return m1, v1, m2, v2, samples


def _clark_wrong(name, m1, v1, m2, v2):
    theta = np.sqrt(v1 + v2)
    a = (m1 - m2) / theta
    cdf, cdfn, pdf = ndtr(a), ndtr(-a), _phi(a)
    mu = m1 * cdf + m2 * cdfn + theta * pdf
    s = (m1**2 + v1) * cdf + (m2**2 + v2) * cdfn + (m1 + m2) * theta * pdf
    if name == "theta_squared_in_mean":
        mu2 = m1 * cdf + m2 * cdfn + theta**2 * pdf
        return mu2, s - mu**2
    if name == "theta_squared_in_alpha":
        a2 = (m1 - m2) / theta**2
        c2, cn2, p2 = ndtr(a2), ndtr(-a2), _phi(a2)
        mu2 = m1 * c2 + m2 * cn2 + theta * p2
        return mu2, (m1**2 + v1) * c2 + (m2**2 + v2) * cn2 + (m1 + m2) * theta * p2 - mu2**2
    if name == "variance_without_cross_term":  # s without (μ1 + μ2)·θ·φ(α)
        return mu, np.maximum((m1**2 + v1) * cdf + (m2**2 + v2) * cdfn - mu**2, 0)
    if name == "variance_mixture_only":  # v1·Φ(α) + v2·Φ(−α), i.e. g(α) dropped
        return mu, v1 * cdf + v2 * cdfn
    raise KeyError(name)


def test_max_check_accepts_the_library_on_the_fixed_case():
    m1, v1, m2, v2, samples = fixed_max_case()
    mean, var = pool_pair_reference(m1, v1, m2, v2, vertical=False)
    assert_moments_agree(samples, mean, var)
    mu, _ = _clark_wrong("variance_mixture_only", m1, v1, m2, v2)
    np.testing.assert_allclose(mu, mean, rtol=1e-13)


@pytest.mark.parametrize("wrong", ["theta_squared_in_mean", "theta_squared_in_alpha",
                                   "variance_without_cross_term", "variance_mixture_only"])
def test_max_check_rejects_wrong_formula(wrong):
    m1, v1, m2, v2, samples = fixed_max_case()
    mean, var = _clark_wrong(wrong, m1, v1, m2, v2)
    res = assert_check_rejects(samples, mean, var)
    assert res.score() > 3, res.report()


# --------------------------------------------------------------------------------------------
# Representation conversions
# --------------------------------------------------------------------------------------------

@covers("convert", kind=MONTE_CARLO)
@MC_SETTINGS
@given(st.floats(-3, 3), st.floats(-3, 1), seeds)
def test_raw_second_moment_matches_monte_carlo(mu, log_std, seed):
    std = 10.0**log_std
    mean, var = np.array([mu]), np.array([std * std])
    s = moments.variance_to_second(mean, var)
    x = mean + std * np.random.default_rng(seed).standard_normal((N_MC, 1))
    # E[x²] = s, Var[x²] = 2v² + 4μ²v for a Gaussian
    assert_moments_agree(x * x, s, 2 * var**2 + 4 * mean**2 * var)
    np.testing.assert_allclose(moments.second_to_variance(mean, s), var,
                               rtol=0, atol=4 * EPS * s[0])


finite = st.floats(-1e150, 1e150, allow_nan=False, allow_infinity=False)
nonneg = st.floats(0, 1e300, allow_nan=False, allow_infinity=False)


@FAST_SETTINGS
@given(finite, nonneg)
def test_conversions_round_trip_and_clamp(mu, v):
    mean, var = np.array([mu]), np.array([v])
    s = moments.variance_to_second(mean, var)
    assert s[0] == mu * mu + v
    back = moments.second_to_variance(mean, s)
    assert back[0] >= 0 and abs(back[0] - v) <= 2 * EPS * s[0]
    # a raw moment slightly below μ² (rounding) is clamped to variance 0
    assert moments.second_to_variance(mean, mean * mean * (1 - 4 * EPS))[0] == 0.0
    # the reference's convert op does the same in both directions
    layer = Layer(name="c", op="convert", inputs=["input"], out_shape=(1,), source="test")
    to_s = REFERENCES["convert"](PlannedLayer(layer, [V], S), [Activation(mean[None], var[None], V)])
    assert to_s.repr is S and to_s.second[0, 0] == s[0]
    to_v = REFERENCES["convert"](PlannedLayer(layer, [S], V), [to_s])
    assert to_v.repr is V and to_v.second[0, 0] == back[0]


# --------------------------------------------------------------------------------------------
# Limit cases without Monte Carlo
# --------------------------------------------------------------------------------------------

def mp_relu(mu, v):
    """Exact mean and variance of max(0, a), a ~ N(mu, v), to ~40 digits for μ²/v up to 1e80
    (the variance is s − m², which cancels ~log10(μ²/v) digits)."""
    with mpmath.workdps(120):
        mu, v = mpmath.mpf(mu), mpmath.mpf(v)
        if v == 0:
            return max(mu, 0), mpmath.mpf(0)
        sd = mpmath.sqrt(v)
        a = mu / sd
        m = mu * mpmath.ncdf(a) + sd * mpmath.npdf(a)
        s = (mu**2 + v) * mpmath.ncdf(a) + mu * sd * mpmath.npdf(a)
        return m, s - m * m


def mp_clark(m1, v1, m2, v2):
    """Exact (60-digit) Clark moments, shifted by m2 so that huge means cancel exactly."""
    with mpmath.workdps(60):
        m1, v1, m2, v2 = map(mpmath.mpf, (m1, v1, m2, v2))
        d = m1 - m2
        th = mpmath.sqrt(v1 + v2)
        if th == 0:
            return max(m1, m2), mpmath.mpf(0)
        a = d / th
        mu = d * mpmath.ncdf(a) + th * mpmath.npdf(a)  # shifted by −m2
        s = (d**2 + v1) * mpmath.ncdf(a) + v2 * mpmath.ncdf(-a) + d * th * mpmath.npdf(a)
        return m2 + mu, s - mu * mu


realistic = (st.just(0.0) | st.floats(1e-20, 1e300) | st.floats(-1e300, -1e-20))


@FAST_SETTINGS
@given(st.lists(realistic, min_size=1, max_size=8))
def test_relu_zero_variance_is_the_deterministic_relu(mus):
    mean = np.array(mus)
    with np.errstate(over="ignore"):
        m, v = relu_reference(mean, np.zeros_like(mean))
    np.testing.assert_array_equal(m, np.maximum(mean, 0.0))
    np.testing.assert_array_equal(v, 0.0)
    # a deterministic input stays deterministic
    pl = elementwise_layer("relu", mean.shape, mean.shape)
    out = REFERENCES["relu"](pl, [Activation(mean[None], None, D)])
    assert out.repr is D and np.array_equal(out.mean[0], np.maximum(mean, 0))


@pytest.mark.slow
@FAST_SETTINGS
@given(st.lists(st.tuples(realistic, realistic), min_size=1, max_size=8))
def test_max_zero_variance_is_the_plain_max(pairs):
    m1, m2 = np.array(pairs).T
    differ = m1 != m2
    m1[differ & (np.abs(m1 - m2) < 1e-20)] = 0.0  # keep |μ1 − μ2| in the realistic range
    zero = np.zeros_like(m1)
    with np.errstate(over="ignore"):
        m, v = pool_pair_reference(m1, zero, m2, zero, vertical=False)
    np.testing.assert_array_equal(m, np.maximum(m1, m2))
    np.testing.assert_array_equal(v, 0.0)


@FAST_SETTINGS
@given(st.floats(-150, 150), st.floats(-6, 6), st.floats(0, 1))
def test_relu_is_scale_invariant_down_to_tiny_scales(log_scale, alpha, zero_var):
    """relu(c·a) = c·relu(a): mean scales by c, variance by c², for every representable c.

    Also covers the zero-variance limit at tiny |μ| (``zero_var`` > 0.5 sets the variance to 0).
    """
    c = 10.0**log_scale
    mu, v = (alpha * c, c * c) if zero_var <= 0.5 else (alpha * c, 0.0)
    m, var = relu_reference(np.array([mu]), np.array([v]))
    em, ev = mp_relu(mu, v)
    assert abs(m[0] - float(em)) <= 1e-12 * c, (mu, v, m[0], float(em))
    assert abs(var[0] - float(ev)) <= 1e-11 * c * c, (mu, v, var[0], float(ev))


@FAST_SETTINGS
@given(st.floats(-150, 150), st.floats(-6, 6), st.floats(0.1, 10), st.floats(0, 1))
def test_max_is_scale_invariant_down_to_tiny_scales(log_scale, alpha, ratio, zero_var):
    c = 10.0**log_scale
    v1, v2 = (c * c, (ratio * c) ** 2) if zero_var <= 0.5 else (0.0, 0.0)
    m2 = 0.0
    m1 = alpha * c
    m, var = pool_pair_reference(np.array([m1]), np.array([v1]), np.array([m2]), np.array([v2]), False)
    em, ev = mp_clark(m1, v1, m2, v2)
    assert abs(m[0] - float(em)) <= 1e-12 * c, (m1, v1, m2, v2, m[0], float(em))
    assert abs(var[0] - float(ev)) <= 1e-11 * c * c, (m1, v1, m2, v2, var[0], float(ev))


def test_zero_variance_at_tiny_means_is_exact():
    """Minimal reproducer of the σ ≥ TINY clamp: a tiny mean with zero variance."""
    m, v = moments.relu_moments(np.array([-1e-30, 1e-30, 1e-300]), np.zeros(3))
    assert np.all(m >= 0), m  # a ReLU output is never negative
    np.testing.assert_array_equal(m, [0.0, 1e-30, 1e-300])
    mm, mv = moments.max_moments(np.array([1e-30]), np.zeros(1), np.array([0.0]), np.zeros(1))
    np.testing.assert_array_equal(mm, [1e-30])


def test_dense_zero_variance_is_deterministic():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 5)) * 1e3
    w = rng.standard_normal((4, 5))
    b = rng.standard_normal(4)
    layer = compute_layer("dense", (4,), {}, w, np.zeros_like(w), b, np.zeros_like(b))
    # deterministic input: v = Σ vw·x² + vb with vw = vb = 0 → exactly 0
    mean, var = run_compute("dense", layer, (5,), x, None, 1.0, "deterministic")
    np.testing.assert_array_equal(var, 0.0)
    np.testing.assert_allclose(mean, x @ w.T + b, rtol=1e-13)
    # Gaussian input with zero variance: the variance form has only zero terms, and the raw form
    # Σ sw·sx − (μwμx)² cancels exactly (identical operands)
    for form in ("raw", "variance"):
        mean2, var2 = run_compute("dense", layer, (5,), x, np.zeros_like(x), 1.0, form)
        np.testing.assert_array_equal(var2, 0.0)
        np.testing.assert_array_equal(mean2, mean)


def test_conv_zero_variance_is_deterministic():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((1, 2, 5, 5))
    w = rng.standard_normal((2, 2, 3, 3))
    attrs = {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 1}
    layer = compute_layer("conv2d", (2, 5, 5), attrs, w, np.zeros_like(w), None, None)
    for form in FORMS:
        x_var = None if form == "deterministic" else np.zeros_like(x)
        mean, var = run_compute("conv2d", layer, (2, 5, 5), x, x_var, 1.0, form)
        np.testing.assert_array_equal(var, 0.0)
        np.testing.assert_allclose(mean, conv2d_nchw(x, w, [1, 1], [1, 1], [1, 1], 1), rtol=1e-12)


def test_max_of_huge_means_with_tiny_variance():
    # N(1e6, 1e-6) vs N(1e6 + 1, 1e-6): the second always wins, so the moments are its own
    m, v = pool_pair_reference(np.array([1e6, 1e6 + 1]), np.array([1e-6, 1e-6]),
                               np.array([1e6 + 1, 1e6]), np.array([1e-6, 1e-6]), vertical=True)
    np.testing.assert_array_equal(m, [1e6 + 1, 1e6 + 1])
    np.testing.assert_allclose(v, [1e-6, 1e-6], rtol=1e-12)


@pytest.mark.slow
@FAST_SETTINGS
@given(st.floats(6, 15), st.booleans(), st.floats(-12, 2), st.floats(-12, 2), st.floats(-10, 10))
def test_max_huge_means_tiny_variances_against_exact(log_c, neg, log_v1, log_v2, alpha):
    c = (-1.0 if neg else 1.0) * 10.0**log_c
    v1, v2 = 10.0**log_v1, 10.0**log_v2
    m2 = c
    m1 = c + alpha * math.sqrt(v1 + v2)  # the difference actually stored is m1 − m2
    m, v = pool_pair_reference(np.array([m1]), np.array([v1]), np.array([m2]), np.array([v2]), False)
    em, ev = mp_clark(m1, v1, m2, v2)
    assert np.isfinite(m[0]) and np.isfinite(v[0])
    # mean: a few ulps of the huge means; variance: relative, no cancellation against μ²
    assert abs(m[0] - float(em)) <= 8 * EPS * (abs(m1) + abs(m2)) + 1e-12 * math.sqrt(v1 + v2)
    assert abs(v[0] - float(ev)) <= 1e-10 * float(ev) + 1e-300, (v[0], float(ev))


@pytest.mark.slow
@FAST_SETTINGS
@given(st.floats(6, 15), st.booleans(), st.floats(-12, 2),
       st.floats(-8, 8).filter(lambda a: abs(a) >= 0.05))
def test_relu_huge_means_against_exact(log_c, neg, log_v, alpha):
    mu = (-1.0 if neg else 1.0) * 10.0**log_c
    for m0, v0 in ((mu, 10.0**log_v),  # |μ|/σ astronomically large: clamped, exact
                   (mu, (mu / alpha) ** 2)):  # |μ|/σ = |alpha|
        m, v = relu_reference(np.array([m0]), np.array([v0]))
        em, ev = mp_relu(m0, v0)
        assert np.isfinite(m[0]) and np.isfinite(v[0])
        assert abs(m[0] - float(em)) <= 8 * EPS * abs(m0) + 1e-12 * math.sqrt(v0)
        assert abs(v[0] - float(ev)) <= 1e-10 * v0, (m0, v0, v[0], float(ev))


def test_relu_huge_mean_tiny_variance_examples():
    m, v = relu_reference(np.array([1e15, -1e15, 1e6]), np.array([1e-6, 1e-6, 1e-12]))
    np.testing.assert_array_equal(m, [1e15, 0.0, 1e6])
    np.testing.assert_allclose(v, [1e-6, 0.0, 1e-12], rtol=1e-14)


@pytest.mark.slow
@FAST_SETTINGS
@given(st.lists(st.floats(6, 15), min_size=1, max_size=6), st.floats(-12, 0), seeds)
def test_dense_deterministic_input_huge_values(log_x, log_vw, seed):
    """First-layer form v = Σ vw·x² + vb has no cancellation: exact to rounding for huge inputs."""
    rng = np.random.default_rng(seed % 2**32)
    k = len(log_x)
    x = (10.0 ** np.array(log_x) * rng.choice([-1, 1], k))[None]
    w_mean = rng.standard_normal((2, k))
    w_var = 10.0**log_vw * rng.uniform(0.1, 1, (2, k))
    b_var = rng.uniform(0, 1, 2)
    layer = compute_layer("dense", (2,), {}, w_mean, w_var, np.zeros(2), b_var)
    mean, var = run_compute("dense", layer, (k,), x, None, 1.0, "deterministic")
    exact = [float(sum(Fraction(w_var[o, i]) * Fraction(x[0, i]) ** 2 for i in range(k)) + Fraction(b_var[o]))
             for o in range(2)]
    assert np.all(np.isfinite(mean)) and np.all(np.isfinite(var))
    np.testing.assert_allclose(var[0], exact, rtol=4 * (k + 2) * EPS)


def _dense_huge_case(log_x, log_vx, log_vw, seed):
    rng = np.random.default_rng(seed % 2**32)
    k = len(log_x)
    xm = (10.0 ** np.array(log_x) * rng.choice([-1, 1], k))[None]
    xv = np.full((1, k), 10.0**log_vx)
    wm = rng.standard_normal((2, k))
    wv = np.full((2, k), 10.0**log_vw)
    layer = compute_layer("dense", (2,), {}, wm, wv, np.zeros(2), np.full(2, 1e-3))
    exact = np.array([float(sum(Fraction(wv[o, i]) * Fraction(xm[0, i]) ** 2
                                + (Fraction(wm[o, i]) ** 2 + Fraction(wv[o, i])) * Fraction(xv[0, i])
                                for i in range(k)) + Fraction(1e-3)) for o in range(2)])
    return layer, k, xm, xv, wm, wv, exact


huge_dense = (st.lists(st.floats(6, 15), min_size=1, max_size=6), st.floats(-12, 0),
              st.floats(-12, 0), seeds)


@pytest.mark.slow
@FAST_SETTINGS
@given(*huge_dense)
def test_dense_variance_form_huge_means_tiny_variances_exact(log_x, log_vx, log_vw, seed):
    """Variance-input form Σ vw·(μx² + vx) + μw²·vx: no cancellation, exact to rounding even for
    input means 1e6..1e15 with variances down to 1e-12."""
    layer, k, xm, xv, wm, wv, exact = _dense_huge_case(log_x, log_vx, log_vw, seed)
    mean, var = run_compute("dense", layer, (k,), xm, xv, 1.0, "variance")
    assert np.all(np.isfinite(mean)) and np.all(np.isfinite(var))
    np.testing.assert_allclose(var[0], exact, rtol=4 * (k + 4) * EPS)


@pytest.mark.slow
@FAST_SETTINGS
@given(*huge_dense)
def test_dense_raw_moment_form_huge_means_within_its_rounding_bound(log_x, log_vx, log_vw, seed):
    """The raw form Σ sw·sx − (μwμx)² cancels: with huge means its variance is only exact to
    ~eps·Σ sw·sx (the representation s = μ² + v itself cannot hold v < ulp(μ²)).  Pin that bound
    and finiteness; e.g. μx = 1e8, vx = 1, vw = 0 gives v = 0 in this form (true: 1)."""
    layer, k, xm, xv, wm, wv, exact = _dense_huge_case(log_x, log_vx, log_vw, seed)
    mean, var = run_compute("dense", layer, (k,), xm, xv, 1.0, "raw")
    assert np.all(np.isfinite(mean)) and np.all(np.isfinite(var)) and np.all(var >= 0)
    scale = ((xm**2 + xv) @ (wm**2 + wv).T)[0]
    assert np.all(np.abs(var[0] - exact) <= 4 * (k + 4) * EPS * scale + 4 * EPS * exact)


extreme_mean = st.floats(-1e300, 1e300, allow_nan=False, allow_infinity=False)
extreme_var = st.just(0.0) | st.floats(1e-300, 1e300) | st.floats(0, 1e300)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(extreme_mean, extreme_var, extreme_mean, extreme_var), min_size=1, max_size=8))
def test_no_nan_or_inf_for_extreme_inputs(rows):
    m1, v1, m2, v2 = (np.array(c) for c in zip(*rows))
    with np.errstate(over="ignore"):
        rm, rv = relu_reference(m1, v1)
        pm, pv = pool_pair_reference(m1, v1, m2, v2, vertical=False)
    for arr in (rm, rv, pm, pv):
        assert np.all(np.isfinite(arr)), rows
    assert np.all(rv >= 0) and np.all(pv >= 0)
    # Gaussian Poincaré: Var[relu(a)] ≤ v·Φ(α) ≤ v, Var[max] ≤ v1·Φ(α) + v2·Φ(−α) ≤ max(v1, v2)
    assert np.all(rv <= v1 * (1 + 4 * EPS))
    assert np.all(pv <= np.maximum(v1, v2) * (1 + 4 * EPS))
    # Jensen: E[max(X1, X2)] ≥ max(μ1, μ2), E[relu(a)] ≥ max(0, μ), up to rounding of the huge
    # terms and up to 1e-28 absolute: below that scale the σ ≥ TINY clamp is wrong, which
    # test_*_scale_invariant_down_to_tiny_scales and test_zero_variance_at_tiny_means_is_exact pin.
    slack = 8 * EPS * (np.abs(m1) + np.abs(m2)) + 8 * EPS * np.sqrt(v1 + v2) + 1e-28
    assert np.all(pm >= np.maximum(m1, m2) - slack)
    assert np.all(rm >= np.maximum(m1, 0) - 8 * EPS * (np.abs(m1) + np.sqrt(v1)) - 1e-28)
