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
rules that carry them at run time) on a few inputs, and collects every logit's loading on every candidate,
``ℓ[(b, o), f]`` (``s[o]·g[o, f]`` of :class:`~pyro2pfp.correlation.shared.Shared`; for a dense output
exactly the covariance of the logit with ``z_f`` given the closure).  The rules are linear in the factor
columns, so an orthonormal combination ``F·Q`` of the candidates has loadings ``ℓ·Q``, and the ``keep``
combinations that carry the most of ``Σ ‖ℓ·Q‖²`` are the top right singular vectors of ``ℓ`` (Eckart–Young):
the top directions of the guide's covariance weighted by the logits' sensitivity (the generalized
eigenproblem of ``F·Fᵀ`` and the logits' Jacobian Gram, within the candidates' span).  Those are carried,
the rest of the candidates' covariance, ``F·(I − Q·Qᵀ)·Fᵀ``, folds into the diagonal, and the plan states
``Σ_{j ≤ keep} σ_j² / Σ_j σ_j²`` (σ the singular values of ``ℓ``): the share of the logits' variance due to
the candidates (to first order in the factors) that the carried factors keep.  The inputs: the user's
example inputs where given, topped up with normals of their mean and sd (:func:`selection_inputs`), enough
of them for several logits per carried factor.  Convolutions loading the guide's factors keep the covariance's
top directions (their rules hold guide × guide terms per output position: too large with every candidate).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..planning.graph import GaussianParam, LayerGraph
from ..planning.plan import plan
from ..planning.registry import OPS
from .execute import execute_shared_all
from .factors import CorrelationError, Hermite, plan_factors
from .shared import Shared

#: the loadings are measured on enough inputs for ``ROWS_PER_FACTOR · keep`` logits (at most
#: ``MAX_SELECTION_INPUTS`` inputs), so that the carried combinations are not fitted to a few inputs
ROWS_PER_FACTOR, MAX_SELECTION_INPUTS = 4, 256
_CHUNK = 8


def selection_inputs(graph: LayerGraph, example: Any = None) -> np.ndarray:
    """The inputs the loadings are measured at: the user's example inputs (``convert(..., example_args=...)``,
    the first argument, when it has the network's input shape), topped up with normals of their per-element
    mean and sd (standard normals without an example) to reach the count :data:`ROWS_PER_FACTOR` asks for."""
    info = graph.guide_factors
    outputs = max(1, int(np.prod(graph.shape_of(graph.output))))
    want = int(np.clip(-(-ROWS_PER_FACTOR * (info.keep if info else 1) // outputs), 8, MAX_SELECTION_INPUTS))
    shape = tuple(graph.input_shape)
    given = None if example is None else np.asarray(example, dtype=np.float64)
    if given is None or given.ndim != len(shape) + 1 or tuple(given.shape[1:]) != shape or not len(given):
        given = np.zeros((0, *shape))
    given = given[:want]
    center = given.mean(0) if len(given) else np.zeros(shape)
    spread = given.std(0) if len(given) > 1 else np.ones(shape)
    extra = center + spread * np.random.default_rng(0).standard_normal((want - len(given), *shape))
    return np.concatenate([given, extra])


def logit_loadings(graph: LayerGraph, x: np.ndarray) -> np.ndarray | None:
    """``ℓ`` (B·outputs, k): every output element's loading on each global factor (module docstring), by the
    float64 shared-factor reference with the guide's factors alone at inputs ``x``; None where the network
    has no rule for them or its output no loading."""
    info = graph.guide_factors
    if info is None:
        return None
    planned = plan(graph)
    try:
        fp = plan_factors(planned, Hermite.NONE, guide=info.k, own_blocks=False)
    except CorrelationError:
        return None
    rows = []
    for start in range(0, len(x), _CHUNK):  # a few inputs at a time: a dense rule's guide × guide terms
        keep: dict[str, Shared | None] = {planned.output: None}
        execute_shared_all(planned, x[start:start + _CHUNK], fp, keep=keep)
        sh = keep[planned.output]
        if sh is None:
            return None
        b, c = sh.g.shape[:2]
        s = np.asarray(sh.s).reshape(b, c, -1)
        rows.append(np.einsum("bcp,bcf->bcpf", s, np.asarray(sh.g)[..., :info.k]).reshape(-1, info.k))
    return np.concatenate(rows)


def select_guide_directions(graph: LayerGraph, example: Any = None) -> LayerGraph:
    """``graph`` with its correlated guide's ``k`` candidate factors rotated to the ``keep`` combinations that
    carry the most of the logits' variance (module docstring), the rest folded into the independent variance,
    and its :class:`~pyro2pfp.planning.graph.GuideFactorInfo` stating that share; where nothing is measured (a
    network without the shared-factor rules, or a conv loading the guide), the first ``keep`` (the covariance's
    top ones) and the covariance share read with them.  ``example``: the user's example inputs
    (:func:`selection_inputs`).  Returns ``graph`` (changed in place) for chaining."""
    info = graph.guide_factors
    if info is None or not info.keep or info.keep >= info.k:
        return graph
    # a conv's rule holds guide × guide terms per output position: with all the candidates, too large to
    # measure at convert time, so convs loading the guide keep its covariance's top directions
    convs = any(OPS[layer.op].positions_share_weights for layer in graph.layers
                if any(p.factors is not None for p in layer.params.values()) and layer.op in OPS)
    try:
        loadings = None if convs else logit_loadings(graph, selection_inputs(graph, example))
    except CorrelationError:
        loadings = None
    if loadings is None or not np.all(np.isfinite(loadings)) or not np.any(loadings):
        rotation = np.eye(info.k)[:, :info.keep]
        graph.guide_factors = dataclasses.replace(info, k=info.keep)
    else:
        # Q: the top right singular vectors of ℓ; F·Q are orthonormal combinations of the candidates, so
        # F·Q·Qᵀ·Fᵀ ≤ F·Fᵀ and the rest, F·(I − Q·Qᵀ)·Fᵀ, goes to the independent diagonal
        _, sv, vt = np.linalg.svd(loadings, full_matrices=False)
        rotation = vt[:info.keep].T
        share = float((sv[:info.keep] ** 2).sum() / (sv**2).sum())
        graph.guide_factors = dataclasses.replace(info, k=info.keep, kept=share, at_logits=True, measured=info.k)
    for layer in graph.layers:
        layer.params = {name: _rotated(p, rotation) for name, p in layer.params.items()}
    return graph


def _rotated(p: GaussianParam, rotation: np.ndarray) -> GaussianParam:
    """``p`` with its loadings on the combinations ``rotation`` (k × keep) of the factors (the rest of its
    variance independent)."""
    return p if p.factors is None else dataclasses.replace(p, factors=p.factors @ rotation)
