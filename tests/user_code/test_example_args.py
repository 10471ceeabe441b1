"""``convert(..., example_args=(x, y), example_kwargs=...)``: models and guides that need the labels (or
other arguments) are run with them; the labels never enter the network."""
from __future__ import annotations

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

import pyro2pfp
from pyro2pfp.frontend.noise import NoiseModel

D_IN, CLASSES = 5, 3
X = torch.randn(8, D_IN, generator=torch.Generator().manual_seed(0))
Y = torch.randint(0, CLASSES, (8,), generator=torch.Generator().manual_seed(1))
W_LOC, B_LOC = torch.randn(D_IN, CLASSES), torch.randn(CLASSES)


def classifier(X, cll):
    W = pyro.sample("W", dist.Normal(torch.zeros(D_IN, CLASSES), 1.0).to_event(2))
    b = pyro.sample("b", dist.Normal(torch.zeros(CLASSES), 1.0).to_event(1))
    with pyro.plate("data", cll.size(0)):  # sized by the labels
        pyro.sample("obs", dist.Categorical(logits=X.mm(W) + b), obs=cll)


def guide(X, cll, *, scale=0.1):
    assert cll.shape[0] == X.shape[0]  # reads the labels
    pyro.sample("W", dist.Normal(W_LOC, scale * torch.ones(D_IN, CLASSES)).to_event(2))
    pyro.sample("b", dist.Normal(B_LOC, scale * torch.ones(CLASSES)).to_event(1))


@pytest.mark.slow
def test_model_and_guide_that_read_the_labels():
    net = pyro2pfp.convert(classifier, guide, example_args=(X, Y), calibration=0.0)
    assert net.input_shape == (D_IN,)
    x = torch.randn(4, D_IN)
    np.testing.assert_allclose(net.reference(x.numpy())[0], (x @ W_LOC + B_LOC).double().numpy(), rtol=1e-5,
                               atol=1e-6)


def test_labels_and_options_as_keyword_arguments():
    def model(X, *, labels, scale):
        classifier(X, labels)

    def kw_guide(X, *, labels, scale):
        guide(X, labels, scale=scale)

    net = pyro2pfp.convert(model, kw_guide, example_args=(X.numpy(),), example_kwargs={"labels": Y, "scale": 0.2})
    w = net.layer_graph.layers[0].params
    assert any(np.allclose(p.var, 0.04) for p in w.values())


def test_a_regression_that_needs_its_targets_gets_its_noise_model():
    def model(X, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(1, D_IN), 1.0).to_event(2))
        sigma = pyro.sample("sigma", dist.LogNormal(0.0, 1.0))
        with pyro.plate("data", y.shape[0]):
            pyro.sample("obs", dist.Normal(torch.nn.functional.linear(X, w), sigma).to_event(1), obs=y)

    def reg_guide(X, y):
        y.shape  # noqa: B018 -- reads the targets
        pyro.sample("w", dist.Normal(torch.zeros(1, D_IN), 0.1 * torch.ones(1, D_IN)).to_event(2))
        pyro.sample("sigma", dist.Delta(torch.tensor(0.5)))

    net = pyro2pfp.convert(model, reg_guide, example_args=(X, torch.randn(8, 1)))
    assert isinstance(net.noise, NoiseModel)
    np.testing.assert_allclose(net.noise.expected_variance, 0.25, rtol=1e-6)
