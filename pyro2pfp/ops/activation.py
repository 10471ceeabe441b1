"""Elementwise activations with Gaussian moments: ReLU, LeakyReLU, scaling by a constant, and the smooth
and clipped activations (Sigmoid, Tanh, GELU, SiLU, ELU, Softplus, Hardtanh/ReLU6); a final
softmax, and a final sigmoid that gives Bernoulli probabilities, are stripped.

Each activation is one :class:`~pyro2pfp.planning.registry.OpDef` with an
:class:`~pyro2pfp.planning.registry.ActivationRule` -- the exact function and its moments for a Gaussian
input, written once against the ``ops`` namespace of :mod:`pyro2pfp.moments` -- plus its converter.
:func:`register_activation` makes the rule the op's NumPy reference and ONNX export; the TVM kernel
and CPU schedule of every such op are the generic ones of ``backends/tvm/ops/activation.py``.
Adding an activation is: its moments (with their source) and one ``register_activation`` call with
a converter here, and its tests (a Monte Carlo test and a compiled-vs-reference test).

Shared-factor PFP (:mod:`pyro2pfp.correlation`): ``register_activation`` registers the generic rule
(Stein's linear response, :func:`stein_shared`) as the op's float64 and ONNX rule, and
``backends/tvm/ops/activation.py`` its TE kernel; ReLU and LeakyReLU have a rule of their own, with a
second Hermite factor (:func:`relu_shared`; its kernel ``sf_relu`` computes the layer's mean-field
moments too).
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import moments
from ..correlation.factors import FactorPlan
from ..correlation.shared import Shared
from ..correlation.shared_algebra import SharedAlgebra, clip, grouped, normalised, own_columns, row_mean, safe_div
from ..correlation.stein import stein_slope
from ..planning.converters import Alias, register
from ..planning.correlated_pools import WindowCovariances
from ..planning.graph import Layer, Repr
from ..planning.plan import PlannedLayer
from ..planning.registry import (
    ACTIVATION,
    VARIANCE_IN_OUT,
    ActivationRule,
    FactorSpec,
    OpDef,
    register_op,
)
from ._formula import formula, shared_formula

_SQRT2PI = float(np.sqrt(2.0 * np.pi))


# ------------------------------------------------------------------ the generic shared-factor rule
def stein_shared(bk: Any, layer: PlannedLayer, x: Any, sh: Shared, rule: ActivationRule) -> Shared:
    """The generic shared-factor rule of an elementwise activation with :class:`ActivationRule` ``rule``:
    Stein's lemma ``lin = E[f'(a)]·s`` with ``E[f'(a)] = ∂E[f(a)]/∂μ`` (differentiate ``E[f(μ + σz)]``
    under the integral), the exact derivative of the rule's own mean moment by forward-mode AD
    (:func:`~pyro2pfp.correlation.stein.stein_slope`; exact for a Gaussian ``a`` up to the mean
    rule's own accuracy, in float32 too); no second-Hermite factor (``s`` keeps the linear response
    only), ``g`` unchanged.  A formula over ``bk`` (:mod:`pyro2pfp.correlation.shared_algebra`)."""
    slope = stein_slope(rule, x.mean, bk.variance(x), layer.layer.attrs, bk.ops)
    return Shared(slope * bk.reshape(sh.s, tuple(layer.layer.out_shape)), sh.g, sh.k)


def _stein_rule(rule: ActivationRule) -> Callable[..., Any]:
    """:func:`stein_shared` for ``rule`` as a shared-factor formula (registered by :func:`register_activation`),
    the profile clipped."""

    def stein(bk: Any, layer: PlannedLayer, inputs: list[Any], shared: list[Shared | None], fp: FactorPlan,
              var: Any) -> tuple[Shared | None, Any]:
        sh = shared[0]
        if sh is None:
            return None, var
        out = stein_shared(bk, layer, inputs[0], sh, rule)
        return Shared(clip(bk, out.s, var), out.g, out.k), var

    return stein


def register_activation(op: OpDef) -> OpDef:
    """Register an activation ``op`` (with its ``activation`` rule) and the rule as its NumPy reference
    and ONNX export: exact on a deterministic input, moment-matched (``rule.moments`` on the input's
    mean and variance, emitted in the representation the plan asks for) otherwise; and, unless
    ``rule.stein`` is False, the generic shared-factor rule (:func:`stein_shared`) for it."""
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
    if rule.stein:
        stein = _stein_rule(rule)
        stein.__name__ = f"{op.name}_stein"
        shared_formula(op.name)(stein)
    return op


RELU = register_activation(OpDef(
    "relu", ("aten.relu.default", "aten.relu_.default"),
    modules="`ReLU`", modules_short=("ReLU",),
    moments="exact for a Gaussian input", assumptions="input treated as Gaussian", contract=ACTIVATION,
    factor_spec=FactorSpec(hermite_block=True),
    activation=ActivationRule(
        exact=lambda x, attrs, ops: ops.maximum(x, ops.const(0.0)),
        moments=lambda mean, var, attrs, ops: moments.relu_moments(mean, var, ops),
        non_decreasing=lambda attrs: True, stein=False)))

LEAKY_RELU = register_activation(OpDef(
    "leaky_relu", ("aten.leaky_relu.default", "aten.leaky_relu_.default"),
    modules="`LeakyReLU(slope)`", modules_short=("LeakyReLU",),
    moments="exact (`Cov(a, relu a) = v·Φ(α)`, Stein's lemma)", assumptions="input treated as Gaussian",
    contract=ACTIVATION, example_attrs={"slope": 0.1}, factor_spec=FactorSpec(hermite_block=True),
    activation=ActivationRule(
        exact=lambda x, attrs, ops: ops.where(x > ops.const(0.0), x, ops.const(attrs["slope"]) * x),
        moments=lambda mean, var, attrs, ops: moments.leaky_relu_moments(mean, var, attrs["slope"], ops),
        non_decreasing=lambda attrs: attrs["slope"] >= 0, stein=False)))


@shared_formula("relu", "leaky_relu")
def relu_shared(bk: SharedAlgebra, layer: PlannedLayer, inputs: list[Any], shared: list[Shared | None], fp: FactorPlan,
                var: Any) -> tuple[Shared | None, Any]:
    """The relu / leaky_relu rule (slope ``λ``, 0 for relu), ``α = μ/σ``: Stein's lemma, exact for a
    Gaussian pre-activation jointly Gaussian with the factors: ``lin = Cov(f(a_p), η) = (Φ(α) +
    λ(1 − Φ(α)))·s_p``.  Second Hermite (Mehler) term: ``h = Cov(f(a_p), (η² − 1)/√2) = (1 −
    λ)·φ(α)/σ·s_p²/√2``, exact for a Gaussian ``a``; ``(η² − 1)/√2`` is uncorrelated with every ``ζ``,
    so it is a new factor of the channel (its correlation ``ρ²`` with other channels' Hermite terms is
    dropped: it is small next to the terms kept).  ``ℓ = m̄(lin)·g ⊕ m̄(h)·e_c``, ``s = (m̄(lin)·lin +
    m̄(h)·h)/‖ℓ‖``.  ``hermite='none'`` keeps ``lin`` only (fewer factor columns, less of the
    shared variance after each ReLU; ``benchmarks/fidelity.py --variants`` compares both with
    sampling).  The variance is not corrected."""
    x, sh = inputs[0], shared[0]
    if sh is None:
        return None, var
    ops = bk.ops
    slope = float(layer.layer.attrs.get("slope", 0.0))
    name, shape = layer.name, tuple(layer.layer.out_shape)
    rows, elements = fp.rows[name], int(np.prod(shape))
    m, v, s, var_out = (grouped(bk, t, rows, elements) for t in (x.mean, bk.variance(x), sh.s, var))
    sd = ops.sqrt(ops.maximum(v, ops.const(0.0)))
    positive = sd > ops.const(0.0)
    alpha = ops.minimum(ops.maximum(safe_div(bk, m, sd), ops.const(-40.0)), ops.const(40.0))
    cdf = ops.where(positive, ops.normal_cdfs(alpha)[0],
                    ops.where(m > ops.const(0.0), ops.const(1.0), ops.const(0.0)))
    lin = (cdf + ops.const(slope) * (ops.const(1.0) - cdf)) * s
    offset = fp.offsets.get(name)
    if offset is None:
        return Shared(bk.reshape(clip(bk, lin, var_out), shape), sh.g, sh.k), var
    k = fp.width[name]
    pdf = ops.exp(ops.const(-0.5) * alpha * alpha) * ops.const(1 / _SQRT2PI)
    h = safe_div(bk, ops.const(1.0 - slope) * pdf, sd) * s * s * ops.const(1 / math.sqrt(2))
    lbar, hbar = (row_mean(bk, t, rows, elements // rows) for t in (lin, h))
    loading = lbar * bk.widened(sh.g, sh.k, k) + hbar * own_columns(bk, rows, k, offset)
    g, norm = normalised(bk, loading, rows)
    s_out = safe_div(bk, lbar * lin + hbar * h, bk.reshape(norm, (rows, 1)))
    return Shared(bk.reshape(clip(bk, s_out, var_out), shape), g, k), var


def _scale_window_covariances(covs: WindowCovariances, layer: Layer) -> str | None:
    """The in-window covariances of ``c·b``: ``c²`` times ``b``'s (exact)."""
    inner = covs.build(layer.inputs[0])
    if inner is None:
        return covs.closure([layer.name], covs.what(layer.name))
    return covs.new(layer.op, [inner], covs.what(layer.name), {"factor": float(layer.attrs["factor"]) ** 2})


