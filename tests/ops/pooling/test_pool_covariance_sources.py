"""In-window covariances of max pools that do not read a conv directly: ``window_closure`` (the shared
factors' covariance of an edge, and of the two branches of a residual add) and ``window_activation``
(a conv's window covariances through an activation that does not commute with the max, e.g. GELU).

* ``window_closure`` is exact for the shared-factor representation ``x = μ + s·(g_c·ζ) + √r·ε``: its
  pairs against sampling that representation, with the Bonferroni bound of the sample count (and the
  two-input form: ``Cov(a_P, b_Q) + Cov(b_P, a_Q)`` of two edges sharing ``ζ``).
* ``window_activation`` keeps Mehler's first term exactly and replaces the rest by its Cauchy-Schwarz
  bound ``ρ²·√(R_i·R_j)``, so its error is at most ``2ρ²·√(R_i·R_j)``: against sampling the network within
  the sampling bound plus that allowance, and (measured 1 %) within 5 % in the median.
* The rewrite gives every max pool of a shared-factor plan covariances (an add, a GELU, another pool),
  and the compiled and ONNX back ends equal the float64 reference for both new ops.
"""
from __future__ import annotations

import numpy as np
import pytest

from pyro2pfp import moments
from pyro2pfp.backends.reference import Activation, execute_all
from pyro2pfp.backends.reference.arrays import padded, window_views
from pyro2pfp.correlation import with_correlation
from pyro2pfp.correlation.shared import Shared
from pyro2pfp.network import PFPNetwork
from pyro2pfp.ops.window_covariance import hermite_terms, taps
from pyro2pfp.planning.correlated_pools import correlate_max_pools
from pyro2pfp.planning.graph import INPUT, Layer, LayerGraph, Repr
from pyro2pfp.planning.plan import PlannedLayer, plan
from pyro2pfp.planning.registry import SHARED_REFERENCES
from tests.support.backends import ONNX_RTOL, assert_matches, onnx_run
from tests.support.builders import conv_layer, dense_layer, pool_layer, relu_layer, reshape_layer
from tests.support.graph_sampler import sample_graph
from tests.support.op_coverage import COMPILED, MONTE_CARLO, covers
from tests.support.stats import z_threshold

POOL = {"kernel": [3, 3], "stride": [2, 2], "padding": [1, 1], "ceil_mode": False}


def _pair_samples(t: np.ndarray, u: np.ndarray | None, pool: dict, out_hw: tuple[int, int]) -> np.ndarray:
    """Per draw, the centred products of every pair of window taps: ``(n, B, C, P, OH, OW)`` (``u``: the
    symmetrised products ``t_P·u_Q + u_P·t_Q`` of two edges)."""
    def views(a):
        flat = a.reshape(-1, *a.shape[2:])
        return [v.reshape(a.shape[0], a.shape[1], *v.shape[1:])
                for v in window_views(padded(flat, pool, out_hw, 0.0), pool["kernel"], pool["stride"], out_hw)]

    tv = views(t - t.mean(0))
    if u is None:
        return np.stack([tv[i] * tv[j] for i, j in moments.window_pairs(len(tv))], axis=3)
    uv = views(u - u.mean(0))
    return np.stack([tv[i] * uv[j] + uv[i] * tv[j] for i, j in moments.window_pairs(len(tv))], axis=3)


