"""TE kernel of ``layer_norm`` (expected statistics, linearised variance) and its default CPU schedule.
(The op definition, its rule and sources, converter, reference and ONNX export:
``pyro2pfp/ops/normalization.py``.)

Per example row (the normalised trailing dims at one position of the leading dims): the row mean ``m``
of the input means (a reduction), the spread ``mean((μ − m)²)`` about it (a second reduction: two passes,
no ``E[μ²] − m²`` cancellation), for a random input the row averages ``A0, A1, A2`` of ``v``, ``z·v``,
``z²·v`` (``s² = spread + (1 − 1/D)·A0``), then the elementwise output pair.

Shared-factor PFP: ``sf_layer_norm`` (a LayerNorm of a flat edge), one kernel: the statistics again,
the input loadings through the Jacobian, ``g``, the corrected variance and the profile.
"""
from __future__ import annotations

import math
from typing import Any

import tvm
from tvm import s_tir, te, tirx

from ....ops.normalization import shared_terms
from ....planning.plan import PlannedLayer
from ....planning.registry import shared_kernel
from ..emit import EmitContext, RelaxActivation, activation_out, epilogue, kernel, variance_of
from ..fast_math import F32
from ..schedules import schedule, simd_lanes, vectorize_inner
from ..shared_factor import SharedRelax, SharedStep, clip, emit_part, f32, normalised, view_as, widened_column
from ..shared_factor_schedule import schedule_shared

_TENSORS = ("weight_mean", "weight_var", "bias_mean", "bias_var")


