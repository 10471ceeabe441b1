"""Normalisation over features: ``LayerNorm`` (``layer_norm``).

``y = γ·z + β``, ``z = (x − m)·r``, ``r = 1/√(s² + ε)``, with ``m``, ``s²`` the mean and the (biased)
variance of ``x`` over the ``D`` normalised trailing dims.  PFP rule (an approximation, stated in the
OpDef's assumptions):

* the **statistics are fixed at their expected values**: ``m = mean(μ)`` (the mean of the row mean) and
  ``s² = E[s²] = mean((μ − mean μ)²) + (1 − 1/D)·mean(v)`` (exact for independent inputs: the spread of
  the means plus the inputs' own variance), so the output mean is ``z = (μ − m)·r``.  For ``v → 0`` these
  are the mean-path statistics (what the deterministic network computes at the posterior mean); for
  input variances comparable to the spread of the means -- typical of Bayesian layers before a
  LayerNorm, whose weight scale the normalisation makes unidentifiable -- the mean-path ``s²`` is far too
  small, and the output variance comes out several times too large;
* the variance is that of LayerNorm **linearised** at the input means (the delta method), whose
  Jacobian includes the statistics' own dependence on the input, ``∂z_j/∂x_k = r·(δ_jk − (1 + z_j·z_k)/D)``;
  for independent inputs of variance ``v``:
  ``Var z_j = r²·(v_j·(1 − 2(1 + z_j²)/D) + (A0 + 2z_j·A1 + z_j²·A2)/D)`` with the row averages
  ``A0 = mean(v)``, ``A1 = mean(z·v)``, ``A2 = mean(z²·v)`` (clamped at 0 against rounding).  Keeping only
  ``r²·v_j`` (the statistics held fixed) overestimates the variance of the outlying elements by up to
  2× even for small input variances (the ``z_j²/D`` term);
* the affine part with independent (possibly Gaussian) ``γ``, ``β`` is exact:
  ``E y = μγ·z + μβ``, ``Var y = μγ²·Var z + vγ·(z² + Var z) + vβ``.

``tests/ops/activations/test_smooth_activations.py`` checks the rule against Monte Carlo (μ ~ N(0, 1) per feature,
v/spread² from 0.01 to 1e6, D = 16 and 64): mean within 0.1 output sd, variance ratio within [0.85, 1.1].
It is poor for few normalised features (D ≤ 4; D = 2 is a sign function), where ``s²`` itself
fluctuates by O(1), and the test shows that too.

Shared-factor PFP (a LayerNorm of a flat edge, e.g. a dense head; :func:`layer_norm_shared`): the
same linearisation applied to the input's loadings ``L_k = s_k·g_row(k)``, so the factors' part of the
input covariance is summed through the Jacobian coherently, and the output features carry the
loadings ``μγ·(J·L)``.

The TVM kernel and its CPU schedule: ``backends/tvm/ops/normalization.py``.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..correlation.factors import FactorPlan
from ..correlation.loadings import CompactPlan, Loadings, TensorAlgebra
from ..correlation.shared import Shared
from ..correlation.shared_algebra import SharedAlgebra, clip, normalised
from ..planning.converters import register
from ..planning.graph import GaussianParam, Layer, Repr
from ..planning.plan import PlannedLayer, stored_variance
from ..planning.registry import CompactSpec, Contract, FactorSpec, OpDef, register_op
from ._formula import compact_formula, formula, shared_formula

LAYER_NORM = register_op(OpDef(
    "layer_norm", ("aten.layer_norm.default",),
    modules="`LayerNorm` over the last dim(s), with or without elementwise affine (`γ`, `β` parameters or "
            "Gaussian sample sites)", modules_short=("LayerNorm",),
    moments="statistics at their expected values, `m = mean(μ)`, `s² = mean((μ − m)²) + (1 − 1/D)·mean(v)`; "
            "mean `z = (μ − m)/√(s²+ε)`; variance of the linearisation, `Var z_j = r²(v_j(1 − 2(1+z_j²)/D) + "
            "mean_k((1 + z_j z_k)² v_k)/D)`; `γ`, `β`: `μγ·z + μβ`, `μγ²·Var z + vγ(z² + Var z) + vβ` (exact)",
    assumptions="**approximation**: the row statistics are fixed at their expected values and the variance is "
                "that of the linearisation at the input means (tested against Monte Carlo for v/spread² "
                "from 1e-2 to 1e6 at D = 16 and 64: mean within 0.1 output sd, variance ratio within "
                "[0.85, 1.1]; poor for D ≤ 4); `γ`, `β` independent of the input",
    # a Gaussian γ or β makes a deterministic input random: never kept deterministic
    contract=Contract(Repr.VARIANCE, Repr.VARIANCE, keeps_deterministic=False),
    factor_spec=FactorSpec(refuse=lambda layer: _refused(layer)), compact_spec=CompactSpec(keeps_units=True),
    stored_tensors=lambda layer, input_repr, calibration: _stored(layer, calibration)))


def _stored(layer: Layer, calibration: float) -> dict[str, np.ndarray]:
    """``γ``, ``β``: their means and calibrated variances."""
    return {f"{name}_{what}": value for name in ("weight", "bias") for what, value in
            (("mean", layer.params[name].mean), ("var", stored_variance(layer.params[name].var, calibration)))}


def _refused(layer: PlannedLayer) -> str | None:
    """The shared-factor rule covers a LayerNorm of a flat edge (each output feature its own row)."""
    shape = tuple(layer.layer.out_shape)
    if len(shape) == 1:
        return None
    return (f"LayerNorms of an unflattened edge (shape {shape}: its rows mix the channels that carry the "
            "factors)")


# ------------------------------------------------------------------------------------ reference + ONNX
@formula("layer_norm")
def layer_norm(bk: Any, layer: PlannedLayer, inputs: list[Any]) -> Any:
    """LayerNorm with expected statistics and a linearised variance (module docstring).  The row averages
    are matrix products with a ``(1, D)`` row of ``1/D`` on the input reshaped to ``(batch, P, D)``
    (standard MatMul in ONNX at every opset), broadcast back over the row."""
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
    s2 = bk.dense(centred * centred, avg, "row_var")  # the spread of the means
    random = x.repr is not Repr.DETERMINISTIC
    if random:
        v = bk.reshape(bk.variance(x), rows)
        a0 = bk.dense(v, avg, "row_v")
        s2 = s2 + ops.const(1.0 - 1.0 / d) * a0  # E[s²] over the inputs' noise
    inv = ops.const(1.0) / ops.sqrt(s2 + ops.const(float(layer.layer.attrs["eps"])))
    z = centred * inv
    t = {name: bk.tensor(layer.tensors[name].reshape(d), name)
         for name in ("weight_mean", "weight_var", "bias_mean", "bias_var")}
    mean = z * t["weight_mean"] + t["bias_mean"]
    var = z * z * t["weight_var"] + t["bias_var"]
    if random:
        zv = z * v
        a1, a2 = bk.dense(zv, avg, "row_zv"), bk.dense(z * zv, avg, "row_zzv")
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


# ------------------------------------------------------------------------------------ compact factor rule
@compact_formula("layer_norm")
def layer_norm_compact(bk: TensorAlgebra, layer: PlannedLayer, inputs: list[Any], loads: list[Loadings | None],
                       plan: CompactPlan, mean: Any, var: Any) -> tuple[Any, Any, Any]:
    """LayerNorm in the compact factor plan, linearised as the op's own variance is (the delta method with
    the Jacobian ``J_jk = r·(δ_jk − (1 + z_j·z_k)/D)`` of ``z``, which includes the statistics' dependence on
    the input): loadings ``L ↦ μγ·(J·L)`` per normalised row -- the mean over the row and its projection on
    ``z`` removed, then scaled by ``r`` -- and ``v += (μγ² + vγ)·(‖J·L‖² − Σ_k J_jk²·‖L_k‖²)`` (the
    inputs' factor part summed through ``J`` coherently in place of independently).  Block columns become
    global (the row mixes channels)."""
    x, ld = inputs[0], loads[0]
    if ld is None:
        return None, mean, var
    ops = bk.ops
    shape = tuple(layer.layer.out_shape)
    k = int(layer.layer.attrs["dims"])
    d = math.prod(shape[len(shape) - k:])
    rows = math.prod(shape) // d
    inv_d = 1.0 / d
    mu = bk.reshape(x.mean, (rows, d))
    centred = mu - bk.reshape(bk.rsum(mu, 2), (rows, 1)) * inv_d
    s2 = bk.rsum(centred * centred, 2) * inv_d
    if x.repr is not Repr.DETERMINISTIC:
        s2 = s2 + (1.0 - inv_d) * inv_d * bk.rsum(bk.reshape(bk.variance(x), (rows, d)), 2)
    r = bk.reshape(1.0 / ops.sqrt(s2 + float(layer.layer.attrs["eps"])), (rows, 1))
    z = centred * r                                                              # (B, rows, D)
    gm = layer.tensors["weight_mean"].reshape(d)
    gv = layer.tensors["weight_var"].reshape(d)
    columns = {key: (g, ld.glob_width[key]) for key, g in ld.glob.items()}
    for key, (g, kk) in ld.blocks_as_global(bk).items():
        columns[key] = (columns[key][0] + g, kk) if key in columns else (g, kk)
    # J_jk² = r²·((1 − 2·(1 + z_j²)/D)·δ_jk + ((1 + z_j·z_k)/D)²)  (B, rows, D, D)
    diag = bk.reshape((1.0 - 2.0 * inv_d) - (2.0 * inv_d) * z * z, (rows, d, 1)) * bk.tensor(np.eye(d), "eye")
    outer = (bk.einsum("brj,brk->brjk", z, z) + 1.0) * inv_d
    jsq = bk.reshape(r * r, (rows, 1, 1)) * (diag + outer * outer)
    out = Loadings()
    coherent = independent = None
    r3, z3 = bk.reshape(r, (rows, 1, 1)), bk.reshape(z, (rows, d, 1))
    for key, (col, kk) in columns.items():
        lc = bk.reshape(col, (rows, d, kk))
        # J·L = r·(L − mean(L) − z·mean(z·L))
        jl = r3 * (lc - bk.reshape(bk.rsum(lc, 2), (rows, 1, kk)) * inv_d
                   - z3 * bk.reshape(bk.rsum(z3 * lc, 2), (rows, 1, kk)) * inv_d)
        c_part = bk.rsum(jl * jl, 3)
        i_part = bk.einsum("brjk,brk->brj", jsq, bk.rsum(lc * lc, 3))
        coherent = c_part if coherent is None else coherent + c_part
        independent = i_part if independent is None else independent + i_part
        out.glob[key] = bk.reshape(jl * bk.tensor(gm.reshape(d, 1), "gamma"), (rows * d, kk))
        out.glob_width[key] = kk
    assert coherent is not None and independent is not None
    correction = bk.tensor(gm**2 + gv, "gamma_second") * (coherent - independent)
    var = ops.maximum(var + bk.reshape(correction, shape), ops.const(0.0))
    return out, mean, var


# ------------------------------------------------------------------------------------ shared-factor rule
def shared_terms(ops: Any, z: Any, r: Any, s2: Any, b0: Any, b1: Any, b2: Any, d: int) -> Any:
    """``Σ_k J_jk²·s_k²``: the part of the linearised variance (module docstring) that treats the inputs'
    shared parts ``s_k`` as independent -- the same formula as the input-variance term with ``s²`` in
    place of ``v`` (``B0 = mean(s²)``, ``B1 = mean(z·s²)``, ``B2 = mean(z²·s²)`` over the row)."""
    z2 = z * z
    return r * r * (s2 * (ops.const(1.0) - ops.const(2.0 / d) * (ops.const(1.0) + z2))
                    + ops.const(1.0 / d) * (b0 + ops.const(2.0) * z * b1 + z2 * b2))


@shared_formula("layer_norm")
def layer_norm_shared(bk: SharedAlgebra, layer: PlannedLayer, inputs: list[Any], shared: list[Shared | None],
                      fp: FactorPlan, var: Any) -> tuple[Shared | None, Any]:
    """LayerNorm of a flat edge of ``D`` features with the input's shared part ``L_k = s_k·g_row(k)``
    (``row(k)``: the input row feature ``k`` belongs to -- itself after a dense layer, its channel after a
    flattened conv).  The delta method of the op's own variance with ``J_jk = r·(δ_jk − (1 + z_j·z_k)/D)``
    (module docstring):

    * loadings ``ℓ_j = μγ_j·(J·L)_j``, ``(J·L)_j = r·(L_j − mean_k L_k − z_j·mean_k(z_k·L_k))``;
      ``s = ‖ℓ‖``, ``g = ℓ/‖ℓ‖`` (each feature its own row, as after a dense layer);
    * ``v = v_mf + (μγ² + vγ)·(‖(J·L)_j‖² − Σ_k J_jk²·s_k²)``: the factors' part summed through ``J``
      with its correlations instead of as independent (clamped at 0).

    Exact for a linear map; ``γ``, ``β`` independent of the input (their own noise stays mean-field)."""
    x, sh = inputs[0], shared[0]
    if sh is None:
        return None, var
    ops = bk.ops
    shape = tuple(layer.layer.out_shape)
    d = int(np.prod(shape))
    k, rows = fp.width[layer.name], fp.rows[layer.inputs[0]]
    mu, v = bk.reshape(x.mean, (d,)), bk.reshape(bk.variance(x), (d,))
    inv_d = ops.const(1.0 / d)

    def mean(t: Any, *kept: int) -> Any:  # over the features: (B, 1) or (B, 1, K)
        return bk.reshape(bk.rsum(t, 1), (1, *kept)) * inv_d

    centred = mu - mean(mu)
    s2_row = mean(centred * centred) + ops.const(1.0 - 1.0 / d) * mean(v)
    r = ops.const(1.0) / ops.sqrt(s2_row + ops.const(float(layer.layer.attrs["eps"])))
    z = centred * r
    s = bk.reshape(sh.s, (d,))
    expand = np.repeat(np.eye(rows), d // rows, axis=0)                              # (D, rows)
    loads = bk.einsum("bd,dr,brf->bdf", s, bk.tensor(expand, "ln_rows"), bk.widened(sh.g, sh.k, k))
    z3 = bk.reshape(z, (d, 1))
    jl = bk.reshape(r, (1, 1)) * (loads - mean(loads, k) - z3 * mean(z3 * loads, k))
    s2 = s * s
    independent = shared_terms(ops, z, r, s2, mean(s2), mean(z * s2), mean(z * z * s2), d)
    gm, gv = (layer.tensors[n].reshape(d) for n in ("weight_mean", "weight_var"))
    coherent = bk.rsum(jl * jl, 2)
    var = bk.reshape(var, (d,)) + bk.tensor(gm**2 + gv, "ln_gamma_second") * (coherent - independent)
    var = ops.maximum(var, ops.const(0.0))
    g, norm = normalised(bk, bk.tensor(gm.reshape(d, 1), "ln_gamma") * jl, d)
    return Shared(bk.reshape(clip(bk, norm, var), shape), g, k), bk.reshape(var, shape)
