"""Reference pooling.

Max pooling folds Clark's pairwise Gaussian max over each window in row-major order; average
pooling is linear (``μ ↦ Σμ/d``, ``v ↦ Σv/d²``).  Positions outside the input (padding, ceil-mode
overhang) are skipped: for max pooling they hold the fold's exact identity ``(−MAX, 0)``
(``max_moments(−MAX, 0, μ, v) = (μ, v)``), for average pooling zeros.
"""
from __future__ import annotations

import numpy as np

from .. import moments
from ..graph import Repr
from ..plan import PlannedLayer
from ._core import Activation, emit_output, reference

LOWEST = float(np.finfo(np.float64).min)


def padded(x: np.ndarray, attrs: dict, out_hw: tuple[int, ...], fill: float) -> np.ndarray:
    """``x`` padded so that every window of the layer lies inside (begin padding + overhang)."""
    pads = [(0, 0), (0, 0)]
    for n, k, s, p, o in zip(x.shape[2:], attrs["kernel"], attrs["stride"], attrs["padding"], out_hw):
        end = max(0, (o - 1) * s + k - n - p)
        pads.append((p, end))
    return np.pad(x, pads, constant_values=fill)


def window_views(x: np.ndarray, kernel: list[int], stride: list[int], out_hw: tuple[int, ...]):
    """Yield, for each window offset (row-major), the strided (N, C, OH, OW) view of ``x``."""
    oh, ow = out_hw
    for p in range(kernel[0]):
        for q in range(kernel[1]):
            yield x[:, :, p:p + stride[0] * (oh - 1) + 1:stride[0], q:q + stride[1] * (ow - 1) + 1:stride[1]]


@reference("max_pool2d")
def max_pool2d(layer: PlannedLayer, inputs: list[Activation]) -> Activation:
    a, x = layer.layer.attrs, inputs[0]
    out_hw = layer.layer.out_shape[1:]
    means = window_views(padded(x.mean, a, out_hw, -np.inf if x.repr is Repr.DETERMINISTIC else LOWEST),
                         a["kernel"], a["stride"], out_hw)
    if x.repr is Repr.DETERMINISTIC:
        mean = next(means)
        for m in means:
            mean = np.maximum(mean, m)
        return Activation(mean, None, Repr.DETERMINISTIC)
    vars_ = window_views(padded(x.variance(), a, out_hw, 0.0), a["kernel"], a["stride"], out_hw)
    mean, var = next(means), next(vars_)
    for m, v in zip(means, vars_):
        mean, var = moments.max_moments(mean, var, m, v)
    return emit_output(mean, var, layer)


def average_divisor(attrs: dict, in_hw: tuple[int, ...], out_hw: tuple[int, ...]) -> np.ndarray:
    """The divisor of each output position (torch's rules: ``divisor``, ``count_include_pad``)."""
    if attrs["divisor"] is not None:
        return np.full(out_hw, float(attrs["divisor"]))
    counts = []
    for n, k, s, p, o in zip(in_hw, attrs["kernel"], attrs["stride"], attrs["padding"], out_hw):
        start = np.arange(o) * s - p
        if attrs["count_include_pad"]:
            counts.append(np.minimum(start + k, n + p) - start)
        else:
            counts.append(np.minimum(start + k, n) - np.maximum(start, 0))
    return np.outer(counts[0], counts[1]).astype(np.float64)


@reference("avg_pool2d")
def avg_pool2d(layer: PlannedLayer, inputs: list[Activation]) -> Activation:
    a, x = layer.layer.attrs, inputs[0]
    out_hw = layer.layer.out_shape[1:]
    divisor = average_divisor(a, x.mean.shape[2:], out_hw)
    mean = sum(window_views(padded(x.mean, a, out_hw, 0.0), a["kernel"], a["stride"], out_hw)) / divisor
    if x.repr is Repr.DETERMINISTIC:
        return Activation(mean, None, Repr.DETERMINISTIC)
    var = sum(window_views(padded(x.variance(), a, out_hw, 0.0), a["kernel"], a["stride"], out_hw)) / divisor**2
    return emit_output(mean, var, layer)
