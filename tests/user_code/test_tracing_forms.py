"""The code people write in ``forward`` either traces or stops naming the user's line and the fix:
device moves (``self.to(device)``, ``x.to(device)``, ``.cpu()``) give the network of the same model
without them (written with ``view(-1, n)``); the Pyro modules tutorial's ``pyro.plate("instances",
len(input))`` converts (the fixed batch size only sizes the likelihood's plate); an unguarded ``.cuda()`` on
a machine without CUDA and a module whose Pyro model is a method stop with the line or the call to change."""
from __future__ import annotations

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

import pyro2pfp

pytestmark = pytest.mark.slow  # trains, converts or starts processes

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FORMS = ("view", "self.to", "x.to", "cpu")  # x.size(0), x.shape[0], torch.flatten and a guarded .cuda() traced before


class SmallCNN(PyroModule):
    """conv → relu → max-pool → (a view written one of several ways) → linear; ``form`` picks how
    forward moves and views."""

    def __init__(self) -> None:
        super().__init__()
        self.form = "view"
        self.conv = PyroModule[nn.Conv2d](1, 3, 3, padding=1)
        self.conv.weight = PyroSample(dist.Normal(0.0, 1.0).expand([3, 1, 3, 3]).to_event(4))
        self.conv.bias = PyroSample(dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        self.fc = PyroModule[nn.Linear](3 * 2 * 2, 2)
        self.fc.weight = PyroSample(dist.Normal(0.0, 1.0).expand([2, 12]).to_event(2))
        self.fc.bias = PyroSample(dist.Normal(0.0, 1.0).expand([2]).to_event(1))

    def forward(self, x, y=None):
        form = self.form
        if form == "self.to":
            self.to(device)
        elif form == "x.to":
            x = x.to(device)
        elif form == "cpu":
            x = x.cpu()
        elif form == "guarded-cuda" and torch.cuda.is_available():
            x = x.cuda()
        elif form == "unguarded-cuda":
            x = x.cuda()
        h = F.max_pool2d(F.relu(self.conv(x)), 2)
        if form == "size0":
            h = h.view(h.size(0), -1)
        elif form == "shape0":
            h = h.reshape(h.shape[0], -1)
        elif form == "flatten":
            h = torch.flatten(h, 1)
        else:
            h = h.view(-1, 12)
        logits = self.fc(h)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


@pytest.fixture(scope="module")
def trained_cnn():
    pyro.clear_param_store()
    model = SmallCNN()
    guide = AutoNormal(model)
    x = torch.randn(8, 1, 4, 4)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
    for _ in range(5):
        svi.step(x, (x.mean((1, 2, 3)) > 0).long())
    state = pyro.get_param_store().get_state()
    return model, guide, x.numpy(), state


@pytest.fixture(scope="module")
def plain_answer(trained_cnn):
    model, guide, x, state = trained_cnn
    pyro.get_param_store().set_state(state)
    return pyro2pfp.convert(model, guide, input_shape=(1, 4, 4)).reference(x)


@pytest.mark.parametrize("form", [f for f in FORMS if f != "view"])
def test_device_moves_and_views_trace(form, trained_cnn, plain_answer):
    model, guide, x, state = trained_cnn
    pyro.get_param_store().set_state(state)
    plain = plain_answer
    model.form = form
    try:
        moved = pyro2pfp.convert(model, guide, input_shape=(1, 4, 4)).reference(x)
    finally:
        model.form = "view"
    np.testing.assert_allclose(moved[0], plain[0], rtol=1e-12)
    np.testing.assert_allclose(moved[1], plain[1], rtol=1e-12)


def test_unguarded_cuda_names_the_line(trained_cnn):
    if torch.cuda.is_available():
        pytest.fail("this test needs a machine without CUDA")  # the CI machines have none
    model, guide, _, state = trained_cnn
    pyro.get_param_store().set_state(state)
    model.form = "unguarded-cuda"
    try:
        with pytest.raises(pyro2pfp.TracingError) as info:
            pyro2pfp.convert(model, guide, input_shape=(1, 4, 4))
    finally:
        model.form = "view"
    message = str(info.value)
    assert "test_tracing_forms.py:" in message and "x = x.cuda()" in message
    assert "torch.cuda.is_available()" in message


class TutorialLinear(PyroModule):
    """Pyro's modules tutorial, as written there."""

    def __init__(self, in_size, out_size):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(in_size, out_size))
        self.bias = nn.Parameter(torch.randn(out_size))

    def forward(self, input_):
        return self.bias + input_ @ self.weight


class TutorialModel(PyroModule):
    def __init__(self, in_size, out_size):
        super().__init__()
        self.linear = TutorialLinear(in_size, out_size)
        self.obs_scale = PyroSample(dist.LogNormal(0, 1))

    def forward(self, input, output=None):
        obs_loc = self.linear(input)
        obs_scale = self.obs_scale
        with pyro.plate("instances", len(input)):
            return pyro.sample("obs", dist.Normal(obs_loc, obs_scale).to_event(1), obs=output)


def test_modules_tutorial_len_plate_converts():
    """``len(input)`` turns the batch into an int ("Constraints violated (batch)" from torch), but only the
    likelihood's plate uses it: traced at two fixed batch sizes, the network is the same, and converts."""
    pyro.clear_param_store()
    model = TutorialModel(5, 2)
    model.linear.weight = PyroSample(dist.Normal(0, 1).expand([5, 2]).to_event(2))
    model.linear.bias = PyroSample(dist.Normal(0, 10).expand([2]).to_event(1))
    guide = AutoNormal(model)
    x = torch.randn(20, 5)
    SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO()).step(x, x[:, :2])
    net = pyro2pfp.convert(model, guide, input_shape=(5,))
    xs = torch.randn(7, 5)  # another batch size than the two it was traced at
    mean, var = net.reference(xs.numpy())
    draws = pyro.infer.Predictive(model, guide=guide, num_samples=4000,
                                  return_sites=("linear.weight", "linear.bias"))(x)
    loc = (xs @ draws["linear.weight"].reshape(-1, 5, 2) + draws["linear.bias"].reshape(-1, 1, 2)).double().numpy()
    se = np.sqrt(loc.var(0) / len(loc))
    assert np.all(np.abs(mean - loc.mean(0)) < 5 * se)  # one Linear layer: PFP's moments are exact
    assert np.all(np.abs(var / loc.var(0) - 1) < 5 * np.sqrt(2 / len(loc)))


class MethodsOnly(PyroModule):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def model(self, x, y=None):
        return self.fc(x)

    def guide(self, x, y=None):
        pass


def test_module_whose_model_is_a_method():
    bnn = MethodsOnly()
    with pytest.raises(pyro2pfp.TracingError, match=r"has no forward\(\) \(it has \.model\(\), \.guide\(\)\).*"
                                                    r"convert\(obj\.model, obj\.guide"):
        pyro2pfp.convert(bnn, bnn.guide, input_shape=(3,))
