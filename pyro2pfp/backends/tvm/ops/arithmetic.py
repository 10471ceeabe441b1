"""TE kernels of the linear elementwise ops -- the per-channel ``affine`` map (eval-mode batch norm) and
the residual ``add`` -- with their default CPU schedule (elementwise).  (The op definitions,
converters, reference and ONNX export: ``pyro2pfp/ops/arithmetic.py``.)

Shared-factor PFP: ``sf_scale`` (affine and scale: ``s ↦ a·s``, clipped) and ``sf_add`` (the branch
covariance, the loading, ``g``, the corrected variance and the profile), both one kernel indexing the
``(B, C, H, W)`` edges by rows."""
from __future__ import annotations

from tvm import relax, te, tirx

from ....ops.arithmetic import linear_factor
from ....planning.graph import Repr
from ....planning.plan import PlannedLayer
from ....planning.registry import shared_kernel
from ..emit import EmitContext, RelaxActivation, activation_out, epilogue, epilogue_fused, kernel, variance_of
from ..fast_math import F32
from ..schedules import schedule
from ..shared_factor import (
    FactorWidths,
    SharedRelax,
    SharedStep,
    clip,
    emit_part,
    emit_width_generic,
    f32,
    normalised,
    row_mean,
    widened_column,
)
from ..shared_factor_schedule import schedule_shared
from .activation import schedule_elementwise


