"""Uncertainty metrics, AUROC, automatic calibration and the synthetic aleatoric / OOD data sets.

The metrics are checked against independent computations: scipy's entropy of known distributions,
a naive softmax implementation, Gauss–Hermite quadrature of a Gaussian logit, scikit-learn's
``roc_auc_score``; ``calibrate`` must recover a known variance factor on synthetic cases.
"""
from __future__ import annotations

import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from scipy.special import softmax
from scipy.stats import entropy

import pyro2pfp
from pyro2pfp.calibration import CalibrationObjective, calibrate, minimise_log_scale, predictive_uncertainty
from pyro2pfp.runtime.uncertainty import (
    auroc,
    sample_logits,
    standard_normal_draws,
    uncertainty,
    uncertainty_from_logit_samples,
)
from pyro2pfp_experiments.ood_data import (
    FASHION_KINDS,
    ambiguous_digits,
    fashion_shapes,
    rendered_letters,
    sample_ambiguous_labels,
)
from pyro2pfp_experiments.zoo import BayesianMLP, predictive_logits

FAST = settings(max_examples=40, deadline=None)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """These tiny models run fastest on one thread (and many times slower with 2 on a busy 2-core box)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# --------------------------------------------------------------------------- metrics

def naive_metrics(samples: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Textbook formulas with scipy: H[mean_n softmax], mean_n H[softmax], their difference."""
    p = softmax(samples, axis=-1)
    total = entropy(p.mean(0), axis=-1)
    aleatoric = entropy(p, axis=-1).mean(0)
    return total, aleatoric, total - aleatoric


def test_entropy_of_a_known_distribution():
    logits = np.log(np.array([[0.5, 0.25, 0.125, 0.125], [0.25, 0.25, 0.25, 0.25]]))
    u = uncertainty_from_logit_samples(np.repeat(logits[None], 7, axis=0))  # no spread across samples
    expected = np.array([1.75 * math.log(2), math.log(4)])  # 1.75 bits, 2 bits
    np.testing.assert_allclose(u["total"], expected, rtol=1e-12)
    np.testing.assert_allclose(u["aleatoric"], expected, rtol=1e-12)
    np.testing.assert_allclose(u["epistemic"], 0.0, atol=1e-12)
    np.testing.assert_allclose(u["probs"], np.exp(logits), rtol=1e-12)
    np.testing.assert_allclose(u["logit_variance"], 0.0, atol=1e-12)


def test_confident_but_disagreeing_samples_are_all_epistemic():
    k = 5
    samples = 60.0 * np.eye(k)[:, None, :]  # sample n is (almost) one-hot on class n
    u = uncertainty_from_logit_samples(samples)
    assert u["total"][0] == pytest.approx(math.log(k), rel=1e-9)
    assert u["aleatoric"][0] == pytest.approx(0.0, abs=1e-20)
    assert u["epistemic"][0] == pytest.approx(math.log(k), rel=1e-9)


@FAST
@given(hnp.arrays(np.float64, st.tuples(st.integers(1, 6), st.integers(1, 4), st.integers(2, 6)),
                  elements=st.floats(-30, 30)))
def test_metrics_match_naive_computation(samples):
    u = uncertainty_from_logit_samples(samples)
    total, aleatoric, mi = naive_metrics(samples)
    np.testing.assert_allclose(u["total"], total, atol=1e-9)
    np.testing.assert_allclose(u["aleatoric"], aleatoric, atol=1e-9)
    np.testing.assert_allclose(u["epistemic"], np.maximum(mi, 0), atol=1e-9)
    k = samples.shape[-1]
    assert np.all(u["aleatoric"] <= u["total"] + 1e-12) and np.all(u["total"] <= math.log(k) + 1e-12)
    assert np.all(u["epistemic"] >= 0)
    np.testing.assert_allclose(u["probs"].sum(-1), 1.0, rtol=1e-12)
    ddof = 1 if samples.shape[0] > 1 else 0
    np.testing.assert_allclose(u["logit_variance"], samples.var(0, ddof=ddof).sum(-1), rtol=1e-9, atol=1e-12)


def test_extreme_logits_are_stable():
    rng = np.random.default_rng(0)
    samples = rng.choice([-1e4, 0.0, 1e4], size=(20, 50, 10)) + rng.standard_normal((20, 50, 10))
    u = uncertainty_from_logit_samples(samples)
    for key in ("total", "aleatoric", "epistemic", "probs"):
        assert np.all(np.isfinite(u[key])), key
    assert np.all(u["total"] <= math.log(10) + 1e-12)
    # float32 input (compiled PFP output) is accepted and promoted
    u32 = uncertainty_from_logit_samples(samples.astype(np.float32))
    assert u32["total"].dtype == np.float64


