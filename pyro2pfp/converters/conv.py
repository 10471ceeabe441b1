"""Convolutions → PFP ``conv2d`` (weight (out, in/groups, kh, kw), optional bias).

``conv1d`` becomes ``reshape (C, 1, L)`` → ``conv2d`` with a 1×k kernel → ``reshape (O, L')``;
``padding="same"``/``"valid"`` become explicit (symmetric) padding.
"""
from __future__ import annotations

from ..graph import GaussianParam, Layer
from ._registry import register


def _pair(value, n: int = 2) -> list[int]:
    value = list(value) if isinstance(value, list | tuple) else [value]
    return [int(v) for v in (value * n if len(value) == 1 else value)]


def _string_padding(node, ctx, padding: str, kernel: list[int], dilation: list[int]) -> list[int]:
    if padding == "valid":
        return [0] * len(kernel)
    totals = [d * (k - 1) for k, d in zip(kernel, dilation)]
    if any(t % 2 for t in totals):
        raise ctx.unsupported(node, f"padding='same' with kernel {kernel} needs asymmetric padding; "
                                    "use an odd kernel or explicit padding")
    return [t // 2 for t in totals]


def _conv_params(node, ctx, weight, bias, reshape_to_2d: bool) -> dict[str, GaussianParam]:
    w = ctx.param(weight, node, "weight")
    if reshape_to_2d:
        shape = (w.shape[0], w.shape[1], 1, w.shape[2])
        w = GaussianParam(w.mean.reshape(shape), w.var.reshape(shape), site=w.site)
    params = {"weight": w}
    if bias is not None:
        params["bias"] = ctx.param(bias, node, "bias")
    return params


@register("aten.conv2d.default", "aten.conv2d.padding", produces=("conv2d",))
def convert_conv2d(node, ctx) -> Layer:
    args = list(node.args) + [None] * 7
    x, weight, bias, stride, padding, dilation, groups = args[:7]
    if len(ctx.shape(x)) != 3:
        raise ctx.unsupported(node, f"conv2d expects (batch, C, H, W) input, got (batch, {ctx.shape(x)})")
    params = _conv_params(node, ctx, weight, bias, reshape_to_2d=False)
    dilation = _pair(dilation if dilation is not None else 1)
    if isinstance(padding, str):
        padding = _string_padding(node, ctx, padding, list(params["weight"].shape[2:]), dilation)
    attrs = {
        "stride": _pair(stride if stride is not None else 1),
        "padding": _pair(padding if padding is not None else 0),
        "dilation": dilation,
        "groups": int(groups) if groups is not None else 1,
    }
    return Layer(name=ctx.new_name(node, prefer_module=True), op="conv2d",
                 inputs=[ctx.activation(x, node)], out_shape=ctx.shape(node),
                 source=ctx.source(node), attrs=attrs, params=params)


@register("aten.conv1d.default", "aten.conv1d.padding", produces=("conv2d", "reshape"))
def convert_conv1d(node, ctx) -> list[Layer]:
    args = list(node.args) + [None] * 7
    x, weight, bias, stride, padding, dilation, groups = args[:7]
    if len(ctx.shape(x)) != 2:
        raise ctx.unsupported(node, f"conv1d expects (batch, C, L) input, got (batch, {ctx.shape(x)})")
    c, length = ctx.shape(x)
    params = _conv_params(node, ctx, weight, bias, reshape_to_2d=True)
    dilation = _pair(dilation if dilation is not None else 1, 1)[0]
    if isinstance(padding, str):
        padding = _string_padding(node, ctx, padding, [params["weight"].shape[3]], [dilation])
    o, out_len = ctx.shape(node)
    name = ctx.new_name(node, prefer_module=True)
    attrs = {"stride": [1, _pair(stride if stride is not None else 1, 1)[0]],
             "padding": [0, _pair(padding if padding is not None else 0, 1)[0]],
             "dilation": [1, dilation], "groups": int(groups) if groups is not None else 1}
    source = ctx.source(node)
    return [
        Layer(name=f"{name}_to_2d", op="reshape", inputs=[ctx.activation(x, node)], out_shape=(c, 1, length),
              source=source),
        Layer(name=f"{name}_2d", op="conv2d", inputs=[f"{name}_to_2d"], out_shape=(o, 1, out_len),
              source=source, attrs=attrs, params=params),
        Layer(name=name, op="reshape", inputs=[f"{name}_2d"], out_shape=(o, out_len), source=source),
    ]
