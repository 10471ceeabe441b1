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

Shared-factor PFP (:mod:`pyro2pfp.correlation`): the float64 and ONNX rules of both ops are at the
end of this file; their TE kernels are in ``backends/tvm/ops/compute_shared.py``.

The TVM kernels and schedules are in ``backends/tvm/ops/compute.py``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backends.onnx.builder import OnnxActivation, OnnxContext, Sym
from ..backends.reference import Activation
from ..backends.reference.arrays import conv2d_nchw, conv_views, tap_product
from ..correlation import guide_onnx
from ..correlation.factors import ComputeFactors, FactorPlan, weight_var
from ..correlation.guide import (
    conv_pooled_injection,
    dense_guide_variance,
    dense_injection,
    dense_product_variance,
    guide_tensors,
)
from ..correlation.onnx_step import OnnxShared, OnnxSharedStep
from ..correlation.shared import Shared, normalised, safe_div, spatial_mean
from ..planning.converters import Alias, register
from ..planning.graph import GaussianParam, Layer, Repr
from ..planning.onedim import as_2d
from ..planning.plan import PlannedLayer
from ..planning.registry import (
    COMPUTE_INPUT,
    Contract,
    FactorSpec,
    OpDef,
    register_op,
    shared_exporter,
    shared_reference,
)
from ._formula import formula

_COMPUTE = Contract(takes=COMPUTE_INPUT, natural=Repr.VARIANCE, keeps_deterministic=False)

DENSE = register_op(OpDef(
    "dense", ("aten.linear.default", "aten.matmul.default", "aten.mm.default"),
    modules="`Linear`, `F.linear`, `x @ W` / `torch.matmul(x, W)` (+ `b`) with `W`, `b` parameters or sample sites",
    modules_short=("Linear", "x @ W"),
    moments="mean, variance exact for independent inputs/weights",
    assumptions="mean-field weights, independent inputs", contract=_COMPUTE, compute_layer=True))



def _grouped(layer: Any) -> str | None:
    """Why shared-factor PFP cannot run a conv2d layer: a grouped convolution (None: it can)."""
    groups = layer.layer.attrs.get("groups", 1)
    return f"grouped convolutions (groups={groups})" if groups != 1 else None


