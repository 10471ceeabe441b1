"""How models attach weights and likelihoods, as public code writes it: a weight used transposed, scaled or
broadcast over the batch converts (it is a weight's shape, not a layer); a sample expanded into copies (which
share one random value) or put through a function is refused naming the line; an unsupported op names the
user's file, line and source text; a likelihood with declared event dimensions inside the data plate, a model
holding its guide inside a container, convert.  Untrained guides with random means (no SVI): fast."""
from __future__ import annotations

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroSample

import pyro2pfp
from tests.support import forward_forms

D_IN, HIDDEN, CLASSES = 5, 7, 3


def _guide(model, x, scale=0.2):
    guide = AutoNormal(model, init_loc_fn=lambda site: torch.randn(site["fn"].shape()), init_scale=scale)
    guide(x, torch.zeros(len(x), dtype=torch.long))
    return guide


def one_layer(attach: str):
    """``logits`` from a sampled weight ``w`` (CLASSES, D_IN) and bias ``b`` attached as ``attach`` says."""

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(CLASSES, D_IN), 1.0).to_event(2))
        b = pyro.sample("b", dist.Normal(torch.zeros(CLASSES), 1.0).to_event(1))
        if attach == "transposed":
            logits = x @ w.T + b.expand(x.shape[0], -1)
        elif attach == "scaled":
            logits = F.linear(x, 2.0 * w, b / 4)
        else:  # a permuted view of the weight
            logits = torch.matmul(x, w.permute(1, 0)) + b.unsqueeze(0)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits

    return model


@pytest.mark.parametrize("attach,scale_w,scale_b", [("transposed", 1.0, 1.0), ("scaled", 2.0, 0.25),
                                                    ("permuted", 1.0, 1.0)])
def test_weights_attached_as_expressions_convert_exactly(attach, scale_w, scale_b):
    """One layer on a deterministic input: PFP's logit moments are exact, so they equal the guide's
    posterior pushed through the expression in closed form."""
    model = one_layer(attach)
    x = torch.randn(4, D_IN)
    guide = _guide(model, x)
    net = pyro2pfp.convert(model, guide, input_shape=(D_IN,))
    w_loc, w_scale = (t.detach().double() for t in guide._get_loc_and_scale("w"))
    b_loc, b_scale = (t.detach().double() for t in guide._get_loc_and_scale("b"))
    xd = x.double()
    mean = scale_w * xd @ w_loc.T + scale_b * b_loc
    var = scale_w**2 * (xd**2) @ (w_scale**2).T + scale_b**2 * b_scale**2
    got_mean, got_var = net.reference(x.numpy())
    np.testing.assert_allclose(got_mean, mean.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_var, var.numpy(), rtol=1e-5)


def test_an_expanded_sample_is_refused_naming_the_line():
    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(1, D_IN), 1.0).to_event(2))
        logits = F.linear(x, w.expand(CLASSES, D_IN))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits

    guide = _guide(model, torch.randn(2, D_IN))
    match = (r"sample site 'w' \(shape \(1, 5\)\) is expanded to \(3, 5\) \(\S*test_attach_forms\.py:\d+ "
             r"\(`logits = F\.linear\(x, w\.expand\(CLASSES, D_IN\)\)`\)\): its copies share one random value.*"
             r"Sample the weight at the shape the layer uses")
    with pytest.raises(pyro2pfp.UnsupportedLayerError, match=match):
        pyro2pfp.convert(model, guide, input_shape=(D_IN,))


class CumulativeNet(PyroModule):
    def __init__(self):
        super().__init__()
        self.fc = PyroModule[nn.Linear](D_IN, CLASSES)
        self.fc.weight = PyroSample(dist.Normal(0.0, 1.0).expand([CLASSES, D_IN]).to_event(2))

    def forward(self, x, y=None):
        h = self.fc(x)
        h = torch.cumsum(h, -1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=h), obs=y)
        return h


def test_an_unsupported_op_names_the_users_line():
    model = CumulativeNet()
    guide = _guide(model, torch.randn(2, D_IN))
    with pytest.raises(pyro2pfp.UnsupportedLayerError,
                       match=r"CumulativeNet\.forward \(aten\.cumsum\) at \S*test_attach_forms\.py:\d+ "
                             r"\(`h = torch\.cumsum\(h, -1\)`\) is not supported by PFP"):
        pyro2pfp.convert(model, guide)


def test_a_likelihood_with_event_dims_inside_the_data_plate_converts():
    """The packaged classifier's methods (tests/support/forward_forms.py): samples assigned to the layers of a
    PyroModule[nn.Sequential], the layers run inside the data plate, Categorical(logits=out).to_event(1),
    which the plate broadcasts to (batch, batch, classes): the network's output is ``out``."""
    bnn = forward_forms.PackagedBNN()
    x = torch.randn(4, forward_forms.D_IN)
    bnn.guide(x)
    net = pyro2pfp.convert(bnn.model, bnn.guide, input_shape=(forward_forms.D_IN,))
    assert [layer.op for layer in net.plan.layers] == ["dense", "relu", "dense"]
    bnn.eval()
    with torch.no_grad():
        logits = forward_forms._packaged_logits(bnn, x, 400).double().numpy()
    mean, var = net.reference(x.numpy())
    se = np.sqrt(logits.var(0, ddof=1) / 400)
    assert np.max(np.abs(mean - logits.mean(0)) / se) < 5
    assert 0.8 < np.median(var / logits.var(0, ddof=1)) < 1.25


@pytest.mark.parametrize("cnn", [False, True])
def test_a_container_holding_model_and_guide_converts(cnn):
    """``pyro.module("model", self.model)`` on a to_pyro_module_ net returning ``logits.exp()``, inside a container
    (a plain nn.Module) that also holds the guide: it used to end in an InternalError while tracing."""
    container, bnn = forward_forms._module_exp(cnn)
    x = torch.randn(4, forward_forms.D_IN)
    bnn.guide(x, torch.zeros(4, dtype=torch.long))
    container.eval()
    with pytest.warns(UserWarning, match="final log_softmax → exp is stripped"):
        net = pyro2pfp.convert(container, container.guide, input_shape=(forward_forms.D_IN,))
    assert net.plan.layers[-1].op == "dense" and net.fidelity.passed
