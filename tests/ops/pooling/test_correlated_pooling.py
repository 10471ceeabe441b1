"""Max pooling with in-window covariances: Clark's correlated max, ``window_cov``, the plan rewrite that
puts a non-decreasing activation after the pool, and all three back ends.

* Clark's max of two *correlated* Gaussians is exact: checked against Monte Carlo with the derived
  bound of ``tests/support/stats.py``, and the independent rule must be rejected on the same sample.
* ``window_cov`` (the covariances of every pair of taps of a window, from the conv that feeds the pool)
  is exact for a conv with independent Gaussian weights and independent inputs: its pairs'
  covariances are checked against Monte Carlo the same way, for a deterministic and a random conv
  input, overlapping / padded / ceil-mode windows and a strided conv.  And to 1e-10 against the
  covariance summed term by term from its definition (independently of the package's shifted-kernel
  form), for 3×3 and 5×5 kernels with padding 0 and 1 and 2×2/2 and 3×3/2/1 pools; the pooled
  moments of those windows against sampling within the sampling bound plus the fold's stated allowance,
  and the pooled moments of two-tap windows (where Clark's max is exact) within the pure sampling bound,
  for a random input whose variance varies in space (a covariance taken at a wrongly oriented shift fails).
* A conv → ReLU → max pool stack with a wide posterior: after the pool the variance ratio to sampling
  is within a stated band with the correlated rule, and the independent rule fails the same band.
* Compiled (TVM) and ONNX outputs equal the float64 reference to float32 rounding.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyro2pfp import moments
from pyro2pfp.backends.reference import execute_all
from pyro2pfp.backends.reference.arrays import LOWEST, padded, window_views
from pyro2pfp.network import PFPNetwork
from pyro2pfp.planning.correlated_pools import correlate_max_pools
from pyro2pfp.planning.graph import INPUT, Layer, LayerGraph
from pyro2pfp.planning.plan import plan
from tests.support.builders import conv_layer, dense_layer, pool_layer, relu_layer, reshape_layer
from tests.support.op_coverage import COMPILED, MONTE_CARLO, covers
from tests.support.stats import assert_check_rejects, assert_moments_agree, z_threshold

N_MC = 200_000
MC = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------------------------
# Clark's max of two correlated Gaussians
# --------------------------------------------------------------------------------------------

@st.composite
def correlated_pairs(draw):
    k = draw(st.integers(1, 4))
    scale = 10.0 ** draw(st.floats(-4, 4))
    m1, s1, m2, s2, rho = (np.empty(k) for _ in range(5))
    for i in range(k):
        s1[i] = scale
        s2[i] = scale * 10.0 ** draw(st.floats(-1, 1))
        rho[i] = draw(st.floats(-0.95, 0.999) | st.sampled_from([0.0, 0.9, 0.99]))
        theta = math.sqrt(max(s1[i] ** 2 + s2[i] ** 2 - 2 * rho[i] * s1[i] * s2[i], 1e-300))
        m1[i] = scale * draw(st.floats(-100, 100))
        m2[i] = m1[i] + theta * draw(st.floats(-5, 5))
    return m1, s1, m2, s2, rho, draw(st.integers(0, 2**32 - 1))


def correlated_samples(rng, m1, s1, m2, s2, rho, n=N_MC):
    z1 = rng.standard_normal((n, m1.size))
    z2 = rho * z1 + np.sqrt(1 - rho**2) * rng.standard_normal((n, m1.size))
    return m1 + s1 * z1, m2 + s2 * z2


@pytest.mark.slow
@MC
@given(correlated_pairs())
def test_correlated_max_of_two_matches_monte_carlo(case):
    m1, s1, m2, s2, rho, seed = case
    mean, var, cdf, cdf_neg = moments.correlated_max_moments(m1, s1**2, m2, s2**2, rho * s1 * s2)
    x1, x2 = correlated_samples(np.random.default_rng(seed), m1, s1, m2, s2, rho)
    assert_moments_agree(np.maximum(x1, x2), mean, var)
    np.testing.assert_allclose(cdf + cdf_neg, 1.0, rtol=1e-12)


def test_independent_clark_is_rejected_for_correlated_inputs():
    m1, s1 = np.array([0.0, 1.0, 5.0]), np.array([1.0, 2.0, 1.0])
    m2, s2, rho = m1 + np.array([0.1, -0.5, 0.3]), s1 * 1.1, np.array([0.9, 0.95, 0.8])
    x1, x2 = correlated_samples(np.random.default_rng(3), m1, s1, m2, s2, rho)
    mean, var, _, _ = moments.correlated_max_moments(m1, s1**2, m2, s2**2, rho * s1 * s2)
    assert_moments_agree(np.maximum(x1, x2), mean, var)
    wrong_mean, wrong_var = moments.max_moments(m1, s1**2, m2, s2**2)
    assert_check_rejects(np.maximum(x1, x2), wrong_mean, wrong_var)


def test_correlated_max_limit_cases():
    # perfectly correlated, equal variances (θ = 0): the larger mean, its variance; no NaN
    m, v, _, _ = moments.correlated_max_moments(np.array([1.0, -3.0, 1e30]), np.array([4.0, 0.0, 1e20]),
                                                np.array([2.0, -3.0, -1e30]), np.array([4.0, 0.0, 1e20]),
                                                np.array([4.0, 0.0, 1e20]))
    np.testing.assert_array_equal(m, [2.0, -3.0, 1e30])
    np.testing.assert_array_equal(v, [4.0, 0.0, 1e20])
    # a covariance that rounding pushed past v1 + v2: θ² clamped at 0, finite
    m, v, _, _ = moments.correlated_max_moments(np.array([0.5]), np.array([1.0]), np.array([0.0]),
                                                np.array([1.0]), np.array([1.0 + 1e-12]))
    assert np.isfinite(m).all() and np.isfinite(v).all() and m[0] == 0.5
    # covariance 0 is the independent rule, bit for bit
    a = np.random.default_rng(0).normal(size=(4, 50))
    mi, vi = moments.max_moments(a[0], a[1] ** 2, a[2], a[3] ** 2)
    mc, vc, _, _ = moments.correlated_max_moments(a[0], a[1] ** 2, a[2], a[3] ** 2, np.zeros(50))
    np.testing.assert_allclose(mc, mi, rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(vc, vi, rtol=1e-12, atol=1e-14)
    # the fold's identity (−MAX, 0) with covariance 0 leaves the other tap as it is
    m, v = moments.correlated_window_max([(np.array([LOWEST]), np.array([0.0])), (np.array([2.0]), np.array([3.0]))],
                                         {(0, 1): np.array([0.0])})
    assert m[0] == 2.0 and v[0] == 3.0


# --------------------------------------------------------------------------------------------
# window_cov against Monte Carlo
# --------------------------------------------------------------------------------------------

CASES = [  # (conv: in_ch, out_ch, kernel, stride, padding; pool: kernel, stride, padding, ceil; image; random input)
    ((2, 3, 3, 1, 1), (2, 2, 0, False), 6, False),
    ((2, 2, 3, 1, 0), (3, 2, 1, False), 7, True),
    ((1, 2, 2, 2, 1), (2, 2, 0, True), 7, True),
    ((2, 3, 3, 1, 1), (3, 2, 1, False), 7, True),
]


def small_graph(rng, case, mean_scale=0.5, var_scale=0.2):
    (cin, cout, k, s, p), (pk, ps, pp, ceil), image, _ = case
    conv = conv_layer(rng, "conv", INPUT, (cin, image, image), cout, k, s, p, 1, 1, mean_scale, var_scale)
    pool = pool_layer("pool", "conv", conv.out_shape, pk, ps)
    pool.attrs.update({"padding": [pp, pp], "ceil_mode": ceil})
    import torch

    out = torch.nn.functional.max_pool2d(torch.zeros(1, *conv.out_shape), pk, ps, pp, ceil_mode=ceil)
    pool.out_shape = tuple(out.shape[1:])
    return LayerGraph(input_shape=(cin, image, image), layers=[conv, pool], output="pool",
                      input_variance=case[3])


def sample_conv(rng, layer, x_mean, x_var, n):
    """``n`` draws of the conv output (new weights, bias and input every draw): each draw's weights
    times its input's patches (``unfold``), one batched matmul."""
    import torch
    import torch.nn.functional as F

    w, b, a = layer.params["weight"], layer.params["bias"], layer.attrs
    ws = w.mean.reshape(w.shape[0], -1) + np.sqrt(w.var).reshape(w.shape[0], -1) * rng.standard_normal(
        (n, w.shape[0], w.mean[0].size))
    bs = b.mean + np.sqrt(b.var) * rng.standard_normal((n, *b.shape))
    xs = x_mean if x_var is None else x_mean + np.sqrt(x_var) * rng.standard_normal((n, *x_mean.shape[1:]))
    patches = F.unfold(torch.as_tensor(xs), w.shape[2:], padding=a["padding"], stride=a["stride"]).numpy()
    out = np.matmul(ws, patches) + bs[:, :, None]  # (n, O, L)
    oh = (x_mean.shape[2] + 2 * a["padding"][0] - w.shape[2]) // a["stride"][0] + 1
    return out.reshape(n, w.shape[0], oh, -1)


