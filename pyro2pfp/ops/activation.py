"""Activation ops: ReLU and LeakyReLU moment matching of a Gaussian input."""
from __future__ import annotations

from .registry import OpDef, register_op

RELU = register_op(OpDef(
    "relu", ("aten.relu.default", "aten.relu_.default"),
    modules="`ReLU`", modules_short=("ReLU",),
    moments="exact for a Gaussian input", assumptions="input treated as Gaussian", fusable=True))

LEAKY_RELU = register_op(OpDef(
    "leaky_relu", ("aten.leaky_relu.default", "aten.leaky_relu_.default"),
    modules="`LeakyReLU(slope)`", modules_short=("LeakyReLU",),
    moments="exact (`Cov(a, relu a) = v·Φ(α)`, Stein's lemma)", assumptions="input treated as Gaussian"))
