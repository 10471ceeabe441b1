"""Compute layers (Gaussian weights): ``dense`` (``nn.Linear``) and ``conv2d`` (``nn.Conv2d``, ``nn.Conv1d``).

Moments (``docs/math.md`` "Compute layers"; the paper's eqs. 7, 12, 13), with independent Gaussian weights and inputs:

* deterministic input ``x``:      ``μ = Σ μw·x + μb``,   ``v = Σ vw·x² + vb``;
* variance input ``(μx, vx)``:    ``μ = Σ μw·μx + μb``,  ``v = Σ vw·(μx² + vx) + μw²·vx + vb``;
* raw-moment input ``(μx, sx)``:  ``μ = Σ μw·μx + μb``,  ``v = Σ sw·sx − (μw·μx)² + vb`` (clamped ≥ 0),

each sum being the layer's linear map (a matmul or a convolution) applied to the products.  The
stored weights (``weight_var`` or ``weight_second_moment = μw² + vw``, calibrated) come from the
planner.  ``conv1d`` becomes ``reshape (C, 1, L)`` → ``conv2d`` with a 1×k kernel → ``reshape
(O, L')`` (:mod:`pyro2pfp.planning.onedim`).  Padding is symmetric in every back end: ``padding="same"``/``"valid"``
become explicit padding as torch pads them, a zero ``F.pad`` before the conv is added to it, and an
asymmetric padding (``"same"`` with an even kernel) becomes the larger side on both sides plus zero
taps in the kernel on the other side (:func:`_symmetric_padding`; exact).

Shared-factor PFP (:mod:`pyro2pfp.correlation`): the rules of both ops, each one formula for the float64
reference and the ONNX export, are at the end of this file; their TE kernels are in
``backends/tvm/ops/compute_shared.py``.

The TVM kernels and schedules are in ``backends/tvm/ops/compute.py``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..correlation.factors import ComputeFactors, FactorPlan, weight_var
from ..correlation.guide import conv_injection, conv_profile_terms, conv_variance, dense_terms, guide_tensors
from ..correlation.shared import Shared
from ..correlation.shared_algebra import (
    SharedAlgebra,
    clip,
    conv_taps,
    mix,
    normalised,
    own_columns,
    own_loading,
    safe_div,
    total,
)
from ..planning.converters import Alias, register
from ..planning.correlated_pools import WindowCovariances
from ..planning.graph import GaussianParam, Layer, Repr
from ..planning.onedim import as_2d
from ..planning.plan import PlannedLayer
from ..planning.registry import (
    COMPUTE_INPUT,
    CompactSpec,
    Contract,
    FactorSpec,
    OpDef,
    register_op,
)
from ._formula import formula, shared_formula
from .compute_compact import conv2d_compact_macs, dense_compact_macs
from .compute_cost import conv2d_cost, dense_cost

_COMPUTE = Contract(takes=COMPUTE_INPUT, natural=Repr.VARIANCE, keeps_deterministic=False)

DENSE = register_op(OpDef(
    "dense", ("aten.linear.default", "aten.matmul.default", "aten.mm.default"),
    modules="`Linear`, `F.linear`, `x @ W` / `torch.matmul(x, W)` (+ `b`) with `W`, `b` parameters or sample sites",
    modules_short=("Linear", "x @ W"),
    moments="mean, variance exact for independent inputs/weights",
    assumptions="mean-field weights, independent inputs", contract=_COMPUTE, compute_layer=True, sums_elements=True,
    factor_spec=FactorSpec(guide_factors=True, cost=dense_cost),
    compact_spec=CompactSpec(mean_field_products=(2, 3), macs=dense_compact_macs)))



def _grouped(layer: PlannedLayer) -> str | None:
    """Why shared-factor PFP cannot run a conv2d layer: a grouped convolution (None: it can)."""
    groups = layer.layer.attrs.get("groups", 1)
    return f"grouped convolutions (groups={groups})" if groups != 1 else None


def _conv_window_covariances(covs: WindowCovariances, layer: Layer) -> str | None:
    """A conv's in-window covariances (``groups = 1``, no dilation: ``window_cov`` of its input and
    weights), else its edge's shared factors' part."""
    a = layer.attrs
    if int(a.get("groups", 1)) == 1 and list(a.get("dilation", [1, 1])) == [1, 1]:
        return covs.from_conv(layer, covs.what(layer.name))
    return covs.closure([layer.name], covs.what(layer.name))


CONV2D = register_op(OpDef(
    "conv2d", ("aten.conv2d.default", "aten.conv2d.padding", "aten.conv1d.default", "aten.conv1d.padding",
               "aten.pad.default", "aten.constant_pad_nd.default"),
    modules="`Conv2d`, `Conv1d` (stride, padding incl. `\"same\"`, dilation, groups; a zero `F.pad`/`ZeroPad` "
            "before it is folded into its padding)",
    modules_short=("Conv1d", "Conv2d"), moments="as dense",
    assumptions="as dense (shared weights make outputs correlated: ignored downstream)", contract=_COMPUTE,
    compute_layer=True, positions_share_weights=True, window_covariances=_conv_window_covariances,
    factor_spec=FactorSpec(refuse=_grouped, guide_factors=True, rescales_weight_noise=True, cost=conv2d_cost),
    compact_spec=CompactSpec(mean_field_products=(2, 3), macs=conv2d_compact_macs)))


# ------------------------------------------------------------------------------------ reference + ONNX
@formula("dense", "conv2d")
def compute_layer(bk: Any, layer: PlannedLayer, inputs: list[Any]) -> Any:
    """(mean, variance) of a dense/conv2d layer from its input in any representation (see the module
    docstring), both sums by the layer's own linear map."""
    x, t = inputs[0], layer.tensors
    if layer.op == "dense":
        def apply(v: Any, w: Any, hint: str) -> Any:
            return bk.dense(v, w, hint)
    else:
        def apply(v: Any, w: Any, hint: str) -> Any:
            return bk.conv2d(v, w, layer.layer.attrs, hint)
    mean = apply(x.mean, t["weight_mean"], "weight_mean")
    if x.repr is Repr.DETERMINISTIC:
        var = apply(x.mean * x.mean, t["weight_var"], "weight_var")
    elif x.repr is Repr.VARIANCE:
        var = (apply(bk.second_moment(x), t["weight_var"], "weight_var")
               + apply(bk.variance(x), t["weight_mean"] ** 2, "weight_mean_sq"))
    else:
        var = (apply(bk.second_moment(x), t["weight_second_moment"], "weight_second_moment")
               - apply(x.mean * x.mean, t["weight_mean"] ** 2, "weight_mean_sq"))
    bias_shape = (-1,) + (1,) * (len(layer.layer.out_shape) - 1)
    if "bias_mean" in t:
        mean = mean + bk.tensor(t["bias_mean"].reshape(bias_shape), "bias_mean")
    if "bias_var" in t:
        var = var + bk.tensor(t["bias_var"].reshape(bias_shape), "bias_var")
    return bk.emit(mean, bk.ops.maximum(var, bk.ops.const(0.0)), layer)


