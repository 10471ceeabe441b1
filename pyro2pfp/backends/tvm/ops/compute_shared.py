"""TE kernels of the shared-factor rules of the compute layers (``dense``, ``conv2d``; the float64 and
ONNX rules: ``pyro2pfp/ops/compute.py``), with their schedules -- beside ``compute.py`` because they
are as long as the mean-field kernels.

* conv2d: ``sf_conv_load`` -- the pooled views ``m̄μ_k``, ``m̄s_k`` (separable, no padded copy),
  ``w̄``, ``ℓ = A·g_in ⊕ w̄`` (``A = W·m̄s``) normalised to ``g``, ``β = ⟨g_in[c], g[o]⟩`` and the
  injection's ``coef = g[o, offset + o]/w̄`` --;
  ``sf_conv_weights`` (per-input weights ``W·β + coef·V·m̄s`` and ``coef·V·m̄μ``; it does not read
  ``g``, so it does not depend on ``K``: layers that differ only in ``K`` share it) and
  ``sf_conv_profile``: the propagated and the regression profile as one convolution of ``[s_in, μ]``
  with those weights, laid out like the mean-field conv kernel and scheduled by its schedule
  (``compute.schedule_conv2d``: register tiles, vectorised).  ``β`` is emitted as ``βᵀ`` (B, C, O),
  unit-stride in ``o`` like the weights kernel reads it.
  Layers of :func:`~.winograd.winograd_shape` (3x3, stride 1, ≥ 16 channels: the ResNet block convs)
  use Winograd F(2x2, 3x3) instead, as the mean-field conv does: ``sf_conv_weights`` emits the
  weights' transforms ``G·A·Gᵀ``, ``G·M·Gᵀ`` (B, 4, 4, C, O) -- per input, at run time
  (:func:`~.winograd.weight_transform`) -- and ``sf_conv_profile`` is :func:`winograd_profile`
  (input transforms of ``s_in`` and ``μ``, one batched GEMM per input and transform position summing
  both terms, output transform, ``+ shift``, clip; scheduled by :func:`~.winograd.schedule_winograd`).
  Off under :func:`~.winograd.direct_convolutions`;
* conv2d with ``injection='rescaled'`` (a noisy layer): the mean-field conv kernel returns its
  weight-noise term ``Σ V·E[x²] + v_bias`` (``compute.py``), and the regression terms are replaced by
  that term's root rescaled to the injection's spatial mean: ``sf_conv_load`` computes the scale
  ``g[o, offset + o]·w̄/mean_p √term`` (block ``root_mean``, a row sum) and no longer outputs the
  pooled views; ``sf_conv_weights`` builds the propagated weights ``W·β`` alone (no ``coef·V·m̄s``, no
  ``w_mu``, no shift), and ``sf_conv_profile`` convolves ``s_in`` only and adds ``scale·√term`` in its
  epilogue.  Without a shared input there is nothing to convolve: ``sf_conv_load`` writes the clipped
  profile ``scale·√term`` itself (block ``s_out``) and the layer has no weights or profile kernel;
* dense: ``sf_dense_load`` (the loading, ``g``, the corrected variance and the clipped profile).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial
from typing import Any

import numpy as np
from tvm import te, tirx

from ....correlation.factors import ComputeFactors
from ....correlation.guide import guide_tensors
from ....errors import PFPError
from ....planning.plan import PlannedLayer
from ....planning.registry import shared_kernel
from ..emit import EmitContext, RelaxActivation
from ..guide_factor import guide_mean, guide_variance, guide_weights_fn
from ..schedules import schedule
from ..shared_factor import (
    FactorWidths,
    SharedRelax,
    SharedStep,
    clip,
    emit_part,
    emit_width_generic,
    f32,
    normalised,
    row_products,
    safe_div,
    view_as,
    widened,
)
from ..shared_factor_schedule import schedule_shared
from .compute import _pad, schedule_conv2d
from .winograd import weight_transform, winograd_correlation, winograd_shape


def winograd_profile(pairs: list[tuple[te.Tensor, te.Tensor]], added: Any, var: te.Tensor) -> te.Tensor:
    """The profile convolution of a :func:`~.winograd.winograd_shape` layer by Winograd F(2x2, 3x3):
    ``s[b, o, y, x] = clip(Σ_k conv3x3(x_k, w_k)[b, o, y, x] + added(b, o, y, x), ±√var[b, o, y, x])``
    for ``pairs = [(x_k (B, C, H, W), U_k (B, 4, 4, C, O))]`` (``U_k = G·w_k·Gᵀ`` per input, emitted by
    ``sf_conv_weights``; :func:`~.winograd.winograd_correlation`) and ``added`` the injection's
    elementwise term -- a function of the output index (the rescaled root), or a (B, O) shift
    tensor --, NCHW out; block ``epilogue``."""
    if isinstance(added, te.Tensor):
        shift = added
        added = lambda b, o, i, j: shift[b, o]  # noqa: E731
    y = winograd_correlation(pairs)
    return te.compute(var.shape, lambda b, o, i, j: clip(y[b, i, j, o] + added(b, o, i, j), var[b, o, i, j]),
                      name="epilogue")


@dataclass(frozen=True)
class ConvSharedLayout:
    """The static facts the kernels of one conv2d layer's rule are specialised to: its shapes, stride, padding and
    dilation, whether its input has a shared part (``has_s``), its factor offset, the width of a correlated guide's
    factors (0: none), whether the profile convolution is Winograd's (``wino``) and whether the injection is
    ``'rescaled'``."""

    o: int
    c: int
    kh: int
    kw: int
    stride: tuple[int, int]
    pad: tuple[int, int]
    dilation: tuple[int, int]
    in_hw: tuple[int, int]
    out_hw: tuple[int, int]
    has_s: bool
    offset: int | None
    guide: int
    wino: bool
    rescaled: bool

    @property
    def has_guide(self) -> bool:
        return self.guide > 0

    def kernel_key(self) -> tuple[Any, ...]:
        """What the kernels read of the layout (:mod:`..kernel_memo`): every field, but of the offset only
        whether there is one -- the kernels take the offset itself as a parameter (``widths.offset``), so
        layers that differ only in it make one kernel."""
        return tuple((f.name, getattr(self, f.name) is not None if f.name == "offset" else getattr(self, f.name))
                     for f in fields(self))

    @staticmethod
    def of(step: SharedStep, ctx: EmitContext, layer: PlannedLayer, sh: SharedRelax | None) -> ConvSharedLayout:
        cf = ComputeFactors.of(layer, step.fp)
        o, c, kh, kw = cf.weight_mean.shape
        a = layer.layer.attrs
        wf, bf = guide_tensors(layer.tensors, o, step.fp)
        has_guide = wf is not None or bf is not None
        guide = (wf if wf is not None else bf).shape[-1] if has_guide else 0  # type: ignore[union-attr]
        rescaled = cf.offset is not None and step.fp.injection == "rescaled"
        if has_guide and rescaled:
            raise PFPError(f"{layer.layer.source}: the TVM back end carries a correlated guide's factors through "
                           "conv2d with injection='regression' only; convert with the default injection")
        h, w = ctx.shapes[layer.inputs[0]][1:]
        oh, ow = layer.layer.out_shape[1:]
        # the profile convolution by Winograd F(2x2, 3x3) (winograd.py); direct with the guide's extra term
        return ConvSharedLayout(o, c, kh, kw, tuple(a["stride"]), tuple(a["padding"]),
                                tuple(a["dilation"]), (h, w), (oh, ow), sh is not None,
                                cf.offset, guide, winograd_shape(layer) and not has_guide, rescaled)

    def column_weights(self) -> np.ndarray:
        """``P`` (KW, W): the output columns ``ox*sx + j*dx - px`` of kernel column ``j`` that fall inside the
        input, weighted 1/(oh*ow) -- the column half of the pooling as a (KW, W) product (:func:`pooled`)."""
        (oh, ow), w = self.out_hw, self.in_hw[1]
        col_weights = np.zeros((self.kw, w))
        for j in range(self.kw):
            for ox in range(ow):
                xx = ox * self.stride[1] + j * self.dilation[1] - self.pad[1]
                if 0 <= xx < w:
                    col_weights[j, xx] += 1.0 / (oh * ow)
        return col_weights


def pooled(lay: ConvSharedLayout, src: te.Tensor, n: int, cw: te.Tensor) -> te.Tensor:
    """``m̄[b, c, i, j]`` = mean over the output positions of the input at kernel offset ``(i, j)`` (0 where
    that tap falls in the padding), separable and without a padded copy: ``cols[b, c, i, x]`` = sum over the
    output rows of input row ``oy*sy + i*dy - py`` (a vector over the unit-stride ``x``), then ``m̄[.., i, j] =
    Σ_x cols[.., i, x]·P[j, x]`` with ``P`` :meth:`ConvSharedLayout.column_weights` (``KH·OH·W + KH·KW·W`` per
    channel)."""
    (h, w), oh = lay.in_hw, lay.out_hw[0]
    sy, py, dy = lay.stride[0], lay.pad[0], lay.dilation[0]
    y = te.reduce_axis((0, oh), name=f"y{n}")

    def row_tap(b: Any, ch: Any, i: Any, xx: Any) -> Any:
        yy = y * sy + i * dy - py
        return tirx.Select(tirx.all(yy >= 0, yy < h), src[b, ch, te.min(te.max(yy, 0), h - 1), xx], f32(0.0))

    cols = te.compute((src.shape[0], lay.c, lay.kh, w), lambda b, ch, i, xx: te.sum(row_tap(b, ch, i, xx), axis=y),
                      name=f"cols{n}")
    xr = te.reduce_axis((0, w), name=f"x{n}")
    return te.compute((src.shape[0], lay.c, lay.kh, lay.kw),
                      lambda b, ch, i, j: te.sum(cols[b, ch, i, xr] * cw[j, xr], axis=xr), name=f"bar{n}")


def injection_root(lay: ConvSharedLayout, mb: te.Tensor, sb: te.Tensor | None, wvt: te.Tensor,
                   bvt: te.Tensor) -> te.Tensor:
    """``w̄ = √(Σ V·(m̄μ² + m̄s²) + v_bias)`` (B, O): the root of the pooled weight and bias noise."""
    batch = mb.shape[0]
    cc, i, j = (te.reduce_axis((0, n), name=name) for n, name in ((lay.c, "c"), (lay.kh, "i"), (lay.kw, "j")))

    def second(b: Any, ch: Any, ii: Any, jj: Any) -> Any:
        mm = mb[b, ch, ii, jj] * mb[b, ch, ii, jj]
        return mm if sb is None else mm + sb[b, ch, ii, jj] * sb[b, ch, ii, jj]

    wsum = te.compute((batch, lay.o), lambda b, oo: te.sum(wvt[cc, i, j, oo] * second(b, cc, i, j),
                                                           axis=[cc, i, j]), name="wsum")
    return te.compute((batch, lay.o), lambda b, oo: te.sqrt(te.max(wsum[b, oo] + bvt[oo], f32(0.0))), name="wbar")


def coefficient(lay: ConvSharedLayout, g: te.Tensor, wbar: te.Tensor, noise: te.Tensor | None, off: Any
                ) -> te.Tensor:
    """``coef[b, o] = g[b, o, offset + o]/w̄[b, o]`` (0 where ``w̄ = 0`` or without an injection);
    ``injection='rescaled'``: ``g[b, o, offset + o]·w̄[b, o]/mean_p √noise[b, o, p]``, the factor of the
    rescaled root (0 where the mean root is 0)."""
    batch, o = wbar.shape
    if lay.offset is None:
        return te.compute((batch, o), lambda b, oo: f32(0.0), name="coef")
    if noise is not None:
        oh, ow = lay.out_hw
        y, xx = te.reduce_axis((0, oh), name="ry"), te.reduce_axis((0, ow), name="rx")
        inv = f32(1.0 / (oh * ow))
        rmean = te.compute((batch, o), lambda b, oo: te.sum(
            rescaled_root(noise, b, oo, y, xx) * inv, axis=[y, xx]), name="root_mean")
        return te.compute((batch, o), lambda b, oo: g[b, oo, oo + off] * safe_div(wbar[b, oo], rmean[b, oo]),
                          name="coef")
    return te.compute((batch, o), lambda b, oo: safe_div(g[b, oo, oo + off], wbar[b, oo]), name="coef")


def with_guide(lay: ConvSharedLayout, loading: te.Tensor | None, mb: te.Tensor, gwt: te.Tensor | None,
               gbt: te.Tensor | None, k: Any) -> te.Tensor:
    """``loading`` plus a correlated guide's ``Σ_{c,k} F_f[o, c, k]·m̄μ_k[c] + F_b,f[o]`` in its columns."""
    if gwt is None or gbt is None:
        assert loading is not None
        return loading
    batch, guide = mb.shape[0], lay.guide
    cg, ig, jg = (te.reduce_axis((0, n), name=name) for n, name in ((lay.c, "cg"), (lay.kh, "ig"), (lay.kw, "jg")))
    gsum = te.compute((batch, lay.o, guide), lambda b, oo, f: te.sum(
        gwt[cg, ig, jg, oo, f] * mb[b, cg, ig, jg], axis=[cg, ig, jg]), name="guide_through_mean")

    def entry(b: Any, oo: Any, f: Any) -> Any:
        ff = te.min(f, guide - 1)
        value = tirx.Select(f < guide, gsum[b, oo, ff] + gbt[oo, ff], f32(0.0))
        return value if loading is None else loading[b, oo, f] + value

    return te.compute((batch, lay.o, k), entry, name="loading_guide")


