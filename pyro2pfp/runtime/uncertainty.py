"""Predictive uncertainty from PFP outputs and from BNN samples, OOD AUROC, automatic calibration.

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
* :func:`predictive_uncertainty` — the original Pyro BNN: logits from
  ``pyro.infer.Predictive`` (:func:`pyro2pfp.analysis.sampling.predictive_logits`).

Both also report the sampling-free score ``"logit_variance"``: the summed logit variance
``Σk var_k`` (exact for PFP; the unbiased sample variance for BNN samples).

:func:`auroc` scores OOD detection (higher score = "more out-of-domain"), and :func:`calibrate`
chooses PFP's global variance factor (see its docstring for the objective).
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import ArgumentError

__all__ = [
    "CALIBRATION_OBJECTIVES",
    "CalibrationObjective",
    "auroc",
    "calibrate",
    "minimise_log_scale",
    "predictive_uncertainty",
    "sample_logits",
    "uncertainty",
    "uncertainty_from_logit_samples",
]

#: Objectives understood by :func:`calibrate`.
CALIBRATION_OBJECTIVES = ("mutual_information", "total", "entropies", "nll")


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

    Args:
        samples: Logits ``(N, B, K)`` (NumPy array or tensor): ``N`` samples of ``B`` inputs with
            ``K`` classes. A single input ``(N, K)`` is treated as ``B = 1``.

    Returns:
        A dict of float64 arrays: ``"total"``, ``"aleatoric"``, ``"epistemic"`` and
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


def _standard_normal(shape: tuple[int, ...], seed: Any) -> np.ndarray:
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
    z = _standard_normal((int(num_samples), *mu.shape), seed)
    return mu + np.sqrt(v) * z


def uncertainty(mean: Any, var: Any, num_samples: int = 100, seed: Any = None) -> dict[str, np.ndarray]:
    """Uncertainty metrics of a PFP output ``(mean, var)`` of the logits, each ``(B, K)`` (``K = 1``: one
    Bernoulli logit per input, see :func:`uncertainty_from_logit_samples`; give a squeezed ``(B,)`` output
    as ``mean[:, None]``).

    Draws :func:`sample_logits` and applies :func:`uncertainty_from_logit_samples`;
    ``"logit_variance"`` is the exact sampling-free score ``var.sum(-1)``.

    >>> mean, var = net.reference(x)
    >>> u = uncertainty(mean, var, num_samples=100, seed=0)
    >>> u["total"], u["aleatoric"], u["epistemic"], u["probs"]
    """
    mu, v = _check_mean_var(mean, var)
    out = uncertainty_from_logit_samples(sample_logits(mu, v, num_samples, seed))
    out["logit_variance"] = v.sum(-1)
    return out


def predictive_uncertainty(model: Callable[..., Any], guide: Callable[..., Any], x: Any,
                           num_samples: int = 100, seed: int | None = None) -> dict[str, np.ndarray]:
    """The same metrics for the sampled BNN: ``pyro.infer.Predictive`` logits of ``(model, guide)``.

    ``x`` is passed to the model as a float32 tensor (shape as the model expects it);
    ``seed`` (if given) seeds Pyro before sampling. See :func:`pyro2pfp.analysis.sampling.predictive_logits`.
    """
    from ..analysis.sampling import predictive_logits

    return uncertainty_from_logit_samples(predictive_logits(model, guide, x, num_samples, seed))


def auroc(score_in_domain: Any, score_out_of_domain: Any) -> float:
    """Area under the ROC curve for telling out-of-domain inputs (positives) from in-domain ones.

    A higher score means "more likely out of domain" (e.g. mutual information, total entropy).
    Computed exactly as the Mann–Whitney U statistic: the probability that a random OOD input
    scores higher than a random in-domain one, ties counting one half,
    ``AUROC = (R_ood − n_ood (n_ood + 1) / 2) / (n_in · n_ood)`` with ``R_ood`` the sum of the
    OOD inputs' mid-ranks in the pooled scores. 1.0 = perfect separation, 0.5 = chance.
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


# --------------------------------------------------------------------------- calibration