SCALE = register_activation(OpDef(
    "scale", ("aten.mul.Tensor", "aten.div.Tensor", "aten.neg.default"),
    modules="`x * c`, `x / c`, `-x` (a constant `c`, e.g. a temperature)", modules_short=("x * c",),
    moments="exact (linear: `μ ↦ c·μ`, `v ↦ c²·v`)", assumptions="—", contract=VARIANCE_IN_OUT,
    example_attrs={"factor": -0.5}, window_covariances=_scale_window_covariances,
    activation=ActivationRule(
        exact=lambda x, attrs, ops: ops.const(attrs["factor"]) * x,
        moments=lambda mean, var, attrs, ops: (ops.const(attrs["factor"]) * mean,
                                               ops.const(attrs["factor"] ** 2) * var),
        non_decreasing=lambda attrs: attrs["factor"] >= 0, stein=False)))  # its shared rule: ops/arithmetic.py


# ------------------------------------------------------------------ smooth and clipped activations
# The moment rules are in pyro2pfp.moments (their docstrings give the method, the sources and the
# accuracy against adaptive quadrature printed by benchmarks/activation_accuracy.py).
_QUADRATURE = ("numerical: delta series (v < 0.05), 16-node Gauss–Hermite (σ < 1.1) or tilted split "
               "Gauss–Laguerre, {acc} (`moments.{fn}`; `benchmarks/activation_accuracy.py`); for μ outside ±1000 the "
               "{limit} moments plus the density-expansion correction (`moments._far_corrections`, ≤ 1e-7 relative)")
