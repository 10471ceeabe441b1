"""Prediction-time cost model of shared-factor PFP (multiply-adds and stored floats per input, beside
mean-field PFP's), for ``benchmarks/fidelity.py --cost``."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import PFPError
from ..planning.graph import INPUT, Repr
from ..planning.plan import PlannedGraph, is_compute_layer
from ..planning.registry import OPS
from .compact import CompactPlan, compact_macs, edge_columns
from .factors import CorrelationError, FactorPlan, _noisy_ancestry, plan_factors


@dataclass(frozen=True)
class Cost:
    """Per-input multiply-adds and stored floats of mean-field PFP and of the scheme's additions
    (:func:`cost_model`)."""

    mean_field_macs: int
    extra_macs: int
    mean_field_floats: int  # μ and second moment of every edge
    extra_floats: int  # s and g of every edge
    max_factors: int  # the largest K of any edge

    def summary(self) -> str:
        total = self.mean_field_macs + self.extra_macs
        return (f"multiply-adds: mean-field {self.mean_field_macs / 1e6:.1f} M, shared factors "
                f"+{self.extra_macs / 1e6:.1f} M (x{total / self.mean_field_macs:.2f}); floats per input over all "
                f"edges: mean-field {self.mean_field_floats / 1e3:.1f} k, +{self.extra_floats / 1e3:.1f} k; "
                f"K ≤ {self.max_factors}")


def cost_model(graph: PlannedGraph, factors: FactorPlan | CompactPlan | None = None) -> Cost:
    """Count the work of one input (module docstring rules). Mean-field: every dense/conv layer is 3 products of its
    size (mean, weight-variance term, mean-weight² term; 2 for a deterministic input); elementwise ops count
    their elements. The scheme adds, per conv layer, the profile convolutions as the compiled kernel computes
    them (``sf_conv_profile``): one with per-input weights on the input's profile ``s_in`` if the input has a
    shared part (the propagated term ``W·β`` and the regression term ``coef·V·m̄s`` on the same input merged
    into one weight) and, for ``injection='regression'``, one on the input mean (``coef·V·m̄μ``;
    ``'rescaled'`` reuses the mean-field weight-variance term instead: its root's spatial mean and the
    scaled root, ``2·O·P``); ``O·C·(K_in + K_out)`` for the loadings and ``2·|W|`` for the per-input
    weights (``|W|``, the propagated term's alone, for ``'rescaled'``); per dense layer two products of
    its size and ``O·C·K``; per ReLU/add ``~3·C·K``; per compaction ``2·C²·K``.  A compute layer's part is
    its op's ``FactorSpec.cost`` (``ops/compute_cost.py``).
    ``factors``: default ``graph.factors``, else :func:`plan_factors` of ``graph``.  For a compact factor plan
    (:class:`~.compact.CompactPlan`) the scheme's multiply-adds are :func:`~.compact.compact_macs`' count and
    its stored floats the columns of every edge that carries loadings (elements times columns)."""
    fp = factors if factors is not None else graph.factors if graph.factors is not None else plan_factors(graph)
    if isinstance(fp, CompactPlan):
        return _compact_cost(graph, fp)
    if not isinstance(fp, FactorPlan):  # another scheme's plan: the shared-factor plan of the same graph is costed
        fp = plan_factors(graph)
    mf, mf_floats = _mean_field_cost(graph)
    extra = extra_floats = 0
    for layer in graph.layers:
        n_out = int(np.prod(layer.layer.out_shape))
        k_in = max((fp.width.get(n, 0) for n in layer.inputs), default=0)
        k = fp.width[layer.name]
        rows = fp.rows[layer.name]
        if k:
            extra_floats += n_out + rows * k
        if is_compute_layer(layer.op):
            cost = OPS[layer.op].factor_spec.cost
            if cost is None:
                raise PFPError(f"{layer.layer.source}: op '{layer.op}' has no cost model (FactorSpec.cost)")
            if not k:
                continue
            extra += cost(layer, fp, k_in)[1]
        elif k:
            extra += 10 * n_out + 3 * rows * k
        if layer.name in fp.compact_at:
            extra += 2 * rows * rows * k
    return Cost(mf, extra, mf_floats, extra_floats, max(fp.width.values(), default=0))


def _mean_field_cost(graph: PlannedGraph) -> tuple[int, int]:
    """The mean-field multiply-adds and stored floats per input (:func:`cost_model`'s rules: every compute layer
    its output positions that share weights times its size, 3 products -- 2 for a deterministic input; every
    other layer its elements; two floats per element)."""
    mf = floats = 0
    for layer in graph.layers:
        n_out = int(np.prod(layer.layer.out_shape))
        floats += 2 * n_out
        if is_compute_layer(layer.op):
            size = int(layer.tensors["weight_mean"].size)
            positions = int(np.prod(layer.layer.out_shape[1:])) if OPS[layer.op].positions_share_weights else 1
            det_in = layer.inputs[0] == INPUT and graph.input_repr is Repr.DETERMINISTIC
            mf += positions * size * (2 if det_in else 3)
        else:
            mf += n_out
    return mf, floats


def _compact_cost(graph: PlannedGraph, cp: CompactPlan) -> Cost:
    """:func:`cost_model` of a compact factor plan."""
    mf, mf_floats = _mean_field_cost(graph)
    columns = edge_columns(graph, cp)
    extra_floats = sum(int(np.prod(graph.shape_of(name))) * per_element for name, (_, per_element) in columns.items())
    return Cost(mf, compact_macs(graph, cp), mf_floats, extra_floats,
                max((factors for factors, _ in columns.values()), default=0))


def dense_head_caveat(graph: PlannedGraph) -> str | None:
    """What a user should know when ``correlation="auto"`` keeps a mean-field plan although a dense layer
    sums the positions of conv channels (conv → … → flatten → dense, LeNet-style): a conv weight's noise
    is shared by every position of its channel, mean-field PFP drops that correlation, and the dense
    layer's variance (and the logits') is then under-stated by an amount that depends on the posterior's
    width -- small for narrow posteriors (``benchmarks/fidelity.py``), about a fifth of the logit
    variance for the trained LeNet-5 of ``examples/mnist_pfp.py`` (its ``check=`` prints the ratio).
    None when no dense layer reads a conv's noise.  The message gives the shared-factor plan's cost for
    this network (:func:`cost_model`), the scheme that keeps the correlation."""
    noisy = _noisy_ancestry(graph)
    dense = next((layer for layer in graph.layers
                  if layer.op in OPS and OPS[layer.op].sums_elements and noisy[layer.inputs[0]]), None)
    if dense is None:
        return None
    try:
        cost = cost_model(graph, plan_factors(graph))
        total = cost.mean_field_macs + cost.extra_macs
        scheme = (f"correlation='shared-factor' keeps it at {total / cost.mean_field_macs:.1f}x the multiply-adds "
                  f"({cost.mean_field_macs / 1e6:.2f} M -> {total / 1e6:.2f} M per input)")
    except CorrelationError as exc:
        scheme = f"correlation='shared-factor' would keep it but is not available here ({exc})"
    return (f"{dense.layer.source}: correlation='auto' chose mean-field, but '{dense.name}' sums positions of conv "
            "channels that share their weights' noise, which mean-field PFP takes as independent: the output "
            "variance may be under-stated (by about a fifth for the trained LeNet-5 of examples/mnist_pfp.py). "
            f"convert(..., check=x) measures it on your inputs; {scheme}; correlation='mean-field' accepts it "
            "without this warning")

