"""Shape and representation ops: ``reshape`` (flatten/view/squeeze, a view on both components), the
planner's representation ``convert`` (``s = μ² + v`` or ``v = s − μ²``, ``docs/math.md``
"Representation planning"), and the torch ops that are the identity at inference (dropout, clone, …).

The TVM kernels are in ``backends/tvm/ops/shape.py``.  Shared-factor PFP (:mod:`pyro2pfp.correlation`):
both ops are views of the profile ``s`` (reshaped; ``g`` kept per channel, so a reshape must keep or
flatten the channel axis, which the factor plan checks) -- their rules are at the end of this file,
the TE one in ``backends/tvm/ops/shape.py``.
"""
from __future__ import annotations

import sys
import warnings
from typing import Any

import numpy as np

from ..correlation.factors import FactorPlan
from ..correlation.loadings import CompactPlan, Loadings, TensorAlgebra
from ..correlation.shared import Shared
from ..correlation.shared_algebra import SharedAlgebra
from ..planning.converters import Alias, register
from ..planning.graph import Layer
from ..planning.plan import PlannedLayer
from ..planning.registry import CompactSpec, Contract, FactorSpec, OpDef, register_op
from ._formula import compact_formula, formula, shared_formula

_PASS_THROUGH = Contract(takes=None, natural=None, keeps_deterministic=True)

RESHAPE = register_op(OpDef(
    "reshape", ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
                "aten.flatten.using_ints", "aten.unflatten.int", "aten.squeeze.default", "aten.squeeze.dim",
                "aten.squeeze.dims", "aten.unsqueeze.default", "aten.select.int", "aten.slice.Tensor"),
    modules="`Flatten`, `view`, `reshape`, `Dropout` (inference), `Identity`",
    modules_short=("Flatten/view/reshape",), moments="identity", assumptions="—", table_op="reshape / none",
    contract=_PASS_THROUGH, view=True, required_tests=("compiled",),  # the identity on moments: nothing to sample
    factor_spec=FactorSpec(reshapes=True), compact_spec=CompactSpec(keeps_units=True)))

CONVERT = register_op(OpDef(
    "convert", modules="(inserted by the planner: variance ↔ second moment)",
    moments="exact", assumptions="—", contract=_PASS_THROUGH, internal=True))


# ------------------------------------------------------------------------------------ reference + ONNX
@formula("reshape")
def reshape(bk: Any, layer: PlannedLayer, inputs: list[Any]) -> Any:
    """Identity on both components, batch dimension kept first."""
    x, shape = inputs[0], tuple(layer.layer.out_shape)
    second = None if x.second is None else bk.reshape(x.second, shape)
    return type(x)(bk.reshape(x.mean, shape), second, x.repr)


@formula("convert")
def convert(bk: Any, layer: PlannedLayer, inputs: list[Any]) -> Any:
    """The input re-expressed in the representation the plan asks for."""
    x = inputs[0]
    return bk.emit(x.mean, bk.variance(x), layer)


# ------------------------------------------------------------------------------------ converters
@register("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
          "aten.flatten.using_ints", "aten.unflatten.int", "aten.squeeze.dim", "aten.squeeze.dims",
          "aten.squeeze.default", "aten.unsqueeze.default", produces=("reshape",))
def convert_reshape(node, ctx) -> Layer | Alias:
    x = node.args[0]
    if ctx.shape(x) == ctx.shape(node):
        return Alias(x)
    return Layer(name=ctx.new_name(node, prefer_module=False), op="reshape",
                 inputs=[ctx.activation(x, node)], out_shape=ctx.shape(node), source=ctx.source(node))


