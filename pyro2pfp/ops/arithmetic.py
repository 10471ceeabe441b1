"""Linear elementwise ops: the per-channel ``affine`` map (eval-mode batch norm) and the residual ``add``.

* ``affine``: ``μ ↦ a·μ + c``, ``v ↦ a²·v`` per channel (channel axis 1), exact (``docs/math.md``
  "Linear layers"); ``a = γ/√(running_var + ε)``, ``c = β − a·running_mean``.
* ``add``: the sum of two activations, ``μ = μa + μb``, ``v = va + vb`` -- exact for independent
  summands (the branches of a residual block share their input, so their covariance is dropped).

Shared-factor PFP (:mod:`pyro2pfp.correlation`): the float64 and ONNX rules of ``affine``, ``add``
and ``scale`` (a constant factor, registered in ``ops/activation.py``: the same rule as ``affine``)
are at the end of this file, their TE kernels in ``backends/tvm/ops/arithmetic.py``.

The TVM kernels and schedules are in ``backends/tvm/ops/arithmetic.py``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backends.onnx.builder import OnnxActivation, OnnxContext
from ..backends.reference import Activation
from ..correlation.factors import FactorPlan
from ..correlation.loadings import CompactPlan, Loadings, TensorAlgebra
from ..correlation.onnx_step import OnnxShared, OnnxSharedStep
from ..correlation.shared import Shared, expand, normalised, row_dots, spatial_mean
from ..planning.converters import Alias, register
from ..planning.correlated_pools import WindowCovariances
from ..planning.graph import GaussianParam, Layer, Repr
from ..planning.plan import PlannedGraph, PlannedLayer, is_compute_layer
from ..planning.registry import CompactSpec, FactorSpec, OpDef, register_op, shared_exporter, shared_reference
from ._formula import compact_formula, formula


def _affine_window_covariances(covs: WindowCovariances, layer: Layer) -> str | None:
    """The in-window covariances of ``γ·b + β`` (an eval-mode BatchNorm): ``γ²`` times ``b``'s (exact)."""
    inner = covs.build(layer.inputs[0])
    if inner is None:
        return covs.closure([layer.name], covs.what(layer.name))
    scale = layer.params["scale"].mean ** 2
    return covs.new(layer.op, [inner], covs.what(layer.name), params={
        "scale": GaussianParam(scale, np.zeros_like(scale)),
        "shift": GaussianParam(np.zeros_like(scale), np.zeros_like(scale))})


def _add_window_covariances(covs: WindowCovariances, layer: Layer) -> str | None:
    """The in-window covariances of ``b + c`` (a residual add): the sum of ``b``'s and ``c``'s, and in a
    shared-factor plan the branches' covariance through their shared factors (``window_closure``); a
    branch without them makes the result partial."""
    parts = [covs.build(n) for n in layer.inputs]
    covs.partial = covs.partial or any(p is None for p in parts)
    parts.append(covs.closure(list(layer.inputs), f"covariance of the branches of {layer.name}"))
    present = [p for p in parts if p is not None]
    total = present[0] if present else None
    for part in present[1:]:
        assert total is not None
        total = covs.new(layer.op, [total, part], covs.what(layer.name))
    return total


AFFINE = register_op(OpDef(
    "affine", ("aten.batch_norm.default", "aten._native_batch_norm_legit_no_training.default"),
    modules="`BatchNorm1d/2d` in eval mode (folded into the Linear/Conv before it, `pyro2pfp.planning.folding`)",
    modules_short=("BatchNorm1d/2d (eval)",), moments="exact (linear)",
    assumptions="deterministic normalisation parameters", elementwise=True, compact_spec=CompactSpec(keeps_units=True),
    non_decreasing=lambda layer: bool(np.all(layer.params["scale"].mean >= 0)),
    window_covariances=_affine_window_covariances,
    # deterministic per-channel scale and shift
    stored_tensors=lambda layer, input_repr, calibration: {"scale": layer.params["scale"].mean,
                                                           "shift": layer.params["shift"].mean}))

ADD = register_op(OpDef(
    "add", ("aten.add.Tensor", "aten.add_.Tensor"),
    modules="`x + y` (residual; `h + b` after a bias-free dense/conv is its bias)", modules_short=("residual '+'",),
    moments="exact for independent summands",
    assumptions="**the two branches are treated as independent** (they share their input, so this "
                "underestimates or overestimates the variance by their covariance)", elementwise=True,
    window_covariances=_add_window_covariances,
    factor_spec=FactorSpec(mean_field_wrong=lambda layer, graph, conv_noise: _adds_shared_branches(layer, graph))))


