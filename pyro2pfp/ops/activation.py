"""Elementwise activations with Gaussian moments: ReLU, LeakyReLU, scaling by a constant; a final softmax
is stripped.

Each activation is one :class:`~pyro2pfp.registry.OpDef` with an
:class:`~pyro2pfp.registry.ActivationRule` -- the exact function and its moments for a Gaussian
input, written once against the ``ops`` namespace of :mod:`pyro2pfp.moments` -- plus its converter.
:func:`register_activation` makes the rule the op's NumPy reference and ONNX export; the TVM kernel
and CPU schedule of every such op are the generic ones of ``tvm_backend/ops/activation.py``.
Adding an activation is: its moments (with their source) and one ``register_activation`` call with
a converter here, and its tests (a Monte Carlo test and a compiled-vs-reference test).
"""
from __future__ import annotations

import warnings
from typing import Any

from .. import moments
from ..converters import Alias, register
from ..graph import Layer, Repr
from ..plan import PlannedLayer
from ..registry import ACTIVATION, VARIANCE_IN_OUT, ActivationRule, OpDef, register_op
from ._formula import formula


def register_activation(op: OpDef) -> OpDef:
    """Register an activation ``op`` (with its ``activation`` rule) and the rule as its NumPy reference
    and ONNX export: exact on a deterministic input, moment-matched (``rule.moments`` on the input's
    mean and variance, emitted in the representation the plan asks for) otherwise."""
    rule = op.activation
    if rule is None:
        raise ValueError(f"activation op {op.name!r} needs an ActivationRule")
    register_op(op)

    def activation(bk: Any, layer: PlannedLayer, inputs: list[Any]) -> Any:
        x, attrs = inputs[0], layer.layer.attrs
        if x.repr is Repr.DETERMINISTIC:
            return bk.deterministic(rule.exact(x.mean, attrs, bk.ops))
        mean, var = rule.moments(x.mean, bk.variance(x), attrs, bk.ops)
        return bk.emit(mean, var, layer)

    activation.__name__ = f"{op.name}_activation"
    formula(op.name)(activation)
    return op


RELU = register_activation(OpDef(
    "relu", ("aten.relu.default", "aten.relu_.default"),
    modules="`ReLU`", modules_short=("ReLU",),
    moments="exact for a Gaussian input", assumptions="input treated as Gaussian", contract=ACTIVATION,
    activation=ActivationRule(
        exact=lambda x, attrs, ops: ops.maximum(x, ops.const(0.0)),
        moments=lambda mean, var, attrs, ops: moments.relu_moments(mean, var, ops))))

LEAKY_RELU = register_activation(OpDef(
    "leaky_relu", ("aten.leaky_relu.default", "aten.leaky_relu_.default"),
    modules="`LeakyReLU(slope)`", modules_short=("LeakyReLU",),
    moments="exact (`Cov(a, relu a) = v·Φ(α)`, Stein's lemma)", assumptions="input treated as Gaussian",
    contract=ACTIVATION, example_attrs={"slope": 0.1},
    activation=ActivationRule(
        exact=lambda x, attrs, ops: ops.where(x > ops.const(0.0), x, ops.const(attrs["slope"]) * x),
        moments=lambda mean, var, attrs, ops: moments.leaky_relu_moments(mean, var, attrs["slope"], ops))))


SCALE = register_activation(OpDef(
    "scale", ("aten.mul.Tensor", "aten.div.Tensor", "aten.neg.default"),
    modules="`x * c`, `x / c`, `-x` (a constant `c`, e.g. a temperature)", modules_short=("x * c",),
    moments="exact (linear: `μ ↦ c·μ`, `v ↦ c²·v`)", assumptions="—", contract=VARIANCE_IN_OUT,
    example_attrs={"factor": -0.5},
    activation=ActivationRule(
        exact=lambda x, attrs, ops: ops.const(attrs["factor"]) * x,
        moments=lambda mean, var, attrs, ops: (ops.const(attrs["factor"]) * mean,
                                               ops.const(attrs["factor"] ** 2) * var))))


# ------------------------------------------------------------------------------------ converters
@register("aten.mul.Tensor", "aten.div.Tensor", "aten.neg.default", produces=("scale",))
def convert_scale(node, ctx) -> Layer:
    """``x * c``, ``c * x``, ``x / c``, ``-x`` with ``c`` a Python number -> ``scale`` by ``c`` (``1/c``)."""
    op = str(node.target)
    if op == "aten.neg.default":
        x, factor = node.args[0], -1.0
    else:
        a, b = node.args[:2]
        numbers = (int, float)
        if op == "aten.mul.Tensor" and isinstance(a, numbers) and not isinstance(b, numbers):
            a, b = b, a
        if not isinstance(b, numbers) or isinstance(b, bool):
            raise ctx.unsupported(node, "only the product/quotient of an activation and a constant number is "
                                        "supported (not of two tensors)")
        if op == "aten.div.Tensor" and b == 0:
            raise ctx.unsupported(node, "division by zero")
        x, factor = a, float(b) if op == "aten.mul.Tensor" else 1.0 / float(b)
    return Layer(name=ctx.new_name(node, prefer_module=False), op="scale", inputs=[ctx.activation(x, node)],
                 out_shape=ctx.shape(node), source=ctx.source(node), attrs={"factor": factor})


@register("aten.relu.default", "aten.relu_.default", produces=("relu",))
def convert_relu(node, ctx) -> Layer:
    x = node.args[0]
    return Layer(name=ctx.new_name(node, prefer_module=False), op="relu",
                 inputs=[ctx.activation(x, node)], out_shape=ctx.shape(node), source=ctx.source(node))


@register("aten.leaky_relu.default", "aten.leaky_relu_.default", produces=("leaky_relu",))
def convert_leaky_relu(node, ctx) -> Layer:
    x = node.args[0]
    slope = float(node.args[1]) if len(node.args) > 1 else float(node.kwargs.get("negative_slope", 0.01))
    return Layer(name=ctx.new_name(node, prefer_module=False), op="leaky_relu",
                 inputs=[ctx.activation(x, node)], out_shape=ctx.shape(node), source=ctx.source(node),
                 attrs={"slope": slope})


@register("aten.softmax.int", "aten._softmax.default", "aten.log_softmax.int", "aten._log_softmax.default")
def strip_final_softmax(node, ctx) -> Alias:
    if not ctx.is_output(node):
        raise ctx.unsupported(node, "softmax inside the network is not supported (only a final softmax, "
                                    "which is stripped so the output stays the logits)")
    warnings.warn(f"{ctx.source(node)}: the final softmax/log_softmax is stripped; the PFP network outputs "
                  "the (mean, variance) of the logits. Use pyro2pfp.uncertainty() for class probabilities.",
                  stacklevel=2)
    return Alias(node.args[0])
