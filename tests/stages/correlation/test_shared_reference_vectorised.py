"""The float64 shared-factor reference's vectorised rules (batched matrix products over the factor and
channel axes, one matrix product per kernel offset) against a straightforward computation: Python loops
over inputs, output channels and factor columns, and torch's float64 convolution for the spatial sums --
written from the rules' docstrings, not from their code."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pyro2pfp import ops as ops  # the op registry: every op family registers itself
from pyro2pfp.correlation import Shared, execute_shared_all, plan_factors
from pyro2pfp.correlation.factors import weight_var
from pyro2pfp.correlation.shared import compacted
from pyro2pfp.planning.graph import INPUT, Layer, LayerGraph
from pyro2pfp.planning.plan import plan
from pyro2pfp.planning.registry import SHARED_REFERENCES
from tests.support.builders import conv_layer, relu_layer


def _graph(rng: np.random.Generator) -> LayerGraph:
    """conv 3×3 → relu → conv 3×3 stride 2 (dilation 1) and a 1×1 stride-2 shortcut conv → add."""
    conv0 = conv_layer(rng, "conv0", INPUT, (3, 7, 7), 4, 3, 1, 1, 1, 1, 0.5, 0.05)
    relu0 = relu_layer("relu0", "conv0", (4, 7, 7))
    conv1 = conv_layer(rng, "conv1", "relu0", (4, 7, 7), 5, 3, 2, 1, 1, 1, 0.5, 0.05)
    short = conv_layer(rng, "short", "relu0", (4, 7, 7), 5, 1, 2, 0, 1, 1, 0.5, 0.05, bias="none")
    add = Layer(name="add", op="add", inputs=["conv1", "short"], out_shape=(5, 4, 4), source="add (test)")
    return LayerGraph(input_shape=(3, 7, 7), layers=[conv0, relu0, conv1, short, add], output="add")


def _taps_mean(t: np.ndarray, kernel: tuple[int, int], attrs: dict) -> np.ndarray:
    """(B, C, kh·kw): each kernel offset's input averaged over the output positions (torch's unfold)."""
    cols = F.unfold(torch.from_numpy(t), kernel, dilation=attrs["dilation"], padding=attrs["padding"],
                    stride=attrs["stride"])
    return cols.mean(dim=-1).numpy().reshape(t.shape[0], t.shape[1], -1)


def _conv(t: np.ndarray, w: np.ndarray, attrs: dict) -> np.ndarray:
    """One input (C, H, W) through one output channel's weights (C, kh, kw): (OH, OW)."""
    out = F.conv2d(torch.from_numpy(t)[None], torch.from_numpy(np.ascontiguousarray(w))[None],
                   stride=attrs["stride"], padding=attrs["padding"], dilation=attrs["dilation"])
    return out[0, 0].numpy()


def naive_conv_shared(layer, mu: np.ndarray, sh: Shared, fp) -> Shared:
    """conv2d_shared's docstring, term by term, one input, output channel and factor at a time."""
    t, attrs = layer.tensors, layer.layer.attrs
    wm, wv = t["weight_mean"], weight_var(t)
    o, c, kh, kw = wm.shape
    k, offset = fp.width[layer.name], fp.offsets[layer.name]
    b = mu.shape[0]
    s_in = sh.s.reshape(mu.shape)
    mbar, sbar = _taps_mean(mu, (kh, kw), attrs), _taps_mean(s_in, (kh, kw), attrs)
    bias_var = t.get("bias_var", np.zeros(o))
    loading, wbar = np.zeros((b, o, k)), np.zeros((b, o))
    for n in range(b):
        for q in range(o):
            amap = [sum(wm[q, ch].reshape(-1)[tap] * sbar[n, ch, tap] for tap in range(kh * kw)) for ch in range(c)]
            for f in range(sh.g.shape[2]):
                loading[n, q, f] = sum(amap[ch] * sh.g[n, ch, f] for ch in range(c))
            wbar[n, q] = np.sqrt((wv[q] * (mbar[n] ** 2 + sbar[n] ** 2).reshape(c, kh, kw)).sum() + bias_var[q])
            loading[n, q, offset + q] += wbar[n, q]
    g = loading / np.sqrt((loading**2).sum(axis=2, keepdims=True))
    s = np.zeros((b, o, *layer.layer.out_shape[1:]))
    for n in range(b):
        for q in range(o):
            for ch in range(c):
                beta = sum(sh.g[n, ch, f] * g[n, q, f] for f in range(sh.g.shape[2]))
                s[n, q] += _conv(s_in[n, ch:ch + 1], beta * wm[q, ch:ch + 1], attrs)
            reg = (_conv(mu[n], wv[q] * mbar[n].reshape(c, kh, kw), attrs)
                   + _conv(s_in[n], wv[q] * sbar[n].reshape(c, kh, kw), attrs) + bias_var[q])
            s[n, q] += g[n, q, offset + q] / wbar[n, q] * reg
    return Shared(s, g)