# ------------------------------------------------------------------------------------ converters
@register("aten.linear.default", produces=("dense",))
def convert_linear(node, ctx) -> Layer:
    x, weight, bias = (list(node.args) + [None])[:3]
    in_shape = ctx.shape(x)
    if len(in_shape) != 1:
        raise ctx.unsupported(
            node, f"Linear applied to a (batch, {', '.join(map(str, in_shape))}) tensor; PFP dense layers "
            "take (batch, features). Flatten the input first."
        )
    params = {"weight": ctx.param(weight, node, "weight")}
    if bias is not None:
        params["bias"] = ctx.param(bias, node, "bias")
    return Layer(name=ctx.new_name(node, prefer_module=True), op="dense",
                 inputs=[ctx.activation(x, node)], out_shape=ctx.shape(node),
                 source=ctx.source(node), params=params)


def _pair(value, n: int = 2) -> list[int]:
    value = list(value) if isinstance(value, list | tuple) else [value]
    return [int(v) for v in (value * n if len(value) == 1 else value)]


def _string_padding(padding: str, kernel: list[int], dilation: list[int]) -> list[tuple[int, int]]:
    """``(begin, end)`` padding of each spatial dim as torch pads ``"valid"``/``"same"``: a total of
    ``d·(k − 1)``, ``total // 2`` before and the rest after (asymmetric for an odd total)."""
    if padding == "valid":
        return [(0, 0)] * len(kernel)
    totals = [d * (k - 1) for k, d in zip(kernel, dilation)]
    return [(t // 2, t - t // 2) for t in totals]


_PAD_OPS = ("aten.pad.default", "aten.constant_pad_nd.default")


def _explicit_padding(x, spatial: int) -> tuple[object, list[tuple[int, int]]]:
    """The conv input before an ``F.pad``/``nn.ZeroPad``/``nn.ConstantPad`` that only feeds convs
    (checked by :func:`convert_pad`), and the ``(begin, end)`` zeros it adds to each spatial dim."""
    if str(getattr(x, "target", "")) not in _PAD_OPS:
        return x, [(0, 0)] * spatial
    pads = [int(p) for p in x.args[1]] + [0] * (2 * spatial)
    per_dim = [(pads[2 * i], pads[2 * i + 1]) for i in range(spatial)]  # torch lists the last dim first
    return x.args[0], per_dim[::-1]


def _spread(a, axis: int, d: int):
    """A kernel of dilation ``d`` written as a dense one (zeros between the taps) along ``axis``."""
    shape = list(a.shape)
    shape[axis] = d * (shape[axis] - 1) + 1
    out = np.zeros(shape)
    index = [slice(None)] * a.ndim
    index[axis] = slice(None, None, d)
    out[tuple(index)] = a
    return out


def _symmetric_padding(w: GaussianParam, pads: list[tuple[int, int]], dilation: list[int]
                       ) -> tuple[GaussianParam, list[int], list[int]]:
    """A conv with ``(begin, end)`` padding per spatial dim (weight axes 2, 3) as one with symmetric
    padding: where ``begin ≠ end``, pad ``max(begin, end)`` on both sides and add ``|end − begin| / d``
    zero taps (mean 0, variance 0) to the kernel on the side with less padding.  Every output reads
    the same inputs with the same weights as before, and the zero taps add nothing to the mean or the
    variance, so the result is exact in every back end.  A dilation that does not divide the
    difference is first written as a dense kernel (dilation 1).  Returns ``(weight, padding, dilation)``."""
    padding, dilations = [], []
    for axis, (begin, end), d in zip((2, 3), pads, dilation):
        if begin != end:
            if abs(end - begin) % d:
                w, d = w.mapped(lambda a, axis=axis, d=d: _spread(a, axis, d)), 1
            shape = list(w.mean.shape)
            shape[axis] = abs(end - begin) // d

            def embed(a: np.ndarray, axis: int = axis, shape: list[int] = shape, before: bool = end > begin
                      ) -> np.ndarray:
                zeros = np.zeros(shape)
                return np.concatenate([zeros, a], axis) if before else np.concatenate([a, zeros], axis)

            w = w.mapped(embed)
        padding.append(max(begin, end))
        dilations.append(d)
    return w, padding, dilations


def _conv_layer(node, ctx, x, weight, bias, stride, padding, dilation, groups, spatial: int):
    """``(input node, params, attrs)`` of the ``conv2d`` layer of a conv with ``spatial`` = 1 (a 1×k
    kernel) or 2 spatial dims: explicit, string and folded ``F.pad`` paddings become symmetric ones."""
    x, pre = _explicit_padding(x, spatial)
    w = ctx.param(weight, node, "weight")
    if spatial == 1:
        shape = (w.shape[0], w.shape[1], 1, w.shape[2])
        w = w.mapped(lambda a: a.reshape(shape))
    dil = _pair(dilation if dilation is not None else 1, spatial)
    if isinstance(padding, str):
        own = _string_padding(padding, list(w.shape[4 - spatial:]), dil)
    else:
        own = [(p, p) for p in _pair(padding if padding is not None else 0, spatial)]
    pads = [(a + c, b + e) for (a, b), (c, e) in zip(own, pre)]
    step = _pair(stride if stride is not None else 1, spatial)
    if spatial == 1:
        pads, dil, step = [(0, 0), *pads], [1, *dil], [1, *step]
    w, symmetric, dil = _symmetric_padding(w, pads, dil)
    params = {"weight": w}
    if bias is not None:
        params["bias"] = ctx.param(bias, node, "bias")
    attrs = {"stride": step, "padding": symmetric, "dilation": dil,
             "groups": int(groups) if groups is not None else 1}
    return x, params, attrs


@register("aten.conv2d.default", "aten.conv2d.padding", produces=("conv2d",))
def convert_conv2d(node, ctx) -> Layer:
    args = list(node.args) + [None] * 7
    x, weight, bias, stride, padding, dilation, groups = args[:7]
    if len(ctx.shape(x)) != 3:
        raise ctx.unsupported(node, f"conv2d expects (batch, C, H, W) input, got (batch, {ctx.shape(x)})")
    x, params, attrs = _conv_layer(node, ctx, x, weight, bias, stride, padding, dilation, groups, spatial=2)
    return Layer(name=ctx.new_name(node, prefer_module=True), op="conv2d",
                 inputs=[ctx.activation(x, node)], out_shape=ctx.shape(node),
                 source=ctx.source(node), attrs=attrs, params=params)


@register("aten.conv1d.default", "aten.conv1d.padding", produces=("conv2d", "reshape"))
def convert_conv1d(node, ctx) -> list[Layer]:
    """``conv1d`` on ``(batch, C, L)``: ``conv2d`` with a 1×k kernel on ``(batch, C, 1, L)``, between
    two reshapes (:mod:`pyro2pfp.planning.onedim` removes the reshapes between consecutive 1-D layers)."""
    args = list(node.args) + [None] * 7
    x, weight, bias, stride, padding, dilation, groups = args[:7]
    if len(ctx.shape(x)) != 2:
        raise ctx.unsupported(node, f"conv1d expects (batch, C, L) input, got (batch, {ctx.shape(x)})")
    x, params, attrs = _conv_layer(node, ctx, x, weight, bias, stride, padding, dilation, groups, spatial=1)
    return as_2d(node, ctx, x, "conv2d", attrs, params, prefer_module=True)


@register(*_PAD_OPS, produces=())
def convert_pad(node, ctx) -> Alias:
    """``F.pad``/``nn.ZeroPad1d/2d``/``nn.ConstantPad`` with zeros right before convs: folded into their
    padding (:func:`_explicit_padding`), so the node itself is the identity."""
    mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
    value = node.args[3] if len(node.args) > 3 else node.kwargs.get("value", 0.0)
    if str(node.target) == "aten.constant_pad_nd.default":
        mode, value = "constant", (node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0.0))
    pads = [int(p) for p in node.args[1]]
    convs = ("aten.conv1d.default", "aten.conv1d.padding", "aten.conv2d.default", "aten.conv2d.padding")
    users = list(node.users)
    spatial = len(ctx.shape(node.args[0])) - 1
    if (mode != "constant" or (value or 0.0) != 0.0 or any(p < 0 for p in pads) or len(pads) > 2 * spatial
            or not users or any(str(u.target) not in convs or u.args[0] is not node for u in users)):
        raise ctx.unsupported(node, f"padding {pads} (mode {mode!r}, value {value}) is supported only as zeros "
                                    "added to the spatial dims right before a Conv1d/Conv2d, which PFP folds into "
                                    "the conv's padding. Pad with zeros before the conv, give the padding to the "
                                    "conv itself (padding=...), or pad the input before calling the model")
    return Alias(node.args[0])


@register("aten.matmul.default", "aten.mm.default", produces=("dense",))
def convert_matmul(node, ctx) -> Layer:
    """``x @ W`` / ``torch.matmul(x, W)`` with ``x`` (batch, in) and ``W`` (in, out) a parameter or
    sample site -> ``dense`` with weight ``Wᵀ`` (a following ``+ b`` becomes its bias, see
    ``ops/arithmetic.py``)."""
    x, weight = node.args[:2]
    in_shape = ctx.shape(x)
    if len(in_shape) != 1:
        raise ctx.unsupported(node, f"x @ W with x of shape (batch, {', '.join(map(str, in_shape))}); PFP dense "
                                    "layers take (batch, features): flatten first")
    if not ctx.is_parameter(weight):
        raise ctx.unsupported(node, "x @ W needs W to be a model parameter or sample site (the product of two "
                                    "activations is not a PFP layer)")
    w = ctx.param(weight, node, "weight")
    if w.mean.ndim != 2:
        raise ctx.unsupported(node, f"x @ W with W of shape {w.shape}; PFP needs a 2-D (in, out) weight")
    return Layer(name=ctx.new_name(node, prefer_module=True), op="dense", inputs=[ctx.activation(x, node)],
                 out_shape=ctx.shape(node), source=ctx.source(node),
                 params={"weight": w.mapped(lambda a: a.T.copy())})


# ------------------------------------------------------------------------------------ shared-factor rules
@shared_formula("conv2d")
def conv2d_shared(bk: SharedAlgebra, layer: PlannedLayer, inputs: list[Any], shared: list[Shared | None],
                  fp: FactorPlan, var: Any) -> tuple[Shared | None, Any]:
    """The conv2d rule (stride/padding/dilation, groups 1; notation: :mod:`pyro2pfp.correlation.shared`).

    Pooled loading ``ℓ[o] = Σ_c A[o, c]·g_in[c] ⊕ w̄[o]·e_o`` with ``A[o, c] = Σ_k W[o, c, k]·m̄
    s_in[c, p+k]`` (the input's shared parts through the mean weights, exact given the closure) and
    ``w̄² = Σ_{c,k} V[o, c, k]·((m̄ μ_in[c, p+k])² + (m̄ s_in[c, p+k])²) + v_bias`` (the variance of
    the spatial mean of the weight and bias noise: the weight-variance term evaluated on the pooled
    input, exact for a deterministic input; the input's pooled variance taken as its shared part).
    ``g = ℓ/‖ℓ‖``; profile ``s[o, p] = Σ_{c,k} W[o, c, k]·⟨g_in[c], g[o]⟩·s_in[c, p+k] + (g[o, e_o]/w̄)·
    (Σ_{c,k} V[o, c, k]·(m̄μ_k·μ_in[c, p+k] + m̄s_k·s_in[c, p+k]) + v_bias)`` — the exact covariance of
    ``out[o, p]`` with ``η'_o`` given the closure (``injection='regression'``).
    ``injection='rescaled'`` replaces the second sum by the mean-field weight-variance term's square
    root rescaled to the same spatial mean (one more convolution of ``E[x²]`` with ``V``, a coarser profile:
    it under-states the shared variance more; ``benchmarks/fidelity.py --variants`` compares both with
    sampling).  ``m̄ s = ‖ℓ‖`` by construction.  The variance is not corrected, except for a correlated guide's
    noise inside a receptive field (:func:`~pyro2pfp.correlation.guide.conv_variance`).  The kernel taps are strided
    views, the pooled views their sums, the profile one batched matrix product per tap; a correlated guide's
    terms: :mod:`pyro2pfp.correlation.guide`."""
    x, sh = inputs[0], shared[0]
    cf = ComputeFactors.of(layer, fp)
    offset, k, wm, wv = cf.offset, cf.k, cf.weight_mean, cf.weight_var
    t = layer.tensors
    o, c, kh, kw = wm.shape
    wf, bf = guide_tensors(t, o, fp)
    if sh is None and offset is None and wf is None and bf is None:
        return None, var
    ops = bk.ops
    oh, ow = layer.layer.out_shape[1:]
    mix_shape = (o, c, oh, ow)
    positions = ops.const(1.0 / (oh * ow))
    mu_taps = conv_taps(bk, x.mean, layer, (kh, kw))
    mbar = [bk.rsum(bk.reshape(tp, (c, oh * ow)), 2) * positions for tp in mu_taps]  # (B, C) each
    s_taps = conv_taps(bk, sh.s, layer, (kh, kw)) if sh is not None else []
    sbar = [bk.rsum(bk.reshape(tp, (c, oh * ow)), 2) * positions for tp in s_taps]
    if wf is not None or bf is not None:  # the guide's noise inside a receptive field, re-summed (guide.py)
        var = ops.maximum(var + conv_variance(bk, layer, x.mean, (mu_taps, s_taps), sh, wm, wf, bf),
                          ops.const(0.0))
    w_k = [wm[:, :, i, j] for i in range(kh) for j in range(kw)]
    v_k = [wv[:, :, i, j] for i in range(kh) for j in range(kw)]
    bias_var = t["bias_var"] if "bias_var" in t else np.zeros(o)
    terms: list[Any] = []  # of the loading, then of the profile
    wbar = None
    if offset is not None:
        second = [m * m + sbar[n] * sbar[n] if sbar else m * m for n, m in enumerate(mbar)]
        wsum = total([bk.dense(sq, v, "v") for sq, v in zip(second, v_k)])
        wbar = ops.sqrt(ops.maximum(wsum + bk.tensor(bias_var, "bias_var"), ops.const(0.0)))  # (B, O)
        terms.append(own_loading(bk, wbar, o, k, offset))
    if sh is not None:
        amap = total([bk.einsum("bc,oc->boc", sb, bk.tensor(w, "w")) for sb, w in zip(sbar, w_k)])
        terms.append(bk.matmul(amap, bk.widened(sh.g, sh.k, k)))
    if wf is not None or bf is not None:  # a correlated guide's factors through the input mean (guide.py)
        terms.append(conv_injection(bk, mbar, wf, bf, k))
    loading = total(terms)
    g, norm = normalised(bk, loading, o)
    if bk.all_zero(norm):
        return None, var
    terms = conv_profile_terms(bk, g, mu_taps, wf, bf, mix_shape) if wf is not None or bf is not None else []
    if sh is not None:
        beta = bk.einsum("bcf,bof->boc", sh.g, bk.slice(g, 2, 0, sh.k))  # ⟨g_in[c], g[o]⟩
        terms += [mix(bk, beta * bk.tensor(w, "w"), tp, mix_shape) for tp, w in zip(s_taps, w_k)]
    if wbar is not None and offset is not None:
        own = bk.einsum("bof,of->bo", g, own_columns(bk, o, k, offset))
        terms.append(_injection_profile(bk, layer, x, own, wbar, (mu_taps, mbar), (s_taps, sbar), fp.injection))
    return Shared(clip(bk, total(terms), var), g, k), var


def _injection_profile(bk: Any, layer: PlannedLayer, x: Any, own: Any, wbar: Any, mu: tuple[list[Any], list[Any]],
                       s: tuple[list[Any], list[Any]], injection: str) -> Any:
    """The profile of a conv's own weight and bias noise, ``Cov(noise[o, p], η_o)`` (B, O, OH, OW), from ``own =
    g[o, e_o]`` and ``w̄`` (B, O): ``'regression'`` -- ``(own/w̄)·(Σ_{c,k} V·(m̄μ_k·μ_{p+k} + m̄s_k·s_{p+k}) +
    v_bias)`` (``mu``, ``s``: the taps and pooled views of the input's mean and profile); ``'rescaled'`` --
    ``own·w̄/mean_p √r·√r`` with ``r = Σ V·E[x²] + v_bias`` (one convolution; 0 where the mean root is 0)."""
    ops, t = bk.ops, layer.tensors
    wv = weight_var(t)
    o, c, kh, kw = wv.shape
    oh, ow = layer.layer.out_shape[1:]
    if injection == "rescaled":
        noise = bk.conv2d(bk.second_moment(x), wv, layer.layer.attrs, "weight_var_noise")
        if "bias_var" in t:
            noise = noise + bk.tensor(t["bias_var"].reshape(o, 1, 1), "bias_var")
        root = ops.sqrt(ops.maximum(noise, ops.const(0.0)))
        root_mean = bk.rsum(bk.reshape(root, (o, oh * ow)), 2) * ops.const(1.0 / (oh * ow))  # (B, O)
        return bk.reshape(own * safe_div(bk, wbar, root_mean), (o, 1, 1)) * root
    views = [tp * bk.reshape(m, (c, 1, 1)) for tp, m in zip(*mu)]
    views = [v + tp * bk.reshape(m, (c, 1, 1)) for v, tp, m in zip(views, *s)] if s[0] else views
    reg = [mix(bk, bk.tensor(wv[:, :, i, j], "v"), views[i * kw + j], (o, c, oh, ow))
           for i in range(kh) for j in range(kw)]
    if "bias_var" in t:
        reg.append(bk.tensor(t["bias_var"].reshape(o, 1, 1), "bias_var"))
    return bk.reshape(safe_div(bk, own, wbar), (o, 1, 1)) * total(reg)


@shared_formula("dense")
def dense_shared(bk: SharedAlgebra, layer: PlannedLayer, inputs: list[Any], shared: list[Shared | None], fp: FactorPlan,
                 var: Any) -> tuple[Shared | None, Any]:
    """The dense rule: ``ℓ[o] = Σ_c (Σ_p W[o, (c, p)]·s[c, p])·g[c] ⊕ √(Σ V·E[x²] + v_bias)·e_o``,
    ``v_out = v_mf + ‖Σ_c (…)·g[c]‖² − Σ_i W[o, i]²·s_i²`` (the shared parts summed with their
    correlations instead of as independent); ``s = ‖ℓ‖``, ``g = ℓ/‖ℓ‖`` (each unit its own channel); a
    correlated guide's terms: :mod:`pyro2pfp.correlation.guide`.  Returns ``(shared part of the output,
    corrected output variance)``."""
    x, sh = inputs[0], shared[0]
    cf = ComputeFactors.of(layer, fp)
    offset, k, wm, wv = cf.offset, cf.k, cf.weight_mean, cf.weight_var
    t = layer.tensors
    o, n = wm.shape
    ops = bk.ops
    wf, bf = guide_tensors(t, o, fp)
    rows = fp.rows[layer.inputs[0]] if sh is not None else 1
    terms: list[Any] = []
    counted: list[Any] = []
    if sh is not None:
        s = bk.reshape(sh.s, (n,))
        coef = bk.einsum("brg,org->bor", bk.reshape(s, (rows, n // rows)), bk.tensor(wm.reshape(o, rows, -1), "w"))
        terms.append(bk.matmul(coef, bk.widened(sh.g, sh.k, k)))
        counted.append(bk.dense(s * s, wm**2, "w2"))
    if wf is not None or bf is not None:  # a correlated guide's factors through the input mean (guide.py)
        injected, guide_counted = dense_terms(bk, bk.reshape(x.mean, (n,)), sh, rows, wf, bf, k)
        terms.append(injected)
        counted.append(guide_counted)
    if terms:
        loading = total(terms)
        var = ops.maximum(var + bk.rsum(loading * loading, 2) - total(counted), ops.const(0.0))
    if offset is not None:
        inj = bk.dense(bk.reshape(bk.second_moment(x), (n,)), wv, "v")
        if "bias_var" in t:
            inj = inj + bk.tensor(t["bias_var"], "bias_var")
        terms.append(own_loading(bk, ops.sqrt(ops.maximum(inj, ops.const(0.0))), o, k, offset))
    if not terms:  # nothing shared in or created
        return None, var
    g, norm = normalised(bk, total(terms), o)
    if bk.all_zero(norm):
        return None, var
    return Shared(clip(bk, norm, var), g, k), var