@kernel("layer_norm")
def layer_norm(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    """LayerNorm (expected statistics, linearised variance) over the trailing ``attrs["dims"]`` axes
    (see ``pyro2pfp/ops/normalization.py``)."""
    x = inputs[0]
    shape = tuple(layer.layer.out_shape)
    k = int(layer.layer.attrs["dims"])
    lead = len(shape) - k
    norm = shape[lead:]
    d = math.prod(norm)
    eps = float(layer.layer.attrs["eps"])
    consts = [ctx.const(layer.tensors[name].reshape(norm)) for name in _TENSORS]
    n_x = len(x.tensors())

    def c(value: float) -> Any:
        return tvm.tirx.const(value, F32)

    def fn(*t: te.Tensor) -> list[te.Tensor]:
        m = t[0]
        s = t[1] if n_x == 2 else None
        gm, gv, bm, bv = t[n_x:]
        row_shape = m.shape[:1 + lead]

        def row_average(name: str, term: Any) -> te.Tensor:
            """``mean_j term(row, j)`` over the normalised axes, one value per row."""
            axes = [te.reduce_axis((0, n), name=f"{name}_{a}") for a, n in enumerate(norm)]
            return te.compute(row_shape, lambda *i: te.sum(term(tuple(i), tuple(axes)) * c(1.0 / d), axis=axes),
                              name=name)

        row_mean = row_average("ln_mean", lambda i, j: m[i + j])

        def dev2(i: tuple, j: tuple) -> Any:
            dev = m[i + j] - row_mean[i]
            return dev * dev

        row_var = row_average("ln_var", dev2)
        if s is not None:
            def v(i: tuple) -> Any:
                return variance_of(m[i], s[i], x.repr)

            a0 = row_average("ln_v", lambda i, j: v(i + j))

        def inv(row: tuple) -> Any:
            s2 = row_var[row] if s is None else row_var[row] + c(1.0 - 1.0 / d) * a0[row]
            return c(1.0) / te.sqrt(s2 + c(eps))

        def z(row: tuple, j: tuple) -> Any:
            return (m[row + j] - row_mean[row]) * inv(row)

        if s is not None:
            a1 = row_average("ln_zv", lambda i, j: z(i, j) * v(i + j))
            a2 = row_average("ln_zzv", lambda i, j: z(i, j) * z(i, j) * v(i + j))

        def out(*i: Any) -> list[Any]:
            row, j = tuple(i[:1 + lead]), tuple(i[1 + lead:])
            r = inv(row)
            zj = (m[i] - row_mean[row]) * r
            mean = zj * gm[j] + bm[j]
            var = zj * zj * gv[j] + bv[j]
            if s is not None:
                z2 = zj * zj
                inner = (v(tuple(i)) * (c(1.0) - c(2.0 / d) * (c(1.0) + z2))
                         + c(1.0 / d) * (a0[row] + c(2.0) * zj * a1[row] + z2 * a2[row]))
                var = var + te.max(inner, c(0.0)) * r * r * (gm[j] * gm[j] + gv[j])
            return epilogue(mean, var, layer)

        return te.compute(m.shape, out, name="layer_norm")

    return activation_out(ctx.emit_te(fn, x.tensors() + consts, layer), layer)


@schedule("layer_norm")
def schedule_layer_norm(sch: s_tir.Schedule, layer: PlannedLayer | None, target: tvm.target.Target) -> None:
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
    for name in ("ln_zzv", "ln_zv", "ln_v", "ln_var", "ln_mean"):  # consumers first
        if name in blocks:
            sch.compute_at(blocks[name], row)
    vectorize_inner(sch, outs[0], lanes, below=row)  # the output blocks share their loop nest


def _row_axes(sch: s_tir.Schedule, block: Any) -> int:
    """How many of ``block``'s iteration variables are spatial (the row axes of a statistics block)."""
    return sum(1 for it in sch.get(block).iter_vars if int(it.iter_type) == 0)  # IterVar.DataPar


class _TeConst:
    @staticmethod
    def const(value: float) -> Any:
        return f32(value)


@shared_kernel("layer_norm")
def layer_norm_shared_kernel(step: SharedStep, ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation],
                             shared: list[SharedRelax | None], out: RelaxActivation
                             ) -> tuple[SharedRelax | None, RelaxActivation]:
    """:func:`pyro2pfp.ops.normalization.layer_norm_shared` as one kernel ``sf_layer_norm``."""
    x, sh = inputs[0], shared[0]
    if sh is None:
        return None, out
    assert x.second is not None and out.second is not None
    d = int(math.prod(layer.layer.out_shape))
    k = step.fp.width[layer.name]
    rows = step.fp.rows[layer.inputs[0]]
    group = d // rows
    eps = float(layer.layer.attrs["eps"])
    gm, gv = (layer.tensors[n].reshape(d) for n in ("weight_mean", "weight_var"))

    def fn(m: te.Tensor, second: te.Tensor, s: te.Tensor, g_in: te.Tensor, var: te.Tensor, gmt: te.Tensor,
           g2t: te.Tensor) -> list[te.Tensor]:
        batch = m.shape[0]
        inv_d = f32(1.0 / d)
        gw = widened_column(g_in)

        def row_sum(name: str, term: Any, shape: tuple = ()) -> te.Tensor:
            j = te.reduce_axis((0, d), name=f"{name}_j")
            return te.compute((batch, *shape), lambda b, *f: te.sum(term(b, j, *f) * inv_d, axis=j), name=name)

        def v(b: Any, j: Any) -> Any:
            return variance_of(m[b, j], second[b, j], x.repr)

        mean = row_sum("ln_mean", lambda b, j: m[b, j])
        spread = row_sum("ln_var", lambda b, j: (m[b, j] - mean[b]) * (m[b, j] - mean[b]))
        a0 = row_sum("ln_v", v)
        r = te.compute((batch,), lambda b: f32(1.0) / te.sqrt(spread[b] + f32(1.0 - 1.0 / d) * a0[b] + f32(eps)),
                       name="ln_r")
        z = te.compute((batch, d), lambda b, j: (m[b, j] - mean[b]) * r[b], name="ln_z")

        def load(b: Any, j: Any, f: Any) -> Any:
            return s[b, j] * gw(b, tirx.floordiv(j, group), f)

        lm = row_sum("ln_load_mean", load, (k,))
        lz = row_sum("ln_load_z", lambda b, j, f: z[b, j] * load(b, j, f), (k,))
        jl = te.compute((batch, d, k), lambda b, j, f: r[b] * (load(b, j, f) - lm[b, f] - z[b, j] * lz[b, f]),
                        name="ln_jl")
        f2 = te.reduce_axis((0, k), name="f2")
        coherent = te.compute((batch, d), lambda b, j: te.sum(jl[b, j, f2] * jl[b, j, f2], axis=f2), name="coherent")
        b0 = row_sum("ln_s0", lambda b, j: s[b, j] * s[b, j])
        b1 = row_sum("ln_s1", lambda b, j: z[b, j] * s[b, j] * s[b, j])
        b2 = row_sum("ln_s2", lambda b, j: z[b, j] * z[b, j] * s[b, j] * s[b, j])
        var_new = te.compute((batch, d), lambda b, j: te.max(var[b, j] + g2t[j] * (coherent[b, j] - shared_terms(
            _TeConst, z[b, j], r[b], s[b, j] * s[b, j], b0[b], b1[b], b2[b], d)), f32(0.0)), name="var")
        g, norm = normalised(lambda b, j, f: gmt[j] * jl[b, j, f], (batch, d, k))
        s_out = te.compute((batch, d), lambda b, j: clip(norm[b, j], var_new[b, j]), name="s")
        return [g, s_out, var_new]

    shape = ctx.shapes[layer.name]
    args = [view_as(ctx, x.mean, d), view_as(ctx, x.second, d), view_as(ctx, sh.s, d), sh.g,
            view_as(ctx, out.second, d), ctx.const(gm), ctx.const(gm**2 + gv)]
    g, s_new, var_new = emit_part(ctx, fn, args, layer, "layer_norm")
    return (SharedRelax(view_as(ctx, s_new, *shape), g, k),
            RelaxActivation(out.mean, view_as(ctx, var_new, *shape), out.repr))


schedule("sf_layer_norm")(schedule_shared)
