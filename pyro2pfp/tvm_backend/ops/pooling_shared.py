"""TE kernels of the shared-factor rules of pooling (``avg_pool2d``, ``max_pool2d``; the float64 and
ONNX rules: ``pyro2pfp/ops/pooling.py``), with their schedule: ``sf_avgpool`` (the window mean of the
profile and the pooled variance) and ``sf_maxpool`` (Clark's fold with the profile's linear response,
a sequential TE reduction over the window, :data:`shared_max`)."""
from __future__ import annotations

from typing import Any

import numpy as np
from tvm import te, tirx

from ... import moments
from ...ops.pooling import average_attrs
from ...plan import PlannedLayer
from ...reference.arrays import average_divisor
from ...registry import shared_kernel
from ..emit import EmitContext, RelaxActivation
from ..schedules import schedule
from ..shared_factor import SharedRelax, SharedStep, clip, emit_part, f32
from ..shared_factor_schedule import schedule_shared
from ..te_let import te_shared
from .pooling import Windows

_LOWEST = float(np.finfo(np.float32).min)


def _max_step(a: Any, b: Any, ops: Any) -> list[Any]:
    """One step of the max-pool fold with the profile: Clark's ``(μ, v)`` of ``max(A, B)`` and
    ``Cov(max(A, B), η) = Φ(α)·s_A + Φ(−α)·s_B``, ``α = (μ_A − μ_B)/√(v_A + v_B)``."""
    theta = ops.sqrt(a[1] + b[1])
    alpha = te.min(te.max((a[0] - b[0]) / te.max(theta, f32(1e-30)), f32(-40.0)), f32(40.0))
    cdf = tirx.Select(theta > f32(0.0), ops.normal_cdfs(alpha)[0],
                      tirx.Select(a[0] >= b[0], f32(1.0), f32(0.0)))
    mean, var = moments.max_moments(a[0], a[1], b[0], b[1], ops)
    return [mean, var, cdf * a[2] + (f32(1.0) - cdf) * b[2]]


# The fold as a sequential TE reduction in row-major window order (as tvm_backend/ops/pooling.py; one
# expression would blow up in LLVM); identity (−FLT_MAX, 0, 0) is exact: Φ(α) = 0 there.
shared_max = te.comm_reducer(
    lambda a, b: tuple(te_shared(lambda ops: _max_step(a, b, ops))),
    lambda t0, t1, t2: (tirx.const(_LOWEST, t0), tirx.const(0.0, t1), tirx.const(0.0, t2)),
    name="shared_max",
)


@shared_kernel("avg_pool2d")
def avg_pool2d_shared_kernel(step: SharedStep, ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation],
                             shared: list[SharedRelax | None], out: RelaxActivation
                             ) -> tuple[SharedRelax | None, RelaxActivation]:
    """:func:`pyro2pfp.ops.pooling.avg_pool2d_shared` as one kernel ``sf_avgpool``."""
    x, sh = inputs[0], shared[0]
    assert sh is not None
    a = average_attrs(layer)
    in_hw, out_hw = ctx.shapes[layer.inputs[0]][1:], layer.layer.out_shape[1:]
    div = average_divisor(a, in_hw, out_hw)
    (kh, kw), (sy, sx), (py, px) = a["kernel"], a["stride"], a["padding"]
    h, w = in_hw

    def fn(s: te.Tensor, v: te.Tensor, d: te.Tensor) -> list[te.Tensor]:
        def window(t: Any, b: Any, c: Any, y: Any, x_: Any, i: Any, j: Any) -> Any:
            yy, xx = y * sy + i - py, x_ * sx + j - px
            inside = tirx.all(yy >= 0, yy < h, xx >= 0, xx < w)
            return tirx.Select(inside, t(b, c, te.min(te.max(yy, 0), h - 1), te.min(te.max(xx, 0), w - 1)),
                               f32(0.0))

        shape = (s.shape[0], s.shape[1], *out_hw)
        i, j = te.reduce_axis((0, kh), name="i"), te.reduce_axis((0, kw), name="j")
        s_out = te.compute(shape, lambda b, c, y, x_: te.sum(
            window(lambda *t: s[t], b, c, y, x_, i, j) / d[y, x_], axis=[i, j]), name="s")
        i2, j2 = te.reduce_axis((0, kh), name="i2"), te.reduce_axis((0, kw), name="j2")

        def indep(*t: Any) -> Any:
            return te.max(v[t] - s[t] * s[t], f32(0.0))

        rest = te.compute(shape, lambda b, c, y, x_: te.sum(
            window(indep, b, c, y, x_, i2, j2) / (d[y, x_] * d[y, x_]), axis=[i2, j2]), name="rest")
        var = te.compute(shape, lambda b, c, y, x_: rest[b, c, y, x_] + s_out[b, c, y, x_] * s_out[b, c, y, x_],
                         name="var")
        return [s_out, var]

    s, var = emit_part(ctx, fn, [sh.s, x.second, ctx.const(div)], layer, "avgpool")
    return SharedRelax(s, sh.g, sh.k), RelaxActivation(out.mean, var, out.repr)


@shared_kernel("max_pool2d")
def max_pool2d_shared_kernel(step: SharedStep, ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation],
                             shared: list[SharedRelax | None], out: RelaxActivation
                             ) -> tuple[SharedRelax | None, RelaxActivation]:
    """:func:`pyro2pfp.ops.pooling.max_pool2d_shared` as one kernel ``sf_maxpool``: Clark's fold with the
    profile's linear response, a sequential TE reduction (:data:`shared_max`)."""
    x, sh = inputs[0], shared[0]
    assert sh is not None
    win = Windows(layer, ctx.shapes[layer.inputs[0]])
    out_hw = layer.layer.out_shape[1:]

    def fn(m: te.Tensor, v: te.Tensor, s: te.Tensor, var: te.Tensor) -> te.Tensor:
        i, j = win.axes()
        taps = win.padded([m, v, s], [_LOWEST, 0.0, 0.0])  # plain loads in the combiner (see Windows.padded)
        shape = (m.shape[0], m.shape[1], *out_hw)
        acc = te.compute(shape, lambda b, c, y, x_: shared_max(
            tuple(win.load_padded(t, b, c, y, x_, i, j) for t in taps), axis=[i, j]), name="fold")
        return te.compute(shape, lambda b, c, y, x_: clip(acc[2][b, c, y, x_], var[b, c, y, x_]), name="s")

    s = emit_part(ctx, fn, [x.mean, x.second, sh.s, out.second], layer, "maxpool")[0]
    return SharedRelax(s, sh.g, sh.k), out


schedule("sf_avgpool", "sf_maxpool")(schedule_shared)
