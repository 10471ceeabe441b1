"""``aten.linear`` → PFP ``dense`` (weight (out, in), optional bias)."""
from __future__ import annotations

from ..graph import Layer
from ._registry import register


@register("aten.linear.default", produces=("dense",))
def convert_linear(node, ctx) -> Layer:
    x, weight, bias = (list(node.args) + [None])[:3]
    in_shape = ctx.shape(x)
    if len(in_shape) != 1:
        raise ctx.unsupported(
            node, f"Linear applied to a (batch, {', '.join(map(str, in_shape))}) tensor; PFP dense layers "
            "take (batch, features). Flatten the input first."
        )
    params = {"weight": ctx.param(weight, node, "weight")}
    if bias is not None:
        params["bias"] = ctx.param(bias, node, "bias")
    return Layer(name=ctx.new_name(node, prefer_module=True), op="dense",
                 inputs=[ctx.activation(x, node)], out_shape=ctx.shape(node),
                 source=ctx.source(node), params=params)