_GAUSSIAN_INPUT = "input treated as Gaussian"

SIGMOID = register_activation(OpDef(
    "sigmoid", ("aten.sigmoid.default", "aten.sigmoid_.default"),
    modules="`Sigmoid` (hidden; a final one is stripped, see below the table)", modules_short=("Sigmoid",),
    moments=_QUADRATURE.format(acc="variance ≤ 1e-6 relative", fn="sigmoid_moments", limit="Heaviside"),
    assumptions=_GAUSSIAN_INPUT, contract=ACTIVATION,
    activation=ActivationRule(
        exact=lambda x, attrs, ops: moments.sigmoid_exact(x, ops),
        moments=lambda mean, var, attrs, ops: moments.sigmoid_moments(mean, var, ops),
        non_decreasing=lambda attrs: True)))

TANH = register_activation(OpDef(
    "tanh", ("aten.tanh.default", "aten.tanh_.default"),
    modules="`Tanh`", modules_short=("Tanh",),
    moments="the sigmoid rule via `tanh(x) = 2σ(2x) − 1`, variance ≤ 1.4e-6 relative (`moments.tanh_moments`; "
            "for μ outside ±500 the sign function's moments plus the correction)",
    assumptions=_GAUSSIAN_INPUT, contract=ACTIVATION,
    activation=ActivationRule(
        exact=lambda x, attrs, ops: moments.tanh_exact(x, ops),
        moments=lambda mean, var, attrs, ops: moments.tanh_moments(mean, var, ops),
        non_decreasing=lambda attrs: True)))

_GELU_TANH_K = math.sqrt(2.0 / math.pi)


