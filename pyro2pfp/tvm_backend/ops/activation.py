"""TE kernels of the elementwise activations and of the planner's representation ``convert``, with
their default CPU schedule.

Every op with an :class:`~pyro2pfp.registry.ActivationRule` (``pyro2pfp/ops/activation.py``) gets
the generic kernel :func:`activation_kernel`: the rule's ``exact`` on a deterministic input, else its
``moments`` evaluated on TE expressions (:data:`~pyro2pfp.tvm_backend._core.TE_OPS`, shared
sub-expressions let-bound once, :func:`~pyro2pfp.tvm_backend._core.te_shared`) and emitted in the
representation the plan asks for -- the same function the NumPy reference and the ONNX export run.
Their schedule is :func:`~pyro2pfp.tvm_backend.schedules.schedule_flat` (vectorised when the body
has no libm call: ``fast_erf``/``fast_exp`` are plain arithmetic).
"""
from __future__ import annotations

from typing import Any

import tvm
from tvm import s_tir, te

from ...plan import PlannedLayer
from ...registry import OPS, ActivationRule
from .._core import EmitContext, RelaxActivation, activation_out, epilogue, kernel, te_shared, variance_of
from ..schedules import schedule, schedule_flat, simd_lanes


def activation_kernel(rule: ActivationRule) -> Any:
    """The Relax/TE emitter of an elementwise activation with rule ``rule``."""

    def emit(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
        x, attrs = inputs[0], layer.layer.attrs
        if x.second is None:  # deterministic input: the exact activation
            def exact(m: te.Tensor) -> te.Tensor:
                return te.compute(m.shape, lambda *i: te_shared(lambda ops: [rule.exact(m[i], attrs, ops)])[0],
                                  name=layer.op)

            return activation_out(ctx.emit_te(exact, [x.mean], layer), layer)

        def matched(m: te.Tensor, s: te.Tensor) -> list[te.Tensor]:
            def moments_at(i: tuple, ops: Any) -> list[Any]:
                mean, var = rule.moments(m[i], variance_of(m[i], s[i], x.repr), attrs, ops)
                return epilogue(mean, var, layer)

            return te.compute(m.shape, lambda *i: te_shared(lambda ops: moments_at(i, ops)), name=layer.op)

        return activation_out(ctx.emit_te(matched, x.tensors(), layer), layer)

    return emit


def schedule_elementwise(sch: s_tir.Schedule, layer: Any, target: tvm.target.Target) -> None:
    """Elementwise ops: :func:`~pyro2pfp.tvm_backend.schedules.schedule_flat`.

    A two-output ``te.compute`` lowers to two blocks (``<name>_v0``, ``<name>_v1``) in one loop nest.
    """
    schedule_flat(sch, simd_lanes(target))


for _op in OPS.values():
    if _op.activation is not None:
        kernel(_op.name)(activation_kernel(_op.activation))
        schedule(_op.name)(schedule_elementwise)


@kernel("convert")
def convert(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    """The input re-expressed in the representation the plan asks for (``s = μ² + v`` / ``v = s − μ²``)."""
    x = inputs[0]

    def fn(m: te.Tensor, s: te.Tensor) -> list[te.Tensor]:
        return te.compute(m.shape, lambda *i: epilogue(m[i], variance_of(m[i], s[i], x.repr), layer),
                          name="convert")

    return activation_out(ctx.emit_te(fn, x.tensors(), layer), layer)


schedule("convert")(schedule_elementwise)