@covers("window_cov", kind=MONTE_CARLO)
@pytest.mark.parametrize("case", CASES[:1] + [pytest.param(c, marks=pytest.mark.slow) for c in CASES[1:]])
def test_window_cov_matches_monte_carlo(case):
    rng = np.random.default_rng(7)
    graph = correlate_max_pools(small_graph(rng, case))
    assert [layer.op for layer in graph.layers] == ["conv2d", "window_cov", "max_pool2d"]
    planned = plan(graph)
    cin, image = case[0][0], case[2]
    x = rng.normal(size=(1, cin, image, image))
    x_var = rng.uniform(0.1, 1.0, x.shape) if case[3] else None
    values = execute_all(planned, x, x_var)
    cov = values["pool_window_cov"].mean[0]  # (C, P, OH, OW)
    pool = planned.layer("pool").layer
    out_hw = pool.out_shape[1:]
    a = sample_conv(rng, graph.layer("conv"), x, x_var, 20_000)  # (n, C, H, W)
    centred = a - values["conv"].mean  # the exact means (conv means are exact)
    taps = list(window_views(padded(centred, pool.attrs, out_hw, np.nan), pool.attrs["kernel"],
                             pool.attrs["stride"], out_hw))
    checked = 0
    for k, (i, j) in enumerate(moments.window_pairs(len(taps))):
        prod = taps[i] * taps[j]  # (n, C, OH, OW); NaN where a tap is outside the conv output
        inside = ~np.isnan(prod[0])
        assert np.all(cov[:, k][~inside] == 0)
        assert_moments_agree(prod[:, inside], cov[:, k][inside], None)
        checked += int(inside.sum())
    assert checked > 0