def conv_load(lay: ConvSharedLayout, *ts: te.Tensor, widths: FactorWidths) -> list[te.Tensor]:
    """Kernel ``sf_conv_load``: the pooled views ``m̄μ``, ``m̄s``; ``w̄`` (:func:`injection_root`); the loading
    ``ℓ = A·g_in ⊕ w̄`` (``A = W·m̄s``) normalised to ``g``; ``β = ⟨g_in[c], g[o]⟩``; the injection's
    coefficient (:func:`coefficient`) -- one kernel (the weights are read in ``(C, KH, KW, O)`` layout: ``A`` and
    the weight-variance sum are vectors over output channels).  ``coef`` is computed here, where ``g`` is, so the
    weights kernel does not read ``g``: it then does not depend on ``K``, and layers that differ only in ``K``
    share it (:mod:`..sharing`).  The factor widths and the offset are the symbolic ``widths``
    (:func:`emit_width_generic`): layers that differ only in them share this kernel too."""
    k, off = widths.k, widths.offset
    it = iter(ts)
    mu = next(it)
    s_in, g_in = (next(it), next(it)) if lay.has_s else (None, None)
    cw, wmt, wvt, bvt = (next(it) for _ in range(4))
    noise = next(it) if lay.rescaled else None  # the mean-field kernel's weight-noise term
    out_var = next(it) if lay.rescaled and not lay.has_s else None
    gwt, gbt = (next(it), next(it)) if lay.has_guide else (None, None)
    batch, o = mu.shape[0], lay.o
    mb = pooled(lay, mu, 0, cw)
    sb = pooled(lay, s_in, 1, cw) if s_in is not None else None
    wbar = injection_root(lay, mb, sb, wvt, bvt)
    if sb is None or g_in is None:
        own = te.compute((batch, o, k), lambda b, oo, f: tirx.Select(
            f == oo + off, wbar[b, oo], f32(0.0)), name="loading") if lay.offset is not None else None
        g = normalised(with_guide(lay, own, mb, gwt, gbt, k))[0]
        coef = coefficient(lay, g, wbar, noise, off)
        if noise is not None and out_var is not None:  # the profile is the rescaled root alone
            return [g, te.compute(noise.shape, lambda b, oo, y, xx: clip(
                coef[b, oo] * rescaled_root(noise, b, oo, y, xx), out_var[b, oo, y, xx]), name="s_out")]
        return [mb, g, coef]
    i2, j2 = te.reduce_axis((0, lay.kh), name="i2"), te.reduce_axis((0, lay.kw), name="j2")
    amap = te.compute((batch, lay.c, o), lambda b, ch, oo: te.sum(wmt[ch, i2, j2, oo] * sb[b, ch, i2, j2],
                                                                  axis=[i2, j2]), name="amap")
    gw = widened(g_in, k)
    c2 = te.reduce_axis((0, lay.c), name="c2")
    prop = te.compute((batch, o, k), lambda b, oo, f: te.sum(amap[b, c2, oo] * gw[b, c2, f], axis=c2),
                      name="prop")
    loading = prop if lay.offset is None else te.compute(prop.shape, lambda b, oo, f: prop[b, oo, f] + tirx.Select(
        f == oo + off, wbar[b, oo], f32(0.0)), name="loading")
    g = normalised(with_guide(lay, loading, mb, gwt, gbt, k))[0]
    # βᵀ[b, c, o] = ⟨g_in[c], g[o]⟩ (B, C, O): unit-stride in o, as the weights kernel reads it
    beta = row_products(g, g_in, g_in.shape[2])
    if noise is not None:  # the weights kernel reads neither pooled view
        return [g, coefficient(lay, g, wbar, noise, off), beta]
    return [mb, sb, g, coefficient(lay, g, wbar, noise, off), beta]


