"""Guides and models the way public Pyro code writes them: every guide site is matched to what the
model does with it (weight, non-weight such as a noise scale), never ignored silently.

Checked against ``Predictive`` on the same (model, guide) where the network is one hidden layer
(PFP exact up to Monte Carlo error, see tests/user_code/test_styles.py).
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
from pyro.nn import PyroModule, PyroSample

import pyro2pfp
from tests.user_code.test_styles import (
    CLASSES,
    D_IN,
    HIDDEN,
    assert_exact_against_sampling,
    data,
    fit,
    likelihood,
    prior,
)


class TutorialMLP(PyroModule):
    def __init__(self):
        super().__init__()
        self.fc1 = PyroModule[nn.Linear](D_IN, HIDDEN)
        self.fc1.weight = prior([HIDDEN, D_IN])
        self.fc1.bias = prior([HIDDEN])
        self.fc2 = PyroModule[nn.Linear](HIDDEN, CLASSES)
        self.fc2.weight = prior([CLASSES, HIDDEN])
        self.fc2.bias = prior([CLASSES])

    def forward(self, x, y=None):
        return likelihood(self.fc2(F.relu(self.fc1(x))), y)


def handwritten_guide(x_data, y_data):
    """A Bayes-by-backprop guide written with the model's signature (y required, unused)."""
    for site, shape in {"fc1.weight": (HIDDEN, D_IN), "fc1.bias": (HIDDEN,),
                        "fc2.weight": (CLASSES, HIDDEN), "fc2.bias": (CLASSES,)}.items():
        loc = pyro.param(f"{site}.loc", lambda shape=shape: 0.1 * torch.randn(shape))
        scale = F.softplus(pyro.param(f"{site}.rho", lambda shape=shape: torch.full(shape, -3.0)))
        pyro.sample(site, dist.Normal(loc, scale).to_event(len(shape)))


@pytest.mark.slow
def test_guide_with_the_models_signature():
    model = TutorialMLP()
    fit(model, handwritten_guide, steps=40)
    net = pyro2pfp.convert(model, handwritten_guide)
    assert_exact_against_sampling(model, lambda x, y=None: handwritten_guide(x, y), net)


def test_guide_sites_that_match_nothing_are_an_error():
    """A guide sampling other names (e.g. a random_module guide for a PyroModule model) is refused,
    naming the unmatched sites and the model's weights — not converted as a deterministic net."""
    model = TutorialMLP()

    def renamed(x, y=None):
        for site, shape in {"module$$$fc1.weight": (HIDDEN, D_IN), "fc1.bias": (HIDDEN,),
                            "fc1.weight": (HIDDEN, D_IN), "fc2.weight": (CLASSES, HIDDEN),
                            "fc2.bias": (CLASSES,)}.items():
            pyro.sample(site, dist.Normal(torch.zeros(shape), 0.1).to_event(len(shape)))

    with pytest.raises(pyro2pfp.PosteriorError, match=r"module\$\$\$fc1.weight.*never samples.*fc1.weight"):
        pyro2pfp.convert(model, renamed, check_posterior=False)


def random_module_model_and_guide():
    """The style of the most-read older BNN tutorials: an nn.Module lifted by pyro.random_module."""
    net = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
    shapes = {name: tuple(p.shape) for name, p in net.named_parameters()}

    def model(x_data, y_data):
        priors = {name: dist.Normal(torch.zeros(s), torch.ones(s)).to_event(len(s)) for name, s in shapes.items()}
        lifted = pyro.random_module("module", net, priors)()
        logits = lifted(x_data)
        with pyro.plate("data", x_data.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y_data)
        return logits

    def guide(x_data, y_data):
        dists = {}
        for name, s in shapes.items():
            loc = pyro.param(f"{name}_mu", lambda s=s: 0.1 * torch.randn(s))
            scale = F.softplus(pyro.param(f"{name}_rho", lambda s=s: torch.full(s, -3.0)))
            dists[name] = dist.Normal(loc, scale).to_event(len(s))
        return pyro.random_module("module", net, dists)()

    return model, guide


@pytest.mark.slow
def test_random_module_model_and_handwritten_guide():
    model, guide = random_module_model_and_guide()
    x, y = data()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.02}), Trace_ELBO())
    for _ in range(40):
        svi.step(x, y)
    net = pyro2pfp.convert(model, guide, input_shape=(D_IN,))
    sites = {p.site for layer in net.layer_graph.layers for p in layer.params.values() if p.site}
    assert sites == {"module$$$0.weight", "module$$$0.bias", "module$$$2.weight", "module$$$2.bias"}
    assert_exact_against_sampling(lambda x: model(x, None), lambda x: guide(x, None), net)


