"""A correlated guide's global factors in the compiled conv2d rule (``backends/tvm/ops/compute_shared.py``):
the TE kernels of the terms :mod:`pyro2pfp.correlation.guide` adds beside the scheme's own (its docstring has
the formulas), float32.

* ``sf_conv_guide_weights``: the guide's per-input weights of the profile convolution on the input mean,
  ``gw[b, c, i, j, o] = Σ_f F_f[o, c, i, j]·g[b, o, f]`` (``g`` the output's loadings, the guide's columns
  first), the profile's shift plus ``Σ_f F_b,f[o]·g[b, o, f]``, and, for an input with a shared part, the
  weights of the mean shift ``G[b, c, i, j, o] = Σ_f F_f[o, c, i, j]·g_in[b, c, f]``;
* ``sf_conv_guide_mean``: the mean shift ``μ[b, o, p] += Σ_{c,i,j} G[b, c, i, j, o]·s_in[b, c, p + (i, j)]``,
  a convolution with per-input weights laid out as the profile convolution's (its schedule).
"""
from __future__ import annotations

from typing import Any

from tvm import relax, te

from ...planning.plan import PlannedLayer
from .emit import EmitContext
from .ops.compute import _pad


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