def _gelu_exact(x: Any, attrs: dict[str, Any], ops: Any) -> Any:
    """``x·Φ(x)`` (``approximate='none'``) or torch's tanh form ``½x(1 + tanh(√(2/π)(x + 0.044715x³)))``."""
    if attrs.get("approximate", "none") == "tanh":
        inner = ops.const(_GELU_TANH_K) * (x + ops.const(0.044715) * x * x * x)
        return ops.const(0.5) * x * (ops.const(1.0) + moments.tanh_exact(inner, ops))
    return moments.gelu_exact(x, ops)


GELU = register_activation(OpDef(
    "gelu", ("aten.gelu.default", "aten.gelu_.default"),
    modules="`GELU()`, `GELU('tanh')`", modules_short=("GELU",),
    moments="exact for a Gaussian input (Stein's lemma + the bivariate normal CDF by 20-point Gauss–Legendre, "
            "`moments.gelu_moments`; arXiv 2403.16163)",
    assumptions=_GAUSSIAN_INPUT + "; `approximate='tanh'` uses the erf-GELU moments: the two functions differ "
                "by < 4.8e-4 absolute everywhere, so the mean is within 4.8e-4 and the variance within "
                "2·4.8e-4·sd + 4.8e-4² (its deterministic path is the tanh form)",
    contract=ACTIVATION, example_attrs={"approximate": "none"},
    activation=ActivationRule(
        exact=_gelu_exact,
        moments=lambda mean, var, attrs, ops: moments.gelu_moments(mean, var, ops))))

SILU = register_activation(OpDef(
    "silu", ("aten.silu.default", "aten.silu_.default"),
    modules="`SiLU` / Swish (`F.silu`)", modules_short=("SiLU",),
    moments=_QUADRATURE.format(acc="variance ≤ 1e-5 relative", fn="silu_moments", limit="ReLU"),
    assumptions=_GAUSSIAN_INPUT, contract=ACTIVATION,
    activation=ActivationRule(
        exact=lambda x, attrs, ops: moments.silu_exact(x, ops),
        moments=lambda mean, var, attrs, ops: moments.silu_moments(mean, var, ops))))


def _softplus_moments(mean: Any, var: Any, attrs: dict[str, Any], ops: Any) -> tuple[Any, Any]:
    """``softplus(βx)/β``: the softplus moments at ``(βμ, β²v)`` scaled by ``1/β``, ``1/β²`` (exact rescaling)."""
    beta = float(attrs.get("beta", 1.0))
    m, v = moments.softplus_moments(ops.const(beta) * mean, ops.const(beta * beta) * var, ops)
    return ops.const(1.0 / beta) * m, ops.const(1.0 / (beta * beta)) * v


SOFTPLUS = register_activation(OpDef(
    "softplus", ("aten.softplus.default",),
    modules="`Softplus(beta, threshold)`", modules_short=("Softplus",),
    moments=_QUADRATURE.format(acc="variance ≤ 5e-7 relative", fn="softplus_moments", limit="ReLU")
    + "; `beta`: `softplus(βx)/β` exactly",
    assumptions=_GAUSSIAN_INPUT + "; `threshold` ignored (torch's numerical cut to `x` where βx > threshold "
                "changes the function by < e^−threshold/β; thresholds below 10 are refused)",
    contract=ACTIVATION, example_attrs={"beta": 2.0},
    activation=ActivationRule(
        exact=lambda x, attrs, ops: ops.const(1.0 / attrs["beta"]) * moments.softplus_exact(
            ops.const(attrs["beta"]) * x, ops),
        moments=_softplus_moments, non_decreasing=lambda attrs: attrs["beta"] > 0)))

ELU = register_activation(OpDef(
    "elu", ("aten.elu.default", "aten.elu_.default"),
    modules="`ELU(alpha)` (α > 0)", modules_short=("ELU",),
    moments="exact for a Gaussian input (lognormal partial expectations + ReLU moments, `moments.elu_moments`)",
    assumptions=_GAUSSIAN_INPUT + "; `CELU`/`SELU` are not converted", contract=ACTIVATION,
    example_attrs={"alpha": 0.5},
    activation=ActivationRule(
        exact=lambda x, attrs, ops: moments.elu_exact(x, attrs["alpha"], ops),
        moments=lambda mean, var, attrs, ops: moments.elu_moments(mean, var, attrs["alpha"], ops),
        non_decreasing=lambda attrs: attrs["alpha"] >= 0)))

