"""Compute layers (Gaussian weights): ``dense`` (``nn.Linear``) and ``conv2d`` (``nn.Conv2d``, ``nn.Conv1d``).

Moments (``docs/math.md`` "Compute layers"; the paper's eqs. 7, 12, 13), with independent Gaussian weights and inputs:

* deterministic input ``x``:      ``μ = Σ μw·x + μb``,   ``v = Σ vw·x² + vb``;
* variance input ``(μx, vx)``:    ``μ = Σ μw·μx + μb``,  ``v = Σ vw·(μx² + vx) + μw²·vx + vb``;
* raw-moment input ``(μx, sx)``:  ``μ = Σ μw·μx + μb``,  ``v = Σ sw·sx − (μw·μx)² + vb`` (clamped ≥ 0),

each sum being the layer's linear map (a matmul or a convolution) applied to the products.  The
stored weights (``weight_var`` or ``weight_second_moment = μw² + vw``, calibrated) come from the
planner.  ``conv1d`` becomes ``reshape (C, 1, L)`` → ``conv2d`` with a 1×k kernel → ``reshape
(O, L')``; ``padding="same"``/``"valid"`` become explicit (symmetric) padding.

The TVM kernels and schedules are in ``tvm_backend/ops/compute.py``.
"""
from __future__ import annotations

from typing import Any

from ..converters import register
from ..graph import GaussianParam, Layer, Repr
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
    "conv2d", ("aten.conv2d.default", "aten.conv2d.padding", "aten.conv1d.default", "aten.conv1d.padding"),
    modules="`Conv2d` (stride, padding incl. `\"same\"` for odd kernels, dilation, groups), `Conv1d`",
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


def _string_padding(node, ctx, padding: str, kernel: list[int], dilation: list[int]) -> list[int]:
    if padding == "valid":
        return [0] * len(kernel)
    totals = [d * (k - 1) for k, d in zip(kernel, dilation)]
    if any(t % 2 for t in totals):
        raise ctx.unsupported(node, f"padding='same' with kernel {kernel} needs asymmetric padding; "
                                    "use an odd kernel or explicit padding")
    return [t // 2 for t in totals]


def _conv_params(node, ctx, weight, bias, reshape_to_2d: bool) -> dict[str, GaussianParam]:
    w = ctx.param(weight, node, "weight")
    if reshape_to_2d:
        shape = (w.shape[0], w.shape[1], 1, w.shape[2])
        w = GaussianParam(w.mean.reshape(shape), w.var.reshape(shape), site=w.site)
    params = {"weight": w}
    if bias is not None:
        params["bias"] = ctx.param(bias, node, "bias")
    return params


@register("aten.conv2d.default", "aten.conv2d.padding", produces=("conv2d",))
def convert_conv2d(node, ctx) -> Layer:
    args = list(node.args) + [None] * 7
    x, weight, bias, stride, padding, dilation, groups = args[:7]
    if len(ctx.shape(x)) != 3:
        raise ctx.unsupported(node, f"conv2d expects (batch, C, H, W) input, got (batch, {ctx.shape(x)})")
    params = _conv_params(node, ctx, weight, bias, reshape_to_2d=False)
    dilation = _pair(dilation if dilation is not None else 1)
    if isinstance(padding, str):
        padding = _string_padding(node, ctx, padding, list(params["weight"].shape[2:]), dilation)
    attrs = {
        "stride": _pair(stride if stride is not None else 1),
        "padding": _pair(padding if padding is not None else 0),
        "dilation": dilation,
        "groups": int(groups) if groups is not None else 1,
    }
    return Layer(name=ctx.new_name(node, prefer_module=True), op="conv2d",
                 inputs=[ctx.activation(x, node)], out_shape=ctx.shape(node),
                 source=ctx.source(node), attrs=attrs, params=params)


@register("aten.conv1d.default", "aten.conv1d.padding", produces=("conv2d", "reshape"))
def convert_conv1d(node, ctx) -> list[Layer]:
    args = list(node.args) + [None] * 7
    x, weight, bias, stride, padding, dilation, groups = args[:7]
    if len(ctx.shape(x)) != 2:
        raise ctx.unsupported(node, f"conv1d expects (batch, C, L) input, got (batch, {ctx.shape(x)})")
    c, length = ctx.shape(x)
    params = _conv_params(node, ctx, weight, bias, reshape_to_2d=True)
    dilation = _pair(dilation if dilation is not None else 1, 1)[0]
    if isinstance(padding, str):
        padding = _string_padding(node, ctx, padding, [params["weight"].shape[3]], [dilation])
    o, out_len = ctx.shape(node)
    name = ctx.new_name(node, prefer_module=True)
    attrs = {"stride": [1, _pair(stride if stride is not None else 1, 1)[0]],
             "padding": [0, _pair(padding if padding is not None else 0, 1)[0]],
             "dilation": [1, dilation], "groups": int(groups) if groups is not None else 1}
    source = ctx.source(node)
    return [
        Layer(name=f"{name}_to_2d", op="reshape", inputs=[ctx.activation(x, node)], out_shape=(c, 1, length),
              source=source),
        Layer(name=f"{name}_2d", op="conv2d", inputs=[f"{name}_to_2d"], out_shape=(o, 1, out_len),
              source=source, attrs=attrs, params=params),
        Layer(name=name, op="reshape", inputs=[f"{name}_2d"], out_shape=(o, out_len), source=source),
    ]


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