def conv_weights(lay: ConvSharedLayout, *ts: te.Tensor) -> list[te.Tensor]:
    """Kernel ``sf_conv_weights``: per-input weights (B, C, KH, KW, O) of the profile convolution: ``A = W·β +
    coef·V·m̄s`` on the input's profile, ``M = coef·V·m̄μ`` on its mean -- or, for a Winograd profile
    convolution, their transforms ``G·A·Gᵀ``, ``G·M·Gᵀ`` (B, 4, 4, C, O) -- and ``coef·v_bias`` (B, O).  ``W``,
    ``V`` come as (C, KH, KW, O), ``β`` as (B, C, O) and ``coef`` (B, O) from ``sf_conv_load``: every read
    unit-stride in ``o``, the vectorised axis, and none depends on ``K``.  ``injection='rescaled'``: ``W·β``
    alone, from ``(β, W)``."""
    it = iter(ts)
    if lay.rescaled:  # the propagated weights W·β alone
        mb, sb, bt, wmt = None, None, next(it), next(it)
        coef = wvt = bvt = None
    else:
        mb = next(it)
        sb, bt = (next(it), next(it)) if lay.has_s else (None, None)
        coef, wmt, wvt, bvt = (next(it) for _ in range(4))
    batch, offset = ts[0].shape[0], lay.offset
    wshape = (batch, lay.c, lay.kh, lay.kw, lay.o)
    outs = []
    if bt is not None:
        def on_s(b: Any, ch: Any, i: Any, j: Any, oo: Any) -> Any:
            value = wmt[ch, i, j, oo] * bt[b, ch, oo]
            if sb is not None and offset is not None and coef is not None and wvt is not None:
                value = value + coef[b, oo] * wvt[ch, i, j, oo] * sb[b, ch, i, j]
            return value

        outs.append(te.compute(wshape, on_s, name="w_s"))
    if mb is not None and coef is not None and wvt is not None and offset is not None:
        outs.append(te.compute(wshape, lambda b, ch, i, j, oo: coef[b, oo] * wvt[ch, i, j, oo]
                               * mb[b, ch, i, j], name="w_mu"))
    if lay.wino:  # their Winograd transforms G·w·Gᵀ (B, 4, 4, C, O) instead
        outs = [weight_transform(wt, f"wino_w{n}") for n, wt in enumerate(outs)]
    if coef is not None and bvt is not None:
        outs.append(te.compute((batch, lay.o), lambda b, oo: coef[b, oo] * bvt[oo]
                               if offset is not None else f32(0.0), name="shift"))
    return outs