class FunctionalMLP(PyroModule):
    """Weights sampled in forward() and used functionally (F.linear), a noise-free classifier."""

    def forward(self, x, y=None):
        w1 = pyro.sample("w1", dist.Normal(0.0, 1.0).expand([HIDDEN, D_IN]).to_event(2))
        b1 = pyro.sample("b1", dist.Normal(0.0, 1.0).expand([HIDDEN]).to_event(1))
        w2 = pyro.sample("w2", dist.Normal(0.0, 1.0).expand([CLASSES, HIDDEN]).to_event(2))
        return likelihood(F.linear(F.relu(F.linear(x, w1, b1)), w2), y)


@pytest.mark.slow
def test_weights_sampled_in_forward():
    model = FunctionalMLP()
    guide = autoguide.AutoNormal(model, init_scale=0.05)
    fit(model, guide, steps=40)
    net = pyro2pfp.convert(model, guide, input_shape=(D_IN,))
    sites = {p.site for layer in net.layer_graph.layers for p in layer.params.values() if p.site}
    assert sites == {"w1", "b1", "w2"}
    assert_exact_against_sampling(model, guide, net)


class Regression(PyroModule):
    """Pyro's regression tutorial style: a learned noise scale ``sigma`` with a Uniform prior."""

    def __init__(self, positive_bias: bool = False):
        super().__init__()
        self.fc1 = PyroModule[nn.Linear](D_IN, HIDDEN)
        self.fc1.weight = prior([HIDDEN, D_IN])
        self.fc1.bias = prior([HIDDEN])
        self.out = PyroModule[nn.Linear](HIDDEN, 1)
        self.out.weight = prior([1, HIDDEN])
        self.out.bias = PyroSample(dist.LogNormal(0.0, 1.0).expand([1]).to_event(1)) if positive_bias \
            else prior([1])

    def forward(self, x, y=None):
        sigma = pyro.sample("sigma", dist.Uniform(0.0, 10.0))
        mean = self.out(F.relu(self.fc1(x)))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mean, sigma).to_event(1), obs=y)
        return mean


def regression_data(n=64):
    x, _ = data(n)
    return x, (x[:, :1] - 0.5 * x[:, 1:2]) + 0.1 * torch.randn(n, 1)


def _fit_regression(model, guide, steps=60):
    x, y = regression_data()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.02}), Trace_ELBO())
    for _ in range(steps):
        svi.step(x, y)


@pytest.mark.slow
def test_learned_noise_scale_is_a_nonweight_site():
    model = Regression()
    guide = autoguide.AutoNormal(model, init_scale=0.05)
    _fit_regression(model, guide)
    net = pyro2pfp.convert(model, guide)
    assert "sigma" in net.nonweight_sites
    assert_exact_against_sampling(model, guide, net)


@pytest.mark.slow
def test_guide_list_with_a_delta_noise_scale():
    """AutoNormal on the weights + AutoDelta on sigma: each part read through its own API."""
    model = Regression()
    guide = autoguide.AutoGuideList(model)
    guide.append(autoguide.AutoNormal(pyro.poutine.block(model, hide=["sigma"]), init_scale=0.05))
    guide.append(autoguide.AutoDelta(pyro.poutine.block(model, expose=["sigma"])))
    _fit_regression(model, guide)
    net = pyro2pfp.convert(model, guide)
    assert net.nonweight_sites["sigma"].kind == "point"
    assert_exact_against_sampling(model, guide, net)

    weights_as_delta = autoguide.AutoGuideList(model)
    weights_as_delta.append(autoguide.AutoNormal(pyro.poutine.block(model, expose=["sigma"])))
    weights_as_delta.append(autoguide.AutoDelta(pyro.poutine.block(model, hide=["sigma"])))
    _fit_regression(model, weights_as_delta, steps=2)
    with pytest.raises(pyro2pfp.PosteriorError, match=r"'fc1.weight' is a weight.*point estimate"):
        pyro2pfp.convert(model, weights_as_delta)


@pytest.mark.slow
def test_positive_bias_is_moment_matched():
    """A LogNormal-prior bias under AutoNormal: exp of a Normal, converted by its exact moments;
    the linear output's mean and variance stay exact, so sampling agrees."""
    model = Regression(positive_bias=True)
    guide = autoguide.AutoNormal(model, init_scale=0.05)
    _fit_regression(model, guide)
    with pytest.warns(UserWarning, match="out.bias.*LogNormal"):
        net = pyro2pfp.convert(model, guide)
    loc, scale = (t.detach().double().numpy() for t in guide._get_loc_and_scale("out.bias"))
    bias = net.layer_graph.layer("out").params["bias"]
    np.testing.assert_allclose(bias.mean, np.exp(loc + scale ** 2 / 2), rtol=1e-6)
    np.testing.assert_allclose(bias.var, (np.exp(scale ** 2) - 1) * np.exp(2 * loc + scale ** 2), rtol=1e-6)
    assert_exact_against_sampling(model, guide, net)