@kernel("affine")
def affine(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    """Per-channel ``μ ↦ a·μ + c``, ``v ↦ a²·v`` (channel axis 1)."""
    x = inputs[0]
    consts = [ctx.const(layer.tensors["scale"]), ctx.const(layer.tensors["shift"])]
    if x.repr is Repr.DETERMINISTIC:
        def det(m: te.Tensor, a: te.Tensor, c: te.Tensor) -> te.Tensor:
            return te.compute(m.shape, lambda *i: m[i] * a[i[1]] + c[i[1]], name="affine")

        return activation_out(ctx.emit_te(det, [x.mean] + consts, layer), layer)

    def fn(m: te.Tensor, s: te.Tensor, a: te.Tensor, c: te.Tensor) -> list[te.Tensor]:
        def f(*i):
            scale = a[i[1]]
            return epilogue(m[i] * scale + c[i[1]], variance_of(m[i], s[i], x.repr) * scale * scale, layer)

        return te.compute(m.shape, f, name="affine")

    return activation_out(ctx.emit_te(fn, x.tensors() + consts, layer), layer)


@kernel("add")
def add(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    """Sum of two independent Gaussians: means and variances add; a ReLU after it (a residual block's
    last ReLU) is computed in the same pass when fused (``fusion.fused_activations``)."""
    a, b = inputs
    if a.repr is Repr.DETERMINISTIC and b.repr is Repr.DETERMINISTIC:
        def det(x: te.Tensor, y: te.Tensor) -> te.Tensor:
            return te.compute(x.shape, lambda *i: x[i] + y[i], name="add")

        return activation_out(ctx.emit_te(det, [a.mean, b.mean], layer), layer)
    n_a = len(a.tensors())

    def fn(*t: te.Tensor) -> list[te.Tensor]:
        ta, tb = t[:n_a], t[n_a:]

        def var(ts, r, i):
            return variance_of(ts[0][i], ts[1][i], r) if len(ts) > 1 else tirx.const(0.0, F32)

        return te.compute(t[0].shape, lambda *i: epilogue_fused(
            ta[0][i] + tb[0][i], var(ta, a.repr, i) + var(tb, b.repr, i), layer, relu), name="add")

    relu = ctx.activation  # a ReLU fused into this kernel (fusion.fused_activations): its moments are emitted
    return activation_out(ctx.emit_te(fn, a.tensors() + b.tensors(), layer), relu or layer)


schedule("affine", "add")(schedule_elementwise)


# ------------------------------------------------------------------ shared-factor rules
def scaled(ctx: EmitContext, s: relax.Expr, var: relax.Expr, factor: relax.Expr, layer: PlannedLayer
            ) -> relax.Expr:
    """``clip(factor[r]·s[r, ...])`` on (B, R, *group axes) tensors (``factor`` (R,) or (1,))."""
    def fn(st: te.Tensor, vt: te.Tensor, a: te.Tensor) -> te.Tensor:
        per_row = int(a.shape[0]) > 1
        return te.compute(st.shape, lambda b, r, *q: clip(a[r if per_row else 0] * st[(b, r, *q)], vt[(b, r, *q)]),
                          name="scaled")

    return emit_part(ctx, fn, [s, var, factor], layer, "scale")[0]


@shared_kernel("affine", "scale")
def linear_shared_kernel(step: SharedStep, ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation],
                         shared: list[SharedRelax | None], out: RelaxActivation
                         ) -> tuple[SharedRelax | None, RelaxActivation]:
    """:func:`pyro2pfp.ops.arithmetic.linear_shared` as one kernel ``sf_scale``."""
    sh = shared[0]
    assert sh is not None
    factor = linear_factor(layer)
    name = layer.name
    s = scaled(ctx, step.by_rows(ctx, sh.s, name), step.by_rows(ctx, out.second, name), ctx.const(factor), layer)
    return SharedRelax(step.as_edge(ctx, s, name), sh.g, sh.k), out


@shared_kernel("add")
def add_shared_kernel(step: SharedStep, ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation],
                      shared: list[SharedRelax | None], out: RelaxActivation
                      ) -> tuple[SharedRelax | None, RelaxActivation]:
    """:func:`pyro2pfp.ops.arithmetic.add_shared` as one kernel ``sf_add``."""
    sa, sb = shared
    if sa is None or sb is None:
        return (sa if sb is None else sb), out  # one branch without a shared part: nothing to combine
    name = layer.name
    k = step.fp.width[name]
    a_s, b_s, var = (step.by_rows(ctx, t, name) for t in (sa.s, sb.s, out.second))

    def rule(at: te.Tensor, bt: te.Tensor, v: te.Tensor, ga: te.Tensor, gb: te.Tensor, widths: FactorWidths
             ) -> list[te.Tensor]:
        """The loading ``ā·g_a + b̄·g_b`` normalised, the branch covariance ``⟨g_a, g_b⟩``, the
        corrected variance and the profile, in one kernel (every step is per row; the factor
        widths are the symbolic ``widths``, so adds that differ only in them share the kernel)."""
        k = widths.k
        gaw, gbw = widened_column(ga), widened_column(gb)  # expressions: no (B, R, K) buffers
        abar, bbar = row_mean(at, "abar"), row_mean(bt, "bbar")
        f = te.reduce_axis((0, k), name="f")
        dot = te.compute(at.shape[:2], lambda b, r: te.sum(gaw(b, r, f) * gbw(b, r, f), axis=f), name="dot")
        gt, _ = normalised(lambda b, r, j: abar[b, r] * gaw(b, r, j) + bbar[b, r] * gbw(b, r, j),
                            (at.shape[0], at.shape[1], k))
        f1 = te.reduce_axis((0, k), name="f1")
        pa = te.compute(at.shape[:2], lambda b, r: te.sum(gaw(b, r, f1) * gt[b, r, f1], axis=f1), name="pa")
        f2 = te.reduce_axis((0, k), name="f2")
        pb = te.compute(at.shape[:2], lambda b, r: te.sum(gbw(b, r, f2) * gt[b, r, f2], axis=f2), name="pb")
        var_new = te.compute(at.shape, lambda b, r, *q: te.max(
            v[(b, r, *q)] + f32(2.0) * at[(b, r, *q)] * bt[(b, r, *q)] * dot[b, r], f32(0.0)), name="var")
        s = te.compute(at.shape, lambda b, r, *q: clip(at[(b, r, *q)] * pa[b, r] + bt[(b, r, *q)] * pb[b, r],
                                                        var_new[(b, r, *q)]), name="s")
        return [s, var_new, gt]

    s, var_new, g = emit_width_generic(ctx, rule, [a_s, b_s, var, sa.g, sb.g], layer, "add",
                                        g_args={3: sa.k, 4: sb.k}, k=k, offset=0)
    out = RelaxActivation(out.mean, step.as_edge(ctx, var_new, name), out.repr)
    return SharedRelax(step.as_edge(ctx, s, name), g, k), out


schedule("sf_scale", "sf_add")(schedule_shared)
