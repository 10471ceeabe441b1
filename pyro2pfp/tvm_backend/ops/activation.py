"""TE kernels of the elementwise activations and of the planner's representation ``convert``, with
their default CPU schedule.

Every op with an :class:`~pyro2pfp.registry.ActivationRule` (``pyro2pfp/ops/activation.py``) gets
the generic kernel :func:`activation_kernel`: the rule's ``exact`` on a deterministic input, else its
``moments`` evaluated on TE expressions (:data:`~pyro2pfp.tvm_backend.fast_math.TE_OPS`, shared
sub-expressions let-bound once, :func:`~pyro2pfp.tvm_backend.te_let.te_shared`) and emitted in the
representation the plan asks for -- the same function the NumPy reference and the ONNX export run.
Their schedule is :func:`~pyro2pfp.tvm_backend.schedules.schedule_flat` (vectorised when the body
has no libm call: ``fast_erf``/``fast_exp`` are plain arithmetic).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tvm
from tvm import relax, s_tir, te

from ...errors import PFPError
from ...graph import Repr
from ...plan import PlannedLayer
from ...registry import OPS, ActivationRule
from ..emit import EmitContext, RelaxActivation, activation_out, epilogue, kernel, variance_of
from ..schedules import pow2_divisor, schedule, schedule_flat, simd_lanes
from ..te_let import te_shared

#: the widest vector :func:`~pyro2pfp.tvm_backend.schedules.schedule_flat` uses (AVX-512 fp32 lanes)
_MAX_LANES = 16


def flat_widens_vector(shape: tuple[int, ...]) -> bool:
    """Whether an elementwise kernel on per-example ``shape`` gets a wider vector as one flat axis:
    :func:`~pyro2pfp.tvm_backend.schedules.schedule_flat` fuses only the last two axes (a fusion of
    three can defeat TVM's index simplification), so e.g. LeNet's 16×10×10 ReLU gets 4 lanes from
    10×10 = 4·25 but 16 from 1600 = 64·25."""
    if len(shape) < 3:
        return False
    return pow2_divisor(int(np.prod(shape[-2:])), _MAX_LANES) < pow2_divisor(int(np.prod(shape)), _MAX_LANES)


def activation_moments(layer: PlannedLayer, x_repr: Repr) -> Callable[[Any, Any, Any], list[Any]]:
    """``moments(m, second, ops) -> [mean, second]``: the TE expressions of one element of the
    elementwise activation ``layer``'s output (in ``layer.out_repr``) from one element of its random
    input (``m``, ``second`` in ``x_repr``), by the op's :class:`~pyro2pfp.registry.ActivationRule`
    -- the body of the mean-field kernel (:func:`activation_kernel`), and of the shared-factor ReLU
    kernel (``correlation.SharedStep.relu_with_moments``), which computes these outputs itself."""
    rule, attrs = OPS[layer.op].activation, layer.layer.attrs
    if rule is None:
        raise PFPError(f"{layer.layer.source}: op '{layer.op}' is not an elementwise activation")

    def moments(m: Any, second: Any, ops: Any) -> list[Any]:
        mean, var = rule.moments(m, variance_of(m, second, x_repr), attrs, ops)
        return epilogue(mean, var, layer)

    return moments


def activation_kernel(rule: ActivationRule) -> Any:
    """The Relax/TE emitter of an elementwise activation with rule ``rule`` (on a flat (batch, N)
    view of its tensors where that widens the vector: :func:`flat_widens_vector`)."""

    def emit(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
        x, attrs = inputs[0], layer.layer.attrs
        shape = tuple(layer.layer.out_shape)
        flat = flat_widens_vector(shape)

        def view(t: relax.Expr, *dims: int) -> relax.Expr:
            return ctx.bb.emit(relax.op.reshape(t, relax.ShapeExpr([ctx.batch, *dims])))

        args = x.tensors() if x.second is not None else [x.mean]
        if flat:
            args = [view(t, int(np.prod(shape))) for t in args]
        if x.second is None:  # deterministic input: the exact activation
            def exact(m: te.Tensor) -> te.Tensor:
                return te.compute(m.shape, lambda *i: te_shared(lambda ops: [rule.exact(m[i], attrs, ops)])[0],
                                  name=layer.op)

            out = activation_out(ctx.emit_te(exact, args, layer), layer)
        else:
            moments = activation_moments(layer, x.repr)

            def matched(m: te.Tensor, s: te.Tensor) -> list[te.Tensor]:
                return te.compute(m.shape, lambda *i: te_shared(lambda ops: moments(m[i], s[i], ops)), name=layer.op)

            out = activation_out(ctx.emit_te(matched, args, layer), layer)
        if not flat:
            return out
        return RelaxActivation(view(out.mean, *shape), None if out.second is None else view(out.second, *shape),
                               out.repr)

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
