"""Winograd F(2x2, 3x3) for the shared-factor profile convolution (``sf_conv_profile``): the run-time
filter transform of the per-input weights (``winograd.weight_transform``, in ``sf_conv_weights``), the
Winograd profile kernel (``compute_shared.winograd_profile``) against the float64 direct formula, its
limit cases, and shared-factor nets compiled with it against ``net.reference``.

Tolerances: the float32 bound of the direct kernels' tests (``tests.support.builders.assert_compute_layer``:
``2·(K + 4)·2⁻²⁴·Σ|terms|`` for a sum of K products), not widened; the networks use
``test_correlation_backends``'s ``RTOL``.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import tvm
from tvm import te

import pyro2pfp
from pyro2pfp.backends.tvm.emit import emit_module
from pyro2pfp.backends.tvm.ops.compute_shared import winograd_profile
from pyro2pfp.backends.tvm.ops.winograd import WINO_G, direct_convolutions, weight_transform, winograd_shape
from pyro2pfp.backends.tvm.schedules import schedule_function
from pyro2pfp.correlation import with_correlation
from pyro2pfp.network import PFPNetwork
from pyro2pfp.planning.graph import INPUT, LayerGraph
from pyro2pfp.planning.plan import plan
from tests.ops.compute.test_winograd import winograd_funcs
from tests.stages.correlation.test_correlation_backends import NATIVE
from tests.support.backends import RTOL, assert_matches
from tests.support.builders import U32, conv_layer, relu_layer


def _build(inputs: list[te.Tensor], outputs: list[te.Tensor], op: str, target: tvm.target.Target = NATIVE):
    """The TE function compiled with the default schedule of ``op`` (a failing schedule raises)."""
    func = schedule_function(te.create_prim_func([*inputs, *outputs]), op, None, target)
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)["main"]


def _run(f, *arrays: np.ndarray, out_shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    outs = [tvm.runtime.tensor(np.full(s, np.nan, np.float32)) for s in out_shapes]
    f(*[tvm.runtime.tensor(np.ascontiguousarray(a, dtype=np.float32)) for a in arrays], *outs)
    return [o.numpy() for o in outs]


def transform64(w: np.ndarray) -> np.ndarray:
    """``G·w·Gᵀ`` in float64 of per-input filters (B, C, 3, 3, O) -> (B, 4, 4, C, O)."""
    return np.einsum("ei,bcijo,uj->beuco", WINO_G, w.astype(np.float64), WINO_G)


def direct64(pairs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """``Σ_k Σ_{c,i,j} w_k[b, c, i, j, o]·x_k[b, c, y+i-1, x+j-1]`` (padding 1) in float64 (B, O, H, W),
    and the same sum of absolute values (the scale of the float32 rounding bound)."""
    total = mag = 0.0
    for x, w in pairs:
        xp = np.pad(x.astype(np.float64), [(0, 0), (0, 0), (1, 1), (1, 1)])
        h, wd = x.shape[2:]
        win = np.stack([np.stack([xp[:, :, i:i + h, j:j + wd] for j in range(3)], 2) for i in range(3)], 2)
        total = total + np.einsum("bcijyx,bcijo->boyx", win, w.astype(np.float64))
        mag = mag + np.einsum("bcijyx,bcijo->boyx", np.abs(win), np.abs(w.astype(np.float64)))
    return total, mag


class Profile:
    """The compiled Winograd profile kernel of ``n_terms`` inputs (B, C, H, W) -- like ``sf_conv_profile``:
    symbolic batch, scheduled by the registered ``sf_conv_profile`` schedule."""

    def __init__(self, n_terms: int, c: int, o: int, h: int, w: int, target: tvm.target.Target = NATIVE):
        n = te.var("n", "int64")
        self.shapes = (c, o, h, w)
        pairs = [(te.placeholder((n, c, h, w), name=f"x{k}"), te.placeholder((n, 4, 4, c, o), name=f"u{k}"))
                 for k in range(n_terms)]
        shift, var = te.placeholder((n, o), name="shift"), te.placeholder((n, o, h, w), name="var")
        out = winograd_profile(pairs, shift, var)
        self.f = _build([t for p in pairs for t in p] + [shift, var], [out], "sf_conv_profile", target)

    def __call__(self, pairs: list[tuple[np.ndarray, np.ndarray]], shift: np.ndarray, var: np.ndarray) -> np.ndarray:
        c, o, h, w = self.shapes
        args = [a for x, wt in pairs for a in (x, transform64(wt).astype(np.float32))]
        return _run(self.f, *args, shift, var, out_shapes=[(len(shift), o, h, w)])[0]


@pytest.fixture(scope="module")
def profile2() -> Profile:
    return Profile(2, 16, 32, 6, 8)


def _random_case(rng: np.random.Generator, batch: int, c: int, o: int, h: int, w: int, scale: float = 1.0):
    pairs = [(scale * rng.standard_normal((batch, c, h, w)), rng.standard_normal((batch, c, 3, 3, o)) / c)
             for _ in range(2)]
    return [(x.astype(np.float32), wt.astype(np.float32)) for x, wt in pairs]


def _assert_profile(got: np.ndarray, pairs, shift: np.ndarray, var: np.ndarray) -> None:
    """``got`` is ``clip(direct + shift, ±√var)`` of the float64 formula to the float32 bound."""
    total, mag = direct64(pairs)
    want = total + shift.astype(np.float64)[:, :, None, None]
    sd = np.sqrt(var.astype(np.float64))
    clipped = np.clip(want, -sd, sd)
    k = 2 * pairs[0][0].shape[1] * 9
    tol = 2 * (k + 4) * U32 * (mag + np.abs(shift)[:, :, None, None]) + 1e-37
    assert np.all(np.abs(got - clipped) <= tol), np.abs(got - clipped).max()
    assert np.all(np.abs(got) <= np.sqrt(var))  # the clip holds exactly (float32 √var)


def test_weight_transform_is_g_w_gt_per_input():
    """The run-time filter transform (two separable stages, rolled rows) is ``G·w·Gᵀ`` of every
    input's filters, to float32 rounding (its terms are ≤ 3 per stage: bound 2·(3 + 3)·2⁻²⁴·Σ|terms|)."""
    rng = np.random.default_rng(0)
    n = te.var("n", "int64")
    w = te.placeholder((n, 16, 3, 3, 32), name="w")
    f = _build([w], [weight_transform(w, "wino_w0")], "sf_conv_weights")
    wn = rng.standard_normal((3, 16, 3, 3, 32)).astype(np.float32)
    got = _run(f, wn, out_shapes=[(3, 4, 4, 16, 32)])[0]
    want = transform64(wn)
    mag = np.einsum("ei,bcijo,uj->beuco", np.abs(WINO_G), np.abs(wn.astype(np.float64)), np.abs(WINO_G))
    assert np.all(np.abs(got - want) <= 2 * 6 * U32 * mag)
    assert np.all(got[:, 0, 0] == wn[:, :, 0, 0])  # corner positions copy one tap exactly
    assert np.all(got[:, 3, 3] == wn[:, :, 2, 2])


