"""Breadth: LeakyReLU, batch norm (affine), average/max pooling with padding and ceil mode,
residual add, Conv1d, padding='same', a final softmax — each converted from torch, run by the
NumPy reference and the compiled module, and (where the moments are exact) checked by sampling."""
from __future__ import annotations

import copy
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyro2pfp
from pyro2pfp.network import PFPNetwork
from pyro2pfp.planning.graph import INPUT, GaussianParam, Layer, LayerGraph
from pyro2pfp.planning.plan import plan
from tests.support.builders import BayesianFirstLayer, ResidualNet, pool_cases, pool_graph
from tests.support.op_coverage import COMPILED, MONTE_CARLO, covers

SETTINGS = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def compiled_and_reference(graph: LayerGraph, x, x_var=None, form="variance"):
    net = PFPNetwork(graph, plan(graph, 1.0, form))
    exe = net.compile()
    args = (x,) if x_var is None else (x, x_var)
    return net.reference(*args), exe(*args)


def assert_close(out, ref, scale):
    for o, r in zip(out, ref):
        assert np.all(np.isfinite(o))
        np.testing.assert_allclose(o, r, rtol=1e-4, atol=1e-5 * scale)


# --- compiled vs reference on hand-built graphs ------------------------------------------------

@pytest.mark.slow
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 40), slope=st.sampled_from([0.0, 0.01, 0.2, 0.5, 1.0]),
       x_var=st.sampled_from([None, 0.0, 1e-6, 1.0, 100.0]), form=st.sampled_from(["variance", "raw"]))
@covers("leaky_relu", kind=COMPILED)
def test_leaky_relu_compiled_matches_reference(seed, n, slope, x_var, form):
    rng = np.random.default_rng(seed)
    graph = LayerGraph((n,), [Layer("lrelu", "leaky_relu", [INPUT], (n,), "t", {"slope": slope})], "lrelu",
                       input_variance=x_var is not None)
    x = (3 * rng.standard_normal((3, n))).astype(np.float32)
    xv = None if x_var is None else (x_var * rng.uniform(0, 1, x.shape)).astype(np.float32)
    ref, out = compiled_and_reference(graph, x, xv, form)
    assert_close(out, ref, np.abs(x).max() + (np.sqrt(xv.max()) if xv is not None else 0) ** 2 + 1)


def torch_pool_shape(kind, c, h, w, kernel, stride, pad, ceil, **kw):
    x = torch.zeros(1, c, h, w)
    pool = F.max_pool2d if kind == "max" else F.avg_pool2d
    return tuple(pool(x, kernel, stride, pad, ceil_mode=ceil, **kw).shape[1:])


@pytest.mark.slow
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), case=pool_cases(), kind=st.sampled_from(["max", "avg"]),
       include_pad=st.booleans(), x_var=st.sampled_from([None, 0.0, 1e-4, 1.0]))
@covers("avg_pool2d", "max_pool2d", kind=COMPILED)
def test_pooling_with_padding_and_ceil_mode_compiled_matches_reference(seed, case, kind, include_pad, x_var):
    graph, torch_pool = pool_graph(kind, case, include_pad, input_variance=x_var is not None)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, *graph.input_shape)).astype(np.float32)
    xv = None if x_var is None else (x_var * rng.uniform(0, 1, x.shape)).astype(np.float32)
    ref, out = compiled_and_reference(graph, x, xv)
    assert_close(out, ref, 10.0)
    if x_var in (None, 0.0):  # the deterministic mean is torch's pooling
        expected = torch_pool(torch.as_tensor(x, dtype=torch.float64))
        np.testing.assert_allclose(ref[0], expected.numpy(), rtol=1e-12, atol=1e-12)


@covers("leaky_relu", kind=COMPILED)
@pytest.mark.parametrize("form", ["variance", "raw"])
def test_leaky_relu_small_layer_compiled_matches_reference(form):
    """One fixed case in the fast loop (the sweep above is slow): slope 0.2, means from −3σ to +3σ,
    variances 0 and 100 beside O(1) ones."""
    rng = np.random.default_rng(24)
    n = 24
    graph = LayerGraph((n,), [Layer("lrelu", "leaky_relu", [INPUT], (n,), "t", {"slope": 0.2})], "lrelu",
                       input_variance=True)
    x = rng.standard_normal((3, n)).astype(np.float32)
    xv = rng.uniform(0, 1, x.shape).astype(np.float32)
    xv[0, :2] = [0.0, 100.0]
    ref, out = compiled_and_reference(graph, x, xv, form)
    assert_close(out, ref, 100.0)


@covers("avg_pool2d", kind=COMPILED)
@pytest.mark.parametrize("case, include_pad", [((3, 2, 1, False, 7, 7), True), ((3, 2, 1, False, 7, 7), False),
                                               ((2, 2, 0, True, 5, 5), False)],
                         ids=["pad-count", "pad-exclude", "ceil"])
