"""``aten.max_pool2d`` → PFP ``max_pool2d`` (pairwise Gaussian max over each window)."""
from __future__ import annotations

from ..graph import Layer
from ._registry import register
from .conv import _pair


@register("aten.max_pool2d.default", "aten.max_pool2d_with_indices.default")
def convert_max_pool2d(node, ctx) -> Layer:
    args = list(node.args) + [None] * 6
    x, kernel, stride, padding, dilation, ceil_mode = args[:6]
    kernel = _pair(kernel)
    attrs = {
        "kernel": kernel,
        "stride": _pair(stride) if stride not in (None, [], ()) else list(kernel),
        "padding": _pair(padding if padding is not None else 0),
        "dilation": _pair(dilation if dilation is not None else 1),
        "ceil_mode": bool(ceil_mode),
    }
    if attrs["dilation"] != [1, 1]:
        raise ctx.unsupported(node, f"max pooling with dilation {attrs['dilation']} is not supported")
    if len(ctx.shape(x)) != 3:
        raise ctx.unsupported(node, f"max_pool2d expects (batch, C, H, W) input, got (batch, {ctx.shape(x)})")
    in_hw, out_hw = ctx.shape(x)[1:], ctx.shape(node)[1:]
    floor_hw = tuple((n - k) // s + 1 for n, k, s in zip(in_hw, kernel, attrs["stride"]))
    if attrs["padding"] != [0, 0] or out_hw != floor_hw:
        raise ctx.unsupported(
            node, f"max pooling with padding {attrs['padding']} / ceil_mode={attrs['ceil_mode']} "
            f"(windows that overhang the input) is not supported yet; use padding=0, ceil_mode=False")
    return Layer(name=ctx.new_name(node, prefer_module=False), op="max_pool2d",
                 inputs=[ctx.activation(x, node)], out_shape=ctx.shape(node),
                 source=ctx.source(node), attrs=attrs)
