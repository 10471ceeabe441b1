"""The compact factor rules of the compute layers (``conv2d``, ``dense``; the ops themselves: :mod:`.compute`),
each one formula for the float64 reference and the ONNX export (:func:`._formula.compact_formula`; the tensor
algebra of ``bk``: :mod:`pyro2pfp.correlation.loadings`).  The TE kernels: ``backends/tvm/ops/compute_compact.py``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backends.reference import NUMPY_BACKEND
from ..correlation.factors import weight_var
from ..correlation.loadings import CompactPlan, Loadings, TensorAlgebra
from ..planning.plan import PlannedLayer
from ._formula import compact_formula


def test_vectors(out_hw: tuple[int, ...], count: int) -> np.ndarray:
    """``(P, count)``: the range finder's test vectors over a conv's output positions -- the uniform vector,
    then the linear ramps along rows and columns (:func:`block_factor_loadings`)."""
    grids = np.meshgrid(*[np.linspace(-1.0, 1.0, n) if n > 1 else np.zeros(1) for n in out_hw], indexing="ij")
    vectors = [np.ones(int(np.prod(out_hw)))] + [g.ravel() for g in grids]
    if count > len(vectors):
        raise ValueError(f"at most {len(vectors)} weight directions per channel, not {count}")
    return np.stack(vectors[:count], axis=1)


def block_root(layer: PlannedLayer) -> tuple[np.ndarray, np.ndarray]:
    """``(√V (O, D), √v_b (O,))``: the roots of a conv's weight variances (``D = C·KH·KW``, torch order) and of
    its bias variances (zeros without a random bias)."""
    wm = layer.tensors["weight_mean"]
    bias = layer.tensors.get("bias_var")
    return (np.sqrt(weight_var(layer.tensors).reshape(wm.shape[0], -1)),
            np.sqrt(bias) if bias is not None else np.zeros(wm.shape[0]))


def block_factor_loadings(bk: Any, layer: PlannedLayer, mean_in: Any, directions: int) -> Any:
    """``(B, O, P, R)``: the conv's own weight and bias noise as ``R = directions`` factors per output channel.

    Channel ``o``'s weight and bias noise at the input mean is ``n[o, p] = Σ_j A_o[p, j]·ξ_j`` with
    ``A_o[p, j] = √V[o, j]·μ_j(p)`` (``j`` over input channels and kernel offsets, ``μ_j(p)`` the input
    mean under tap ``j`` at output position ``p``, ``ξ`` independent standard normals) and the bias as one
    more tap whose input is 1 at every position (``√v_b``).  Its covariance over positions is
    ``A_o·A_oᵀ``.  For orthonormal directions ``e_1 … e_R`` in ``ξ``-space the factors ``ζ_r = e_rᵀξ`` are
    independent standard normals with loadings ``L[o, p, r] = (A_o·e_r)[p]``; what they leave,
    ``A_o(I − E·Eᵀ)A_oᵀ``, is positive semi-definite and kept as each element's independent residual.
    The directions are the range finder of ``A_oᵀ`` (Halko, Martinsson & Tropp 2011, "Finding structure
    with randomness", SIAM Review 53(2), Alg. 4.1) with deterministic test vectors ``Ω`` over the
    positions (:func:`test_vectors`), ``E = orth(A_oᵀ·Ω)`` by modified Gram-Schmidt, ``A_oᵀ·Ω = √V ⊙
    (input views pooled with Ω)``: first the uniform vector, whose direction keeps the variance of the
    channel's spatial sum -- bias included -- exactly (``1ᵀ·L·Lᵀ·1 = 1ᵀ·A_o·A_oᵀ·1``: the noise a dense
    layer reading all positions with similar weights sees), then the linear ramps along rows and columns.
    Cost: one convolution of the input mean with per-input weights per direction."""
    a = layer.layer.attrs
    o, c, kh, kw = layer.tensors["weight_mean"].shape
    out_hw = tuple(layer.layer.out_shape[1:])
    p = int(np.prod(out_hw))
    views = bk.unfold(mean_in, c, (kh, kw), tuple(a["stride"]), tuple(a["dilation"]), tuple(a["padding"]),
                      tuple(a["padding"]), out_hw, 0.0)                                              # (B, D, P)
    root_w, root_b = block_root(layer)
    omega = test_vectors(out_hw, directions)
    pooled = bk.einsum("bdp,pr->bdr", views, bk.tensor(omega, "test_vectors"))                   # (B, D, R)
    ops = bk.ops
    qs: list[tuple[Any, Any]] = []  # orthonormal directions (weight part (B, O, D), bias part (B, O))
    loads = []
    for r in range(directions):
        v = bk.einsum("od,bd->bod", bk.tensor(root_w, "root_weight_var"), bk.rsum(bk.slice(pooled, 2, r, r + 1), 2))
        vb = bk.tensor(root_b * omega[:, r].sum(), "root_bias_var") + bk.zeros_like(bk.rsum(v, 2))
        for q, qb in qs:  # modified Gram-Schmidt against the earlier directions
            dot = bk.rsum(v * q, 2) + vb * qb
            v, vb = v - bk.reshape(dot, (o, 1)) * q, vb - dot * qb
        norm = ops.sqrt(bk.rsum(v * v, 2) + vb * vb)
        inv = ops.where(norm > ops.const(0.0), ops.const(1.0) / ops.where(norm > ops.const(0.0), norm,
                                                                          ops.const(1.0)), ops.const(0.0))
        q, qb = v * bk.reshape(inv, (o, 1)), vb * inv
        qs.append((q, qb))
        weights = bk.permute(q * bk.tensor(root_w, "root_weight_var"), (0, 2, 1))                  # (B, D, O)
        # positions × channels, channels contiguous (a compiled kernel's vectors), then (B, O, P)
        loads.append(bk.permute(bk.einsum("bdp,bdo->bpo", views, weights), (0, 2, 1))
                     + bk.reshape(qb * bk.tensor(root_b, "root_bias_var"), (o, 1)))
    if directions == 1:
        return bk.reshape(loads[0], (o, p, 1))
    return bk.concat([bk.reshape(t, (o, p, 1)) for t in loads], 2)


def conv_block_factors(layer: PlannedLayer, mean_in: np.ndarray, directions: int) -> np.ndarray:
    """:func:`block_factor_loadings` of float64 arrays."""
    return block_factor_loadings(NUMPY_BACKEND, layer, np.asarray(mean_in, dtype=np.float64), directions)


def dense_weight(layer: PlannedLayer) -> np.ndarray:
    """A conv's weight mean as (O, C, KH, KW) with every input channel (zeros between groups)."""
    wm = layer.tensors["weight_mean"]
    groups = int(layer.layer.attrs.get("groups", 1))
    if groups == 1:
        return wm
    o, cg = wm.shape[:2]
    full = np.zeros((o, cg * groups, *wm.shape[2:]))
    og = o // groups
    for gi in range(groups):
        full[gi * og:(gi + 1) * og, gi * cg:(gi + 1) * cg] = wm[gi * og:(gi + 1) * og]
    return full


