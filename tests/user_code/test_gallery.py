"""A gallery of BNNs in the styles of Pyro's tutorials and public BNN code, each converted and checked
against Pyro's ``Predictive`` (issue 16 item 6), and the heteroscedastic-head / TyXe-noise machinery
they use (:mod:`pyro2pfp.frontend.noise`, item 3).

Every gallery model (tests/support/gallery_models.py) is trained a few hundred SVI steps on seeded synthetic
data; the truth is ``MC_SAMPLES`` = 1000 draws of the trained guide (regression: ``obs``; classification:
the logits).  Two of them go through the whole lifecycle across processes (train + save the param
store in one process, build + load + convert in a fresh one).  Tolerances, per test input (and logit):

* exact models (one hidden layer, mean-field guide, deterministic input: PFP's output moments and the
  noise's ``E[σ²]`` are exact): ``|Δmean| ≤ 5`` MC standard errors and ``|Δvar| ≤ 5`` standard errors
  of the MC variance (from its 4th central moment) -- pure Monte Carlo error;
* approximate models -- two hidden layers (a ReLU of a non-Gaussian sum), or a heteroscedastic head
  whose ``E[σ(x)²]`` is integrated over PFP's *Gaussian* of the scale column (the column is a sum of
  products of Gaussians, not Gaussian): ``|Δmean| ≤ 5`` MC se, ``|Δvar| ≤ 6`` se and the median
  variance ratio within [0.85, 1.15];
* classification: the argmax agrees on ≥ 95 % of inputs.
"""
from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroSample
from scipy import integrate

import pyro2pfp
import pyro2pfp.compat
from pyro2pfp.frontend.noise import HeteroscedasticNoise, LinkStep, expected_square
from tests.support import gallery_models as G

WORKER = G.__file__  # also run as a script in fresh processes
CROSS_PROCESS = ("tutorial-regression", "random-module-classifier", "residual-cnn-layernorm")


@pytest.fixture(autouse=True)
def _one_thread():
    """Small nets: one torch thread is faster than two on a shared machine (and the workers use one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _check(entry: G.Entry, pfp: dict, mc: dict) -> None:
    a = G.agreement(entry, pfp, mc)
    assert a["max_mean_err_sd"] <= 5.0, a
    if entry.exact:
        assert a["max_var_err_se"] <= 5.0, a
    else:
        assert a["max_var_err_se"] <= 6.0 and 0.85 <= a["median_var_ratio"] <= 1.15, a
    if entry.task == "classification":
        assert a["argmax_agreement"] >= 0.95, a
        # the trained logits are far from 0 (an untrained or all-zero network would not pass)
        assert np.median(np.abs(mc["mc_mean"])) > 20 * np.median(mc["se_mean"])
    else:
        # the noise is a material part of the predictive variance: without it the check would fail
        epistemic_only = np.abs(pfp["epistemic"] - mc["mc_var"]) / mc["se_var"]
        assert epistemic_only.max() > 10.0, epistemic_only.max()


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in G.GALLERY if n not in CROSS_PROCESS])
def test_gallery_model_matches_predictive(name):
    entry = G.GALLERY[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TyXe / random_module deprecation warnings
        pfp, mc = G.run_in_process(entry)
    _check(entry, pfp, mc)


@pytest.mark.slow
@pytest.mark.parametrize("name", CROSS_PROCESS)
def test_gallery_model_in_a_fresh_process(name, tmp_path):
    """Train and save in one process, load and convert in another (the deployment lifecycle)."""
    for step in ("train", "convert"):
        result = subprocess.run([sys.executable, WORKER, step, name, str(tmp_path)], capture_output=True,
                                text=True, timeout=600)
        assert result.returncode == 0, f"worker {step} {name} failed:\n{result.stderr[-3000:]}"
    truth = dict(np.load(tmp_path / f"{name}-truth.npz"))
    pfp = dict(np.load(tmp_path / f"{name}-pfp.npz"))
    _check(G.GALLERY[name], pfp, truth)


def test_residual_layer_norm_cnn_gets_shared_factors_and_correlated_pools():
    """The residual CNN with a LayerNorm head (BatchNorm before each Bayesian conv, a max pool of the residual
    sum) converts as it stands to a shared-factor plan -- LayerNorm has its rule -- whose max pool folds the
    residual sum's in-window covariances, without a warning that anything falls back to mean-field."""
    entry = G.GALLERY["residual-cnn-layernorm"]
    built = entry.build()
    x, y = entry.data(8, 0)
    built.guide(x, y)
    built.model.eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net = built.convert()
    assert net.plan.factors is not None
    messages = [str(w.message) for w in caught]
    assert not any("mean-field" in m and "shared-factor rule" in m for m in messages), messages
    pool = next(layer for layer in net.layer_graph.layers if layer.op == "max_pool2d")
    covs = {layer.op for layer in net.layer_graph.layers if layer.name.startswith(f"{pool.name}_window_cov")}
    assert len(pool.inputs) == 2 and {"window_cov", "window_closure"} <= covs, covs