def _adds_shared_branches(layer: PlannedLayer, graph: PlannedGraph) -> str | None:
    """Why mean-field PFP is wrong for an add (None: it is fine): it adds two random branches, which share
    their input."""
    if sum(graph.repr_of(n) is not Repr.DETERMINISTIC for n in layer.inputs) == 2:
        return f"{layer.layer.source} adds two branches that share their input"
    return None


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
    if producer is None or not is_compute_layer(producer.op) or "bias" in producer.params \
            or len(activation.users) != 1:
        raise ctx.unsupported(node, "adding a parameter to an activation is supported only as the bias of the "
                                    "bias-free dense/conv layer that computes it (x @ W + b)")
    bias = ctx.param(bias_arg, node, "bias")
    channels = producer.out_shape[0]
    per_channel = (channels,) + (1,) * (len(producer.out_shape) - 1)  # (M,) for dense, (C, 1, 1) for conv
    shape = bias.shape
    while len(shape) > len(per_channel) and shape[0] == 1:  # b.unsqueeze(0), b.view(1, -1, 1, 1): over the batch
        shape = shape[1:]
    if shape != per_channel:
        raise ctx.unsupported(node, f"a bias of shape {bias.shape} added to a {producer.op} output of shape "
                                    f"(batch, {', '.join(map(str, producer.out_shape))}); expected {per_channel}")
    producer.params["bias"] = bias.mapped(lambda a: a.reshape(channels))
    return Alias(activation)


# ------------------------------------------------------------------------------------ shared-factor rules
def linear_factor(layer: PlannedLayer) -> np.ndarray:
    """The per-row factor of a linear elementwise layer: an affine layer's per-channel ``scale``, a
    scale layer's constant ``factor`` (as a one-element array)."""
    return layer.tensors["scale"] if "scale" in layer.tensors else np.array([layer.layer.attrs["factor"]])


@shared_reference("affine", "scale")
def linear_shared(layer: PlannedLayer, inputs: list[Activation], shared: list[Shared | None], fp: FactorPlan,
                  var: np.ndarray) -> tuple[Shared | None, np.ndarray]:
    """The affine (BatchNorm eval, scale ``a`` per channel) and scale (a constant ``a``) rule: ``s ↦ a·s``;
    ``g`` unchanged (exact)."""
    sh = shared[0]
    if sh is None:
        return None, var
    factor = linear_factor(layer)
    shape = sh.s.shape
    rows = sh.g.shape[1]
    s = sh.s.reshape(shape[0], rows, -1) * factor.reshape(1, -1, 1)
    return Shared(s.reshape(shape), sh.g), var


@shared_reference("add")
def add_shared(layer: PlannedLayer, inputs: list[Activation], shared: list[Shared | None], fp: FactorPlan,
               var: np.ndarray) -> tuple[Shared | None, np.ndarray]:
    """The add (residual) rule: ``ℓ = m̄ s_a·g_a + m̄ s_b·g_b`` -- branches that share upstream factors
    (both functions of the block input) add coherently; ``g = ℓ/‖ℓ‖``, ``s = s_a·⟨g_a, g⟩ +
    s_b·⟨g_b, g⟩``; ``v = v_a + v_b + 2·s_a·s_b·⟨g_a, g_b⟩`` (the branch covariance; exact in a linear
    Gaussian net).  A branch without a shared part leaves the other's."""
    sa, sb = shared
    if sa is None or sb is None:
        return (sa if sb is None else sb), np.maximum(var + 0.0, 0.0)
    shape = inputs[0].mean.shape
    k = fp.width[layer.name]
    a_s, b_s = sa.s.reshape(shape), sb.s.reshape(shape)
    ka, kb = sa.g.shape[2], sb.g.shape[2]  # the columns beyond an edge's own are zero: not materialised
    cross = 2.0 * a_s * b_s * expand(row_dots(sa.g[..., :kb], sb.g[..., :ka]), len(shape))
    loading = np.zeros((*sa.g.shape[:2], k))
    loading[..., :ka] = spatial_mean(a_s)[..., None] * sa.g
    loading[..., :kb] += spatial_mean(b_s)[..., None] * sb.g
    norm, g = normalised(loading)
    s = a_s * expand(row_dots(sa.g, g[..., :ka]), len(shape)) + b_s * expand(row_dots(sb.g, g[..., :kb]), len(shape))
    return Shared(s, g), np.maximum(var + cross, 0.0)