HARDTANH = register_activation(OpDef(
    "hardtanh", ("aten.hardtanh.default", "aten.hardtanh_.default", "aten.relu6.default", "aten.relu6_.default"),
    modules="`Hardtanh(min_val, max_val)`, `ReLU6`", modules_short=("Hardtanh", "ReLU6"),
    moments="exact for a Gaussian input (moments of a clipped Gaussian, `moments.hardtanh_moments`)",
    assumptions=_GAUSSIAN_INPUT, contract=ACTIVATION, example_attrs={"lo": -1.0, "hi": 2.0},
    activation=ActivationRule(
        exact=lambda x, attrs, ops: moments.hardtanh_exact(x, attrs["lo"], attrs["hi"], ops),
        moments=lambda mean, var, attrs, ops: moments.hardtanh_moments(mean, var, attrs["lo"], attrs["hi"], ops),
        non_decreasing=lambda attrs: attrs["lo"] <= attrs["hi"])))


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
def softmax_not_a_trailing_normalisation(node, ctx) -> Alias:
    """A softmax the walk meets was not stripped as the output's normalisation
    (:mod:`pyro2pfp.frontend.output_chain`): it is inside the network, or over another dimension than the classes."""
    if ctx.is_output(node):
        raise ctx.unsupported(node, f"the output is a softmax over dimension {node.args[1]}, not the last "
                                    "(class) dimension: it is not a normalisation of the logits, and PFP has no "
                                    "moment rule for it. Return the logits (or a softmax over the last dimension)")
    users = ", ".join(sorted(u.name for u in node.users))
    raise ctx.unsupported(node, f"softmax inside the network (its result feeds {users}) is not supported: "
                                "PFP has no Gaussian moment rule for it. Only a trailing normalisation of the "
                                "logits (softmax, log_softmax, exp of log_softmax, sigmoid, logsigmoid, constant "
                                "scalings, reshapes) is recognised, and stripped; move the softmax to the end, "
                                "or replace it by an activation PFP supports")


def _arg(node: Any, index: int, name: str, default: Any) -> Any:
    """Argument ``index`` (or keyword ``name``) of an aten call, ``default`` when absent."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _elementwise(node: Any, ctx: Any, op: str, attrs: dict[str, Any] | None = None) -> Layer:
    return Layer(name=ctx.new_name(node, prefer_module=False), op=op, inputs=[ctx.activation(node.args[0], node)],
                 out_shape=ctx.shape(node), source=ctx.source(node), attrs=attrs or {})


# Ops that only re-arrange (or copy) a tensor: a sigmoid followed only by these is still the output.
_VIEW_OPS = ("aten.view.", "aten.reshape.", "aten._unsafe_view.", "aten.squeeze", "aten.unsqueeze",
             "aten.flatten.", "aten.clone.", "aten.contiguous.", "aten.detach.", "aten.alias.")


def _is_final(node: Any, ctx: Any) -> bool:
    """Whether ``node`` is the model's output, or reaches it through reshapes/squeezes only."""
    while not ctx.is_output(node):
        users = list(node.users)
        if len(users) != 1 or not str(users[0].target).startswith(_VIEW_OPS):
            return False
        node = users[0]
    return True


@register("aten.sigmoid.default", "aten.sigmoid_.default", produces=("sigmoid",))
def convert_sigmoid(node, ctx) -> Layer | Alias:
    """A hidden sigmoid -> ``sigmoid``.  A sigmoid that *is* the output (possibly through reshapes/squeezes)
    gives probabilities for a ``Bernoulli(probs=…)`` likelihood: it is stripped with a warning, like a final
    softmax, so the network outputs the logit moments (``pyro2pfp.uncertainty`` gives the Bernoulli
    probabilities of a one-logit output) -- unless the model's likelihood is a Normal (then it is a
    regression onto (0, 1) and the sigmoid is kept as the activation)."""
    if _is_final(node, ctx) and not ctx.traced.regression():  # a Normal likelihood: a regression mean
        warnings.warn(f"{ctx.source(node)}: the final sigmoid is stripped (it gives the probabilities of a "
                      "Bernoulli likelihood); the PFP network outputs the (mean, variance) of the logit. Use "
                      "pyro2pfp.uncertainty() for the Bernoulli probabilities.", stacklevel=2)
        return Alias(node.args[0])
    return _elementwise(node, ctx, "sigmoid")


