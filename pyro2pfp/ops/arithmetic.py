"""Linear elementwise ops: per-channel affine (folded eval-mode batch norm) and the residual add."""
from __future__ import annotations

from .registry import OpDef, register_op

AFFINE = register_op(OpDef(
    "affine", ("aten.batch_norm.default", "aten._native_batch_norm_legit_no_training.default"),
    modules="`BatchNorm1d/2d` in eval mode", modules_short=("BatchNorm1d/2d (eval)",),
    moments="exact (linear)", assumptions="deterministic normalisation parameters"))

ADD = register_op(OpDef(
    "add", ("aten.add.Tensor", "aten.add_.Tensor"),
    modules="`x + y` (residual)", modules_short=("residual '+'",),
    moments="exact for independent summands",
    assumptions="**the two branches are treated as independent** (they share their input, so this "
                "underestimates or overestimates the variance by their covariance)"))
