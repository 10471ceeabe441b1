"""Reference dense and conv2d layers (float64).

Input deterministic ``x``:      ``μ = Σ μw·x + μb``,  ``v = Σ vw·x² + vb``.
Input variance ``(μx, vx)``:   ``μ = Σ μw·μx + μb``, ``v = Σ vw·(μx² + vx) + μw²·vx + vb``.
Input raw moment ``(μx, sx)``: ``μ = Σ μw·μx + μb``, ``v = Σ sw·sx − (μw·μx)² + vb`` (clamped ≥ 0).
Both linear maps are applied by the same ``apply(x, w)`` (a matmul or a convolution).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..graph import Repr
from ..plan import PlannedLayer
from ._core import Activation, emit_output, reference


def _compute_layer(layer: PlannedLayer, x: Activation,
                   apply: Callable[[np.ndarray, np.ndarray], np.ndarray], bias_shape: tuple[int, ...]
                   ) -> Activation:
    t = layer.tensors
    mean = apply(x.mean, t["weight_mean"])
    if x.repr is Repr.DETERMINISTIC:
        var = apply(x.mean**2, t["weight_var"])
    elif x.repr is Repr.VARIANCE:
        var = apply(x.second_moment(), t["weight_var"]) + apply(x.variance(), t["weight_mean"] ** 2)
    else:
        var = apply(x.second_moment(), t["weight_second_moment"]) - apply(x.mean**2, t["weight_mean"] ** 2)
    if "bias_mean" in t:
        mean = mean + t["bias_mean"].reshape(bias_shape)
    if "bias_var" in t:
        var = var + t["bias_var"].reshape(bias_shape)
    return emit_output(mean, np.maximum(var, 0.0), layer)


@reference("dense")
def dense(layer: PlannedLayer, inputs: list[Activation]) -> Activation:
    return _compute_layer(layer, inputs[0], lambda x, w: x @ w.T, (1, -1))


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
                out[:, g * og:(g + 1) * og] += np.einsum("nchw,oc->nohw", patch, wg[:, :, p, q])
    return out


@reference("conv2d")
def conv2d(layer: PlannedLayer, inputs: list[Activation]) -> Activation:
    a = layer.layer.attrs

    def apply(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return conv2d_nchw(x, w, a["stride"], a["padding"], a["dilation"], a["groups"])

    return _compute_layer(layer, inputs[0], apply, (1, -1, 1, 1))
