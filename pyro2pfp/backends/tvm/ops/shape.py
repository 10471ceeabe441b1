"""Reshape: ``R.reshape`` of both components, batch dimension kept first; its shared-factor rule (and
the planner's ``convert``'s): a view of the profile."""
from __future__ import annotations

from tvm import relax

from ....planning.plan import PlannedLayer
from ....planning.registry import shared_kernel
from ..emit import EmitContext, RelaxActivation, kernel
from ..shared_factor import SharedRelax, SharedStep, view_as


@kernel("reshape")
def reshape(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    x = inputs[0]
    shape = relax.ShapeExpr([ctx.batch, *layer.layer.out_shape])
    tensors = [ctx.bb.emit(relax.op.reshape(t, shape)) for t in x.tensors()]
    return RelaxActivation(tensors[0], tensors[1] if len(tensors) > 1 else None, x.repr)


@shared_kernel("reshape", "convert")
def view_shared_kernel(step: SharedStep, ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation],
                       shared: list[SharedRelax | None], out: RelaxActivation
                       ) -> tuple[SharedRelax | None, RelaxActivation]:
    """:func:`pyro2pfp.ops.shape.view_shared`: a view of the profile."""
    sh = shared[0]
    assert sh is not None
    return SharedRelax(view_as(ctx, sh.s, *layer.layer.out_shape), sh.g, sh.k), out
