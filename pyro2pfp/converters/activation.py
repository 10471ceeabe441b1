"""Activations: ReLU and LeakyReLU (Gaussian moment matching); a final softmax is stripped."""
from __future__ import annotations

import warnings

from ..graph import Layer
from ._registry import Alias, register


@register("aten.relu.default", "aten.relu_.default", produces=("relu",))
def convert_relu(node, ctx) -> Layer:
    x = node.args[0]
    return Layer(name=ctx.new_name(node, prefer_module=False), op="relu",
                 inputs=[ctx.activation(x, node)], out_shape=ctx.shape(node), source=ctx.source(node))


@register("aten.leaky_relu.default", "aten.leaky_relu_.default", produces=("leaky_relu",))
def convert_leaky_relu(node, ctx) -> Layer:
    x = node.args[0]
    slope = float(node.args[1]) if len(node.args) > 1 else float(node.kwargs.get("negative_slope", 0.01))
    return Layer(name=ctx.new_name(node, prefer_module=False), op="leaky_relu",
                 inputs=[ctx.activation(x, node)], out_shape=ctx.shape(node), source=ctx.source(node),
                 attrs={"slope": slope})


@register("aten.softmax.int", "aten._softmax.default", "aten.log_softmax.int", "aten._log_softmax.default")
def strip_final_softmax(node, ctx) -> Alias:
    if not ctx.is_output(node):
        raise ctx.unsupported(node, "softmax inside the network is not supported (only a final softmax, "
                                    "which is stripped so the output stays the logits)")
    warnings.warn(f"{ctx.source(node)}: the final softmax/log_softmax is stripped; the PFP network outputs "
                  "the (mean, variance) of the logits. Use pyro2pfp.uncertainty() for class probabilities.",
                  stacklevel=2)
    return Alias(node.args[0])