def test_window_cov_check_can_fail():
    """The same check rejects covariances without the bias variance (deterministic input, case 0)."""
    rng = np.random.default_rng(7)
    graph = correlate_max_pools(small_graph(rng, CASES[0]))
    planned = plan(graph)
    x = rng.normal(size=(1, 2, 6, 6))
    cov = execute_all(planned, x)["pool_window_cov"].mean[0][:, 0]
    bias_var = graph.layer("conv").params["bias"].var[:, None, None]
    a = sample_conv(rng, graph.layer("conv"), x, None, 20_000) - execute_all(planned, x)["conv"].mean
    views = list(window_views(a, [2, 2], [2, 2], (3, 3)))
    assert_moments_agree(views[0] * views[1], cov, None)
    assert_check_rejects(views[0] * views[1], cov - bias_var, None)


# --------------------------------------------------------------------------------------------
# the plan rewrite
# --------------------------------------------------------------------------------------------

def cnn_graph(rng, act: str = "relu", act_attrs=None, mean_scale=0.4, var_scale=0.05):
    conv = conv_layer(rng, "conv1", INPUT, (1, 12, 12), 4, 3, 1, 1, 1, 1, mean_scale, var_scale)
    a = Layer("act1", act, ["conv1"], conv.out_shape, "act1 (test)", attrs=dict(act_attrs or {}))
    pool = pool_layer("pool1", "act1", conv.out_shape, 2, 2)
    conv2 = conv_layer(rng, "conv2", "pool1", pool.out_shape, 6, 3, 1, 0, 1, 1, mean_scale, var_scale)
    relu2 = relu_layer("relu2", "conv2", conv2.out_shape)
    pool2 = pool_layer("pool2", "relu2", conv2.out_shape, 2, 2)
    flat = int(np.prod(pool2.out_shape))
    return LayerGraph(input_shape=(1, 12, 12), layers=[
        conv, a, pool, conv2, relu2, pool2, reshape_layer("flat", "pool2", (flat,)),
        dense_layer(rng, "fc", "flat", flat, 5, mean_scale, var_scale)], output="fc")


def test_rewrite_moves_non_decreasing_activations_and_adds_covariances():
    g = correlate_max_pools(cnn_graph(np.random.default_rng(0), "leaky_relu", {"slope": 0.2}))
    ops = [(layer.name, layer.op) for layer in g.layers]
    assert ops[:4] == [("conv1", "conv2d"), ("pool1_window_cov", "window_cov"),
                       ("pool1_pre_leaky_relu", "max_pool2d"), ("pool1", "leaky_relu")]
    assert g.layer("pool1_pre_leaky_relu").inputs == ["conv1", "pool1_window_cov"]
    assert g.layer("pool1_window_cov").inputs == [INPUT]
    assert "moved after" in g.layer("pool1_pre_leaky_relu").note
    summary = plan(g).summary()
    assert "correlated Clark max" in summary and "leaky_relu moved after it" in summary


@pytest.mark.parametrize("act, attrs", [("gelu", {"approximate": "none"}), ("leaky_relu", {"slope": -0.5}),
                                        ("silu", {})])