def conv_profile(lay: ConvSharedLayout, n_terms: int, *ts: te.Tensor) -> list[te.Tensor]:
    """Kernel ``sf_conv_profile``: ``s[b, o] = Σ_{c,i,j} A·tap(s_in) + M·tap(μ) + shift``, clipped: a convolution
    with per-input weights, in the layout of the mean-field conv kernel (its schedule), or by Winograd
    (:func:`winograd_profile`); ``ts``: ``n_terms`` (input, weights) pairs, the shift (B, O) -- for
    ``'rescaled'`` the root's scale --, the output variance and, for ``'rescaled'``, the weight-noise term."""
    it = iter(ts)
    srcs = [(next(it), next(it)) for _ in range(n_terms)]  # (input, weights)
    per_channel, var = next(it), next(it)  # the shift (B, O), or for 'rescaled' the root's scale
    if lay.rescaled:
        noise = next(it)

        def added(b: Any, oo: Any, y: Any, x_: Any) -> Any:
            return per_channel[b, oo] * rescaled_root(noise, b, oo, y, x_)
    else:
        def added(b: Any, oo: Any, y: Any, x_: Any) -> Any:
            return per_channel[b, oo]
    if lay.wino:
        return [winograd_profile(srcs, added, var)]
    (sy, sx), (dy, dx) = lay.stride, lay.dilation
    padded = [(_pad(src, list(lay.pad)), wt) for src, wt in srcs]
    rc, rp, rq = (te.reduce_axis((0, n), name=name) for n, name in ((lay.c, "rc"), (lay.kh, "rp"), (lay.kw, "rq")))

    def body(b: Any, oo: Any, y: Any, x_: Any) -> Any:
        pos = (b, rc, y * sy + rp * dy, x_ * sx + rq * dx)
        total = padded[0][0][pos] * padded[0][1][b, rc, rp, rq, oo]
        for src, wt in padded[1:]:
            total = total + src[pos] * wt[b, rc, rp, rq, oo]
        return te.sum(total, axis=[rc, rp, rq])

    acc = te.compute((srcs[0][0].shape[0], lay.o, *lay.out_hw), body, name="conv2d")
    return [te.compute(acc.shape, lambda b, oo, y, x_: clip(acc[b, oo, y, x_] + added(b, oo, y, x_),
                                                             var[b, oo, y, x_]), name="epilogue")]


