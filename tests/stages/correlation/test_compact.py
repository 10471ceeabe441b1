"""The compact factor plan (pyro2pfp.correlation.compact) against Monte Carlo and closed forms.

Exact rules are checked where they are exact: a chain of dense layers (the input residual as factors,
a linear Gaussian net), the conv's uniform weight direction (it keeps the variance of each channel's
spatial sum exactly).  A small LeNet-shaped net is checked against sampling with a stated tolerance,
beside mean-field, which the same check rejects.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pyro2pfp import ops as ops  # the op registry: every op family registers itself
from pyro2pfp.backends.reference import execute, execute_all
from pyro2pfp.correlation import Loadings, execute_compact_all, plan_compact
from pyro2pfp.ops.compute_compact import conv_block_factors
from pyro2pfp.planning.correlated_pools import correlate_max_pools
from pyro2pfp.planning.graph import INPUT, GaussianParam, LayerGraph
from pyro2pfp.planning.plan import plan
from tests.support.builders import conv_layer, dense_layer, lenet_graph, reshape_layer
from tests.support.stats import check_moments


def _draw(p: GaussianParam, n: int, rng: np.random.Generator) -> np.ndarray:
    return p.mean + np.sqrt(p.var) * rng.standard_normal((n, *p.mean.shape))


def test_dense_chain_with_the_input_residual_as_factors_is_exact():
    """input → dense → dense → dense (no activation: a linear Gaussian net): fc2's input residual as factors
    makes the output variance exact; mean-field drops the units' shared inputs and fails the check."""
    rng = np.random.default_rng(0)
    layers = [dense_layer(rng, "fc1", INPUT, 6, 12, 0.8, 0.05), dense_layer(rng, "fc2", "fc1", 12, 9, 0.8, 0.05),
              dense_layer(rng, "fc3", "fc2", 9, 4, 0.8, 0.05)]
    graph = plan(LayerGraph(input_shape=(6,), layers=layers, output="fc3"))
    cp = plan_compact(graph)
    assert cp.residual == frozenset({"fc2"}) and cp.terminal == frozenset({"fc3"}) and not cp.directions
    x = rng.standard_normal((3, 6))
    n = 40000
    h = np.asarray(x)[None]
    for layer in layers:
        w, b = (_draw(layer.params[k], n, rng) for k in ("weight", "bias"))
        h = np.einsum("nbi,nji->nbj", np.broadcast_to(h, (n, *h.shape[1:])), w) + b[:, None]
    graph.factors = cp
    out = execute_all(graph, x)["fc3"]
    check = check_moments(h, out.mean, out.variance())
    assert check.ok, check.report()
    graph.factors = None
    assert not check_moments(h, *execute(graph, x)).ok


def _spatial_sum_net(rng: np.random.Generator, bias: str) -> LayerGraph:
    conv = conv_layer(rng, "conv", INPUT, (2, 6, 6), 3, 3, 1, 1, 1, 1, 0.5, 0.2, bias=bias)
    flat = reshape_layer("flat", "conv", (3 * 36,))
    ones = np.kron(np.eye(3), np.ones((1, 36)))  # output o = Σ_p conv[o, p]
    fc = dense_layer(rng, "fc", "flat", 3 * 36, 3, 0.0, 0.0, bias="none")
    fc.params["weight"] = GaussianParam(ones, np.zeros_like(ones))
    return LayerGraph(input_shape=(2, 6, 6), layers=[conv, flat, fc], output="fc")


@pytest.mark.parametrize("bias", ["prob", "none"])
def test_the_uniform_weight_direction_keeps_each_channel_sum_exactly(bias):
    """One factor per channel (the range finder's uniform test vector, the bias a tap of input 1): it
    carries the variance of a channel's spatial sum exactly (closed form), ``L·Lᵀ`` never exceeds the
    channel's covariance over positions (the loadings are a projection of its weight noise), and the dense
    layer summing the positions adds the residual's diagonal as independent (what the rule states)."""
    rng = np.random.default_rng(1)
    graph = plan(_spatial_sum_net(rng, bias))
    cp = plan_compact(graph, directions=1)
    assert cp.directions == {"conv": 1}
    x = rng.uniform(0.0, 1.0, (2, 2, 6, 6))  # image-like: the positions of a channel share their weights
    conv = graph.layers[0]
    wv = conv.tensors["weight_var"].reshape(3, -1)
    patches = F.unfold(torch.as_tensor(x), 3, padding=1).numpy()  # (B, C·k·k, P)
    vb = conv.tensors["bias_var"] if "bias_var" in conv.tensors else np.zeros(3)
    cov = np.einsum("od,bdp,bdq->bopq", wv, patches, patches) + vb[None, :, None, None]
    loads = conv_block_factors(conv, x, 1)  # (B, O, P, 1)
    assert loads.shape == (2, 3, 36, 1)
    low = np.einsum("bopr,boqr->bopq", loads, loads)
    assert np.linalg.eigvalsh(cov - low).min() > -1e-9 * np.abs(cov).max()
    ones = np.ones(36)
    np.testing.assert_allclose(np.einsum("p,bopq,q->bo", ones, low, ones),
                               np.einsum("p,bopq,q->bo", ones, cov, ones), rtol=1e-10)
    graph.factors = cp
    var = execute_all(graph, x)["fc"].variance()
    # the sum's variance through the factors, plus the residual's diagonal summed as independent
    residual = np.einsum("bopp->bo", cov - low)
    np.testing.assert_allclose(var, np.einsum("p,bopq,q->bo", ones, cov, ones) + residual, rtol=1e-10)
    graph.factors = None
    exact = np.einsum("p,bopq,q->bo", ones, cov, ones)
    assert (execute(graph, x)[1] < 0.7 * exact).all()  # mean-field: the positions summed as independent


