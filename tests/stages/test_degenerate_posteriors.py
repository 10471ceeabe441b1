"""Degenerate posteriors (scales of exactly 0, scales float32 cannot hold) convert to networks that
are deterministic where sampling is, and the errors of three misuses name their cause."""
from __future__ import annotations

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn as nn
from pyro.infer import autoguide
from pyro.nn import PyroModule, PyroSample

import pyro2pfp
from pyro2pfp.frontend import tracing
from pyro2pfp.frontend.posterior import check_posterior
from pyro2pfp.planning.graph import Repr
from pyro2pfp_experiments.zoo import BayesianLeNet5, BayesianMLP, make_guide

SIZES = {"fc1.weight": (5, 6), "fc1.bias": (5,), "fc2.weight": (3, 5), "fc2.bias": (3,)}


class _SmallNet(PyroModule):
    """6 → 5 → ReLU → 3 with PyroSample weights and a Categorical likelihood."""

    def __init__(self):
        super().__init__()
        self.fc1 = PyroModule[nn.Linear](6, 5)
        self.fc1.weight = PyroSample(dist.Normal(0.0, 1.0).expand([5, 6]).to_event(2))
        self.fc1.bias = PyroSample(dist.Normal(0.0, 1.0).expand([5]).to_event(1))
        self.fc2 = PyroModule[nn.Linear](5, 3)
        self.fc2.weight = PyroSample(dist.Normal(0.0, 1.0).expand([3, 5]).to_event(2))
        self.fc2.bias = PyroSample(dist.Normal(0.0, 1.0).expand([3]).to_event(1))

    def forward(self, x, y=None):
        logits = self.fc2(torch.relu(self.fc1(x)))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


def _scales(kind: str) -> dict[str, torch.Tensor]:
    """Per-site posterior scales: ``zero`` everywhere; ``partly`` zero for fc1 and for output 0 of fc2
    (so logit 0 is deterministic and the others are not); ``1e-30`` everywhere."""
    if kind == "zero":
        return {name: torch.zeros(shape) for name, shape in SIZES.items()}
    if kind == "1e-30":
        return {name: torch.full(shape, 1e-30) for name, shape in SIZES.items()}
    scales = {name: torch.full(shape, 0.2) for name, shape in SIZES.items()}
    scales["fc1.weight"].zero_()
    scales["fc1.bias"].zero_()
    scales["fc2.weight"][0] = 0.0
    scales["fc2.bias"][0] = 0.0
    return scales


def _locs(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in SIZES.items()}


def _trained_guide(model, kind: str, scales: dict[str, torch.Tensor], locs: dict[str, torch.Tensor]):
    """The guide of ``kind`` with the given means and scales, set the way a user sets a trained
    guide's values: through the param store (``store[name] = value``, constrained space)."""
    x, y = torch.zeros(2, 6), torch.zeros(2, dtype=torch.long)
    store = pyro.get_param_store()
    if kind == "AutoNormal":
        guide = autoguide.AutoNormal(model)
        guide(x, y)
        for name in SIZES:
            store[f"AutoNormal.locs.{name}"] = locs[name].clone()
            store[f"AutoNormal.scales.{name}"] = scales[name].clone()
        return guide
    if kind in ("AutoDiagonalNormal", "AutoLowRankMultivariateNormal", "AutoMultivariateNormal"):
        guide = getattr(autoguide, kind)(model)
        guide(x, y)
        flat_loc, flat_scale = torch.zeros(guide.latent_dim), torch.zeros(guide.latent_dim)
        for (site, loc_view), (_, scale_view) in zip(guide._unpack_latent(flat_loc),
                                                     guide._unpack_latent(flat_scale)):
            loc_view.copy_(locs[site["name"]])
            scale_view.copy_(scales[site["name"]])
        store[f"{kind}.loc"] = flat_loc
        store[f"{kind}.scale"] = flat_scale
        return guide

    def guide(x, y=None):  # hand-written: a scale parameter per site, or a Delta where it is all 0
        for name in SIZES:
            loc = pyro.param(f"{name}.loc", locs[name].clone())
            scale = pyro.param(f"{name}.scale", scales[name].clone())
            fn = dist.Delta(loc) if kind == "Delta" else dist.Normal(loc, scale)
            pyro.sample(name, fn.to_event(len(SIZES[name])))

    return guide