# ------------------------------------------------------------------------------- heteroscedastic heads
def _linear(i: int, o: int) -> PyroModule:
    layer = PyroModule[nn.Linear](i, o)
    layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand([o, i]).to_event(2))
    layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand([o]).to_event(1))
    return layer


class LinearHead(PyroModule):
    """No hidden layer: the scale column is exactly Gaussian under the guide, so E[σ(x)²] is exact."""

    def __init__(self, link: str) -> None:
        super().__init__()
        self.link = link
        self.fc = _linear(G.D_IN, 2)

    def forward(self, x, y=None):
        out = self.fc(x)
        mu, raw = out.chunk(2, dim=-1)
        sigma = 2.0 * (0.5 * raw - 0.2).exp() if self.link == "exp" else F.softplus(raw) + 0.01
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mu.squeeze(-1), sigma.squeeze(-1)), obs=y)
        return mu.squeeze(-1)


@pytest.mark.slow
@pytest.mark.parametrize("link", ["exp", "softplus"])
def test_aleatoric_of_a_gaussian_scale_column_is_exact(link):
    """E[σ(x)²] against Monte Carlo over the guide's weights (σ computed by the model's own code):
    within 5 MC standard errors; dropping the column's variance (σ at the mean column) fails."""
    model = LinearHead(link)
    guide = AutoNormal(model, init_scale=0.3)  # untrained, wide posterior: the variance term matters
    x, y = G.regression_data(32, 3)
    guide(x, y)
    net = pyro2pfp.convert(model, guide)
    assert isinstance(net.noise, HeteroscedasticNoise) and net.noise.output_shape == (2,)
    assert net.noise.mean_index.reshape(-1).tolist() == [0] and net.noise.scale_index.reshape(-1).tolist() == [1]
    out = net.regression(*net.reference(x.numpy()))
    n = 2000
    sq = np.empty((n, len(x)))
    with torch.no_grad():
        for i in range(n):
            trace = pyro.poutine.trace(pyro.poutine.replay(model, trace=pyro.poutine.trace(guide).get_trace(x))
                                       ).get_trace(x)
            sq[i] = (trace.nodes["obs"]["fn"].scale.double() ** 2).numpy()
    mc, se = sq.mean(0), sq.std(0, ddof=1) / np.sqrt(n)
    assert np.all(np.abs(out["aleatoric"] - mc) <= 5 * se), np.abs(out["aleatoric"] - mc) / se
    mean, _ = net.reference(x.numpy())
    at_mean = expected_square(net.noise.link, mean[:, 1], np.zeros(len(x)))
    assert np.max(np.abs(at_mean - mc) / se) > 10


@pytest.mark.parametrize("steps,exact", [
    ((LinkStep("aten.exp.default"),), True),
    ((LinkStep("aten.mul.Tensor", (2.0,)), LinkStep("aten.add.Tensor", (-1.0,)), LinkStep("aten.exp.default"),
      LinkStep("aten.mul.Tensor", (0.5,)), LinkStep("aten.add.Tensor", (0.1,))), True),
    ((LinkStep("aten.add.Tensor", (0.3,)),), True),
    ((LinkStep("aten.softplus.default"),), False),
    ((LinkStep("aten.softplus.default", (2.0, 20.0)), LinkStep("aten.add.Tensor", (1e-3,))), False),
    ((LinkStep("aten.sigmoid.default"), LinkStep("aten.mul.Tensor", (3.0,))), False),
    ((LinkStep("aten.abs.default"), LinkStep("aten.clamp_min.default", (0.2,))), False),
])
@pytest.mark.parametrize("mu,var", [(-1.3, 0.7), (0.4, 2.5), (2.0, 0.01)])
def test_expected_square_against_adaptive_quadrature(steps, exact, mu, var):
    def g2(h):
        for s in steps:
            h = s(np.asarray(h))
        return float(h) ** 2

    def integrand(h):
        return g2(h) * np.exp(-0.5 * (h - mu) ** 2 / var) / np.sqrt(2 * np.pi * var)

    sd = np.sqrt(var)
    truth, _ = integrate.quad(integrand, mu - 12 * sd, mu + 12 * sd, limit=400, epsabs=1e-13, epsrel=1e-12)
    got = float(expected_square(steps, np.array(mu), np.array(var)))
    # closed forms: to the adaptive rule's own accuracy (~1e-8 on exp of a wide Gaussian); 64-node
    # Gauss-Hermite to 1e-6 relative (kinks of abs/clamp: 1e-3)
    tol = 1e-7 if exact else (1e-3 if any(s.op in ("aten.abs.default", "aten.clamp_min.default") for s in steps)
                               else 1e-6)
    assert abs(got - truth) <= tol * truth, (got, truth)


