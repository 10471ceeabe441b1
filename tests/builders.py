"""Build small PFP layer graphs directly (no Pyro), for back-end tests."""
from __future__ import annotations

import numpy as np

from pyro2pfp.graph import INPUT, GaussianParam, Layer, LayerGraph


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
