"""Reshape: ``R.reshape`` of both components, batch dimension kept first."""
from __future__ import annotations

from tvm import relax

from ...plan import PlannedLayer
from ..emit import EmitContext, RelaxActivation, kernel


@kernel("reshape")
def reshape(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    x = inputs[0]
    shape = relax.ShapeExpr([ctx.batch, *layer.layer.out_shape])
    tensors = [ctx.bb.emit(relax.op.reshape(t, shape)) for t in x.tensors()]
    return RelaxActivation(tensors[0], tensors[1] if len(tensors) > 1 else None, x.repr)
