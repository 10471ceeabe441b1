"""The ONNX export of the compact factor plan (:mod:`.compact`): after each layer's export, the layer's compact
factor rule (:data:`~pyro2pfp.planning.registry.COMPACT_EXPORTERS`, the same formulas the float64 reference
runs) through
:func:`.loadings.compact_layer` with the export's ``OnnxContext`` as back end.  Block columns stay block columns
((B, C, P, r) tensors, no zeros); every width is static, only the batch axis is dynamic."""
from __future__ import annotations

from typing import Any

from ..backends.onnx.builder import SCHEME_STEPS, OnnxActivation, OnnxContext
from ..planning.graph import INPUT
from ..planning.plan import PlannedGraph, PlannedLayer
from ..planning.registry import COMPACT_EXPORTERS
from .compact import compact_plan
from .loadings import Loadings, compact_layer


class OnnxCompactStep:
    """The compact factor plan's step of the ONNX export (``backends.onnx.builder.SCHEME_STEPS``): keeps each edge's
    :class:`~.loadings.Loadings` (ONNX symbols) and returns the layer's output with the corrected variance."""

    def __init__(self, graph: PlannedGraph, ctx: OnnxContext) -> None:
        self.plan = compact_plan(graph)
        self.loads: dict[str, Loadings | None] = {INPUT: None}

    def emits_mean_field(self, layer: PlannedLayer) -> bool:
        """Never: every layer's mean-field outputs are exported first, the step corrects their variance."""
        return False

    def __call__(self, ctx: OnnxContext, layer: PlannedLayer, inputs: list[OnnxActivation],
                 out: OnnxActivation | None) -> OnnxActivation:
        assert out is not None  # emits_mean_field is never true: the layer's export comes first
        loads = [self.loads[n] for n in layer.inputs]
        var = ctx.variance(out)
        ld, mean, new_var = compact_layer(ctx, COMPACT_EXPORTERS, layer, inputs, loads, self.plan, out.mean, var)
        self.loads[layer.name] = ld
        if new_var is var and mean is out.mean:
            return out
        return ctx.emit(mean, new_var, layer)


SCHEME_STEPS["compact-factor"] = OnnxCompactStep

__all__: list[Any] = ["OnnxCompactStep"]
