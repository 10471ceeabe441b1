"""Prediction-time cost model of shared-factor PFP (multiply-adds and stored floats per input, beside
mean-field PFP's), for ``benchmarks/fidelity.py --cost``."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..planning.graph import INPUT, Repr
from ..planning.plan import PlannedGraph, PlannedLayer, is_compute_layer
from .factors import FactorPlan, plan_factors


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


def cost_model(graph: PlannedGraph, factors: FactorPlan | None = None) -> Cost:
    """Count the work of one input (module docstring rules). Mean-field: every dense/conv layer is 3 products of its
    size (mean, weight-variance term, mean-weight² term; 2 for a deterministic input); elementwise ops count
    their elements. The scheme adds, per conv layer, the profile convolutions as the compiled kernel computes
    them (``sf_conv_profile``): one with per-input weights on the input's profile ``s_in`` if the input has a
    shared part (the propagated term ``W·β`` and the regression term ``coef·V·m̄s`` on the same input merged
    into one weight) and, for ``injection='regression'``, one on the input mean (``coef·V·m̄μ``;
    ``'rescaled'`` reuses the mean-field weight-variance term instead: its root's spatial mean and the
    scaled root, ``2·O·P``); ``O·C·(K_in + K_out)`` for the loadings and ``2·|W|`` for the per-input
    weights (``|W|``, the propagated term's alone, for ``'rescaled'``); per dense layer two products of
    its size and ``O·C·K``; per ReLU/add ``~3·C·K``; per compaction ``2·C²·K``.
    ``factors``: default ``graph.factors``, else :func:`plan_factors` of ``graph``."""
    fp = factors if factors is not None else graph.factors if graph.factors is not None else plan_factors(graph)
    injection = fp.injection
    mf = extra = mf_floats = extra_floats = 0
    for layer in graph.layers:
        shape = layer.layer.out_shape
        n_out = int(np.prod(shape))
        ins = layer.inputs
        det_in = ins[0] == INPUT and graph.input_repr is Repr.DETERMINISTIC
        mf_floats += 2 * n_out
        k_in = max((fp.width.get(n, 0) for n in ins), default=0)
        k = fp.width[layer.name]
        rows = fp.rows[layer.name]
        if k:
            extra_floats += n_out + rows * k
        if is_compute_layer(layer.op):
            wm = layer.tensors["weight_mean"]
            o, size = wm.shape[0], int(wm.size)
            positions = int(np.prod(shape[1:])) if layer.op == "conv2d" else 1
            macs = positions * size
            mf += macs * (2 if det_in else 3)
            if not k:
                continue
            extra += guide_macs(layer, fp, k_in, macs, size)
            c_in = wm.shape[1] if layer.op == "conv2d" else fp.rows.get(ins[0], 1)
            if layer.op == "conv2d":
                noisy = layer.name in fp.offsets
                if injection == "regression" or not noisy:
                    extra += (macs if k_in else 0) + (macs if noisy else 0) + o * c_in * (k_in + k) + 2 * size
                else:  # rescaled: the propagated term's weights only, the root's mean and the scaled root
                    extra += (macs + size if k_in else 0) + o * c_in * (k_in + k) + 2 * n_out
            else:
                extra += (2 * macs + o * c_in * k_in if k_in else 0) + o * k
        else:
            mf += n_out
            if k:
                extra += 10 * n_out + 3 * rows * k
        if layer.name in fp.compact_at:
            extra += 2 * rows * rows * k
    return Cost(mf, extra, mf_floats, extra_floats, max(fp.width.values(), default=0))


def dense_head_caveat(graph: PlannedGraph) -> str | None:
    """What a user should know when ``correlation="auto"`` keeps a mean-field plan although a dense layer
    sums the positions of conv channels (conv → … → flatten → dense, LeNet-style): a conv weight's noise
    is shared by every position of its channel, mean-field PFP drops that correlation, and the dense
    layer's variance (and the logits') is then under-stated by an amount that depends on the posterior's
    width -- small for narrow posteriors (``benchmarks/fidelity.py``), about a fifth of the logit
    variance for the trained LeNet-5 of ``examples/mnist_pfp.py`` (its ``check=`` prints the ratio).
    None when no dense layer reads a conv's noise.  The message gives the shared-factor plan's cost for
    this network (:func:`cost_model`), the scheme that keeps the correlation."""
    from .factors import CorrelationError, _noisy_ancestry

    noisy = _noisy_ancestry(graph)
    dense = next((layer for layer in graph.layers if layer.op == "dense" and noisy[layer.inputs[0]]), None)
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


def guide_macs(layer: PlannedLayer, fp: FactorPlan, k_in: int, macs: int, size: int) -> int:
    """The multiply-adds a compute layer spends on a correlated guide's factors (:mod:`.guide`): dense --
    the injection ``F·μ`` (``|W|·k``), the mean shift ``Σ F·ℓ_in`` (``|W|·k``) and the product's variance
    ``2‖sym A‖²`` (``|W|·k²``), both with an input that loads on them, and the mean-field part removed from
    the variance (``|W|``); conv2d -- the pooled injection
    and the per-input filter ``G = Σ_f g·F_f`` (``2·|W|·k``), the profile ``conv(μ, G)`` (one
    convolution) and the mean shift (one convolution and ``|W|·k``)."""
    wf = layer.tensors.get("weight_factors") if getattr(fp, "guide", 0) else None
    if wf is None:
        return 0
    guide = int(wf.shape[-1])
    has_in = k_in > 0
    if layer.op == "dense":
        return size * guide * ((2 + guide) if has_in else 1) + size
    return 2 * size * guide + macs + ((macs + size * guide) if has_in else 0)
