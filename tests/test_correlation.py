"""The shared per-channel (cross-position) component of pyro2pfp.correlation against Monte Carlo.

* conv → global average pooling with a deterministic input: the correlated rule is exact (the
  weight-noise variance of the pooled output is the weight-variance term on the pooled input), so
  it is checked with pure Monte Carlo bounds (tests/stats.py); mean-field PFP fails the same check.
* a small ResNet-style net (residual blocks, BatchNorm eval, global pooling): the logit variance
  ratio against Monte Carlo over the guide's samples is within [0.6, 1.6] with the treatment and
  below 0.6 without it (stated tolerance: the rule is an approximation after ReLU and adds).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from builders import conv_layer
from stats import check_moments

import pyro2pfp
from pyro2pfp.diagnose import layer_fidelity
from pyro2pfp.graph import INPUT, Layer, LayerGraph
from pyro2pfp.plan import plan
from pyro2pfp.reference import execute
from pyro2pfp.reference.arrays import conv2d_nchw
from pyro2pfp_experiments.correlation import execute_correlated, execute_correlated_all


def _conv_pool_graph(rng, image: int = 6, channels: int = 3):
    conv = conv_layer(rng, "conv", INPUT, (2, image, image), channels, 3, 1, 1, 1, 1, 0.5, 0.05)
    attrs = {"kernel": [image, image], "stride": [image, image], "padding": [0, 0], "ceil_mode": False,
             "count_include_pad": True, "divisor": None}
    pool = Layer(name="pool", op="avg_pool2d", inputs=["conv"], out_shape=(channels, 1, 1), source="pool (test)",
                 attrs=attrs)
    return LayerGraph(input_shape=(2, image, image), layers=[conv, pool], output="pool")


def test_conv_then_global_average_pool_is_exact():
    rng = np.random.default_rng(0)
    graph = _conv_pool_graph(rng)
    x = rng.standard_normal((3, 2, 6, 6))
    planned = plan(graph)
    mean, var = execute_correlated(planned, x)
    conv = graph.layers[0]
    w, b = conv.params["weight"], conv.params["bias"]
    n = 20000
    samples = np.empty((n, *mean.shape))
    for i in range(n):
        ws = w.mean + np.sqrt(w.var) * rng.standard_normal(w.shape)
        bs = b.mean + np.sqrt(b.var) * rng.standard_normal(b.shape)
        out = conv2d_nchw(x, ws, [1, 1], [1, 1], [1, 1], 1) + bs.reshape(1, -1, 1, 1)
        samples[i] = out.mean(axis=(2, 3), keepdims=True)
    check = check_moments(samples, mean, var)
    assert check.ok, check.report()
    mf_mean, mf_var = execute(planned, x)
    assert not check_moments(samples, mf_mean, mf_var).ok  # mean-field divides a correlated variance by H·W


def test_zero_variance_limit_is_mean_field():
    rng = np.random.default_rng(1)
    graph = _conv_pool_graph(rng)
    for layer in graph.layers:
        for k, p in layer.params.items():
            layer.params[k] = type(p)(p.mean, np.zeros_like(p.var))
    planned = plan(graph)
    x = rng.standard_normal((2, 2, 6, 6))
    mean, var = execute_correlated(planned, x)
    ref_mean, ref_var = execute(planned, x)
    np.testing.assert_allclose(mean, ref_mean)
    assert np.all(var == 0) and np.all(np.isfinite(var))


@pytest.fixture(scope="module")
def small_resnet():
    from pyro2pfp_experiments.zoo import bayesian_resnet, he_posterior

    torch.manual_seed(0)
    model = bayesian_resnet(blocks=1, widths=(4, 8))
    x = torch.randn(6, 3, 8, 8)
    guide = he_posterior(model, x, scale=0.02, seed=0)
    net = pyro2pfp.convert(model, guide, input_shape=(3, 8, 8))
    diag = pyro2pfp.diagnose(model, guide, x, num_samples=150, net=net, per_layer=False)
    return net, x.numpy().astype(np.float64), diag


def test_small_resnet_logit_variances_match_sampling_only_with_the_correlation(small_resnet):
    net, x, diag = small_resnet
    mc_mean, mc_var = diag.output["mc_mean"], diag.output["mc_var"]
    with_corr = layer_fidelity("logits", "", *execute_correlated(net.plan, x), mc_mean, mc_var)
    mean_field = layer_fidelity("logits", "", *net.reference(x), mc_mean, mc_var)
    # 150 samples: the MC variance's relative sd is 0.12, so the median is good to ~±0.05
    assert 0.75 <= with_corr.ratio_median <= 1.3, with_corr
    assert mean_field.ratio_median < 0.6, mean_field
    assert with_corr.mean_error < 0.2 and mean_field.mean_error < 0.2  # the means are untouched


def test_correlated_executor_keeps_means_and_per_position_variances(small_resnet):
    net, x, _ = small_resnet
    ref = pyro2pfp.reference.execute_all(net.plan, x)
    corr = execute_correlated_all(net.plan, x)
    for layer in net.plan.layers:
        np.testing.assert_allclose(corr[layer.name].mean, ref[layer.name].mean, rtol=1e-12, atol=1e-12)
        if layer.op in ("conv2d", "relu", "affine", "add"):  # only pooling/dense use the shared part
            np.testing.assert_allclose(corr[layer.name].variance(), ref[layer.name].variance(), rtol=1e-12)
