"""Joining branches: ``concat`` -- ``torch.cat`` / ``torch.concat`` / ``torch.concatenate`` /
``torch.hstack`` along any per-sample axis, and ``torch.stack`` (each input given a new axis of size 1 by
a ``reshape`` layer, then concatenated along it).

Moments (``docs/math.md`` "Concatenation"): concatenation moves elements without changing them, so
the output's mean and variance are the inputs' means and variances, placed side by side -- exact,
whatever the inputs' distributions and their dependence (a concatenation has no sum in it: the
branches' covariance never enters an element's variance).  A deterministic input contributes a
variance of exactly 0; a network whose every input is deterministic gives a deterministic output.

Shared-factor PFP (:mod:`pyro2pfp.correlation`): along the row (channel, or dense unit) axis the
shared parts concatenate too -- the profiles ``s`` side by side and the loadings ``g`` row block by
row block, each widened with zero columns to the output's factor count ``K`` (a branch without a
shared part contributes ``s = 0``, ``g = 0``).  Exact: every element keeps its covariance with every
factor, and the factors are the network's, common to all branches (``K`` counts every block created
before the layer, so two branches that share upstream factors stay correlated through them).  Along
another axis a row would mix positions with different loadings, which the rank-1-per-row
representation cannot hold: such a layer has no shared-factor rule (``correlation='auto'`` falls back to
mean-field with a warning), nor has a concatenation of flattened conv outputs (rows with a group of
positions).

The TVM kernels are in ``backends/tvm/ops/concat.py``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..correlation.factors import FactorPlan
from ..correlation.shared import Shared
from ..correlation.shared_algebra import SharedAlgebra
from ..planning.converters import Alias, register
from ..planning.correlated_pools import WindowCovariances
from ..planning.graph import Layer, Repr
from ..planning.plan import PlannedLayer
from ..planning.registry import FactorSpec, OpDef, register_op
from ._formula import formula, shared_formula

CAT_OPS = ("aten.cat.default", "aten.concat.default", "aten.concatenate.default", "aten.hstack.default")
STACK_OPS = ("aten.stack.default",)


def row_axis_only(layer: PlannedLayer) -> str | None:
    """Why the shared-factor rule cannot run ``layer`` (None: it can): it joins along the row axis only."""
    axis = layer.layer.attrs["axis"]
    if axis == 0:
        return None
    return f"concatenations along per-sample axis {axis} (not the channel/unit axis 0)"


def _window_covariances(covs: WindowCovariances, layer: Layer) -> str | None:
    """The in-window covariances of a concatenation along the channels: the concatenation of its parts'
    (the rest, and parts without them: the edge's shared factors' part)."""
    if layer.attrs.get("axis") == 0 and not layer.attrs.get("stack", False):
        parts = [covs.build(n) for n in layer.inputs]
        if all(p is not None for p in parts):
            return covs.new(layer.op, [p for p in parts if p is not None], covs.what(layer.name), {"axis": 0})
    return covs.closure([layer.name], covs.what(layer.name))


CONCAT = register_op(OpDef(
    "concat", CAT_OPS + STACK_OPS,
    modules="`torch.cat` / `concat` / `concatenate` / `hstack` of branches (any axis but the batch's), "
            "`torch.stack` (a new axis)",
    modules_short=("torch.cat/stack of branches",), moments="exact",
    assumptions="— (shared factors: along the channel/unit axis only; `auto` falls back to mean-field otherwise)",
    factor_spec=FactorSpec(refuse=row_axis_only, joins_rows=True), window_covariances=_window_covariances))


# ------------------------------------------------------------------------------------ reference + ONNX
@formula("concat")
def concat(bk: Any, layer: PlannedLayer, inputs: list[Any]) -> Any:
    """Means and variances side by side along ``attrs["axis"]`` (a deterministic input: variance 0)."""
    axis = layer.layer.attrs["axis"]
    mean = bk.concat([x.mean for x in inputs], axis)
    if all(x.repr is Repr.DETERMINISTIC for x in inputs):
        return bk.deterministic(mean)
    var = bk.concat([bk.zeros_like(x.mean) if x.repr is Repr.DETERMINISTIC else bk.variance(x) for x in inputs],
                    axis)
    return bk.emit(mean, var, layer)


# ------------------------------------------------------------------------------------ converters
def _tensors(node: Any, ctx: Any) -> list[Any]:
    """The fx nodes joined by a cat/stack node; a constant among them is refused."""
    import torch.fx  # converters run while converting, with torch loaded

    tensors = list(node.args[0]) if node.args else list(node.kwargs.get("tensors", ()))
    if not tensors or not all(isinstance(t, torch.fx.Node) for t in tensors):
        raise ctx.unsupported(node, "joining a constant tensor with activations is not supported; compute the "
                                    "constant part outside the converted network")
    return tensors


def _axis(node: Any, ctx: Any, dim: int, rank: int) -> int:
    """The per-sample axis (batch excluded) of ``dim`` in a tensor of ``rank`` axes (batch included)."""
    d = dim % rank
    if d == 0:
        op = str(node.target).removeprefix("aten.").split(".")[0]
        raise ctx.unsupported(node, f"{op} along the batch axis (dim={dim}) is not supported: PFP layers keep "
                                    "every example apart; join per-example features along another axis")
    return d - 1


@register(*CAT_OPS, produces=("concat",))
def convert_cat(node: Any, ctx: Any) -> Layer | Alias:
    """``torch.cat(tensors, dim)`` (``concat``, ``concatenate``; ``hstack``: ``dim=1``) -> ``concat``."""
    tensors = _tensors(node, ctx)
    if str(node.target) == "aten.hstack.default":
        dim = 1
    else:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    out = ctx.shape(node)
    axis = _axis(node, ctx, int(dim), len(out) + 1)
    if len(tensors) == 1:
        return Alias(tensors[0])
    return Layer(name=ctx.new_name(node, prefer_module=False), op="concat",
                 inputs=[ctx.activation(t, node) for t in tensors], out_shape=out, source=ctx.source(node),
                 attrs={"axis": axis})


@register(*STACK_OPS, produces=("reshape", "concat"))
def convert_stack(node: Any, ctx: Any) -> list[Layer]:
    """``torch.stack(tensors, dim)``: each input reshaped to have a size-1 axis at ``dim``, then ``concat``
    along it (the reshapes are views)."""
    tensors = _tensors(node, ctx)
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    out = ctx.shape(node)
    axis = _axis(node, ctx, int(dim), len(out) + 1)
    name, source = ctx.new_name(node, prefer_module=False), ctx.source(node)
    unsqueezed = (*out[:axis], 1, *out[axis + 1:])
    views = [Layer(name=f"{name}_in{i}", op="reshape", inputs=[ctx.activation(t, node)], out_shape=unsqueezed,
                   source=source) for i, t in enumerate(tensors)]
    return [*views, Layer(name=name, op="concat", inputs=[v.name for v in views], out_shape=out, source=source,
                          attrs={"axis": axis})]


# ------------------------------------------------------------------------------------ shared-factor rules
@shared_formula("concat")
def concat_shared(bk: SharedAlgebra, layer: PlannedLayer, inputs: list[Any], shared: list[Shared | None],
                  fp: FactorPlan, var: Any) -> tuple[Shared | None, Any]:
    """Along the row axis: ``s`` side by side, ``g`` row blocks widened to the output's ``K`` (a branch
    without a shared part: ``s = 0``, ``g = 0``); the variance unchanged (exact)."""
    k = fp.width[layer.name]
    s_parts, g_parts = [], []
    for name, x, sh in zip(layer.inputs, inputs, shared, strict=True):
        shape = bk.edge_shape(x, name)
        if sh is None:
            rows = bk.reshape(x.mean, (shape[0], int(np.prod(shape[1:]))))
            s_parts.append(bk.zeros_like(x.mean))
            g_parts.append(bk.widened(bk.zeros_like(bk.slice(rows, 2, 0, 1)), 1, k))
        else:
            s_parts.append(bk.reshape(sh.s, shape))
            g_parts.append(bk.widened(sh.g, sh.k, k))
    return Shared(bk.concat(s_parts, 0), bk.concat(g_parts, 0), k), var