@shared_kernel('conv2d')
def conv2d_shared_kernel(step: SharedStep, ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation],
                         shared: list[SharedRelax | None], out: RelaxActivation
                         ) -> tuple[SharedRelax | None, RelaxActivation]:
    """:func:`pyro2pfp.ops.compute.conv2d_shared` as three kernels: :func:`conv_load`, :func:`conv_weights`,
    :func:`conv_profile` (module docstring), plus a correlated guide's (``backends/tvm/guide_factor.py``)."""
    x, sh = inputs[0], shared[0]
    lay = ConvSharedLayout.of(step, ctx, layer, sh)
    cf = ComputeFactors.of(layer, step.fp)
    t, o, c, kh, kw, k = layer.tensors, lay.o, lay.c, lay.kh, lay.kw, cf.k
    wf, bf = guide_tensors(t, o, step.fp)
    guide_w = np.transpose(wf if wf is not None else np.zeros((o, c, kh, kw, max(lay.guide, 1))), (1, 2, 3, 0, 4))
    guide_b = bf if bf is not None else np.zeros((o, max(lay.guide, 1)))
    bias_var = ctx.const(t["bias_var"] if "bias_var" in t else np.zeros(o))
    w_cons = [ctx.const(np.transpose(t_, (1, 2, 3, 0))) for t_ in (cf.weight_mean, cf.weight_var)]  # (C, KH, KW, O)
    args = [x.mean] + ([sh.s, sh.g] if sh is not None else []) + [ctx.const(lay.column_weights()), *w_cons, bias_var]
    if lay.rescaled:
        assert out.weight_noise is not None  # emit_module refuses a kernel that did not return it
        args += [out.weight_noise] + ([out.second] if sh is None else [])
    if lay.has_guide:
        args += [ctx.const(guide_w), ctx.const(guide_b)]
    if lay.has_guide:  # the guide's noise inside a receptive field, re-summed (correlation/guide.py)
        fw_sq = np.transpose((wf**2).sum(-1), (1, 2, 3, 0)) if wf is not None else np.zeros((c, kh, kw, o))
        v_args = [x.mean] + ([sh.s, sh.g] if sh is not None else []) + [
            ctx.const(guide_w), ctx.const(fw_sq), ctx.const(guide_b), ctx.const((guide_b**2).sum(-1))]
        if sh is not None:
            wm_t = np.transpose(cf.weight_mean, (1, 2, 3, 0))
            v_args += [ctx.const(fw_sq + wm_t**2), ctx.const(wm_t)]
        out = RelaxActivation(out.mean, guide_variance(ctx, layer, emit_part, v_args + [out.second], lay.guide,
                                                       sh is not None), out.repr, out.weight_noise)
    outs = emit_width_generic(ctx, partial(conv_load, lay), args, layer, "conv_load",
                              g_args={2: sh.k} if sh is not None else {}, k=k, offset=lay.offset or 0)
    if lay.rescaled and sh is None:  # no convolution: the profile is the rescaled root (load kernel)
        return SharedRelax(outs[1], outs[0], k), out
    if lay.rescaled:
        (g, coef_t, beta), mbar, sbar = outs, None, None
    elif sh is not None:
        mbar, sbar, g, coef_t, beta = outs
    else:
        (mbar, g, coef_t), sbar, beta = outs, None, None
    if lay.rescaled:
        w_args = [beta, w_cons[0]]
    else:
        w_args = [t_ for t_ in (mbar, sbar, beta) if t_ is not None] + [coef_t, *w_cons, bias_var]
    w_outs = emit_part(ctx, partial(conv_weights, lay), w_args, layer, "conv_weights")
    terms = ([sh.s] if sh is not None else []) + ([x.mean] if lay.offset is not None and not lay.rescaled else [])
    pairs = list(zip(terms, w_outs[:len(terms)]))
    shift = w_outs[-1]
    mean_w = None
    if lay.has_guide:  # the guide's profile term on the input mean, its bias term in the shift, the mean's weights
        g_outs = emit_part(ctx, guide_weights_fn(lay.guide, sh is not None and wf is not None),
                           [g, shift, ctx.const(guide_w), ctx.const(guide_b)]
                           + ([sh.g] if sh is not None and wf is not None else []), layer, "conv_guide_weights")
        pairs.append((x.mean, g_outs[0]))
        shift = g_outs[1]
        mean_w = g_outs[2] if len(g_outs) > 2 else None
    p_args = [t for pair in pairs for t in pair]
    p_args += [coef_t, out.second, out.weight_noise] if lay.rescaled else [shift, out.second]
    s = emit_part(ctx, partial(conv_profile, lay, len(pairs)), p_args, layer, "conv_profile")[0]
    if mean_w is not None and sh is not None:  # the mean of the weights' guide noise times the input's
        out = RelaxActivation(guide_mean(ctx, layer, emit_part, sh.s, mean_w, out.mean), out.second, out.repr,
                              out.weight_noise)
    return SharedRelax(s, g, k), out


