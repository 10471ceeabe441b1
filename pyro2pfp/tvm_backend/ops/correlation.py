"""TE kernels of shared-factor PFP (:mod:`pyro2pfp.correlation`) and their default CPU schedule.

A plan with factors (``graph.factors``) is emitted as the mean-field kernels of every layer plus,
after each, the kernels of its shared-factor rule (:class:`SharedStep`, called by
``_core.emit_module``), which carry the profile ``s`` (B, *edge shape) and the loadings ``g``
(B, rows, K) beside ``(μ, v)`` and replace ``v`` where the rule corrects it (dense, add, average
pooling).  The rules and their sources are those of :mod:`pyro2pfp.correlation.rules`; here they
are float32 TE expressions of the same formulas:

* every loading ``ℓ`` is normalised by one kernel (``sf_norm``: ``‖ℓ‖`` and ``g = ℓ/‖ℓ‖``, 0 where
  ``‖ℓ‖ = 0``) and every profile is clipped to ``±sd`` of its edge, as in the reference executor;
* conv2d: ``sf_conv_pool`` (the pooled views ``m̄μ_k``, ``m̄s_k``), ``sf_conv_load`` (``A = W·m̄s``,
  ``w̄``, ``ℓ``), ``sf_conv_beta`` (``⟨g_in[c], g[o]⟩``), ``sf_conv_weights`` (per-input weights
  ``W·β + coef·V·m̄s`` and ``coef·V·m̄μ``) and ``sf_conv_profile``: the propagated and the regression
  profile as one convolution of ``[s_in, μ]`` with those weights, laid out like the mean-field conv
  kernel and scheduled by its schedule (``compute.schedule_conv2d``: register tiles, vectorised).
  Layers of :func:`~.winograd.winograd_shape` (3x3, stride 1, ≥ 16 channels: the ResNet block convs)
  use Winograd F(2x2, 3x3) instead, as the mean-field conv does: ``sf_conv_weights`` emits the
  weights' transforms ``G·A·Gᵀ``, ``G·M·Gᵀ`` (B, 4, 4, C, O) -- per input, at run time
  (:func:`~.winograd.weight_transform`) -- and ``sf_conv_profile`` is :func:`winograd_profile`
  (input transforms of ``s_in`` and ``μ``, one batched GEMM per input and transform position summing
  both terms, output transform, ``+ shift``, clip; scheduled by :func:`~.winograd.schedule_winograd`).
  Measured (``benchmarks/kernel_profile.py --net resnet20 --batch 10 --threads 1 --static --kernels``,
  AVX-512, best of 3-4 runs): the ``sf_conv_profile`` rows 13.5 -> 5.8 ms (per call: 16->16 32x32
  0.89 -> 0.39 ms, 32->32 16x16 0.77 -> 0.26, 64->64 8x8 0.66 -> 0.23), ``sf_conv_weights`` (now
  with the transforms, reading every operand unit-stride in ``o``) 1.4 -> 1.3 ms, the whole exe(x)
  37.1 -> 30.9 ms; at ``--batch 1`` 1.36 -> 0.54, 0.15 -> 0.12 and 4.1 -> 3.0 ms.  Compile time
  (``benchmarks/compile_time.py --repeats 1``) ResNet-20 14.7 -> 15.7 CPU s.  Off under
  :func:`~.winograd.direct_convolutions`;
* relu/leaky_relu: ``sf_relu_terms`` (Stein's ``lin``, the Hermite ``h`` and their channel means),
  ``sf_relu_load``, ``sf_relu_profile``; affine/scale: ``sf_scale``; add: ``sf_add_load`` and
  ``sf_add_profile`` (with the branch covariance); average pooling: ``sf_avgpool``; max pooling:
  ``sf_maxpool`` (Clark's fold with the profile's linear response, a sequential TE reduction); dense:
  ``sf_dense_load`` (with the corrected variance) and ``sf_clip``; reshape/convert: views.

**Static K, compaction by Cholesky**: every edge carries the factor columns of
:func:`~pyro2pfp.correlation.factors.fixed_k_plan` (``compaction=True``: the reference's compaction
points, ``K`` rounded up to whole SIMD vectors with zero columns).  Where the reference replaces ``g``
by ``Rᵀ`` of its QR factorisation, the kernels compute the Gram matrix ``g·gᵀ`` (``sf_gram``) and its
Cholesky factor ``L`` (``sf_cholesky``, :func:`cholesky_factor`, hand-written TIR in float64) -- the
same ``g·gᵀ``, which is all that is used downstream, so the results are the reference's up to float32
rounding and ``K`` stays bounded (ResNet-20: ≤ 320 columns instead of 1,488 without compaction).
Not compiled (an ``ArgumentError`` naming the layer): activations other than ReLU/LeakyReLU/scale,
the raw-moment plan and ``injection='rescaled'``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm
from tvm import relax, s_tir, te, tirx

from ... import moments
from ...correlation.backend import FixedKStep
from ...correlation.factors import ComputeFactors, aligned
from ...plan import PlannedLayer
from ...reference.arrays import average_divisor
from .._core import (
    F32,
    LAYER_ATTR,
    OP_ATTR,
    SCHEME_STEPS,
    EmitContext,
    RelaxActivation,
    fast_erf,
    fast_exp,
    te_shared,
)
from ..schedules import extent, pow2_divisor, schedule, simd_lanes, static_extent, vectorizable
from .compute import _pad, schedule_conv2d
from .winograd import schedule_weight_transforms, weight_transform, winograd_correlation, winograd_shape

PARTS = ("norm", "clip", "scale", "conv_pool", "conv_load", "conv_beta", "conv_weights", "relu_terms", "relu_load",
         "relu_profile", "add_load", "add_profile", "avgpool", "maxpool", "dense_load", "gram")
_LOWEST = float(np.finfo(np.float32).min)


def _c(value: float) -> tirx.PrimExpr:
    return tirx.const(value, F32)


def _max_step(a: Any, b: Any, ops: Any) -> list[Any]:
    """One step of the max-pool fold with the profile: Clark's ``(μ, v)`` of ``max(A, B)`` and
    ``Cov(max(A, B), η) = Φ(α)·s_A + Φ(−α)·s_B``, ``α = (μ_A − μ_B)/√(v_A + v_B)``."""
    theta = ops.sqrt(a[1] + b[1])
    alpha = te.min(te.max((a[0] - b[0]) / te.max(theta, _c(1e-30)), _c(-40.0)), _c(40.0))
    cdf = tirx.Select(theta > _c(0.0), ops.normal_cdfs(alpha)[0],
                      tirx.Select(a[0] >= b[0], _c(1.0), _c(0.0)))
    mean, var = moments.max_moments(a[0], a[1], b[0], b[1], ops)
    return [mean, var, cdf * a[2] + (_c(1.0) - cdf) * b[2]]


# The fold as a sequential TE reduction in row-major window order (as tvm_backend/ops/pooling.py; one
# expression would blow up in LLVM); identity (−FLT_MAX, 0, 0) is exact: Φ(α) = 0 there.
shared_max = te.comm_reducer(
    lambda a, b: tuple(te_shared(lambda ops: _max_step(a, b, ops))),
    lambda t0, t1, t2: (tirx.const(_LOWEST, t0), tirx.const(0.0, t1), tirx.const(0.0, t2)),
    name="shared_max",
)


@dataclass
class SharedRelax:
    """The shared part of one edge in the Relax graph: ``s`` (B, *edge shape), ``g`` (B, rows, k)."""

    s: relax.Expr
    g: relax.Expr
    k: int


def _emit(ctx: EmitContext, fn: Any, args: list[relax.Expr], layer: PlannedLayer, part: str) -> list[relax.Expr]:
    """One TE function as the PrimFunc ``pfp_sf_<part>_<layer>`` (op attribute ``sf_<part>``)."""
    attrs = {OP_ATTR: f"sf_{part}", LAYER_ATTR: layer.name}
    out = ctx.bb.emit_te(fn, *args, primfunc_name_hint=f"pfp_sf_{part}_{layer.name}", primfunc_attrs=attrs)
    if isinstance(out.ty, relax.TupleType):
        return [ctx.bb.emit(relax.TupleGetItem(out, i)) for i in range(len(out.ty.fields))]
    return [out]


def _view(ctx: EmitContext, t: relax.Expr, *shape: int) -> relax.Expr:
    return ctx.bb.emit(relax.op.reshape(t, relax.ShapeExpr([ctx.batch, *shape])))


def _safe_div(num: Any, den: Any) -> Any:
    return tirx.Select(den > _c(0.0), num / te.max(den, _c(1e-30)), _c(0.0))


def _clip(s: Any, var: Any) -> Any:
    sd = te.sqrt(te.max(var, _c(0.0)))
    return te.min(te.max(s, -sd), sd)


def _widened(g: te.Tensor, k: int) -> te.Tensor:
    """``g`` (B, R, k_in) with zero columns up to ``k``."""
    k_in = int(g.shape[2])
    if k_in == k:
        return g
    return te.compute((g.shape[0], g.shape[1], k), lambda b, r, f: tirx.Select(
        f < k_in, g[b, r, te.min(f, k_in - 1)], _c(0.0)), name="widened")


def _row_products(a: te.Tensor, b: te.Tensor, k: int) -> te.Tensor:
    """``out[n, r, c] = Σ_{f<k} a[n, c, f]·b[n, r, f]`` (B, rows of ``b``, rows of ``a``): the inner
    products of every row of ``b`` with every row of ``a`` -- ``β = ⟨g_in[c], g[o]⟩`` of the conv rule,
    the Gram matrix ``g·gᵀ`` of a compaction.  ``a`` is transposed first so ``c`` is unit-stride (block
    ``beta``, a :data:`MATMUL_BLOCKS` product of the schedule)."""
    a_t = te.compute((a.shape[0], k, a.shape[1]), lambda n, f, c: a[n, c, f], name="g_t")
    f = te.reduce_axis((0, k), name="f")
    return te.compute((a.shape[0], b.shape[1], a.shape[1]), lambda n, r, c: te.sum(a_t[n, f, c] * b[n, r, f], axis=f),
                      name="beta")


def _normalise(ctx: EmitContext, loading: relax.Expr, layer: PlannedLayer) -> tuple[relax.Expr, relax.Expr]:
    """``(g, ‖ℓ‖)`` of a loading (B, R, K)."""
    def fn(t: te.Tensor) -> list[te.Tensor]:
        f = te.reduce_axis((0, t.shape[2]), name="f")
        sq = te.compute(t.shape[:2], lambda b, r: te.sum(t[b, r, f] * t[b, r, f], axis=f), name="sq")
        norm = te.compute(t.shape[:2], lambda b, r: te.sqrt(sq[b, r]), name="norm")
        g = te.compute(t.shape, lambda b, r, j: _safe_div(t[b, r, j], norm[b, r]), name="g")
        return [g, norm]

    g, norm = _emit(ctx, fn, [loading], layer, "norm")
    return g, norm


def _scaled(ctx: EmitContext, s: relax.Expr, var: relax.Expr, factor: relax.Expr, layer: PlannedLayer
            ) -> relax.Expr:
    """``clip(factor[r]·s[r, q])`` on (B, R, G) views (``factor`` (R,) or (1,))."""
    def fn(st: te.Tensor, vt: te.Tensor, a: te.Tensor) -> te.Tensor:
        per_row = int(a.shape[0]) > 1
        return te.compute(st.shape, lambda b, r, q: _clip(a[r if per_row else 0] * st[b, r, q], vt[b, r, q]),
                          name="scaled")

    return _emit(ctx, fn, [s, var, factor], layer, "scale")[0]


def winograd_profile(pairs: list[tuple[te.Tensor, te.Tensor]], shift: te.Tensor, var: te.Tensor) -> te.Tensor:
    """The profile convolution of a :func:`~.winograd.winograd_shape` layer by Winograd F(2x2, 3x3):
    ``s[b, o, y, x] = clip(Σ_k conv3x3(x_k, w_k)[b, o, y, x] + shift[b, o], ±√var[b, o, y, x])`` for
    ``pairs = [(x_k (B, C, H, W), U_k (B, 4, 4, C, O))]`` (``U_k = G·w_k·Gᵀ`` per input, emitted by
    ``sf_conv_weights``; :func:`~.winograd.winograd_correlation`), NCHW out; block ``epilogue``."""
    y = winograd_correlation(pairs)
    return te.compute(var.shape, lambda b, o, i, j: _clip(y[b, i, j, o] + shift[b, o], var[b, o, i, j]),
                      name="epilogue")


class SharedStep(FixedKStep):
    """The shared-factor kernels of one plan, emitted after each layer's mean-field kernel."""

    what = "the TVM back end"
    compaction = True

    def view(self, ctx: EmitContext, layer: PlannedLayer, sh: SharedRelax) -> SharedRelax:
        return SharedRelax(_view(ctx, sh.s, *layer.layer.out_shape), sh.g, sh.k)

    # ------------------------------------------------------------------ helpers
    def _grouped(self, ctx: EmitContext, t: relax.Expr, name: str) -> relax.Expr:
        """``t`` (B, *shape of edge ``name``) as a (B, rows, group) view."""
        rows = self.fp.rows[name]
        return _view(ctx, t, rows, int(np.prod(ctx.shapes[name])) // rows)

    # ------------------------------------------------------------------ rules
    def linear(self, ctx: EmitContext, layer: PlannedLayer, sh: SharedRelax, out: RelaxActivation) -> SharedRelax:
        factor = layer.tensors["scale"] if layer.op == "affine" else np.array([layer.layer.attrs["factor"]])
        name = layer.name
        s = _scaled(ctx, self._grouped(ctx, sh.s, name), self._grouped(ctx, out.second, name), ctx.const(factor),
                    layer)
        return SharedRelax(_view(ctx, s, *ctx.shapes[name]), sh.g, sh.k)

    def relu(self, ctx: EmitContext, layer: PlannedLayer, x: RelaxActivation, sh: SharedRelax,
              out: RelaxActivation) -> SharedRelax:
        slope = float(layer.layer.attrs["slope"]) if layer.op == "leaky_relu" else 0.0
        name, src = layer.name, layer.inputs[0]
        offset = self.fp.offsets.get(name)
        k = self.fp.width[name]
        views = [self._grouped(ctx, t, src) for t in (x.mean, x.second, sh.s)]
        out_var = self._grouped(ctx, out.second, name)

        def terms(m: te.Tensor, v: te.Tensor, s: te.Tensor) -> list[te.Tensor]:
            def lin_h(b: Any, r: Any, q: Any) -> list[Any]:
                sd = te.sqrt(te.max(v[b, r, q], _c(0.0)))
                alpha = te.min(te.max(_safe_div(m[b, r, q], sd), _c(-40.0)), _c(40.0))
                cdf = tirx.Select(sd > _c(0.0), _c(0.5) + _c(0.5) * fast_erf(alpha * _c(1 / math.sqrt(2))),
                                  tirx.Select(m[b, r, q] > _c(0.0), _c(1.0), _c(0.0)))
                pdf = fast_exp(_c(-0.5) * alpha * alpha) * _c(1 / math.sqrt(2 * math.pi))
                lin = (cdf + _c(slope) * (_c(1.0) - cdf)) * s[b, r, q]
                h = _safe_div(_c(1.0 - slope) * pdf, sd) * s[b, r, q] * s[b, r, q] * _c(1 / math.sqrt(2))
                return [lin, h]

            both = te.compute(m.shape, lin_h, name="lin_h")
            q = te.reduce_axis((0, m.shape[2]), name="q")
            inv = _c(1.0 / int(m.shape[2]))
            lbar = te.compute(m.shape[:2], lambda b, r: te.sum(both[0][b, r, q] * inv, axis=q), name="lbar")
            q2 = te.reduce_axis((0, m.shape[2]), name="q2")
            hbar = te.compute(m.shape[:2], lambda b, r: te.sum(both[1][b, r, q2] * inv, axis=q2), name="hbar")
            return [both[0], both[1], lbar, hbar]

        lin, h, lbar, hbar = _emit(ctx, terms, views, layer, "relu_terms")
        if offset is None:  # hermite='none': the linear response only
            s = _scaled(ctx, lin, out_var, ctx.const(np.ones(1)), layer)
            return SharedRelax(_view(ctx, s, *ctx.shapes[name]), sh.g, sh.k)

        def load(lb: te.Tensor, hb: te.Tensor, g_in: te.Tensor) -> te.Tensor:
            gw = _widened(g_in, k)
            return te.compute((lb.shape[0], lb.shape[1], k), lambda b, r, f: lb[b, r] * gw[b, r, f] + tirx.Select(
                f == r + offset, hb[b, r], _c(0.0)), name="loading")

        loading = _emit(ctx, load, [lbar, hbar, sh.g], layer, "relu_load")[0]
        g, norm = _normalise(ctx, loading, layer)

        def profile(li: te.Tensor, hi: te.Tensor, lb: te.Tensor, hb: te.Tensor, nm: te.Tensor, v: te.Tensor
                    ) -> te.Tensor:
            return te.compute(li.shape, lambda b, r, q: _clip(
                _safe_div(lb[b, r], nm[b, r]) * li[b, r, q] + _safe_div(hb[b, r], nm[b, r]) * hi[b, r, q], v[b, r, q]),
                name="profile")

        s = _emit(ctx, profile, [lin, h, lbar, hbar, norm, out_var], layer, "relu_profile")[0]
        return SharedRelax(_view(ctx, s, *ctx.shapes[name]), g, k)

    def add(self, ctx: EmitContext, layer: PlannedLayer, sa: SharedRelax, sb: SharedRelax, out: RelaxActivation
            ) -> tuple[SharedRelax, RelaxActivation]:
        name = layer.name
        k = self.fp.width[name]
        a_s, b_s, var = (self._grouped(ctx, t, name) for t in (sa.s, sb.s, out.second))

        def load(at: te.Tensor, bt: te.Tensor, ga: te.Tensor, gb: te.Tensor) -> list[te.Tensor]:
            gaw, gbw = _widened(ga, k), _widened(gb, k)
            q = te.reduce_axis((0, at.shape[2]), name="q")
            inv = _c(1.0 / int(at.shape[2]))
            abar = te.compute(at.shape[:2], lambda b, r: te.sum(at[b, r, q] * inv, axis=q), name="abar")
            q2 = te.reduce_axis((0, at.shape[2]), name="q2")
            bbar = te.compute(at.shape[:2], lambda b, r: te.sum(bt[b, r, q2] * inv, axis=q2), name="bbar")
            f = te.reduce_axis((0, k), name="f")
            dot = te.compute(at.shape[:2], lambda b, r: te.sum(gaw[b, r, f] * gbw[b, r, f], axis=f), name="dot")
            loading = te.compute((at.shape[0], at.shape[1], k), lambda b, r, j: abar[b, r] * gaw[b, r, j]
                                 + bbar[b, r] * gbw[b, r, j], name="loading")
            return [loading, dot]

        loading, dot = _emit(ctx, load, [a_s, b_s, sa.g, sb.g], layer, "add_load")
        g, _ = _normalise(ctx, loading, layer)

        def profile(at: te.Tensor, bt: te.Tensor, v: te.Tensor, dt: te.Tensor, ga: te.Tensor, gb: te.Tensor,
                    gt: te.Tensor) -> list[te.Tensor]:
            gaw, gbw = _widened(ga, k), _widened(gb, k)
            f = te.reduce_axis((0, k), name="f")
            pa = te.compute(at.shape[:2], lambda b, r: te.sum(gaw[b, r, f] * gt[b, r, f], axis=f), name="pa")
            f2 = te.reduce_axis((0, k), name="f2")
            pb = te.compute(at.shape[:2], lambda b, r: te.sum(gbw[b, r, f2] * gt[b, r, f2], axis=f2), name="pb")
            var_new = te.compute(at.shape, lambda b, r, q: te.max(
                v[b, r, q] + _c(2.0) * at[b, r, q] * bt[b, r, q] * dt[b, r], _c(0.0)), name="var")
            s = te.compute(at.shape, lambda b, r, q: _clip(at[b, r, q] * pa[b, r] + bt[b, r, q] * pb[b, r],
                                                           var_new[b, r, q]), name="s")
            return [s, var_new]

        s, var_new = _emit(ctx, profile, [a_s, b_s, var, dot, sa.g, sb.g, g], layer, "add_profile")
        shape = ctx.shapes[name]
        out = RelaxActivation(out.mean, _view(ctx, var_new, *shape), out.repr)
        return SharedRelax(_view(ctx, s, *shape), g, k), out

    def avg_pool(self, ctx: EmitContext, layer: PlannedLayer, x: RelaxActivation, sh: SharedRelax,
                  out: RelaxActivation) -> tuple[SharedRelax, RelaxActivation]:
        a = dict(layer.layer.attrs)
        a.setdefault("divisor", None)
        a.setdefault("count_include_pad", False)
        in_hw, out_hw = ctx.shapes[layer.inputs[0]][1:], layer.layer.out_shape[1:]
        div = average_divisor(a, in_hw, out_hw)
        (kh, kw), (sy, sx), (py, px) = a["kernel"], a["stride"], a["padding"]
        h, w = in_hw

        def fn(s: te.Tensor, v: te.Tensor, d: te.Tensor) -> list[te.Tensor]:
            def window(t: Any, b: Any, c: Any, y: Any, x_: Any, i: Any, j: Any) -> Any:
                yy, xx = y * sy + i - py, x_ * sx + j - px
                inside = tirx.all(yy >= 0, yy < h, xx >= 0, xx < w)
                return tirx.Select(inside, t(b, c, te.min(te.max(yy, 0), h - 1), te.min(te.max(xx, 0), w - 1)),
                                   _c(0.0))

            shape = (s.shape[0], s.shape[1], *out_hw)
            i, j = te.reduce_axis((0, kh), name="i"), te.reduce_axis((0, kw), name="j")
            s_out = te.compute(shape, lambda b, c, y, x_: te.sum(
                window(lambda *t: s[t], b, c, y, x_, i, j) / d[y, x_], axis=[i, j]), name="s")
            i2, j2 = te.reduce_axis((0, kh), name="i2"), te.reduce_axis((0, kw), name="j2")

            def indep(*t: Any) -> Any:
                return te.max(v[t] - s[t] * s[t], _c(0.0))

            rest = te.compute(shape, lambda b, c, y, x_: te.sum(
                window(indep, b, c, y, x_, i2, j2) / (d[y, x_] * d[y, x_]), axis=[i2, j2]), name="rest")
            var = te.compute(shape, lambda b, c, y, x_: rest[b, c, y, x_] + s_out[b, c, y, x_] * s_out[b, c, y, x_],
                             name="var")
            return [s_out, var]

        s, var = _emit(ctx, fn, [sh.s, x.second, ctx.const(div)], layer, "avgpool")
        return SharedRelax(s, sh.g, sh.k), RelaxActivation(out.mean, var, out.repr)

    def max_pool(self, ctx: EmitContext, layer: PlannedLayer, x: RelaxActivation, sh: SharedRelax,
                  out: RelaxActivation) -> SharedRelax:
        a = layer.layer.attrs
        (kh, kw), (sy, sx), (py, px) = a["kernel"], a["stride"], a["padding"]
        h, w = ctx.shapes[layer.inputs[0]][1:]
        out_hw = layer.layer.out_shape[1:]

        def fn(m: te.Tensor, v: te.Tensor, s: te.Tensor, var: te.Tensor) -> te.Tensor:
            i, j = te.reduce_axis((0, kh), name="i"), te.reduce_axis((0, kw), name="j")

            def tap(t: te.Tensor, fill: float, b: Any, c: Any, y: Any, x_: Any) -> Any:
                yy, xx = y * sy + i - py, x_ * sx + j - px
                inside = tirx.all(yy >= 0, yy < h, xx >= 0, xx < w)
                return tirx.Select(inside, t[b, c, te.min(te.max(yy, 0), h - 1), te.min(te.max(xx, 0), w - 1)],
                                   _c(fill))

            shape = (m.shape[0], m.shape[1], *out_hw)
            acc = te.compute(shape, lambda b, c, y, x_: shared_max(
                (tap(m, _LOWEST, b, c, y, x_), tap(v, 0.0, b, c, y, x_), tap(s, 0.0, b, c, y, x_)), axis=[i, j]),
                name="fold")
            return te.compute(shape, lambda b, c, y, x_: _clip(acc[2][b, c, y, x_], var[b, c, y, x_]), name="s")

        s = _emit(ctx, fn, [x.mean, x.second, sh.s, out.second], layer, "maxpool")[0]
        return SharedRelax(s, sh.g, sh.k)

    def conv2d(self, ctx: EmitContext, layer: PlannedLayer, x: RelaxActivation, sh: SharedRelax | None,
               out: RelaxActivation) -> SharedRelax | None:
        cf = ComputeFactors.of(layer, self.fp)
        offset, k, wm, wv = cf.offset, cf.k, cf.weight_mean, cf.weight_var
        t, a = layer.tensors, layer.layer.attrs
        o, c, kh, kw = wm.shape
        (sy, sx), (py, px), (dy, dx) = a["stride"], a["padding"], a["dilation"]
        h, w = ctx.shapes[layer.inputs[0]][1:]
        oh, ow = layer.layer.out_shape[1:]
        has_s = sh is not None
        wino = winograd_shape(layer)  # the profile convolution by Winograd F(2x2, 3x3) (winograd.py)
        bias_var = ctx.const(t["bias_var"] if "bias_var" in t else np.zeros(o))

        def tap(src: te.Tensor, b: Any, ch: Any, y: Any, x_: Any, i: Any, j: Any) -> Any:
            yy, xx = y * sy + i * dy - py, x_ * sx + j * dx - px
            inside = tirx.all(yy >= 0, yy < h, xx >= 0, xx < w)
            return tirx.Select(inside, src[b, ch, te.min(te.max(yy, 0), h - 1), te.min(te.max(xx, 0), w - 1)],
                               _c(0.0))

        def pooled(*srcs: te.Tensor) -> list[te.Tensor]:
            """``m̄[b, c, i, j]`` = mean over the output positions of the input at kernel offset
            ``(i, j)``: row sums over the output columns per padded input row, then sums over the
            output rows (separable: ``Hp·KW·OW + KH·KW·OH`` instead of ``KH·KW·OH·OW`` per channel)."""
            outs = []
            for n, src in enumerate(srcs):
                padded = _pad(src, [py, px])
                hp = int(padded.shape[2])
                x_ = te.reduce_axis((0, ow), name=f"x{n}")
                rows = te.compute((src.shape[0], c, hp, kw), lambda b, ch, yy, j: te.sum(
                    padded[b, ch, yy, x_ * sx + j * dx], axis=x_), name=f"rows{n}")  # noqa: B023
                y = te.reduce_axis((0, oh), name=f"y{n}")
                outs.append(te.compute((src.shape[0], c, kh, kw), lambda b, ch, i, j: te.sum(
                    rows[b, ch, y * sy + i * dy, j] * _c(1.0 / (oh * ow)), axis=y), name=f"bar{n}"))  # noqa: B023
            return outs

        bars = _emit(ctx, pooled, [x.mean] + ([sh.s] if sh is not None else []), layer, "conv_pool")
        mbar = bars[0]
        sbar = bars[1] if has_s else None

        def load(*ts: te.Tensor) -> list[te.Tensor]:
            mb, sb, g_in = ts[0], (ts[1] if has_s else None), (ts[2] if has_s else None)
            wmt, wvt, bvt = ts[-3:]
            cc, i, j = te.reduce_axis((0, c), name="c"), te.reduce_axis((0, kh), name="i"), te.reduce_axis((0, kw),
                                                                                                             name="j")

            def second(b: Any, ch: Any, ii: Any, jj: Any) -> Any:
                mm = mb[b, ch, ii, jj] * mb[b, ch, ii, jj]
                return mm if sb is None else mm + sb[b, ch, ii, jj] * sb[b, ch, ii, jj]

            wsum = te.compute((mb.shape[0], o), lambda b, oo: te.sum(
                wvt[oo, cc, i, j] * second(b, cc, i, j), axis=[cc, i, j]), name="wsum")
            wbar = te.compute((mb.shape[0], o), lambda b, oo: te.sqrt(te.max(wsum[b, oo] + bvt[oo], _c(0.0))),
                              name="wbar")
            if sb is None or g_in is None:
                loading = te.compute((mb.shape[0], o, k), lambda b, oo, f: tirx.Select(
                    f == oo + (offset or 0), wbar[b, oo], _c(0.0)), name="loading")
                return [loading, wbar]
            i2, j2 = te.reduce_axis((0, kh), name="i2"), te.reduce_axis((0, kw), name="j2")
            amap = te.compute((mb.shape[0], o, c), lambda b, oo, ch: te.sum(wmt[oo, ch, i2, j2] * sb[b, ch, i2, j2],
                                                                             axis=[i2, j2]), name="amap")
            gw = _widened(g_in, k)
            c2 = te.reduce_axis((0, c), name="c2")

            prop = te.compute((mb.shape[0], o, k), lambda b, oo, f: te.sum(amap[b, oo, c2] * gw[b, c2, f], axis=c2),
                              name="prop")
            if offset is None:
                return [prop, wbar]
            loading = te.compute(prop.shape, lambda b, oo, f: prop[b, oo, f] + tirx.Select(
                f == oo + offset, wbar[b, oo], _c(0.0)), name="loading")
            return [loading, wbar]

        load_args = [mbar] + ([sbar, sh.g] if has_s and sbar is not None and sh is not None else [])
        loading, wbar = _emit(ctx, load, load_args + [ctx.const(wm), ctx.const(wv), bias_var], layer, "conv_load")
        g, _ = _normalise(ctx, loading, layer)
        beta = None
        if sh is not None:
            k_in = sh.k

            # βᵀ[b, c, o] = ⟨g_in[c], g[o]⟩ (B, C, O): unit-stride in o, as the weights kernel reads it
            beta = _emit(ctx, lambda g_in, gt: _row_products(gt, g_in, k_in), [sh.g, g], layer, "conv_beta")[0]

        def weights(*ts: te.Tensor) -> list[te.Tensor]:
            """Per-input weights (B, C, KH, KW, O) of the profile convolution: ``A = W·β + coef·V·m̄s``
            on the input's profile, ``M = coef·V·m̄μ`` on its mean -- or, for a Winograd profile
            convolution, their transforms ``G·A·Gᵀ``, ``G·M·Gᵀ`` (B, 4, 4, C, O) -- and ``coef·v_bias``
            (B, O).  ``W``, ``V`` come as (C, KH, KW, O) and ``β`` as (B, C, O): every read unit-stride
            in ``o``, the vectorised axis."""
            it = iter(ts)
            mb = next(it)
            sb, bt = (next(it), next(it)) if has_s else (None, None)
            gt, wb, wmt, wvt, bvt = (next(it) for _ in range(5))
            batch = mb.shape[0]
            wshape = (batch, c, kh, kw, o)
            coef = te.compute((batch, o), lambda b, oo: _safe_div(gt[b, oo, oo + (offset or 0)], wb[b, oo]),
                              name="coef")
            outs = []
            if sb is not None and bt is not None:
                def on_s(b: Any, ch: Any, i: Any, j: Any, oo: Any) -> Any:
                    value = wmt[ch, i, j, oo] * bt[b, ch, oo]
                    if offset is not None:
                        value = value + coef[b, oo] * wvt[ch, i, j, oo] * sb[b, ch, i, j]
                    return value

                outs.append(te.compute(wshape, on_s, name="w_s"))
            if offset is not None:
                outs.append(te.compute(wshape, lambda b, ch, i, j, oo: coef[b, oo] * wvt[ch, i, j, oo]
                                       * mb[b, ch, i, j], name="w_mu"))
            if wino:  # their Winograd transforms G·w·Gᵀ (B, 4, 4, C, O) instead
                outs = [weight_transform(wt, f"wino_w{n}") for n, wt in enumerate(outs)]
            outs.append(te.compute((batch, o), lambda b, oo: coef[b, oo] * bvt[oo]
                                   if offset is not None else _c(0.0), name="shift"))
            return outs

        w_args = [mbar] + ([sbar, beta] if sbar is not None and beta is not None else [])
        w_cons = [ctx.const(np.transpose(t_, (1, 2, 3, 0))) for t_ in (wm, wv)]  # (C, KH, KW, O)
        w_outs = _emit(ctx, weights, w_args + [g, wbar, *w_cons, bias_var], layer, "conv_weights")

        def profile(*ts: te.Tensor) -> list[te.Tensor]:
            """``s[b, o] = Σ_{c,i,j} A·tap(s_in) + M·tap(μ) + shift``, clipped: a convolution with
            per-input weights, in the layout of the mean-field conv kernel (its schedule)."""
            it = iter(ts)
            srcs = [(next(it), next(it)) for _ in range(n_terms)]  # (input, weights)
            shift, var = next(it), next(it)
            if wino:
                return [winograd_profile(srcs, shift, var)]
            padded = [(_pad(src, [py, px]), wt) for src, wt in srcs]
            rc, rp, rq = (te.reduce_axis((0, n), name=name) for n, name in ((c, "rc"), (kh, "rp"), (kw, "rq")))

            def body(b: Any, oo: Any, y: Any, x_: Any) -> Any:
                pos = (b, rc, y * sy + rp * dy, x_ * sx + rq * dx)
                total = padded[0][0][pos] * padded[0][1][b, rc, rp, rq, oo]
                for src, wt in padded[1:]:
                    total = total + src[pos] * wt[b, rc, rp, rq, oo]
                return te.sum(total, axis=[rc, rp, rq])

            acc = te.compute((srcs[0][0].shape[0], o, oh, ow), body, name="conv2d")
            return te.compute(acc.shape, lambda b, oo, y, x_: _clip(acc[b, oo, y, x_] + shift[b, oo],
                                                                     var[b, oo, y, x_]), name="epilogue")

        terms = ([sh.s] if sh is not None else []) + ([x.mean] if offset is not None else [])
        n_terms = len(terms)
        args = [t for pair in zip(terms, w_outs[:n_terms]) for t in pair] + [w_outs[-1], out.second]
        s = _emit(ctx, profile, args, layer, "conv_profile")[0]
        return SharedRelax(s, g, k)

    def dense(self, ctx: EmitContext, layer: PlannedLayer, x: RelaxActivation, sh: SharedRelax | None,
               out: RelaxActivation) -> tuple[SharedRelax | None, RelaxActivation]:
        cf = ComputeFactors.of(layer, self.fp)
        offset, k, wm, wv = cf.offset, cf.k, cf.weight_mean, cf.weight_var
        t = layer.tensors
        o, n = wm.shape
        src = layer.inputs[0]
        rows = self.fp.rows[src] if sh is not None else 0
        group = n // rows if rows else 1
        bias_var = ctx.const(t["bias_var"] if "bias_var" in t else np.zeros(o))
        x_mean = _view(ctx, x.mean, n)
        x_second = _view(ctx, x.second, n) if x.second is not None else None

        def load(*ts: Any) -> list[te.Tensor]:
            it = iter(ts)
            mu = next(it)
            v = next(it) if x_second is not None else None
            s, g_in = (next(it), next(it)) if sh is not None else (None, None)
            var, wmt, wvt, bvt = (next(it) for _ in range(4))
            batch = mu.shape[0]
            parts: list[Any] = []
            if offset is not None:
                i = te.reduce_axis((0, n), name="i")
                inj = te.compute((batch, o), lambda b, oo: te.sum(wvt[oo, i] * (
                    mu[b, i] * mu[b, i] + (v[b, i] if v is not None else _c(0.0))), axis=i), name="inj")
            if s is not None and g_in is not None:
                q = te.reduce_axis((0, group), name="q")
                coef = te.compute((batch, o, rows), lambda b, oo, r: te.sum(
                    wmt[oo, r * group + q] * s[b, r * group + q], axis=q), name="coef")
                i2 = te.reduce_axis((0, n), name="i2")
                ws2 = te.compute((batch, o), lambda b, oo: te.sum(
                    wmt[oo, i2] * wmt[oo, i2] * s[b, i2] * s[b, i2], axis=i2), name="ws2")
                gw = _widened(g_in, k)
                r2 = te.reduce_axis((0, rows), name="r2")
                prop = te.compute((batch, o, k), lambda b, oo, f: te.sum(coef[b, oo, r2] * gw[b, r2, f], axis=r2),
                                  name="prop")
                f2 = te.reduce_axis((0, k), name="f2")
                pn = te.compute((batch, o), lambda b, oo: te.sum(prop[b, oo, f2] * prop[b, oo, f2], axis=f2), name="pn")
                var_new = te.compute((batch, o), lambda b, oo: te.max(var[b, oo] + pn[b, oo] - ws2[b, oo], _c(0.0)),
                                     name="var")
                parts = [prop, var_new]
            else:
                parts = [None, te.compute((batch, o), lambda b, oo: var[b, oo], name="var")]

            def entry(b: Any, oo: Any, f: Any) -> Any:
                value = parts[0][b, oo, f] if parts[0] is not None else _c(0.0)
                if offset is not None:
                    value = value + tirx.Select(f == oo + offset, te.sqrt(te.max(inj[b, oo] + bvt[oo], _c(0.0))),
                                                _c(0.0))
                return value

            loading = te.compute((batch, o, k), entry, name="loading")
            return [loading, parts[1]]

        args = [x_mean] + ([x_second] if x_second is not None else []) + (
            [_view(ctx, sh.s, n), sh.g] if sh is not None else []) + [out.second, ctx.const(wm), ctx.const(wv),
                                                                      bias_var]
        loading, var_new = _emit(ctx, load, args, layer, "dense_load")
        g, norm = _normalise(ctx, loading, layer)

        def clip(s: te.Tensor, v: te.Tensor) -> te.Tensor:
            return te.compute(s.shape, lambda b, oo: _clip(s[b, oo], v[b, oo]), name="s")

        s = _emit(ctx, clip, [norm, var_new], layer, "clip")[0]
        return SharedRelax(s, g, k), RelaxActivation(out.mean, var_new, out.repr)


    # ------------------------------------------------------------------ compaction
    def compact(self, ctx: EmitContext, layer: PlannedLayer, sh: SharedRelax) -> SharedRelax:
        """``g`` (B, R, K) → ``L`` (B, R, aligned(R)), the Cholesky factor of ``g·gᵀ`` (zero columns
        beyond ``R``): the same ``g·gᵀ``, which is all that is used downstream (exact, as the
        reference's QR compaction ``Rᵀ``, which equals ``L`` up to the signs of its columns)."""
        rows, k = self.fp.rows[layer.name], sh.k

        gram = _emit(ctx, lambda gt: _row_products(gt, gt, k), [sh.g], layer, "gram")[0]
        width = aligned(rows)
        func = cholesky_factor(rows, width).with_attrs({OP_ATTR: "sf_cholesky", LAYER_ATTR: layer.name})
        gv = ctx.bb.add_func(func, f"pfp_sf_cholesky_{layer.name}")
        g = ctx.bb.emit(relax.call_tir(gv, [gram], out_ty=relax.TensorType((ctx.batch, rows, width), "float32")))
        return SharedRelax(sh.s, g, width)


#: a pivot ``d`` of the Cholesky factorisation below this fraction of its diagonal entry counts as
#: zero (a row in the span of the previous ones, e.g. a dead channel or a duplicate): its column of
#: ``L`` is set to zero, which changes ``g·gᵀ`` by at most ``d`` on the diagonal
CHOLESKY_PIVOT_TOL = 1e-6


@functools.cache
def cholesky_factor(rows: int, width: int) -> tirx.PrimFunc:
    """PrimFunc ``(gram (n, R, R) float32) -> L (n, R, width) float32``: per input, the lower-
    triangular ``L`` with ``L·Lᵀ = gram`` (columns ``R … width-1`` zero), by the left-looking
    Cholesky–Banachiewicz recurrence in float64 (Golub & Van Loan, *Matrix Computations*, 4th ed.,
    Alg. 4.2.1): ``d_j = G[j, j] − Σ_{k<j} L[j, k]²``, ``L[j, j] = √d_j``, ``L[i, j] = (G[i, j] −
    Σ_{k<j} L[i, k]·L[j, k]) / L[j, j]``.  ``gram`` is positive *semi*-definite (the Gram matrix of
    unit or zero rows): a pivot ``d_j ≤`` :data:`CHOLESKY_PIVOT_TOL`·``G[j, j]`` gives a zero column
    (the row is in the span of the previous ones; rounding may have made ``d_j`` slightly negative),
    so the result stays finite.  Sequential per input (``O(R³/6)``), parallel over the batch; hand-
    written TIR, marked scheduled.  Cached per ``(rows, width)``: parsing the TVMScript costs ~0.2 s,
    and a ResNet-20 compacts 9 times with 3 distinct shapes."""
    from tvm.script import tirx as T

    tol = CHOLESKY_PIVOT_TOL
    r_ = rows

    @T.prim_func(private=True, s_tir=True)
    def cholesky(gram_h: T.handle, out_h: T.handle) -> None:
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        n = T.int64()
        # int64 dims like the TE kernels' (int32 ones break relax.transform.SpecializePrimFuncBasedOnCallSite,
        # which static-batch builds and tuning run)
        gram = T.match_buffer(gram_h, (n, T.int64(r_), T.int64(r_)), "float32")
        out = T.match_buffer(out_h, (n, T.int64(r_), T.int64(width)), "float32")
        with T.sblock("root"):  # Relax's passes expect a root block
            for b in T.parallel(n):
                lower = T.decl_buffer((r_ * r_,), "float64")
                acc = T.decl_buffer((1,), "float64")
                for j in range(r_):
                    acc[0] = T.Cast("float64", gram[b, j, j])
                    for k in range(j):
                        acc[0] = acc[0] - lower[j * r_ + k] * lower[j * r_ + k]
                    if acc[0] > T.float64(tol) * T.Cast("float64", gram[b, j, j]) and acc[0] > T.float64(0):
                        lower[j * r_ + j] = T.sqrt(acc[0])
                    else:
                        lower[j * r_ + j] = T.float64(0)
                    for i in range(j + 1, r_):
                        acc[0] = T.Cast("float64", gram[b, i, j])
                        for k in range(j):
                            acc[0] = acc[0] - lower[i * r_ + k] * lower[j * r_ + k]
                        if lower[j * r_ + j] > T.float64(0):
                            lower[i * r_ + j] = acc[0] / lower[j * r_ + j]
                        else:
                            lower[i * r_ + j] = T.float64(0)
                for i, f in T.grid(r_, width):
                    if f <= i:
                        out[b, i, f] = T.Cast("float32", lower[i * r_ + f])
                    else:
                        out[b, i, f] = T.float32(0)

    return cholesky


SCHEME_STEPS["shared-factor"] = SharedStep


MATMUL_BLOCKS = ("beta", "prop")
"""Blocks ``out[b, o, n] = Σ_r x[b, o|r, r]·y[b, r, n]`` whose last axis ``n`` is unit-stride in the
operand that depends on it (``β`` reads ``g_in`` transposed; the loadings' ``prop`` reads ``g_in``)."""


def schedule_shared(sch: s_tir.Schedule, layer: Any, target: tvm.target.Target) -> None:
    """Every loop nest of a shared-factor kernel: its first two data-parallel loops (the batch and
    the channel/row axis) fused into one parallel loop.  The product blocks of :data:`MATMUL_BLOCKS`
    get the reduction outside the unit-stride last axis, which is vectorised (split by the largest
    power of two dividing it, up to the SIMD width); other reductions stay serial inside.  The
    Winograd weight transforms of ``sf_conv_weights`` (and the weights they transform) get
    :func:`~.winograd.schedule_weight_transforms` instead."""
    lanes = simd_lanes(target)
    done = schedule_weight_transforms(sch, lanes)  # Winograd-transformed conv weights (sf_conv_weights)
    nests: dict[Any, Any] = {}
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        if sch.get(block).name_hint not in done:
            nests.setdefault(sch.get_sref(sch.get_loops(block)[0]), block)
    for block in nests.values():
        loops = sch.get_loops(block)  # now: an rfactor of an earlier nest renews the loops of the others
        if sch.get(block).name_hint in MATMUL_BLOCKS and len(loops) == 4:
            b, o, n, r = loops
            sch.reorder(b, o, r, n)
            sch.parallel(sch.fuse(b, o))
            vec = pow2_divisor(static_extent(sch, n), lanes)
            if vec > 1:
                sch.vectorize(sch.split(n, [None, vec])[1])
            sch.decompose_reduction(block, r)
            continue
        if _vector_reduction(sch, block, loops, lanes):
            continue
        spatial = sum(1 for iv in sch.get(block).iter_vars if int(iv.iter_type) == 0)
        lead = loops[:max(1, min(2, spatial))]
        sch.parallel(sch.fuse(*lead) if len(lead) > 1 else lead[0])
        if spatial == len(loops) > 2 and vectorizable(sch, [block]):  # elementwise: vectorise the last axis
            vec = pow2_divisor(static_extent(sch, loops[-1]), lanes)
            if vec > 1:
                sch.vectorize(sch.split(loops[-1], [None, vec])[1])


def _vector_reduction(sch: s_tir.Schedule, block: Any, loops: list[Any], lanes: int) -> bool:
    """Schedule a block whose reductions are its innermost loops (a row sum: the positions' mean of
    Stein's terms, ``‖ℓ‖²`` over the factors, a branch's mean profile, the weight-variance sum over
    channels and kernel offsets; several reduction loops are fused into one) with ``vec`` partial sums:
    the reduction split into ``(r_o, r_i)`` with ``r_i`` the largest power of two dividing it (up to
    the SIMD width), ``rfactor`` over ``r_i`` so the partial sums are a vector (``r_i`` vectorised,
    ``r_o`` serial), then the ``vec`` partial sums added per row under the same parallel loop.  A
    serial float32 sum is one dependent add per element (the adder's latency, ~4 cycles); this is
    ``vec`` independent ones per vector (measured 143 → 5 µs for a (10, 16, 1024) row mean, one
    thread).  Changes the summation order only.  False (nothing done) for any other block."""
    kinds = [int(iv.iter_type) for iv in sch.get(block).iter_vars]
    n_spatial = kinds.index(2) if 2 in kinds else len(kinds)
    if (len(kinds) != len(loops) or n_spatial == 0 or n_spatial == len(kinds)
            or any(k != 0 for k in kinds[:n_spatial]) or any(k != 2 for k in kinds[n_spatial:])):
        return False
    length = 1
    for loop in loops[n_spatial:]:
        size = extent(sch, loop)
        if size is None:
            return False
        length *= size
    vec = pow2_divisor(length, lanes)
    if vec < 4 or length < 2 * vec or not vectorizable(sch, [block]):
        return False
    # several trailing reductions (e.g. over channel and kernel offsets) are one row-major sum
    reduction = sch.fuse(*loops[n_spatial:]) if len(loops) - n_spatial > 1 else loops[-1]
    inner = sch.split(reduction, [None, vec])[1]
    partial = sch.rfactor(inner, factor_axis=n_spatial)  # loops: spatial..., r_o, r_i (new handles)
    lead = sch.get_loops(partial)[:min(2, n_spatial)]
    fused = sch.fuse(*lead) if len(lead) > 1 else lead[0]
    sch.parallel(fused)
    sch.vectorize(sch.get_loops(partial)[-1])
    sch.decompose_reduction(partial, sch.get_loops(partial)[-2])
    sch.reverse_compute_at(block, fused)
    return True


schedule(*(f"sf_{part}" for part in PARTS))(schedule_shared)
# the profile convolution has the mean-field conv kernel's blocks (pad, conv2d, epilogue) and layout
schedule("sf_conv_profile")(schedule_conv2d)
