"""Pooling ops: max pooling (Clark's max) and average pooling (linear)."""
from __future__ import annotations

from .registry import OpDef, register_op

MAX_POOL2D = register_op(OpDef(
    "max_pool2d", ("aten.max_pool2d.default", "aten.max_pool2d_with_indices.default"),
    modules="`MaxPool2d` (any kernel, stride, padding, `ceil_mode`)", modules_short=("MaxPool2d",),
    moments="Clark's max, exact for two inputs",
    assumptions="pairwise fold over the window in row-major order; independent inputs"))

AVG_POOL2D = register_op(OpDef(
    "avg_pool2d", ("aten.avg_pool2d.default", "aten.adaptive_avg_pool2d.default", "aten.mean.dim"),
    modules="`AvgPool2d`, `AdaptiveAvgPool2d` (output dividing the input, e.g. 1×1), `x.mean((2, 3))`",
    modules_short=("AvgPool2d", "AdaptiveAvgPool2d(1)"),
    moments="exact (linear)", assumptions="independent inputs"))