@pytest.mark.parametrize("batch", [1, 3])
def test_winograd_profile_matches_the_direct_formula(profile2, batch):
    """Two terms (profile and mean) with random per-input weights, a shift, a variance that clips
    about a third of the outputs: the float64 direct convolution + shift, clipped, to float32."""
    rng = np.random.default_rng(batch)
    pairs = _random_case(rng, batch, 16, 32, 6, 8)
    shift = rng.standard_normal((batch, 32)).astype(np.float32)
    total, _ = direct64(pairs)
    var = (rng.uniform(0.3, 3.0, total.shape) * (total + shift[:, :, None, None]) ** 2).astype(np.float32)
    got = profile2(pairs, shift, var)
    _assert_profile(got, pairs, shift, var)
    clipped = np.abs(total + shift[:, :, None, None]) > np.sqrt(var.astype(np.float64)) * (1 + 1e-4)
    assert 0.1 < clipped.mean() < 0.9
    want = total + shift[:, :, None, None]
    assert np.all(got[clipped] == np.sign(want[clipped]) * np.sqrt(var[clipped]))  # exactly at the bound


@pytest.mark.parametrize("target", ["native", "llvm"])
def test_winograd_profile_single_term_and_other_shapes(target):
    """One term (a first conv: the mean only, or no regression term: the profile only), 24 -> 16 on a
    non-square map with 1 tile row per chunk, against the direct formula; also for the generic
    ``llvm`` target (128-bit vectors: other tile sizes)."""
    rng = np.random.default_rng(7)
    kernel = Profile(1, 24, 16, 2, 10, NATIVE if target == "native" else tvm.target.Target("llvm"))
    x = rng.standard_normal((2, 24, 2, 10)).astype(np.float32)
    wt = (rng.standard_normal((2, 24, 3, 3, 16)) / 24).astype(np.float32)
    shift = np.zeros((2, 16), np.float32)
    var = np.full((2, 16, 2, 10), 1e6, np.float32)
    got = kernel([(x, wt)], shift, var)
    _assert_profile(got, [(x, wt)], shift, var)