CONV2D = register_op(OpDef(
    "conv2d", ("aten.conv2d.default", "aten.conv2d.padding", "aten.conv1d.default", "aten.conv1d.padding",
               "aten.pad.default", "aten.constant_pad_nd.default"),
    modules="`Conv2d`, `Conv1d` (stride, padding incl. `\"same\"`, dilation, groups; a zero `F.pad`/`ZeroPad` "
            "before it is folded into its padding)",
    modules_short=("Conv1d", "Conv2d"), moments="as dense",
    assumptions="as dense (shared weights make outputs correlated: ignored downstream)", contract=_COMPUTE,
    compute_layer=True, factor_spec=FactorSpec(refuse=_grouped)))


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
@shared_reference("conv2d")
def conv2d_shared(layer: PlannedLayer, inputs: list[Activation], shared: list[Shared | None], fp: FactorPlan,
                  var: np.ndarray) -> tuple[Shared | None, np.ndarray]:
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
    root rescaled to the same spatial mean (no extra convolution, a coarser profile: it under-states
    the shared variance more; ``benchmarks/fidelity.py --variants`` compares both with sampling).
    ``m̄ s = ‖ℓ‖`` by construction.  The variance is not corrected."""
    x, sh = inputs[0], shared[0]
    t, a = layer.tensors, layer.layer.attrs
    injection = fp.injection
    wm, wv = t["weight_mean"], weight_var(t)
    o, c, kh, kw = wm.shape
    k = fp.width[layer.name]
    offset = fp.offsets.get(layer.name)
    mu = x.mean
    b = mu.shape[0]
    wf, bf = guide_tensors(t, o, fp)
    if sh is None and offset is None and wf is None and bf is None:
        return None, var
    s_in = np.zeros_like(mu) if sh is None else sh.s.reshape(mu.shape)
    mbar = np.stack([spatial_mean(v) for v in conv_views(mu, layer, (kh, kw))], axis=2)  # (B, C, k)
    sbar = np.stack([spatial_mean(v) for v in conv_views(s_in, layer, (kh, kw))], axis=2)
    loading = np.zeros((b, o, k))
    if sh is not None:
        amap = np.einsum("ock,bck->boc", wm.reshape(o, c, -1), sbar)
        loading[..., :sh.g.shape[2]] += amap @ sh.g
    if offset is not None:
        pooled_w = np.einsum("ock,bck->bo", wv.reshape(o, c, -1), mbar**2 + sbar**2)
        if "bias_var" in t:
            pooled_w = pooled_w + t["bias_var"][None]
        wbar = np.sqrt(np.maximum(pooled_w, 0.0))
        loading[:, np.arange(o), offset + np.arange(o)] += wbar
    injected = conv_pooled_injection(mbar, wf, bf, k, o)
    if injected is not None:  # a correlated guide's factors through the input mean (correlation/guide.py)
        loading += injected
    norm, g = normalised(loading)
    if not norm.any():
        return None, var
    s_out = np.zeros((b, o, *layer.layer.out_shape[1:]))
    if sh is not None:
        beta = g[..., :sh.g.shape[2]] @ np.swapaxes(sh.g, 1, 2)  # (B, O, C): ⟨g_in[c], g[o]⟩
        for kk, view in enumerate(conv_views(s_in, layer, (kh, kw))):
            i, j = divmod(kk, kw)
            s_out += tap_product(wm[None, :, :, i, j] * beta, view)
    if wf is not None:  # Cov(out[o, p], η_o) of the guide's part: conv(μ, Σ_f g[o, f]·F_f[o])
        gw = np.einsum("octf,bof->boct", wf.reshape(o, c, kh * kw, -1), g[..., :wf.shape[-1]])
        for kk, view in enumerate(conv_views(mu, layer, (kh, kw))):
            s_out += np.einsum("bchw,boc->bohw", view, gw[..., kk])
    if bf is not None:
        s_out += np.einsum("of,bof->bo", bf, g[..., :bf.shape[-1]])[..., None, None]
    if offset is not None and injection == "rescaled":
        ex2 = x.second_moment() if x.repr is not Repr.DETERMINISTIC else mu**2
        prof = conv2d_nchw(ex2, wv, a["stride"], a["padding"], a["dilation"], 1)
        if "bias_var" in t:
            prof = prof + t["bias_var"].reshape(1, -1, 1, 1)
        root = np.sqrt(np.maximum(prof, 0.0))
        scale = g[:, np.arange(o), offset + np.arange(o)] * safe_div(wbar, spatial_mean(root))
        s_out += scale[..., None, None] * root
    if offset is not None and injection != "rescaled":
        # Cov(noise[o, p], pooled noise[o]) = Σ_{c,k} V·(m̄μ_k·μ_{p+k} + m̄s_k·s_{p+k}) + v_bias
        reg = np.zeros_like(s_out)
        for kk, (vm, vs) in enumerate(zip(conv_views(mu, layer, (kh, kw)), conv_views(s_in, layer, (kh, kw)))):
            i, j = divmod(kk, kw)
            reg += tap_product(wv[:, :, i, j], mbar[:, :, kk, None, None] * vm + sbar[:, :, kk, None, None] * vs)
        if "bias_var" in t:
            reg += t["bias_var"].reshape(1, -1, 1, 1)
        s_out += safe_div(g[:, np.arange(o), offset + np.arange(o)], wbar)[..., None, None] * reg
    return Shared(s_out, g), var


@shared_reference("dense")
def dense_shared(layer: PlannedLayer, inputs: list[Activation], shared: list[Shared | None], fp: FactorPlan,
                 var: np.ndarray) -> tuple[Shared | None, np.ndarray]:
    """The dense rule: ``ℓ[o] = Σ_c (Σ_p W[o, (c, p)]·s[c, p])·g[c] ⊕ √(Σ V·E[x²] + v_bias)·e_o``,
    ``v_out = v_mf + ‖Σ_c (…)·g[c]‖² − Σ_i W[o, i]²·s_i²`` (the shared parts summed with their
    correlations instead of as independent); ``s = ‖ℓ‖``, ``g = ℓ/‖ℓ‖`` (each unit its own channel).
    Returns ``(shared part of the output, corrected output variance)``."""
    x, sh = inputs[0], shared[0]
    t = layer.tensors
    wm, wv = t["weight_mean"], weight_var(t)
    b, o = x.mean.shape[0], wm.shape[0]
    k = fp.width[layer.name]
    offset = fp.offsets.get(layer.name)
    wf, bf = guide_tensors(t, o, fp)
    loading = np.zeros((b, o, k))
    coherent: np.ndarray | float = 0.0
    if sh is not None:
        s = sh.s.reshape(b, -1)
        rows = sh.g.shape[1]
        coef = np.einsum("ocp,bcp->boc", wm.reshape(o, rows, -1), s.reshape(b, rows, -1))
        loading += coef @ sh.widened(k)
        coherent = s**2 @ (wm**2).T
    injected = dense_injection(x.mean, wf, bf, k)
    if injected is not None:  # a correlated guide's factors through the input mean (correlation/guide.py)
        loading += injected
        coherent = coherent + dense_guide_variance(x.mean, None if sh is None else sh.s,
                                                   None if sh is None else sh.g, wf, bf, fp.guide)
        if sh is not None and wf is not None:  # the product of the weights' and the input's guide noise
            coherent = coherent - dense_product_variance(sh.s, sh.g, wf, wf.shape[-1])
    if sh is not None or injected is not None:
        var = np.maximum(var + (loading**2).sum(axis=2) - coherent, 0.0)
    if offset is not None:
        ex2 = x.second_moment() if x.repr is not Repr.DETERMINISTIC else x.mean**2
        inj = ex2.reshape(b, -1) @ wv.T + (t["bias_var"][None] if "bias_var" in t else 0.0)
        loading[:, np.arange(o), offset + np.arange(o)] += np.sqrt(np.maximum(inj, 0.0))
    norm, g = normalised(loading)
    if not norm.any():
        return None, var
    return Shared(norm, g), var


@shared_exporter("conv2d")
def conv2d_shared_onnx(step: OnnxSharedStep, ctx: OnnxContext, layer: PlannedLayer, inputs: list[OnnxActivation],
                       shared: list[OnnxShared | None], out: OnnxActivation
                       ) -> tuple[OnnxShared | None, OnnxActivation]:
    """:func:`conv2d_shared` in ONNX: the kernel taps as strided Slices, the pooled views as ReduceSums
    and the per-input weights of the profile as Einsums over the taps (``Σ_k tap_k(s)·W_k·β``), not a
    grouped Conv (whose group count cannot follow a dynamic batch).  ``injection='rescaled'``: the
    weight-noise term ``Σ V·E[x²] + v_bias`` is one Conv of its own (the mean-field export has summed
    it into the variance; the compiled kernels reuse it), its root rescaled, instead of the
    regression Einsums."""
    x, sh = inputs[0], shared[0]
    cf = ComputeFactors.of(layer, step.fp)
    offset, k, wm, wv = cf.offset, cf.k, cf.weight_mean, cf.weight_var
    t, a = layer.tensors, layer.layer.attrs
    o, c, kh, kw = wm.shape
    in_shape, out_hw = step.ctx.shapes[layer.inputs[0]], layer.layer.out_shape[1:]
    args = (in_shape, (kh, kw), a["stride"], a["padding"], a["dilation"], out_hw)
    positions = 1.0 / (out_hw[0] * out_hw[1])
    mu_taps = step.taps(x.mean, *args)
    mbar = [step.view_as(step.rsum(tp, [2, 3]), c) * step.c(positions) for tp in mu_taps]  # (B, C) each
    s_taps = step.taps(sh.s, *args) if sh is not None else []
    sbar = [step.view_as(step.rsum(tp, [2, 3]), c) * step.c(positions) for tp in s_taps]
    w_k = [step.t(wm[:, :, i, j], "w") for i in range(kh) for j in range(kw)] if sh is not None else []
    v_k = [wv[:, :, i, j] for i in range(kh) for j in range(kw)]
    loading: Sym | None = None
    wbar: Sym | None = None
    if offset is not None:
        second = [m * m + (sbar[n] * sbar[n] if sbar else step.c(0.0)) for n, m in enumerate(mbar)]
        wsum = step.total([sq.nary("MatMul", step.t(v.T, "v_t")) for sq, v in zip(second, v_k)])
        bias_var = t["bias_var"] if "bias_var" in t else np.zeros(o)
        wbar = (wsum + step.t(bias_var, "bias_var")).nary("Max", step.c(0.0)).unary("Sqrt")  # (B, O)
        loading = step.einsum("bo,of->bof", wbar, step.onehot(o, k, offset))
    if sh is not None:
        amap = step.total([step.einsum("bc,oc->boc", sb, w) for sb, w in zip(sbar, w_k)])
        prop = step.einsum("boc,bcf->bof", amap, step.widened(sh.g, sh.k, k))
        loading = prop if loading is None else loading + prop
    wf, bf = guide_tensors(t, o, step.fp)
    if wf is not None or bf is not None:  # a correlated guide's factors (correlation/guide_onnx.py)
        injected = guide_onnx.conv_injection(step, mbar, wf, bf, k)
        loading = injected if loading is None else loading + injected
    if loading is None:  # nothing shared in or created (the reference's rule returns no shared part)
        return None, out
    g, _ = step.normalise(loading)
    terms: list[Sym] = []
    if wf is not None or bf is not None:
        terms += guide_onnx.conv_profile_terms(step, g, mu_taps, wf, bf)
    if wf is not None and sh is not None:
        out = OnnxActivation(out.mean + guide_onnx.conv_mean_shift(step, sh, s_taps, wf), out.second, out.repr)
    if sh is not None:
        g_in_cols = g.nary("Slice", step.b.ints([0], "starts"), step.b.ints([sh.k], "ends"),
                           step.b.ints([2], "axes"))
        beta = step.einsum("bcf,bof->boc", sh.g, g_in_cols)
        terms += [step.einsum("bchw,boc->bohw", tp, beta * w) for tp, w in zip(s_taps, w_k)]
    if offset is not None and wbar is not None and step.fp.injection == "rescaled":
        # the weight-noise term Σ V·E[x²] + v_bias as its own Conv (the mean-field export sums it into
        # the variance before this rule runs), its root rescaled to the spatial mean w̄
        noise = ctx.conv2d(ctx.second_moment(x), wv, a, "weight_var_noise")
        if "bias_var" in t:
            noise = noise + step.view_as(step.t(t["bias_var"], "bias_var"), o, 1, 1)
        root = noise.nary("Max", step.c(0.0)).unary("Sqrt")
        root_mean = step.rsum(root, [2, 3]) * step.c(positions)  # (B, O, 1, 1)
        own = step.view_as(step.einsum("bof,of->bo", g, step.onehot(o, k, offset)), o, 1, 1)
        terms.append(own * step.safe_div(step.view_as(wbar, o, 1, 1), root_mean) * root)
    elif offset is not None and wbar is not None:
        coef = step.safe_div(step.einsum("bof,of->bo", g, step.onehot(o, k, offset)), wbar)
        reg = [step.einsum("bchw,bc,oc->bohw", tp, mb, step.t(v, "v")) for tp, mb, v in zip(mu_taps, mbar, v_k)]
        reg += [step.einsum("bchw,bc,oc->bohw", tp, sb, step.t(v, "v")) for tp, sb, v in zip(s_taps, sbar, v_k)]
        if "bias_var" in t:
            reg.append(step.view_as(step.t(t["bias_var"], "bias_var"), o, 1, 1))
        terms.append(step.view_as(coef, o, 1, 1) * step.total(reg))
    return OnnxShared(step.clip(step.total(terms), step.var(out)), g, k), out


@shared_exporter("dense")
def dense_shared_onnx(step: OnnxSharedStep, ctx: OnnxContext, layer: PlannedLayer, inputs: list[OnnxActivation],
                      shared: list[OnnxShared | None], out: OnnxActivation
                      ) -> tuple[OnnxShared | None, OnnxActivation]:
    """:func:`dense_shared` in ONNX (Einsums and MatMuls)."""
    x, sh = inputs[0], shared[0]
    cf = ComputeFactors.of(layer, step.fp)
    offset, k, wm, wv = cf.offset, cf.k, cf.weight_mean, cf.weight_var
    t = layer.tensors
    o, n = wm.shape
    loading: Sym | None = None
    var = step.var(out)
    mean = out.mean
    assert var is not None
    wf, bf = guide_tensors(t, o, step.fp)
    rows = step.fp.rows[layer.inputs[0]] if sh is not None else 1
    counted: Sym | None = None
    if sh is not None:
        s = step.view_as(sh.s, n)
        coef = step.einsum("brg,org->bor", step.view_as(s, rows, n // rows), step.t(wm.reshape(o, rows, -1), "w"))
        loading = step.einsum("bor,brf->bof", coef, step.widened(sh.g, sh.k, k))
        counted = (s * s).nary("MatMul", step.t((wm**2).T, "w2_t"))
    if wf is not None or bf is not None:  # a correlated guide's factors (correlation/guide_onnx.py)
        injected, guide_counted, shift = guide_onnx.dense_terms(step, step.view_as(x.mean, n), sh, rows, wf, bf, k)
        loading = injected if loading is None else loading + injected
        counted = guide_counted if counted is None else counted + guide_counted
        if shift is not None:
            mean = mean + shift
    if loading is not None and counted is not None:
        pn = step.view_as(step.rsum(loading * loading, [2]), o)
        var = (var + pn - counted).nary("Max", step.c(0.0))
    if offset is not None:
        mu = step.view_as(x.mean, n)
        ex2 = mu * mu if x.second is None else mu * mu + step.view_as(x.second, n)
        inj = ex2.nary("MatMul", step.t(wv.T, "v_t"))
        if "bias_var" in t:
            inj = inj + step.t(t["bias_var"], "bias_var")
        own = step.einsum("bo,of->bof", inj.nary("Max", step.c(0.0)).unary("Sqrt"), step.onehot(o, k, offset))
        loading = own if loading is None else loading + own
    assert loading is not None
    g, norm = step.normalise(loading)
    s_out = step.clip(step.view_as(norm, o), var)
    return OnnxShared(s_out, g, k), OnnxActivation(mean, var, out.repr)