def test_expected_square_limits():
    """Zero variance gives g(μ)² (bit-exact for exp); huge means stay finite for softplus/sigmoid."""
    mu = np.array([-50.0, -3.0, 0.0, 2.5, 40.0])
    assert np.array_equal(expected_square((LinkStep("aten.exp.default"),), mu, np.zeros(5)), np.exp(2 * mu))
    sp = (LinkStep("aten.softplus.default"),)
    assert np.allclose(expected_square(sp, mu, np.zeros(5)), np.logaddexp(0, mu) ** 2, rtol=1e-14)
    huge = np.array([1e6, -1e6, 3e30])
    for steps in (sp, (LinkStep("aten.sigmoid.default"),)):
        out = expected_square(steps, huge, np.array([1.0, 1.0, 1e10]))
        assert np.all(np.isfinite(out)), out
    assert np.allclose(expected_square(sp, huge[:1], np.array([4.0])), 1e12 + 4.0, rtol=1e-12)
    assert expected_square(sp, huge[1:2], np.array([4.0]))[0] < 1e-300  # softplus(-1e6)² underflows to 0


class TwoHeads(PyroModule):
    def __init__(self):
        super().__init__()
        self.fc1, self.mean, self.scale = _linear(G.D_IN, 8), _linear(8, 1), _linear(8, 1)

    def forward(self, x, y=None):
        h = F.relu(self.fc1(x))
        mu, sigma = self.mean(h).squeeze(-1), F.softplus(self.scale(h)).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mu, sigma), obs=y)
        return mu


class ProductHead(PyroModule):
    def __init__(self):
        super().__init__()
        self.fc = _linear(G.D_IN, 3)

    def forward(self, x, y=None):
        out = self.fc(x)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(out[:, 0], out[:, 1].exp() * out[:, 2].exp()), obs=y)
        return out[:, 0]


@pytest.mark.parametrize("cls,match", [
    (TwoHeads, r"heteroscedastic head.*loc comes from 'mean' \(linear\) and its scale from 'scale' \(linear\)"),
    (ProductHead, r"heteroscedastic head.*cannot be read"),
])
def test_unreadable_head_is_a_clear_error(cls, match):
    model = cls()
    guide = AutoNormal(model)
    x, y = G.regression_data(8, 0)
    guide(x, y)
    with pytest.raises(pyro2pfp.UnsupportedLayerError, match=match):
        pyro2pfp.convert(model, guide)


class MultiOutput(PyroModule):
    """Multi-output heteroscedastic regression: ``Normal(out[:, :2], 0.05 + 2·softplus(out[:, 2:])).to_event(1)``."""

    def __init__(self):
        super().__init__()
        self.fc1, self.out = _linear(G.D_IN, 12), _linear(12, 4)

    def forward(self, x, y=None):
        out = self.out(F.relu(self.fc1(x)))
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("obs", dist.Normal(out[:, :2], 0.05 + 2 * F.softplus(out[:, 2:])).to_event(1), obs=y)


@pytest.mark.slow
def test_multi_output_heteroscedastic_regression():
    model = MultiOutput()
    guide = AutoNormal(model, init_scale=0.05)
    x, y1 = G.regression_data(64, 0)
    y = torch.stack([y1, -y1], -1)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.02}), Trace_ELBO())
    for _ in range(150):
        svi.step(x, y)
    net = pyro2pfp.convert(model, guide)
    assert net.noise.mean_index.tolist() == [0, 1] and net.noise.scale_index.tolist() == [2, 3]
    xt = G.regression_data(16, 5)[0]
    out = net.regression(*net.reference(xt.numpy()))
    assert out["total"].shape == (16, 2)
    samples = pyro.infer.Predictive(model, guide=guide, num_samples=1000, return_sites=("obs",))(xt)["obs"]
    mc = G.moments(samples.double().numpy())
    assert np.all(np.abs(out["mean"] - mc["mc_mean"]) <= 5 * mc["se_mean"])  # one hidden layer: exact mean
    assert np.all(np.abs(out["total"] - mc["mc_var"]) <= 6 * mc["se_var"])  # Gaussian scale column: approximate
    compiled = net.regression(*net.compile()(xt.numpy()))  # the compiled module ends at the same output
    for key, value in out.items():
        np.testing.assert_allclose(compiled[key], value, rtol=1e-4, atol=1e-6 * np.abs(value).max(), err_msg=key)


