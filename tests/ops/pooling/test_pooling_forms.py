"""Every pooling and padding form of the supported convolutions: 1-D layers anywhere in the net (run as
2-D ones with H = 1, ``pyro2pfp/planning/onedim.py``), asymmetric ``padding="same"`` and ``F.pad`` folded into
the conv (zero taps, ``ops/compute.py``), adaptive pools with the windows of a regular pool.

* Zero posterior variance (``calibration=0``): the converted network's mean is torch's own forward at
  the posterior mean, for nets that use every form, in the reference, the compiled module and ONNX.
* A Bayesian 1-D conv → BatchNorm1d → MaxPool1d(2) on a deterministic input: every moment is exact
  (Clark's max of two jointly Gaussian conv outputs with their covariance), checked against draws of the
  guide with the bound of ``tests/support/stats.py``; the same net compiled equals the reference.
* Forms that are not a regular pool, or padding that cannot be folded, and 3-D layers: errors naming
  the layer, the sizes and the remedy.
"""
from __future__ import annotations

import copy
import itertools
import warnings

import numpy as np
import onnxruntime as ort
import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pyro2pfp
from pyro2pfp.backends.onnx.builder import to_onnx
from pyro2pfp.backends.reference.arrays import conv2d_nchw
from pyro2pfp.ops.compute import _symmetric_padding
from pyro2pfp.ops.pooling import adaptive_window
from pyro2pfp.planning.graph import GaussianParam
from tests.support.builders import BayesianFirstLayer
from tests.support.stats import assert_check_rejects, assert_moments_agree


def _guide(site: str, shape: torch.Size, seed: int, scale: float = 0.1):
    gen = torch.Generator().manual_seed(seed)
    loc = 0.5 * torch.randn(shape, generator=gen)
    sd = scale * (0.5 + torch.rand(shape, generator=gen))

    def guide(x, y=None):
        pyro.sample(site, dist.Normal(loc, sd).to_event(len(shape)))

    return guide, loc, sd


class Forms1d(nn.Module):
    """Every 1-D form, and 1-D layers after other 1-D layers (not only before a flatten)."""

    def __init__(self):
        super().__init__()
        self.pad = nn.ConstantPad1d((1, 2), 0.0)
        self.c1 = nn.Conv1d(2, 4, 4, padding="same")  # even kernel: asymmetric, as torch pads it
        self.bn1 = nn.BatchNorm1d(4)
        self.pool1 = nn.MaxPool1d(3, stride=2, padding=1, ceil_mode=True)
        self.c2 = nn.Conv1d(4, 4, 2, padding="same", dilation=3)  # odd total 3, dilation 3
        self.bn2 = nn.BatchNorm1d(4)  # after an add: not folded, lifted
        self.pool2 = nn.AvgPool1d(3, stride=2, padding=1, count_include_pad=False)
        self.c3 = nn.Conv1d(4, 3, 3, stride=2, groups=1)
        self.amax = nn.AdaptiveMaxPool1d(2)
        self.aavg = nn.AdaptiveAvgPool1d(2)

    def forward(self, x):
        h = self.pool1(F.leaky_relu(self.bn1(self.c1(self.pad(x))), 0.1))
        h = self.pool2(torch.tanh(self.bn2(self.c2(h) + h)))  # a 1-D residual connection
        h = self.c3(F.pad(h, (0, 3)))
        return (self.amax(h) + self.aavg(h)).flatten(1)


