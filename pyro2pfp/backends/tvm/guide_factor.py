"""A correlated guide's global factors in the compiled conv2d rule (``backends/tvm/ops/compute_shared.py``):
the TE kernels of the terms :mod:`pyro2pfp.correlation.guide` adds beside the scheme's own (its docstring has
the formulas), float32.

* ``sf_conv_guide_weights``: the guide's per-input weights of the profile convolution on the input mean,
  ``gw[b, c, i, j, o] = Σ_f F_f[o, c, i, j]·g[b, o, f]`` (``g`` the output's loadings, the guide's columns
  first), the profile's shift plus ``Σ_f F_b,f[o]·g[b, o, f]``, and, for an input with a shared part, the
  weights of the mean shift ``G[b, c, i, j, o] = Σ_f F_f[o, c, i, j]·g_in[b, c, f]``;
* ``sf_conv_guide_mean``: the mean shift ``μ[b, o, p] += Σ_{c,i,j} G[b, c, i, j, o]·s_in[b, c, p + (i, j)]``,
  a convolution with per-input weights laid out as the profile convolution's (its schedule);
* ``sf_conv_guide_var``: the per-position variance's gain ``|λ_p|² + 2‖sym A_p‖² − counted``
  (:func:`pyro2pfp.correlation.guide.conv_variance`): ``λ`` (B, O, guide, OH, OW) the convolutions of ``μ``
  with every ``F_f`` plus ``Σ_c g_in[c, f]·Q[b, o, c, p]`` (``Q`` the per-channel convolution of ``s_in`` with
  ``W``); ``A`` likewise in two steps -- the per-channel convolutions ``P[b, o, c, f, p] = Σ_{i,j} F_f[o, c, i, j]·
  s_in[b, c, p + (i, j)]``, then ``A[f, h] = Σ_c P[.., c, f, ..]·g_in[c, h]`` (``guide·|W| + guide²·O·C``
  multiply-adds per position instead of ``guide²·|W|``); ``counted`` one convolution of ``μ²`` and
  ``s_in²·|g_in|²``.
"""
from __future__ import annotations

from typing import Any

from tvm import relax, te

from ...planning.plan import PlannedLayer
from .emit import EmitContext
from .ops.compute import _pad
from .shared_factor import f32


def guide_weights_fn(guide: int, with_mean: bool) -> Any:
    """The TE function of ``sf_conv_guide_weights``: ``(g, shift, F (C, KH, KW, O, guide), F_b (O, guide)
    [, g_in]) -> [gw, shift', [G]]`` (module docstring)."""

    def weights(*ts: te.Tensor) -> list[te.Tensor]:
        g, shift, fw, fb = ts[:4]
        g_in = ts[4] if with_mean else None
        batch = g.shape[0]
        c, kh, kw, o = fw.shape[:4]
        fr = te.reduce_axis((0, guide), name="fr")
        gw = te.compute((batch, c, kh, kw, o), lambda b, ch, i, j, oo: te.sum(fw[ch, i, j, oo, fr] * g[b, oo, fr],
                                                                               axis=fr), name="guide_w")
        fb_r = te.reduce_axis((0, guide), name="fb_r")
        gbias = te.compute((batch, o), lambda b, oo: te.sum(fb[oo, fb_r] * g[b, oo, fb_r], axis=fb_r),
                           name="guide_bias")
        outs = [gw, te.compute((batch, o), lambda b, oo: shift[b, oo] + gbias[b, oo], name="shift")]
        if g_in is not None:
            fm = te.reduce_axis((0, guide), name="fm")
            outs.append(te.compute((batch, c, kh, kw, o), lambda b, ch, i, j, oo: te.sum(
                fw[ch, i, j, oo, fm] * g_in[b, ch, fm], axis=fm), name="guide_mean_w"))
        return outs

    return weights


