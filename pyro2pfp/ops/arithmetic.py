"""Linear elementwise ops: the per-channel ``affine`` map (eval-mode batch norm) and the residual ``add``.

* ``affine``: ``μ ↦ a·μ + c``, ``v ↦ a²·v`` per channel (channel axis 1), exact (``docs/math.md``
  "Linear layers"); ``a = γ/√(running_var + ε)``, ``c = β − a·running_mean``.
* ``add``: the sum of two activations, ``μ = μa + μb``, ``v = va + vb`` -- exact for independent
  summands (the branches of a residual block share their input, so their covariance is dropped).

Shared-factor PFP (:mod:`pyro2pfp.correlation`): the rules of ``affine``, ``add`` and ``scale`` (a constant
factor, registered in ``ops/activation.py``: the same rule as ``affine``), each one formula for the float64
reference and the ONNX export, are at the end of this file, their TE kernels in ``backends/tvm/ops/arithmetic.py``.

The TVM kernels and schedules are in ``backends/tvm/ops/arithmetic.py``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..correlation.factors import FactorPlan
from ..correlation.loadings import CompactPlan, Loadings, TensorAlgebra
from ..correlation.shared import Shared
from ..correlation.shared_algebra import SharedAlgebra, clip, grouped, normalised, row_mean
from ..planning.converters import Alias, register
from ..planning.correlated_pools import WindowCovariances
from ..planning.graph import GaussianParam, Layer, Repr
from ..planning.plan import PlannedGraph, PlannedLayer, is_compute_layer
from ..planning.registry import CompactSpec, FactorSpec, OpDef, register_op
from ._formula import compact_formula, formula, shared_formula


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


@shared_formula("affine", "scale")
def linear_shared(bk: SharedAlgebra, layer: PlannedLayer, inputs: list[Any], shared: list[Shared | None],
                  fp: FactorPlan, var: Any) -> tuple[Shared | None, Any]:
    """The affine (BatchNorm eval, scale ``a`` per channel) and scale (a constant ``a``) rule: ``s ↦ a·s``;
    ``g`` unchanged (exact)."""
    sh = shared[0]
    if sh is None:
        return None, var
    shape = tuple(layer.layer.out_shape)
    rows, elements = fp.rows[layer.name], int(np.prod(shape))
    s = grouped(bk, sh.s, rows, elements) * bk.tensor(linear_factor(layer).reshape(-1, 1), "scale")
    s = clip(bk, s, grouped(bk, var, rows, elements))
    return Shared(bk.reshape(s, shape), sh.g, sh.k), var


@shared_formula("add")
def add_shared(bk: SharedAlgebra, layer: PlannedLayer, inputs: list[Any], shared: list[Shared | None], fp: FactorPlan,
               var: Any) -> tuple[Shared | None, Any]:
    """The add (residual) rule: ``ℓ = m̄ s_a·g_a + m̄ s_b·g_b`` -- branches that share upstream factors
    (both functions of the block input) add coherently; ``g = ℓ/‖ℓ‖``, ``s = s_a·⟨g_a, g⟩ +
    s_b·⟨g_b, g⟩``; ``v = v_a + v_b + 2·s_a·s_b·⟨g_a, g_b⟩`` (the branch covariance; exact in a linear
    Gaussian net).  A branch without a shared part leaves the other's."""
    sa, sb = shared
    if sa is None or sb is None:
        return (sa if sb is None else sb), var  # nothing to combine
    ops = bk.ops
    shape = tuple(layer.layer.out_shape)
    k, rows, elements = fp.width[layer.name], fp.rows[layer.name], int(np.prod(shape))
    a_s, b_s, v = (grouped(bk, t, rows, elements) for t in (sa.s, sb.s, var))
    ga, gb = bk.widened(sa.g, sa.k, k), bk.widened(sb.g, sb.k, k)
    abar, bbar = (row_mean(bk, t, rows, elements // rows) for t in (a_s, b_s))
    g, _ = normalised(bk, abar * ga + bbar * gb, rows)
    dot, pa, pb = (bk.reshape(bk.rsum(p * q, 2), (rows, 1)) for p, q in ((ga, gb), (ga, g), (gb, g)))
    var_new = ops.maximum(v + ops.const(2.0) * a_s * b_s * dot, ops.const(0.0))
    s = clip(bk, a_s * pa + b_s * pb, var_new)
    return Shared(bk.reshape(s, shape), g, k), bk.reshape(var_new, shape)


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