def naive_add_shared(sa: Shared, sb: Shared, k: int, var: np.ndarray) -> tuple[Shared, np.ndarray]:
    """add_shared's docstring with the factor columns looped over (zero beyond an edge's own)."""
    b, c = sa.s.shape[:2]
    ga, gb = np.zeros((b, c, k)), np.zeros((b, c, k))
    ga[..., :sa.g.shape[2]], gb[..., :sb.g.shape[2]] = sa.g, sb.g
    abar, bbar = sa.s.mean(axis=(2, 3)), sb.s.mean(axis=(2, 3))
    loading = np.zeros((b, c, k))
    s, v = np.zeros_like(sa.s), var.copy()
    for n in range(b):
        for ch in range(c):
            for f in range(k):
                loading[n, ch, f] = abar[n, ch] * ga[n, ch, f] + bbar[n, ch] * gb[n, ch, f]
            g = loading[n, ch] / np.linalg.norm(loading[n, ch])
            loading[n, ch] = g
            pa = sum(ga[n, ch, f] * g[f] for f in range(k))
            pb = sum(gb[n, ch, f] * g[f] for f in range(k))
            s[n, ch] = sa.s[n, ch] * pa + sb.s[n, ch] * pb
            v[n, ch] += 2.0 * sa.s[n, ch] * sb.s[n, ch] * sum(ga[n, ch, f] * gb[n, ch, f] for f in range(k))
    return Shared(s, loading), np.maximum(v, 0.0)


def test_vectorised_conv_and_add_rules_equal_a_per_factor_computation():
    rng = np.random.default_rng(3)
    graph = plan(_graph(rng))
    fp = plan_factors(graph)
    x = rng.standard_normal((2, 3, 7, 7))
    keep: dict[str, Shared | None] = {"relu0": None, "conv1": None, "short": None}
    values = execute_shared_all(graph, x, fp, keep=keep)
    relu0 = keep["relu0"]
    assert relu0 is not None and relu0.g.shape[2] < fp.width["conv1"]  # the rule widens g: exercised
    for name in ("conv1", "short"):
        layer = graph.layer(name)
        var = values[name].variance()
        got, _ = SHARED_REFERENCES["conv2d"](layer, [values["relu0"]], [relu0], fp, var)
        want = naive_conv_shared(layer, values["relu0"].mean, relu0, fp)
        assert got is not None
        np.testing.assert_allclose(got.g, want.g, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(got.s, want.s, rtol=1e-11, atol=1e-13 * np.abs(want.s).max())
    sa, sb = keep["conv1"], keep["short"]
    assert sa is not None and sb is not None and sa.g.shape[2] != sb.g.shape[2]  # different widths: widened
    layer = graph.layer("add")
    var = values["conv1"].variance() + values["short"].variance()
    got, got_var = SHARED_REFERENCES["add"](layer, [values["conv1"], values["short"]], [sa, sb], fp, var)
    want, want_var = naive_add_shared(sa, sb, fp.width["add"], var)
    assert got is not None
    np.testing.assert_allclose(got.g, want.g, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(got.s, want.s, rtol=1e-11, atol=1e-13 * np.abs(want.s).max())
    np.testing.assert_allclose(got_var, want_var, rtol=1e-12)


def test_compaction_equals_the_stacked_qr_bit_for_bit():
    """The compaction's per-input ``R`` (``mode="r"``) is NumPy's stacked QR's ``R``, bit for bit; and
    keeps ``g·gᵀ``."""
    rng = np.random.default_rng(4)
    g = rng.standard_normal((3, 5, 23))
    sh = Shared(rng.standard_normal((3, 5, 2, 2)), g)
    got = compacted(sh)
    _, r = np.linalg.qr(np.swapaxes(g, 1, 2))
    assert np.array_equal(got.g, np.swapaxes(r, 1, 2))
    np.testing.assert_allclose(got.g @ np.swapaxes(got.g, 1, 2), g @ np.swapaxes(g, 1, 2), rtol=1e-12, atol=1e-12)