def guide_mean(ctx: EmitContext, layer: PlannedLayer, emit: Any, s_in: relax.Expr, weights: relax.Expr,
               mean: relax.Expr) -> relax.Expr:
    """``sf_conv_guide_mean``: ``mean + conv(s_in, weights)`` with per-input weights (B, C, KH, KW, O), the
    layer's stride, padding and dilation (blocks ``pad``, ``conv2d``, ``epilogue`` as the profile's)."""
    a = layer.layer.attrs
    (sy, sx), (py, px), (dy, dx) = a["stride"], a["padding"], a["dilation"]
    o, oh, ow = layer.layer.out_shape

    def conv(src: te.Tensor, wt: te.Tensor, base: te.Tensor) -> list[te.Tensor]:
        c, kh, kw = (int(d) for d in wt.shape[1:4])
        padded = _pad(src, [py, px])
        rc, rp, rq = (te.reduce_axis((0, n), name=name) for n, name in ((c, "rc"), (kh, "rp"), (kw, "rq")))
        acc = te.compute((src.shape[0], o, oh, ow), lambda b, oo, y, x_: te.sum(
            padded[b, rc, y * sy + rp * dy, x_ * sx + rq * dx] * wt[b, rc, rp, rq, oo], axis=[rc, rp, rq]),
            name="conv2d")
        return [te.compute(acc.shape, lambda b, oo, y, x_: base[b, oo, y, x_] + acc[b, oo, y, x_], name="epilogue")]

    return emit(ctx, conv, [s_in, weights, mean], layer, "conv_guide_mean")[0]