def rescaled_root(noise: te.Tensor, b: Any, o: Any, y: Any, x: Any) -> Any:
    """``√max(noise, 0)`` at ``(b, o, y, x)``: the root of the mean-field weight-noise term that
    ``injection='rescaled'`` scales to the injection's spatial mean."""
    return te.sqrt(te.max(noise[b, o, y, x], f32(0.0)))


def _guide_terms(mu: te.Tensor, s: te.Tensor | None, g_in: te.Tensor | None, wft: te.Tensor, bft: te.Tensor,
                 wf2: te.Tensor, bf2: te.Tensor, counted: te.Tensor | None, prop: te.Tensor | None,
                 dims: tuple[Any, int, int, int, int, int, int]) -> tuple[te.Tensor, te.Tensor]:
    """A correlated guide's terms of ``sf_dense_load`` (:mod:`pyro2pfp.correlation.guide`): ``counted`` plus
    what the mean-field variance counted of the guide's noise (less the variance of the product of the weights'
    and the input's guide noise), and ``prop`` with the guide's loadings through the input mean appended.
    ``dims``: (batch, O, n, K, guide, rows, group)."""
    batch, o, n, k, guide, rows, group = dims
    ig = te.reduce_axis((0, n), name="ig")
    gsum = te.compute((batch, o, guide), lambda b, oo, f: te.sum(wft[oo, ig, f] * mu[b, ig], axis=ig),
                      name="guide_through_mean")
    ginj = te.compute((batch, o, guide), lambda b, oo, f: gsum[b, oo, f] + bft[oo, f], name="guide_injection")
    if s is not None and g_in is not None:
        fg = te.reduce_axis((0, guide), name="fg")
        share = te.compute((batch, rows), lambda b, r: te.sum(g_in[b, r, fg] * g_in[b, r, fg], axis=fg),
                           name="guide_share")
        second = te.compute((batch, n), lambda b, ii: mu[b, ii] * mu[b, ii]
                            + s[b, ii] * s[b, ii] * share[b, tirx.floordiv(ii, group)], name="guide_second")
    else:
        second = te.compute((batch, n), lambda b, ii: mu[b, ii] * mu[b, ii], name="guide_second")
    i3 = te.reduce_axis((0, n), name="i3")
    gcount = te.compute((batch, o), lambda b, oo: te.sum(wf2[oo, i3] * second[b, i3], axis=i3),
                        name="guide_counted")
    if s is not None and g_in is not None:  # less the variance of the product of the weights' and the
        # input's guide noise, 2‖sym A‖² with A[f, h] = Σ_i F_f[o, i]·s_i·g_in[i, h] (correlation/guide.py)
        i5 = te.reduce_axis((0, n), name="i5")
        amat = te.compute((batch, o, guide, guide), lambda b, oo, f, h: te.sum(
            wft[oo, i5, f] * s[b, i5] * g_in[b, tirx.floordiv(i5, group), h], axis=i5), name="guide_product")
        f5, h5 = te.reduce_axis((0, guide), name="f5"), te.reduce_axis((0, guide), name="h5")
        pvar = te.compute((batch, o), lambda b, oo: te.sum(amat[b, oo, f5, h5] * (
            amat[b, oo, f5, h5] + amat[b, oo, h5, f5]), axis=[f5, h5]), name="guide_product_var")
        gross = gcount
        gcount = te.compute((batch, o), lambda b, oo: gross[b, oo] - pvar[b, oo], name="guide_counted_net")
    before = counted
    counted = te.compute((batch, o), lambda b, oo: gcount[b, oo] + bf2[oo] + (
        before[b, oo] if before is not None else f32(0.0)), name="counted")
    base = prop

    def with_guide(b: Any, oo: Any, f: Any) -> Any:
        value = tirx.Select(f < guide, ginj[b, oo, te.min(f, guide - 1)], f32(0.0))
        return value if base is None else base[b, oo, f] + value

    prop = te.compute((batch, o, k), with_guide, name="prop_guide")
    return counted, prop


