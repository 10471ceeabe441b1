"""Shape and representation ops: ``reshape`` (flatten/view/squeeze, a view on both components), the
planner's representation ``convert`` (``s = μ² + v`` or ``v = s − μ²``, ``pfp-math.md``
"Representation planning"), and the torch ops that are the identity at inference (dropout, clone, …).

The TVM kernels are in ``tvm_backend/ops/shape.py``.
"""
from __future__ import annotations

import warnings
from typing import Any

from ..converters import Alias, register
from ..graph import Layer
from ..plan import PlannedLayer
from ..registry import Contract, OpDef, register_op
from ._formula import formula

_PASS_THROUGH = Contract(takes=None, natural=None, keeps_deterministic=True)

RESHAPE = register_op(OpDef(
    "reshape", ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
                "aten.flatten.using_ints", "aten.unflatten.int", "aten.squeeze.default", "aten.squeeze.dim",
                "aten.squeeze.dims", "aten.unsqueeze.default"),
    modules="`Flatten`, `view`, `reshape`, `Dropout` (inference), `Identity`",
    modules_short=("Flatten/view/reshape",), moments="identity", assumptions="—", table_op="reshape / none",
    contract=_PASS_THROUGH, view=True, required_tests=("compiled",)))  # the identity on moments: nothing to sample

CONVERT = register_op(OpDef(
    "convert", modules="(inserted by the planner: variance ↔ second moment)",
    moments="exact", assumptions="—", contract=_PASS_THROUGH, internal=True))


# ------------------------------------------------------------------------------------ reference + ONNX
@formula("reshape")
def reshape(bk: Any, layer: PlannedLayer, inputs: list[Any]) -> Any:
    """Identity on both components, batch dimension kept first."""
    x, shape = inputs[0], tuple(layer.layer.out_shape)
    second = None if x.second is None else bk.reshape(x.second, shape)
    return type(x)(bk.reshape(x.mean, shape), second, x.repr)


@formula("convert")
def convert(bk: Any, layer: PlannedLayer, inputs: list[Any]) -> Any:
    """The input re-expressed in the representation the plan asks for."""
    x = inputs[0]
    return bk.emit(x.mean, bk.variance(x), layer)


# ------------------------------------------------------------------------------------ converters
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
