"""Every common way of writing a Pyro BNN and its guide converts without renaming.

The workhorse check: for a one-hidden-layer network with a deterministic input, PFP's per-logit
mean and variance are exact (independent hidden units, exact ReLU moments), so PFP must agree
with ``Predictive`` sampling of the same (model, guide) up to Monte Carlo error (z bound with a
family-wise false-alarm rate of 1e-4).  Guides with correlations are checked against their own
marginal variances instead.
"""
from __future__ import annotations

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from pyro.infer import SVI, Predictive, Trace_ELBO, autoguide
from pyro.nn import PyroModule, PyroParam, PyroSample
from scipy.special import ndtri

import pyro2pfp
import pyro2pfp.compat
from pyro2pfp_experiments.validation import sampling_agreement
from tests.support.stats import median_variance_ratio, variance_ratio_band

D_IN, HIDDEN, CLASSES = 12, 10, 4


def data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g)
    return x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()


def fit(model, guide, steps=30, lr=0.02):
    x, y = data()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": lr}), Trace_ELBO())
    for _ in range(steps):
        svi.step(x, y)


def prior(shape, scale=1.0):
    return PyroSample(dist.Normal(0.0, scale).expand(shape).to_event(len(shape)))


def likelihood(logits, y):
    with pyro.plate("data", logits.shape[0]):
        pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
    return logits


def assert_exact_against_sampling(model, guide, net, num_samples=1000):
    x, _ = data(n=16, seed=1)
    mean, var = net.compile()(x)
    ref_mean, ref_var = net.reference(x)
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-4, atol=1e-5 * np.abs(ref_mean).max())
    np.testing.assert_allclose(var, ref_var, rtol=1e-3, atol=1e-5 * ref_var.max())
    samples = Predictive(model, guide=guide, num_samples=num_samples, return_sites=("_RETURN",))(x)["_RETURN"]
    agreement = sampling_agreement(ref_mean, ref_var, samples.detach().double().numpy())
    z = ndtri(1 - 1e-4 / (4 * ref_mean.size))
    assert agreement.mean_z < z and agreement.var_z < z, agreement
    return agreement


class MLP(PyroModule):
    def __init__(self, bias="prob"):
        super().__init__()
        self.fc1 = PyroModule[nn.Linear](D_IN, HIDDEN, bias=bias != "none")
        self.fc2 = PyroModule[nn.Linear](HIDDEN, CLASSES, bias=bias != "none")
        for layer in (self.fc1, self.fc2):
            layer.weight = prior(layer.weight.shape)
            if bias == "prob":
                layer.bias = prior(layer.bias.shape)
            elif bias == "det":
                layer.bias = PyroParam(torch.zeros(layer.bias.shape))

    def forward(self, x, y=None):
        return likelihood(self.fc2(F.relu(self.fc1(x))), y)


@pytest.mark.slow
@pytest.mark.parametrize("guide_cls", [autoguide.AutoNormal, autoguide.AutoDiagonalNormal])
def test_diagonal_autoguides_are_exact(guide_cls):
    model = MLP()
    guide = guide_cls(model, init_scale=0.1)
    fit(model, guide)
    net = pyro2pfp.convert(model, guide)
    assert [p.op for p in net.plan.layers] == ["dense", "relu", "dense"]
    assert_exact_against_sampling(model, guide, net)


@pytest.mark.slow
@pytest.mark.parametrize("guide_cls", [autoguide.AutoLowRankMultivariateNormal, autoguide.AutoMultivariateNormal])
def test_correlated_autoguides_under_mean_field_use_marginals_and_warn(guide_cls):
    model = MLP()
    guide = guide_cls(model, init_scale=0.1)
    fit(model, guide, steps=10)
    with pytest.warns(UserWarning, match=r"correlations between weights .*are dropped"):
        net = pyro2pfp.convert(model, guide, correlation="mean-field")
    marginal = guide.get_posterior().variance.detach().double().numpy()
    flat = np.concatenate([net.layer_graph.layer(name).params[attr].var.ravel()
                           for name in ("fc1", "fc2") for attr in ("weight", "bias")])
    order = [site for site, _ in guide._unpack_latent(torch.zeros(guide.latent_dim))]
    names = [s["name"] for s in order]
    expected = {}
    pos = 0
    for site in order:
        size = site["value"].numel()
        expected[site["name"]] = marginal[pos:pos + size]
        pos += size
    got = {f"{n}.{a}": net.layer_graph.layer(n).params[a].var.ravel()
           for n in ("fc1", "fc2") for a in ("weight", "bias")}
    for name in names:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5)
    assert flat.size == marginal.size


