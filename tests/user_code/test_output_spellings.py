"""The network's output is found by meaning: every spelling of a normalisation of the logits after the
last layer (softmax, log_softmax, exp of log_softmax, log of softmax, sigmoid, logsigmoid, a constant
scaling after them, reshapes) is stripped with one warning naming it, and a model that returns
nothing (or its likelihood's sample) has the output its likelihood is built from.

Checked exactly: at calibration 0 the PFP mean is the network at the posterior means, so it must equal
the logits the model computes there."""
from __future__ import annotations

import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from pyro import poutine
from pyro.infer import autoguide
from pyro.nn import PyroModule, PyroSample

import pyro2pfp

D_IN, HIDDEN, CLASSES, T = 6, 5, 3, 2.5

# spelling -> (the model's return value from the logits z, the warning it gives (None: no warning),
#              the logits PFP outputs (a temperature inside the normalisation belongs to them))
SPELLINGS = {
    "softmax": (lambda z: F.softmax(z, -1), r"final softmax is stripped", None),
    "log_softmax": (lambda z: F.log_softmax(z, dim=-1), r"final log_softmax is stripped", None),
    "exp of log_softmax": (lambda z: F.log_softmax(z, -1).exp(), r"final log_softmax → exp is stripped", None),
    "log of softmax": (lambda z: torch.softmax(z, -1).log(), r"final softmax → log is stripped", None),
    "nn.Softmax module": (lambda z: nn.Softmax(dim=1)(z), r"final softmax is stripped", None),
    "softmax of z / T": (lambda z: F.softmax(z / T, -1), r"final softmax is stripped", lambda z: z / T),
    "log_softmax of T * z": (lambda z: F.log_softmax(T * z, -1), r"final log_softmax is stripped", lambda z: T * z),
    "percent": (lambda z: 100.0 * F.softmax(z, -1), r"final softmax → × constant is stripped", None),
    "softmax then reshape": (lambda z: F.softmax(z, -1).reshape(-1, CLASSES), r"final softmax is stripped", None),
    "exp of log_softmax, viewed": (lambda z: F.log_softmax(z, -1).view(z.shape[0], -1).exp(),
                                   r"final log_softmax → exp is stripped", None),
    "logits": (lambda z: z, None, None),
    "None (Categorical logits)": (lambda z: None, None, None),
}


class Classifier(PyroModule):
    def __init__(self, spelling, classes=CLASSES, likelihood="logits"):
        super().__init__()
        self.spelling, self.likelihood = spelling, likelihood
        self.fc1 = PyroModule[nn.Linear](D_IN, HIDDEN)
        self.fc2 = PyroModule[nn.Linear](HIDDEN, classes)
        for layer in (self.fc1, self.fc2):
            layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand(layer.weight.shape).to_event(2))
            layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand(layer.bias.shape).to_event(1))

    def logits(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))

    def forward(self, x, y=None):
        z = self.logits(x)
        out = self.spelling(z)
        with pyro.plate("data", x.shape[0]):
            if self.likelihood == "logits":
                obs = pyro.sample("obs", dist.Categorical(logits=z), obs=y)
            elif self.likelihood == "probs":
                obs = pyro.sample("obs", dist.Categorical(probs=F.softmax(z, -1)), obs=y)
            else:  # one logit: Bernoulli
                obs = pyro.sample("obs", dist.Bernoulli(probs=torch.sigmoid(z)).to_event(1), obs=y)
        return obs if out == "sample" else out


def converted(model, y_example):
    pyro.clear_param_store()
    guide = autoguide.AutoNormal(model, init_scale=0.1)
    x = torch.randn(4, D_IN, generator=torch.Generator().manual_seed(0))
    guide(x, y_example)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net = pyro2pfp.convert(model, guide, calibration=0.0)
    stripped = [str(w.message) for w in caught if "stripped" in str(w.message)]
    return net, guide, stripped


