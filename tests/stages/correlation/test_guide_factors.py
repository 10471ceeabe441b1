"""A correlated guide's covariance between weights, read as global factors and carried by shared-factor PFP
(``pyro2pfp/frontend/posterior/correlated.py``, ``pyro2pfp/correlation/guide.py``).

Truths: the guide's own covariance (``guide.get_posterior()``), and, for a single dense layer with a
deterministic input, the exact output covariance ``x̃ᵀ Σ x̃`` (the logits are linear in the weights)."""
from __future__ import annotations

import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn as nn
from pyro.infer.autoguide import AutoDiagonalNormal, AutoLowRankMultivariateNormal, AutoMultivariateNormal
from pyro.nn import PyroModule, PyroSample

import pyro2pfp
from pyro2pfp.frontend.posterior import correlated
from pyro2pfp.frontend.posterior.correlated import kept_share, top_directions


class OneLayer(PyroModule):
    """A Bayesian linear classifier as tutorials write it."""

    def __init__(self, d_in: int = 5, d_out: int = 3) -> None:
        super().__init__()
        self.fc = PyroModule[nn.Linear](d_in, d_out)
        self.fc.weight = PyroSample(dist.Normal(0.0, 1.0).expand([d_out, d_in]).to_event(2))
        self.fc.bias = PyroSample(dist.Normal(0.0, 1.0).expand([d_out]).to_event(1))

    def forward(self, x, y=None):
        logits = self.fc(x)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


def _trained_like(guide_cls, seed: int = 0, **kwargs):
    """A model and guide whose parameters are set to random values (as after training)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    model = OneLayer()
    guide = guide_cls(model, **kwargs)
    x = torch.randn(4, 5)
    guide(x, torch.zeros(4, dtype=torch.long))
    with torch.no_grad():
        for _, value in pyro.get_param_store().items():
            value.unconstrained().copy_(0.5 * torch.randn_like(value.unconstrained()))
        if hasattr(guide, "cov_factor"):
            guide.cov_factor.copy_(torch.randn_like(guide.cov_factor))
        if hasattr(guide, "loc"):
            guide.loc.copy_(torch.randn_like(guide.loc))
    return model, guide


def _exact_logit_moments(guide, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and variance of ``W x + b`` under the guide's joint Gaussian (latent order: fc.weight, fc.bias)."""
    post = guide.get_posterior()
    loc = post.loc.detach().double().numpy()
    cov = post.covariance_matrix.detach().double().numpy()
    order = [site["name"] for site, _ in guide._unpack_latent(post.loc)]
    assert order == ["fc.weight", "fc.bias"], order
    d_out, d_in = 3, 5
    means, variances = [], []
    for xi in x:
        # logit o = Σ_i W[o, i] x_i + b_o: a linear map A (d_out × D) of the flat latent
        a = np.zeros((d_out, loc.size))
        for o in range(d_out):
            a[o, o * d_in:(o + 1) * d_in] = xi
            a[o, d_out * d_in + o] = 1.0
        means.append(a @ loc)
        variances.append(np.einsum("od,de,oe->o", a, cov, a))
    return np.array(means), np.array(variances)


@pytest.mark.parametrize("guide_cls, kwargs", [(AutoLowRankMultivariateNormal, {"rank": 2}),
                                                (AutoMultivariateNormal, {})])
