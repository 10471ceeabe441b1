"""convert(): tracing, posterior reading, planning and the errors users see."""
from __future__ import annotations

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from pyro.infer.autoguide import AutoDelta, AutoNormal
from pyro.nn import PyroModule, PyroSample

import pyro2pfp
from pyro2pfp.planning.graph import Repr
from pyro2pfp_experiments.zoo import BayesianLeNet5, BayesianMLP, make_guide


def initialised_guide(model, x, y, init_scale=0.05):
    guide = make_guide(model, init_scale=init_scale)
    guide(x, y)  # creates the posterior parameters (what SVI's first step does)
    return guide


def mnist_like(batch=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g)


def test_mlp_traces_to_dense_relu_dense_and_reads_autonormal_posterior():
    model = BayesianMLP(hidden=(16,))
    x, y = mnist_like()
    guide = initialised_guide(model, x, y)
    net = pyro2pfp.convert(model, guide, calibration=0.3)  # input shape from the Linear first layer
    assert net.input_shape == (784,)
    ops = [(p.op, p.name) for p in net.plan.layers]
    assert ops == [("dense", "fc1"), ("relu", "relu"), ("dense", "fc2")]
    store = pyro.get_param_store()
    for name in ("fc1", "fc2"):
        layer = net.layer_graph.layer(name)
        for attr in ("weight", "bias"):
            loc = store[f"AutoNormal.locs.{name}.{attr}"].detach().double().numpy()
            scale = store[f"AutoNormal.scales.{name}.{attr}"].detach().double().numpy()
            np.testing.assert_allclose(layer.params[attr].mean, loc, rtol=1e-7)
            np.testing.assert_allclose(layer.params[attr].var, scale**2, rtol=1e-6)
            assert layer.params[attr].site == f"{name}.{attr}"
    fc1, fc2 = net.plan.layer("fc1"), net.plan.layer("fc2")
    w1, w2 = net.layer_graph.layer("fc1").params["weight"], net.layer_graph.layer("fc2").params["weight"]
    # First layer: deterministic input, calibrated weight variances.
    assert fc1.in_reprs == [Repr.DETERMINISTIC] and fc1.out_repr is Repr.VARIANCE
    np.testing.assert_allclose(fc1.tensors["weight_var"], 0.3 * w1.var)
    # Default plan: variances on every edge, variance-input form, no conversions.
    assert fc2.in_reprs == [Repr.VARIANCE] and fc2.out_repr is Repr.VARIANCE
    np.testing.assert_allclose(fc2.tensors["weight_var"], 0.3 * w2.var)
    assert not any(p.op == "convert" for p in net.plan.layers)


def test_raw_moment_plan_is_the_papers():
    model = BayesianMLP(hidden=(16,))
    x, y = mnist_like()
    guide = initialised_guide(model, x, y)
    net = pyro2pfp.convert(model, guide, calibration=0.3, moment_form="raw")
    fc1, relu, fc2 = net.plan.layers
    w2 = net.layer_graph.layer("fc2").params["weight"]
    assert fc1.in_reprs == [Repr.DETERMINISTIC] and "weight_var" in fc1.tensors
    assert relu.in_reprs == [Repr.VARIANCE] and relu.out_repr is Repr.SECOND_MOMENT  # no conversion
    assert fc2.in_reprs == [Repr.SECOND_MOMENT] and fc2.out_repr is Repr.VARIANCE
    np.testing.assert_allclose(fc2.tensors["weight_second_moment"], w2.mean**2 + 0.3 * w2.var)
    assert "conversion" not in net.summary()
    with pytest.raises(pyro2pfp.PFPError, match="moment_form"):
        pyro2pfp.convert(model, guide, moment_form="fast")


@pytest.mark.slow
def test_lenet_plans():
    model = BayesianLeNet5(c1=2, c2=3, f1=8, f2=6)
    x, y = mnist_like()
    guide = initialised_guide(model, x, y)
    default = pyro2pfp.convert(model, guide, input_shape=(1, 28, 28))
    # the default: each conv → ReLU → max pool becomes conv → correlated max pool → ReLU (exact), the
    # pool reading its window's covariances from a window_cov layer (a plain tensor)
    assert [p.op for p in default.plan.layers] == [
        "conv2d", "window_cov", "max_pool2d", "relu", "conv2d", "window_cov", "max_pool2d", "relu", "reshape",
        "dense", "relu", "dense", "relu", "dense"]
    assert all(p.out_repr is (Repr.DETERMINISTIC if p.op == "window_cov" else Repr.VARIANCE)
               for p in default.plan.layers)
    assert "conversion" not in default.summary() and "correlated Clark max" in default.summary()
    # the paper's plan: independent max pools, raw moments into compute layers
    net = pyro2pfp.convert(model, guide, input_shape=(1, 28, 28), moment_form="raw", max_pool="independent")
    ops = [p.op for p in net.plan.layers]
    assert ops == ["conv2d", "relu", "max_pool2d", "conv2d", "relu", "max_pool2d", "reshape",
                   "dense", "relu", "dense", "relu", "dense"]
    relu1, pool1 = net.plan.layers[1], net.plan.layers[2]
    assert relu1.out_repr is Repr.VARIANCE  # max pooling wants variances: converted in ReLU's epilogue
    assert pool1.in_reprs == [Repr.VARIANCE] and pool1.out_repr is Repr.SECOND_MOMENT  # conv wants s
    text = str(net)
    for word in ("conv1", "max_pool2d", "deterministic-input form", "E[w²] precomputed",
                 "second moment → variance", "variance → second moment"):
        assert word in text


