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


@reference("leaky_relu")
def leaky_relu(layer: PlannedLayer, inputs: list[Activation]) -> Activation:
    x, slope = inputs[0], layer.layer.attrs["slope"]
    if x.repr is Repr.DETERMINISTIC:
        return Activation(np.where(x.mean > 0, x.mean, slope * x.mean), None, Repr.DETERMINISTIC)
    mean, var = moments.leaky_relu_moments(x.mean, x.variance(), slope)
    return emit_output(mean, var, layer)


@reference("affine")
def affine(layer: PlannedLayer, inputs: list[Activation]) -> Activation:
    """Per-channel ``μ ↦ a·μ + c``, ``v ↦ a²·v`` (channel axis 1)."""
    x = inputs[0]
    shape = (1, -1) + (1,) * (x.mean.ndim - 2)
    scale = layer.tensors["scale"].reshape(shape)
    mean = x.mean * scale + layer.tensors["shift"].reshape(shape)
    if x.repr is Repr.DETERMINISTIC:
        return Activation(mean, None, Repr.DETERMINISTIC)
    return emit_output(mean, x.variance() * scale**2, layer)


@reference("add")
def add(layer: PlannedLayer, inputs: list[Activation]) -> Activation:
    """Sum of two independent Gaussians: means and variances add."""
    a, b = inputs
    mean = a.mean + b.mean
    if a.repr is Repr.DETERMINISTIC and b.repr is Repr.DETERMINISTIC:
        return Activation(mean, None, Repr.DETERMINISTIC)
    return emit_output(mean, a.variance() + b.variance(), layer)