def guide_var_fn(layer: PlannedLayer, guide: int, with_input: bool) -> Any:
    """The TE function of ``sf_conv_guide_var``: ``(μ, [s_in, g_in,] F (C, KH, KW, O, guide), Σ_f F_f² (C, KH,
    KW, O), F_b (O, guide), |F_b|² (O,), [W² + Σ_f F_f² (C, KH, KW, O), W (C, KH, KW, O),] var) -> [var']``
    (module docstring); ``with_input``: the input has a shared part."""
    a = layer.layer.attrs
    (sy, sx), (py, px), (dy, dx) = a["stride"], a["padding"], a["dilation"]
    o, oh, ow = layer.layer.out_shape

    def variance(*ts: te.Tensor) -> list[te.Tensor]:
        it = iter(ts)
        mu = next(it)
        s, g_in = (next(it), next(it)) if with_input else (None, None)
        fw, f2, fb, fb2 = (next(it) for _ in range(4))
        wsq, wm = (next(it), next(it)) if with_input else (None, None)
        var = next(it)
        batch = mu.shape[0]
        c, kh, kw = (int(d) for d in fw.shape[:3])
        mp = _pad(mu, [py, px])

        def at(t: te.Tensor, b: Any, ch: Any, y: Any, x_: Any, i: Any, j: Any) -> Any:
            return t[b, ch, y * sy + i * dy, x_ * sx + j * dx]

        rc, ri, rj = (te.reduce_axis((0, n), name=name) for n, name in ((c, "lc"), (kh, "li"), (kw, "lj")))
        sp = _pad(s, [py, px]) if s is not None else None

        lam = te.compute((batch, o, guide, oh, ow), lambda b, oo, f, y, x_: te.sum(
            fw[rc, ri, rj, oo, f] * at(mp, b, rc, y, x_, ri, rj), axis=[rc, ri, rj]), name="guide_lambda")
        if sp is not None and g_in is not None and wm is not None:  # per channel, then over the channels
            wi, wj = te.reduce_axis((0, kh), name="wi"), te.reduce_axis((0, kw), name="wj")
            per_w = te.compute((batch, o, c, oh, ow), lambda b, oo, ch, y, x_: te.sum(
                wm[ch, wi, wj, oo] * at(sp, b, ch, y, x_, wi, wj), axis=[wi, wj]), name="guide_per_channel_w")
            wc = te.reduce_axis((0, c), name="wc")
            lam_in = te.compute((batch, o, guide, oh, ow), lambda b, oo, f, y, x_: te.sum(
                per_w[b, oo, wc, y, x_] * g_in[b, wc, f], axis=wc), name="guide_lambda_in")
            lam_all = te.compute((batch, o, guide, oh, ow), lambda b, oo, f, y, x_: lam[b, oo, f, y, x_]
                                 + lam_in[b, oo, f, y, x_] + fb[oo, f], name="guide_lambda_all")
        else:
            lam_all = te.compute((batch, o, guide, oh, ow), lambda b, oo, f, y, x_: lam[b, oo, f, y, x_] + fb[oo, f],
                                 name="guide_lambda_all")
        lf = te.reduce_axis((0, guide), name="lf")
        gain = te.compute((batch, o, oh, ow), lambda b, oo, y, x_: te.sum(
            lam_all[b, oo, lf, y, x_] * lam_all[b, oo, lf, y, x_], axis=lf), name="guide_linear")
        cc, ci, cj = (te.reduce_axis((0, n), name=name) for n, name in ((c, "cc"), (kh, "ci"), (kw, "cj")))
        if sp is not None and g_in is not None and wsq is not None:
            hr = te.reduce_axis((0, guide), name="hr")
            share = te.compute((batch, c), lambda b, ch: te.sum(g_in[b, ch, hr] * g_in[b, ch, hr], axis=hr),
                               name="guide_share")

            def counted_body(b: Any, oo: Any, y: Any, x_: Any) -> Any:
                m, sv = at(mp, b, cc, y, x_, ci, cj), at(sp, b, cc, y, x_, ci, cj)
                return te.sum(f2[cc, ci, cj, oo] * m * m + wsq[cc, ci, cj, oo] * sv * sv * share[b, cc],
                              axis=[cc, ci, cj])

            pi, pj = te.reduce_axis((0, kh), name="pi"), te.reduce_axis((0, kw), name="pj")
            per_channel = te.compute((batch, o, c, guide, oh, ow), lambda b, oo, ch, f, y, x_: te.sum(
                fw[ch, pi, pj, oo, f] * at(sp, b, ch, y, x_, pi, pj), axis=[pi, pj]), name="guide_per_channel")
            ac = te.reduce_axis((0, c), name="ac")
            amat = te.compute((batch, o, guide, guide, oh, ow), lambda b, oo, f, h, y, x_: te.sum(
                per_channel[b, oo, ac, f, y, x_] * g_in[b, ac, h], axis=ac), name="guide_product")
            qf, qh = te.reduce_axis((0, guide), name="qf"), te.reduce_axis((0, guide), name="qh")
            product = te.compute((batch, o, oh, ow), lambda b, oo, y, x_: te.sum(amat[b, oo, qf, qh, y, x_] * (
                amat[b, oo, qf, qh, y, x_] + amat[b, oo, qh, qf, y, x_]), axis=[qf, qh]), name="guide_product_var")
        else:
            def counted_body(b: Any, oo: Any, y: Any, x_: Any) -> Any:
                m = at(mp, b, cc, y, x_, ci, cj)
                return te.sum(f2[cc, ci, cj, oo] * m * m, axis=[cc, ci, cj])

            product = None
        counted = te.compute((batch, o, oh, ow), counted_body, name="guide_counted")

        def out(b: Any, oo: Any, y: Any, x_: Any) -> Any:
            value = var[b, oo, y, x_] + gain[b, oo, y, x_] - counted[b, oo, y, x_] - fb2[oo]
            if product is not None:
                value = value + product[b, oo, y, x_]
            return te.max(value, f32(0.0))

        return [te.compute((batch, o, oh, ow), out, name="var")]

    return variance


def guide_variance(ctx: EmitContext, layer: PlannedLayer, emit: Any, args: list[relax.Expr], guide: int,
                   with_input: bool) -> relax.Expr:
    """``sf_conv_guide_var``: the conv's output variance with the guide's noise inside a receptive field
    re-summed (``args`` as :func:`guide_var_fn` takes them)."""
    return emit(ctx, guide_var_fn(layer, guide, with_input), args, layer, "conv_guide_var")[0]
