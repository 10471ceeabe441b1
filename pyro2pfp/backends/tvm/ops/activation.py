"""TE kernels of the elementwise activations, with their default CPU schedule.

Every op with an :class:`~pyro2pfp.planning.registry.ActivationRule` (``pyro2pfp/ops/activation.py``) gets
the generic kernel :func:`activation_kernel`: the rule's ``exact`` on a deterministic input, else its
``moments`` evaluated on TE expressions (:data:`~pyro2pfp.backends.tvm.fast_math.TE_OPS`, shared
sub-expressions let-bound once, :func:`~pyro2pfp.backends.tvm.te_let.te_shared`) and emitted in the
representation the plan asks for -- the same function the NumPy reference and the ONNX export run.
Their schedule is :func:`~pyro2pfp.backends.tvm.schedules.schedule_flat` (vectorised when the body
has no libm call: ``fast_erf``/``fast_exp`` are plain arithmetic).

Shared-factor PFP: every such op whose rule is the generic one (``ActivationRule.stein``) gets the
kernel ``sf_stein``, Stein's ``clip(E[f'(a)]·s)`` with the exact slope of the rule's own float32 mean
formula by forward-mode AD (:func:`stein_kernel`, :mod:`pyro2pfp.correlation.stein`); ReLU and
LeakyReLU get ``sf_relu`` (:func:`relu_shared_kernel`), which computes the layer's mean-field
outputs too.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import tvm
from tvm import relax, s_tir, te, tirx

from .... import moments
from ....correlation.backend import fuses_mean_field
from ....correlation.stein import stein_slope
from ....errors import PFPError
from ....planning.graph import Repr
from ....planning.plan import PlannedLayer
from ....planning.registry import OPS, ActivationRule, shared_kernel
from ..emit import EmitContext, RelaxActivation, activation_out, epilogue, kernel, variance_of
from ..schedules import pow2_divisor, schedule, schedule_flat, simd_lanes
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
    safe_div,
    widened_column,
)
from ..shared_factor_schedule import schedule_shared
from ..te_let import te_shared

#: the widest vector :func:`~pyro2pfp.backends.tvm.schedules.schedule_flat` uses (AVX-512 fp32 lanes)
_MAX_LANES = 16


def flat_widens_vector(shape: tuple[int, ...]) -> bool:
    """Whether an elementwise kernel on per-example ``shape`` gets a wider vector as one flat axis:
    :func:`~pyro2pfp.backends.tvm.schedules.schedule_flat` fuses only the last two axes (a fusion of
    three can defeat TVM's index simplification), so e.g. LeNet's 16×10×10 ReLU gets 4 lanes from
    10×10 = 4·25 but 16 from 1600 = 64·25."""
    if len(shape) < 3:
        return False
    return pow2_divisor(int(np.prod(shape[-2:])), _MAX_LANES) < pow2_divisor(int(np.prod(shape)), _MAX_LANES)


def activation_moments(layer: PlannedLayer, x_repr: Repr) -> Callable[[Any, Any, Any], list[Any]]:
    """``moments(m, second, ops) -> [mean, second]``: the TE expressions of one element of the
    elementwise activation ``layer``'s output (in ``layer.out_repr``) from one element of its random
    input (``m``, ``second`` in ``x_repr``), by the op's :class:`~pyro2pfp.planning.registry.ActivationRule`
    -- the body of the mean-field kernel (:func:`activation_kernel`), and of the shared-factor ReLU
    kernel (:func:`relu_shared_kernel`), which computes these outputs itself."""
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


def schedule_elementwise(sch: s_tir.Schedule, layer: PlannedLayer | None, target: tvm.target.Target) -> None:
    """Elementwise ops: :func:`~pyro2pfp.backends.tvm.schedules.schedule_flat`.

    A two-output ``te.compute`` lowers to two blocks (``<name>_v0``, ``<name>_v1``) in one loop nest.
    """
    schedule_flat(sch, simd_lanes(target))


for _op in OPS.values():
    if _op.activation is not None:
        kernel(_op.name)(activation_kernel(_op.activation))
        schedule(_op.name)(schedule_elementwise)


# ------------------------------------------------------------------ shared-factor rules
def stein_kernel(layer: PlannedLayer, x_repr: Any) -> Any:
    """``fn(m, second, s, var_out)``: the TE stage of the generic activation rule ``sf_stein`` (one
    elementwise block ``stein``) -- ``clip(E[f'(a)]·s, ±√var_out)`` per element, ``E[f'(a)]`` the exact
    ``μ``-derivative of the layer's ``ActivationRule`` mean at the input's ``(μ, v)`` (``second`` in
    ``x_repr``): :func:`~pyro2pfp.correlation.stein.stein_slope` on ``TE_OPS`` (forward-mode AD of
    the very float32 formula the mean-field kernel evaluates; shared sub-expressions let-bound once,
    :func:`~pyro2pfp.backends.tvm.te_let.te_shared`)."""
    rule, attrs = OPS[layer.op].activation, layer.layer.attrs

    def fn(m: te.Tensor, second: te.Tensor, s: te.Tensor, var: te.Tensor) -> te.Tensor:
        def element(*i: Any) -> Any:
            def build(ops: Any) -> list[Any]:
                slope = stein_slope(rule, m[i], variance_of(m[i], second[i], x_repr), attrs, ops)
                return [clip(slope * s[i], var[i])]

            return te_shared(build)[0]

        return te.compute(m.shape, element, name="stein")

    return fn


def stein_shared_kernel(step: SharedStep, ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation],
                        shared: list[SharedRelax | None], out: RelaxActivation
                        ) -> tuple[SharedRelax | None, RelaxActivation]:
    """The generic activation rule (:func:`pyro2pfp.ops.activation.stein_shared`), one elementwise kernel
    ``sf_stein`` (:func:`stein_kernel`)."""
    x, sh = inputs[0], shared[0]
    assert sh is not None
    assert x.second is not None and out.second is not None
    s = emit_part(ctx, stein_kernel(layer, x.repr), [x.mean, x.second, sh.s, out.second], layer, "stein")[0]
    return SharedRelax(s, sh.g, sh.k), out


@shared_kernel("relu", "leaky_relu")
@fuses_mean_field
def relu_shared_kernel(step: SharedStep, ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation],
                       shared: list[SharedRelax | None], out: RelaxActivation | None
                       ) -> tuple[SharedRelax | None, RelaxActivation]:
    """:func:`pyro2pfp.ops.activation.relu_shared` as one kernel ``sf_relu`` for a relu/leaky_relu layer
    with a shared input (it computes the layer's mean-field outputs too: called with ``out=None``): the layer's
    mean-field outputs (the registry rule's expressions, :func:`activation_moments`:
    what the mean-field kernel would compute) and the rule -- Stein's ``lin``, the Hermite ``h``,
    their channel means, the loading ``lbar·g_in ⊕ hbar`` normalised and the profile
    ``clip(lbar/‖ℓ‖·lin + hbar/‖ℓ‖·h)`` (every step per row).  ``σ``, ``α``, ``Φ(α)`` and ``φ(α)``
    are those of the moments (:func:`~pyro2pfp.moments.gaussian_terms`, bound once per element:
    ``te_shared(reuse=True)``); where ``σ = 0`` Stein's terms take the reference's limits
    (``Φ → [μ > 0]``, ``h = 0``)."""
    x, sh = inputs[0], shared[0]
    assert out is None and sh is not None  # SharedStep.emits_mean_field
    slope = float(layer.layer.attrs.get("slope", 0.0))
    name, src = layer.name, layer.inputs[0]
    offset = step.fp.offsets.get(name)
    hermite = offset is not None  # (the kernel reads this, not the offset: it takes it as a parameter)
    k = step.fp.width[name]
    assert x.second is not None  # a random input (emits_mean_field)
    views = [step.by_rows(ctx, t, src) for t in (x.mean, x.second, sh.s)]
    mean_field = activation_moments(layer, x.repr)

    def terms(m: te.Tensor, v: te.Tensor, s: te.Tensor) -> list[te.Tensor]:
        """``[mean, second]`` of the output (the mean-field moments) and Stein's ``[lin, h]``."""
        def element(*i: Any) -> list[Any]:
            def build(ops: Any) -> list[Any]:
                outs = mean_field(m[i], v[i], ops)
                # the same bound σ, α, Φ(α), φ(α) as the moments (reuse): one erf and one exp
                sd, _, cdf, _, pdf = moments.gaussian_terms(m[i], variance_of(m[i], v[i], x.repr), ops)
                cdf = tirx.Select(sd > f32(0.0), cdf, tirx.Select(m[i] > f32(0.0), f32(1.0), f32(0.0)))
                lin = (cdf + f32(slope) * (f32(1.0) - cdf)) * s[i]
                h = safe_div(f32(1.0 - slope) * pdf, sd) * s[i] * s[i] * f32(1 / math.sqrt(2))
                return [*outs, lin] if not hermite else [*outs, lin, h]

            return te_shared(build, reuse=True)

        return list(te.compute(m.shape, element, name="relu"))

    def rule(*ts: te.Tensor, widths: FactorWidths | None = None) -> list[te.Tensor]:
        m, v, s = ts[:3]
        mean, second, lin, *h = terms(m, v, s)

        def var(*i: Any) -> Any:  # the output's variance, the profile's clip
            return variance_of(mean[i], second[i], layer.out_repr)

        if not hermite:  # hermite='none': the linear response only
            return [mean, second, te.compute(lin.shape, lambda *i: clip(lin[i], var(*i)), name="s")]
        assert widths is not None  # the factor widths and offset: symbolic (emit_width_generic)
        lbar, hbar = row_mean(lin, "lbar"), row_mean(h[0], "hbar")
        column = widened_column(ts[3])
        g, norm = normalised(lambda b, r, f: lbar[b, r] * column(b, r, f) + tirx.Select(
            f == r + widths.offset, hbar[b, r], f32(0.0)), (lbar.shape[0], lbar.shape[1], widths.k))
        s_out = te.compute(lin.shape, lambda b, r, *q: clip(
            safe_div(lbar[b, r], norm[b, r]) * lin[(b, r, *q)]
            + safe_div(hbar[b, r], norm[b, r]) * h[0][(b, r, *q)], var(b, r, *q)), name="profile")
        return [mean, second, s_out, g]

    if offset is None:
        outs = emit_part(ctx, rule, views, layer, "relu")
    else:  # layers that differ only in the factor widths and offset share the kernel
        outs = emit_width_generic(ctx, rule, [*views, sh.g], layer, "relu", g_args={3: sh.k}, k=k,
                                   offset=offset)
    out = RelaxActivation(step.as_edge(ctx, outs[0], name), step.as_edge(ctx, outs[1], name), layer.out_repr)
    if offset is None:
        return SharedRelax(step.as_edge(ctx, outs[2], name), sh.g, sh.k), out
    return SharedRelax(step.as_edge(ctx, outs[2], name), outs[3], k), out


schedule("sf_relu", "sf_stein")(schedule_shared)
for _op in OPS.values():
    if _op.activation is not None and _op.activation.stein:  # the generic rule (ops/activation.py registers it too)
        shared_kernel(_op.name)(stein_shared_kernel)
