"""Compiled TVM module vs the float64 NumPy reference, on layer graphs built directly.

Tolerances are float32 rounding bounds, not tuned numbers: a sum of K float32 products has an
error of at most about ``(K + 4)·u·Σ|terms|`` (``u = 2⁻²⁴``, recursive summation plus the rounding
of the float32 inputs), so compute layers are checked against ``2·(K + 4)·u`` times the sum of the
absolute values of their terms; elementwise ops against a few ulps of their input scale.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyro2pfp.backends.reference.arrays import conv2d_nchw
from pyro2pfp.network import PFPNetwork
from pyro2pfp.planning.graph import INPUT, LayerGraph, Repr
from pyro2pfp.planning.plan import plan
from tests.support.builders import (
    assert_compute_layer,
    conv_layer,
    dense_layer,
    forms,
    input_var,
    inputs,
    lenet_graph,
    mlp_graph,
    pool_layer,
    relu_layer,
    scales,
    var_scales,
)
from tests.support.op_coverage import COMPILED, covers

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def build(graph: LayerGraph, calibration: float = 1.0, moment_form: str = "variance"
          ) -> tuple[PFPNetwork, object]:
    net = PFPNetwork(graph, plan(graph, calibration, moment_form))
    return net, net.compile("llvm")



def run_both(net, exe, x, x_var):
    ref = net.reference(x, x_var) if x_var is not None else net.reference(x)
    out = exe(x, x_var) if x_var is not None else exe(x)
    assert all(np.all(np.isfinite(o)) for o in out)
    return ref, out


@pytest.mark.slow
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 9), k=st.integers(1, 64),
       m=st.integers(1, 40), mean_scale=scales, var_scale=var_scales, x_scale=scales,
       x_var=input_var, bias=st.sampled_from(["none", "det", "prob"]), form=forms)
@covers("dense", kind=COMPILED)
def test_dense_matches_reference(seed, batch, k, m, mean_scale, var_scale, x_scale, x_var, bias, form):
    rng = np.random.default_rng(seed)
    layer = dense_layer(rng, "fc", INPUT, k, m, mean_scale, var_scale, bias)
    graph = LayerGraph(input_shape=(k,), layers=[layer], output="fc", input_variance=x_var is not None)
    net, exe = build(graph, moment_form=form)
    x, xv = inputs(rng, batch, (k,), x_scale, x_var)
    ref, out = run_both(net, exe, x, xv)
    assert_compute_layer(layer, x, xv, ref, out, lambda a, w: a @ w.T, form)


@st.composite
def conv_cases(draw):
    groups = draw(st.sampled_from([1, 1, 2]))
    c = groups * draw(st.integers(1, 3))
    o = groups * draw(st.integers(1, 3))
    kernel = draw(st.integers(1, 4))
    dil = draw(st.integers(1, 2))
    pad = draw(st.integers(0, 2))
    stride = draw(st.integers(1, 2))
    min_size = max(1, dil * (kernel - 1) + 1 - 2 * pad)
    h = draw(st.integers(min_size, min_size + 6))
    w = draw(st.integers(min_size, min_size + 6))
    return c, h, w, o, kernel, stride, pad, dil, groups


@pytest.mark.slow
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 4), case=conv_cases(), mean_scale=scales,
       var_scale=var_scales, x_scale=scales, x_var=input_var, bias=st.sampled_from(["none", "det", "prob"]),
       form=forms)
@covers("conv2d", kind=COMPILED)
def test_conv2d_matches_reference(seed, batch, case, mean_scale, var_scale, x_scale, x_var, bias, form):
    c, h, w, o, kernel, stride, pad, dil, groups = case
    rng = np.random.default_rng(seed)
    layer = conv_layer(rng, "conv", INPUT, (c, h, w), o, kernel, stride, pad, dil, groups,
                       mean_scale, var_scale, bias)
    graph = LayerGraph(input_shape=(c, h, w), layers=[layer], output="conv", input_variance=x_var is not None)
    net, exe = build(graph, moment_form=form)
    x, xv = inputs(rng, batch, (c, h, w), x_scale, x_var)
    ref, out = run_both(net, exe, x, xv)
    a = layer.attrs
    assert_compute_layer(layer, x, xv, ref, out,
                  lambda t, wt: conv2d_nchw(t, wt, a["stride"], a["padding"], a["dilation"], a["groups"]), form)


@pytest.mark.slow
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 6), n=st.integers(1, 50),
       x_scale=scales, x_var=st.sampled_from([0.0, 1e-30, 1e-8, 1e-2, 1.0, 100.0]))
@covers("relu", kind=COMPILED)
def test_relu_matches_reference(seed, batch, n, x_scale, x_var):
    rng = np.random.default_rng(seed)
    graph = LayerGraph(input_shape=(n,), layers=[relu_layer("relu", INPUT, (n,))], output="relu",
                       input_variance=True)
    net, exe = build(graph)
    x, xv = inputs(rng, batch, (n,), x_scale, x_var)
    ref, out = run_both(net, exe, x, xv)
    sigma = np.sqrt(xv.astype(np.float64))
    scale = np.abs(x) + sigma
    assert np.all(np.abs(out[0] - ref[0]) <= 1e-5 * scale + 1e-37)
    assert np.all(np.abs(out[1] - ref[1]) <= 1e-5 * xv + 1e-37)


@pytest.mark.slow
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 4), c=st.integers(1, 3),
       h=st.integers(3, 9), w=st.integers(3, 9), kernel=st.integers(1, 3), stride=st.integers(1, 3),
       x_scale=scales, x_var=st.sampled_from([None, 0.0, 1e-8, 1e-2, 1.0, 100.0]))
@covers("max_pool2d", kind=COMPILED)
def test_max_pool_matches_reference(seed, batch, c, h, w, kernel, stride, x_scale, x_var):
    rng = np.random.default_rng(seed)
    graph = LayerGraph(input_shape=(c, h, w), layers=[pool_layer("pool", INPUT, (c, h, w), kernel, stride)],
                       output="pool", input_variance=x_var is not None)
    net, exe = build(graph)
    x, xv = inputs(rng, batch, (c, h, w), x_scale, x_var)
    ref, out = run_both(net, exe, x, xv)
    big = np.abs(x).max() + (np.sqrt(xv.max()) if xv is not None else 0.0)
    assert np.all(np.abs(out[0] - ref[0]) <= 1e-5 * big + 1e-37)
    if xv is not None:
        assert np.all(np.abs(out[1] - ref[1]) <= 1e-5 * (xv.max() + np.abs(ref[1])) + 1e-37)
    else:
        np.testing.assert_array_equal(out[1], 0.0)


# --- one small fixed case per op, in the fast loop (the hypothesis sweeps above are slow) ------------
# Each is one cheap build of one layer: a kernel that drops or mistypes a term (the conv's μw²·vx, a
# ReLU's σφ(α)) fails the loop that runs before every commit.  Weight and input variances are of the
# order of the means, so every term of the variance is a material part of it.

INPUT_FORMS = {  # id: (input variance scale or None for a deterministic input, moment form)
    "deterministic": (None, "variance"), "variance": (1.0, "variance"), "raw": (1.0, "raw")}


@covers("dense", kind=COMPILED)
@pytest.mark.parametrize("inp", list(INPUT_FORMS))
def test_dense_small_layer_matches_reference(inp):
    x_var, form = INPUT_FORMS[inp]
    rng = np.random.default_rng(21)
    layer = dense_layer(rng, "fc", INPUT, 12, 5, 1.0, 0.3, "prob")
    graph = LayerGraph(input_shape=(12,), layers=[layer], output="fc", input_variance=x_var is not None)
    net, exe = build(graph, moment_form=form)
    x, xv = inputs(rng, 3, (12,), 1.0, x_var)
    ref, out = run_both(net, exe, x, xv)
    assert_compute_layer(layer, x, xv, ref, out, lambda a, w: a @ w.T, form)


FAST_CONVS = {  # id: (in (C, H, W), out channels, kernel, stride, padding, dilation, groups)
    "3x3-pad1": ((3, 6, 6), 4, 3, 1, 1, 1, 1),
    "grouped-strided-dilated": ((4, 7, 7), 4, 2, 2, 1, 2, 2),
}


@covers("conv2d", kind=COMPILED)
@pytest.mark.parametrize("inp, case", [(inp, "3x3-pad1") for inp in INPUT_FORMS]
                         + [("variance", "grouped-strided-dilated")])
def test_conv2d_small_layer_matches_reference(inp, case):
    x_var, form = INPUT_FORMS[inp]
    (c, h, w), o, kernel, stride, pad, dil, groups = FAST_CONVS[case]
    rng = np.random.default_rng(22)
    layer = conv_layer(rng, "conv", INPUT, (c, h, w), o, kernel, stride, pad, dil, groups, 1.0, 0.3, "prob")
    graph = LayerGraph(input_shape=(c, h, w), layers=[layer], output="conv", input_variance=x_var is not None)
    net, exe = build(graph, moment_form=form)
    x, xv = inputs(rng, 2, (c, h, w), 1.0, x_var)
    ref, out = run_both(net, exe, x, xv)
    a = layer.attrs
    assert_compute_layer(layer, x, xv, ref, out,
                         lambda t, wt: conv2d_nchw(t, wt, a["stride"], a["padding"], a["dilation"], a["groups"]), form)


@covers("relu", kind=COMPILED)
@pytest.mark.parametrize("form", ["variance", "raw"])
def test_relu_small_layer_matches_reference(form):
    """Means from −3σ to +3σ, and variances 0, 1e-30 and 100 (its limit cases) beside O(1) ones."""
    rng = np.random.default_rng(23)
    n = 24
    graph = LayerGraph(input_shape=(n,), layers=[relu_layer("relu", INPUT, (n,))], output="relu",
                       input_variance=True)
    net, exe = build(graph, moment_form=form)
    x, xv = inputs(rng, 3, (n,), 1.0, 1.0)
    xv[0, :3] = [0.0, 1e-30, 100.0]
    ref, out = run_both(net, exe, x, xv)
    scale = np.abs(x) + np.sqrt(xv.astype(np.float64))
    assert np.all(np.abs(out[0] - ref[0]) <= 1e-5 * scale + 1e-37)
    assert np.all(np.abs(out[1] - ref[1]) <= 1e-5 * scale**2 + 1e-37)


@covers("reshape", "convert", kind=COMPILED)
@pytest.mark.parametrize("form", ["variance", "raw"])
@pytest.mark.parametrize("arch", ["mlp", "mlp2", pytest.param("lenet", marks=pytest.mark.slow)])
def test_networks_match_reference_any_batch(arch, form):
    """One compiled module (symbolic batch) serves every batch size and matches the reference.

    Several layers of float32 rounding (K up to 784 terms each, plus cancellation in outputs near
    zero) give errors of ~1e-5 of the output scale; formula or indexing bugs give O(1) errors.
    """
    rng = np.random.default_rng(7)
    graph = {"mlp": lambda: mlp_graph(rng, [784, 100, 10]),
             "mlp2": lambda: mlp_graph(rng, [784, 100, 100, 10]),
             "lenet": lambda: lenet_graph(rng)}[arch]()
    net, exe = build(graph, calibration=0.5, moment_form=form)
    for batch in (1, 3, 17):
        x = rng.uniform(0, 1, (batch, *graph.input_shape)).astype(np.float32)
        ref, out = run_both(net, exe, x, None)
        for o, r in zip(out, ref):
            np.testing.assert_allclose(o, r, rtol=1e-4, atol=1e-4 * np.abs(r).max())


@pytest.mark.slow
@pytest.mark.parametrize("form", ["variance", "raw"])
def test_deterministic_limit(form):
    """Zero weight variance and a deterministic input give the deterministic network: the mean is
    its output and the variance is exactly 0 in both plans (every layer is planned deterministic, so
    the raw-moment plan has no Σ sw·sx − (μw·μx)² to round)."""
    rng = np.random.default_rng(3)
    graph = lenet_graph(rng, var_scale=0.0)
    net, exe = build(graph, moment_form=form)
    x = rng.uniform(0, 1, (5, *graph.input_shape)).astype(np.float32)
    (rm, rv), (cm, cv) = run_both(net, exe, x, None)
    np.testing.assert_allclose(cm, rm, rtol=1e-4, atol=1e-5 * np.abs(rm).max())
    assert np.all(cv == 0.0) and np.all(rv == 0.0)
    assert all(p.out_repr is Repr.DETERMINISTIC for p in net.plan.layers if p.name != net.plan.output)
    # Calibration 0 turns any posterior into the deterministic network too.
    noisy = lenet_graph(np.random.default_rng(3), var_scale=1.0)
    net0, exe0 = build(noisy, calibration=0.0, moment_form=form)
    (rm0, rv0), (cm0, cv0) = run_both(net0, exe0, x, None)
    np.testing.assert_allclose(cm0, cm, rtol=1e-5, atol=1e-6 * np.abs(rm).max())
    assert np.all(cv0 == 0.0) and np.all(rv0 == 0.0)


@pytest.mark.slow
def test_narrow_posterior_variances_are_kept_to_float32_precision():
    """SVI posteriors are narrow (σw ≈ 1e-3·|μw|): the variance plan keeps the output variance to
    float32 precision, where the raw-moment form s = μ² + v rounds most of it away."""
    rng = np.random.default_rng(5)
    graph = lenet_graph(rng, mean_scale=0.1, var_scale=1e-8)
    x = rng.uniform(0, 1, (4, *graph.input_shape)).astype(np.float32)
    net, exe = build(graph)
    (rm, rv), (cm, cv) = run_both(net, exe, x, None)
    np.testing.assert_allclose(cv, rv, rtol=1e-4, atol=1e-5 * rv.max())
    np.testing.assert_allclose(cm, rm, rtol=1e-4, atol=1e-5 * np.abs(rm).max())


@pytest.mark.slow
def test_extreme_values_stay_finite():
    """Huge means with tiny variances, and tiny variances everywhere: finite, non-negative output."""
    rng = np.random.default_rng(11)
    for mean_scale, var_scale, x_scale in [(1e3, 1e-12, 1e3), (1e-3, 1e-30, 1e-3), (10.0, 1e4, 10.0)]:
        graph = lenet_graph(rng, widths=(2, 3, 8, 6), image=12, mean_scale=mean_scale, var_scale=var_scale)
        net, exe = build(graph)
        x = (x_scale * rng.standard_normal((2, *graph.input_shape))).astype(np.float32)
        (rm, rv), (cm, cv) = run_both(net, exe, x, None)
        assert np.all(np.isfinite(rm)) and np.all(np.isfinite(rv)) and np.all(rv >= 0) and np.all(cv >= 0)
        np.testing.assert_allclose(cm, rm, rtol=1e-3, atol=1e-4 * np.abs(rm).max())
