"""``concat`` (``torch.cat`` / ``torch.stack`` of branches): its moments against sampling, every back end
against the float64 reference, its shared-factor rule (a convolution split in two and concatenated
is the whole convolution, exactly), and the converter's spellings and refusals."""
from __future__ import annotations

import warnings

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
from pyro2pfp.correlation import with_correlation
from pyro2pfp.correlation.factors import CorrelationError
from pyro2pfp.errors import UnsupportedLayerError
from pyro2pfp.network import PFPNetwork
from pyro2pfp.planning.graph import INPUT, GaussianParam, Layer, LayerGraph
from pyro2pfp.planning.plan import plan
from tests.support.backends import ONNX_RTOL, assert_matches, onnx_run
from tests.support.builders import conv_layer, dense_block_graph, dense_layer, reshape_layer
from tests.support.op_coverage import COMPILED, MONTE_CARLO, covers
from tests.support.stats import assert_check_rejects, assert_moments_agree


def _bayesian(cls: type, *args, **kwargs) -> PyroModule:
    """``PyroModule[cls](*args, **kwargs)`` whose weight and bias are Normal sample sites."""
    module = PyroModule[cls](*args, **kwargs)
    for name, p in list(module.named_parameters()):
        setattr(module, name, PyroSample(dist.Normal(0.0, 1.0).expand(p.shape).to_event(p.dim())))
    return module