def test_single_input_layout_and_validation():
    u = uncertainty_from_logit_samples(np.zeros((4, 3)))  # (N, K): one input
    assert u["total"].shape == (1,) and u["total"][0] == pytest.approx(math.log(3))
    with pytest.raises(ValueError):
        uncertainty_from_logit_samples(np.zeros((2, 3, 4, 5)))
    with pytest.raises(ValueError):
        uncertainty_from_logit_samples(np.array([[[np.nan, 0.0]]]))
    with pytest.raises(ValueError):
        uncertainty(np.zeros((2, 3)), np.zeros((2, 4)))
    with pytest.raises(ValueError):
        uncertainty(np.zeros((2, 3)), -np.ones((2, 3)))
    with pytest.raises(ValueError):
        sample_logits(np.zeros((2, 3)), np.ones((2, 3)), num_samples=0)


def test_uncertainty_with_zero_variance_is_the_softmax_entropy():
    mean = np.array([[2.0, -1.0, 0.5], [0.0, 0.0, 0.0]])
    u = uncertainty(mean, np.zeros_like(mean), num_samples=5, seed=0)
    np.testing.assert_allclose(u["total"], entropy(softmax(mean, -1), axis=-1), rtol=1e-12)
    np.testing.assert_allclose(u["aleatoric"], u["total"], rtol=1e-12)
    np.testing.assert_allclose(u["epistemic"], 0.0, atol=1e-12)
    np.testing.assert_allclose(u["logit_variance"], 0.0)


def test_logit_sampling_is_seeded_and_uses_exact_variance():
    rng = np.random.default_rng(1)
    mean, var = rng.standard_normal((8, 4)), rng.uniform(0.1, 2.0, (8, 4))
    a = uncertainty(mean, var, num_samples=50, seed=3)
    b = uncertainty(mean, var, num_samples=50, seed=3)
    c = uncertainty(mean, var, num_samples=50, seed=4)
    np.testing.assert_array_equal(a["epistemic"], b["epistemic"])
    assert not np.array_equal(a["epistemic"], c["epistemic"])
    np.testing.assert_allclose(a["logit_variance"], var.sum(-1))  # exact, not the sample variance
    g = uncertainty(mean, var, num_samples=50, seed=np.random.default_rng(3))
    np.testing.assert_array_equal(g["total"], a["total"])
    s = sample_logits(mean, var, num_samples=20000, seed=0)
    assert s.shape == (20000, 8, 4)
    np.testing.assert_allclose(s.mean(0), mean, atol=5 * np.sqrt(var.max() / 20000))
    np.testing.assert_allclose(s.var(0), var, rtol=0.05)
    # float32 inputs (the compiled module's output) and torch tensors are accepted
    t = uncertainty(torch.as_tensor(mean, dtype=torch.float32), var.astype(np.float32), num_samples=50, seed=3)
    np.testing.assert_allclose(t["total"], a["total"], rtol=1e-5)


def test_sample_logits_are_mean_plus_sd_times_the_public_draws():
    """``standard_normal_draws`` (what ``calibrate`` keeps fixed across factors) are the draws behind
    ``sample_logits``: the same seed gives ``mean + √var·z`` exactly, a Generator continues its stream."""
    mean, var = np.array([[0.5, -2.0, 1e6]]), np.array([[0.0, 4.0, 1e-3]])
    z = standard_normal_draws((7, 1, 3), seed=5)
    np.testing.assert_array_equal(sample_logits(mean, var, num_samples=7, seed=5), mean + np.sqrt(var) * z)
    rng = np.random.default_rng(5)
    first = standard_normal_draws((7, 1, 3), seed=rng)
    np.testing.assert_array_equal(first, z)
    assert not np.array_equal(standard_normal_draws((7, 1, 3), seed=rng), z)


def test_gaussian_logits_against_quadrature():
    """Two classes, logits N(0, v) each: total = log 2, aleatoric = E[h(sigmoid(d))], d ~ N(0, 2v)."""
    v = 1.5
    nodes, weights = np.polynomial.hermite_e.hermegauss(80)  # ∫ f(x) exp(-x²/2) dx
    d = math.sqrt(2 * v) * nodes
    p = 1 / (1 + np.exp(-d))
    h = -(p * np.log(p) + (1 - p) * np.log1p(-p))
    aleatoric = float((weights * h).sum() / weights.sum())
    u = uncertainty(np.zeros((1, 2)), np.full((1, 2), v), num_samples=400_000, seed=0)
    assert u["total"][0] == pytest.approx(math.log(2), abs=1e-4)
    assert u["aleatoric"][0] == pytest.approx(aleatoric, abs=2e-3)
    assert u["epistemic"][0] == pytest.approx(math.log(2) - aleatoric, abs=2e-3)