def expected_logits(model, guide, x, transform=None):
    with torch.no_grad(), poutine.condition(data=guide.median()):
        z = model.logits(x)
    return (transform(z) if transform else z).double().numpy()


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_every_spelling_of_the_output_normalisation(spelling):
    returns, warning, logits = SPELLINGS[spelling]
    model = Classifier(returns)
    net, guide, stripped = converted(model, torch.zeros(4, dtype=torch.long))
    if warning is None:
        assert stripped == []
    else:
        assert len(stripped) == 1 and __import__("re").search(warning, stripped[0]), stripped
        assert "test_output_spellings.py" in stripped[0]  # where the user wrote it
    x = torch.randn(7, D_IN, generator=torch.Generator().manual_seed(1))
    mean, var = net.reference(x.numpy())
    np.testing.assert_allclose(mean, expected_logits(model, guide, x, logits), rtol=1e-5, atol=1e-6)
    assert np.all(var < 1e-12)


@pytest.mark.parametrize("returns,likelihood,classes,warning", [
    ("sample", "logits", CLASSES, None),             # returns the likelihood's sample
    (None, "probs", CLASSES, r"final softmax is stripped"),   # Categorical(probs=softmax(z)), returns None
    ("sample", "bernoulli", 1, r"final sigmoid is stripped"),  # Bernoulli(probs=sigmoid(z))
])
def test_the_output_is_what_the_likelihood_is_built_from(returns, likelihood, classes, warning):
    model = Classifier(lambda z: returns, classes=classes, likelihood=likelihood)
    y = torch.zeros(4, 1) if likelihood == "bernoulli" else torch.zeros(4, dtype=torch.long)
    net, guide, stripped = converted(model, y)
    assert len(stripped) == (warning is not None)
    x = torch.randn(7, D_IN, generator=torch.Generator().manual_seed(1))
    np.testing.assert_allclose(net.reference(x.numpy())[0], expected_logits(model, guide, x), rtol=1e-5, atol=1e-6)


def test_a_logsigmoid_output_of_one_logit_is_stripped():
    model = Classifier(F.logsigmoid, classes=1, likelihood="bernoulli")
    net, guide, stripped = converted(model, torch.zeros(4, 1))
    assert len(stripped) == 1 and "final log_sigmoid is stripped" in stripped[0]
    x = torch.randn(7, D_IN, generator=torch.Generator().manual_seed(1))
    np.testing.assert_allclose(net.reference(x.numpy())[0], expected_logits(model, guide, x), rtol=1e-5, atol=1e-6)


def test_functional_model_returning_none_is_read_from_its_likelihood():
    """``softmax(X.mm(W) + b)`` with sample sites W, b into a Categorical, and no return value."""

    def model(X, cll=None):
        W = pyro.sample("W", dist.Normal(torch.zeros(D_IN, CLASSES), 1.0).to_event(2))
        b = pyro.sample("b", dist.Normal(torch.zeros(CLASSES), 1.0).to_event(1))
        probs = F.softmax(X.mm(W) + b, dim=-1)
        with pyro.plate("data", X.shape[0]):
            pyro.sample("obs", dist.Categorical(probs=probs), obs=cll)

    w_loc, b_loc = torch.randn(D_IN, CLASSES), torch.randn(CLASSES)

    def guide(X, cll=None):
        pyro.sample("W", dist.Normal(w_loc, 0.1 * torch.ones(D_IN, CLASSES)).to_event(2))
        pyro.sample("b", dist.Normal(b_loc, 0.1 * torch.ones(CLASSES)).to_event(1))

    with pytest.warns(UserWarning, match="final softmax is stripped"):
        net = pyro2pfp.convert(model, guide, input_shape=(D_IN,), calibration=0.0)
    x = torch.randn(5, D_IN)
    np.testing.assert_allclose(net.reference(x.numpy())[0], (x @ w_loc + b_loc).double().numpy(), rtol=1e-5,
                               atol=1e-6)


class SoftmaxInside(Classifier):
    def logits(self, x):
        return self.fc2(F.softmax(self.fc1(x), -1))


def test_a_softmax_inside_the_network_names_its_use_and_the_fix():
    model = SoftmaxInside(lambda z: z)
    with pytest.raises(pyro2pfp.UnsupportedLayerError, match=r"softmax inside the network.*feeds.*move the softmax"):
        converted(model, torch.zeros(4, dtype=torch.long))


def test_a_softmax_over_the_batch_is_not_taken_for_a_normalisation():
    model = Classifier(lambda z: F.softmax(z, dim=0))
    with pytest.raises(pyro2pfp.UnsupportedLayerError, match=r"softmax over dimension 0, not the last"):
        converted(model, torch.zeros(4, dtype=torch.long))
