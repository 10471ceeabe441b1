"""TE kernels of the linear elementwise ops -- the per-channel ``affine`` map (eval-mode batch norm) and
the residual ``add`` -- with their default CPU schedule (elementwise).  (The op definitions,
converters, reference and ONNX export: ``pyro2pfp/ops/arithmetic.py``.)"""
from __future__ import annotations

from tvm import te, tirx

from ...graph import Repr
from ...plan import PlannedLayer
from ..emit import EmitContext, RelaxActivation, activation_out, epilogue, epilogue_fused, kernel, variance_of
from ..fast_math import F32
from ..schedules import schedule
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