def _sampled_logits(model, guide, x: torch.Tensor, n: int = 16) -> np.ndarray:
    """Logits of ``n`` posterior samples of the weights (Pyro's own sampler), shape (n, batch, 3)."""
    out = []
    with torch.no_grad(), pyro.validation_enabled(False):
        for _ in range(n):
            trace = pyro.poutine.trace(guide).get_trace(x)
            out.append(pyro.poutine.replay(model, trace=trace)(x).double().numpy())
    return np.stack(out)


GUIDES = ["AutoNormal", "AutoDiagonalNormal", "AutoLowRankMultivariateNormal", "hand-written"]
CASES = [(g, s) for g in GUIDES for s in ("zero", "partly", "1e-30")] + [("Delta", "zero")]
# the guard whitens the sub-vector of non-zero scales
CASES += [pytest.param("AutoMultivariateNormal", "partly", marks=pytest.mark.slow)]


@pytest.mark.filterwarnings("ignore:Auto.*MultivariateNormal models correlations")
@pytest.mark.parametrize("guide_kind,scale_kind", CASES)
def test_zero_and_denormal_scales_convert_deterministic_where_sampling_is(guide_kind, scale_kind):
    model = _SmallNet()
    locs, scales = _locs(), _scales(scale_kind)
    guide = _trained_guide(model, guide_kind, scales, locs)
    net = pyro2pfp.convert(model, guide)  # the consistency check runs (check_posterior=True)

    for name, scale in scales.items():
        layer, attr = name.split(".")
        param = net.layer_graph.layer(layer).params[attr]
        np.testing.assert_allclose(param.mean, locs[name].double().numpy(), rtol=1e-6)
        read_zero = param.var == 0
        assert np.array_equal(read_zero, scale.numpy() == 0), name  # 0 read as 0, 1e-30 as its square
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
    mean, var = net.reference(x)
    with torch.no_grad(), pyro.poutine.condition(data=locs):
        np.testing.assert_allclose(mean, model(x).double().numpy(), rtol=1e-6, atol=1e-6)
    if scale_kind == "partly":
        assert np.all(var[:, 0] == 0) and np.all(var[:, 1:] > 0)
        assert net.plan.layer("fc1").out_repr is Repr.DETERMINISTIC
    else:  # 0, or 1e-30: a variance below float32's range, stored as 0
        assert np.all(var == 0)
        assert all(p.out_repr is Repr.DETERMINISTIC for p in net.plan.layers if p.name != net.plan.output)
    if guide_kind != "AutoLowRankMultivariateNormal":  # torch cannot build its singular covariance
        spread = _sampled_logits(model, guide, x).var(axis=0)
        np.testing.assert_array_equal(var == 0, spread == 0)  # deterministic exactly where sampling is


@pytest.mark.slow
@pytest.mark.parametrize("model_kind", ["MLP", "LeNet-5"])
def test_collapsed_autonormal_converts_and_compiles_to_zero_variance(model_kind):
    """Every AutoNormal scale 0 (the param store's unconstrained value -inf): a deterministic network,
    in the reference and compiled, in both plans."""
    model = BayesianMLP(hidden=(8,)) if model_kind == "MLP" else BayesianLeNet5(c1=2, c2=3, f1=8, f2=6)
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(3, 1, 28, 28, generator=g), torch.randint(0, 10, (3,), generator=g)
    guide = make_guide(model, init_scale=0.05)
    guide(x, y)
    store = pyro.get_param_store()
    for name in list(store.keys()):
        if ".locs." in name:
            store[name] = 0.3 * torch.randn(store[name].shape, generator=g)
        else:
            store[name] = torch.zeros_like(store[name])
    shape = None if model_kind == "MLP" else (1, 28, 28)
    inputs = x.reshape(3, -1) if model_kind == "MLP" else x
    means = {name.removeprefix("AutoNormal.locs."): store[name].detach() for name in store.keys() if ".locs." in name}
    with torch.no_grad(), pyro.poutine.condition(data=means):
        expected = model(x).double().numpy()
    for form in ("variance", "raw"):
        net = pyro2pfp.convert(model, guide, input_shape=shape, moment_form=form)
        mean, var = net.reference(inputs)
        np.testing.assert_allclose(mean, expected, rtol=1e-6, atol=1e-6)
        assert np.all(var == 0)
    if model_kind == "MLP":
        cmean, cvar = net.compile()(inputs)
        assert np.all(cvar == 0)
        np.testing.assert_allclose(cmean, expected, rtol=1e-4, atol=1e-4)


