"""Whole networks: PFP vs ``pyro.infer.Predictive`` sampling of the same trained (model, guide).

Bounds and why:

* One hidden layer, deterministic input (the paper's MLP shape): every hidden unit has its own
  weight row and bias, so the hidden activations are independent and each logit is a sum of
  independent terms.  PFP's per-logit mean and variance are then *exact* (ReLU moments are exact
  for the Gaussian pre-activation ``Σ w·x + b`` of a deterministic input), and the only difference
  from sampling is Monte Carlo error: we allow ``z`` standard errors with ``z`` set for a
  family-wise false-alarm rate of 1e-4 (Bonferroni over all logits).
* Deeper networks (two hidden layers, LeNet-5): the pre-activations of later layers are sums of
  independent terms but not exactly Gaussian, and activations that share an input or a
  convolution weight are correlated, which PFP ignores.  The mean is still exact given exact input
  means, so errors stay small for trained (narrow) posteriors: we require argmax agreement
  ≥ 95 % and mean logits within 5 % (relative L2), and observe well below that.  The variances: the
  median over logits of PFP's variance / the sampled variance lies in the band the sample count
  gives (``tests/support/stats.py``'s ``variance_ratio_band``: ``exp(±z·se)``, ``se`` the relative
  standard error of a sampled variance: exp(±0.28) for 400 Gaussian draws at a false-alarm rate of 1e-4); the
  same network with every variance zeroed, or a quarter or four times as large (calibration 0, 0.25,
  4), falls outside it.  Measured with 4,000 samples: median ratios 0.98 (MLP-2) and 1.00 (LeNet).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.special import ndtri

import pyro2pfp
from pyro2pfp_experiments.datasets import load_mnist
from pyro2pfp_experiments.validation import sampling_agreement
from pyro2pfp_experiments.zoo import BayesianLeNet5, BayesianMLP, make_guide, predictive_logits, train_svi
from tests.support.op_coverage import MONTE_CARLO, covers
from tests.support.stats import median_variance_ratio, variance_ratio_band


@pytest.fixture(scope="module")
def digits():
    x_train, y_train, x_test, y_test = load_mnist(n_train=1000, n_test=100)
    return x_train, y_train, x_test, y_test


def train(model, digits, epochs, flat):
    x_train, y_train, x_test, _ = digits
    if flat:
        x_train, x_test = x_train.reshape(len(x_train), -1), x_test.reshape(len(x_test), -1)
    guide = make_guide(model, init_scale=1e-2)
    train_svi(model, guide, x_train, y_train, epochs=epochs, lr=1e-2)
    return guide, x_test


@pytest.fixture(scope="module")
def mlp_and_samples(digits):
    model = BayesianMLP(hidden=(32,))
    guide, x = train(model, digits, epochs=3, flat=True)
    x = x[:40]
    mc = predictive_logits(model, guide, torch.as_tensor(x), num_samples=2000, seed=1)
    return model, guide, x, mc


def z_limit(n_outputs: int) -> float:
    """z for a family-wise false-alarm rate of 1e-4 over the means and variances of n outputs."""
    return float(ndtri(1 - 1e-4 / (2 * 2 * n_outputs)))


@pytest.mark.slow
def test_one_hidden_layer_mlp_moments_are_exact(mlp_and_samples):
    model, guide, x, mc = mlp_and_samples
    net = pyro2pfp.convert(model, guide)
    mean, var = net.compile()(x)
    agreement = sampling_agreement(mean.astype(np.float64), var.astype(np.float64), mc)
    assert agreement.mean_z < z_limit(mean.size), agreement
    assert agreement.var_z < z_limit(mean.size), agreement
    assert agreement.argmax_agreement >= 0.95, agreement


@pytest.mark.slow
def test_wrong_calibration_is_detected_by_the_same_check(mlp_and_samples):
    """The check above is sharp: shrinking the variances by a third must fail it."""
    model, guide, x, mc = mlp_and_samples
    mean, var = pyro2pfp.convert(model, guide, calibration=2 / 3).reference(x)
    assert sampling_agreement(mean, var, mc).var_z > z_limit(mean.size)


@pytest.mark.slow
@covers("reshape", kind=MONTE_CARLO)
@pytest.mark.parametrize("arch", ["mlp2", "lenet"])
def test_deeper_networks_agree_with_sampling(arch, digits):
    if arch == "mlp2":
        model, flat, shape, epochs = BayesianMLP(hidden=(64, 32)), True, None, 3
    else:
        model, flat, shape, epochs = BayesianLeNet5(c1=4, c2=8, f1=32, f2=16), False, (1, 28, 28), 2
    guide, x = train(model, digits, epochs=epochs, flat=flat)
    net = pyro2pfp.convert(model, guide, input_shape=shape)
    mean, var = net.compile()(x)
    ref_mean, ref_var = net.reference(x)
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-4, atol=1e-4 * np.abs(ref_mean).max())
    np.testing.assert_allclose(var, ref_var, rtol=1e-3, atol=1e-4 * ref_var.max())
    mc = predictive_logits(model, guide, torch.as_tensor(x), num_samples=400, seed=2)
    agreement = sampling_agreement(ref_mean, ref_var, mc)
    assert agreement.argmax_agreement >= 0.95, agreement
    assert agreement.mean_rel_error <= 0.05, agreement
    lo, hi = variance_ratio_band(mc)
    assert lo <= median_variance_ratio(ref_var, mc) <= hi, (median_variance_ratio(ref_var, mc), lo, hi)
    # the band is sharp: variances zeroed, a quarter or four times as large fall outside it
    for calibration in (0.0, 0.25, 4.0):
        _, var = pyro2pfp.convert(model, guide, input_shape=shape, calibration=calibration).reference(x)
        ratio = median_variance_ratio(var, mc)
        assert not lo <= ratio <= hi, (calibration, ratio, lo, hi)
