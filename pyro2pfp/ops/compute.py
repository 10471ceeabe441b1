"""Compute layers (Gaussian weights): ``dense`` (``nn.Linear``) and ``conv2d`` (``nn.Conv2d``, ``nn.Conv1d``).

Moments (``docs/math.md`` "Compute layers"; the paper's eqs. 7, 12, 13), with independent Gaussian weights and inputs:

* deterministic input ``x``:      ``μ = Σ μw·x + μb``,   ``v = Σ vw·x² + vb``;
* variance input ``(μx, vx)``:    ``μ = Σ μw·μx + μb``,  ``v = Σ vw·(μx² + vx) + μw²·vx + vb``;
* raw-moment input ``(μx, sx)``:  ``μ = Σ μw·μx + μb``,  ``v = Σ sw·sx − (μw·μx)² + vb`` (clamped ≥ 0),

each sum being the layer's linear map (a matmul or a convolution) applied to the products.  The
stored weights (``weight_var`` or ``weight_second_moment = μw² + vw``, calibrated) come from the
planner.  ``conv1d`` becomes ``reshape (C, 1, L)`` → ``conv2d`` with a 1×k kernel → ``reshape
(O, L')`` (:mod:`pyro2pfp.onedim`).  Padding is symmetric in every back end: ``padding="same"``/``"valid"``
become explicit padding as torch pads them, a zero ``F.pad`` before the conv is added to it, and an
asymmetric padding (``"same"`` with an even kernel) becomes the larger side on both sides plus zero
taps in the kernel on the other side (:func:`_symmetric_padding`; exact).

The TVM kernels and schedules are in ``tvm_backend/ops/compute.py``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..converters import Alias, register
from ..graph import GaussianParam, Layer, Repr
from ..onedim import as_2d
from ..plan import PlannedLayer
from ..registry import COMPUTE_INPUT, Contract, OpDef, register_op
from ._formula import formula

_COMPUTE = Contract(takes=COMPUTE_INPUT, natural=Repr.VARIANCE, keeps_deterministic=False)

DENSE = register_op(OpDef(
    "dense", ("aten.linear.default", "aten.matmul.default", "aten.mm.default"),
    modules="`Linear`, `F.linear`, `x @ W` / `torch.matmul(x, W)` (+ `b`) with `W`, `b` parameters or sample sites",
    modules_short=("Linear", "x @ W"),
    moments="mean, variance exact for independent inputs/weights",
    assumptions="mean-field weights, independent inputs", contract=_COMPUTE, compute_layer=True))

CONV2D = register_op(OpDef(
    "conv2d", ("aten.conv2d.default", "aten.conv2d.padding", "aten.conv1d.default", "aten.conv1d.padding",
               "aten.pad.default", "aten.constant_pad_nd.default"),
    modules="`Conv2d`, `Conv1d` (stride, padding incl. `\"same\"`, dilation, groups; a zero `F.pad`/`ZeroPad` "
            "before it is folded into its padding)",
    modules_short=("Conv1d", "Conv2d"), moments="as dense",
    assumptions="as dense (shared weights make outputs correlated: ignored downstream)", contract=_COMPUTE,
    compute_layer=True))


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
    mean, var, padding, dilations = w.mean, w.var, [], []
    for axis, (begin, end), d in zip((2, 3), pads, dilation):
        if begin != end:
            if abs(end - begin) % d:
                mean, var, d = _spread(mean, axis, d), _spread(var, axis, d), 1
            shape = list(mean.shape)
            shape[axis] = abs(end - begin) // d
            zeros = np.zeros(shape)
            mean, var = ((np.concatenate([zeros, a], axis) if end > begin else np.concatenate([a, zeros], axis))
                         for a in (mean, var))
        padding.append(max(begin, end))
        dilations.append(d)
    if mean is w.mean:
        return w, padding, dilations
    return GaussianParam(mean, var, site=w.site), padding, dilations


def _conv_layer(node, ctx, x, weight, bias, stride, padding, dilation, groups, spatial: int):
    """``(input node, params, attrs)`` of the ``conv2d`` layer of a conv with ``spatial`` = 1 (a 1×k
    kernel) or 2 spatial dims: explicit, string and folded ``F.pad`` paddings become symmetric ones."""
    x, pre = _explicit_padding(x, spatial)
    w = ctx.param(weight, node, "weight")
    if spatial == 1:
        shape = (w.shape[0], w.shape[1], 1, w.shape[2])
        w = GaussianParam(w.mean.reshape(shape), w.var.reshape(shape), site=w.site)
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
    two reshapes (:mod:`pyro2pfp.onedim` removes the reshapes between consecutive 1-D layers)."""
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
                 params={"weight": GaussianParam(w.mean.T.copy(), w.var.T.copy(), site=w.site)})
