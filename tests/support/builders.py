"""Shared test helpers: small PFP layer graphs built directly (no Pyro), hypothesis strategies,
the float32 error bound of compute layers, and a torch model that uses every PFP op."""
from __future__ import annotations

import numpy as np
import pyro
import pyro.distributions as dist
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st
from pyro.nn import PyroModule, PyroSample

from pyro2pfp.planning.graph import INPUT, GaussianParam, Layer, LayerGraph


def gaussian(rng: np.random.Generator, shape: tuple[int, ...], mean_scale: float, var_scale: float,
             ) -> GaussianParam:
    """Weights with means ~ mean_scale·N(0,1) and variances ~ var_scale·U(0.1, 1) (0 if var_scale is 0)."""
    mean = mean_scale * rng.standard_normal(shape)
    var = var_scale * rng.uniform(0.1, 1.0, shape)
    return GaussianParam(mean, var, site="w" if var_scale else None)


def dense_layer(rng, name: str, inp: str, k: int, m: int, mean_scale: float, var_scale: float,
                bias: str = "prob") -> Layer:
    params = {"weight": gaussian(rng, (m, k), mean_scale, var_scale)}
    if bias != "none":
        params["bias"] = gaussian(rng, (m,), mean_scale, var_scale if bias == "prob" else 0.0)
    return Layer(name=name, op="dense", inputs=[inp], out_shape=(m,), source=f"{name} (test)", params=params)


def conv_out(n: int, k: int, stride: int, pad: int, dil: int) -> int:
    return (n + 2 * pad - dil * (k - 1) - 1) // stride + 1