@shared_kernel('dense')
def dense_shared_kernel(step: SharedStep, ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation],
                        shared: list[SharedRelax | None], out: RelaxActivation
                        ) -> tuple[SharedRelax | None, RelaxActivation]:
    """:func:`pyro2pfp.ops.compute.dense_shared` as one kernel ``sf_dense_load``: the loading, ``g``, the
    corrected variance and the clipped profile -- and, with a correlated guide's factors
    (:mod:`pyro2pfp.correlation.guide`), their loading through the input mean, what the mean-field variance
    counted of them and the mean of the product of the weights' and the input's guide noise (the mean)."""
    x, sh = inputs[0], shared[0]
    cf = ComputeFactors.of(layer, step.fp)
    offset, k, wm, wv = cf.offset, cf.k, cf.weight_mean, cf.weight_var
    t = layer.tensors
    o, n = wm.shape
    src = layer.inputs[0]
    rows = step.fp.rows[src] if sh is not None else 0
    group = n // rows if rows else 1
    bias_var = ctx.const(t["bias_var"] if "bias_var" in t else np.zeros(o))
    x_mean = view_as(ctx, x.mean, n)
    x_second = view_as(ctx, x.second, n) if x.second is not None else None
    wf, bf = guide_tensors(t, o, step.fp)
    has_guide = wf is not None or bf is not None
    guide = (wf if wf is not None else bf).shape[-1] if has_guide else 0  # type: ignore[union-attr]
    # the guide's loadings (O, n, guide), bias loadings (O, guide) and their squared sums (O, n), (O,)
    wf_all = wf if wf is not None else np.zeros((o, n, max(guide, 1)))
    bf_all = bf if bf is not None else np.zeros((o, max(guide, 1)))
    shifted = wf is not None and sh is not None

    def load(*ts: Any) -> list[te.Tensor]:
        it = iter(ts)
        mu = next(it)
        v = next(it) if x_second is not None else None
        s, g_in = (next(it), next(it)) if sh is not None else (None, None)
        var, wmt, wvt, bvt = (next(it) for _ in range(4))
        wft, bft, wf2, bf2 = (next(it) for _ in range(4)) if has_guide else (None,) * 4
        mean = next(it) if shifted else None
        batch = mu.shape[0]
        if offset is not None:
            i = te.reduce_axis((0, n), name="i")
            inj = te.compute((batch, o), lambda b, oo: te.sum(wvt[oo, i] * (
                mu[b, i] * mu[b, i] + (v[b, i] if v is not None else f32(0.0))), axis=i), name="inj")
        prop = counted = None
        if s is not None and g_in is not None:
            q = te.reduce_axis((0, group), name="q")
            coef = te.compute((batch, o, rows), lambda b, oo, r: te.sum(
                wmt[oo, r * group + q] * s[b, r * group + q], axis=q), name="coef")
            i2 = te.reduce_axis((0, n), name="i2")
            counted = te.compute((batch, o), lambda b, oo: te.sum(
                wmt[oo, i2] * wmt[oo, i2] * s[b, i2] * s[b, i2], axis=i2), name="ws2")
            gw = widened(g_in, k)
            r2 = te.reduce_axis((0, rows), name="r2")
            prop = te.compute((batch, o, k), lambda b, oo, f: te.sum(coef[b, oo, r2] * gw[b, r2, f], axis=r2),
                              name="prop")
        if wft is not None and bft is not None and wf2 is not None and bf2 is not None:
            counted, prop = _guide_terms(mu, s, g_in, wft, bft, wf2, bf2, counted, prop,
                                         (batch, o, n, k, guide, rows, group))
        if prop is not None and counted is not None:
            f2 = te.reduce_axis((0, k), name="f2")
            pn = te.compute((batch, o), lambda b, oo: te.sum(prop[b, oo, f2] * prop[b, oo, f2], axis=f2), name="pn")
            var_new = te.compute((batch, o), lambda b, oo: te.max(var[b, oo] + pn[b, oo] - counted[b, oo], f32(0.0)),
                                 name="var")
        else:
            var_new = te.compute((batch, o), lambda b, oo: var[b, oo], name="var")

        def entry(b: Any, oo: Any, f: Any) -> Any:
            value = prop[b, oo, f] if prop is not None else f32(0.0)
            if offset is not None:
                value = value + tirx.Select(f == oo + offset, te.sqrt(te.max(inj[b, oo] + bvt[oo], f32(0.0))),
                                            f32(0.0))
            return value

        loading = te.compute((batch, o, k), entry, name="loading")
        g, norm = normalised(loading)
        s_out = te.compute((batch, o), lambda b, oo: clip(norm[b, oo], var_new[b, oo]), name="s")
        outs = [g, s_out, var_new]
        if mean is not None and s is not None and g_in is not None and wft is not None:
            i4, f4 = te.reduce_axis((0, n), name="i4"), te.reduce_axis((0, guide), name="f4")
            shift = te.compute((batch, o), lambda b, oo: te.sum(
                wft[oo, i4, f4] * s[b, i4] * g_in[b, tirx.floordiv(i4, group), f4], axis=[i4, f4]), name="shift")
            outs.append(te.compute((batch, o), lambda b, oo: mean[b, oo] + shift[b, oo], name="mean"))
        return outs

    args = [x_mean] + ([x_second] if x_second is not None else []) + (
        [view_as(ctx, sh.s, n), sh.g] if sh is not None else []) + [out.second, ctx.const(wm), ctx.const(wv),
                                                                  bias_var]
    if has_guide:
        args += [ctx.const(wf_all), ctx.const(bf_all), ctx.const((wf_all**2).sum(-1)), ctx.const((bf_all**2).sum(-1))]
    if shifted:
        args.append(view_as(ctx, out.mean, o))
    # with a guide, the nests of the guide's terms sit between those ROW_GROUPS merges for sf_dense_load:
    # its own op name, whose nests are scheduled one by one
    outs = emit_part(ctx, load, args, layer, "dense_guide_load" if has_guide else "dense_load")
    g, s, var_new = outs[:3]
    mean_out = outs[3] if shifted else out.mean
    return SharedRelax(s, g, k), RelaxActivation(mean_out, var_new, out.repr)


schedule("sf_conv_load", "sf_conv_weights", "sf_dense_load", "sf_dense_guide_load", "sf_conv_guide_weights",
         "sf_conv_guide_var")(schedule_shared)
# the profile convolution has the mean-field conv kernel's blocks (pad, conv2d, epilogue) and layout
schedule("sf_conv_profile", "sf_conv_guide_mean")(schedule_conv2d)