class Forms2d(nn.Module):
    """2-D: asymmetric 'same' padding (a dilation that does not divide the difference too), ZeroPad2d
    folded into the conv, adaptive max/avg pools whose windows are regular without dividing the input
    (7 → 3 and 5 → 2: windows of 3 every 2)."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(2, 3, (2, 3), padding="same")
        self.c2 = nn.Conv2d(3, 3, (2, 2), padding="same", dilation=(3, 1))
        self.zp = nn.ZeroPad2d((1, 0, 2, 1))
        self.c3 = nn.Conv2d(3, 2, 3)
        self.amax = nn.AdaptiveMaxPool2d((3, 2))
        self.aavg = nn.AdaptiveAvgPool2d((3, 1))

    def forward(self, x):
        h = torch.relu(self.c2(torch.relu(self.c1(x))))
        return self.aavg(self.amax(self.c3(self.zp(h)))).flatten(1)


class GlobalPools(nn.Module):
    """Global pooling written as reductions: over L of (N, C, L), and over H×W of (N, C, H, W)."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(2, 3, 3)
        self.c2 = nn.Conv2d(3, 3, 2)

    def forward(self, x):
        h = torch.relu(self.c1(x))  # (N, 3, 10)
        g = h.mean(-1) + h.amax(-1) + h.max(dim=2).values + h.mean(2, keepdim=True).flatten(1)
        h2 = self.c2(h.view(-1, 3, 2, 5))  # (N, 3, 1, 4)
        return g + h2.amax((2, 3)) + torch.max(h2.flatten(2), -1, keepdim=True)[0].squeeze(-1)


def _converted(body_cls, first, shape, seed=0, calibration=0.0, correlation="mean-field"):
    torch.manual_seed(seed)
    body = body_cls()
    for m in body.modules():  # non-trivial running statistics
        if isinstance(m, nn.BatchNorm1d | nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
    body.eval()
    reference = copy.deepcopy(body)
    model = BayesianFirstLayer(body, first).eval()
    guide, loc, _ = _guide(f"body.{first}.weight", reference.get_submodule(first).weight.shape, seed)
    net = pyro2pfp.convert(model, guide, input_shape=shape, calibration=calibration, correlation=correlation)
    with torch.no_grad():
        reference.get_submodule(first).weight.copy_(loc)
    return net, reference


@pytest.fixture(scope="module")
def forms_1d():
    return _converted(Forms1d, "c1", (2, 23))


def test_1d_forms_match_torch_and_run_as_2d_layers(forms_1d):
    net, reference = forms_1d
    x = torch.randn(4, 2, 23, generator=torch.Generator().manual_seed(1))
    mean, var = net.reference(x)
    with torch.no_grad():
        expected = reference(x).double().numpy()
    np.testing.assert_allclose(mean, expected, rtol=1e-5, atol=1e-5)
    assert np.all(var == 0.0)
    ops = [layer.op for layer in net.layer_graph.layers]
    # one chain of 2-D layers: the input reshape, the output flatten, nothing between
    assert ops.count("reshape") == 2, ops
    assert ops.count("affine") == 1, ops  # bn1 folded into c1; bn2 (after the add) lifted to 2-D


@pytest.mark.slow
def test_1d_forms_onnx_equals_the_reference():
    net, _ = _converted(Forms1d, "c1", (2, 23), calibration=1.0)
    x = np.random.default_rng(2).normal(size=(3, 2, 23))
    rm, rv = net.reference(x)
    assert rv.max() > 0
    sess = ort.InferenceSession(to_onnx(net).SerializeToString(), providers=["CPUExecutionProvider"])
    om, ov = sess.run(None, {sess.get_inputs()[0].name: x.astype(np.float32)})
    np.testing.assert_allclose(om, rm, rtol=1e-4, atol=1e-5 * np.abs(rm).max())
    np.testing.assert_allclose(ov, rv, rtol=1e-4, atol=1e-5 * rv.max())


def test_2d_forms_match_torch():
    net, reference = _converted(Forms2d, "c1", (2, 6, 6))
    x = torch.randn(3, 2, 6, 6, generator=torch.Generator().manual_seed(3))
    mean, var = net.reference(x)
    with torch.no_grad():
        expected = reference(x).double().numpy()
    np.testing.assert_allclose(mean, expected, rtol=1e-5, atol=1e-5)
    assert np.all(var == 0.0)


def test_global_pooling_reductions_match_torch():
    net, reference = _converted(GlobalPools, "c1", (2, 12))
    x = torch.randn(3, 2, 12, generator=torch.Generator().manual_seed(9))
    mean, var = net.reference(x)
    with torch.no_grad():
        expected = reference(x).double().numpy()
    np.testing.assert_allclose(mean, expected, rtol=1e-5, atol=1e-5)
    assert np.all(var == 0.0)


def test_symmetric_padding_with_zero_taps_is_torch_asymmetric_padding():
    """The index arithmetic of the zero taps, against torch padding each side explicitly: every
    (kernel, dilation, begin, end, stride) of a small grid, both spatial axes."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(2, 2, 9, 10))
    for k, d, begin, end, s in itertools.product((1, 2, 4), (1, 3), (0, 1, 2), (0, 3), (1, 2)):
        w = rng.normal(size=(3, 2, k, k + 1))
        pads = [(begin, end), (end, begin)]
        param, padding, dilation = _symmetric_padding(GaussianParam(w, w * w), pads, [d, d])
        padded_x = F.pad(torch.as_tensor(x), (end, begin, begin, end))
        if min(padded_x.shape[2:]) < d * k + 1:  # the kernel does not fit (k + 1 taps along W)
            continue
        want = F.conv2d(padded_x, torch.as_tensor(w), stride=s, dilation=d).numpy()
        got = conv2d_nchw(x, param.mean, [s, s], padding, dilation, 1)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=str((k, d, begin, end, s)))
        assert padding[0] == padding[1] == max(begin, end)
        assert np.array_equal(param.var != 0, param.mean != 0)  # the zero taps carry no variance


def test_adaptive_windows_of_a_regular_pool():
    for size, out in itertools.product(range(1, 14), range(1, 8)):
        window = adaptive_window(size, out)
        x = torch.arange(float(size)).reshape(1, 1, size) ** 2
        want = F.adaptive_max_pool1d(x, out)
        if window is None:  # torch's windows differ in size or spacing, or repeat (output > input)
            starts = [i * size // out for i in range(out)]
            ends = [-(-(i + 1) * size // out) for i in range(out)]
            spacings = {b - a for a, b in zip(starts, starts[1:])}
            assert len({e - s for s, e in zip(starts, ends)}) > 1 or len(spacings) > 1 or min(spacings) < 1
            continue
        kernel, stride = window
        np.testing.assert_array_equal(F.max_pool1d(x, kernel, stride).numpy(), want.numpy())
        np.testing.assert_allclose(F.avg_pool1d(x, kernel, stride).numpy(), F.adaptive_avg_pool1d(x, out).numpy())


# ------------------------------------------------------------------------------- Monte Carlo
class Block1d(nn.Module):
    """Conv1d('same', even kernel) → BatchNorm1d → MaxPool1d(2): exact PFP moments (Clark's max of two
    jointly Gaussian conv outputs with their covariance; a ReLU before the pool would be applied to the
    non-Gaussian max, an approximation)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 4, padding="same")
        self.bn = nn.BatchNorm1d(3)
        self.pool = nn.MaxPool1d(2)

    def forward(self, x):
        return self.pool(self.bn(self.conv(x))).flatten(1)


