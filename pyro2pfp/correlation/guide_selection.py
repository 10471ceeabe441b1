"""Which of a correlated guide's directions to carry as global factors: those that carry the most of the
logits' variance, measured.

A full-covariance guide's covariance is written as ``F·Fᵀ + diag`` with ``F`` its top directions
(:mod:`pyro2pfp.frontend.posterior.correlated`); carrying all of them costs a factor column each on every
edge, so at most ``keep`` are carried and the rest fold into the independent diagonal (every marginal
variance stays exact).  The covariance's own eigenvalues are the wrong order for that choice: on a trained
Tanh MLP the top 32 directions hold 97 % of the covariance's trace but the network with them has 19 % less
logit variance than sampling the guide (``benchmarks/correlated_guides.py``): many small directions that
the network amplifies add up coherently at the logits, and large ones that it ignores need not be carried.

So convert reads ``k`` candidate directions (the covariance's top ones, more than it carries), propagates
every candidate through the network's shared-factor reference (the guide's factors alone: the same float64
rules that carry them at run time, here at the weights' linearisation) on a few inputs, and measures each
direction's contribution to the logits' variance, ``c_f = Σ_{b,o} ℓ[b, o, f]²`` with ``ℓ[b, o, f]`` the
output ``o``'s loading on the factor (``s[o]·g[o, f]`` of :class:`~pyro2pfp.correlation.shared.Shared`; for a
dense output exactly the covariance of the logit with ``z_f`` given the closure).  The ``keep`` directions of
largest ``c_f`` are carried, the rest fold into the diagonal, and the plan states
``Σ_kept c_f / Σ_all c_f``: the share of the logits' variance (from the candidates' correlated part, to first
order) that the carried factors keep.  The inputs: standard normals of the input's shape (seeded), the
network's linearisation being what is compared, not the data's.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..planning.graph import GaussianParam, LayerGraph
from ..planning.plan import plan
from .execute import execute_shared_all
from .factors import CorrelationError, Hermite, plan_factors
from .shared import Shared

#: the number of (standard normal, seeded) inputs the contributions are measured at
SELECTION_INPUTS = 8


def logit_contributions(graph: LayerGraph, x: np.ndarray) -> np.ndarray | None:
    """``c_f`` (k,): every global factor's contribution to the output's variance, ``Σ_{b,o} ℓ[b, o, f]²``
    (module docstring), by the float64 shared-factor reference with the guide's factors alone at inputs ``x``;
    None where the network has no rule for them or its output no loading."""
    info = graph.guide_factors
    if info is None:
        return None
    planned = plan(graph)
    try:
        fp = plan_factors(planned, Hermite.NONE, guide=info.k, own_blocks=False)
    except CorrelationError:
        return None
    keep: dict[str, Shared | None] = {planned.output: None}
    execute_shared_all(planned, x, fp, keep=keep)
    sh = keep[planned.output]
    if sh is None:
        return None
    b, c = sh.g.shape[:2]
    s2 = (np.asarray(sh.s).reshape(b, c, -1) ** 2).sum(-1)  # (B, C): Σ over a channel's elements of s²
    return np.einsum("bc,bcf->f", s2, np.asarray(sh.g)[..., :info.k] ** 2)


def select_guide_directions(graph: LayerGraph) -> LayerGraph:
    """``graph`` with its correlated guide's factors cut to the ``keep`` candidates that carry the most of the
    logits' variance (module docstring), the rest folded into the independent variance, and its
    :class:`~pyro2pfp.planning.graph.GuideFactorInfo` stating that share; where nothing can be measured (a
    network without the shared-factor rules, extra inputs), the first ``keep`` (the covariance's top ones) and
    the covariance share read with them.  Returns ``graph`` (changed in place) for chaining."""
    info = graph.guide_factors
    if info is None or not info.keep or info.keep >= info.k:
        return graph
    try:
        x = np.random.default_rng(0).standard_normal((SELECTION_INPUTS, *graph.input_shape))
        contribution = logit_contributions(graph, x)
    except CorrelationError:
        contribution = None
    if contribution is None or not np.all(np.isfinite(contribution)) or contribution.sum() <= 0:
        chosen = np.arange(info.keep)
        graph.guide_factors = dataclasses.replace(info, k=info.keep)
    else:
        chosen = np.sort(np.argsort(-contribution, kind="stable")[:info.keep])
        share = float(contribution[chosen].sum() / contribution.sum())
        graph.guide_factors = dataclasses.replace(info, k=info.keep, kept=share, at_logits=True, measured=info.k)
    for layer in graph.layers:
        layer.params = {name: _cut(p, chosen) for name, p in layer.params.items()}
    return graph


def _cut(p: GaussianParam, chosen: np.ndarray) -> GaussianParam:
    """``p`` with its loadings on the ``chosen`` factors only (the rest of its variance independent)."""
    return p if p.factors is None else dataclasses.replace(p, factors=p.factors[..., chosen])