def _closure_layer(c: int, hw: tuple[int, int], inputs: list[str]) -> PlannedLayer:
    out_hw = tuple((n + 2 * POOL["padding"][k] - 3) // 2 + 1 for k, n in enumerate(hw))
    layer = Layer("cl", "window_closure", inputs, (c, 36, *out_hw), "cl (test)",
                  attrs={"pool": POOL, "in_hw": list(hw)})
    return PlannedLayer(layer, [Repr.VARIANCE] * len(inputs), Repr.DETERMINISTIC, {})


@covers("window_closure", kind=MONTE_CARLO)
@pytest.mark.parametrize("two", [False, True])
def test_window_closure_is_the_representations_covariance(two):
    rng = np.random.default_rng(3 + two)
    b, c, h, w, k, n = 2, 3, 7, 6, 4, 20_000
    edges = []
    for _ in range(2 if two else 1):
        g = rng.standard_normal((b, c, k))
        g[:, 0] = 0.0  # a channel without shared part
        edges.append((rng.standard_normal((b, c, h, w)), rng.uniform(-1, 1, (b, c, h, w)), g,
                      rng.uniform(0.1, 0.5, (b, c, h, w))))
    layer = _closure_layer(c, (h, w), ["a", "b"][:len(edges)])
    acts = [Activation(mu, r + (s**2) * (g**2).sum(2)[..., None, None], Repr.VARIANCE) for mu, s, g, r in edges]
    _, out = SHARED_REFERENCES["window_closure"](layer, acts, [Shared(s, g) for _, s, g, _ in edges], None, None)
    zeta = rng.standard_normal((n, b, 1, k))
    draws = [mu + s * (zeta * g).sum(-1)[..., None, None] + np.sqrt(r) * rng.standard_normal((n, *mu.shape))
             for mu, s, g, r in edges]
    products = _pair_samples(draws[0], draws[1] if two else None, POOL, out.mean.shape[3:])
    mc, se = products.mean(0), products.std(0) / np.sqrt(n)
    z = z_threshold(mc.size)
    assert np.all(np.abs(out.mean - mc) <= z * se + 1e-12), np.max(np.abs(out.mean - mc) / (se + 1e-300))
    assert np.abs(out.mean).max() > 20 * se.max()  # the covariances are resolved by the sample
    assert not out.mean[:, 0].any()  # no shared part: no covariance
    outside = out.mean[:, :, 0, 0, 0]  # pair (tap 0, tap 1) of the corner window: tap 0 is padding
    assert not outside.any()


def gelu_graph(rng: np.random.Generator) -> LayerGraph:
    conv = conv_layer(rng, "c1", INPUT, (1, 10, 10), 3, 3, 1, 1, 1, 1, 0.5, 0.05)
    return LayerGraph(input_shape=(1, 10, 10), output="pool", layers=[
        conv, Layer("act", "gelu", ["c1"], conv.out_shape, "act (test)", attrs={"approximate": "none"}),
        pool_layer("pool", "act", conv.out_shape, 2, 2)])


@covers("window_activation", kind=MONTE_CARLO)
def test_window_activation_matches_sampling_within_mehlers_bound():
    rng = np.random.default_rng(1)
    g = correlate_max_pools(gelu_graph(rng))
    cov_layer = g.layer(g.layer("pool").inputs[1])
    assert cov_layer.op == "window_activation"
    x = rng.uniform(0, 1, (3, 1, 10, 10))
    n = 8_000
    draws = sample_graph(gelu_graph(np.random.default_rng(1)), x, n, seed=2)
    planned = plan(g)
    values = execute_all(planned, x)
    pred = values[cov_layer.name].mean
    products = _pair_samples(draws["act"], None, {"kernel": [2, 2], "stride": [2, 2], "padding": [0, 0],
                                                  "ceil_mode": False}, pred.shape[3:])
    mc, se = products.mean(0), products.std(0) / np.sqrt(n)
    # the allowance 2ρ²·√(R_i·R_j) per pair, from the pre-activation's moments
    pl = next(p for p in planned.layers if p.name == cov_layer.name)
    pre = values["c1"]
    sd, _, rest = hermite_terms(pl, pre.mean, pre.variance(), moments.NUMPY)
    cin = values[cov_layer.inputs[1]].mean
    tap = [(r, q) for r, q in taps([2, 2])]
    allowance = np.empty_like(pred)
    for k, (i, j) in enumerate(moments.window_pairs(4)):
        (r1, q1), (r2, q2) = tap[i], tap[j]
        si, sj = sd[:, :, r1::2, q1::2], sd[:, :, r2::2, q2::2]
        rho = cin[:, :, k] / (si * sj)
        allowance[:, :, k] = 2 * rho**2 * np.sqrt(rest[:, :, r1::2, q1::2] * rest[:, :, r2::2, q2::2])
    z = z_threshold(mc.size)
    assert np.all(np.abs(pred - mc) <= z * se + allowance)
    live = np.abs(mc) > 20 * se
    assert live.mean() > 0.5
    assert abs(np.median(pred[live] / mc[live]) - 1) < 0.05


def residual_graph(rng: np.random.Generator) -> LayerGraph:
    """conv → ReLU → conv, + the ReLU (a residual add) → max pool → GELU → max pool → max pool: the three
    sources of covariances that are not a conv (an add, an activation, another pool)."""
    c1 = conv_layer(rng, "c1", INPUT, (1, 8, 8), 2, 3, 1, 1, 1, 1, 0.5, 0.05)
    sh = c1.out_shape
    c2 = conv_layer(rng, "c2", "r1", sh, 2, 3, 1, 1, 1, 1, 0.4, 0.05)
    p1 = pool_layer("p1", "add", sh, 2, 2)
    gelu = Layer("act", "gelu", ["p1"], p1.out_shape, "act (test)", attrs={"approximate": "tanh"})
    p2 = pool_layer("p2", "act", p1.out_shape, 2, 2)
    p3 = pool_layer("p3", "p2", p2.out_shape, 2, 1)
    return LayerGraph(input_shape=(1, 8, 8), output="out", layers=[
        c1, relu_layer("r1", "c1", sh), c2, Layer("add", "add", ["c2", "r1"], sh, "add (test)"), p1, gelu, p2, p3,
        reshape_layer("flat", "p3", (2,)), dense_layer(rng, "out", "flat", 2, 3, 0.4, 0.05)])


def test_every_max_pool_of_a_shared_factor_plan_is_correlated():
    g = residual_graph(np.random.default_rng(0))
    shared = correlate_max_pools(g, shared=True)
    for pool in ("p1", "p2", "p3"):
        assert len(shared.layer(pool).inputs) == 2, pool
    assert {layer.op for layer in shared.layers} >= {"window_cov", "window_activation", "window_closure"}
    mean_field = correlate_max_pools(g)
    assert len(mean_field.layer("p3").inputs) == 1  # another pool's output: independent in the scheme


@pytest.mark.slow
@covers("window_closure", "window_activation", kind=COMPILED)
@pytest.mark.parametrize("correlation", ["mean-field", "shared-factor"])
def test_compiled_and_onnx_equal_the_reference(correlation):
    g = residual_graph(np.random.default_rng(4))
    rewritten = correlate_max_pools(g, shared=correlation == "shared-factor")
    planned = with_correlation(plan(rewritten), correlation) if correlation != "mean-field" else plan(rewritten)
    net = PFPNetwork(rewritten, planned)
    x = np.random.default_rng(5).uniform(0, 1, (3, *g.input_shape)).astype(np.float32)
    ref = net.reference(x)
    assert_matches(net.compile("llvm")(x), ref)
    assert_matches(onnx_run(net, x), ref, ONNX_RTOL)


@covers("window_closure", "window_activation", kind=COMPILED)
def test_small_shared_factor_net_compiled_matches_the_reference():
    """The fast loop's compiled check of both ops (the test above is slow): a residual add → 2×2 pool →
    GELU → 2×2/1 pool, shared factors, two channels of 6×6."""
    rng = np.random.default_rng(6)
    c1 = conv_layer(rng, "c1", INPUT, (1, 6, 6), 2, 3, 1, 1, 1, 1, 0.5, 0.05)
    sh = c1.out_shape
    p1 = pool_layer("p1", "add", sh, 2, 2)
    g = LayerGraph(input_shape=(1, 6, 6), output="p2", layers=[
        c1, relu_layer("r1", "c1", sh), conv_layer(rng, "c2", "r1", sh, 2, 3, 1, 1, 1, 1, 0.4, 0.05),
        Layer("add", "add", ["c2", "r1"], sh, "add (test)"), p1,
        Layer("act", "gelu", ["p1"], p1.out_shape, "act (test)", attrs={"approximate": "none"}),
        pool_layer("p2", "act", p1.out_shape, 2, 1)])
    rewritten = correlate_max_pools(g, shared=True)
    assert {"window_closure", "window_activation"} <= {layer.op for layer in rewritten.layers}
    net = PFPNetwork(rewritten, with_correlation(plan(rewritten), "shared-factor"))
    x = rng.uniform(0, 1, (2, 1, 6, 6)).astype(np.float32)
    assert_matches(net.compile("llvm")(x), net.reference(x))