def test_lenet_without_input_shape_asks_for_it():
    model = BayesianLeNet5(c1=2, c2=3, f1=8, f2=6)
    x, y = mnist_like()
    guide = initialised_guide(model, x, y)
    with pytest.raises(pyro2pfp.InputShapeError, match=r"conv1.*input_shape"):
        pyro2pfp.convert(model, guide)


def test_wrong_input_shape_is_a_clear_error():
    model = BayesianLeNet5(c1=2, c2=3, f1=8, f2=6)
    x, y = mnist_like()
    guide = initialised_guide(model, x, y)
    with pytest.raises(pyro2pfp.TracingError, match=r"input shape \(batch, 1, 20, 20\)"):
        pyro2pfp.convert(model, guide, input_shape=(1, 20, 20))


def test_reference_and_compiled_accept_numpy_and_torch_and_reject_bad_shapes():
    model = BayesianMLP(hidden=(8,))
    x, y = mnist_like(batch=3)
    net = pyro2pfp.convert(model, initialised_guide(model, x, y))
    exe = net.compile()
    flat = x.reshape(3, -1)
    m_np, v_np = exe(flat.numpy())
    m_t, v_t = exe(flat)
    np.testing.assert_array_equal(m_np, m_t)
    rm, rv = net.reference(flat)
    np.testing.assert_allclose(m_np, rm, rtol=1e-4, atol=1e-5)
    assert m_np.dtype == np.float32 and m_np.shape == (3, 10) and v_np.shape == (3, 10)
    with pytest.raises(pyro2pfp.InputShapeError, match=r"\(3, 1, 28, 28\), expected \(batch, 784\)"):
        exe(x)
    with pytest.raises(pyro2pfp.InputShapeError, match="single example"):
        net.reference(flat[0])
    with pytest.raises(pyro2pfp.InputShapeError, match="NaN"):
        exe(np.full((1, 784), np.nan, np.float32))


def test_posterior_means_reproduce_the_deterministic_forward():
    """At calibration 0 the PFP mean is the network evaluated at the posterior means."""
    model = BayesianLeNet5(c1=3, c2=4, f1=10, f2=8)
    x, y = mnist_like(batch=5)
    guide = initialised_guide(model, x, y)
    net = pyro2pfp.convert(model, guide, input_shape=(1, 28, 28), calibration=0.0)
    with torch.no_grad(), pyro.poutine.condition(data=guide.median()):
        expected = model(x).double().numpy()
    mean, var = net.reference(x)
    np.testing.assert_allclose(mean, expected, rtol=1e-5, atol=1e-5)
    assert np.all(var <= 1e-12 * np.abs(expected).max() ** 2)


class _HandWrittenGuideNet(PyroModule):
    def __init__(self):
        super().__init__()
        self.fc1 = PyroModule[nn.Linear](6, 4)
        self.fc1.weight = PyroSample(dist.Normal(0.0, 1.0).expand([4, 6]).to_event(2))
        self.fc1.bias = PyroSample(dist.Normal(0.0, 1.0).expand([4]).to_event(1))

    def forward(self, x, y=None):
        logits = self.fc1(x)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


def test_hand_written_guide_posterior_is_read_from_its_distributions():
    model = _HandWrittenGuideNet()
    w_loc = torch.randn(4, 6)
    w_raw = torch.randn(4, 6)
    b_loc, b_log = torch.randn(4), torch.randn(4)

    def guide(x, y=None):
        mu = pyro.param("my_w_mu", w_loc)
        rho = pyro.param("my_w_rho", w_raw)
        pyro.sample("fc1.weight", dist.Normal(mu, F.softplus(rho)).to_event(2))
        pyro.sample("fc1.bias", dist.Normal(pyro.param("b_mu", b_loc), pyro.param("b_log", b_log).exp()).to_event(1))

    net = pyro2pfp.convert(model, guide)
    w = net.layer_graph.layer("fc1").params["weight"]
    np.testing.assert_allclose(w.mean, w_loc.detach().double().numpy(), rtol=1e-6)
    np.testing.assert_allclose(w.var, F.softplus(w_raw.detach()).double().numpy() ** 2, rtol=1e-5)
    b = net.layer_graph.layer("fc1").params["bias"]
    np.testing.assert_allclose(b.var, b_log.detach().exp().double().numpy() ** 2, rtol=1e-5)


