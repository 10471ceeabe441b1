"""Residual ``a + b`` of two activations → PFP ``add`` (means add; variances add, assuming independence)."""
from __future__ import annotations

import torch

from ..graph import Layer
from ._registry import register


@register("aten.add.Tensor", "aten.add_.Tensor", produces=("add",))
def convert_add(node, ctx) -> Layer:
    a, b = node.args[:2]
    alpha = node.kwargs.get("alpha", 1)
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)) or alpha != 1:
        raise ctx.unsupported(node, "only the sum of two activations (a residual connection) is supported")
    if ctx.shape(a) != ctx.shape(b):
        raise ctx.unsupported(node, f"adding shapes {ctx.shape(a)} and {ctx.shape(b)} (broadcasting) is not supported")
    return Layer(name=ctx.new_name(node, prefer_module=False), op="add",
                 inputs=[ctx.activation(a, node), ctx.activation(b, node)], out_shape=ctx.shape(node),
                 source=ctx.source(node))
