"""Reference ReLU (Gaussian moment matching) and representation conversions."""
from __future__ import annotations

import numpy as np

from .. import moments
from ..graph import Repr
from ..plan import PlannedLayer
from ._core import Activation, emit_output, reference


@reference("relu")
def relu(layer: PlannedLayer, inputs: list[Activation]) -> Activation:
    x = inputs[0]
    if x.repr is Repr.DETERMINISTIC:
        return Activation(np.maximum(x.mean, 0.0), None, Repr.DETERMINISTIC)
    mean, var = moments.relu_moments(x.mean, x.variance())
    return emit_output(mean, var, layer)


@reference("convert")
def convert(layer: PlannedLayer, inputs: list[Activation]) -> Activation:
    x = inputs[0]
    return emit_output(x.mean, x.variance(), layer)