@pytest.mark.slow
def test_hand_written_softplus_guide_is_exact():
    model = MLP()

    def guide(x, y=None):
        for name, shape in (("fc1.weight", (HIDDEN, D_IN)), ("fc1.bias", (HIDDEN,)),
                            ("fc2.weight", (CLASSES, HIDDEN)), ("fc2.bias", (CLASSES,))):
            loc = pyro.param(f"q_{name}_loc", 0.3 * torch.randn(shape))
            rho = pyro.param(f"q_{name}_rho", torch.full(shape, -2.0))
            pyro.sample(name, dist.Normal(loc, F.softplus(rho)).to_event(len(shape)))

    fit(model, guide)
    assert_exact_against_sampling(model, guide, pyro2pfp.convert(model, guide))


def test_autodelta_and_flow_guides_are_rejected_with_the_guide_named():
    model = MLP()
    x, y = data()
    for guide in (autoguide.AutoDelta(model), autoguide.AutoIAFNormal(model)):
        guide(x, y)
        with pytest.raises(pyro2pfp.PosteriorError, match=type(guide).__name__):
            pyro2pfp.convert(model, guide)


def _sequential_model():
    body = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
    pyro.nn.module.to_pyro_module_(body)
    for module in body.modules():
        for name, value in list(module.named_parameters(recurse=False)):
            setattr(module, name, prior(value.shape))

    class Model(PyroModule):
        def __init__(self):
            super().__init__()
            self.net = body

        def forward(self, x, y=None):
            return likelihood(self.net(x), y)

    return Model()


class ModuleListMLP(PyroModule):
    def __init__(self):
        super().__init__()
        widths = [D_IN, HIDDEN, CLASSES]
        self.layers = PyroModule[nn.ModuleList]([PyroModule[nn.Linear](a, b) for a, b in zip(widths, widths[1:])])
        for layer in self.layers:
            layer.weight = prior(layer.weight.shape)
            layer.bias = prior(layer.bias.shape)

    def forward(self, x, y=None):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return likelihood(x, y)


@pytest.mark.slow
@pytest.mark.parametrize("build,first", [(_sequential_model, "net.0"), (ModuleListMLP, "layers.0")])
def test_sequential_and_modulelist_models(build, first):
    model = build()
    guide = autoguide.AutoNormal(model, init_scale=0.1)
    fit(model, guide)
    net = pyro2pfp.convert(model, guide)
    assert net.plan.layers[0].name == first
    assert net.layer_graph.layer(first).params["weight"].site == f"{first}.weight"
    assert_exact_against_sampling(model, guide, net)


class PartlyBayesian(PyroModule):
    """Bayesian fc1 weight, PyroParam fc1 bias, untouched PyroModule fc2, plain nn.Linear head."""

    def __init__(self):
        super().__init__()
        self.fc1 = PyroModule[nn.Linear](D_IN, HIDDEN)
        self.fc1.weight = prior((HIDDEN, D_IN))
        self.fc1.bias = PyroParam(torch.zeros(HIDDEN))
        self.fc2 = PyroModule[nn.Linear](HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x, y=None):
        pyro.module("head", self.head)
        return likelihood(self.head(F.relu(self.fc2(F.relu(self.fc1(x))))), y)