def test_rewrite_keeps_activations_that_are_not_non_decreasing(act, attrs):
    """Such an activation stays before the pool; the pool's covariances are the conv's window covariances
    through the activation (``window_activation``), not the independent fold."""
    g = correlate_max_pools(cnn_graph(np.random.default_rng(0), act, attrs))
    assert g.layer("act1").op == act and g.layer("pool1").op == "max_pool2d"
    assert g.layer("pool1").inputs[0] == "act1" and len(g.layer("pool1").inputs) == 2
    cov = g.layer(g.layer("pool1").inputs[1])
    assert cov.op == "window_activation" and cov.inputs[0] == "conv1"
    assert g.layer(cov.inputs[1]).op == "window_cov"
    assert g.layer("pool2").op == "relu"  # the second stack is rewritten


def test_rewrite_is_exact_on_deterministic_weights():
    """With zero posterior variances the rewritten net computes the deterministic net exactly."""
    rng = np.random.default_rng(1)
    g0 = cnn_graph(rng, var_scale=0.0)
    x = rng.normal(size=(3, 1, 12, 12))
    m0, v0 = PFPNetwork(g0, plan(g0)).reference(x)
    m1, v1 = PFPNetwork(correlate_max_pools(g0), plan(correlate_max_pools(g0))).reference(x)
    np.testing.assert_allclose(m1, m0, rtol=1e-12, atol=1e-12)
    assert not v0.any() and not v1.any()


# --------------------------------------------------------------------------------------------
# a wide posterior: the variance after the pools, against sampling the same network
# --------------------------------------------------------------------------------------------

def sample_network(rng, g: LayerGraph, x: np.ndarray, n: int) -> dict[str, np.ndarray]:
    """Monte Carlo of conv1 → relu → pool1 → conv2 → relu → pool2: per layer, (n, batch, ...) draws
    (new weights every draw; draw ``s`` is group ``s`` of one grouped convolution)."""
    import torch
    import torch.nn.functional as F

    def draw(p):
        return torch.as_tensor(p.mean + np.sqrt(p.var) * rng.standard_normal((n, *p.mean.shape)))

    c1, c2 = g.layer("conv1"), g.layer("conv2")
    w1, b1 = draw(c1.params["weight"]), draw(c1.params["bias"])
    w2, b2 = draw(c2.params["weight"]), draw(c2.params["bias"])
    xt = torch.as_tensor(x).repeat(1, n, 1, 1)
    h = F.conv2d(xt, w1.reshape(-1, *w1.shape[2:]), b1.reshape(-1), padding=1, groups=n)
    p1 = F.max_pool2d(F.relu(h), 2)
    p2 = F.max_pool2d(F.relu(F.conv2d(p1, w2.reshape(-1, *w2.shape[2:]), b2.reshape(-1), groups=n)), 2)

    def per_draw(t):
        return t.numpy().reshape(x.shape[0], n, -1, *t.shape[2:]).swapaxes(0, 1)

    return {"pool1": per_draw(p1), "pool2": per_draw(p2)}


@pytest.fixture(scope="module")
def wide_cnn():
    rng = np.random.default_rng(5)
    g = cnn_graph(rng, mean_scale=0.4, var_scale=0.1)
    x = rng.uniform(0, 1, (4, 1, 12, 12))
    x[:, :, :3] = 0.0  # a blank band: windows whose taps are (nearly) one variable
    return g, x, sample_network(rng, g, x, 3000)


@pytest.mark.slow
@pytest.mark.parametrize("pool, correlated_band, mean_error", [("pool1", (0.92, 1.08), 0.1),
                                                              ("pool2", (0.85, 1.15), 0.6)])
def test_variance_after_max_pool_matches_sampling(wide_cnn, pool, correlated_band, mean_error):
    """pool1 sees the conv of a deterministic input (exact covariances); pool2's conv has a mean-field
    input (the covariances between pool1's outputs are dropped), hence its wider bounds."""
    g, x, samples = wide_cnn
    mc_mean, mc_var = samples[pool].mean(0), samples[pool].var(0)
    live = mc_var > 1e-6 * mc_var.max()
    results = {}
    for name, graph in (("independent", g), ("correlated", correlate_max_pools(g))):
        values = execute_all(plan(graph), x)
        results[name] = (values[pool].mean, values[pool].variance())
    se = np.sqrt(mc_var / 3000)
    m_c, v_c = results["correlated"]
    ratio = np.median(v_c[live] / mc_var[live])
    assert correlated_band[0] <= ratio <= correlated_band[1], ratio
    assert np.median(np.abs(m_c - mc_mean)[live] / np.sqrt(mc_var[live])) < mean_error
    m_i, v_i = results["independent"]
    # the paper's rule is measurably off on the same windows (the failure this rule fixes)
    assert np.median(v_i[live] / mc_var[live]) < correlated_band[0] or \
        np.median(np.abs(m_i - mc_mean)[live] / se[live]) > 5


