"""The ``scale`` op (``x * c``, ``x / c``, ``-x``): an activation added through the op registry with one
declaration in ``pyro2pfp/ops/activation.py`` (its reference, ONNX export and TVM kernel are the generic
ones).  Exact moments: ``μ ↦ c·μ``, ``v ↦ c²·v``."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pyro
import pytest
import torch
import torch.nn as nn
from pyro.infer import autoguide
from pyro.nn import PyroModule

import pyro2pfp
from pyro2pfp.network import PFPNetwork
from pyro2pfp.planning.graph import INPUT, Layer, LayerGraph
from pyro2pfp.planning.plan import plan
from tests.support.op_coverage import COMPILED, MONTE_CARLO, covers
from tests.user_code.test_styles import CLASSES, D_IN, HIDDEN, assert_exact_against_sampling, fit, likelihood, prior


def scale_net(factor: float, n: int = 7, input_variance: bool = True) -> PFPNetwork:
    graph = LayerGraph((n,), [Layer("s", "scale", [INPUT], (n,), "t", {"factor": factor})], "s",
                       input_variance=input_variance)
    return PFPNetwork(graph, plan(graph))


@covers("scale", kind=MONTE_CARLO)
@pytest.mark.parametrize("factor", [-3.0, 0.5, 1e-3])
def test_scale_moments_match_sampling(factor):
    rng = np.random.default_rng(0)
    mean, var = rng.normal(0, 2, (1, 7)), rng.uniform(0, 3, (1, 7))
    n = 200_000
    draws = factor * (mean + np.sqrt(var) * rng.standard_normal((n, 7)))
    m, v = scale_net(factor).reference(mean, var)
    sd = np.sqrt(var) * abs(factor)
    assert np.all(np.abs(m - draws.mean(0)) < 5 * sd / np.sqrt(n) + 1e-300)
    assert np.all(np.abs(v - draws.var(0)) < 5 * sd**2 * np.sqrt(2 / n))


@covers("scale", kind=COMPILED)
@pytest.mark.parametrize("input_variance", [True, False])
def test_scale_compiled_and_onnx_match_the_reference(input_variance):
    net = scale_net(-0.25, input_variance=input_variance)
    rng = np.random.default_rng(1)
    x = rng.normal(0, 100, (5, 7)).astype(np.float32)
    args = (x, rng.uniform(0, 10, x.shape).astype(np.float32)) if input_variance else (x,)
    ref = net.reference(*args)
    for out in (net.compile()(*args),
                ort.InferenceSession(net.to_onnx().SerializeToString()).run(
                    None, dict(zip(("x", "x_var"), args)))):
        np.testing.assert_allclose(out[0], ref[0], rtol=1e-6)
        np.testing.assert_allclose(out[1], ref[1], rtol=1e-6)


class TemperatureMLP(PyroModule):
    def __init__(self):
        super().__init__()
        self.fc1 = PyroModule[nn.Linear](D_IN, HIDDEN)
        self.fc2 = PyroModule[nn.Linear](HIDDEN, CLASSES)
        for layer in (self.fc1, self.fc2):
            layer.weight = prior(layer.weight.shape)
            layer.bias = prior(layer.bias.shape)

    def forward(self, x, y=None):
        h = torch.relu(self.fc1(-x * 0.5))  # -x and x * c before the first layer
        return likelihood(self.fc2(h) / 2.0, y)  # a temperature on the logits


@pytest.mark.slow
def test_constant_scalings_convert_and_agree_with_predictive():
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = TemperatureMLP()
    guide = autoguide.AutoNormal(model)
    fit(model, guide)
    net = pyro2pfp.convert(model, guide)
    factors = [p.layer.attrs["factor"] for p in net.plan.layers if p.op == "scale"]
    assert factors == [-1.0, 0.5, 0.5]
    assert_exact_against_sampling(model, guide, net)


def test_a_product_of_two_activations_is_refused():
    class Square(PyroModule):
        def __init__(self):
            super().__init__()
            self.fc = PyroModule[nn.Linear](D_IN, CLASSES)
            self.fc.weight = prior((CLASSES, D_IN))

        def forward(self, x, y=None):
            h = self.fc(x)
            return likelihood(h * h, y)

    pyro.clear_param_store()
    model = Square()
    guide = autoguide.AutoNormal(model)
    fit(model, guide, steps=1)
    with pytest.raises(pyro2pfp.UnsupportedLayerError, match="constant number"):
        pyro2pfp.convert(model, guide)