def test_avg_pool_small_layer_compiled_matches_reference(case, include_pad):
    """One fixed window per form in the fast loop (the sweep above is slow): padding counted or not,
    and a ceil-mode overhang; a Gaussian input (the variance is ``Σ v / n²`` over the window)."""
    graph, _ = pool_graph("avg", case, include_pad, input_variance=True)
    rng = np.random.default_rng(25)
    x = rng.standard_normal((2, *graph.input_shape)).astype(np.float32)
    xv = rng.uniform(0, 1, x.shape).astype(np.float32)
    ref, out = compiled_and_reference(graph, x, xv)
    assert_close(out, ref, 10.0)


@covers("affine", "add", kind=COMPILED)
@covers("affine", "add", kind=MONTE_CARLO)
def test_affine_add_compiled_match_reference_and_sampling():
    rng = np.random.default_rng(0)
    c, n = 3, 4
    scale, shift = rng.standard_normal(c), rng.standard_normal(c)
    zeros = np.zeros(c)
    layers = [Layer("bn", "affine", [INPUT], (c, n, n), "t",
                    params={"scale": GaussianParam(scale, zeros), "shift": GaussianParam(shift, zeros)}),
              Layer("sum", "add", ["bn", INPUT], (c, n, n), "t")]
    graph = LayerGraph((c, n, n), layers, "sum", input_variance=True)
    x = rng.standard_normal((2, c, n, n)).astype(np.float32)
    xv = rng.uniform(0.1, 1, x.shape).astype(np.float32)
    ref, out = compiled_and_reference(graph, x, xv)
    assert_close(out, ref, 10.0)
    # Linear layers: exact by construction (the add assumes independent summands).
    a = scale.reshape(1, -1, 1, 1)
    np.testing.assert_allclose(ref[0], x * a + shift.reshape(1, -1, 1, 1) + x, rtol=1e-6)
    np.testing.assert_allclose(ref[1], xv * a**2 + xv, rtol=1e-6)


@covers("leaky_relu", kind=MONTE_CARLO)
def test_leaky_relu_moments_match_sampling():
    """LeakyReLU moments are exact for a Gaussian input: z-test with the sample standard errors."""
    rng = np.random.default_rng(1)
    mean = np.array([-2.0, -0.3, 0.0, 0.4, 3.0, 1e-3])
    var = np.array([1.0, 0.5, 2.0, 0.1, 4.0, 1e-6])
    n = 400_000
    for slope in (0.01, 0.2, 0.7):
        s = mean + np.sqrt(var) * rng.standard_normal((n, mean.size))
        y = np.where(s > 0, s, slope * s)
        m, v = pyro2pfp.moments.leaky_relu_moments(mean, var, slope)
        se_m = y.std(0) / np.sqrt(n)
        se_v = np.sqrt(((y - y.mean(0)) ** 4).mean(0) - y.var(0) ** 2) / np.sqrt(n)
        assert np.all(np.abs(m - y.mean(0)) < 5.5 * se_m + 1e-12)
        assert np.all(np.abs(v - y.var(0)) < 5.5 * se_v + 1e-12)
        # A wrong covariance term (dropping Stein's vΦ(α)) is rejected by the same check.
        r_m, r_v = pyro2pfp.moments.relu_moments(mean, var)
        wrong = slope**2 * var + (1 - slope) ** 2 * r_v
        assert np.any(np.abs(wrong - y.var(0)) > 5.5 * se_v)


# --- torch models through convert(): mean at calibration 0 == deterministic torch forward --------



class _Residual(ResidualNet):
    """The every-op network with a final log_softmax (which convert strips)."""

    def logits(self, x):
        return super().forward(x)

    def forward(self, x):
        return F.log_softmax(self.logits(x), -1)


class _Seq1d(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(2, 3, 3, padding=1), nn.BatchNorm1d(3), nn.LeakyReLU(0.05),
                                 nn.Dropout(0.3), nn.Flatten(), nn.Identity(), nn.Linear(3 * 9, 4))

    def forward(self, x):
        return self.net(x)

    logits = forward


def _posterior_guide(model, shape):
    """A hand-written guide: N(loc, scale) for the one sample site."""
    w = model.body.get_submodule(model.first).weight  # a prior sample: gives the shape
    loc, scale = 0.3 * torch.randn(w.shape), 0.1 * torch.rand(w.shape)
    site = f"body.{model.first}.weight"

    def guide(x, y=None):
        pyro.sample(site, dist.Normal(loc, scale).to_event(loc.dim()))

    return guide, loc