# --------------------------------------------------------------------------- AUROC

def test_auroc_known_values():
    assert auroc([0.1, 0.2, 0.3], [0.5, 0.9]) == 1.0  # separable
    assert auroc([0.5, 0.9], [0.1, 0.2, 0.3]) == 0.0  # separable, wrong direction
    assert auroc([1.0, 1.0], [1.0, 1.0, 1.0]) == 0.5  # all tied
    # pairs (in, out): (0,1) 1, (0,2) 1, (1,1) ½, (1,2) 1  ->  3.5 / 4
    assert auroc([0.0, 1.0], [1.0, 2.0]) == 0.875
    with pytest.raises(ValueError):
        auroc([], [1.0])
    with pytest.raises(ValueError):
        auroc([np.nan], [1.0])


@pytest.mark.slow
@FAST
@given(st.lists(st.integers(0, 5), min_size=1, max_size=30), st.lists(st.integers(0, 5), min_size=1, max_size=30))
def test_auroc_matches_sklearn_and_pairwise_count(s_in, s_out):
    from sklearn.metrics import roc_auc_score

    a = auroc(s_in, s_out)
    pairs = np.array([[1.0 if o > i else 0.5 if o == i else 0.0 for o in s_out] for i in s_in])
    assert a == pytest.approx(pairs.mean(), abs=1e-12)
    labels = np.r_[np.zeros(len(s_in)), np.ones(len(s_out))]
    assert a == pytest.approx(roc_auc_score(labels, np.r_[s_in, s_out]), abs=1e-12)
    assert auroc(np.exp(s_in), np.exp(s_out)) == pytest.approx(a, abs=1e-12)  # rank-invariant


# --------------------------------------------------------------------------- models for PFP / calibration

def linear_bnn(k_in: int = 5, k_out: int = 3, seed: int = 0):
    """A Bayesian linear classifier (the zoo MLP without hidden layers) and fixed Normal posteriors."""
    model = BayesianMLP(in_features=k_in, hidden=(), out_features=k_out)
    g = torch.Generator().manual_seed(seed)
    locs = {"fc1.weight": torch.randn(k_out, k_in, generator=g, dtype=torch.float64).float(),
            "fc1.bias": 0.5 * torch.randn(k_out, generator=g, dtype=torch.float64).float()}
    scales = {name: 0.3 + 0.7 * torch.rand(loc.shape, generator=g, dtype=torch.float64).float()
              for name, loc in locs.items()}
    return model, locs, scales


def fixed_guide(locs, scales, factor: float = 1.0):
    """A hand-written guide: every site ~ Normal(loc, sqrt(factor)·scale) (variances × factor)."""
    def guide(x, y=None):
        for name, loc in locs.items():
            pyro.sample(name, dist.Normal(loc, math.sqrt(factor) * scales[name]).to_event(loc.dim()))
    return guide


def small_mlp_guide(seed: int = 0):
    model = BayesianMLP(in_features=6, hidden=(8,), out_features=4)
    g = torch.Generator().manual_seed(seed)
    shapes = {"fc1.weight": (8, 6), "fc1.bias": (8,), "fc2.weight": (4, 8), "fc2.bias": (4,)}
    locs = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    scales = {n: 0.2 + 0.5 * torch.rand(s, generator=g) for n, s in shapes.items()}
    return model, fixed_guide(locs, scales)


def test_predictive_uncertainty_is_the_same_code_path():
    model, guide = small_mlp_guide()
    x = torch.randn(7, 6)
    u = predictive_uncertainty(model, guide, x, num_samples=30, seed=5)
    ref = uncertainty_from_logit_samples(predictive_logits(model, guide, x, num_samples=30, seed=5))
    for key in ("total", "aleatoric", "epistemic", "probs", "logit_variance"):
        np.testing.assert_array_equal(u[key], ref[key])