class LogisticRegression(PyroModule):
    """Bayesian multinomial logistic regression: a convex MAP, so its Laplace Hessian is positive."""

    def __init__(self):
        super().__init__()
        self.fc = PyroModule[nn.Linear](D_IN, CLASSES)
        self.fc.weight = prior([CLASSES, D_IN])
        self.fc.bias = prior([CLASSES])

    def forward(self, x, y=None):
        return likelihood(self.fc(x), y)


@pytest.mark.slow
def test_laplace_guide_points_to_its_gaussian():
    model = LogisticRegression()
    guide = autoguide.AutoLaplaceApproximation(model)
    fit(model, guide, steps=200, lr=0.05)
    with pytest.raises(pyro2pfp.PosteriorError, match="laplace_approximation"):
        pyro2pfp.convert(model, guide)
    x, y = data()
    laplace = guide.laplace_approximation(x, y)
    net = pyro2pfp.convert(model, laplace)  # the default carries the Laplace covariance as global factors
    assert net.plan.factors is not None and net.plan.factors.guide > 0, net.summary()
    with pytest.warns(UserWarning, match="correlations"):  # the marginals alone: said so
        pyro2pfp.convert(model, laplace, correlation="mean-field")
    # One linear layer: the logits' mean is exact and the marginal variances are the Laplace MVN's.
    flat_var = laplace.get_posterior().variance.detach().double().numpy()
    read = np.concatenate([net.layer_graph.layer("fc").params[p].var.ravel() for p in ("weight", "bias")])
    np.testing.assert_allclose(np.sort(read), np.sort(flat_var), rtol=1e-6)


@pytest.mark.slow
def test_model_returning_its_observation():
    """A regression model that returns the sampled ``obs``: the network is the mean that feeds it."""

    class ReturnsObs(Regression):
        def forward(self, x, y=None):
            sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
            mean = self.out(F.relu(self.fc1(x)))
            with pyro.plate("data", x.shape[0]):
                return pyro.sample("obs", dist.Normal(mean, sigma).to_event(1), obs=y)

    model = ReturnsObs()
    guide = autoguide.AutoNormal(model, init_scale=0.05)
    _fit_regression(model, guide)
    net = pyro2pfp.convert(model, guide)
    x, _ = regression_data(16)
    with torch.no_grad():
        samples = Predictive(model, guide=guide, num_samples=1000, return_sites=("obs",))(x)["obs"]
    mean, var = net.reference(x.numpy())
    mc_mean, mc_sd = samples.mean(0).double().numpy(), samples.std(0).double().numpy()
    assert np.all(np.abs(mean - mc_mean) < 5 * mc_sd / np.sqrt(1000))
    assert np.all(var < mc_sd ** 2)  # the obs noise (sigma) adds to PFP's epistemic variance


def test_noise_only_guide_is_an_error():
    """Every weight deterministic while the guide has latent sites: refused, not a deterministic net."""

    class DeterministicNet(PyroModule):
        def __init__(self):
            super().__init__()
            self.fc = PyroModule[nn.Linear](D_IN, 1)

        def forward(self, x, y=None):
            sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
            mean = self.fc(x)
            with pyro.plate("data", x.shape[0]):
                pyro.sample("obs", dist.Normal(mean, sigma).to_event(1), obs=y)
            return mean

    model = DeterministicNet()
    guide = autoguide.AutoNormal(model)
    _fit_regression(model, guide, steps=2)
    with pytest.raises(pyro2pfp.PosteriorError, match="none of them is a weight"):
        pyro2pfp.convert(model, guide)


def _predictive_obs(model, guide, x, num_samples=2000):
    with torch.no_grad():
        samples = Predictive(model, guide=guide, num_samples=num_samples, return_sites=("obs",))(x)["obs"]
    return samples.double().numpy()