@compact_formula("conv2d")
def conv2d_compact(bk: TensorAlgebra, layer: PlannedLayer, inputs: list[Any], loads: list[Loadings | None],
                   plan: CompactPlan, mean: Any, var: Any) -> tuple[Any, Any, Any]:
    """The conv2d rule of the compact factor plan (:mod:`pyro2pfp.correlation.compact`).

    The input's loadings pass through the mean weights (exact for a linear map): a global column is
    convolved with ``W``; a block column of input channel ``c`` with ``W[:, c]`` (it then loads every
    output channel: a global column; one grouped convolution of the block columns).  The output variance
    takes their coherent sum in place of the mean-field one: ``v += ‖L_out‖² − conv(‖L_in‖², W²)``.  A conv
    of the plan's ``directions`` adds its own weight noise as block factors (:func:`block_factor_loadings`).
    The mean is not changed."""
    x, ld = inputs[0], loads[0]
    a = layer.layer.attrs
    wm = layer.tensors["weight_mean"]
    o, _, kh, kw = wm.shape
    c, h, w = plan.shapes[layer.inputs[0]]
    out_shape = tuple(layer.layer.out_shape)
    p = out_shape[1] * out_shape[2]
    out = Loadings()
    if ld is not None:
        for key, g in ld.glob.items():
            k = ld.glob_width[key]
            cols = bk.rows(bk.permute(bk.reshape(g, (c, h, w, k)), (0, 4, 1, 2, 3)), (c, h, w))   # (B·k, C, H, W)
            res = bk.conv2d(cols, wm, a, "weight_mean")                                         # (B·k, O, OH, OW)
            out.glob[key] = bk.permute(bk.rows(res, (k, o * p)), (0, 2, 1))
            out.glob_width[key] = k
        if ld.block:
            wide = dense_weight(layer)
            grouped = np.ascontiguousarray(wide.transpose(1, 0, 2, 3)).reshape(c * o, 1, kh, kw)
            for key, blk in ld.block.items():
                r = ld.block_shape[key][2]
                cols = bk.rows(bk.permute(bk.reshape(blk, (c, h, w, r)), (0, 4, 1, 2, 3)), (c, h, w))  # (B·r, C, H, W)
                res = bk.conv2d(cols, grouped, {**a, "groups": c}, "weight_mean_by_channel")   # (B·r, C·O, OH, OW)
                g = bk.rows(bk.permute(bk.rows(res, (r, c, o, p)), (0, 3, 4, 2, 1)), (o * p, c * r))  # (B, O·P, C·r)
                out.glob[key] = out.glob[key] + g if key in out.glob else g
                out.glob_width[key] = c * r
        explained_in = bk.reshape(ld.explained(bk, c * h * w), (c, h, w))
        coherent = bk.reshape(out.explained(bk, o * p), out_shape)
        ops = bk.ops
        var = ops.maximum(var + coherent - bk.conv2d(explained_in, wm**2, a, "weight_mean_squared"), ops.const(0.0))
    if layer.name in plan.directions:
        r = plan.directions[layer.name]
        out.block[layer.name], out.block_shape[layer.name] = block_factor_loadings(bk, layer, x.mean, r), (o, p, r)
    return (None if out.empty() else out), mean, var


