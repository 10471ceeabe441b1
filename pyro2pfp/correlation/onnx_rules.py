"""ONNX export of shared-factor PFP: the rules of :mod:`pyro2pfp.correlation.rules` as standard ONNX
operators, emitted after each layer's mean-field export (``onnx_export.SCHEME_STEPS``).

Float32, dynamic batch; the factor plan without compaction (ONNX has no Cholesky/QR operator; exact:
only ``g·gᵀ`` is used downstream, ``K`` grows with depth instead -- the compiled path compacts, see
``tvm_backend/ops/correlation.py``).  Every tensor op is Einsum, MatMul, Pad, Slice (strided kernel
taps), ReduceSum (axes as an input: opset ≥ 13), Reshape, Where and elementwise arithmetic; the
per-input weights of the conv profile are Einsums over the kernel taps (``Σ_k tap_k(s)·W_k·β``), not
a grouped Conv (whose group count cannot follow a dynamic batch).  Any other elementwise activation
gets Stein's rule with the exact slope of its own mean formula (forward-mode AD on the exporter's
ops, :mod:`pyro2pfp.correlation.stein`).  The raw-moment plan raises an ``ArgumentError``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import moments
from ..graph import Repr
from ..onnx_export import LOWEST32, SCHEME_STEPS, OnnxActivation, OnnxContext, Sym
from ..plan import PlannedGraph, PlannedLayer
from ..reference.arrays import average_divisor
from ..registry import OPS
from .backend import FixedKStep
from .factors import ComputeFactors
from .stein import stein_slope

_TINY = 1e-30


@dataclass
class OnnxShared:
    """The shared part of one edge: ``s`` (B, *edge shape), ``g`` (B, rows, k)."""

    s: Sym
    g: Sym
    k: int


class OnnxSharedStep(FixedKStep):
    """Emits the shared-factor rules of one plan after each layer's mean-field export."""

    what = "ONNX export"

    def __init__(self, graph: PlannedGraph, ctx: OnnxContext) -> None:
        super().__init__(graph)
        self.ctx = ctx
        self.b = ctx.b

    # ------------------------------------------------------------------ small helpers
    @staticmethod
    def var(a: OnnxActivation) -> Sym:
        """The variance of a random edge (the variance plan: ``second`` is the variance)."""
        assert a.second is not None and a.repr is Repr.VARIANCE, a.repr
        return a.second

    def c(self, value: float) -> Sym:
        return Sym(self.b, value=float(value))

    def t(self, array: np.ndarray, hint: str) -> Sym:
        return self.ctx.tensor(np.asarray(array, dtype=np.float64), hint)

    def einsum(self, eq: str, *xs: Sym) -> Sym:
        return xs[0].nary("Einsum", *xs[1:], equation=eq)

    def rsum(self, x: Sym, axes: list[int]) -> Sym:
        """Sum over ``axes``, kept as size-1 axes."""
        return x.nary("ReduceSum", self.b.ints(axes, "axes"), keepdims=1)

    def where(self, cond: Sym, a: Any, b: Any) -> Sym:
        return cond.nary("Where", a, b)

    def safe_div(self, num: Sym, den: Sym) -> Sym:
        return self.where(den > 0.0, num / den.nary("Max", self.c(_TINY)), 0.0)

    def clip(self, s: Sym, var: Sym) -> Sym:
        sd = var.nary("Max", self.c(0.0)).unary("Sqrt")
        return s.nary("Max", -sd).nary("Min", sd)

    def view_as(self, x: Sym, *shape: int) -> Sym:
        return self.ctx.reshape(x, shape)

    def grouped(self, x: Sym, name: str) -> Sym:
        rows = self.fp.rows[name]
        return self.view_as(x, rows, int(np.prod(self.ctx.shapes[name])) // rows)

    def widened(self, g: Sym, k_in: int, k: int) -> Sym:
        if k_in == k:
            return g
        return g.nary("Pad", self.b.ints([0, 0, 0, 0, 0, k - k_in], "pads"))

    def onehot(self, rows: int, k: int, offset: int) -> Sym:
        e = np.zeros((rows, k))
        e[np.arange(rows), offset + np.arange(rows)] = 1.0
        return self.t(e, "own_factors")

    def normalise(self, loading: Sym) -> tuple[Sym, Sym]:
        """``(g, ‖ℓ‖)`` with ``‖ℓ‖`` kept as (B, R, 1)."""
        norm = self.rsum(loading * loading, [2]).unary("Sqrt")
        return self.safe_div(loading, norm), norm

    def taps(self, x: Sym, shape: tuple[int, ...], kernel: tuple[int, int], stride: list[int], pad: list[int],
             dilation: list[int], out_hw: tuple[int, ...], fill: float = 0.0) -> list[Sym]:
        """The strided (B, C, OH, OW) view of ``x`` (B, C, H, W) for each kernel offset (row-major),
        zero (``fill``) outside (padding, overhang)."""
        h, w = shape[1:]
        end = [max(0, (o - 1) * s + (k - 1) * d + 1 - n - p)
               for o, s, k, d, n, p in zip(out_hw, stride, kernel, dilation, (h, w), pad)]
        if any(pad) or any(end):
            x = x.nary("Pad", self.b.ints([0, 0, pad[0], pad[1], 0, 0, end[0], end[1]], "pads"), self.c(fill))
        out = []
        for i in range(kernel[0]):
            for j in range(kernel[1]):
                r0, c0 = i * dilation[0], j * dilation[1]
                ends = [r0 + stride[0] * (out_hw[0] - 1) + 1, c0 + stride[1] * (out_hw[1] - 1) + 1]
                out.append(x.nary("Slice", self.b.ints([r0, c0], "starts"), self.b.ints(ends, "ends"),
                                  self.b.ints([2, 3], "axes"), self.b.ints(list(stride), "steps")))
        return out

    # ------------------------------------------------------------------ rules
    def view(self, ctx: OnnxContext, layer: PlannedLayer, sh: OnnxShared) -> OnnxShared:
        return OnnxShared(self.view_as(sh.s, *ctx.shapes[layer.name]), sh.g, sh.k)

    def linear(self, ctx: OnnxContext, layer: PlannedLayer, sh: OnnxShared, out: OnnxActivation) -> OnnxShared:
        factor = layer.tensors["scale"] if layer.op == "affine" else np.array([layer.layer.attrs["factor"]])
        s = self.grouped(sh.s, layer.name) * self.t(factor.reshape(-1, 1), "scale")
        s = self.clip(s, self.grouped(self.var(out), layer.name))
        return OnnxShared(self.view_as(s, *ctx.shapes[layer.name]), sh.g, sh.k)

    def relu(self, ctx: OnnxContext, layer: PlannedLayer, x: OnnxActivation, sh: OnnxShared, out: OnnxActivation
             ) -> OnnxShared:
        slope = float(layer.layer.attrs["slope"]) if layer.op == "leaky_relu" else 0.0
        name, src = layer.name, layer.inputs[0]
        offset, k = self.fp.offsets.get(name), self.fp.width[name]
        assert x.second is not None
        m, v, s = (self.grouped(t, src) for t in (x.mean, x.second, sh.s))
        sd = v.nary("Max", self.c(0.0)).unary("Sqrt")
        alpha = self.safe_div(m, sd).nary("Max", self.c(-40.0)).nary("Min", self.c(40.0))
        cdf = self.where(sd > 0.0, self.ctx.ops.normal_cdfs(alpha)[0], self.where(m > 0.0, 1.0, 0.0))
        lin = (cdf + self.c(slope) * (self.c(1.0) - cdf)) * s
        var_out = self.grouped(self.var(out), name)
        if offset is None:
            return OnnxShared(self.view_as(self.clip(lin, var_out), *self.ctx.shapes[name]), sh.g, sh.k)
        pdf = (self.c(-0.5) * alpha * alpha).unary("Exp") * self.c(1 / math.sqrt(2 * math.pi))
        h = self.safe_div(self.c(1.0 - slope) * pdf, sd) * s * s * self.c(1 / math.sqrt(2))
        group = int(np.prod(self.ctx.shapes[src])) // self.fp.rows[src]
        lbar, hbar = (self.rsum(t, [2]) * self.c(1.0 / group) for t in (lin, h))
        loading = lbar * self.widened(sh.g, sh.k, k) + hbar * self.onehot(self.fp.rows[name], k, offset)
        g, norm = self.normalise(loading)
        s_out = self.safe_div(lbar * lin + hbar * h, norm)
        return OnnxShared(self.view_as(self.clip(s_out, var_out), *self.ctx.shapes[name]), g, k)

    def activation(self, ctx: OnnxContext, layer: PlannedLayer, x: OnnxActivation, sh: OnnxShared,
                   out: OnnxActivation) -> OnnxShared:
        """The generic activation rule: ``clip(E[f'(a)]·s)``, the slope the exact ``μ``-derivative of the
        rule's mean on the exporter's ops (:func:`~pyro2pfp.correlation.stein.stein_slope`); the nodes
        of the rule's variance, which the slope does not need, are dropped (:meth:`_prune`)."""
        assert x.second is not None and x.repr is Repr.VARIANCE, x.repr
        start = len(self.ctx.b.nodes)
        slope = stein_slope(OPS[layer.op].activation, x.mean, x.second, layer.layer.attrs, self.ctx.ops)
        s = self.clip(slope * sh.s, self.var(out))
        self._prune(start, s.name)
        return OnnxShared(s, sh.g, sh.k)

    def _prune(self, start: int, output: str) -> None:
        """Drop the nodes added since ``start`` that ``output`` does not depend on."""
        nodes = self.ctx.b.nodes
        needed, kept = {output}, []
        for node in reversed(nodes[start:]):
            if any(o in needed for o in node.output):
                needed.update(node.input)
                kept.append(node)
        nodes[start:] = kept[::-1]

    def add(self, ctx: OnnxContext, layer: PlannedLayer, sa: OnnxShared, sb: OnnxShared, out: OnnxActivation
            ) -> tuple[OnnxShared, OnnxActivation]:
        name = layer.name
        k = self.fp.width[name]
        a_s, b_s, var = (self.grouped(t, name) for t in (sa.s, sb.s, self.var(out)))
        ga, gb = self.widened(sa.g, sa.k, k), self.widened(sb.g, sb.k, k)
        group = int(np.prod(self.ctx.shapes[name])) // self.fp.rows[name]
        abar, bbar = (self.rsum(t, [2]) * self.c(1.0 / group) for t in (a_s, b_s))
        g, _ = self.normalise(abar * ga + bbar * gb)
        dot, pa, pb = (self.rsum(p * q, [2]) for p, q in ((ga, gb), (ga, g), (gb, g)))
        var_new = (var + self.c(2.0) * a_s * b_s * dot).nary("Max", self.c(0.0))
        s = self.clip(a_s * pa + b_s * pb, var_new)
        shape = self.ctx.shapes[name]
        out = OnnxActivation(out.mean, self.view_as(var_new, *shape), out.repr)
        return OnnxShared(self.view_as(s, *shape), g, k), out

    def avg_pool(self, ctx: OnnxContext, layer: PlannedLayer, x: OnnxActivation, sh: OnnxShared, out: OnnxActivation
                 ) -> tuple[OnnxShared, OnnxActivation]:
        a = dict(layer.layer.attrs)
        a.setdefault("divisor", None)
        a.setdefault("count_include_pad", False)
        in_shape, out_hw = self.ctx.shapes[layer.inputs[0]], layer.layer.out_shape[1:]
        div = average_divisor(a, in_shape[1:], out_hw)
        assert x.second is not None
        indep = (x.second - sh.s * sh.s).nary("Max", self.c(0.0))
        args = (in_shape, tuple(a["kernel"]), a["stride"], a["padding"], [1, 1], out_hw)
        s = self._sum(self.taps(sh.s, *args)) * self.t(1.0 / div, "inv_divisor")
        rest = self._sum(self.taps(indep, *args)) * self.t(1.0 / div**2, "inv_divisor2")
        return OnnxShared(s, sh.g, sh.k), OnnxActivation(out.mean, rest + s * s, out.repr)

    @staticmethod
    def _sum(terms: list[Sym]) -> Sym:
        return terms[0] if len(terms) == 1 else terms[0].nary("Sum", *terms[1:])

    def max_pool(self, ctx: OnnxContext, layer: PlannedLayer, x: OnnxActivation, sh: OnnxShared,
                 out: OnnxActivation) -> OnnxShared:
        a = layer.layer.attrs
        in_shape, out_hw = self.ctx.shapes[layer.inputs[0]], layer.layer.out_shape[1:]
        args = (in_shape, tuple(a["kernel"]), a["stride"], a["padding"], [1, 1], out_hw)
        assert x.second is not None
        ms, vs, ss = self.taps(x.mean, *args, fill=LOWEST32), self.taps(x.second, *args), self.taps(sh.s, *args)
        mean, var, s = ms[0], vs[0], ss[0]
        ops = self.ctx.ops
        for m2, v2, s2 in zip(ms[1:], vs[1:], ss[1:]):
            theta = (var + v2).unary("Sqrt")
            alpha = self.safe_div(mean - m2, theta).nary("Max", self.c(-40.0)).nary("Min", self.c(40.0))
            cdf = self.where(theta > 0.0, ops.normal_cdfs(alpha)[0],
                             self.where(mean.nary("GreaterOrEqual", m2), 1.0, 0.0))
            s = cdf * s + (self.c(1.0) - cdf) * s2
            mean, var = moments.max_moments(mean, var, m2, v2, ops)
        return OnnxShared(self.clip(s, self.var(out)), sh.g, sh.k)

    def conv2d(self, ctx: OnnxContext, layer: PlannedLayer, x: OnnxActivation, sh: OnnxShared | None,
               out: OnnxActivation) -> OnnxShared | None:
        cf = ComputeFactors.of(layer, self.fp)
        offset, k, wm, wv = cf.offset, cf.k, cf.weight_mean, cf.weight_var
        t, a = layer.tensors, layer.layer.attrs
        o, c, kh, kw = wm.shape
        in_shape, out_hw = self.ctx.shapes[layer.inputs[0]], layer.layer.out_shape[1:]
        args = (in_shape, (kh, kw), a["stride"], a["padding"], a["dilation"], out_hw)
        positions = 1.0 / (out_hw[0] * out_hw[1])
        mu_taps = self.taps(x.mean, *args)
        mbar = [self.view_as(self.rsum(tp, [2, 3]), c) * self.c(positions) for tp in mu_taps]  # (B, C) each
        s_taps = self.taps(sh.s, *args) if sh is not None else []
        sbar = [self.view_as(self.rsum(tp, [2, 3]), c) * self.c(positions) for tp in s_taps]
        w_k = [self.t(wm[:, :, i, j], "w") for i in range(kh) for j in range(kw)] if sh is not None else []
        v_k = [wv[:, :, i, j] for i in range(kh) for j in range(kw)]
        loading: Sym | None = None
        wbar: Sym | None = None
        if offset is not None:
            second = [m * m + (sbar[n] * sbar[n] if sbar else self.c(0.0)) for n, m in enumerate(mbar)]
            wsum = self._sum([sq.nary("MatMul", self.t(v.T, "v_t")) for sq, v in zip(second, v_k)])
            bias_var = t["bias_var"] if "bias_var" in t else np.zeros(o)
            wbar = (wsum + self.t(bias_var, "bias_var")).nary("Max", self.c(0.0)).unary("Sqrt")  # (B, O)
            loading = self.einsum("bo,of->bof", wbar, self.onehot(o, k, offset))
        if sh is not None:
            amap = self._sum([self.einsum("bc,oc->boc", sb, w) for sb, w in zip(sbar, w_k)])
            prop = self.einsum("boc,bcf->bof", amap, self.widened(sh.g, sh.k, k))
            loading = prop if loading is None else loading + prop
        assert loading is not None
        g, _ = self.normalise(loading)
        terms: list[Sym] = []
        if sh is not None:
            g_in_cols = g.nary("Slice", self.b.ints([0], "starts"), self.b.ints([sh.k], "ends"),
                               self.b.ints([2], "axes"))
            beta = self.einsum("bcf,bof->boc", sh.g, g_in_cols)
            terms += [self.einsum("bchw,boc->bohw", tp, beta * w) for tp, w in zip(s_taps, w_k)]
        if offset is not None and wbar is not None:
            coef = self.safe_div(self.einsum("bof,of->bo", g, self.onehot(o, k, offset)), wbar)
            reg = [self.einsum("bchw,bc,oc->bohw", tp, mb, self.t(v, "v")) for tp, mb, v in zip(mu_taps, mbar, v_k)]
            reg += [self.einsum("bchw,bc,oc->bohw", tp, sb, self.t(v, "v")) for tp, sb, v in zip(s_taps, sbar, v_k)]
            if "bias_var" in t:
                reg.append(self.view_as(self.t(t["bias_var"], "bias_var"), o, 1, 1))
            terms.append(self.view_as(coef, o, 1, 1) * self._sum(reg))
        return OnnxShared(self.clip(self._sum(terms), self.var(out)), g, k)

    def dense(self, ctx: OnnxContext, layer: PlannedLayer, x: OnnxActivation, sh: OnnxShared | None, out: OnnxActivation
              ) -> tuple[OnnxShared | None, OnnxActivation]:
        cf = ComputeFactors.of(layer, self.fp)
        offset, k, wm, wv = cf.offset, cf.k, cf.weight_mean, cf.weight_var
        t = layer.tensors
        o, n = wm.shape
        loading: Sym | None = None
        var = self.var(out)
        assert var is not None
        if sh is not None:
            rows = self.fp.rows[layer.inputs[0]]
            s = self.view_as(sh.s, n)
            coef = self.einsum("brg,org->bor", self.view_as(s, rows, n // rows), self.t(wm.reshape(o, rows, -1), "w"))
            loading = self.einsum("bor,brf->bof", coef, self.widened(sh.g, sh.k, k))
            ws2 = (s * s).nary("MatMul", self.t((wm**2).T, "w2_t"))
            pn = self.view_as(self.rsum(loading * loading, [2]), o)
            var = (var + pn - ws2).nary("Max", self.c(0.0))
        if offset is not None:
            mu = self.view_as(x.mean, n)
            ex2 = mu * mu if x.second is None else mu * mu + self.view_as(x.second, n)
            inj = ex2.nary("MatMul", self.t(wv.T, "v_t"))
            if "bias_var" in t:
                inj = inj + self.t(t["bias_var"], "bias_var")
            own = self.einsum("bo,of->bof", inj.nary("Max", self.c(0.0)).unary("Sqrt"), self.onehot(o, k, offset))
            loading = own if loading is None else loading + own
        assert loading is not None
        g, norm = self.normalise(loading)
        s_out = self.clip(self.view_as(norm, o), var)
        return OnnxShared(s_out, g, k), OnnxActivation(out.mean, var, out.repr)


SCHEME_STEPS["shared-factor"] = OnnxSharedStep
