"""TE kernels of the shared-factor rules of pooling (``avg_pool2d``, ``max_pool2d``; the float64 and
ONNX rules: ``pyro2pfp/ops/pooling.py``), with their schedule: ``sf_avgpool`` (the window mean of the
profile and the pooled variance) and ``sf_maxpool`` (Clark's fold -- correlated where the planner gave
the pool its in-window covariances -- with the profile's linear response, one stage per window tap; it
computes the layer's mean-field outputs too)."""
from __future__ import annotations

from typing import Any

import numpy as np
from tvm import te, tirx

from ....correlation.backend import fuses_mean_field
from ....ops.pooling import average_attrs
from ....planning.graph import Repr
from ....planning.plan import PlannedLayer
from ....planning.registry import shared_kernel
from ...reference.arrays import average_divisor
from ..emit import EmitContext, RelaxActivation, epilogue, variance_of
from ..schedules import schedule
from ..shared_factor import SharedRelax, SharedStep, clip, emit_part, f32
from ..shared_factor_schedule import schedule_shared
from .pooling import Windows, correlated_max_pool

_LOWEST = float(np.finfo(np.float32).min)


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


@fuses_mean_field
@shared_kernel("max_pool2d")
def max_pool2d_shared_kernel(step: SharedStep, ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation],
                             shared: list[SharedRelax | None], out: RelaxActivation | None
                             ) -> tuple[SharedRelax | None, RelaxActivation]:
    """:func:`pyro2pfp.ops.pooling.max_pool2d_shared` as one kernel ``sf_maxpool`` that computes the layer's
    mean-field outputs too (called with ``out=None``): Clark's fold -- correlated with the ``window_cov``
    input's covariances, else independent -- one stage per window tap
    (:func:`~pyro2pfp.backends.tvm.ops.pooling.correlated_max_pool`), the profile carried with the fold's
    weights and clipped to the output's ``±sd``."""
    x, sh = inputs[0], shared[0]
    assert out is None and sh is not None and x.repr is Repr.VARIANCE, x.repr
    win = Windows(layer, ctx.shapes[layer.inputs[0]])
    covariances = [inputs[1].mean] if len(inputs) == 2 else []
    taps = win.kernel[0] * win.kernel[1]

    def fn(m: te.Tensor, v: te.Tensor, s: te.Tensor, *cov: te.Tensor) -> list[te.Tensor]:
        if taps == 1:  # a 1 x 1 window: a strided copy
            def copy(t: te.Tensor, name: str) -> te.Tensor:
                return te.compute((m.shape[0], *win.out_shape), lambda b, c, i, j: win.load(
                    t, b, c, i, j, 0, 0, _LOWEST if t is m else 0.0), name=name)

            mean, var, prof = copy(m, "mean"), copy(v, "var"), copy(s, "profile")
            second = te.compute(mean.shape, lambda *i: epilogue(mean[i], var[i], layer)[1], name="second")
        else:
            mean, second, prof = correlated_max_pool(win, layer, m, v, cov[0] if cov else None, s)
        s_out = te.compute(mean.shape, lambda *i: clip(prof[i], variance_of(mean[i], second[i], layer.out_repr)),
                           name="s")
        return [mean, second, s_out]

    outs = emit_part(ctx, fn, [x.mean, x.second, sh.s, *covariances], layer, "maxpool")
    return SharedRelax(outs[2], sh.g, sh.k), RelaxActivation(outs[0], outs[1], layer.out_repr)


schedule("sf_avgpool", "sf_maxpool")(schedule_shared)