@pytest.mark.slow
@pytest.mark.parametrize("noise", ["uniform", "halfnormal", "log_sigma", "pyro_param", "delta"])
def test_regression_predictive_variance(noise):
    """Predictive mean and variance of ``obs`` (law of total variance: PFP's epistemic variance plus
    E[sigma²]) agree with Pyro's Predictive within Monte Carlo error (one hidden layer: exact)."""
    from pyro.nn import PyroParam

    class NoisyRegression(Regression):
        def __init__(self):
            super().__init__()
            if noise == "pyro_param":
                self.sigma = PyroParam(torch.tensor(0.3), constraint=dist.constraints.positive)

        def forward(self, x, y=None):
            if noise == "uniform":
                sigma = pyro.sample("sigma", dist.Uniform(0.0, 10.0))
            elif noise == "halfnormal":
                sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
            elif noise == "log_sigma":
                sigma = pyro.sample("log_sigma", dist.Normal(-1.0, 1.0)).exp()
            elif noise == "pyro_param":
                sigma = self.sigma
            else:
                sigma = pyro.sample("sigma", dist.LogNormal(-1.0, 1.0))
            mean = self.out(F.relu(self.fc1(x)))
            with pyro.plate("data", x.shape[0]):
                pyro.sample("obs", dist.Normal(mean, sigma).to_event(1), obs=y)
            return mean

    model = NoisyRegression()
    if noise == "delta":
        guide = autoguide.AutoGuideList(model)
        guide.append(autoguide.AutoNormal(pyro.poutine.block(model, hide=["sigma"]), init_scale=0.05))
        guide.append(autoguide.AutoDelta(pyro.poutine.block(model, expose=["sigma"])))
    else:
        guide = autoguide.AutoNormal(model, init_scale=0.05)
    _fit_regression(model, guide, steps=80)
    net = pyro2pfp.convert(model, guide)
    assert net.noise.site == {"pyro_param": None, "log_sigma": "log_sigma"}.get(noise, "sigma"), net.noise
    x, _ = regression_data(16)
    out = net.regression(*net.reference(x.numpy()))
    obs = _predictive_obs(model, guide, x)
    n = obs.shape[0]
    mc_mean, mc_var = obs.mean(0), obs.var(0, ddof=1)
    assert np.all(np.abs(out["mean"] - mc_mean) < 5 * np.sqrt(mc_var / n))
    # var of a sample variance ≈ 2σ⁴/(n−1) for near-Gaussian obs; 5 standard errors, with slack for kurtosis
    assert np.all(np.abs(out["total"] - mc_var) < 6 * mc_var * np.sqrt(2 / (n - 1))), (out["total"], mc_var)
    assert np.all(out["aleatoric"] > 0) and np.allclose(out["total"], out["epistemic"] + out["aleatoric"])
    # The noise matters here: without it the variances would be off by far more than MC error.
    assert np.median(out["aleatoric"] / out["epistemic"]) > 0.5, np.median(out["aleatoric"] / out["epistemic"])


def test_classifier_has_no_regression_noise():
    model = TutorialMLP()
    guide = autoguide.AutoNormal(model)
    fit(model, guide, steps=2)
    net = pyro2pfp.convert(model, guide)
    with pytest.raises(pyro2pfp.PosteriorError, match="no regression noise model"):
        net.regression(*net.reference(data(4)[0].numpy()))


@pytest.mark.slow
def test_regression_tutorial_with_squeeze():
    """Pyro's Bayesian regression tutorial style: ``.squeeze(-1)`` on the output, a ``sigma`` site with a
    Uniform prior, an observation per row (no event dimension)."""

    class TutorialRegression(Regression):
        def forward(self, x, y=None):
            sigma = pyro.sample("sigma", dist.Uniform(0.0, 10.0))
            mean = self.out(F.relu(self.fc1(x))).squeeze(-1)
            with pyro.plate("data", x.shape[0]):
                pyro.sample("obs", dist.Normal(mean, sigma), obs=y)
            return mean

    model = TutorialRegression()
    guide = autoguide.AutoNormal(model, init_scale=0.05)
    x, y = regression_data()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.03}), Trace_ELBO())
    for _ in range(150):
        svi.step(x, y.squeeze(-1))
    net = pyro2pfp.convert(model, guide)
    xt, _ = regression_data(16)
    mean, var = net.compile()(xt.numpy())
    assert mean.shape == (16,)
    out = net.regression(*net.reference(xt.numpy()))
    np.testing.assert_allclose(mean, out["mean"], rtol=1e-4, atol=1e-5)
    obs = _predictive_obs(model, guide, xt)
    n = obs.shape[0]
    mc_mean, mc_var = obs.mean(0), obs.var(0, ddof=1)
    assert np.all(np.abs(out["mean"] - mc_mean) < 5 * np.sqrt(mc_var / n))
    assert np.all(np.abs(out["total"] - mc_var) < 6 * mc_var * np.sqrt(2 / (n - 1)))