@pytest.mark.slow
def test_bayesian_1d_block_matches_sampling_of_the_guide_compiled_too():
    torch.manual_seed(5)
    body = Block1d()
    body.bn.running_mean.uniform_(-0.5, 0.5)
    body.bn.running_var.uniform_(0.5, 2.0)
    body.eval()
    torch_body = copy.deepcopy(body)
    model = BayesianFirstLayer(body, "conv").eval()
    guide, loc, sd = _guide("body.conv.weight", torch_body.conv.weight.shape, 6, scale=0.4)
    net = pyro2pfp.convert(model, guide, input_shape=(2, 8), correlation="mean-field")
    assert any(layer.op == "window_cov" for layer in net.plan.layers)  # the correlated max-pool rule
    x = torch.randn(2, 2, 8, generator=torch.Generator().manual_seed(7))
    mean, var = net.reference(x)
    pyro.set_rng_seed(8)
    weights = dist.Normal(loc, sd).sample((100_000,))  # draws of the guide's posterior
    params = {k: v for k, v in torch_body.named_parameters() if k != "conv.weight"}
    buffers = dict(torch_body.named_buffers())

    def run(w):
        return torch.func.functional_call(torch_body, {**params, **buffers, "conv.weight": w}, (x,))

    with torch.no_grad():
        samples = torch.cat([torch.vmap(run)(chunk) for chunk in weights.split(10_000)]).double().numpy()
    assert_moments_agree(samples, mean, var)
    independent = pyro2pfp.convert(model, guide, input_shape=(2, 8), correlation="mean-field",
                                   max_pool="independent")
    assert_check_rejects(samples, *independent.reference(x))  # the check can fail on the same draws
    cm, cv = net.compile()(x)  # the compiled 1-D net (conv, window covariances, correlated max)
    np.testing.assert_allclose(cm, mean, rtol=1e-4, atol=1e-5 * np.abs(mean).max())
    np.testing.assert_allclose(cv, var, rtol=1e-4, atol=1e-5 * var.max())


