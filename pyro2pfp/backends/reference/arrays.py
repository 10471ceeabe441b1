"""Float64 array helpers of the NumPy reference: convolution and pooling windows (no PFP math)."""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ...planning.plan import PlannedLayer

LOWEST = float(np.finfo(np.float64).min)


def conv2d_nchw(x: np.ndarray, w: np.ndarray, stride: list[int], padding: list[int],
                dilation: list[int], groups: int) -> np.ndarray:
    """Plain float64 2-D convolution (cross-correlation), NCHW input, OIHW weight."""
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (padding[0], padding[0]), (padding[1], padding[1])))
    oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (wd + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    out = np.zeros((n, o, oh, ow))
    og = o // groups
    for g in range(groups):
        xg = xp[:, g * cg:(g + 1) * cg]
        wg = w[g * og:(g + 1) * og]
        for p in range(kh):
            for q in range(kw):
                r0, c0 = p * dilation[0], q * dilation[1]
                patch = xg[:, :, r0:r0 + stride[0] * (oh - 1) + 1:stride[0], c0:c0 + stride[1] * (ow - 1) + 1:stride[1]]
                out[:, g * og:(g + 1) * og] += tap_product(wg[:, :, p, q], patch)
    return out


def tap_product(weight: np.ndarray, view: np.ndarray) -> np.ndarray:
    """``Σ_c weight[b, o, c]·view[b, c, h, w]``: (B, O, H, W) from weights (O, C), the same for every input,
    or (B, O, C), one matrix per input (the shared-factor rules' profiles), and a kernel offset's view
    (B, C, H, W) -- one matrix product per input (BLAS; an einsum runs NumPy's own loops, several times
    slower)."""
    b, c, h, w = view.shape
    return np.matmul(weight, view.reshape(b, c, h * w)).reshape(b, weight.shape[-2], h, w)


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


def conv_views(t: np.ndarray, layer: PlannedLayer, kernel: tuple[int, int]) -> Iterator[np.ndarray]:
    """The strided input view of every kernel offset (row-major), each (B, C, OH, OW)."""
    a = layer.layer.attrs
    stride, pad, dil = a["stride"], a["padding"], a["dilation"]
    oh, ow = layer.layer.out_shape[1:]
    tp = np.pad(t, ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))
    for p in range(kernel[0]):
        for q in range(kernel[1]):
            r0, c0 = p * dil[0], q * dil[1]
            yield tp[:, :, r0:r0 + stride[0] * (oh - 1) + 1:stride[0], c0:c0 + stride[1] * (ow - 1) + 1:stride[1]]
