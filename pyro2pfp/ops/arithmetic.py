"""Linear elementwise ops: the per-channel ``affine`` map (eval-mode batch norm) and the residual ``add``.

* ``affine``: ``μ ↦ a·μ + c``, ``v ↦ a²·v`` per channel (channel axis 1), exact (``docs/math.md``
  "Linear layers"); ``a = γ/√(running_var + ε)``, ``c = β − a·running_mean``.
* ``add``: the sum of two activations, ``μ = μa + μb``, ``v = va + vb`` -- exact for independent
  summands (the branches of a residual block share their input, so their covariance is dropped).

The TVM kernels and schedules are in ``tvm_backend/ops/arithmetic.py``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..converters import Alias, register
from ..graph import GaussianParam, Layer, Repr
from ..plan import PlannedLayer
from ..registry import OpDef, register_op
from ._formula import formula

AFFINE = register_op(OpDef(
    "affine", ("aten.batch_norm.default", "aten._native_batch_norm_legit_no_training.default"),
    modules="`BatchNorm1d/2d` in eval mode (folded into the Linear/Conv before it, `pyro2pfp.folding`)",
    modules_short=("BatchNorm1d/2d (eval)",), moments="exact (linear)",
    assumptions="deterministic normalisation parameters"))

ADD = register_op(OpDef(
    "add", ("aten.add.Tensor", "aten.add_.Tensor"),
    modules="`x + y` (residual; `h + b` after a bias-free dense/conv is its bias)", modules_short=("residual '+'",),
    moments="exact for independent summands",
    assumptions="**the two branches are treated as independent** (they share their input, so this "
                "underestimates or overestimates the variance by their covariance)"))


# ------------------------------------------------------------------------------------ reference + ONNX
@formula("affine")
def affine(bk: Any, layer: PlannedLayer, inputs: list[Any]) -> Any:
    """Per-channel ``μ ↦ a·μ + c``, ``v ↦ a²·v`` (channel axis 1)."""
    x = inputs[0]
    shape = (-1,) + (1,) * (len(layer.layer.out_shape) - 1)
    scale = layer.tensors["scale"].reshape(shape)
    mean = x.mean * bk.tensor(scale, "scale") + bk.tensor(layer.tensors["shift"].reshape(shape), "shift")
    if x.repr is Repr.DETERMINISTIC:
        return bk.deterministic(mean)
    return bk.emit(mean, bk.variance(x) * bk.tensor(scale**2, "scale_sq"), layer)


@formula("add")
def add(bk: Any, layer: PlannedLayer, inputs: list[Any]) -> Any:
    """Sum of two independent Gaussians: means and variances add (a deterministic summand adds no variance)."""
    a, b = inputs
    mean = a.mean + b.mean
    random = [bk.variance(x) for x in (a, b) if x.repr is not Repr.DETERMINISTIC]
    if not random:
        return bk.deterministic(mean)
    return bk.emit(mean, random[0] + random[1] if len(random) == 2 else random[0], layer)


# ------------------------------------------------------------------------------------ converters
@register("aten.batch_norm.default", "aten._native_batch_norm_legit_no_training.default",
          produces=("affine",))
def convert_batch_norm(node, ctx) -> Layer:
    args = list(node.args)
    if str(node.target) == "aten.batch_norm.default":
        x, weight, bias, running_mean, running_var, training, _momentum, eps = args[:8]
    else:
        x, weight, bias, running_mean, running_var, _momentum, eps = args[:7]
        training = False
    if training:
        raise ctx.unsupported(node, "batch norm in training mode (batch statistics); call model.eval()")
    if running_mean is None or running_var is None:
        raise ctx.unsupported(node, "batch norm without running statistics is not supported")
    stats = [ctx.param(running_mean, node, "running mean"), ctx.param(running_var, node, "running var")]
    gamma = ctx.param(weight, node, "weight") if weight is not None else None
    beta = ctx.param(bias, node, "bias") if bias is not None else None
    for p, role in ((gamma, "weight"), (beta, "bias")):
        if p is not None and not p.is_deterministic:
            raise ctx.unsupported(node, f"a Bayesian batch-norm {role} (site '{p.site}') is not supported; "
                                        "keep normalisation parameters deterministic")
    scale = 1.0 / np.sqrt(stats[1].mean + float(eps))
    if gamma is not None:
        scale = scale * gamma.mean
    shift = -stats[0].mean * scale + (beta.mean if beta is not None else 0.0)
    zeros = np.zeros_like(scale)
    return Layer(name=ctx.new_name(node, prefer_module=True), op="affine",
                 inputs=[ctx.activation(x, node)], out_shape=ctx.shape(node), source=ctx.source(node),
                 params={"scale": GaussianParam(scale, zeros), "shift": GaussianParam(shift, zeros.copy())})


@register("aten.add.Tensor", "aten.add_.Tensor", produces=("add",))
def convert_add(node, ctx) -> Layer | Alias:
    """``a + b`` of two activations -> ``add`` (a residual connection); ``h + b`` with ``b`` a parameter or
    sample site right after a bias-free dense/conv layer (``x @ W + b``) -> that layer's bias."""
    a, b = node.args[:2]
    alpha = node.kwargs.get("alpha", 1)
    if alpha != 1:
        raise ctx.unsupported(node, f"add with alpha={alpha} is not supported")
    if ctx.is_parameter(a) or ctx.is_parameter(b):
        return _bias_add(node, ctx, b if ctx.is_parameter(a) else a, a if ctx.is_parameter(a) else b)
    import torch.fx  # converters run while converting, with torch loaded

    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
        raise ctx.unsupported(node, "only the sum of two activations (a residual connection) or a bias after a "
                                    "dense/conv layer is supported")
    if ctx.shape(a) != ctx.shape(b):
        raise ctx.unsupported(node, f"adding shapes {ctx.shape(a)} and {ctx.shape(b)} (broadcasting) is not supported")
    return Layer(name=ctx.new_name(node, prefer_module=False), op="add",
                 inputs=[ctx.activation(a, node), ctx.activation(b, node)], out_shape=ctx.shape(node),
                 source=ctx.source(node))


def _bias_add(node, ctx, activation, bias_arg) -> Alias:
    """Attach a parameter added to the output of a bias-free dense/conv layer as that layer's bias (exact:
    the bias is independent of the weights, ``docs/math.md`` "Compute layers")."""
    producer = ctx.producer(activation)
    if producer is None or producer.op not in ("dense", "conv2d") or "bias" in producer.params \
            or len(activation.users) != 1:
        raise ctx.unsupported(node, "adding a parameter to an activation is supported only as the bias of the "
                                    "bias-free dense/conv layer that computes it (x @ W + b)")
    bias = ctx.param(bias_arg, node, "bias")
    channels = producer.out_shape[0]
    per_channel = (channels,) + (1,) * (len(producer.out_shape) - 1)  # (M,) for dense, (C, 1, 1) for conv
    if bias.shape != per_channel:
        raise ctx.unsupported(node, f"a bias of shape {bias.shape} added to a {producer.op} output of shape "
                                    f"(batch, {', '.join(map(str, producer.out_shape))}); expected {per_channel}")
    producer.params["bias"] = GaussianParam(bias.mean.reshape(channels), bias.var.reshape(channels), site=bias.site)
    return Alias(activation)