@register("aten.select.int", "aten.slice.Tensor", produces=("reshape",))
def convert_select(node, ctx) -> Layer | Alias:
    """``out[..., 0]`` / ``out[:, 0]`` / ``out[..., 0:1]`` where it keeps every element (the indexed axis
    has size 1, or the slice spans it): a reshape.  Picking some of several columns is not a PFP layer
    (a regression head that reads its mean and noise scale from columns is read by
    :func:`pyro2pfp.frontend.noise.read_head` and ends the network before the indexing)."""
    import torch  # converters run while converting, with torch loaded

    x = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if node.target is torch.ops.aten.slice.Tensor and dim == 0 and (node.args[2:3] or [0])[0] in (0, None) and \
            (node.args[3:4] or [None])[0] in (None, sys.maxsize) and (node.args[4:5] or [1])[0] == 1:
        return Alias(x)  # x[:] on the batch axis
    src, out = ctx.shape(x), ctx.shape(node)
    if int(np.prod(src)) != int(np.prod(out)):
        op = str(node.target).removeprefix("aten.").split(".")[0]
        raise ctx.unsupported(node, f"{op} picks {int(np.prod(out))} of the {int(np.prod(src))} elements of shape "
                                    f"{src}; PFP converts indexing only where it keeps every element (e.g. "
                                    "out[..., 0] of a single output) or as a Normal likelihood's heteroscedastic "
                                    "head (the mean and the noise scale read from columns of the network output)")
    if dim % (len(src) + 1) == 0:
        raise ctx.unsupported(node, "indexing the batch axis is not supported")
    return convert_reshape(node, ctx)


@register("aten.dropout.default", "aten.feature_dropout.default", "aten.alpha_dropout.default")
def convert_dropout(node, ctx) -> Alias:
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", False)
    if train:
        warnings.warn(f"{ctx.source(node)}: dropout is called with training=True; PFP treats it as "
                      "the identity (inference mode). Use nn.Dropout or F.dropout(x, p, self.training).",
                      stacklevel=2)
    return Alias(node.args[0])


@register("aten.clone.default", "aten.contiguous.default", "aten.detach.default", "aten.alias.default",
          "aten.identity.default")
def convert_identity(node, ctx) -> Alias:
    return Alias(node.args[0])


# ------------------------------------------------------------------------------------ shared-factor rules
@shared_formula("reshape", "convert")
def view_shared(bk: SharedAlgebra, layer: PlannedLayer, inputs: list[Any], shared: list[Shared | None], fp: FactorPlan,
                var: Any) -> tuple[Shared | None, Any]:
    """reshape/flatten: ``s`` reshaped, ``g`` kept per channel; convert: the identity."""
    sh = shared[0]
    if sh is None:
        return None, var
    return Shared(bk.reshape(sh.s, tuple(layer.layer.out_shape)), sh.g, sh.k), var


@compact_formula("reshape")
def reshape_compact(bk: TensorAlgebra, layer: PlannedLayer, inputs: list[Any], loads: list[Loadings | None],
                    plan: CompactPlan, mean: Any, var: Any) -> tuple[Any, Any, Any]:
    """Reshape in the compact factor plan: the loadings follow their elements (global columns are kept per
    element in flat order; block columns stay per channel where the reshape keeps the channel axis or
    flattens it, else they become global columns of zeros and loadings)."""
    ld = loads[0]
    if ld is None:
        return None, mean, var
    shape = tuple(layer.layer.out_shape)
    out = Loadings(dict(ld.glob), {}, dict(ld.glob_width))
    kept = {key for key, (c, _, _) in ld.block_shape.items() if len(shape) == 1 or shape[0] == c}
    for key in kept:
        out.block[key], out.block_shape[key] = ld.block[key], ld.block_shape[key]
    if kept != set(ld.block):  # the channel grouping is lost: factor (ch, r) as a global column
        lost = Loadings({}, {k: b for k, b in ld.block.items() if k not in kept},
                        {}, {k: s for k, s in ld.block_shape.items() if k not in kept})
        for key, (g, k) in lost.blocks_as_global(bk).items():  # the same factors as a global entry of the key
            out.glob[key], out.glob_width[key] = (out.glob[key] + g if key in out.glob else g), k
    return out, mean, var
