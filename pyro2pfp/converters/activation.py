"""Activations: ``aten.relu`` → PFP ``relu`` (Gaussian moment matching)."""
from __future__ import annotations

from ..graph import Layer
from ._registry import register


@register("aten.relu.default", "aten.relu_.default")
def convert_relu(node, ctx) -> Layer:
    x = node.args[0]
    return Layer(name=ctx.new_name(node, prefer_module=False), op="relu",
                 inputs=[ctx.activation(x, node)], out_shape=ctx.shape(node), source=ctx.source(node))
