"""Shared-factor PFP through a LayerNorm of a flat edge (a dense head): the linearised LayerNorm applied to
the input's loadings (``pyro2pfp/ops/normalization.py``, ``layer_norm_shared``).

* Against sampling: two Bayesian dense layers (the second's outputs correlated through the first's
  weight noise) and a LayerNorm, at a narrow posterior where the linearisation is accurate: the
  shared-factor LayerNorm's median variance ratio lies in the band the sample count gives
  (``variance_ratio_band``); the mean-field rule, which sums the same correlated inputs as independent,
  misses a tenth of the outputs by more than 10 %.
* The rule equals the delta method ``diag(J·Σ·Jᵀ)`` of the representation's own covariance
  ``Σ = diag(v − s²) + L·Lᵀ`` to rounding.
* A LayerNorm of an unflattened edge is refused by the factor plan, naming the layer.
* Compiled (TVM) and ONNX equal the float64 reference (a conv → pool → dense → LayerNorm → GELU → dense net;
  in the fast loop, the compiled kernel on two dense layers and a LayerNorm).
"""
from __future__ import annotations

import numpy as np
import pytest

from pyro2pfp.backends.reference import execute_all
from pyro2pfp.correlation import with_correlation
from pyro2pfp.correlation.execute import execute_shared_all
from pyro2pfp.correlation.factors import CorrelationError
from pyro2pfp.network import PFPNetwork
from pyro2pfp.planning.graph import INPUT, GaussianParam, Layer, LayerGraph
from pyro2pfp.planning.plan import plan
from tests.support.backends import ONNX_RTOL, assert_matches, onnx_run
from tests.support.builders import conv_layer, dense_layer, pool_layer, relu_layer, reshape_layer
from tests.support.graph_sampler import sample_graph
from tests.support.stats import variance_ratio_band


def _layer_norm(rng: np.random.Generator, inp: str, shape: tuple[int, ...]) -> Layer:
    d = shape[-1]
    return Layer("ln", "layer_norm", [inp], shape, "ln (test)", attrs={"dims": 1, "eps": 1e-5},
                 params={"weight": GaussianParam(rng.uniform(0.5, 1.5, d), np.zeros(d)),
                         "bias": GaussianParam(0.1 * rng.standard_normal(d), np.zeros(d))})


def dense_ln_graph(rng: np.random.Generator, var_scale: float = 0.005) -> LayerGraph:
    return LayerGraph(input_shape=(6,), output="ln", layers=[
        dense_layer(rng, "fc0", INPUT, 6, 8, 0.5, var_scale),
        dense_layer(rng, "fc1", "fc0", 8, 16, 0.5, var_scale / 10),
        _layer_norm(rng, "fc1", (16,))])


@pytest.fixture(scope="module")
def sampled():
    g = dense_ln_graph(np.random.default_rng(1))
    x = np.random.default_rng(0).standard_normal((16, 6))
    return g, x, sample_graph(g, x, 20_000)


def test_layer_norm_of_correlated_features_matches_sampling(sampled):
    g, x, draws = sampled
    lo, hi = variance_ratio_band(draws["ln"])
    mc = draws["ln"].var(0, ddof=1)
    shared = execute_shared_all(with_correlation(plan(g), "shared-factor"), x)["ln"].variance() / mc
    assert lo <= np.median(shared) <= hi, (np.median(shared), lo, hi)
    mean_field = execute_all(plan(g), x)["ln"].variance() / mc
    assert np.mean(np.abs(mean_field - 1) > 0.1) > 0.1  # the correlations matter here


def test_layer_norm_rule_is_the_delta_method_of_the_representation(sampled):
    g, x, _ = sampled
    keep = {"fc1": None}
    values = execute_shared_all(with_correlation(plan(g), "shared-factor"), x, keep=keep)
    sh, mu, v = keep["fc1"], values["fc1"].mean, values["fc1"].variance()
    assert sh is not None
    gamma = g.layer("ln").params["weight"].mean
    d = mu.shape[1]
    for b in range(x.shape[0]):
        loads = sh.s[b][:, None] * sh.g[b]
        sigma = np.diag(v[b] - sh.s[b] ** 2) + loads @ loads.T
        centred = mu[b] - mu[b].mean()
        r = 1 / np.sqrt((centred**2).mean() + (1 - 1 / d) * v[b].mean() + 1e-5)
        z = centred * r
        jac = r * (np.eye(d) - (1 + np.outer(z, z)) / d)
        np.testing.assert_allclose(values["ln"].variance()[b], gamma**2 * np.diag(jac @ sigma @ jac.T), rtol=1e-10)


def test_layer_norm_of_an_unflattened_edge_is_refused():
    rng = np.random.default_rng(2)
    conv = conv_layer(rng, "c1", INPUT, (1, 6, 6), 3, 3, 1, 1, 1, 1, 0.5, 0.05)
    g = LayerGraph(input_shape=(1, 6, 6), output="ln", layers=[conv, _layer_norm(rng, "c1", conv.out_shape)])
    with pytest.raises(CorrelationError, match=r"ln \(test\).*LayerNorms of an unflattened edge"):
        with_correlation(plan(g), "shared-factor")


def head_graph(rng: np.random.Generator) -> LayerGraph:
    c1 = conv_layer(rng, "c1", INPUT, (1, 8, 8), 4, 3, 1, 1, 1, 1, 0.5, 0.05)
    pool = pool_layer("p", "r1", c1.out_shape, 2, 2)
    return LayerGraph(input_shape=(1, 8, 8), output="fc2", layers=[
        c1, relu_layer("r1", "c1", c1.out_shape), pool, reshape_layer("flat", "p", (64,)),
        dense_layer(rng, "fc1", "flat", 64, 24, 0.3, 0.02), _layer_norm(rng, "fc1", (24,)),
        Layer("act", "gelu", ["ln"], (24,), "act (test)", attrs={"approximate": "none"}),
        dense_layer(rng, "fc2", "act", 24, 5, 0.4, 0.02)])


@pytest.mark.slow
def test_layer_norm_shared_compiled_and_onnx_equal_the_reference():
    g = head_graph(np.random.default_rng(3))
    net = PFPNetwork(g, with_correlation(plan(g), "shared-factor"))
    x = np.random.default_rng(4).uniform(0, 1, (3, *g.input_shape)).astype(np.float32)
    ref = net.reference(x)
    assert not np.allclose(ref[1], PFPNetwork(g, plan(g)).reference(x)[1], rtol=1e-3)
    assert_matches(net.compile("llvm")(x), ref)
    assert_matches(onnx_run(net, x), ref, ONNX_RTOL)


def test_layer_norm_shared_kernel_matches_the_reference():
    """The fast loop's check of ``sf_layer_norm`` (the test above is slow): two dense layers and a LayerNorm."""
    g = dense_ln_graph(np.random.default_rng(5), var_scale=0.05)
    net = PFPNetwork(g, with_correlation(plan(g), "shared-factor"))
    x = np.random.default_rng(6).standard_normal((3, 6)).astype(np.float32)
    ref = net.reference(x)
    assert not np.allclose(ref[1], PFPNetwork(g, plan(g)).reference(x)[1], rtol=1e-3)
    assert_matches(net.compile("llvm")(x), ref)