def _lenet_samples(graph: LayerGraph, x: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` draws of the builder LeNet's logits (torch float64, every weight and bias sampled)."""
    by = {layer.name: layer for layer in graph.layers}

    def w(name: str, key: str) -> torch.Tensor:
        return torch.as_tensor(_draw(by[name].params[key], n, rng))

    xt = torch.as_tensor(x)
    outs = []
    params = {(name, key): w(name, key) for name in ("conv1", "conv2", "fc1", "fc2", "fc3")
              for key in ("weight", "bias")}
    for i in range(n):
        h = F.max_pool2d(F.relu(F.conv2d(xt, params["conv1", "weight"][i], params["conv1", "bias"][i], padding=2)), 2)
        h = F.max_pool2d(F.relu(F.conv2d(h, params["conv2", "weight"][i], params["conv2", "bias"][i])), 2).flatten(1)
        for name in ("fc1", "fc2", "fc3"):
            h = F.linear(h, params[name, "weight"][i], params[name, "bias"][i])
            h = F.relu(h) if name != "fc3" else h
        outs.append(h.numpy())
    return np.stack(outs)


def test_lenet_logit_variances_come_closer_to_sampling_than_mean_field():
    """A LeNet-5-shaped net (correlated pools) whose weight means share a positive part, so that its dense
    layers sum correlated units: against 4,000 samples (sd of a variance ratio ≈ 2 %), the compact plan's
    median logit variance ratio is above mean-field's by more than the noise and within [0.8, 1.1];
    mean-field's is below 0.85.  The plan carries conv2's block factors and fc2's input residual."""
    rng = np.random.default_rng(2)
    graph = lenet_graph(rng, widths=(4, 8, 40, 30), image=16, mean_scale=0.35, var_scale=0.05)
    for layer in graph.layers:
        if "weight" in layer.params:
            p = layer.params["weight"]
            layer.params["weight"] = GaussianParam(p.mean + 0.2, p.var, site=p.site)
    planned = plan(correlate_max_pools(graph))
    cp = plan_compact(planned, directions=1)
    assert cp.directions == {"conv2": 1} and cp.residual == frozenset({"fc2"})
    assert "fc2" in cp.describe() and "conv2" in cp.describe()
    x = rng.uniform(0, 1, (4, 1, 16, 16))
    samples = _lenet_samples(graph, x, 4000, rng)
    mc_var = samples.var(axis=0, ddof=1)
    mean_field = np.median(execute(planned, x)[1] / mc_var)
    planned.factors = cp
    compact = np.median(execute(planned, x)[1] / mc_var)
    assert planned.correlation == "compact-factor" and "compact-factor" in planned.summary()
    assert mean_field < 0.85 and 0.8 <= compact <= 1.1 and compact - mean_field > 0.03, (mean_field, compact)


def test_loadings_merge_by_creator_and_shrink_to_the_variance():
    a = Loadings({"f": np.ones((1, 2, 3))}, {"c": np.ones((1, 2, 1, 1))})
    b = Loadings({"f": np.ones((1, 2, 3)), "g": np.ones((1, 2, 1))})
    m = a.merged(b)
    assert set(m.glob) == {"f", "g"} and np.all(m.glob["f"] == 2) and set(m.block) == {"c"}
    np.testing.assert_allclose(m.squared(1, 2), [[12 + 1 + 1] * 2])


def test_zero_variance_gives_mean_field_and_no_nan():
    rng = np.random.default_rng(4)
    graph = lenet_graph(rng, widths=(2, 3, 8, 6), image=12, var_scale=0.0)
    planned = plan(correlate_max_pools(graph))
    x = rng.uniform(0, 1, (2, 1, 12, 12))
    planned.factors = plan_compact(planned)
    out = execute_compact_all(planned, x)[planned.output]
    planned.factors = None
    np.testing.assert_allclose(out.mean, execute(planned, x)[0])
    assert np.all(out.variance() == 0)
    planned.factors = plan_compact(planned)
    big = execute(planned, 1e150 * x)
    assert all(np.all(np.isfinite(t)) for t in big)


def test_convert_plans_it_after_the_pool_rewrite_and_says_what_it_carries():
    """The user path: a PyroModule LeNet-5 with an AutoNormal guide, ``convert(correlation="compact-factor")``:
    correlated pools, conv2's directions or the cost model's reason for leaving them out, fc2's input
    residual; ``net.reference`` runs it and the ONNX export matches it."""
    import pyro

    import pyro2pfp
    from pyro2pfp_experiments.zoo import BayesianLeNet5, make_guide

    pyro.clear_param_store()
    torch.manual_seed(0)
    model = BayesianLeNet5(c1=3, c2=4, f1=12, f2=10)
    guide = make_guide(model, init_scale=0.05)
    guide(torch.zeros(1, 1, 28, 28), torch.zeros(1, dtype=torch.long))  # a guide that has run, as after training
    net = pyro2pfp.convert(model, guide, input_shape=(1, 28, 28), correlation="compact-factor")
    cp = net.plan.factors
    assert net.plan.correlation == "compact-factor" and cp.residual == frozenset({"fc2"})
    assert any(p.op == "window_cov" for p in net.plan.layers)
    assert cp.directions == {"conv2": 1} or "over the budget" in cp.note
    assert "fc2" in net.summary().splitlines()[-1]
    x = np.random.default_rng(0).uniform(0, 1, (2, 1, 28, 28))
    mean, var = net.reference(x)
    assert np.all(np.isfinite(mean)) and np.all(var > 0)
    from tests.support.backends import ONNX_RTOL, assert_matches, onnx_run

    assert_matches(onnx_run(net, x.astype(np.float32)), (mean, var), ONNX_RTOL)


def test_layer_norm_carries_the_loadings_through_its_jacobian():
    """fc1 → relu → fc2 → LayerNorm → fc3 → fc4: fc3's input residual and fc2's become factors and pass the
    LayerNorm by its linearisation; the logits' variance against 20,000 samples: the compact plan within
    15 % in the median and closer than mean-field."""
    from pyro2pfp.planning.graph import Layer

    rng = np.random.default_rng(7)
    d = 12
    ln = Layer(name="ln", op="layer_norm", inputs=["fc2"], out_shape=(d,), source="ln (test)",
               attrs={"dims": 1, "eps": 1e-5},
               params={"weight": GaussianParam(rng.uniform(0.5, 1.5, d), np.zeros(d)),
                       "bias": GaussianParam(0.1 * rng.standard_normal(d), np.zeros(d))})
    layers = [dense_layer(rng, "fc1", INPUT, 6, 16, 0.6, 0.05), Layer(name="relu1", op="relu", inputs=["fc1"],
                                                                      out_shape=(16,), source="relu1 (test)"),
              dense_layer(rng, "fc2", "relu1", 16, d, 0.5, 0.05), ln, dense_layer(rng, "fc3", "ln", d, 8, 0.5, 0.02),
              dense_layer(rng, "fc4", "fc3", 8, 3, 0.5, 0.02)]
    for layer in layers:  # a shared positive part: the units' correlations matter to the sums
        if layer.op == "dense":
            p = layer.params["weight"]
            layer.params["weight"] = GaussianParam(p.mean + 0.3, p.var, site=p.site)
    graph = plan(LayerGraph(input_shape=(6,), layers=layers, output="fc4"))
    cp = plan_compact(graph)
    assert cp.residual == frozenset({"fc2", "fc3"})
    x = rng.standard_normal((3, 6))
    n = 20000
    h = torch.as_tensor(np.broadcast_to(x, (n, 3, 6)).copy())
    for layer in layers:
        if layer.op == "dense":
            w, b = (torch.as_tensor(_draw(layer.params[k], n, rng)) for k in ("weight", "bias"))
            h = torch.einsum("nbi,nji->nbj", h, w) + b[:, None]
        elif layer.op == "relu":
            h = torch.relu(h)
        else:
            gamma, beta = (torch.as_tensor(ln.params[k].mean) for k in ("weight", "bias"))
            h = F.layer_norm(h, (d,), gamma, beta)
    mc = h.numpy().var(axis=0, ddof=1)
    mean_field = np.median(execute(graph, x)[1] / mc)
    graph.factors = cp
    compact = np.median(execute(graph, x)[1] / mc)
    assert abs(np.log(compact)) < abs(np.log(mean_field)) and 0.85 <= compact <= 1.15, (mean_field, compact)