class CalibrationObjective:
    """The function of the calibration factor ``c`` that :func:`calibrate` minimises.

    ``obj(c)`` re-plans the converted network with weight/bias variances multiplied by ``c``
    (``pyro2pfp.planning.plan.plan(net.layer_graph, c)``; no re-tracing), runs the float64 reference on
    ``x_val`` and logit-samples the output with *fixed* standard-normal draws
    ``l = μ(c) + sqrt(v(c)) · z`` (common random numbers: the objective is a deterministic,
    smooth function of ``c``). With ``U`` the per-input metrics of these samples and ``U*`` those
    of the sampled BNN (``target_samples``):

    * ``"mutual_information"``: ``mean_i (MI_i(c) − MI*_i)²``
    * ``"total"``:              ``mean_i (H_i(c) − H*_i)²``
    * ``"entropies"``:          the sum of the two
    * ``"nll"``:                ``−mean_i log p̄_i(y_i; c)``, the negative log-likelihood of the
      labels ``y_val`` under PFP's predictive probabilities (no BNN samples needed).

    ``obj.evaluate(c)`` returns every objective the data allow; calling ``obj(c)`` returns the chosen
    one and appends ``(c, value)`` to ``obj.history``.
    """

    def __init__(self, net: Any, x_val: Any, *, objective: str = "mutual_information",
                 target_samples: Any = None, y_val: Any = None, num_samples: int = 100,
                 seed: int = 0) -> None:
        from .inputs import as_input_array

        if objective not in CALIBRATION_OBJECTIVES:
            raise ArgumentError(f"objective must be one of {CALIBRATION_OBJECTIVES}, got {objective!r}")
        if net.input_variance:
            raise ArgumentError("calibrate supports networks with a deterministic input only")
        self.net = net
        self.objective = objective
        self.x = as_input_array(x_val, net.input_shape, "x_val", dtype=np.float64)
        b = self.x.shape[0]
        self.target: dict[str, np.ndarray] | None = None
        self.y: np.ndarray | None = None
        if y_val is not None:
            self.y = np.asarray(y_val).astype(np.int64).ravel()
            if self.y.shape != (b,):
                raise ArgumentError(f"y_val must have shape ({b},), got {np.shape(y_val)}")
        if target_samples is not None:
            self.target = uncertainty_from_logit_samples(target_samples)
            if self.target["total"].shape != (b,):
                raise ArgumentError(f"target_samples must have shape (N, {b}, K), got {np.shape(target_samples)}")
        if objective == "nll" and self.y is None:
            raise ArgumentError("objective 'nll' needs the labels y_val")
        if objective != "nll" and self.target is None:
            raise ArgumentError(f"objective {objective!r} needs the BNN's logit samples (target_samples)")
        self.num_samples = int(num_samples)
        if self.num_samples < 1:
            raise ArgumentError(f"num_samples must be >= 1, got {num_samples}")
        self.seed = seed
        self._z: np.ndarray | None = None
        self.history: list[tuple[float, float]] = []

    def pfp_output(self, c: float) -> tuple[np.ndarray, np.ndarray]:
        """``(mean, var)`` of the logits with calibration factor ``c`` (float64 reference)."""
        from ..backends.reference import execute
        from ..correlation import with_correlation
        from ..planning.plan import plan

        planned = with_correlation(plan(self.net.layer_graph, float(c), self.net.plan.moment_form),
                                   self.net.plan.correlation)
        return execute(planned, self.x)

    def metrics(self, c: float) -> dict[str, np.ndarray]:
        """PFP uncertainty metrics on ``x_val`` with factor ``c`` (the fixed logit draws)."""
        mean, var = self.pfp_output(c)
        if self._z is None:
            self._z = _standard_normal((self.num_samples, *mean.shape), self.seed)
        return uncertainty_from_logit_samples(mean + np.sqrt(np.maximum(var, 0.0)) * self._z)

    def evaluate(self, c: float) -> dict[str, float]:
        """Every objective that the given data allow (BNN samples and/or labels), at factor ``c``."""
        u = self.metrics(c)
        out = {}
        if self.target is not None:
            t = self.target
            out["mutual_information"] = float(np.mean((u["epistemic"] - t["epistemic"]) ** 2))
            out["total"] = float(np.mean((u["total"] - t["total"]) ** 2))
            out["entropies"] = out["mutual_information"] + out["total"]
        if self.y is not None:
            p = u["probs"][np.arange(len(self.y)), self.y]
            out["nll"] = float(-np.mean(np.log(np.maximum(p, np.finfo(np.float64).tiny))))
        return out

    def __call__(self, c: float) -> float:
        value = self.evaluate(c)[self.objective]
        self.history.append((float(c), value))
        return value


def minimise_log_scale(fn: Callable[[float], float], bounds: tuple[float, float] = (1e-3, 10.0),
                       grid: int = 13, rtol: float = 1e-2) -> float:
    """Minimise ``fn`` over ``[lo, hi]``: a log-spaced grid, then golden-section search in ``log c``
    on the bracket around the best grid point until it is narrower than ``rtol`` (relative)."""
    lo, hi = float(bounds[0]), float(bounds[1])
    if not 0 < lo < hi or not math.isfinite(hi):
        raise ArgumentError(f"bounds must satisfy 0 < lo < hi < inf, got {bounds}")
    if grid < 3:
        raise ArgumentError(f"grid must be >= 3, got {grid}")
    logs = np.linspace(math.log(lo), math.log(hi), int(grid))
    values = [fn(math.exp(t)) for t in logs]
    best = int(np.argmin(values))
    a, b = logs[max(best - 1, 0)], logs[min(best + 1, len(logs) - 1)]
    cache = {float(logs[best]): values[best]}

    def f(t: float) -> float:
        if t not in cache:
            cache[t] = fn(math.exp(t))
        return cache[t]

    g = (math.sqrt(5) - 1) / 2
    x1, x2 = b - g * (b - a), a + g * (b - a)
    f1, f2 = f(x1), f(x2)
    while b - a > math.log1p(rtol):
        if f1 <= f2:
            b, x2, f2 = x2, x1, f1
            x1 = b - g * (b - a)
            f1 = f(x1)
        else:
            a, x1, f1 = x1, x2, f2
            x2 = a + g * (b - a)
            f2 = f(x2)
    t_best = min(cache, key=lambda t: cache[t])
    if best in (0, len(logs) - 1) and t_best in (logs[0], logs[-1]):
        warnings.warn(f"the calibration optimum lies at the edge of bounds {bounds}; widen them",
                      stacklevel=3)
    return float(math.exp(t_best))