class Branches(PyroModule):
    """Two Bayesian conv branches of a deterministic input, joined every way users join them: along
    the channels (with the input itself, DenseNet-style), along the width (a negative dim), stacked
    on a new axis, and the flattened results concatenated with the last dim."""

    def __init__(self) -> None:
        super().__init__()
        self.a = _bayesian(nn.Conv2d, 2, 3, 3, padding=1)
        self.b = _bayesian(nn.Conv2d, 2, 3, 1)

    @staticmethod
    def join(a: torch.Tensor, x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a = F.leaky_relu(a, 0.1)
        channels = torch.cat([a, x, b], dim=1)
        width = torch.cat((a, b), -1)
        stacked = torch.stack([a, b], dim=2)
        return torch.concat([channels.flatten(1), width.flatten(1), stacked.flatten(1)], dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.join(self.a(x), x, self.b(x))


def _perturbed(model: PyroModule, x: torch.Tensor, scale: float, loc: float = 0.7) -> AutoNormal:
    """An AutoNormal guide of ``model`` with random locations (``loc``·N(0, 1)) and the given scale (a
    posterior with non-trivial means)."""
    pyro.clear_param_store()
    guide = AutoNormal(model, init_scale=scale)
    guide(x)
    with torch.no_grad():
        for name, value in pyro.get_param_store().named_parameters():
            if "locs" in name:
                value.copy_(loc * torch.randn_like(value))
    return guide


def _conv_samples(guide: AutoNormal, name: str, x: torch.Tensor, n: int, padding: int) -> torch.Tensor:
    """``n`` draws of conv ``name``'s output on ``x`` under the guide's Normal posterior: (n, B, C, H, W)."""
    draws = {}
    for part in ("weight", "bias"):
        loc, scale = guide._get_loc_and_scale(f"{name}.{part}")
        draws[part] = loc.double() + scale.double() * torch.randn(n, *loc.shape, dtype=torch.float64)
    w, b = draws["weight"], draws["bias"]
    out = F.conv2d(x, w.reshape(-1, *w.shape[2:]), b.reshape(-1), padding=padding)  # (B, n·C, H, W)
    return out.reshape(len(x), n, w.shape[1], *out.shape[2:]).transpose(0, 1)


@covers("concat", kind=MONTE_CARLO)
def test_concat_moments_match_sampling():
    """Every joined element is a Gaussian conv output or the LeakyReLU of one (exact PFP moments), the
    input itself (variance 0), or one of those moved by cat/stack: all within the Bonferroni bound of
    6000 draws of the guide's posterior pushed through the model's own joins; dropping a branch's
    variance, or swapping two branches, is rejected."""
    pyro.set_rng_seed(0)
    model = Branches()
    x = torch.randn(2, 2, 4, 4)
    guide = _perturbed(model, x, 0.3)
    net = pyro2pfp.convert(model, guide, input_shape=(2, 4, 4))
    assert [layer.op for layer in net.layer_graph.layers].count("concat") == 4
    mean, var = net.reference(x.numpy())
    n = 6000
    with torch.no_grad():
        xd = x.double()
        a, b = _conv_samples(guide, "a", xd, n, 1), _conv_samples(guide, "b", xd, n, 0)
        samples = Branches.join(a.flatten(0, 1), xd.repeat(n, 1, 1, 1), b.flatten(0, 1))
    samples = samples.reshape(n, *mean.shape).numpy()
    random = var > 0
    assert_moments_agree(samples[:, random], mean[random], var[random])
    # the input's copy is deterministic in PFP and in every sample
    np.testing.assert_array_equal(samples[:, ~random].std(axis=0), 0.0)
    assert (~random).sum() == x[0].numel() * len(x)
    wrong = var.copy()
    wrong[:, :3 * 16] = 0.0  # branch a's variance (the first 3 channels) dropped
    assert_check_rejects(samples[:, random], mean[random], wrong[random])
    swapped = mean.copy()
    swapped[:, :48], swapped[:, 80:128] = mean[:, 80:128], mean[:, :48]  # branches a and b swapped
    assert_check_rejects(samples[:, random], swapped[random], var[random])


def _mixed_graph(rng: np.random.Generator) -> LayerGraph:
    """A random, a deterministic and a random input joined along the channels, that joined with itself
    along the width, flattened and joined with a dense layer of it and with the input joined with itself
    along the height (deterministic: 64 elements of variance 0) (1-D)."""
    conv = conv_layer(rng, "conv", INPUT, (2, 4, 4), 3, 3, 1, 1, 1, 1, 0.5, 0.05)
    layers = [conv, Layer("relu", "relu", ["conv"], (3, 4, 4), "relu (test)"),
              Layer("cat", "concat", ["relu", INPUT, "conv"], (8, 4, 4), "cat (test)", {"axis": 0}),
              Layer("wide", "concat", ["cat", "cat"], (8, 4, 8), "wide (test)", {"axis": -1 % 3}),
              reshape_layer("flat", "wide", (256,)), dense_layer(rng, "fc", "flat", 256, 5, 0.1, 0.01),
              Layer("tall", "concat", [INPUT, INPUT], (2, 8, 4), "tall (test)", {"axis": 1}),
              reshape_layer("tall_flat", "tall", (64,)),
              Layer("out", "concat", ["flat", "fc", "tall_flat"], (325,), "out (test)", {"axis": 0})]
    return LayerGraph((2, 4, 4), layers, "out")


@covers("concat", kind=COMPILED)
def test_concat_compiled_and_onnx_match_the_reference():
    """Mixed representations (random, deterministic), channel/width/1-D axes: the compiled module and the
    ONNX export agree with the float64 reference, which places the branches' moments side by side."""
    rng = np.random.default_rng(1)
    graph = _mixed_graph(rng)
    net = PFPNetwork(graph, plan(graph))
    x = rng.standard_normal((3, 2, 4, 4)).astype(np.float32)
    mean, var = net.reference(x)
    assert_matches(net.compile()(x), (mean, var))
    assert_matches(onnx_run(net, x), (mean, var), ONNX_RTOL)
    # the reference: the first 128 outputs are relu | x | conv along the channels, twice along the width
    conv_only = PFPNetwork(LayerGraph((2, 4, 4), graph.layers[:1], "conv"), plan(
        LayerGraph((2, 4, 4), graph.layers[:1], "conv")))
    cm, cv = conv_only.reference(x)
    wide_m = mean[:, :256].reshape(3, 8, 4, 8)
    wide_v = var[:, :256].reshape(3, 8, 4, 8)
    for half in (slice(0, 4), slice(4, 8)):
        np.testing.assert_array_equal(wide_m[:, 3:5, :, half], x)
        np.testing.assert_array_equal(wide_v[:, 3:5, :, half], 0.0)
        np.testing.assert_allclose(wide_m[:, 5:, :, half], cm, rtol=1e-12)
        np.testing.assert_allclose(wide_v[:, 5:, :, half], cv, rtol=1e-12)
    assert net.plan.layer("tall").out_repr.name == "DETERMINISTIC"
    np.testing.assert_array_equal(mean[:, 261:].reshape(3, 2, 8, 4), np.concatenate([x, x], axis=2))
    np.testing.assert_array_equal(var[:, 261:], 0.0)


@pytest.mark.slow
def test_concat_raw_moment_plan_compiled_matches_the_reference():
    """The paper's plan: the concatenation's consumer (a dense layer) wants the second raw moment, which
    the concat kernel gives in its epilogue."""
    rng = np.random.default_rng(2)
    conv = conv_layer(rng, "conv", INPUT, (2, 4, 4), 3, 3, 1, 1, 1, 1, 0.5, 0.05)
    layers = [conv, Layer("relu", "relu", ["conv"], (3, 4, 4), "relu (test)"),
              Layer("cat", "concat", ["relu", INPUT], (5, 4, 4), "cat (test)", {"axis": 0}),
              reshape_layer("flat", "cat", (80,)), dense_layer(rng, "fc", "flat", 80, 4, 0.2, 0.01)]
    graph = LayerGraph((2, 4, 4), layers, "fc")
    planned = plan(graph, 1.0, "raw")
    assert planned.layer("cat").out_repr.name == "SECOND_MOMENT"
    net = PFPNetwork(graph, planned)
    x = rng.standard_normal((2, 2, 4, 4)).astype(np.float32)
    assert_matches(net.compile()(x), net.reference(x))
    assert_matches(net.reference(x), PFPNetwork(graph, plan(graph)).reference(x), 1e-9)


# ------------------------------------------------------------------------------ shared factors
def _split_graph(rng: np.random.Generator, split: bool) -> LayerGraph:
    """conv (noisy) → ReLU → conv of 6 channels → ReLU → 2×2 average pool → flatten → dense; with
    ``split`` the second conv is two convs (2 and 4 channels, the same weights) joined by concat."""
    c0 = conv_layer(rng, "c0", INPUT, (2, 6, 6), 4, 3, 1, 1, 1, 1, 0.5, 0.02)
    c1 = conv_layer(rng, "c1", "r0", (4, 6, 6), 6, 3, 1, 1, 1, 1, 0.4, 0.02)
    fc = dense_layer(rng, "fc", "flat", 54, 3, 0.3, 0.01)
    pool = Layer("pool", "avg_pool2d", ["r1"], (6, 3, 3), "pool (test)",
                 {"kernel": [2, 2], "stride": [2, 2], "padding": [0, 0], "ceil_mode": False,
                  "count_include_pad": True, "divisor": None})
    if split:
        parts = []
        for name, rows in (("c1a", slice(0, 2)), ("c1b", slice(2, 6))):
            params = {k: GaussianParam(p.mean[rows], p.var[rows], p.site) for k, p in c1.params.items()}
            n = rows.stop - rows.start
            parts.append(Layer(name, "conv2d", ["r0"], (n, 6, 6), f"{name} (test)", dict(c1.attrs), params))
        middle = [*parts, Layer("c1", "concat", ["c1a", "c1b"], (6, 6, 6), "c1 (test)", {"axis": 0})]
    else:
        middle = [c1]
    layers = [c0, Layer("r0", "relu", ["c0"], (4, 6, 6), "r0 (test)"), *middle,
              Layer("r1", "relu", ["c1"], (6, 6, 6), "r1 (test)"), pool, reshape_layer("flat", "pool", (54,)), fc]
    return LayerGraph((2, 6, 6), layers, "fc")


def _split_nets(correlation: str) -> tuple[PFPNetwork, PFPNetwork]:
    nets = []
    for split in (False, True):
        graph = _split_graph(np.random.default_rng(3), split)
        nets.append(PFPNetwork(graph, with_correlation(plan(graph), correlation)))
    return nets[0], nets[1]


@pytest.mark.parametrize("correlation", ["mean-field", "shared-factor"])
def test_a_split_convolution_concatenated_is_the_whole_convolution(correlation):
    """The two halves' factor blocks are the whole conv's block (the same columns), so the shared
    parts concatenate to the whole conv's: the output is the same to rounding (the factors and
    profiles concatenate exactly).  In ONNX too; and shared factors change the output here."""
    whole, split = _split_nets(correlation)
    x = np.random.default_rng(4).standard_normal((3, 2, 6, 6))
    want = whole.reference(x)
    got = split.reference(x)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-14)
    assert_matches(onnx_run(split, x.astype(np.float32)), want, ONNX_RTOL)
    if correlation == "shared-factor":
        assert split.plan.factors.offsets["c1a"] == whole.plan.factors.offsets["c1"]
        assert not np.allclose(want[1], _split_nets("mean-field")[0].reference(x)[1], rtol=1e-3)


@pytest.mark.slow
def test_a_split_convolution_concatenated_compiles_as_the_whole_convolution():
    """The compiled shared-factor kernels (``sf_concat``) give the reference's output."""
    whole, split = _split_nets("shared-factor")
    x = np.random.default_rng(5).standard_normal((2, 2, 6, 6)).astype(np.float32)
    assert_matches(split.compile()(x), whole.reference(x))


@pytest.mark.parametrize("correlation", ["mean-field", "shared-factor"])
def test_a_deterministic_branch_joins_without_a_shared_part(correlation):
    """``concat(x, r)`` then a deterministic 1×1 conv is ``conv_x(x) + conv_r(r)`` exactly (the input's
    rows carry ``s = 0``, ``g = 0``; the add of a deterministic branch keeps the other's shared part): the
    same output to rounding; the ONNX export (its zero parts) agrees with the reference."""
    nets = []
    for joined in (True, False):
        graph = dense_block_graph(np.random.default_rng(8), joined)
        nets.append(PFPNetwork(graph, with_correlation(plan(graph), correlation)))
    x = np.random.default_rng(9).standard_normal((3, 2, 4, 4))
    want = nets[1].reference(x)
    for g, w in zip(nets[0].reference(x), want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-14)
    assert_matches(onnx_run(nets[0], x.astype(np.float32)), want, ONNX_RTOL)
    if correlation == "shared-factor":  # the shared parts matter here
        mean_field = PFPNetwork(nets[0].layer_graph, plan(nets[0].layer_graph)).reference(x)[1]
        assert not np.allclose(want[1], mean_field, rtol=1e-3)


@pytest.mark.slow
def test_a_deterministic_branch_joins_without_a_shared_part_compiled():
    """The compiled ``sf_concat`` with the input's zero rows gives the reference's output."""
    graph = dense_block_graph(np.random.default_rng(8), True)
    net = PFPNetwork(graph, with_correlation(plan(graph), "shared-factor"))
    x = np.random.default_rng(10).standard_normal((2, 2, 4, 4)).astype(np.float32)
    assert_matches(net.compile()(x), net.reference(x))


def test_shared_factors_refuse_a_concatenation_they_cannot_represent():
    """Along the width (rows would mix loadings) and of flattened conv outputs (rows of positions):
    a named refusal; ``auto`` falls back to mean-field with a warning naming the layer."""
    rng = np.random.default_rng(6)
    c0 = conv_layer(rng, "c0", INPUT, (2, 4, 4), 3, 3, 1, 1, 1, 1, 0.5, 0.02)
    pool = Layer("pool", "avg_pool2d", ["wide"], (3, 2, 4), "pool (test)",
                 {"kernel": [2, 2], "stride": [2, 2], "padding": [0, 0], "ceil_mode": False,
                  "count_include_pad": True, "divisor": None})
    wide = LayerGraph((2, 4, 4), [c0, Layer("wide", "concat", ["c0", "c0"], (3, 4, 8), "wide (test)",
                                            {"axis": 2}), pool], "pool")
    with pytest.raises(CorrelationError, match=r"wide \(test\).*axis 2"):
        with_correlation(plan(wide), "shared-factor")
    with pytest.warns(UserWarning, match=r"mean-field.*wide \(test\)"):
        assert with_correlation(plan(wide), "auto").factors is None
    flat = LayerGraph((2, 4, 4), [c0, reshape_layer("flat", "c0", (48,)),
                                  Layer("both", "concat", ["flat", "flat"], (96,), "both (test)", {"axis": 0})],
                      "both")
    with pytest.raises(CorrelationError, match=r"both \(test\).*flattened flat"):
        with_correlation(plan(flat), "shared-factor")


# ------------------------------------------------------------------------------ converter
class Joins(PyroModule):
    """``torch.cat``'s spellings on dense branches of a deterministic input."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a = _bayesian(nn.Linear, 4, 3)
        self.b = _bayesian(nn.Linear, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.a(x), torch.tanh(self.b(x))
        if self.how == "hstack":
            return torch.hstack([a, b])
        if self.how == "concatenate":
            return torch.concatenate((b, a), axis=1)
        if self.how == "stack":
            return torch.stack([a, b], -1).flatten(1)
        if self.how == "single":
            return torch.cat([a], 1)
        if self.how == "batch":
            return torch.cat([a, b], 0)
        raise AssertionError(self.how)


@pytest.mark.parametrize("how", ["hstack", "concatenate", "stack", "single"])
def test_every_spelling_converts_to_the_torch_forward(how):
    """At calibration 0 the network is the deterministic forward of the posterior means."""
    pyro.set_rng_seed(1)
    model = Joins(how)
    x = torch.randn(5, 4)
    guide = _perturbed(model, x, 0.1)
    net = pyro2pfp.convert(model, guide, calibration=0.0)
    with torch.no_grad():
        want = pyro.poutine.condition(model, {k: v for k, v in guide.median().items()})(x)
    mean, var = net.reference(x.numpy())
    np.testing.assert_allclose(mean, want.double().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(var, 0.0)
    assert ("concat" in [layer.op for layer in net.layer_graph.layers]) == (how != "single")


def test_joining_along_the_batch_axis_is_named():
    pyro.set_rng_seed(2)
    model = Joins("batch")
    x = torch.randn(5, 4)
    guide = _perturbed(model, x, 0.1)
    with warnings.catch_warnings(), pytest.raises(UnsupportedLayerError, match=r"cat along the batch axis \(dim=0\)"):
        warnings.simplefilter("ignore")
        pyro2pfp.convert(model, guide)
