"""Layers that only move data: view/reshape/flatten → PFP ``reshape``; dropout/clone/… → identity."""
from __future__ import annotations

import warnings

from ..graph import Layer
from ._registry import Alias, register


@register("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
          "aten.flatten.using_ints", "aten.unflatten.int", "aten.squeeze.dim", "aten.squeeze.dims",
          "aten.squeeze.default", "aten.unsqueeze.default", produces=("reshape",))
def convert_reshape(node, ctx) -> Layer | Alias:
    x = node.args[0]
    if ctx.shape(x) == ctx.shape(node):
        return Alias(x)
    return Layer(name=ctx.new_name(node, prefer_module=False), op="reshape",
                 inputs=[ctx.activation(x, node)], out_shape=ctx.shape(node), source=ctx.source(node))


@register("aten.dropout.default", "aten.feature_dropout.default", "aten.alpha_dropout.default")
def convert_dropout(node, ctx) -> Alias:
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", False)
    if train:
        warnings.warn(f"{ctx.source(node)}: dropout is called with training=True; PFP treats it as "
                      "the identity (inference mode). Use nn.Dropout or F.dropout(x, p, self.training).",
                      stacklevel=2)
    return Alias(node.args[0])


@register("aten.clone.default", "aten.contiguous.default", "aten.detach.default", "aten.alias.default",
          "aten.identity.default")
def convert_identity(node, ctx) -> Alias:
    return Alias(node.args[0])
