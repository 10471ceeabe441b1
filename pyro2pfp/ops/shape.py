"""Shape and representation ops: reshape (a view) and the planner's representation ``convert``."""
from __future__ import annotations

from .registry import OpDef, register_op

RESHAPE = register_op(OpDef(
    "reshape", ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
                "aten.flatten.using_ints", "aten.unflatten.int", "aten.squeeze.default", "aten.squeeze.dim",
                "aten.squeeze.dims", "aten.unsqueeze.default"),
    modules="`Flatten`, `view`, `reshape`, `Dropout` (inference), `Identity`",
    modules_short=("Flatten/view/reshape",), moments="identity", assumptions="—", table_op="reshape / none",
    view=True, required_tests=("compiled",)))  # the identity on moments: nothing to sample

CONVERT = register_op(OpDef(
    "convert", modules="(inserted by the planner: variance ↔ second moment)",
    moments="exact", assumptions="—", internal=True, fusable=True))
