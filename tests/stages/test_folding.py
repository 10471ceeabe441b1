"""Batch norm folded into the layer before it (pyro2pfp.planning.folding) is exact: the folded network computes
the unfolded one's (mean, variance) in the float64 reference to rounding, in every plan, with input
variance and with a calibration factor; the compiled folded network matches its reference.  Only
batch norms that follow a dense/conv layer feeding nothing else are folded."""
from __future__ import annotations

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn as nn
from pyro.nn import PyroSample

import pyro2pfp
from pyro2pfp_experiments.zoo import bayesian_resnet, he_posterior
from tests.support.builders import ResidualNet


def residual_model(conv_bias: bool = True):
    torch.manual_seed(0)
    body = ResidualNet()
    if not conv_bias:
        body.conv.bias = None
    with torch.no_grad():
        body.bn.running_mean.uniform_(-0.5, 0.5)
        body.bn.running_var.uniform_(0.5, 2.0)
        body.bn.weight.uniform_(-2.0, 2.0)  # negative γ too
        body.bn.bias.uniform_(-1.0, 1.0)
    body.eval()
    pyro.nn.module.to_pyro_module_(body)
    shapes = {"conv.weight": (4, 3, 3, 3), "conv2.weight": (4, 4, 3, 3), "fc.weight": (5, 4)}
    if conv_bias:
        shapes["conv.bias"] = (4,)
    for site, shape in shapes.items():
        module, attr = site.split(".")
        setattr(body.get_submodule(module), attr, PyroSample(dist.Normal(0.0, 1.0).expand(shape).to_event(len(shape))))
    g = torch.Generator().manual_seed(1)
    locs = {n: 0.3 * torch.randn(s, generator=g) for n, s in shapes.items()}
    scales = {n: 0.02 + 0.1 * torch.rand(s, generator=g) for n, s in shapes.items()}

    def guide(x, y=None):
        for n in locs:
            pyro.sample(n, dist.Normal(locs[n], scales[n]).to_event(locs[n].dim()))

    return body, guide


def rel_diff(a, b):
    return np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-300))


@pytest.mark.slow
@pytest.mark.parametrize("form", ["variance", "raw"])
@pytest.mark.parametrize("conv_bias", [True, False])
def test_folded_equals_unfolded_in_the_reference(form, conv_bias):
    body, guide = residual_model(conv_bias)
    kw = dict(input_shape=(3, 9, 9), moment_form=form, calibration=0.4, input_variance=True)
    folded = pyro2pfp.convert(body, guide, **kw)
    unfolded = pyro2pfp.convert(body, guide, fold_batch_norm=False, **kw)
    assert "affine" in {p.op for p in unfolded.plan.layers}
    assert "affine" not in {p.op for p in folded.plan.layers}
    assert len(folded.plan.layers) == len(unfolded.plan.layers) - 1
    conv = folded.layer_graph.layer("conv")  # the folded conv keeps its name, now computes the batch norm's output
    assert conv.op == "conv2d" and "bias" in conv.params and conv.params["weight"].site == "conv.weight"
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 9, 9))
    for xv in (np.zeros_like(x), rng.uniform(0, 0.05, x.shape)):
        (fm, fv), (um, uv) = folded.reference(x, xv), unfolded.reference(x, xv)
        assert rel_diff(fm, um) < 1e-12 and rel_diff(fv, uv) < 1e-12
    exe = folded.compile()
    mean, var = exe(x.astype(np.float32), xv.astype(np.float32))
    np.testing.assert_allclose(mean, fm, rtol=1e-4, atol=1e-4 * np.abs(fm).max())
    np.testing.assert_allclose(var, fv, rtol=1e-3, atol=1e-4 * np.abs(fv).max())


@pytest.mark.slow
def test_resnet_batch_norms_all_fold_and_agree():
    model = bayesian_resnet(blocks=1, widths=(8, 16))
    x = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    guide = he_posterior(model, x)
    folded = pyro2pfp.convert(model, guide, input_shape=(3, 16, 16))
    unfolded = pyro2pfp.convert(model, guide, input_shape=(3, 16, 16), fold_batch_norm=False)
    n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert sum(p.op == "affine" for p in unfolded.plan.layers) == n_bn
    assert sum(p.op == "affine" for p in folded.plan.layers) == 0
    (fm, fv), (um, uv) = folded.reference(x.numpy()), unfolded.reference(x.numpy())
    assert rel_diff(fm, um) < 1e-11 and rel_diff(fv, uv) < 1e-11


def test_a_batch_norm_whose_conv_output_is_used_twice_is_not_folded():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 3, padding=1)
            self.bn = nn.BatchNorm2d(2)
            self.fc = nn.Linear(2 * 5 * 5, 3)

        def forward(self, x, y=None):
            h = self.conv(x)
            return self.fc(torch.flatten(self.bn(h) + h, 1))  # conv output feeds bn and the add

    body = Twice().eval()
    pyro.nn.module.to_pyro_module_(body)
    body.conv.weight = PyroSample(dist.Normal(0.0, 1.0).expand([2, 2, 3, 3]).to_event(4))
    loc = 0.3 * torch.randn(2, 2, 3, 3)

    def guide(x, y=None):
        pyro.sample("conv.weight", dist.Normal(loc, 0.05).to_event(4))

    # bn(h) + h adds two copies of one noise, which both schemes take as independent: about half the sampled
    # variance, which the spot check every convert runs refuses; the plan's structure is what this test checks
    with pytest.raises(pyro2pfp.FidelityError, match="grossly unlike sampling the trained model"):
        pyro2pfp.convert(body, guide, input_shape=(2, 5, 5))
    net = pyro2pfp.convert(body, guide, input_shape=(2, 5, 5), check=False)
    assert [p.op for p in net.layer_graph.layers][:3] == ["conv2d", "affine", "add"]


def test_fold_batch_norm_must_be_a_bool():
    body, guide = residual_model()
    with pytest.raises(pyro2pfp.ArgumentError, match="fold_batch_norm"):
        pyro2pfp.convert(body, guide, input_shape=(3, 9, 9), fold_batch_norm="yes")