# --------------------------------------------------------------------------------------------
# compiled and ONNX back ends
# --------------------------------------------------------------------------------------------

def backend_graph(rng) -> LayerGraph:
    """A random-input conv → ReLU → 3×3/2/1 pool (overlap, padding) and a strided conv → 2×2 ceil pool."""
    conv1 = conv_layer(rng, "conv1", INPUT, (2, 9, 9), 4, 3, 1, 1, 1, 1, 0.4, 0.05)
    relu1 = relu_layer("relu1", "conv1", conv1.out_shape)
    pool1 = pool_layer("pool1", "relu1", conv1.out_shape, 3, 2)
    pool1.attrs["padding"] = [1, 1]
    pool1.out_shape = (4, 5, 5)
    conv2 = conv_layer(rng, "conv2", "pool1", pool1.out_shape, 3, 2, 2, 1, 1, 1, 0.4, 0.05)
    pool2 = pool_layer("pool2", "conv2", conv2.out_shape, 2, 2)
    pool2.attrs["ceil_mode"] = True
    pool2.out_shape = (3, 2, 2)
    flat = 12
    return LayerGraph(input_shape=(2, 9, 9), input_variance=True, layers=[
        conv1, relu1, pool1, conv2, pool2, reshape_layer("flat", "pool2", (flat,)),
        dense_layer(rng, "fc", "flat", flat, 4, 0.4, 0.05)], output="fc")


@pytest.mark.slow
@covers("window_cov", kind=COMPILED)
@pytest.mark.parametrize("moment_form", ["variance", "raw"])
def test_compiled_and_onnx_equal_the_reference(moment_form):
    import onnxruntime as ort

    rng = np.random.default_rng(11)
    g = correlate_max_pools(backend_graph(rng))
    assert sum(layer.op == "window_cov" for layer in g.layers) == 2
    net = PFPNetwork(g, plan(g, 1.0, moment_form))
    x = rng.uniform(0, 1, (3, 2, 9, 9)).astype(np.float32)
    x_var = rng.uniform(0, 0.1, x.shape).astype(np.float32)
    ref = net.reference(x, x_var)
    session = ort.InferenceSession(net.to_onnx().SerializeToString())
    outputs = [session.run(None, {"x": x, "x_var": x_var})]
    if moment_form == "variance":  # the compiled path is the same for both forms but for the conversions
        outputs.append(net.compile("llvm")(x, x_var))
    for got in outputs:
        for r, o in zip(ref, got):
            np.testing.assert_allclose(o, r, rtol=2e-4, atol=2e-5 * np.abs(r).max())


@covers("window_cov", kind=COMPILED)
@pytest.mark.parametrize("case", [CASES[3], CASES[2]], ids=["3x3-2-pad1", "strided-conv-ceil"])
def test_window_cov_small_network_compiled_matches_reference(case):
    """One small correlated pool per window form in the fast loop (the back-end test above is slow): a
    random-input conv → an overlapping, padded 3×3/2/1 max pool (36 pairs of taps per window), and a
    strided conv → a 2×2 ceil-mode pool; the compiled pool's moments equal the reference's, which
    read the in-window covariances."""
    rng = np.random.default_rng(12)
    g = correlate_max_pools(small_graph(rng, case))
    assert [layer.op for layer in g.layers] == ["conv2d", "window_cov", "max_pool2d"]
    net = PFPNetwork(g, plan(g))
    cin, image = case[0][0], case[2]
    x = rng.normal(size=(2, cin, image, image)).astype(np.float32)
    x_var = rng.uniform(0.1, 1.0, x.shape).astype(np.float32)
    ref = net.reference(x, x_var)
    for r, o in zip(ref, net.compile("llvm")(x, x_var)):
        np.testing.assert_allclose(o, r, rtol=2e-4, atol=2e-5 * np.abs(r).max())


