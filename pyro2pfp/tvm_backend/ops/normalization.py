"""TE kernel of ``layer_norm`` (fixed-statistics LayerNorm) and its default CPU schedule.  (The op
definition, its rule and sources, converter, reference and ONNX export: ``pyro2pfp/ops/normalization.py``.)

Three stages per example row (the normalised trailing dims of one position of the leading dims):
the row mean ``m`` of the input means (a reduction), the row variance ``s²`` about it (a second
reduction: two passes, no ``E[μ²] − m²`` cancellation), and the elementwise output pair
``μγ·z + μβ``, ``μγ²·v_z + vγ·(z² + v_z) + vβ`` with ``z = (μ − m)·r``, ``v_z = v·r²``,
``r = 1/√(s² + ε)``.
"""
from __future__ import annotations

import math
from typing import Any

import tvm
from tvm import s_tir, te

from ...graph import Repr
from ...plan import PlannedLayer
from .._core import F32, EmitContext, RelaxActivation, activation_out, epilogue, kernel, variance_of
from ..schedules import schedule, simd_lanes, vectorize_inner

_TENSORS = ("weight_mean", "weight_var", "bias_mean", "bias_var")


@kernel("layer_norm")
def layer_norm(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    """Fixed-statistics LayerNorm over the trailing ``attrs["dims"]`` axes (see the module docstring)."""
    x = inputs[0]
    shape = tuple(layer.layer.out_shape)
    k = int(layer.layer.attrs["dims"])
    lead = len(shape) - k
    norm = shape[lead:]
    inv_d = 1.0 / math.prod(norm)
    eps = float(layer.layer.attrs["eps"])
    consts = [ctx.const(layer.tensors[name].reshape(norm)) for name in _TENSORS]
    n_x = len(x.tensors())

    def fn(*t: te.Tensor) -> list[te.Tensor]:
        m = t[0]
        s = t[1] if n_x == 2 else None
        gm, gv, bm, bv = t[n_x:]
        row_shape = m.shape[:1 + lead]

        def reduce_axes(name: str) -> list[Any]:
            return [te.reduce_axis((0, n), name=f"{name}{j}") for j, n in enumerate(norm)]

        ra = reduce_axes("r")
        row_mean = te.compute(row_shape, lambda *i: te.sum(m[tuple(i) + tuple(ra)] * tvm.tirx.const(inv_d, F32),
                                                           axis=ra), name="ln_mean")
        rb = reduce_axes("q")

        def dev2(i: tuple) -> Any:
            c = m[tuple(i) + tuple(rb)] - row_mean[i]
            return c * c * tvm.tirx.const(inv_d, F32)

        row_var = te.compute(row_shape, lambda *i: te.sum(dev2(i), axis=rb), name="ln_var")

        def out(*i: Any) -> list[Any]:
            row, j = i[:1 + lead], i[1 + lead:]
            inv = tvm.tirx.const(1.0, F32) / te.sqrt(row_var[row] + tvm.tirx.const(eps, F32))
            z = (m[i] - row_mean[row]) * inv
            mean = z * gm[j] + bm[j]
            var = z * z * gv[j] + bv[j]
            if s is not None:
                vz = variance_of(m[i], s[i], x.repr) * inv * inv
                var = var + vz * (gm[j] * gm[j] + gv[j])
            return epilogue(mean, var, layer)

        return te.compute(m.shape, out, name="layer_norm")

    return activation_out(ctx.emit_te(fn, x.tensors() + consts, layer), layer)


@schedule("layer_norm")
def schedule_layer_norm(sch: s_tir.Schedule, layer: Any, target: tvm.target.Target) -> None:
    """One parallel loop over (batch × leading positions); each iteration computes its row's two statistics
    (``compute_at``: the intermediates shrink to one value per thread) and then the row's outputs, whose
    innermost normalised axis is vectorised (a power-of-two width dividing it, when the body allows)."""
    lanes = simd_lanes(target)
    blocks = {sch.get(b).name_hint: b for b in sch.get_child_blocks(sch.get_sblock("root"))}
    outs = [b for name, b in blocks.items() if name.startswith("layer_norm")]
    n_row = _row_axes(sch, blocks["ln_mean"])  # batch + leading axes
    out_loops = sch.get_loops(outs[0])
    row = sch.fuse(*out_loops[:n_row]) if n_row > 1 else out_loops[0]
    sch.parallel(row)
    sch.compute_at(blocks["ln_var"], row)
    sch.compute_at(blocks["ln_mean"], row)
    vectorize_inner(sch, outs[0], lanes, below=row)  # the output blocks share their loop nest


def _row_axes(sch: s_tir.Schedule, block: Any) -> int:
    """How many of ``block``'s iteration variables are spatial (the row axes of a statistics block)."""
    return sum(1 for it in sch.get(block).iter_vars if int(it.iter_type) == 0)  # IterVar.DataPar