def test_a_dense_layer_under_a_correlated_guide_is_exact(guide_cls, kwargs):
    model, guide = _trained_like(guide_cls, **kwargs)
    x = np.random.default_rng(1).standard_normal((6, 5))
    net = pyro2pfp.convert(model, guide, input_shape=(5,), correlation="shared-factor")
    assert net.plan.factors is not None and net.plan.factors.guide > 0
    mean, var = net.reference(x)
    exact_mean, exact_var = _exact_logit_moments(guide, x)
    np.testing.assert_allclose(mean, exact_mean, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(var, exact_var, rtol=1e-5)  # the truth from the guide's float32 covariance
    with pytest.warns(UserWarning, match="correlations between weights are dropped"):
        mf_mean, mf_var = pyro2pfp.convert(model, guide, input_shape=(5,), correlation="mean-field").reference(x)
    assert np.max(np.abs(mf_var / exact_var - 1)) > 0.05  # the check above can fail: marginals alone differ
    np.testing.assert_allclose(mf_mean, exact_mean, rtol=1e-9, atol=1e-9)


class TwoLinear(PyroModule):
    """Two Bayesian linear layers without an activation between them: the logits are a quadratic form of the
    Gaussian latent, whose mean and variance are known exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = OneLayer(5, 4).fc, OneLayer(4, 3).fc

    def forward(self, x, y=None):
        logits = self.fc2(self.fc1(x))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


def _exact_quadratic_moments(guide, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``a = W2 (W1 x + b1) + b2 = θᵀQθ + cᵀθ`` over the latent ``θ ~ N(m, Σ)``: mean ``tr(QΣ) + mᵀQm + cᵀm``,
    variance ``2 tr((QΣ)²) + (2Qm + c)ᵀ Σ (2Qm + c)`` (Q symmetric)."""
    post = guide.get_posterior()
    m = post.loc.detach().double().numpy()
    cov = post.covariance_matrix.detach().double().numpy()
    index = {site["name"]: v.long().numpy() for site, v in
             guide._unpack_latent(torch.arange(m.size, dtype=torch.float64))}
    w1, b1, w2, b2 = (index[n] for n in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"))
    means, variances = [], []
    for xi in x:
        mean_row, var_row = [], []
        for o in range(3):
            q, c = np.zeros((m.size, m.size)), np.zeros(m.size)
            for j in range(4):
                for i in range(5):
                    q[w2[o, j], w1[j, i]] += xi[i] / 2
                q[w2[o, j], b1[j]] += 0.5
            q, c[b2[o]] = q + q.T, 1.0
            lin = 2 * q @ m + c
            mean_row.append(np.trace(q @ cov) + m @ q @ m + c @ m)
            var_row.append(2 * np.trace(q @ cov @ q @ cov) + lin @ cov @ lin)
        means.append(mean_row)
        variances.append(var_row)
    return np.array(means), np.array(variances)


def test_the_product_of_two_layers_guide_noise_is_exact():
    """Dense → dense under a low-rank guide: the second layer multiplies its weights' guide noise by its input's
    (the same factors), a product whose mean and variance the rule adds -- exact here, in every back end."""
    from tests.support.backends import ONNX_RTOL, RTOL, assert_matches, onnx_run

    pyro.clear_param_store()
    pyro.set_rng_seed(3)
    model = TwoLinear()
    guide = AutoLowRankMultivariateNormal(model, rank=2)
    guide(torch.randn(4, 5), torch.zeros(4, dtype=torch.long))
    with torch.no_grad():
        guide.loc.copy_(torch.randn_like(guide.loc))
        guide.cov_factor.copy_(0.7 * torch.randn_like(guide.cov_factor))
    net = pyro2pfp.convert(model, guide, input_shape=(5,))
    assert net.plan.factors is not None and net.plan.factors.guide == 2
    x = np.random.default_rng(1).standard_normal((6, 5)).astype(np.float32)
    mean, var = net.reference(x)
    exact_mean, exact_var = _exact_quadratic_moments(guide, x.astype(np.float64))
    np.testing.assert_allclose(mean, exact_mean, rtol=1e-5, atol=1e-6 * np.abs(exact_mean).max())
    np.testing.assert_allclose(var, exact_var, rtol=1e-5)  # the truth from the guide's float32 covariance
    assert_matches(onnx_run(net, x), (mean, var), ONNX_RTOL)
    assert_matches(tuple(np.asarray(a) for a in net.compile()(x)), (mean, var), RTOL)


def test_lowrank_loadings_are_the_guides_factor_and_the_summary_says_so():
    model, guide = _trained_like(AutoLowRankMultivariateNormal, rank=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "correlations are dropped" warning when they are carried
        net = pyro2pfp.convert(model, guide, input_shape=(5,), correlation="shared-factor")
    post = guide.get_posterior()
    factor = post.cov_factor.detach().double().numpy()
    w = next(layer for layer in net.plan.layers if layer.op == "dense").tensors["weight_factors"]
    loadings = w.reshape(-1, w.shape[-1])
    # the same column space and the same F·Fᵀ on the weight block
    np.testing.assert_allclose(loadings @ loadings.T, factor[:15] @ factor[:15].T, rtol=1e-5, atol=1e-7)  # float32
    assert "2 global factors" in net.summary()


def test_diagonal_guides_have_no_guide_factors():
    model, guide = _trained_like(AutoDiagonalNormal)
    net = pyro2pfp.convert(model, guide, input_shape=(5,))
    assert net.plan.factors is None and net.plan.guide_factors is None


def test_truncated_split_keeps_marginals_and_states_the_share(monkeypatch):
    monkeypatch.setattr(correlated, "MAX_GUIDE_FACTORS", 4)
    model, guide = _trained_like(AutoMultivariateNormal)
    net = pyro2pfp.convert(model, guide, input_shape=(5,), correlation="shared-factor")
    info = net.plan.guide_factors
    assert info is not None and info.k == 4 and info.rank == 18 and 0 < info.kept < 1
    assert "the 4 of 18 directions that carry the most of the logits' variance" in net.summary()
    assert info.at_logits and "of the logit variance" in net.summary()
    cov = guide.get_posterior().covariance_matrix.detach().double().numpy()
    dense = next(layer for layer in net.plan.layers if layer.op == "dense")
    f = dense.tensors["weight_factors"].reshape(-1, 4)
    # every marginal variance stays exact: the dropped part goes to the independent diagonal
    np.testing.assert_allclose(dense.tensors["weight_var"].ravel(), np.diag(cov)[:15], rtol=1e-5)  # float32 truth
    assert np.all((f**2).sum(1) <= np.diag(cov)[:15] * (1 + 1e-9))


def test_randomized_directions_match_the_exact_ones(monkeypatch):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((300, 40)) * np.geomspace(10, 0.01, 40)
    exact, s2 = top_directions(a, 5)
    monkeypatch.setattr(correlated, "EXACT_SVD_LIMIT", 10)
    approx, _ = top_directions(a, 5)
    np.testing.assert_allclose(approx @ approx.T, exact @ exact.T, rtol=1e-6, atol=1e-8 * s2[0])
    assert kept_share(a, a) == pytest.approx(1.0)
    assert 0 < kept_share(a, exact) < 1


def test_auto_carries_the_guides_factors_in_every_back_end(monkeypatch):
    """``auto`` keeps a correlated guide's factors (no warning), the plan printout says how many, and the
    compiled and ONNX networks agree with the float64 reference, itself exact for one dense layer."""
    from tests.support.backends import ONNX_RTOL, RTOL, assert_matches, onnx_run

    model, guide = _trained_like(AutoLowRankMultivariateNormal, rank=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        net = pyro2pfp.convert(model, guide, input_shape=(5,))
    assert net.plan.factors is not None and net.plan.factors.guide == 2
    assert "2 global factors" in net.summary() and "not carried" not in net.summary()
    x = np.random.default_rng(1).standard_normal((6, 5)).astype(np.float32)
    ref = net.reference(x)
    np.testing.assert_allclose(ref[1], _exact_logit_moments(guide, x)[1], rtol=1e-5)
    assert_matches(onnx_run(net, x), ref, ONNX_RTOL)
    assert_matches(tuple(np.asarray(a) for a in net.compile()(x)), ref, RTOL)
    from pyro2pfp.correlation.onnx_step import OnnxSharedStep

    monkeypatch.setattr(OnnxSharedStep, "guide_ops", frozenset())  # a back end without the guide's terms
    with pytest.raises(pyro2pfp.PFPError, match="does not carry a correlated guide's global factors"):
        net.to_onnx()


class TwoConv(PyroModule):
    """conv(1→3, 1×1, no bias) → conv(3→2, 3×3, padding 1) without an activation between them, the output
    flattened: a quadratic form of the Gaussian latent, like :class:`TwoLinear`."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = PyroModule[nn.Conv2d](1, 3, 1, bias=False)
        self.conv1.weight = PyroSample(dist.Normal(0.0, 1.0).expand([3, 1, 1, 1]).to_event(4))
        self.conv2 = PyroModule[nn.Conv2d](3, 2, 3, padding=1)
        self.conv2.weight = PyroSample(dist.Normal(0.0, 1.0).expand([2, 3, 3, 3]).to_event(4))
        self.conv2.bias = PyroSample(dist.Normal(0.0, 1.0).expand([2]).to_event(1))

    def forward(self, x, y=None):
        logits = torch.flatten(self.conv2(self.conv1(x)), 1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


def _exact_quadratic_form_moments(guide, fn, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Mean and variance of every output of ``fn(sites, x)``, a quadratic function ``f(θ) = ½θᵀHθ + gᵀθ + f₀`` of
    the guide's latent ``θ ~ N(m, Σ)`` (``H``, ``g``, ``f₀`` by autograd, float64): mean ``½tr(HΣ) + f(m)``,
    variance ``½tr((HΣ)²) + (Hm + g)ᵀΣ(Hm + g)`` (Isserlis' theorem)."""
    post = guide.get_posterior()
    m = post.loc.detach().double()
    cov = post.covariance_matrix.detach().double()

    def f(theta: torch.Tensor) -> torch.Tensor:
        sites = {site["name"]: v for site, v in guide._unpack_latent(theta)}
        return fn(sites, x.double()).reshape(-1)

    zero = torch.zeros_like(m)
    g = torch.func.jacrev(f)(zero)  # (outputs, D)
    hessians = torch.func.jacfwd(torch.func.jacrev(f))(zero)  # (outputs, D, D)
    at_m = f(m)
    lin = hessians @ m + g
    mean = 0.5 * torch.einsum("nde,ed->n", hessians, cov) + at_m
    hs = hessians @ cov
    var = 0.5 * torch.einsum("nde,ned->n", hs, hs) + torch.einsum("nd,de,ne->n", lin, cov, lin)
    shape = (x.shape[0], -1)
    return mean.reshape(shape).numpy(), var.reshape(shape).numpy()


def _two_convs_and(guide_cls, seed: int, **kwargs) -> tuple[TwoConv, object, torch.Tensor]:
    """:class:`TwoConv`, its ``guide_cls`` guide (initialised) and four inputs."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    model = TwoConv()
    guide = guide_cls(model, **kwargs)
    x = torch.randn(4, 1, 5, 5)
    guide(x, torch.zeros(4, dtype=torch.long))
    return model, guide, x


def test_the_product_of_two_convs_guide_noise_is_exact():
    """Conv → conv under a low-rank guide (its independent part negligible): the second conv's weights' guide
    noise meets its input's through the same factors at every position, inside every receptive field.  The rule
    re-sums those terms (the linear ones with their correlations, the product's variance by Isserlis' theorem)
    and the mean shift: exact here, in every back end; the same net under the guide's marginals is not."""
    from tests.support.backends import ONNX_RTOL, RTOL, assert_matches, onnx_run

    model, guide, x = _two_convs_and(AutoLowRankMultivariateNormal, 5, rank=3)
    with torch.no_grad():
        guide.loc.copy_(torch.randn_like(guide.loc))
        # the posterior's factor is cov_factor·scale, its diagonal scale²: the independent part ~0 (conv1's outputs
        # load on the factors alone, as the closure carries them)
        guide.cov_factor.copy_(600.0 * torch.randn_like(guide.cov_factor))
        for name, value in pyro.get_param_store().items():
            if name.endswith("scale"):
                value.unconstrained().copy_(torch.full_like(value.unconstrained(), float(np.log(1e-3))))
    net = pyro2pfp.convert(model, guide, input_shape=(1, 5, 5))
    assert net.plan.factors is not None and net.plan.factors.guide == 3

    def two_convs(sites: dict, xs: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        hidden = F.conv2d(xs, sites["conv1.weight"])
        return F.conv2d(hidden, sites["conv2.weight"], sites["conv2.bias"], padding=1)

    exact_mean, exact_var = _exact_quadratic_form_moments(guide, two_convs, x)
    mean, var = net.reference(x.numpy())
    np.testing.assert_allclose(mean, exact_mean, rtol=1e-5, atol=1e-6 * np.abs(exact_mean).max())
    np.testing.assert_allclose(var, exact_var, rtol=1e-4)  # the truth from the guide's float32 parameters
    assert_matches(onnx_run(net, x.numpy()), (mean, var), ONNX_RTOL)
    assert_matches(tuple(np.asarray(a) for a in net.compile()(x.numpy())), (mean, var), RTOL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mf_var = pyro2pfp.convert(model, guide, input_shape=(1, 5, 5), correlation="mean-field").reference(
            x.numpy())[1]
    assert np.max(np.abs(mf_var / exact_var - 1)) > 0.05  # the check above can fail: marginals alone differ


def test_a_mean_field_guides_conv_variances_are_the_mean_field_plans():
    """The receptive-field terms are the guide's: under ``AutoNormal`` (no guide factors) every conv's per-position
    variance in the shared-factor plan is the mean-field plan's, bit for bit."""
    from pyro.infer.autoguide import AutoNormal

    from pyro2pfp.backends.reference import execute_all
    from pyro2pfp.correlation.execute import execute_shared_all

    model, guide, x = _two_convs_and(AutoNormal, 2, init_scale=0.3)
    shared = pyro2pfp.convert(model, guide, input_shape=(1, 5, 5), correlation="shared-factor")
    plain = pyro2pfp.convert(model, guide, input_shape=(1, 5, 5), correlation="mean-field")
    assert shared.plan.factors is not None and shared.plan.factors.guide == 0
    got, want = execute_shared_all(shared.plan, x.numpy()), execute_all(plain.plan, x.numpy())
    for name in ("conv1", "conv2"):
        np.testing.assert_array_equal(got[name].variance(), want[name].variance())


class TwoLayerTanh(PyroModule):
    """A Bayesian Tanh MLP 5-4-3 as tutorials write it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = PyroModule[nn.Linear](5, 4)
        self.fc1.weight = PyroSample(dist.Normal(0.0, 1.0).expand([4, 5]).to_event(2))
        self.fc1.bias = PyroSample(dist.Normal(0.0, 1.0).expand([4]).to_event(1))
        self.fc2 = PyroModule[nn.Linear](4, 3)
        self.fc2.weight = PyroSample(dist.Normal(0.0, 1.0).expand([3, 4]).to_event(2))
        self.fc2.bias = PyroSample(dist.Normal(0.0, 1.0).expand([3]).to_event(1))

    def forward(self, x, y=None):
        logits = self.fc2(torch.tanh(self.fc1(x)))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


def _saturated_guide():
    """A full-covariance guide whose largest directions load on a hidden unit saturated by its bias mean
    (tanh' ≈ 0: the network ignores them) and whose smaller one moves ``fc2``'s weights together."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = TwoLayerTanh()
    guide = AutoMultivariateNormal(model)
    guide(torch.randn(4, 5), torch.zeros(4, dtype=torch.long))
    slices, offset = {}, 0
    for site, value in guide._unpack_latent(guide.loc.detach()):
        slices[site["name"]] = slice(offset, offset + value.numel())
        offset += value.numel()
    loc = 0.3 * torch.randn(offset, dtype=torch.float64)
    loc[slices["fc1.bias"].start] = 20.0  # hidden unit 0: tanh saturated
    cov = 1e-4 * torch.eye(offset, dtype=torch.float64)
    ignored = torch.zeros(offset, 2, dtype=torch.float64)
    ignored[slices["fc1.weight"].start:slices["fc1.weight"].start + 5, 0] = 1.0  # fc1.weight[0, :]
    ignored[slices["fc1.weight"].start:slices["fc1.weight"].start + 5, 1] = torch.tensor([1.0, -1, 1, -1, 1])
    cov += 0.4 * ignored @ ignored.T  # eigenvalues 2.0: the largest
    coherent = torch.zeros(offset, dtype=torch.float64)
    coherent[slices["fc2.weight"]] = 0.3  # eigenvalue 12 · 0.09 = 1.08
    cov += torch.outer(coherent, coherent)
    chol = torch.linalg.cholesky(cov)
    scale = torch.diagonal(chol)
    with torch.no_grad():  # Σ = (scale·L)(scale·L)ᵀ, L unit lower triangular: set through the unconstrained values
        guide.loc.copy_(loc)
        for name, value in (("scale", scale), ("scale_tril", chol / scale[:, None])):
            constraint = guide._pyro_params[name][0]
            getattr(guide, f"{name}_unconstrained").copy_(torch.distributions.transform_to(constraint).inv(value))
    return model, guide


def _sampled_logit_variance(guide, x: np.ndarray, samples: int = 40000) -> np.ndarray:
    """The logits' variance by sampling the guide's joint Gaussian (the truth)."""
    post = guide.get_posterior()
    z = post.sample((samples,)).double()
    parts, offset = {}, 0
    for site, value in guide._unpack_latent(guide.loc.detach()):
        parts[site["name"]] = z[:, offset:offset + value.numel()].reshape(samples, *value.shape)
        offset += value.numel()
    xt = torch.as_tensor(x, dtype=torch.float64)
    h = torch.tanh(torch.einsum("soi,bi->sbo", parts["fc1.weight"], xt) + parts["fc1.bias"][:, None])
    logits = torch.einsum("soi,sbi->sbo", parts["fc2.weight"], h) + parts["fc2.bias"][:, None]
    return logits.var(0).numpy()


def test_the_kept_direction_is_the_one_the_logits_feel_and_the_share_says_so(monkeypatch):
    """The covariance's largest directions load on a saturated hidden unit that the logits ignore: keeping one
    direction by the logits' variance keeps ``fc2``'s coherent one, whose network matches sampling, and the plan
    states the share of the logit variance kept; the covariance's own order keeps an ignored direction."""
    monkeypatch.setattr(correlated, "MAX_GUIDE_FACTORS", 1)
    model, guide = _saturated_guide()
    x = np.random.default_rng(1).standard_normal((16, 5))
    truth = _sampled_logit_variance(guide, x)
    net = pyro2pfp.convert(model, guide, input_shape=(5,), correlation="shared-factor", check=False)
    info = net.plan.guide_factors
    assert info is not None and info.k == 1 and info.at_logits and info.kept > 0.9
    assert "of the logit variance" in net.summary()
    fc1, fc2 = (layer for layer in net.plan.layers if layer.op == "dense")
    assert np.abs(fc2.tensors["weight_factors"]).max() > 0.2  # the coherent direction, not the ignored one
    assert np.abs(fc1.tensors["weight_factors"][0]).max() < 0.05
    ratio = net.reference(x.astype(np.float32))[1] / truth
    assert 0.9 < np.median(ratio) < 1.1, np.median(ratio)

    monkeypatch.setattr(correlated, "CANDIDATE_FACTORS", 0)  # no candidates: the covariance's top direction
    eig = pyro2pfp.convert(model, guide, input_shape=(5,), correlation="shared-factor", check=False)
    e_info = eig.plan.guide_factors
    assert e_info is not None and not e_info.at_logits and e_info.kept > 0.5  # the covariance share: looks fine
    e_fc1 = next(layer for layer in eig.plan.layers if layer.op == "dense")
    assert np.abs(e_fc1.tensors["weight_factors"][0]).max() > 0.5  # ... but it kept the ignored direction
    e_ratio = eig.reference(x.astype(np.float32))[1] / truth
    # and the logits' variance is wrong: fc2's coherent direction counted as independent noise per weight
    assert not 0.8 < np.median(e_ratio) < 1.25, np.median(e_ratio)
