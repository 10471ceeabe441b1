"""Normalisation over features: ``LayerNorm`` (``layer_norm``).

``y = γ·z + β``, ``z = (x − m)·r``, ``r = 1/√(s² + ε)``, with ``m``, ``s²`` the mean and the (biased)
variance of ``x`` over the ``D`` normalised trailing dims.  PFP rule (an approximation, stated in the
OpDef's assumptions): LayerNorm is **linearised at the input means** (the delta method):

* the statistics take their **mean-path values**: ``m``, ``s²`` are the mean and variance of the input
  *means* ``μ`` over the normalised dims (what the deterministic network computes at the posterior
  mean), and the output mean is ``z = (μ − m)·r`` (first order: the curvature's O(v) shift is dropped);
* the variance is that of the linearisation, whose Jacobian includes the statistics' own dependence on
  the input, ``∂z_j/∂x_k = r·(δ_jk − (1 + z_j·z_k)/D)``; for independent inputs of variance ``v``:
  ``Var z_j = r²·(v_j·(1 − 2(1 + z_j²)/D) + (A0 + 2z_j·A1 + z_j²·A2)/D)`` with the row averages
  ``A0 = mean(v)``, ``A1 = mean(z·v)``, ``A2 = mean(z²·v)`` (clamped at 0 against rounding).  Keeping only
  ``r²·v_j`` (the statistics held fixed) overestimates the variance of the outlying elements by up to
  2× even for small input variances (the ``z_j²/D`` term; ``tests/test_smooth_activations.py``);
* the affine part with independent (possibly Gaussian) ``γ``, ``β`` is exact:
  ``E y = μγ·z + μβ``, ``Var y = μγ²·Var z + vγ·(z² + Var z) + vβ``.

When it is good: input variances small against the spread of the means across the features (the usual
case after a trained layer; measured: variance within a few % and mean within 0.2 output sd for
``v ≤ 0.01·spread²``, ``D = 16``).  When it is not: input variances comparable to or larger than that
spread (e.g. all means nearly equal), where ``z`` is far from linear in ``x``: the true output variance
is then bounded by ``γ²·(D − 1)`` (the normalised row has norm √D) and the rule can exceed it by orders of
magnitude.

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
    moments="delta method at the input means: `z = (μ − m)/√(s²+ε)`, `Var z_j = r²(v_j(1 − 2(1+z_j²)/D) + "
            "mean_k((1 + z_j z_k)² v_k)/D)`; `γ`, `β`: `μγ·z + μβ`, `μγ²·Var z + vγ(z² + Var z) + vβ` (exact)",
    assumptions="**linearised at the input means**: the statistics `m`, `s²` are those of the input *means*, the "
                "output mean is first order, the variance that of the linearisation (good when input variances "
                "are small against the spread of the means over the normalised dims — measured within a few % "
                "at v ≤ 0.01·spread²; poor when they are comparable or larger); `γ`, `β` independent of the input",
    # a Gaussian γ or β makes a deterministic input random: never kept deterministic
    contract=Contract(Repr.VARIANCE, Repr.VARIANCE, keeps_deterministic=False)))


# ------------------------------------------------------------------------------------ reference + ONNX
@formula("layer_norm")
def layer_norm(bk: Any, layer: PlannedLayer, inputs: list[Any]) -> Any:
    """Linearised LayerNorm (module docstring).  The row averages are matrix products with a ``(1, D)`` row
    of ``1/D`` on the input reshaped to ``(batch, P, D)`` (standard MatMul in ONNX at every opset),
    broadcast back over the row."""
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
    var = z * z * t["weight_var"] + t["bias_var"]
    if x.repr is not Repr.DETERMINISTIC:
        v = bk.reshape(bk.variance(x), rows)
        zv = z * v
        a0, a1, a2 = bk.dense(v, avg, "row_v"), bk.dense(zv, avg, "row_zv"), bk.dense(z * zv, avg, "row_zzv")
        z2 = z * z
        inner = (v * (ops.const(1.0) - ops.const(2.0 / d) * (ops.const(1.0) + z2))
                 + ops.const(1.0 / d) * (a0 + ops.const(2.0) * z * a1 + z2 * a2))
        var_z = ops.maximum(inner, ops.const(0.0)) * (inv * inv)
        var = var + var_z * (t["weight_mean"] * t["weight_mean"] + t["weight_var"])
    return bk.emit(bk.reshape(mean, shape), bk.reshape(var, shape), layer)


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
