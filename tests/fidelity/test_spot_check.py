"""The spot check every ``convert`` runs (:func:`pyro2pfp.analysis.fidelity.spot_check`): 64 guide samples through the
traced network on two inputs against the network's NumPy reference, a :class:`~pyro2pfp.FidelityError` naming
the first layer that departs when the logits are grossly off.

A network built wrongly -- from swapped deterministic weights, or from a guide whose scales were reset -- is
refused; an exact network passes with figures at the sampling noise; ``check=False`` skips the check."""
from __future__ import annotations

import copy
import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn as nn
from pyro.infer.autoguide import AutoNormal

import pyro2pfp
from pyro2pfp.analysis.fidelity import SPOT_RATIO_SD, SPOT_SAMPLES, spot_check

D_IN, HIDDEN, CLASSES = 6, 12, 3


def features() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh())


def last_layer_model(body: nn.Module):
    """Fixed (never trained, not in the param store) features and a Bayesian last layer sampled in the model."""

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(CLASSES, HIDDEN), 1.0).to_event(2))
        b = pyro.sample("b", dist.Normal(torch.zeros(CLASSES), 1.0).to_event(1))
        logits = body(x) @ w.T + b
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits

    return model


@pytest.fixture
def posterior():
    body = features()
    model = last_layer_model(body)
    guide = AutoNormal(model, init_loc_fn=lambda site: torch.randn(site["fn"].shape()), init_scale=0.1)
    guide(torch.randn(2, D_IN), torch.zeros(2, dtype=torch.long))
    return body, model, guide


def test_an_exact_network_passes_at_the_sampling_noise(posterior):
    _, model, guide = posterior
    net = pyro2pfp.convert(model, guide, input_shape=(D_IN,))
    check = net.fidelity
    assert check.passed and check.num_samples == SPOT_SAMPLES and check.num_inputs == 2
    assert check.mean_error_se < 3 and check.ratio_bounds[0] < check.ratio < check.ratio_bounds[1]
    lo, hi = check.ratio_bounds  # κ ≥ 3: at least a Gaussian's sampling noise
    assert math.isclose(hi, 1 / lo) and hi >= math.exp(SPOT_RATIO_SD * math.sqrt(2 / SPOT_SAMPLES)) - 1e-12
    assert pyro2pfp.convert(model, guide, input_shape=(D_IN,), check=False).fidelity is None


def test_swapped_deterministic_weights_are_refused(posterior):
    """A network converted from a copy of the features with their weight rows in reverse order (what a wrong read
    of the deterministic layers gives), checked against the model and guide: the first dense layer departs."""
    body, model, guide = posterior
    swapped = copy.deepcopy(body)
    with torch.no_grad():
        swapped[0].weight.copy_(swapped[0].weight.flip(0))
    net = pyro2pfp.convert(last_layer_model(swapped), guide, input_shape=(D_IN,), check=False)
    with pytest.raises(pyro2pfp.FidelityError, match=r"first layer past these bounds is 'linear' \(dense") as info:
        spot_check(net, model, guide)
    assert "median mean error" in str(info.value) and "check=False" in str(info.value)


def test_a_guide_whose_scales_were_reset_is_refused(posterior):
    """A network converted while the guide's scales were at a fresh guide's initial 0.01, checked against the
    trained guide: the variance ratio is far below the bounds."""
    _, model, guide = posterior
    store = pyro.get_param_store()
    trained = {name: store[name].detach().clone() for name in store.keys() if ".scales." in name}
    for name, value in trained.items():
        store[name] = torch.full_like(value, 0.01)
    net = pyro2pfp.convert(model, guide, input_shape=(D_IN,), check=False)
    for name, value in trained.items():
        store[name] = value
    with pytest.raises(pyro2pfp.FidelityError, match=r"median variance ratio PFP/MC 0\.00\d+ \(gross: outside"):
        spot_check(net, model, guide)


def test_calibration_scales_the_sampled_posterior(posterior):
    """A calibrated plan is checked against the posterior with its variances times the calibration (each
    sample's deviation from the mean scaled by its square root), not refused for being calibrated."""
    _, model, guide = posterior
    net = pyro2pfp.convert(model, guide, input_shape=(D_IN,), calibration=0.25)
    assert net.fidelity.passed and 0.7 < net.fidelity.ratio < 1.4
    np.testing.assert_allclose(net.fidelity.ratio_bounds[0] * net.fidelity.ratio_bounds[1], 1.0)