@pytest.mark.slow
def test_pfp_and_predictive_agree_for_gaussian_logits():
    """A linear BNN's logits are exactly Gaussian, so PFP logit sampling and Predictive estimate the
    same metrics (up to Monte Carlo error)."""
    model, locs, scales = linear_bnn()
    guide = fixed_guide(locs, scales)
    x = np.random.default_rng(2).standard_normal((12, 5))
    net = pyro2pfp.convert(model, guide, input_shape=(5,), calibration=1.0)
    pfp = uncertainty(*net.reference(x), num_samples=20000, seed=0)
    svi = predictive_uncertainty(model, guide, x, num_samples=600, seed=0)
    assert pfp["epistemic"].mean() > 0.1  # a case with real epistemic uncertainty
    for key in ("total", "aleatoric", "epistemic"):
        np.testing.assert_allclose(pfp[key], svi[key], atol=0.05, err_msg=key)
    np.testing.assert_allclose(pfp["logit_variance"], svi["logit_variance"], rtol=0.15)


# --------------------------------------------------------------------------- calibration

def test_minimise_log_scale_finds_a_known_minimum():
    calls = []

    def f(c):
        calls.append(c)
        return (math.log(c) - math.log(0.37)) ** 2

    assert minimise_log_scale(f, (1e-3, 10.0), grid=13, rtol=1e-4) == pytest.approx(0.37, rel=1e-4)
    assert len(calls) < 60
    with pytest.warns(UserWarning, match="edge"):
        minimise_log_scale(lambda c: -c, (0.1, 2.0))
    with pytest.raises(ValueError):
        minimise_log_scale(f, (0.0, 1.0))


def test_calibrate_recovers_the_factor_exactly_with_common_draws():
    """Target = PFP's own logit samples at c* drawn with calibrate's seed: the objective is exactly 0
    at c*, so the search must land on c* (a nonlinear network: c enters through the ReLU moments)."""
    model, guide = small_mlp_guide()
    x = np.random.default_rng(0).standard_normal((40, 6))
    net = pyro2pfp.convert(model, guide, input_shape=(6,))
    c_true, n = 0.23, 64
    mean, var = pyro2pfp.convert(model, guide, input_shape=(6,), calibration=c_true).reference(x)
    target = sample_logits(mean, var, num_samples=n, seed=11)
    for objective in ("mutual_information", "total", "entropies"):
        c = calibrate(model, guide, x, net=net, samples=target, objective=objective, num_samples=n,
                      seed=11, rtol=1e-3)
        assert c == pytest.approx(c_true, rel=2e-3), objective


@pytest.mark.slow
@pytest.mark.parametrize("c_true", [0.2, 1.0, 4.0])
def test_calibrate_recovers_a_known_factor_from_predictive(c_true):
    """The BNN to match is the linear BNN with every posterior variance multiplied by c_true
    (Predictive samples, independent of PFP); PFP of the unscaled guide must need factor c_true."""
    model, locs, scales = linear_bnn(seed=1)
    x = np.random.default_rng(3).standard_normal((200, 5))
    n = 400
    target = predictive_logits(model, fixed_guide(locs, scales, c_true), x, num_samples=n, seed=0)
    c, obj = calibrate(model, fixed_guide(locs, scales), x, input_shape=(5,), samples=target,
                       num_samples=n, seed=1, return_objective=True)
    assert c == pytest.approx(c_true, rel=0.1)
    assert obj.objective == "mutual_information" and len(obj.history) > 13
    # without precomputed samples, calibrate runs Predictive of (model, guide) itself: PFP is exact here
    pyro.clear_param_store()
    if c_true == 1.0:
        assert calibrate(model, fixed_guide(locs, scales), x, input_shape=(5,), num_samples=n,
                         seed=2) == pytest.approx(1.0, rel=0.15)


@pytest.mark.slow
def test_calibrate_nll_recovers_the_data_generating_factor():
    """Labels drawn from the predictive distribution of the BNN whose variances are × c_true: the
    NLL (a proper scoring rule) of PFP's predictive is smallest near c_true."""
    model, locs, scales = linear_bnn(seed=2)
    x = np.random.default_rng(4).standard_normal((4000, 5))
    c_true = 3.0
    logits = predictive_logits(model, fixed_guide(locs, scales, c_true), x, num_samples=200, seed=0)
    p = softmax(logits, -1).mean(0)  # the BNN's predictive p̄(y | x)
    y = (np.random.default_rng(5).uniform(size=(len(x), 1)) > np.cumsum(p, -1)).sum(-1)  # y ~ p̄
    c = calibrate(model, fixed_guide(locs, scales), x, input_shape=(5,), y_val=y, num_samples=100, seed=0)
    assert c == pytest.approx(c_true, rel=0.3)  # the default objective with labels is "nll"