@shared_exporter("affine", "scale")
def linear_shared_onnx(step: OnnxSharedStep, ctx: OnnxContext, layer: PlannedLayer, inputs: list[OnnxActivation],
                       shared: list[OnnxShared | None], out: OnnxActivation
                       ) -> tuple[OnnxShared | None, OnnxActivation]:
    """:func:`linear_shared` in ONNX."""
    sh = shared[0]
    if sh is None:
        return None, out
    s = step.grouped(sh.s, layer.name) * step.t(linear_factor(layer).reshape(-1, 1), "scale")
    s = step.clip(s, step.grouped(step.var(out), layer.name))
    return OnnxShared(step.view_as(s, *ctx.shapes[layer.name]), sh.g, sh.k), out


@shared_exporter("add")
def add_shared_onnx(step: OnnxSharedStep, ctx: OnnxContext, layer: PlannedLayer, inputs: list[OnnxActivation],
                    shared: list[OnnxShared | None], out: OnnxActivation) -> tuple[OnnxShared | None, OnnxActivation]:
    """:func:`add_shared` in ONNX."""
    sa, sb = shared
    if sa is None or sb is None:
        return (sa if sb is None else sb), out  # one branch without a shared part: nothing to combine
    name = layer.name
    k = step.fp.width[name]
    a_s, b_s, var = (step.grouped(t, name) for t in (sa.s, sb.s, step.var(out)))
    ga, gb = step.widened(sa.g, sa.k, k), step.widened(sb.g, sb.k, k)
    group = int(np.prod(step.ctx.shapes[name])) // step.fp.rows[name]
    abar, bbar = (step.rsum(t, [2]) * step.c(1.0 / group) for t in (a_s, b_s))
    g, _ = step.normalise(abar * ga + bbar * gb)
    dot, pa, pb = (step.rsum(p * q, [2]) for p, q in ((ga, gb), (ga, g), (gb, g)))
    var_new = (var + step.c(2.0) * a_s * b_s * dot).nary("Max", step.c(0.0))
    s = step.clip(a_s * pa + b_s * pb, var_new)
    shape = step.ctx.shapes[name]
    out = OnnxActivation(out.mean, step.view_as(var_new, *shape), out.repr)
    return OnnxShared(step.view_as(s, *shape), g, k), out


# ------------------------------------------------------------------------------------ compact factor rules
@compact_formula("affine")
def affine_compact(bk: TensorAlgebra, layer: PlannedLayer, inputs: list[Any], loads: list[Loadings | None],
                   plan: CompactPlan, mean: Any, var: Any) -> tuple[Any, Any, Any]:
    """Per-channel ``a·x + c`` in the compact factor plan: ``L ↦ a·L`` (exact)."""
    ld = loads[0]
    if ld is None:
        return None, mean, var
    shape = tuple(layer.layer.out_shape)
    scale = np.broadcast_to(layer.tensors["scale"].reshape((-1,) + (1,) * (len(shape) - 1)), shape)
    return ld.times(bk, np.ascontiguousarray(scale).reshape(-1), int(np.prod(shape))), mean, var


@compact_formula("add")
def add_compact(bk: TensorAlgebra, layer: PlannedLayer, inputs: list[Any], loads: list[Loadings | None],
                plan: CompactPlan, mean: Any, var: Any) -> tuple[Any, Any, Any]:
    """``a + b`` in the compact factor plan: the loadings add (branches carrying the same factors add them
    coherently); ``v = v_a + v_b + 2·Σ_f L_a,f·L_b,f`` (exact for the factors' part; the residuals stay
    independent)."""
    la, lb = (ld if ld is not None else Loadings() for ld in loads)
    shape = tuple(layer.layer.out_shape)
    e = int(np.prod(shape))
    cross = [bk.rsum(la.glob[key] * lb.glob[key], 2) for key in sorted(la.glob.keys() & lb.glob.keys())]
    cross += [bk.reshape(bk.rsum(la.block[key] * lb.block[key], 3), (e,))
              for key in sorted(la.block.keys() & lb.block.keys())]
    merged = la.merged(lb)
    if cross:
        total = cross[0]
        for part in cross[1:]:
            total = total + part
        var = bk.ops.maximum(var + bk.ops.const(2.0) * bk.reshape(total, shape), bk.ops.const(0.0))
    return (None if merged.empty() else merged), mean, var
