"""Reference max pooling: Clark's pairwise Gaussian max folded over each window in row-major order."""
from __future__ import annotations

import numpy as np

from .. import moments
from ..graph import Repr
from ..plan import PlannedLayer
from ._core import Activation, emit_output, reference


def window_views(x: np.ndarray, kernel: list[int], stride: list[int], out_hw: tuple[int, int]):
    """Yield, for each window offset (row-major), the strided (N, C, OH, OW) view of ``x``."""
    oh, ow = out_hw
    for p in range(kernel[0]):
        for q in range(kernel[1]):
            yield x[:, :, p:p + stride[0] * (oh - 1) + 1:stride[0], q:q + stride[1] * (ow - 1) + 1:stride[1]]


@reference("max_pool2d")
def max_pool2d(layer: PlannedLayer, inputs: list[Activation]) -> Activation:
    a, x = layer.layer.attrs, inputs[0]
    out_hw = layer.layer.out_shape[1:]
    means = window_views(x.mean, a["kernel"], a["stride"], out_hw)
    if x.repr is Repr.DETERMINISTIC:
        mean = next(means)
        for m in means:
            mean = np.maximum(mean, m)
        return Activation(mean, None, Repr.DETERMINISTIC)
    vars_ = window_views(x.variance(), a["kernel"], a["stride"], out_hw)
    mean, var = next(means), next(vars_)
    for m, v in zip(means, vars_):
        mean, var = moments.max_moments(mean, var, m, v)
    return emit_output(mean, var, layer)