def test_guide_errors_name_the_guide_and_site():
    model = _HandWrittenGuideNet()
    x = torch.randn(2, 6)
    y = torch.randint(0, 4, (2,))

    delta = AutoDelta(model)
    delta(x, y)
    with pytest.raises(pyro2pfp.PosteriorError, match="AutoDelta"):
        pyro2pfp.convert(model, delta)

    with pytest.raises(pyro2pfp.PosteriorError, match="never been run"):
        pyro2pfp.convert(model, AutoNormal(model))

    def laplace_guide(x, y=None):
        pyro.sample("fc1.weight", dist.Laplace(torch.zeros(4, 6), torch.ones(4, 6)).to_event(2))
        pyro.sample("fc1.bias", dist.Normal(torch.zeros(4), torch.ones(4)).to_event(1))

    # A non-Gaussian weight posterior with finite moments is moment-matched, with a warning.
    with pytest.warns(UserWarning, match=r"fc1.weight.*Laplace"):
        w = pyro2pfp.convert(model, laplace_guide, check_posterior=False).layer_graph.layer("fc1").params["weight"]
    np.testing.assert_array_equal(w.var, np.full((4, 6), 2.0))  # Var Laplace(0, b) = 2 b²

    def cauchy_guide(x, y=None):
        pyro.sample("fc1.weight", dist.Cauchy(torch.zeros(4, 6), torch.ones(4, 6)).to_event(2))
        pyro.sample("fc1.bias", dist.Normal(torch.zeros(4), torch.ones(4)).to_event(1))

    with pytest.raises(pyro2pfp.PosteriorError, match=r"'fc1.weight'.*Cauchy"):
        pyro2pfp.convert(model, cauchy_guide)

    def partial_guide(x, y=None):
        pyro.sample("fc1.weight", dist.Normal(torch.zeros(4, 6), torch.ones(4, 6)).to_event(2))

    with pytest.raises(pyro2pfp.PosteriorError, match=r"'fc1.bias'.*no posterior"):
        pyro2pfp.convert(model, partial_guide)

    def wrong_shape_guide(x, y=None):
        pyro.sample("fc1.weight", dist.Normal(torch.zeros(6, 4), torch.ones(6, 4)).to_event(2))
        pyro.sample("fc1.bias", dist.Normal(torch.zeros(4), torch.ones(4)).to_event(1))

    with pytest.raises(pyro2pfp.PosteriorError, match=r"'fc1.weight'.*shape"):
        pyro2pfp.convert(model, wrong_shape_guide)


class _MishNet(PyroModule):
    def __init__(self):
        super().__init__()
        self.fc1 = PyroModule[nn.Linear](6, 4)
        self.fc1.weight = PyroSample(dist.Normal(0.0, 1.0).expand([4, 6]).to_event(2))
        self.gate = nn.Mish()

    def forward(self, x, y=None):
        return self.gate(self.fc1(x))


def test_unsupported_layer_names_module_path_and_op():
    model = _MishNet()

    def guide(x, y=None):
        pyro.sample("fc1.weight", dist.Normal(torch.zeros(4, 6), torch.ones(4, 6)).to_event(2))

    with pytest.raises(pyro2pfp.UnsupportedLayerError, match=r"gate \(aten\.mish\).*Supported"):
        pyro2pfp.convert(model, guide)


def test_non_module_model_and_bad_calibration_are_rejected():
    with pytest.raises(pyro2pfp.PosteriorError, match="needs the trained guide"):
        pyro2pfp.convert(lambda x: x, None, input_shape=(3,))
    model = _HandWrittenGuideNet()

    def guide(x, y=None):
        pyro.sample("fc1.weight", dist.Normal(torch.zeros(4, 6), torch.ones(4, 6)).to_event(2))
        pyro.sample("fc1.bias", dist.Normal(torch.zeros(4), torch.ones(4)).to_event(1))

    with pytest.raises(pyro2pfp.TracingError, match="torch.nn.Module"):
        pyro2pfp.convert(42, guide, input_shape=(6,))
    with pytest.raises(pyro2pfp.PFPError, match="calibration"):
        pyro2pfp.convert(model, guide, calibration=-1.0)
