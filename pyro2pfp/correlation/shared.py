"""Shared-factor PFP, the representation (float64): mean-field moments plus, per channel, the part of
the noise that is shared by all positions and, across channels, by the same upstream weight noise.

Why
---
Mean-field PFP (``docs/math.md``) keeps per element ``(μ, v)`` and treats all elements as
independent.  Its per-position variances match sampling even in a deep residual net (every layer's
variance ratio in ``pyro2pfp.diagnose`` stays near 1), but a conv weight is shared by all positions
and every channel mixes all upstream channels, so *sums* over positions (global average pooling,
flatten → dense) lose most of the variance (the ResNet rows of ``docs/fidelity.md``).  The
scheme keeps the mean-field ``(μ, v)`` and carries beside them the covariance of every activation
with a few normals per channel, used where positions and channels are summed.  Prediction stays a
single forward pass without sampling; nothing is fitted to Monte Carlo.

Representation (per edge, per input ``b``; ``C`` channels, ``P`` positions)
-------------------------------------------------------------------------------
* ``μ, v`` (B, C, P): the mean-field plan's moments, unchanged except at average pooling (pooled
  variance), dense layers (output variance) and residual adds (branch covariance).
* factors ``ζ_1 … ζ_K``: independent standard normals.  The planner
  (:func:`~pyro2pfp.correlation.factors.plan_factors`) gives every layer that creates shared noise a
  block of columns: one factor per output channel of every Bayesian conv2d/dense (its weight and bias
  noise), one per channel of every ReLU (its second Hermite term, ``hermite='factor'``).
* ``g`` (B, C, K), unit rows: the channel's normal ``η_c = Σ_f g[c, f]·ζ_f``.
* ``s`` (B, C, P), signed: ``s[c, p] = Cov(a[c, p], η_c)``, the regression profile of the channel on
  its normal.  The one approximation every rule shares is the rank-1-per-channel closure
  ``Cov(a[c, p], ζ_f) ≈ s[c, p]·g[c, f]`` (what is carried of an activation's covariance with the
  factors is its component along its channel's normal), so ``Cov(a[c, p], a[c', q]) ≈
  s[c, p]·s[c', q]·⟨g[c], g[c']⟩`` for ``(c, p) ≠ (c', q)``; the rest of ``v`` (``v − s²``) is
  independent across elements, as in mean-field.  Mean-field is the special case ``s ≡ 0``.
* A flattened edge keeps ``g`` per channel and ``s`` flat (``group = P`` elements per channel).

Rules
-----
Each op's rule lives with the op, in its family file ``pyro2pfp/ops/<family>.py`` (one formula for the
float64 reference and the ONNX export, ``@shared_formula(op)``, written in :mod:`.shared_algebra`) and
``pyro2pfp/backends/tvm/ops/<family>*.py`` (``@shared_kernel(op)``: TE), each with its formulas and
their assumptions in its docstring.  Notation there: ``m̄`` the mean over the output positions;
``W, V`` the weight mean and variance; ``⊕ x·e_o`` x in the layer's own factor column; Φ, φ the
normal CDF/PDF; ``(μ, v)`` are mean-field unless said.  Every rule's profile is clipped to ``±sd``
of its edge by the executor.  An op with an :class:`~pyro2pfp.planning.registry.ActivationRule` and no rule
of its own gets the generic one (Stein's lemma, :mod:`pyro2pfp.correlation.stein`).

* compaction: where a layer's output is the only live edge (every ResNet block boundary) and
  ``K ≥ 4·C``, ``g`` (C × K) becomes ``Rᵀ`` from ``gᵀ = Q·R`` (C × C).  Exact (only ``g·gᵀ``
  matters from there on; later factors are new).  Bounds K by ~5·C instead of growing with depth.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Shared:
    """The shared part of one edge: ``s`` (B, *edge shape: C, *spatial, or flat C·group), ``g`` (B, C, K) and
    ``K`` (``k``; read from ``g`` when not given: float64 arrays).  The entries are the back end's tensors:
    float64 arrays in the reference, ONNX symbols in the export (the rules are written once for both:
    :mod:`.shared_algebra`)."""

    s: Any
    g: Any
    k: int = -1

    def __post_init__(self) -> None:
        if self.k < 0:
            self.k = int(self.g.shape[2])



def compacted(sh: Shared) -> Shared:
    """``g`` (B, C, K) → ``Rᵀ`` (B, C, C) with ``gᵀ = Q·R``: same ``g·gᵀ`` (exact)."""
    # R alone, one input at a time: NumPy's stacked ``mode="r"`` is many times slower than this loop, and
    # ``mode="reduced"`` also forms Q (as costly again); every input's R is the same as theirs, bit for bit
    r = np.stack([np.linalg.qr(gt, mode="r") for gt in np.swapaxes(sh.g, 1, 2)])
    return Shared(sh.s, np.swapaxes(r, 1, 2))