@pytest.mark.slow
@pytest.mark.parametrize("body,first,shape", [(_Residual, "conv", (3, 9, 9)), (_Seq1d, "net.0", (2, 9))])
def test_layers_convert_and_match_torch(body, first, shape):
    torch.manual_seed(0)
    torch_body = body()
    for m in torch_body.modules():  # non-trivial running statistics
        if isinstance(m, nn.BatchNorm1d | nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
    torch_body.eval()
    reference_body = copy.deepcopy(torch_body)
    model = BayesianFirstLayer(torch_body, first).eval()
    guide, loc = _posterior_guide(model, shape)
    x = torch.randn(3, *shape)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net = pyro2pfp.convert(model, guide, input_shape=shape, calibration=0.0)
    if body is _Residual:
        assert any("softmax" in str(w.message) for w in caught)
    with torch.no_grad():  # the deterministic network at the posterior mean (logits: no softmax)
        reference_body.get_submodule(first).weight.copy_(loc)
        logits = reference_body.logits(x)
    mean, var = net.reference(x)
    np.testing.assert_allclose(mean, logits.double().numpy(), rtol=1e-5, atol=1e-5)
    assert np.all(var == 0.0)
    cm, cv = net.compile()(x)
    np.testing.assert_allclose(cm, mean, rtol=1e-4, atol=1e-5)
    # With the posterior variance switched on, compiled and reference still agree.
    net1 = pyro2pfp.convert(model, guide, input_shape=shape, calibration=1.0)
    (rm, rv), (cm, cv) = net1.reference(x), net1.compile()(x)
    np.testing.assert_allclose(cm, rm, rtol=1e-4, atol=1e-5 * np.abs(rm).max())
    np.testing.assert_allclose(cv, rv, rtol=1e-4, atol=1e-5 * rv.max())
    assert rv.max() > 0


def test_unsupported_padding_and_softmax_inside_are_clear_errors():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(1, 2, 3, padding=1, padding_mode="reflect")

        def forward(self, x):
            return self.c(x)

    class Mid(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 2)

        def forward(self, x):
            return self.b(torch.softmax(self.a(x), -1))

    for body, first, shape, pattern in [(Bad, "c", (1, 5, 5), r"c \(aten.pad\): .*'reflect'.*only as zeros"),
                                        (Mid, "a", (4,), r"softmax inside")]:
        model = BayesianFirstLayer(body(), first)
        guide, _ = _posterior_guide(model, shape)
        with pytest.raises(pyro2pfp.UnsupportedLayerError, match=pattern):
            pyro2pfp.convert(model, guide, input_shape=shape)


@covers("avg_pool2d", kind=MONTE_CARLO)
def test_avg_pool_matches_sampling():
    """Average pooling with padding (count_include_pad=False), plus an independent branch added by
    the residual rule (means add, variances add): the moments are exact, so sampling must agree
    within its standard error."""
    rng = np.random.default_rng(2)
    c, h = 2, 5
    attrs = {"kernel": [3, 3], "stride": [2, 2], "padding": [1, 1], "ceil_mode": False,
             "dilation": [1, 1], "count_include_pad": False, "divisor": None}
    out = torch_pool_shape("avg", c, h, h, 3, 2, 1, False, count_include_pad=False)
    graph = LayerGraph((c, h, h), [Layer("pool", "avg_pool2d", [INPUT], out, "t", attrs)], "pool",
                       input_variance=True)
    x = rng.standard_normal((1, c, h, h))
    xv = rng.uniform(0.1, 2.0, x.shape)
    mean, var = PFPNetwork(graph, plan(graph)).reference(x, xv)
    n = 200_000
    samples = torch.as_tensor(x + np.sqrt(xv) * rng.standard_normal((n, c, h, h)))
    pooled = F.avg_pool2d(samples, 3, 2, 1, count_include_pad=False).numpy()
    other = rng.standard_normal(pooled.shape) * 0.5 + 1.0  # an independent N(1, 0.25) branch
    total = pooled + other
    se_m = total.std(0) / np.sqrt(n)
    se_v = np.sqrt(((total - total.mean(0)) ** 4).mean(0) - total.var(0) ** 2) / np.sqrt(n)
    assert np.all(np.abs(mean[0] + 1.0 - total.mean(0)) < 5.5 * se_m)
    assert np.all(np.abs(var[0] + 0.25 - total.var(0)) < 5.5 * se_v)
    # Dividing by the full window (count_include_pad=True) instead is rejected by the same check.
    wrong = dict(attrs, count_include_pad=True)
    graph_w = LayerGraph((c, h, h), [Layer("pool", "avg_pool2d", [INPUT], out, "t", wrong)], "pool",
                         input_variance=True)
    _, var_w = PFPNetwork(graph_w, plan(graph_w)).reference(x, xv)
    assert np.any(np.abs(var_w[0] + 0.25 - total.var(0)) > 5.5 * se_v)