@pytest.mark.slow
def test_partially_bayesian_network():
    model = PartlyBayesian()
    guide = autoguide.AutoNormal(model, init_scale=0.1)
    fit(model, guide)
    # The deterministic fc2 mixes fc1's independent units, so its outputs are correlated and the mean-field
    # plan under-states the logits' variance (median ratio to sampling 0.39, measured with 20,000 draws):
    # the spot check refuses it, naming the remedy.
    with pytest.raises(pyro2pfp.FidelityError, match="correlation='shared-factor'"):
        pyro2pfp.convert(model, guide, correlation="mean-field")
    # 'auto' sees the deterministic dense layer that reads random units and picks shared factors, which pass
    # the spot check (convert's default check=).
    net = pyro2pfp.convert(model, guide)
    assert net.plan.correlation == "shared-factor", net.plan.summary()
    store = pyro.get_param_store()
    fc1 = net.layer_graph.layer("fc1")
    assert fc1.params["weight"].site == "fc1.weight" and not fc1.params["weight"].is_deterministic
    np.testing.assert_allclose(fc1.params["bias"].mean, store["fc1.bias"].detach().double().numpy(), rtol=1e-6)
    assert fc1.params["bias"].is_deterministic
    assert net.layer_graph.layer("fc2").params["weight"].is_deterministic
    head = net.layer_graph.layer("head")
    np.testing.assert_allclose(head.params["weight"].mean, store["head$$$weight"].detach().double().numpy(),
                               rtol=1e-6)
    assert head.params["weight"].is_deterministic
    # Deterministic layers still propagate the uncertainty of fc1.
    x, _ = data(n=8, seed=3)
    mean, var = net.compile()(x)
    assert np.all(var > 0)
    samples = Predictive(model, guide=guide, num_samples=800, return_sites=("_RETURN",))(x)["_RETURN"]
    ref_mean, ref_var = net.reference(x)
    mc = samples.detach().double().numpy()
    agreement = sampling_agreement(ref_mean, ref_var, mc)
    assert agreement.argmax_agreement >= 0.85 and agreement.mean_rel_error < 0.05, agreement
    # The shared-factor plan carries fc2's correlations: within the band the sample count gives (measured 0.97).
    lo, hi = variance_ratio_band(mc)
    assert lo <= median_variance_ratio(ref_var, mc) <= hi, (median_variance_ratio(ref_var, mc), lo, hi)


@pytest.mark.slow
@pytest.mark.parametrize("bias", ["none", "det", "prob"])
def test_bias_configurations(bias):
    model = MLP(bias=bias)
    guide = autoguide.AutoNormal(model, init_scale=0.1)
    fit(model, guide, steps=10)
    net = pyro2pfp.convert(model, guide)
    fc2 = net.plan.layer("fc2")
    assert ("bias_mean" in fc2.tensors) == (bias != "none")
    assert ("bias_var" in fc2.tensors) == (bias == "prob")
    assert_exact_against_sampling(model, guide, net, num_samples=600)


@pytest.mark.slow
def test_input_variance_network():
    model = MLP()
    guide = autoguide.AutoNormal(model, init_scale=0.1)
    fit(model, guide, steps=10)
    net = pyro2pfp.convert(model, guide, input_variance=True)
    plain = pyro2pfp.convert(model, guide)
    x, _ = data(n=5, seed=4)
    exe = net.compile()
    zero = np.zeros_like(x.numpy())
    np.testing.assert_allclose(net.reference(x, zero)[0], plain.reference(x)[0], rtol=1e-12)
    np.testing.assert_allclose(net.reference(x, zero)[1], plain.reference(x)[1], rtol=1e-10)
    noise = np.full_like(zero, 0.5)
    (rm, rv), (cm, cv) = net.reference(x, noise), exe(x, noise)
    np.testing.assert_allclose(cm, rm, rtol=1e-4, atol=1e-5 * np.abs(rm).max())
    np.testing.assert_allclose(cv, rv, rtol=1e-4, atol=1e-5 * rv.max())
    assert np.all(rv > plain.reference(x)[1])  # sensor noise adds uncertainty
    with pytest.raises(pyro2pfp.PFPError, match="x_var"):
        net.reference(x)


@pytest.mark.slow
def test_tyxe_variational_bnn():
    import tyxe  # installed by the set-up command (pip install --no-deps tyxe==0.0.2)
    pyro2pfp.compat.patch_pyro_for_tyxe()
    body = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
    import functools

    bnn = tyxe.VariationalBNN(body, tyxe.priors.IIDPrior(dist.Normal(0.0, 1.0)),
                              tyxe.likelihoods.Categorical(dataset_size=64),
                              functools.partial(tyxe.guides.AutoNormal, init_scale=0.1))
    x, y = data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    bnn.fit(loader, pyro.optim.Adam({"lr": 0.02}), 5)
    net = pyro2pfp.convert(bnn)
    w = net.layer_graph.layer("0").params["weight"]
    np.testing.assert_allclose(w.mean, bnn.net_guide.get_loc("net.0.weight").detach().double().numpy(), rtol=1e-6)
    np.testing.assert_allclose(w.var, bnn.net_guide.get_scale("net.0.weight").detach().double().numpy() ** 2,
                               rtol=1e-5)
    assert_exact_against_sampling(bnn.net, bnn.net_guide, net)


