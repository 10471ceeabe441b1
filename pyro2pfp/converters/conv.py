"""``aten.conv2d`` → PFP ``conv2d`` (weight (out, in/groups, kh, kw), optional bias)."""
from __future__ import annotations

from ..graph import Layer
from ._registry import register


def _pair(value, n: int = 2) -> list[int]:
    value = list(value) if isinstance(value, list | tuple) else [value]
    return [int(v) for v in (value * n if len(value) == 1 else value)]


@register("aten.conv2d.default")
def convert_conv2d(node, ctx) -> Layer:
    args = list(node.args) + [None] * 7
    x, weight, bias, stride, padding, dilation, groups = args[:7]
    if len(ctx.shape(x)) != 3:
        raise ctx.unsupported(node, f"conv2d expects (batch, C, H, W) input, got (batch, {ctx.shape(x)})")
    params = {"weight": ctx.param(weight, node, "weight")}
    if bias is not None:
        params["bias"] = ctx.param(bias, node, "bias")
    attrs = {
        "stride": _pair(stride if stride is not None else 1),
        "padding": _pair(padding if padding is not None else 0),
        "dilation": _pair(dilation if dilation is not None else 1),
        "groups": int(groups) if groups is not None else 1,
    }
    return Layer(name=ctx.new_name(node, prefer_module=True), op="conv2d",
                 inputs=[ctx.activation(x, node)], out_shape=ctx.shape(node),
                 source=ctx.source(node), attrs=attrs, params=params)