@compact_formula("dense")
def dense_compact(bk: TensorAlgebra, layer: PlannedLayer, inputs: list[Any], loads: list[Loadings | None],
                  plan: CompactPlan, mean: Any, var: Any) -> tuple[Any, Any, Any]:
    """The dense rule of the compact factor plan (:mod:`pyro2pfp.correlation.compact`).

    Output loadings ``ℓ = W·L`` (a block column of channel ``c`` through the weights of its ``P`` elements
    only, then global); variance ``v_out = v_mf + ‖ℓ‖² − W²·‖L‖²`` (the inputs' shared noise summed
    coherently in place of independently: exact for the linear map).  A dense layer of the plan's
    ``residual`` makes its input's residual ``r = v − ‖L‖²`` one factor per input element,
    ``ℓ[j, i] = W[j, i]·√r_i``: exact, since an input element's independent noise is shared by every unit
    that reads it (mean-field keeps only its diagonal, ``W²·r``, which this leaves unchanged)."""
    x, ld = inputs[0], loads[0]
    wm = layer.tensors["weight_mean"]
    j, i = wm.shape
    ops = bk.ops
    out = Loadings()
    explained = None
    if ld is not None:
        w = bk.tensor(wm, "weight_mean") if ld.glob else None
        for key, g in ld.glob.items():
            out.glob[key], out.glob_width[key] = bk.einsum("ji,bik->bjk", w, g), ld.glob_width[key]
        for key, blk in ld.block.items():
            c, p, r = ld.block_shape[key]
            # units contiguous (a compiled kernel's vectors: the weights as (C, P, J)), then (B, J, C·R)
            by_channel = np.ascontiguousarray(wm.reshape(j, c, p).transpose(1, 2, 0))
            g = bk.reshape(bk.permute(bk.einsum("cpj,bcpr->bcrj", bk.tensor(by_channel, "weight_mean_by_channel"),
                                                blk), (0, 3, 1, 2)), (j, c * r))
            out.glob[key] = out.glob[key] + g if key in out.glob else g
            out.glob_width[key] = c * r
        explained = ld.explained(bk, i)
        var = ops.maximum(var + out.explained(bk, j) - bk.dense(explained, wm**2, "weight_mean_squared"),
                          ops.const(0.0))
    if layer.name in plan.residual:
        resid = bk.reshape(bk.variance(x), (i,))
        if explained is not None:
            resid = resid - explained
        root = ops.sqrt(ops.maximum(resid, ops.const(0.0)))
        out.glob[layer.name] = bk.tensor(wm, "weight_mean") * bk.reshape(root, (1, i))
        out.glob_width[layer.name] = i
    return (None if out.empty() else out), mean, var


def conv2d_compact_macs(layer: PlannedLayer, plan: CompactPlan, columns: int, blocks: tuple[int, int]
                        ) -> tuple[int, int, tuple[int, int]]:
    """A conv's part of :func:`~pyro2pfp.correlation.compact.compact_macs` (``CompactSpec.macs``): ``O·P·C·k²`` per
    global column in, ``O·P·k²`` per block column (one input channel), ``R·O·P·C·k²`` for its own ``R``
    directions; every column in leaves as a global one, its directions as block columns."""
    o, c, kh, kw = layer.tensors["weight_mean"].shape
    positions = int(np.prod(layer.layer.out_shape)) // o
    total = columns * o * positions * c * kh * kw + blocks[0] * blocks[1] * o * positions * kh * kw
    out_columns, out_blocks = columns + blocks[0] * blocks[1], (0, 0)
    r = plan.directions.get(layer.name, 0)
    if r:
        total += r * o * positions * (c * kh * kw + 1) + o * (c * kh * kw + 1) * r * r
        out_blocks = (o, r)
    return total, out_columns, out_blocks


def dense_compact_macs(layer: PlannedLayer, plan: CompactPlan, columns: int, blocks: tuple[int, int]
                       ) -> tuple[int, int, tuple[int, int]]:
    """A dense layer's part of :func:`~pyro2pfp.correlation.compact.compact_macs` (``CompactSpec.macs``): ``J·I`` per
    global column in, ``J·P`` per block column, ``J·I`` for the input residual as factors (``I`` more
    global columns out)."""
    j, i = layer.tensors["weight_mean"].shape
    total = j * i * columns + j * i * blocks[1] + j * (columns + blocks[0] * blocks[1])
    out_columns = columns + blocks[0] * blocks[1]
    if layer.name in plan.residual:
        total += j * i
        out_columns += i
    return total, out_columns, (0, 0)
