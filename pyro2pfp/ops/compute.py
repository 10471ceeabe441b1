"""Compute layers (Gaussian weights): dense and conv2d."""
from __future__ import annotations

from .registry import OpDef, register_op

DENSE = register_op(OpDef(
    "dense", ("aten.linear.default",),
    modules="`Linear`", modules_short=("Linear",),
    moments="mean, variance exact for independent inputs/weights",
    assumptions="mean-field weights, independent inputs", compute_layer=True))

CONV2D = register_op(OpDef(
    "conv2d", ("aten.conv2d.default", "aten.conv2d.padding", "aten.conv1d.default", "aten.conv1d.padding"),
    modules="`Conv2d` (stride, padding incl. `\"same\"` for odd kernels, dilation, groups), `Conv1d`",
    modules_short=("Conv1d", "Conv2d"), moments="as dense",
    assumptions="as dense (shared weights make outputs correlated: ignored downstream)", compute_layer=True))
