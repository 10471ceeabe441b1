"""Normalisation over features: ``LayerNorm`` (``layer_norm``).

``y = γ·(x − m)/√(s² + ε) + β`` with ``m``, ``s²`` the mean and the (biased) variance of ``x`` over
the normalised trailing dims.  PFP rule (an approximation, stated in the OpDef's assumptions):

* the **statistics are fixed at their mean-path values**: ``m``, ``s²`` are the mean and variance of
  the input *means* ``μ`` over the normalised dims (what the deterministic network would compute at
  the posterior mean), so the map is affine per example and its moments follow exactly:
  ``z = (μ − m)·r``, ``v_z = v·r²`` with ``r = 1/√(s² + ε)``;
* the affine part with independent (possibly Gaussian) ``γ``, ``β``:
  ``E y = μγ·z + μβ``, ``Var y = μγ²·v_z + vγ·(z² + v_z) + vβ`` (exact for ``γ``, ``β``
  independent of ``x``; with deterministic ``γ``, ``β`` it is ``γ²·v/(s² + ε)``).

What this neglects: the randomness of ``m`` and ``s²`` themselves.  Normalising over ``D`` features,
``Var m = Σv/D²`` and the fluctuation of ``s²`` are O(1/D) of the input's spread, so the rule is good
when the input's variances are small against the spread of its means across the features (the usual
case after a trained layer) and for wide layers; it is poor when the input variance dominates the
spread of the means (e.g. all means nearly equal): the true output then has variance ≤ γ² per
element (the normalised values are bounded), which the fixed-statistics rule can exceed by far.
``tests/test_smooth_activations.py`` measures both regimes against Monte Carlo.

The TVM kernel and its CPU schedule: ``tvm_backend/ops/normalization.py``.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..converters import register
from ..graph import GaussianParam, Layer, Repr
from ..plan import PlannedLayer
from ..registry import Contract, OpDef, register_op
from ._formula import formula

LAYER_NORM = register_op(OpDef(
    "layer_norm", ("aten.layer_norm.default",),
    modules="`LayerNorm` over the last dim(s), with or without elementwise affine (`γ`, `β` parameters or "
            "Gaussian sample sites)", modules_short=("LayerNorm",),
    moments="`μ ↦ μγ·(μ − m)/√(s²+ε) + μβ`, `v ↦ μγ²·v/(s²+ε) + vγ·(z² + v/(s²+ε)) + vβ` (exact given m, s²)",
    assumptions="**statistics fixed at their mean-path values**: `m`, `s²` are the mean and variance of the input "
                "*means* over the normalised dims (their own randomness, O(1/D), is dropped: good when input "
                "variances are small against the spread of the means, poor when they dominate it); "
                "`γ`, `β` independent of the input",
    # a Gaussian γ or β makes a deterministic input random: never kept deterministic
    contract=Contract(Repr.VARIANCE, Repr.VARIANCE, keeps_deterministic=False)))


# ------------------------------------------------------------------------------------ reference + ONNX
@formula("layer_norm")
def layer_norm(bk: Any, layer: PlannedLayer, inputs: list[Any]) -> Any:
    """Fixed-statistics LayerNorm (module docstring).  The row statistics are matrix products with a
    ``(1, D)`` row of ``1/D`` on the input reshaped to ``(batch, P, D)`` (standard MatMul in ONNX at every
    opset), broadcast back over the row."""
    x = inputs[0]
    shape = tuple(layer.layer.out_shape)
    k = int(layer.layer.attrs["dims"])
    norm = shape[len(shape) - k:]
    d = math.prod(norm)
    rows = (math.prod(shape[:len(shape) - k]), d)
    ops = bk.ops
    avg = np.full((1, d), 1.0 / d)
    mu = bk.reshape(x.mean, rows)
    centred = mu - bk.dense(mu, avg, "row_mean")
    s2 = bk.dense(centred * centred, avg, "row_var")
    inv = ops.const(1.0) / ops.sqrt(s2 + ops.const(float(layer.layer.attrs["eps"])))
    z = centred * inv
    t = {name: bk.tensor(layer.tensors[name].reshape(d), name)
         for name in ("weight_mean", "weight_var", "bias_mean", "bias_var")}
    mean = z * t["weight_mean"] + t["bias_mean"]
    var_terms = z * z * t["weight_var"] + t["bias_var"]
    if x.repr is not Repr.DETERMINISTIC:
        vz = bk.reshape(bk.variance(x), rows) * (inv * inv)
        var_terms = var_terms + vz * (t["weight_mean"] * t["weight_mean"] + t["weight_var"])
    return bk.emit(bk.reshape(mean, shape), bk.reshape(var_terms, shape), layer)


# ------------------------------------------------------------------------------------ converter
@register("aten.layer_norm.default", produces=("layer_norm",))
def convert_layer_norm(node, ctx) -> Layer:
    """``F.layer_norm(x, normalized_shape, weight, bias, eps)`` over the trailing dims of ``x``."""
    x, normalized = node.args[0], [int(n) for n in node.args[1]]
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    bias = node.args[3] if len(node.args) > 3 else node.kwargs.get("bias")
    eps = float(node.args[4] if len(node.args) > 4 else node.kwargs.get("eps", 1e-5))
    shape = ctx.shape(node)
    k = len(normalized)
    if k == 0 or k > len(shape) or list(shape[len(shape) - k:]) != normalized:
        raise ctx.unsupported(node, f"LayerNorm over {tuple(normalized)} of an input of shape (batch, "
                                    f"{', '.join(map(str, shape))}): only the trailing dims (not the batch) "
                                    "can be normalised")
    params = {}
    for name, arg, fill in (("weight", weight, 1.0), ("bias", bias, 0.0)):
        p = ctx.param(arg, node, name)
        if p is None:
            params[name] = GaussianParam(np.full(normalized, fill), np.zeros(normalized))
            continue
        if tuple(p.shape) != tuple(normalized):
            raise ctx.unsupported(node, f"LayerNorm {name} of shape {tuple(p.shape)}, expected {tuple(normalized)}")
        params[name] = p
    return Layer(name=ctx.new_name(node, prefer_module=True), op="layer_norm", inputs=[ctx.activation(x, node)],
                 out_shape=shape, source=ctx.source(node), attrs={"dims": k, "eps": eps}, params=params)