@pytest.mark.parametrize("body_cls, first, correlation", [(Forms1d, "c1", "mean-field"),
                                                           (Block1d, "conv", "shared-factor")],
                         ids=["forms-mean-field", "block-shared-factor"])
def test_1d_layers_compile_with_their_default_schedules(body_cls, first, correlation, monkeypatch):
    """1-D layers run as 2-D ones with one row: every kernel gets its default schedule -- a schedule that
    counts on a loop over the rows (which TVM drops for one row) fails soft, a RuntimeWarning and the
    kernel left unscheduled -- and the compiled net equals the reference."""
    monkeypatch.setenv("PYRO2PFP_KERNEL_CACHE", "off")  # schedule every kernel here, none from the cache
    net, _ = _converted(body_cls, first, (2, 23), calibration=1.0, correlation=correlation)
    x = np.random.default_rng(4).normal(size=(3, 2, 23)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "the default schedule of ... failed"
        cm, cv = net.compile()(x)
    mean, var = net.reference(x)
    assert var.max() > 0
    np.testing.assert_allclose(cm, mean, rtol=1e-4, atol=1e-5 * np.abs(mean).max())
    np.testing.assert_allclose(cv, var, rtol=1e-4, atol=1e-5 * var.max())


# ------------------------------------------------------------------------------- errors
class _Irregular(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 2, 3)
        self.pool = nn.AdaptiveAvgPool1d(4)

    def forward(self, x):
        return self.pool(self.conv(x)).flatten(1)


class _PadValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 2, 3)

    def forward(self, x):
        return self.conv(F.pad(x, (1, 1), value=1.0)).flatten(1)


class _PadNoConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 2, 3)

    def forward(self, x):
        return F.pad(self.conv(x), (1, 1)).flatten(1)


class _Conv3d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(1, 2, 3)
        self.pool = nn.MaxPool3d(2)

    def forward(self, x):
        return self.pool(self.conv(x)).flatten(1)


@pytest.mark.parametrize("body, shape, pattern", [
    (_Irregular, (1, 12), r"pool \(aten.adaptive_avg_pool1d\): AdaptiveAvgPool1d from 10 to 4: .*differ in size "
                          r"or spacing.*divides the input \(for 10: 1, 2, 5, 10\).*AvgPool1d with a fixed kernel"),
    (_PadValue, (1, 8), r"body \(aten.pad\): padding \[1, 1\] \(mode 'constant', value 1.0\) is supported only "
                        r"as zeros.*folds into the conv's padding"),
    (_PadNoConv, (1, 8), r"body \(aten.pad\): .*right before a Conv1d/Conv2d"),
    (_Conv3d, (1, 5, 5, 5), r"conv.*3-D \(volumetric\) convolution and pooling are not supported"),
])
def test_forms_that_are_not_supported_say_why_and_what_to_do(body, shape, pattern):
    model = BayesianFirstLayer(body(), "conv")
    guide, _, _ = _guide("body.conv.weight", model.body.conv.weight.shape, 0)
    with pytest.raises(pyro2pfp.UnsupportedLayerError, match=pattern):
        pyro2pfp.convert(model, guide, input_shape=shape)
