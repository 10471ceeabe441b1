"""Reshape: ``R.reshape`` of both components, batch dimension kept first; the planner's ``convert``: an
elementwise kernel (the input re-expressed in the representation the plan asks for); their shared-factor
rule: a view of the profile."""
from __future__ import annotations

from tvm import relax, te

from ....planning.plan import PlannedLayer
from ....planning.registry import shared_kernel
from ..emit import EmitContext, RelaxActivation, activation_out, epilogue, kernel, variance_of
from ..schedules import schedule
from ..shared_factor import SharedRelax, SharedStep, view_as
from .activation import schedule_elementwise


@kernel("reshape")
def reshape(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    x = inputs[0]
    shape = relax.ShapeExpr([ctx.batch, *layer.layer.out_shape])
    tensors = [ctx.bb.emit(relax.op.reshape(t, shape)) for t in x.tensors()]
    return RelaxActivation(tensors[0], tensors[1] if len(tensors) > 1 else None, x.repr)


@kernel("convert")
def convert(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    """The input re-expressed in the representation the plan asks for (``s = μ² + v`` / ``v = s − μ²``)."""
    x = inputs[0]

    def fn(m: te.Tensor, s: te.Tensor) -> list[te.Tensor]:
        return te.compute(m.shape, lambda *i: epilogue(m[i], variance_of(m[i], s[i], x.repr), layer),
                          name="convert")

    return activation_out(ctx.emit_te(fn, x.tensors(), layer), layer)


schedule("convert")(schedule_elementwise)


@shared_kernel("reshape", "convert")
def view_shared_kernel(step: SharedStep, ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation],
                       shared: list[SharedRelax | None], out: RelaxActivation
                       ) -> tuple[SharedRelax | None, RelaxActivation]:
    """:func:`pyro2pfp.ops.shape.view_shared`: a view of the profile."""
    sh = shared[0]
    assert sh is not None
    return SharedRelax(view_as(ctx, sh.s, *layer.layer.out_shape), sh.g, sh.k), out