def test_caveats_name_the_pools_the_rule_does_not_cover():
    from pyro2pfp.planning.correlated_pools import pool_caveats

    rng = np.random.default_rng(0)
    assert pool_caveats(correlate_max_pools(cnn_graph(rng))) == []  # LeNet-style: both pools covered
    assert pool_caveats(correlate_max_pools(cnn_graph(rng, "gelu", {"approximate": "none"}))) == []
    g = cnn_graph(rng)
    pool3 = pool_layer("pool3", "pool2", g.layer("pool2").out_shape, 2, 1)  # reads another pool: not covered
    g = LayerGraph(input_shape=g.input_shape, output="pool3", layers=[*g.layers[:6], pool3])
    notes = pool_caveats(correlate_max_pools(g))
    assert len(notes) == 1 and "'pool3'" in notes[0] and "independent" in notes[0]
    assert pool_caveats(correlate_max_pools(g, shared=True)) == []
    conv1 = conv_layer(rng, "conv1", INPUT, (1, 8, 8), 2, 3, 1, 1, 1, 1, 0.3, 0.05)
    conv2 = conv_layer(rng, "conv2", "relu1", conv1.out_shape, 2, 3, 1, 1, 1, 1, 0.3, 0.05)
    vgg = LayerGraph(input_shape=(1, 8, 8), output="pool", layers=[
        conv1, relu_layer("relu1", "conv1", conv1.out_shape), conv2, relu_layer("relu2", "conv2", conv2.out_shape),
        pool_layer("pool", "relu2", conv2.out_shape, 2, 2)])
    notes = pool_caveats(correlate_max_pools(vgg))
    assert len(notes) == 1 and "another conv's output (conv1)" in notes[0]


# --------------------------------------------------------------------------------------------
# window_cov against the covariance computed from its definition (exact, float64)
# --------------------------------------------------------------------------------------------

EXACT_CASES = [  # (conv kernel, conv padding, pool (kernel, stride, padding)): conv stride 1, random input
    (k, p, pool) for k in (3, 5) for p in (0, 1) for pool in ((2, 2, 0), (3, 2, 1))]


def exact_graph(rng, kernel, padding, pool, image=8):
    return small_graph(rng, ((2, 2, kernel, 1, padding), (*pool, False), image, True))


def exact_input(rng) -> tuple[np.ndarray, np.ndarray]:
    """A batch of one ``(2, 8, 8)`` independent-Gaussian input (mean, variance) with positive means, as
    after a ReLU: neighbouring conv outputs then share much of their weight noise, the case the
    in-window covariances are for."""
    return rng.uniform(0.5, 1.5, (1, 2, 8, 8)), rng.uniform(0.05, 0.5, (1, 2, 8, 8))


def covariance_by_definition(conv: Layer, x_mean: np.ndarray, x_var: np.ndarray, o: int,
                             p: tuple[int, int], q: tuple[int, int]) -> float:
    """``Cov(a[o, p], a[o, q])`` of ``a = conv(x; W, b)`` summed term by term from the definition:
    ``a[o, p] = Σ_k W_k·X[p, k] + b`` over the kernel taps ``k = (c, r, s)`` (``X`` zero outside the
    image), and for every pair of terms ``Cov(W_k X_pk, W_l X_ql) = E[W_k W_l]·E[X_pk X_ql] −
    E[W_k]E[W_l]E[X_pk]E[X_ql]``, with ``E[W_k W_l] = μ_k μ_l + [k = l]·v_k`` and ``E[X X'] = μ μ' +
    [same element inside the image]·v`` (weights, bias and input elements all independent)."""
    w, b, pad = conv.params["weight"], conv.params["bias"], conv.attrs["padding"][0]
    c_in, kh, kw = w.shape[1:]
    h, wd = x_mean.shape[1:]

    def terms(pos):
        cs, rs, ss = np.meshgrid(np.arange(c_in), np.arange(kh), np.arange(kw), indexing="ij")
        rows, cols = pos[0] + rs.ravel() - pad, pos[1] + ss.ravel() - pad
        inside = (rows >= 0) & (rows < h) & (cols >= 0) & (cols < wd)
        flat = np.where(inside, (cs.ravel() * h + np.clip(rows, 0, h - 1)) * wd + np.clip(cols, 0, wd - 1), -1)
        mean = np.where(inside, x_mean.ravel()[np.maximum(flat, 0)], 0.0)
        return flat, mean

    fp, mp = terms(p)
    fq, mq = terms(q)
    wm, wv = w.mean[o].ravel(), w.var[o].ravel()
    e_ww = np.outer(wm, wm) + np.diag(wv)
    same = (fp[:, None] == fq[None, :]) & (fp[:, None] >= 0)
    e_xx = np.outer(mp, mq) + np.where(same, x_var.ravel()[np.maximum(fp, 0)][:, None], 0.0)
    return float(np.sum(e_ww * e_xx - np.outer(wm, wm) * np.outer(mp, mq)) + b.var[o])


