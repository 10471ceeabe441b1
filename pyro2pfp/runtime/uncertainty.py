"""Predictive uncertainty from PFP outputs and from BNN samples, OOD AUROC.

One code path computes the metrics: :func:`uncertainty_from_logit_samples` takes logit samples
``(N, B, K)`` -- ``N`` samples, ``B`` inputs, ``K`` classes -- and returns, per input (all
entropies in nats)::

    p[n]      = softmax(l[n])                        (computed as exp(log_softmax), stable)
    p̄         = mean over n of p[n]                  "probs"
    total     = H[p̄]     = −Σk p̄k log p̄k            Shannon entropy (total uncertainty)
    aleatoric = mean_n H[p[n]] = −mean_n Σk p[n]k log p[n]k   softmax entropy
    epistemic = total − aleatoric                    mutual information (≥ 0 by Jensen)

``log p̄`` is computed as ``logsumexp_n(log p[n]) − log N`` so that it is exact even when some
``p̄k`` underflow. The metrics' sources:

* :func:`uncertainty` — a PFP network's ``(mean, var)`` of the logits: *logit sampling*
  (``docs/math.md`` "Uncertainty from the logits"), ``l[n] = mean + sqrt(var) · z[n]`` with ``z ~ N(0, 1)`` drawn in one
  vectorised call from ``numpy.random.default_rng(seed)``.
* :func:`pyro2pfp.calibration.predictive_uncertainty` — the original Pyro BNN: logits from
  ``pyro.infer.Predictive`` (:func:`pyro2pfp.analysis.sampling.predictive_logits`).

Both also report the sampling-free score ``"logit_variance"``: the summed logit variance
``Σk var_k`` (exact for PFP; the unbiased sample variance for BNN samples).

:func:`auroc` scores OOD detection (higher score = "more out-of-domain").  This module needs NumPy only
(SciPy for :func:`auroc`); :func:`pyro2pfp.calibrate` (:mod:`pyro2pfp.calibration`) chooses PFP's global
variance factor against the BNN's samples.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import ArgumentError

__all__ = [
    "auroc",
    "sample_logits",
    "standard_normal_draws",
    "uncertainty",
    "uncertainty_from_logit_samples",
]

def _as_float64(a: Any, name: str) -> np.ndarray:
    if hasattr(a, "detach"):
        a = a.detach().cpu().numpy()
    a = np.asarray(a, dtype=np.float64)
    if not np.all(np.isfinite(a)):
        raise ArgumentError(f"{name} contains NaN or infinite values")
    return a


# --------------------------------------------------------------------------- metrics

def logsumexp(a: np.ndarray, axis: int, keepdims: bool = False) -> np.ndarray:
    """``log Σ exp(a)`` along ``axis``, shifted by the maximum so that nothing overflows (finite ``a``).
    NumPy only (not SciPy's), so that the metrics run where only NumPy is installed (a board)."""
    top = np.max(a, axis=axis, keepdims=True)
    out = np.log(np.sum(np.exp(a - top), axis=axis, keepdims=True)) + top
    return out if keepdims else np.squeeze(out, axis=axis)


def uncertainty_from_logit_samples(samples: Any) -> dict[str, np.ndarray]:
    """Shannon entropy, softmax entropy and mutual information from logit samples.

    Parameters
    ----------
    samples
        Logits ``(N, B, K)`` (NumPy array or tensor): ``N`` samples of ``B`` inputs with ``K`` classes.
        A single input ``(N, K)`` is treated as ``B = 1``.

    Returns
    -------
    dict of str to numpy.ndarray
        Float64 arrays: ``"total"``, ``"aleatoric"``, ``"epistemic"`` and
        ``"logit_variance"`` of shape ``(B,)``; ``"probs"`` ``(B, K)``, the predictive class
        probabilities ``p̄`` (rows sum to 1). Entropies are in nats; ``epistemic`` is clipped at 0
        (it can only go below through rounding).  One logit per input (``K = 1``: a Bernoulli
        likelihood, e.g. a network whose final sigmoid was stripped) is the two-class case with logits
        ``[0, l]``: ``probs`` is ``(B, 2)``, ``[P(y=0), P(y=1)] = [1 − mean σ(l), mean σ(l)]``, and the
        entropies are the Bernoulli ones.
    """
    s = _as_float64(samples, "samples")
    if s.ndim == 2:
        s = s[:, None, :]
    if s.ndim != 3 or min(s.shape) < 1:
        raise ArgumentError(f"samples must have shape (num_samples, batch, classes), got {s.shape}")
    n = s.shape[0]
    logit_variance = s.var(axis=0, ddof=1 if n > 1 else 0).sum(-1)
    if s.shape[-1] == 1:  # one logit l (Bernoulli, a stripped final sigmoid): softmax([0, l]) = [1 − σ(l), σ(l)]
        s = np.concatenate([np.zeros_like(s), s], axis=-1)
    logp = s - logsumexp(s, axis=-1, keepdims=True)  # (N, B, K) log-softmax
    p = np.exp(logp)
    aleatoric = -(p * logp).sum(-1).mean(0)  # p·log p → 0 when p underflows (logp is finite)
    log_pbar = logsumexp(logp, axis=0) - math.log(n)  # (B, K)
    pbar = np.exp(log_pbar)
    total = -(pbar * log_pbar).sum(-1)
    epistemic = np.maximum(total - aleatoric, 0.0)
    return {
        "total": total,
        "aleatoric": aleatoric,
        "epistemic": epistemic,
        "probs": pbar / pbar.sum(-1, keepdims=True),
        "logit_variance": logit_variance,
    }


def _check_mean_var(mean: Any, var: Any) -> tuple[np.ndarray, np.ndarray]:
    mu = _as_float64(mean, "mean")
    v = _as_float64(var, "var")
    if mu.ndim != 2 or mu.shape != v.shape:
        raise ArgumentError(f"mean and var must both have shape (batch, classes), got {mu.shape} and {v.shape}")
    if np.any(v < 0):
        raise ArgumentError("var must be non-negative")
    return mu, v


def standard_normal_draws(shape: tuple[int, ...], seed: Any = None) -> np.ndarray:
    """Standard normal draws of ``shape`` (float64) in one vectorised call: the draws behind
    :func:`sample_logits` (``mean + √var·z``), for a caller that keeps them fixed while the moments
    change (common random numbers, as ``calibrate`` does).  ``seed``: an int, ``None`` (fresh
    entropy) or a ``numpy.random.Generator``; a given int seed always gives the same draws."""
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    return rng.standard_normal(shape)


def sample_logits(mean: Any, var: Any, num_samples: int = 100, seed: Any = None) -> np.ndarray:
    """Logit sampling: ``num_samples`` draws of ``N(mean, var)`` per logit, ``(N, B, K)`` float64.

    ``seed`` is an int, ``None`` (fresh entropy) or a ``numpy.random.Generator``; the draw is one
    vectorised ``standard_normal((N, B, K))`` call, so a given seed always gives the same samples.
    """
    mu, v = _check_mean_var(mean, var)
    if num_samples < 1:
        raise ArgumentError(f"num_samples must be >= 1, got {num_samples}")
    z = standard_normal_draws((int(num_samples), *mu.shape), seed)
    return mu + np.sqrt(v) * z


def uncertainty(mean: Any, var: Any, num_samples: int = 100, seed: Any = None) -> dict[str, np.ndarray]:
    """Uncertainty metrics of a PFP output: the logits' mean and variance.

    Draws :func:`sample_logits` and applies :func:`uncertainty_from_logit_samples`;
    ``"logit_variance"`` is the exact sampling-free score ``var.sum(-1)``.

    Parameters
    ----------
    mean, var
        The logits' mean and variance, each ``(B, K)`` (``K = 1``: one Bernoulli logit per input, see
        :func:`uncertainty_from_logit_samples`; give a squeezed ``(B,)`` output as ``mean[:, None]``).
    num_samples
        Logit draws per input.
    seed
        Seed of ``numpy.random.default_rng`` for the draws.

    Returns
    -------
    dict of str to numpy.ndarray
        As :func:`uncertainty_from_logit_samples`.

    Examples
    --------

    >>> mean, var = net.reference(x)
    >>> u = uncertainty(mean, var, num_samples=100, seed=0)
    >>> u["total"], u["aleatoric"], u["epistemic"], u["probs"]
    """
    mu, v = _check_mean_var(mean, var)
    out = uncertainty_from_logit_samples(sample_logits(mu, v, num_samples, seed))
    out["logit_variance"] = v.sum(-1)
    return out


def auroc(score_in_domain: Any, score_out_of_domain: Any) -> float:
    """Area under the ROC curve for telling out-of-domain inputs (positives) from in-domain ones.

    A higher score means "more likely out of domain" (e.g. mutual information, total entropy).
    Computed exactly as the Mann–Whitney U statistic: the probability that a random OOD input
    scores higher than a random in-domain one, ties counting one half,
    ``AUROC = (R_ood − n_ood (n_ood + 1) / 2) / (n_in · n_ood)`` with ``R_ood`` the sum of the
    OOD inputs' mid-ranks in the pooled scores.

    Parameters
    ----------
    score_in_domain, score_out_of_domain
        Scores of the in-domain and the out-of-domain inputs (any shape; flattened).

    Returns
    -------
    float
        1.0 = perfect separation, 0.5 = chance.

    Raises
    ------
    ArgumentError
        When either set of scores is empty.
    """
    from scipy.stats import rankdata

    s_in = _as_float64(score_in_domain, "score_in_domain").ravel()
    s_out = _as_float64(score_out_of_domain, "score_out_of_domain").ravel()
    if s_in.size == 0 or s_out.size == 0:
        raise ArgumentError("auroc needs at least one in-domain and one out-of-domain score")
    ranks = rankdata(np.concatenate([s_in, s_out]))  # mid-ranks for ties
    n_in, n_out = s_in.size, s_out.size
    u = ranks[n_in:].sum() - n_out * (n_out + 1) / 2.0
    return float(u / (n_in * n_out))