def test_winograd_profile_limit_cases(profile2):
    """Zero profile and zero mean weights: exactly 0 out (no rounding noise from the transforms);
    zero variance: exactly 0 (clipped to ±0); huge means with huge weights: finite, to the bound;
    a profile exactly at the clip bound (var = s²) stays within ±√var."""
    rng = np.random.default_rng(11)
    (s, ws), (mu, wm) = _random_case(rng, 2, 16, 32, 6, 8)
    zero_s, zero_w = np.zeros_like(s), np.zeros_like(wm)
    shift0 = np.zeros((2, 32), np.float32)
    big_var = np.full((2, 32, 6, 8), 1e30, np.float32)
    assert np.all(profile2([(zero_s, ws), (mu, zero_w)], shift0, big_var) == 0.0)
    assert np.all(profile2([(s, ws), (mu, wm)], shift0, np.zeros_like(big_var)) == 0.0)
    # huge means (1e4) and large weights: finite and to the float32 bound
    huge = [(s, ws), (1e4 * mu, 1e2 * wm)]
    got = profile2(huge, shift0, big_var)
    assert np.all(np.isfinite(got))
    _assert_profile(got, huge, shift0, big_var)
    # at the bound: var = (float32 of the exact value)² -- |s| ≤ √var exactly, and within rounding of it
    total, _ = direct64([(s, ws), (mu, wm)])
    var = (total.astype(np.float32) ** 2).astype(np.float32)
    got = profile2([(s, ws), (mu, wm)], shift0, var)
    _assert_profile(got, [(s, ws), (mu, wm)], shift0, var)
    assert np.all(np.sign(got) * np.sign(total) >= 0)


def three_conv_graph(rng: np.random.Generator) -> LayerGraph:
    """conv 16->16 (deterministic input: the mean term only) → ReLU → conv 16->32 (profile + mean
    terms) → ReLU → conv 32->16: every conv's profile convolution is a Winograd one."""
    c0 = conv_layer(rng, "c0", INPUT, (16, 8, 8), 16, 3, 1, 1, 1, 1, 0.3, 0.01)
    c1 = conv_layer(rng, "c1", "r0", (16, 8, 8), 32, 3, 1, 1, 1, 1, 0.2, 0.01)
    c2 = conv_layer(rng, "c2", "r1", (32, 8, 8), 16, 3, 1, 1, 1, 1, 0.2, 0.01, bias="det")
    layers = [c0, relu_layer("r0", "c0", (16, 8, 8)), c1, relu_layer("r1", "c1", (32, 8, 8)), c2]
    return LayerGraph(input_shape=(16, 8, 8), layers=layers, output="c2")


@pytest.mark.slow
def test_net_with_winograd_profiles_matches_the_reference_and_the_direct_kernels():
    """Three Winograd-shaped convs under shared-factor: every ``sf_conv_profile`` is Winograd (and
    scheduled: no fallback warning); the compiled net matches ``net.reference`` like the direct
    kernels do (``direct_convolutions()``: no Winograd kernel at all), and both agree."""
    graph = three_conv_graph(np.random.default_rng(3))
    x = np.random.default_rng(4).standard_normal((3, 16, 8, 8)).astype(np.float32)
    net = PFPNetwork(graph, with_correlation(plan(graph), "shared-factor"))
    names = winograd_funcs(net.mod)
    assert {f"pfp_sf_conv_profile_{k}" for k in ("c0", "c1", "c2")} <= set(names)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out = net.compile(NATIVE)(x)
    ref = net.reference(x)
    assert_matches(out, ref)
    with direct_convolutions():
        assert not winograd_shape(net.plan.layers[0])
        direct = PFPNetwork(graph, with_correlation(plan(graph), "shared-factor"))
        assert winograd_funcs(direct.mod) == []
        out_d = direct.compile(NATIVE)(x)
    assert_matches(out_d, ref)
    assert_matches(out, out_d)


@pytest.mark.slow
def test_converted_resnet_with_winograd_profiles_matches_the_reference():
    """A small Bayesian ResNet (16/32 channels: its stride-1 3x3 block convs are Winograd in both
    schemes' kernels) converted with the default plan (shared-factor), static and symbolic batch."""
    from pyro2pfp_experiments.zoo import bayesian_resnet, he_posterior

    torch.manual_seed(0)
    model = bayesian_resnet(blocks=1, widths=(16, 32))
    x = torch.randn(2, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        net = pyro2pfp.convert(model, he_posterior(model, x, scale=0.03, seed=0), input_shape=(3, 8, 8))
    assert net.plan.correlation == "shared-factor"
    own = emit_module(net.plan, reuse=False)  # every layer its own kernels (net.mod shares equal ones)
    profiles = [n for n in winograd_funcs(own) if n.startswith("pfp_sf_conv_profile")]
    assert len(profiles) >= 3
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        exe = net.compile(NATIVE, batch_sizes=[2])
    assert_matches(exe(x.numpy()), net.reference(x.numpy()), RTOL)
    x3 = torch.randn(3, 3, 8, 8).numpy()
    assert_matches(exe(x3), net.reference(x3), RTOL)