@pytest.mark.parametrize("kernel, padding, pool", EXACT_CASES)
def test_window_cov_equals_the_covariance_by_definition(kernel, padding, pool):
    rng = np.random.default_rng(kernel * 10 + padding)
    graph = correlate_max_pools(exact_graph(rng, kernel, padding, pool))
    planned = plan(graph)
    x, x_var = exact_input(rng)
    values = execute_all(planned, x, x_var)
    cov, conv_var = values["pool_window_cov"].mean[0], values["conv"].variance()[0]
    conv = graph.layer("conv")
    (pk, ps, pp), (oh, ow) = pool, planned.layer("pool").layer.out_shape[1:]
    conv_hw = conv.out_shape[1:]
    taps = [(r, c) for r in range(pk) for c in range(pk)]
    scale = float(np.max(conv_var))
    for o in range(conv.out_shape[0]):
        for i in range(oh):
            for j in range(ow):
                pos = [(i * ps - pp + r, j * ps - pp + c) for r, c in taps]
                inside = [0 <= a < conv_hw[0] and 0 <= b < conv_hw[1] for a, b in pos]
                for k, (t, u) in enumerate(moments.window_pairs(len(taps))):
                    want = covariance_by_definition(conv, x[0], x_var[0], o, pos[t], pos[u]) \
                        if inside[t] and inside[u] else 0.0
                    assert abs(cov[o, k, i, j] - want) <= 1e-10 * scale, (o, k, i, j, cov[o, k, i, j], want)
    # the diagonal (the conv's own variance) from the same definition
    for o, a, b in [(0, 0, 0), (1, conv_hw[0] - 1, conv_hw[1] // 2), (1, conv_hw[0] // 2, conv_hw[1] // 2)]:
        want = covariance_by_definition(conv, x[0], x_var[0], o, (a, b), (a, b))
        assert abs(conv_var[o, a, b] - want) <= 1e-10 * scale


def two_tap_graph(rng, kernel: tuple[int, int]) -> LayerGraph:
    """A random-input conv 3×3 (padding 1, 2 → 2 channels, 6×6) → a max pool of two-tap windows (``kernel``
    (1, 2): side by side, (2, 1): one above the other; stride = kernel)."""
    conv = conv_layer(rng, "conv", INPUT, (2, 6, 6), 2, 3, 1, 1, 1, 1, 0.5, 0.2)
    pool = pool_layer("pool", "conv", conv.out_shape, 2, 2)
    pool.attrs.update({"kernel": list(kernel), "stride": list(kernel)})
    pool.out_shape = (2, 6 // kernel[0], 6 // kernel[1])
    return LayerGraph((2, 6, 6), [conv, pool], "pool", input_variance=True)


def gaussian_two_tap_max(rng, graph: LayerGraph, x: np.ndarray, x_var: np.ndarray, n: int) -> np.ndarray:
    """``n`` draws of every window's max, ``(n, C·OH·OW)``, its two taps drawn jointly Gaussian with the
    conv's exact means and the (co)variances of :func:`covariance_by_definition` (not the package's)."""
    conv, pool = graph.layer("conv"), graph.layer("pool")
    mean = execute_all(plan(graph), x, x_var)["conv"].mean[0]
    (kh, kw), out = pool.attrs["kernel"], pool.out_shape
    means, roots = [], []
    for o, i, j in np.ndindex(*out):
        p, q = (i * kh, j * kw), (i * kh + kh - 1, j * kw + kw - 1)
        cov = [[covariance_by_definition(conv, x[0], x_var[0], o, a, b) for b in (p, q)] for a in (p, q)]
        means.append([mean[o][p], mean[o][q]])
        roots.append(np.linalg.cholesky(np.array(cov)))
    taps = np.einsum("wij,nwj->nwi", np.array(roots), rng.standard_normal((n, len(means), 2))) + np.array(means)
    return taps.max(axis=2)


@covers("window_cov", kind=MONTE_CARLO)
@pytest.mark.parametrize("kernel", [(1, 2), (2, 1)], ids=["side-by-side", "one-above-the-other"])
def test_two_tap_pools_are_exact_against_sampling(kernel):
    """Clark's max of two jointly Gaussian taps is exact, so the pooled moments of two-tap windows agree
    with sampling within the pure Monte Carlo bound of ``tests/support/stats.py`` (no allowance): the
    taps drawn with the conv's exact means and the covariances summed from their definition.  The
    input is random, with a variance that varies from place to place (0 to 2), so that a covariance taken
    at the wrong offset (a window shift of the wrong orientation, in the input-mean term or in the
    input-variance term, which a deterministic input does not have) is a different number, and fails."""
    rng = np.random.default_rng(3)
    graph = two_tap_graph(rng, kernel)
    x = rng.uniform(0.5, 1.5, (1, 2, 6, 6))
    x_var = rng.uniform(0.0, 2.0, x.shape)
    draws = gaussian_two_tap_max(np.random.default_rng(1), graph, x, x_var, 200_000)
    pooled = execute_all(plan(correlate_max_pools(graph)), x, x_var)["pool"]
    assert_moments_agree(draws, pooled.mean[0].reshape(-1), pooled.variance()[0].reshape(-1))


#: Clark's fold treats the running maximum of a window as Gaussian (exact for two taps only), and a conv
#: of a random input is not Gaussian: beyond the sampling bound, the pooled moments may miss Monte Carlo by
#: this much (mean: in units of the MC sd; variance: relative; measured up to 0.03 sd and 13 % on these
#: windows).  On these windows the correlated fold stays within it and the independent fold (covariances
#: dropped) does not -- but an error of the covariances smaller than the fold's own (the input-variance
#: term's window shift taken the wrong way: at most 0.04 sd and 12 %) passes too: the exact two-tap
#: windows above, with the pure sampling bound, and the by-definition test are the ones that catch it.
FOLD_ALLOWANCE = {"mean": 0.03, "var": 0.15}


def pooled_draws(rng, conv: Layer, x_mean: np.ndarray, x_var: np.ndarray, pool, n: int, chunk: int = 2000):
    """``n`` draws of ``max_pool(conv(x))`` (new weights, bias and input every draw), ``(n, C, OH, OW)``:
    per chunk, each draw's weights times its input's patches, then the max over the pool's windows."""
    w, b, pad = conv.params["weight"], conv.params["bias"], conv.attrs["padding"][0]
    (o, c, k, _), (pk, ps, pp) = w.shape, pool
    out = []
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        ws = w.mean.reshape(o, -1) + np.sqrt(w.var).reshape(o, -1) * rng.standard_normal((m, o, c * k * k))
        bs = b.mean + np.sqrt(b.var) * rng.standard_normal((m, o))
        xs = x_mean + np.sqrt(x_var) * rng.standard_normal((m, *x_mean.shape))
        xs = np.pad(xs, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
        patches = np.lib.stride_tricks.sliding_window_view(xs, (k, k), axis=(2, 3))  # (m, c, oh, ow, k, k)
        oh, ow = patches.shape[2:4]
        cols = patches.transpose(0, 1, 4, 5, 2, 3).reshape(m, c * k * k, oh * ow)
        a = (np.matmul(ws, cols) + bs[:, :, None]).reshape(m, o, oh, ow)
        a = np.pad(a, ((0, 0), (0, 0), (pp, pp), (pp, pp)), constant_values=-np.inf)
        taps = np.lib.stride_tricks.sliding_window_view(a, (pk, pk), axis=(2, 3))[:, :, ::ps, ::ps]
        out.append(taps.max(axis=(-2, -1)))
    return np.concatenate(out)


def fold_errors(draws: np.ndarray, mean: np.ndarray, var: np.ndarray) -> tuple[float, float]:
    """The largest mean and variance errors against the draws, each as a fraction of its bound: the
    sampling bound (``z``·standard error, Bonferroni ``z`` of ``tests/support/stats.py``) plus
    :data:`FOLD_ALLOWANCE`; ≤ 1 is within."""
    n = draws.shape[0]
    mc_mean = draws.mean(axis=0)
    dev2 = (draws - mc_mean) ** 2
    mc_var = dev2.mean(axis=0)
    z = z_threshold(2 * mean.size)
    mean_bound = z * np.sqrt(mc_var / n) + FOLD_ALLOWANCE["mean"] * np.sqrt(mc_var)
    var_bound = z * dev2.std(axis=0) / np.sqrt(n) + FOLD_ALLOWANCE["var"] * mc_var
    return float(np.max(np.abs(mean - mc_mean) / mean_bound)), float(np.max(np.abs(var - mc_var) / var_bound))


@pytest.mark.parametrize("kernel, padding, pool", EXACT_CASES)
def test_pooled_moments_with_exact_covariances_match_sampling(kernel, padding, pool):
    """The pooled moments of the conv of an independent-Gaussian input (its window covariances exact,
    :func:`test_window_cov_equals_the_covariance_by_definition`) against sampling, within the sampling
    bound plus the fold's allowance; the independent fold on the same draws is outside it."""
    rng = np.random.default_rng(kernel * 10 + padding)
    graph = exact_graph(rng, kernel, padding, pool)
    x, x_var = exact_input(rng)
    draws = pooled_draws(np.random.default_rng(1), graph.layer("conv"), x[0], x_var[0], pool, 20_000)
    correlated = execute_all(plan(correlate_max_pools(graph)), x, x_var)["pool"]
    independent = execute_all(plan(graph), x, x_var)["pool"]
    assert max(fold_errors(draws, correlated.mean[0], correlated.variance()[0])) <= 1.0
    assert max(fold_errors(draws, independent.mean[0], independent.variance()[0])) > 1.0