def conv_layer(rng, name: str, inp: str, in_shape: tuple[int, int, int], out_c: int, kernel: int,
               stride: int, pad: int, dil: int, groups: int, mean_scale: float, var_scale: float,
               bias: str = "prob") -> Layer:
    c, h, w = in_shape
    params = {"weight": gaussian(rng, (out_c, c // groups, kernel, kernel), mean_scale, var_scale)}
    if bias != "none":
        params["bias"] = gaussian(rng, (out_c,), mean_scale, var_scale if bias == "prob" else 0.0)
    out_shape = (out_c, conv_out(h, kernel, stride, pad, dil), conv_out(w, kernel, stride, pad, dil))
    attrs = {"stride": [stride, stride], "padding": [pad, pad], "dilation": [dil, dil], "groups": groups}
    return Layer(name=name, op="conv2d", inputs=[inp], out_shape=out_shape, source=f"{name} (test)",
                 attrs=attrs, params=params)


def relu_layer(name: str, inp: str, shape: tuple[int, ...]) -> Layer:
    return Layer(name=name, op="relu", inputs=[inp], out_shape=shape, source=f"{name} (test)")


def pool_layer(name: str, inp: str, in_shape: tuple[int, int, int], kernel: int, stride: int) -> Layer:
    c, h, w = in_shape
    out = (c, (h - kernel) // stride + 1, (w - kernel) // stride + 1)
    attrs = {"kernel": [kernel, kernel], "stride": [stride, stride], "padding": [0, 0],
             "dilation": [1, 1], "ceil_mode": False}
    return Layer(name=name, op="max_pool2d", inputs=[inp], out_shape=out, source=f"{name} (test)", attrs=attrs)


def reshape_layer(name: str, inp: str, shape: tuple[int, ...]) -> Layer:
    return Layer(name=name, op="reshape", inputs=[inp], out_shape=shape, source=f"{name} (test)")


def mlp_graph(rng, sizes: list[int], mean_scale: float = 0.1, var_scale: float = 1e-3) -> LayerGraph:
    """input → dense → relu → … → dense (the paper's MLP shape for sizes [784, 100, 10])."""
    layers, prev = [], INPUT
    for i, (k, m) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(dense_layer(rng, f"fc{i + 1}", prev, k, m, mean_scale, var_scale))
        prev = layers[-1].name
        if i < len(sizes) - 2:
            layers.append(relu_layer(f"relu{i + 1}", prev, (m,)))
            prev = layers[-1].name
    return LayerGraph(input_shape=(sizes[0],), layers=layers, output=prev)


def lenet_graph(rng, widths: tuple[int, int, int, int] = (6, 16, 120, 84), image: int = 28,
                mean_scale: float = 0.1, var_scale: float = 1e-3) -> LayerGraph:
    """The paper's LeNet-5: conv5 pad2 → relu → pool2 → conv5 → relu → pool2 → flatten → fc×3."""
    c1, c2, f1, f2 = widths
    ls = []
    ls.append(conv_layer(rng, "conv1", INPUT, (1, image, image), c1, 5, 1, 2, 1, 1, mean_scale, var_scale))
    ls.append(relu_layer("relu1", "conv1", ls[-1].out_shape))
    ls.append(pool_layer("pool1", "relu1", ls[-1].out_shape, 2, 2))
    ls.append(conv_layer(rng, "conv2", "pool1", ls[-1].out_shape, c2, 5, 1, 0, 1, 1, mean_scale, var_scale))
    ls.append(relu_layer("relu2", "conv2", ls[-1].out_shape))
    ls.append(pool_layer("pool2", "relu2", ls[-1].out_shape, 2, 2))
    flat = int(np.prod(ls[-1].out_shape))
    ls.append(reshape_layer("flatten", "pool2", (flat,)))
    ls.append(dense_layer(rng, "fc1", "flatten", flat, f1, mean_scale, var_scale))
    ls.append(relu_layer("relu3", "fc1", (f1,)))
    ls.append(dense_layer(rng, "fc2", "relu3", f1, f2, mean_scale, var_scale))
    ls.append(relu_layer("relu4", "fc2", (f2,)))
    ls.append(dense_layer(rng, "fc3", "relu4", f2, 10, mean_scale, var_scale))
    return LayerGraph(input_shape=(1, image, image), layers=ls, output="fc3")


# --- hypothesis strategies shared by the back-end tests -----------------------------------------

scales = st.sampled_from([1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0])
var_scales = st.sampled_from([0.0, 1e-8, 1e-4, 1e-2, 1.0, 10.0])
input_var = st.one_of(st.none(), st.sampled_from([0.0, 1e-6, 1e-2, 1.0]))
forms = st.sampled_from(["variance", "raw"])


def inputs(rng: np.random.Generator, batch: int, shape: tuple[int, ...], scale: float, var_scale: float | None,
           ) -> tuple[np.ndarray, np.ndarray | None]:
    """A float32 input batch ``scale``·N(0,1) and its variance ``var_scale``·U(0,1) (None: deterministic input)."""
    x = (scale * rng.standard_normal((batch, *shape))).astype(np.float32)
    if var_scale is None:
        return x, None
    return x, (var_scale * rng.uniform(0.0, 1.0, x.shape)).astype(np.float32)

U32 = 2.0**-24


def assert_compute_layer(layer, x, x_var, ref, out, apply, moment_form):
    w, b = layer.params["weight"], layer.params.get("bias")
    x = x.astype(np.float64)
    k = int(np.prod(w.shape[1:]))
    mag_mean = apply(np.abs(x), np.abs(w.mean))
    if x_var is None:
        mag_var = apply(x**2, w.var)
    elif moment_form == "variance":
        xv = x_var.astype(np.float64)
        mag_var = apply(x**2 + xv, w.var) + apply(xv, w.mean**2)
    else:
        xv = x_var.astype(np.float64)
        mag_var = apply(x**2 + xv, w.mean**2 + w.var) + apply(x**2, w.mean**2)
    if b is not None:
        shape = (1, -1) + (1,) * (mag_mean.ndim - 2)
        mag_mean = mag_mean + np.abs(b.mean).reshape(shape)
        mag_var = mag_var + b.var.reshape(shape)
    tol = 2 * (k + 4) * U32
    assert np.all(np.abs(out[0] - ref[0]) <= tol * mag_mean + 1e-37), np.abs(out[0] - ref[0]).max()
    assert np.all(np.abs(out[1] - ref[1]) <= tol * mag_var + 1e-37), np.abs(out[1] - ref[1]).max()


class ResidualNet(nn.Module):
    """Conv('same') → BatchNorm → LeakyReLU → residual conv → ReLU → avg/max pool (ceil, padding) →
    global average → Linear: every PFP op the converters produce."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding="same")
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.pool = nn.AvgPool2d(2, ceil_mode=True)
        self.mp = nn.MaxPool2d(3, 2, padding=1, ceil_mode=True)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 5)

    def forward(self, x, y=None):
        h = F.leaky_relu(self.bn(self.conv(x)), 0.1)
        h = self.conv2(h) + h
        h = self.mp(self.pool(F.relu(h)))
        return self.fc(torch.flatten(self.gap(h), 1))


# --- pooling windows with padding / ceil mode, shared by the TVM and ONNX tests ------------------

@st.composite
def pool_cases(draw):
    """(kernel, stride, padding, ceil_mode, height, width) that torch accepts."""
    kernel = draw(st.integers(1, 4))
    stride = draw(st.integers(1, 3))
    pad = draw(st.integers(0, kernel // 2))
    return kernel, stride, pad, draw(st.booleans()), draw(st.integers(kernel, kernel + 6)), \
        draw(st.integers(kernel, kernel + 6))


def pool_graph(kind: str, case: tuple, include_pad: bool, input_variance: bool, channels: int = 2):
    """A one-layer max/avg pooling graph for ``case`` and torch's pooling of the same windows.

    Average pooling with both padding and ceil mode is not supported (the converter says so), so
    ceil mode is dropped there.  Returns ``(graph, torch_pool)`` with ``torch_pool(x_tensor)``.
    """
    kernel, stride, pad, ceil, h, w = case
    if kind == "avg" and pad and ceil:
        ceil = False
    extra = {"count_include_pad": include_pad} if kind == "avg" else {}
    pool = F.max_pool2d if kind == "max" else F.avg_pool2d

    def torch_pool(t: torch.Tensor) -> torch.Tensor:
        return pool(t, kernel, stride, pad, ceil_mode=ceil, **extra)

    out_shape = tuple(torch_pool(torch.zeros(1, channels, h, w)).shape[1:])
    attrs = {"kernel": [kernel] * 2, "stride": [stride] * 2, "padding": [pad] * 2, "ceil_mode": ceil,
             "dilation": [1, 1], "count_include_pad": include_pad, "divisor": None}
    op = "max_pool2d" if kind == "max" else "avg_pool2d"
    layer = Layer("pool", op, [INPUT], out_shape, "t", attrs)
    return LayerGraph((channels, h, w), [layer], "pool", input_variance=input_variance), torch_pool


class BayesianFirstLayer(PyroModule):
    """A torch ``body`` whose layer ``first`` gets a ``PyroSample`` weight (standard normal prior); the
    rest stays deterministic: one Bayesian layer in front of any torch stack, for converter tests."""

    def __init__(self, body: nn.Module, first: str):
        super().__init__()
        pyro.nn.module.to_pyro_module_(body)
        self.body = body
        layer = body.get_submodule(first)
        layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand(layer.weight.shape).to_event(layer.weight.dim()))
        self.first = first

    def forward(self, x, y=None):
        return self.body(x)


def dense_block_graph(rng: np.random.Generator, joined: bool) -> LayerGraph:
    """DenseNet-style: conv (noisy) → ReLU ``r``; ``joined``: ``concat(x, r)`` → 1×1 conv with deterministic
    weights ``[Wx | Wr]``; else the same as ``conv_x(x) + conv_r(r)`` (``add``); then 2×2 average pooling,
    flatten, dense."""
    c0 = conv_layer(rng, "c0", INPUT, (2, 4, 4), 3, 3, 1, 1, 1, 1, 0.5, 0.03)
    mix = conv_layer(rng, "mix", "cat", (5, 4, 4), 4, 1, 1, 0, 1, 1, 0.6, 0.0, bias="det")
    tail = [Layer("pool", "avg_pool2d", ["mix"], (4, 2, 2), "pool (test)",
                  {"kernel": [2, 2], "stride": [2, 2], "padding": [0, 0], "ceil_mode": False,
                   "count_include_pad": True, "divisor": None}),
            reshape_layer("flat", "pool", (16,)), dense_layer(rng, "fc", "flat", 16, 3, 0.4, 0.01)]
    head = [c0, Layer("r", "relu", ["c0"], (3, 4, 4), "r (test)")]
    if joined:
        return LayerGraph((2, 4, 4), [*head, Layer("cat", "concat", [INPUT, "r"], (5, 4, 4), "cat (test)",
                                                   {"axis": 0}), mix, *tail], "fc")
    w, b = mix.params["weight"], mix.params["bias"]
    conv_x = Layer("mix_x", "conv2d", [INPUT], (4, 4, 4), "mix_x (test)", dict(mix.attrs),
                   {"weight": GaussianParam(w.mean[:, :2], w.var[:, :2])})
    conv_r = Layer("mix_r", "conv2d", ["r"], (4, 4, 4), "mix_r (test)", dict(mix.attrs),
                   {"weight": GaussianParam(w.mean[:, 2:], w.var[:, 2:]), "bias": b})
    return LayerGraph((2, 4, 4), [*head, conv_x, conv_r,
                                  Layer("mix", "add", ["mix_x", "mix_r"], (4, 4, 4), "mix (test)"), *tail], "fc")