@register("aten.tanh.default", "aten.tanh_.default", produces=("tanh",))
def convert_tanh(node, ctx) -> Layer:
    return _elementwise(node, ctx, "tanh")


@register("aten.silu.default", "aten.silu_.default", produces=("silu",))
def convert_silu(node, ctx) -> Layer:
    return _elementwise(node, ctx, "silu")


@register("aten.gelu.default", "aten.gelu_.default", produces=("gelu",))
def convert_gelu(node, ctx) -> Layer:
    """``GELU(approximate=…)``: ``'none'`` (erf) or ``'tanh'`` (its moments: the erf rule, see the OpDef)."""
    approximate = str(_arg(node, 1, "approximate", "none"))
    if approximate not in ("none", "tanh"):
        raise ctx.unsupported(node, f"GELU with approximate={approximate!r} (expected 'none' or 'tanh')")
    return _elementwise(node, ctx, "gelu", {"approximate": approximate})


_SOFTPLUS_MIN_THRESHOLD = 10.0  # the cut then changes the function by < e^−10/β = 4.5e-5/β


@register("aten.softplus.default", produces=("softplus",))
def convert_softplus(node, ctx) -> Layer:
    """``Softplus(beta, threshold)`` -> ``softplus`` with ``beta`` (``threshold`` is a numerical cut, ignored)."""
    beta, threshold = _arg(node, 1, "beta", 1.0), _arg(node, 2, "threshold", 20.0)
    if isinstance(beta, bool) or not isinstance(beta, int | float) or not math.isfinite(beta) or beta <= 0:
        raise ctx.unsupported(node, f"Softplus needs a finite beta > 0, got {beta!r}")
    if not threshold >= _SOFTPLUS_MIN_THRESHOLD:
        raise ctx.unsupported(node, f"Softplus with threshold={threshold!r}: PFP uses the smooth softplus, which "
                                    f"differs from torch's cut by log1p(e^-threshold)/beta; supported for threshold "
                                    f">= {_SOFTPLUS_MIN_THRESHOLD:g} (torch's default is 20)")
    return _elementwise(node, ctx, "softplus", {"beta": float(beta)})


@register("aten.elu.default", "aten.elu_.default", produces=("elu",))
def convert_elu(node, ctx) -> Layer:
    """``ELU(alpha)`` with ``alpha > 0`` (``aten.elu``'s ``scale``/``input_scale`` must be 1: SELU/CELU are
    their own aten ops and are not converted)."""
    alpha = _arg(node, 1, "alpha", 1.0)
    scale, input_scale = _arg(node, 2, "scale", 1.0), _arg(node, 3, "input_scale", 1.0)
    if scale != 1 or input_scale != 1:
        raise ctx.unsupported(node, f"ELU with scale={scale}, input_scale={input_scale} (SELU-like) is not "
                                    "supported; only ELU(alpha)")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha) or alpha <= 0:
        raise ctx.unsupported(node, f"ELU needs a finite alpha > 0 (the moment rule assumes it), got {alpha!r}")
    return _elementwise(node, ctx, "elu", {"alpha": float(alpha)})


@register("aten.hardtanh.default", "aten.hardtanh_.default", "aten.relu6.default", "aten.relu6_.default",
          produces=("hardtanh",))
def convert_hardtanh(node, ctx) -> Layer:
    """``Hardtanh(min_val, max_val)`` and ``ReLU6`` (``aten.relu6`` or ``hardtanh(0, 6)``) -> ``hardtanh``."""
    if str(node.target).startswith("aten.relu6"):
        lo, hi = 0.0, 6.0
    else:
        lo, hi = _arg(node, 1, "min_val", -1.0), _arg(node, 2, "max_val", 1.0)
    if not all(isinstance(b, int | float) and not isinstance(b, bool) and math.isfinite(b) for b in (lo, hi)) \
            or not lo < hi:
        raise ctx.unsupported(node, f"Hardtanh needs finite min_val < max_val, got ({lo!r}, {hi!r})")
    return _elementwise(node, ctx, "hardtanh", {"lo": float(lo), "hi": float(hi)})