class FunctionalBNN(PyroModule):
    """Weights as PyroSample attributes of the model itself, layers written as ``x @ W + b`` /
    ``torch.matmul`` (the style of Pyro's regression tutorials and many notebooks)."""

    def __init__(self, second_bias: str = "none"):
        super().__init__()
        self.W1 = prior((D_IN, HIDDEN))
        self.b1 = prior((HIDDEN,))
        self.W2 = prior((HIDDEN, CLASSES))
        self.second_bias = second_bias
        if second_bias == "prob":
            self.b2 = prior((CLASSES,))

    def forward(self, x, y=None):
        h = torch.relu(x @ self.W1 + self.b1)
        logits = torch.matmul(h, self.W2)
        if self.second_bias == "prob":
            logits = self.b2 + logits  # the parameter on the left works too
        return likelihood(logits, y)


@pytest.mark.slow
@pytest.mark.parametrize("second_bias", ["none", "prob"])
def test_matmul_layers_with_bias_sites(second_bias):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = FunctionalBNN(second_bias)
    guide = autoguide.AutoNormal(model)
    fit(model, guide)
    net = pyro2pfp.convert(model, guide, input_shape=(D_IN,))
    first, last = (layer for layer in net.layer_graph.layers if layer.op == "dense")
    np.testing.assert_allclose(first.params["weight"].mean, guide.median()["W1"].detach().double().numpy().T,
                               rtol=1e-6)
    assert first.params["bias"].site == "b1"
    assert ("bias" in last.params) == (second_bias == "prob")
    assert_exact_against_sampling(model, guide, net)


def test_a_parameter_added_anywhere_else_is_refused_with_the_reason():
    class BiasTwice(PyroModule):
        def __init__(self):
            super().__init__()
            self.fc = PyroModule[nn.Linear](D_IN, CLASSES)
            self.fc.weight = prior((CLASSES, D_IN))
            self.shift = prior((CLASSES,))

        def forward(self, x, y=None):
            return likelihood(self.fc(x) + self.shift, y)  # fc already has a bias

    pyro.clear_param_store()
    model = BiasTwice()
    guide = autoguide.AutoNormal(model)
    guide(*data(4))
    with pytest.raises(pyro2pfp.UnsupportedLayerError, match=r"bias-free dense/conv layer"):
        pyro2pfp.convert(model, guide, input_shape=(D_IN,))


def structured_guide(model, conditional: str, dependencies=None):
    conditionals = {"fc1.weight": conditional, "fc1.bias": "normal", "fc2.weight": "normal", "fc2.bias": "delta"}
    kwargs = {} if dependencies is None else {"dependencies": dependencies}
    return autoguide.AutoStructured(model, conditionals=conditionals, **kwargs)


@pytest.mark.slow
def test_autostructured_without_dependencies_is_exact():
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = MLP(bias="det")
    guide = structured_guide(model, "normal", dependencies={})
    fit(model, guide)
    net = pyro2pfp.convert(model, guide)
    np.testing.assert_allclose(net.layer_graph.layer("fc1").params["weight"].var,
                               guide.scales.fc1.weight.detach().double().numpy().reshape(HIDDEN, D_IN) ** 2,
                               rtol=1e-6)
    assert net.layer_graph.layer("fc2").params["bias"].is_deterministic  # a PyroParam: no guide site
    assert_exact_against_sampling(model, guide, net)


@pytest.mark.slow
def test_autostructured_mvn_under_mean_field_uses_the_marginals_and_warns():
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = MLP(bias="det")
    guide = structured_guide(model, "mvn", dependencies={})
    fit(model, guide, steps=10)
    n = HIDDEN * D_IN  # a correlation factor far from the identity (set in the store, as after a load)
    a = torch.randn(n, n, generator=torch.Generator().manual_seed(3)) / n**0.5
    tril = torch.linalg.cholesky(a @ a.T + 0.5 * torch.eye(n))
    pyro.get_param_store()["AutoStructured.scale_trils.fc1.weight"] = tril
    with pytest.warns(UserWarning, match=r"correlations between weights .*are dropped"):
        net = pyro2pfp.convert(model, guide, correlation="mean-field")
    with torch.no_grad():
        samples = torch.stack([guide()["fc1.weight"] for _ in range(4000)]).double().numpy()
    var = net.layer_graph.layer("fc1").params["weight"].var
    np.testing.assert_allclose(var, samples.var(axis=0), rtol=0.15)  # 4,000 samples: ±4.5 % sd


def test_autostructured_with_dependencies_is_refused_with_the_sites_named():
    pyro.clear_param_store()
    model = MLP()
    guide = autoguide.AutoStructured(model)  # default: every site depends linearly on the earlier ones
    fit(model, guide, steps=1)
    with pytest.raises(pyro2pfp.PosteriorError, match=r"dependencies.*fc2\.weight"):
        pyro2pfp.convert(model, guide)
