"""Pooling: ``max_pool2d`` (pairwise Gaussian max over each window), ``avg_pool2d`` (linear), and
global/adaptive average pooling and ``mean`` over (H, W) as average pooling."""
from __future__ import annotations

from ..graph import Layer
from ._registry import register
from .conv import _pair


def _window_attrs(node, ctx, kernel, stride, padding, ceil_mode) -> dict:
    kernel = _pair(kernel)
    attrs = {
        "kernel": kernel,
        "stride": _pair(stride) if stride not in (None, [], ()) else list(kernel),
        "padding": _pair(padding if padding is not None else 0),
        "ceil_mode": bool(ceil_mode),
    }
    if any(p > k // 2 for p, k in zip(attrs["padding"], kernel)):
        raise ctx.unsupported(node, f"padding {attrs['padding']} larger than half the kernel {kernel}")
    return attrs


def _check_4d(node, ctx, x) -> None:
    if len(ctx.shape(x)) != 3:
        raise ctx.unsupported(node, f"expects (batch, C, H, W) input, got (batch, {ctx.shape(x)})")


@register("aten.max_pool2d.default", "aten.max_pool2d_with_indices.default", produces=("max_pool2d",))
def convert_max_pool2d(node, ctx) -> Layer:
    args = list(node.args) + [None] * 6
    x, kernel, stride, padding, dilation, ceil_mode = args[:6]
    _check_4d(node, ctx, x)
    attrs = _window_attrs(node, ctx, kernel, stride, padding, ceil_mode)
    attrs["dilation"] = _pair(dilation if dilation is not None else 1)
    if attrs["dilation"] != [1, 1]:
        raise ctx.unsupported(node, f"max pooling with dilation {dilation} is not supported")
    return Layer(name=ctx.new_name(node, prefer_module=False), op="max_pool2d",
                 inputs=[ctx.activation(x, node)], out_shape=ctx.shape(node),
                 source=ctx.source(node), attrs=attrs)


@register("aten.avg_pool2d.default", produces=("avg_pool2d",))
def convert_avg_pool2d(node, ctx) -> Layer:
    args = list(node.args) + [None] * 7
    x, kernel, stride, padding, ceil_mode, count_include_pad, divisor = args[:7]
    _check_4d(node, ctx, x)
    attrs = _window_attrs(node, ctx, kernel, stride, padding, ceil_mode)
    attrs["count_include_pad"] = True if count_include_pad is None else bool(count_include_pad)
    attrs["divisor"] = int(divisor) if divisor is not None else None
    if attrs["ceil_mode"] and attrs["padding"] != [0, 0]:
        raise ctx.unsupported(node, "average pooling with both padding and ceil_mode is not supported")
    return Layer(name=ctx.new_name(node, prefer_module=False), op="avg_pool2d",
                 inputs=[ctx.activation(x, node)], out_shape=ctx.shape(node),
                 source=ctx.source(node), attrs=attrs)


def _global_average(node, ctx, x, keep_shape: bool) -> list[Layer]:
    c, h, w = ctx.shape(x)
    attrs = {"kernel": [h, w], "stride": [h, w], "padding": [0, 0], "ceil_mode": False,
             "count_include_pad": True, "divisor": None}
    pool = Layer(name=ctx.new_name(node, prefer_module=False), op="avg_pool2d",
                 inputs=[ctx.activation(x, node)], out_shape=(c, 1, 1), source=ctx.source(node), attrs=attrs)
    if keep_shape:
        return [pool]
    flat = Layer(name=ctx.new_name(node, prefer_module=False), op="reshape", inputs=[pool.name],
                 out_shape=ctx.shape(node), source=ctx.source(node))
    return [pool, flat]


@register("aten.adaptive_avg_pool2d.default", produces=("avg_pool2d", "reshape"))
def convert_adaptive_avg_pool2d(node, ctx) -> list[Layer]:
    x, size = node.args[:2]
    _check_4d(node, ctx, x)
    c, h, w = ctx.shape(x)
    oh, ow = ctx.shape(node)[1:]
    if (oh, ow) == (1, 1):
        return _global_average(node, ctx, x, keep_shape=True)
    if h % oh or w % ow:
        raise ctx.unsupported(node, f"adaptive average pooling {h}x{w} -> {oh}x{ow} with unequal windows; "
                                    "only output sizes that divide the input are supported")
    attrs = {"kernel": [h // oh, w // ow], "stride": [h // oh, w // ow], "padding": [0, 0],
             "ceil_mode": False, "count_include_pad": True, "divisor": None}
    return [Layer(name=ctx.new_name(node, prefer_module=False), op="avg_pool2d",
                  inputs=[ctx.activation(x, node)], out_shape=(c, oh, ow), source=ctx.source(node), attrs=attrs)]


@register("aten.mean.dim", produces=("avg_pool2d", "reshape"))
def convert_mean(node, ctx) -> list[Layer]:
    x, dims = node.args[:2]
    keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
    rank = len(ctx.shape(x)) + 1
    if rank != 4 or sorted(d % rank for d in dims) != [2, 3]:
        raise ctx.unsupported(node, f"mean over dims {list(dims)}; only the spatial mean of (batch, C, H, W) "
                                    "(global average pooling) is supported")
    return _global_average(node, ctx, x, keep_shape=keepdim)