@pytest.mark.slow
def test_tyxe_heteroskedastic_likelihood():
    """TyXe's HeteroskedasticGaussian: means then softplus scales along the last axis."""
    import tyxe

    pyro2pfp.compat.patch_pyro_for_tyxe()
    body = nn.Sequential(nn.Linear(G.D_IN, 8), nn.ReLU(), nn.Linear(8, 2))
    bnn = tyxe.VariationalBNN(body, tyxe.priors.IIDPrior(dist.Normal(0.0, 1.0)),
                              tyxe.likelihoods.HeteroskedasticGaussian(64),
                              lambda m: tyxe.guides.AutoNormal(m, init_scale=0.01))
    x, y = G.regression_data(64, 0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y[:, None]), batch_size=64)
    bnn.fit(loader, pyro.optim.Adam({"lr": 0.02}), 150)
    net = pyro2pfp.convert(bnn)
    assert isinstance(net.noise, HeteroscedasticNoise)
    assert net.noise.link == (LinkStep("aten.softplus.default", (1.0, 20.0)),)
    xt = G.regression_data(16, 5)[0]
    out = net.regression(*net.reference(xt.numpy()))
    samples = pyro.infer.Predictive(bnn.model, guide=bnn.guide, num_samples=1000,
                                    return_sites=("likelihood.data",))(xt)["likelihood.data"]
    mc = G.moments(samples.double().numpy().reshape(1000, 16))
    assert np.all(np.abs(out["mean"].reshape(16) - mc["mc_mean"]) <= 5 * mc["se_mean"])
    assert np.all(np.abs(out["total"].reshape(16) - mc["mc_var"]) <= 6 * mc["se_var"])


def test_tyxe_gaussian_regression_keeps_its_final_sigmoid():
    """A TyXe regression whose net ends in a Sigmoid (a mean in (0, 1)) under HomoskedasticGaussian: the
    sigmoid is the mean's activation, not Bernoulli probabilities -- it is kept, not stripped."""
    import warnings

    import tyxe

    pyro2pfp.compat.patch_pyro_for_tyxe()
    body = nn.Sequential(nn.Linear(G.D_IN, 8), nn.Tanh(), nn.Linear(8, 1), nn.Sigmoid())
    bnn = tyxe.VariationalBNN(body, tyxe.priors.IIDPrior(dist.Normal(0.0, 1.0)),
                              tyxe.likelihoods.HomoskedasticGaussian(64, scale=0.1),
                              lambda m: tyxe.guides.AutoNormal(m, init_scale=0.01))
    x, y = G.regression_data(64, 0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.sigmoid(y)[:, None]), batch_size=64)
    bnn.fit(loader, pyro.optim.Adam({"lr": 0.02}), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "final sigmoid is stripped" warning
        net = pyro2pfp.convert(bnn)
    assert [p.op for p in net.plan.layers] == ["dense", "tanh", "dense", "sigmoid"]
    mean, _ = net.reference(x[:4].numpy())
    assert np.all((mean > 0) & (mean < 1))


def test_cnn_auto_chooses_shared_factors():
    """The SiLU CNN averages positions of a conv output: ``correlation='auto'`` gives shared factors,
    with no warning (SiLU's generic Stein rule is in every back end, ``correlation/stein.py``) -- the
    plan the gallery entry asks for explicitly (``'shared-factor'``, see gallery_models)."""
    entry = G.GALLERY["cnn-silu-batchnorm"]
    built = entry.build()
    x, y = entry.data(8, 0)
    built.guide(x, y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net = pyro2pfp.convert(built.model, built.guide, input_shape=built.input_shape)
    assert not [w for w in caught if "correlation" in str(w.message)], [str(w.message) for w in caught]
    assert net.plan.correlation == "shared-factor"
    assert "silu" in {layer.op for layer in net.plan.layers}


def test_homoscedastic_model_with_a_column_index_converts():
    """``self.out(h)[..., 0]`` on a single output is a reshape (ops/shape.py), not an unsupported select."""
    model = G.ListRegression(sizes=(G.D_IN, 8, 1))
    guide = AutoNormal(model)
    x, y = G.regression_data(8, 0)
    guide(x, y)
    net = pyro2pfp.convert(model, guide)
    assert net.noise.site == "log_sigma"
    assert net.reference(x.numpy())[0].shape == (8,)