def test_calibration_objective_reports_all_objectives_and_validates():
    model, guide = small_mlp_guide()
    x = np.random.default_rng(0).standard_normal((10, 6))
    net = pyro2pfp.convert(model, guide, input_shape=(6,))
    target = predictive_logits(model, guide, x, num_samples=20, seed=0)
    obj = CalibrationObjective(net, x, target_samples=target, y_val=np.zeros(10, int), num_samples=20)
    values = obj.evaluate(0.5)
    assert set(values) == {"mutual_information", "total", "entropies", "nll"}
    assert obj(0.5) == values["mutual_information"] and obj.history == [(0.5, values["mutual_information"])]
    with pytest.raises(ValueError, match="y_val"):
        CalibrationObjective(net, x, objective="nll", target_samples=target)
    with pytest.raises(ValueError, match="target_samples"):
        CalibrationObjective(net, x, objective="total")
    with pytest.raises(ValueError, match="objective"):
        CalibrationObjective(net, x, objective="kl", target_samples=target)
    with pytest.raises(ValueError, match="target_samples"):
        CalibrationObjective(net, x, target_samples=target[:, :5])
    # the returned factor is accepted by convert
    c = calibrate(model, guide, x, net=net, samples=target, num_samples=20)
    assert isinstance(c, float) and pyro2pfp.convert(model, guide, input_shape=(6,), calibration=c).calibration == c


# --------------------------------------------------------------------------- data sets

def _check_images(images, n):
    assert images.shape == (n, 1, 28, 28) and images.dtype == np.float32
    assert images.min() >= 0.0 and images.max() <= 1.0


def test_ambiguous_digits():
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(40, 1, 28, 28)).astype(np.float32)
    y = np.arange(40) % 4
    images, pairs, alpha = ambiguous_digits(x, y, 300, seed=1, alpha_range=(0.4, 0.6))
    _check_images(images, 300)
    assert np.all(pairs[:, 0] != pairs[:, 1])
    assert np.all((alpha >= 0.4) & (alpha <= 0.6))
    np.testing.assert_allclose(images.reshape(300, -1).max(1), 1.0, rtol=1e-6)
    again = ambiguous_digits(x, y, 300, seed=1, alpha_range=(0.4, 0.6))
    np.testing.assert_array_equal(again[0], images)
    labels = sample_ambiguous_labels(pairs, np.full(300, 0.8), seed=0)
    assert np.all((labels == pairs[:, 0]) | (labels == pairs[:, 1]))
    assert np.mean(labels == pairs[:, 0]) == pytest.approx(0.8, abs=0.07)
    # a blend of two single-pixel "digits" is their alpha-weighted sum, rescaled to max 1
    a, b = np.zeros((1, 28, 28), np.float32), np.zeros((1, 28, 28), np.float32)
    a[0, 3, 3], b[0, 20, 20] = 1.0, 1.0
    img, pr, al = ambiguous_digits(np.stack([a, b]), np.array([0, 1]), 5, seed=0)
    for i in range(5):
        wa, wb = (al[i], 1 - al[i]) if pr[i, 0] == 0 else (1 - al[i], al[i])
        assert img[i, 0, 3, 3] == pytest.approx(wa / max(wa, wb), rel=1e-6)
        assert img[i, 0, 20, 20] == pytest.approx(wb / max(wa, wb), rel=1e-6)
    with pytest.raises(ValueError):
        ambiguous_digits(x, np.zeros(40, int), 3)


def test_rendered_letters_and_fashion_shapes():
    letters, lab = rendered_letters(30, seed=0)
    _check_images(letters, 30)
    assert set(lab) <= set(range(10)) and letters.reshape(30, -1).max(1).min() > 0.9
    ys, xs = np.indices((28, 28))
    for img in letters[:, 0]:  # MNIST preprocessing: centre of mass in the middle, inside a 20-px box
        m = img.sum()
        assert abs((ys * img).sum() / m - 13.5) <= 1.0 and abs((xs * img).sum() / m - 13.5) <= 1.0
        rows, cols = np.nonzero(img.max(1))[0], np.nonzero(img.max(0))[0]
        assert max(rows[-1] - rows[0], cols[-1] - cols[0]) <= 21
    np.testing.assert_array_equal(rendered_letters(30, seed=0)[0], letters)
    fashion, kinds = fashion_shapes(40, seed=0)
    _check_images(fashion, 40)
    assert set(kinds) <= set(range(len(FASHION_KINDS)))
    assert (fashion > 0.05).mean() > 2 * (letters > 0.05).mean()  # large filled shapes vs strokes
    np.testing.assert_array_equal(fashion_shapes(40, seed=0)[0], fashion)
    assert rendered_letters(0)[0].shape == (0, 1, 28, 28) and fashion_shapes(0)[0].shape == (0, 1, 28, 28)
