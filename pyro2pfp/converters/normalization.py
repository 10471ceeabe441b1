"""Eval-mode batch normalisation → PFP ``affine``: ``μ ↦ a·μ + c``, ``v ↦ a²·v`` per channel."""
from __future__ import annotations

import numpy as np

from ..graph import GaussianParam, Layer
from ._registry import register


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