def test_collapsed_posterior_loads_into_a_guide_that_never_ran():
    model = _SmallNet()
    locs = _locs()
    _trained_guide(model, "AutoNormal", _scales("zero"), locs)
    state = pyro.get_param_store().get_state()
    pyro.clear_param_store()
    pyro.get_param_store().set_state(state)
    net = pyro2pfp.convert(model, autoguide.AutoNormal(model))  # a fresh guide, as in a new process
    mean, var = net.reference(np.ones((2, 6)))
    assert np.all(var == 0)
    np.testing.assert_array_equal(net.layer_graph.layer("fc2").params["weight"].mean, locs["fc2.weight"].numpy())


def test_invalid_scales_are_counted_not_dumped():
    model = _SmallNet()
    scales = _scales("partly")
    scales["fc1.weight"][0, :3] = float("nan")
    scales["fc2.weight"][1, 0] = -0.5
    guide = _trained_guide(model, "hand-written", scales, _locs())
    with pytest.raises(pyro2pfp.PosteriorError) as info:
        pyro2pfp.convert(model, guide)
    message = str(info.value)
    assert "'fc1.weight' (shape (5, 6), 30 values)" in message and "3 NaN variances" in message
    assert "tensor(" not in message and "\n" not in message


def test_consistency_check_still_sees_a_spread_read_as_negligible():
    """Entries read with an sd float32 cannot resolve are checked too: a guide that samples them
    with a real spread (a stale read) fails."""
    model = _SmallNet()
    locs = _locs()
    guide = _trained_guide(model, "hand-written", _scales("partly"), locs)
    x = torch.zeros(2, 6)
    posterior = {name: (locs[name].double().numpy(), np.full(shape, 1e-60)) for name, shape in SIZES.items()}
    with pytest.raises(pyro2pfp.PosteriorError, match=r"'fc2.weight': \d+ entries .* sd below float32"):
        check_posterior(guide, posterior, (x,))


class _AttentionNet(PyroModule):
    def __init__(self):
        super().__init__()
        self.fc = PyroModule[nn.Linear](8, 8)
        self.fc.weight = PyroSample(dist.Normal(0.0, 1.0).expand([8, 8]).to_event(2))
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, 3)

    def forward(self, x, y=None):
        h = self.fc(x).reshape(x.shape[0], 1, 8)
        a, _ = self.attn(h, h, h)
        return self.out(a.reshape(x.shape[0], 8))


def test_unsupported_module_is_named_not_reported_as_a_batch_branch():
    model = _AttentionNet()
    guide = autoguide.AutoNormal(model)
    guide(torch.zeros(2, 8))
    with pytest.raises(pyro2pfp.UnsupportedLayerError,
                       match=r"^`attn` \(nn\.MultiheadAttention\) is not supported by PFP: attn \(aten\.") as info:
        pyro2pfp.convert(model, guide)
    assert "differently at batch 1" not in str(info.value)


def test_batch_1_comparison_passes_over_torch_internals(monkeypatch):
    """Without the unsupported-module check, the batch-1 comparison alone does not take attention's
    arithmetic on the symbolic batch size (batch · heads) or torch's own lowering for a branch: the
    walk then names the first op it cannot convert."""
    monkeypatch.setattr(tracing, "check_supported_ops", lambda *args: None)
    model = _AttentionNet()
    guide = autoguide.AutoNormal(model)
    guide(torch.zeros(2, 8))
    with pytest.raises(pyro2pfp.UnsupportedLayerError, match=r"^attn \(aten\."):
        pyro2pfp.convert(model, guide)


def test_model_that_runs_no_network_is_told_to_pass_the_guides_model():
    model = _SmallNet()
    guide = _trained_guide(model, "AutoNormal", _scales("partly"), _locs())
    with pytest.raises(pyro2pfp.PosteriorError,
                       match=r"'<lambda>' uses none of .*samples no site.*trained for \(_SmallNet\): "
                             r"the network itself \(a PyroModule"):
        pyro2pfp.convert(lambda x: x, guide, input_shape=(6,))