def calibrate(model: Any, guide: Any, x_val: Any, *, input_shape: tuple[int, ...] | None = None,
              y_val: Any = None, objective: str | None = None, num_samples: int = 100,
              samples: Any = None, net: Any = None, bounds: tuple[float, float] = (1e-3, 10.0),
              grid: int = 13, rtol: float = 1e-2, seed: int = 0,
              return_objective: bool = False) -> float | tuple[float, CalibrationObjective]:
    """Choose PFP's global variance (calibration) factor automatically from validation inputs.

    The factor ``c`` multiplies every weight and bias variance of the PFP network
    (``convert(..., calibration=c)``). It is chosen to minimise, over ``c`` in ``bounds``,

    * (default, ``objective="mutual_information"``) the mean squared difference, over the
      validation inputs, between PFP's mutual information (logit sampling, ``num_samples``
      draws) and the mutual information of the sampled BNN (``num_samples`` Predictive samples
      of ``(model, guide)``) -- i.e. PFP's *epistemic* uncertainty is matched to the BNN's;
    * ``"total"``: the same for the total (Shannon) entropy; ``"entropies"``: the sum of both;
    * ``"nll"`` (the default when labels ``y_val`` are given): the negative log-likelihood of
      ``y_val`` under PFP's predictive probabilities -- a proper scoring rule on held-out data.

    Both sides use the same number of samples, so the finite-sample bias of the entropy
    estimates is the same on both sides; the PFP draws are fixed across ``c`` (see
    :class:`CalibrationObjective`). Search: a ``grid``-point log-spaced grid over ``bounds``,
    then golden-section search in ``log c`` to relative precision ``rtol``
    (:func:`minimise_log_scale`). Each evaluation re-plans the already converted network and
    runs the float64 NumPy reference on ``x_val`` (no re-tracing, no compilation).

    Args:
        model, guide: The trained Pyro BNN (as for :func:`pyro2pfp.convert`).
        x_val: Validation inputs ``(B, *input_shape)``, unlabelled unless ``objective="nll"``.
            Use held-out in-domain data (never the OOD test set).
        input_shape: As for ``convert``.
        y_val: Labels of ``x_val`` (needed for ``"nll"``; otherwise only used for reporting by
            the returned objective's ``evaluate``).
        objective: One of :data:`CALIBRATION_OBJECTIVES`; ``None`` means ``"nll"`` if ``y_val``
            is given, else ``"mutual_information"``.
        num_samples: Samples per input for both PFP logit sampling and Predictive.
        samples: Precomputed BNN logit samples ``(N, B, K)`` on ``x_val`` (skips Predictive);
            ``N`` should equal ``num_samples`` (a warning otherwise).
        net: An already converted :class:`~pyro2pfp.PFPNetwork` of ``(model, guide)`` (skips
            tracing); its own calibration factor is ignored.
        bounds, grid, rtol: Search range, grid size and final relative precision.
        seed: Seeds the PFP logit draws and (via ``pyro.set_rng_seed``) Predictive.
        return_objective: Also return the :class:`CalibrationObjective` (its ``history`` holds
            every evaluated ``(c, value)``).

    Returns:
        The factor as a float (pass it to ``convert(..., calibration=factor)``).
    """
    from ..network import convert
    from .inputs import as_input_array

    if objective is None:
        objective = "nll" if y_val is not None else "mutual_information"
    if net is None:
        net = convert(model, guide, input_shape=input_shape, calibration=1.0)
    x = as_input_array(x_val, net.input_shape, "x_val")
    if samples is not None and np.shape(samples)[0] != num_samples:
        warnings.warn(f"samples has {np.shape(samples)[0]} samples per input but num_samples={num_samples}: "
                      "entropy estimates are biased differently for different sample counts", stacklevel=2)
    if objective != "nll" and samples is None:
        from ..analysis.sampling import predictive_logits

        samples = predictive_logits(model, guide, x, num_samples=num_samples, seed=seed)
    obj = CalibrationObjective(net, x, objective=objective, target_samples=samples, y_val=y_val,
                               num_samples=num_samples, seed=seed)
    factor = minimise_log_scale(obj, bounds, grid, rtol)
    return (factor, obj) if return_objective else factor
