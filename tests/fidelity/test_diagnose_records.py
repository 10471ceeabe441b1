"""``diagnose`` records what each layer produced: an in-place op after a layer (``h += x``, a torchvision
BasicBlock's ``out += identity`` and ``ReLU(inplace=True)``) must not rewrite the layer's recorded
output; layers that sampling leaves deterministic, and compute layers with deterministic weights, are
described as such."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn as nn
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroSample

import pyro2pfp


def _bayesian(module: nn.Module) -> None:
    """Normal(0, 1) sample sites for the weight and bias of ``module`` (a PyroModule)."""
    for name, p in list(module.named_parameters(recurse=False)):
        setattr(module, name, PyroSample(dist.Normal(0.0, 1.0).expand(p.shape).to_event(p.dim())))


class TwoLinear(PyroModule):
    """``h = fc1(x)``, then ``h += x`` or ``h = h + x``, ReLU, ``fc2``."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.inplace = inplace
        self.fc1 = PyroModule[nn.Linear](6, 6)
        self.fc2 = PyroModule[nn.Linear](6, 3)
        _bayesian(self.fc1)
        _bayesian(self.fc2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.inplace:
            h += x
        else:
            h = h + x
        return self.fc2(torch.relu(h))


def _diagnosis(model: PyroModule, x: torch.Tensor, **kwargs):
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    guide = AutoNormal(model, init_scale=0.3)
    guide(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pyro2pfp.diagnose(model, guide, x.numpy(), num_samples=200, **kwargs)


def _same_rows(a, b) -> None:
    assert [r.op for r in a.layers] == [r.op for r in b.layers]
    for ra, rb in zip(a.layers, b.layers, strict=True):
        for field in ("mean_error", "mean_error_p90", "ratio_median", "ratio_p10", "ratio_p90"):
            x, y = getattr(ra, field), getattr(rb, field)
            assert (math.isnan(x) and math.isnan(y)) or math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12), (ra, rb)


def test_an_inplace_add_does_not_rewrite_the_layer_before_it():
    """``h += x`` and ``h = h + x`` give the same rows (the same samples); fc1's mean error is at the
    noise floor (it was the add's output minus the input's, ~1 sd, when the record was not a copy)."""
    x = torch.randn(8, 6)
    inplace, plain = _diagnosis(TwoLinear(True), x), _diagnosis(TwoLinear(False), x)
    _same_rows(inplace, plain)
    fc1 = inplace.layers[0]
    assert fc1.name == "fc1" and fc1.mean_error < 0.2, fc1
    assert 0.8 < fc1.ratio_median < 1.25, fc1


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: ``out += identity`` and ``ReLU(inplace=True)``."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class PlainBlock(BasicBlock):
    """The same block written without in-place ops."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + x)


class SmallResNet(PyroModule):
    """A deterministic stem conv (plain parameters), one residual block with Bayesian convs, a
    deterministic 1×1 conv, global average pooling and a Bayesian Linear."""

    def __init__(self, block: type) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(2, 4, 3, padding=1)
        self.block = block(4)
        self.mix = nn.Conv2d(4, 4, 1)
        self.fc = nn.Linear(4, 3)
        pyro.nn.module.to_pyro_module_(self)
        for module in (self.block.conv1, self.block.conv2, self.fc):
            _bayesian(module)
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mix(self.block(self.stem(x)))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(h, 1), 1))


@pytest.mark.slow
def test_a_resnet_block_with_inplace_ops_is_recorded_as_computed():
    """The torchvision block (``out += identity``, in-place ReLUs) gives the rows of the same block
    written without in-place ops; every conv's mean error is at the noise floor.  The stem, which
    sampling leaves deterministic, is described as such (not NaN), and the deterministic 1×1 conv on a
    random input is planned with "deterministic weights"."""
    x = torch.randn(3, 2, 6, 6)
    inplace = _diagnosis(SmallResNet(BasicBlock), x, correlation="mean-field")
    plain = _diagnosis(SmallResNet(PlainBlock), x, correlation="mean-field")
    _same_rows(inplace, plain)
    rows = {r.name: r for r in inplace.layers}
    for name, row in rows.items():
        if row.op == "conv2d" and not row.deterministic:
            assert row.mean_error < 0.2, (name, row)
    stem = rows["stem"]
    assert stem.deterministic and math.isnan(stem.mean_error)
    assert stem.deterministic_pfp_var == 0.0 and stem.deterministic_mean_error < 1e-4
    table = inplace.table()
    stem_line = next(line for line in table.splitlines() if line.startswith("stem "))
    assert "deterministic (as sampled)" in stem_line and "nan" not in stem_line
    pyro.set_rng_seed(0)
    model = SmallResNet(BasicBlock)
    guide = AutoNormal(model, init_scale=0.3)
    guide(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        summary = pyro2pfp.convert(model, guide, input_shape=(2, 6, 6), correlation="mean-field").plan.summary()
    lines = {line.split()[0]: line for line in summary.splitlines()[2:] if line.strip()}
    assert "deterministic weights" in lines["mix"] and "weight variances" not in lines["mix"]
    assert "weight variances" in lines["fc"]
    assert np.all(np.isfinite([r.mean_error for r in inplace.layers if not r.deterministic]))
