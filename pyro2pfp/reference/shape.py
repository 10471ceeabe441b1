"""Reference reshape: identity on both components, batch dimension kept first."""
from __future__ import annotations

from ..plan import PlannedLayer
from ._core import Activation, reference


@reference("reshape")
def reshape(layer: PlannedLayer, inputs: list[Activation]) -> Activation:
    x = inputs[0]
    shape = (x.mean.shape[0], *layer.layer.out_shape)
    second = None if x.second is None else x.second.reshape(shape)
    return Activation(x.mean.reshape(shape), second, x.repr)
