"""Calibration of a converted network's variances against the Pyro BNN's own samples, and the BNN's
predictive uncertainty from ``pyro.infer.Predictive`` (the metrics are :mod:`pyro2pfp.runtime.uncertainty`'s).

:func:`calibrate` chooses PFP's global variance factor (see its docstring for the objective);
:func:`predictive_uncertainty` gives the same metrics as :func:`pyro2pfp.uncertainty` for the sampled BNN.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import ArgumentError
from .planning.plan import plan
from .runtime.inputs import as_input_array
from .runtime.uncertainty import _standard_normal, uncertainty_from_logit_samples

if TYPE_CHECKING:
    from .network import PFPNetwork


__all__ = ["CALIBRATION_OBJECTIVES", "CalibrationObjective", "calibrate", "minimise_log_scale",
           "predictive_uncertainty"]

#: Objectives understood by :func:`calibrate`.
CALIBRATION_OBJECTIVES = ("mutual_information", "total", "entropies", "nll")


def predictive_uncertainty(model: Callable[..., Any], guide: Callable[..., Any], x: Any,
                           num_samples: int = 100, seed: int | None = None) -> dict[str, np.ndarray]:
    """The metrics of :func:`pyro2pfp.uncertainty` for the sampled BNN, from ``pyro.infer.Predictive``
    logits of ``(model, guide)`` (:func:`pyro2pfp.analysis.sampling.predictive_logits`).

    Parameters
    ----------
    model, guide
        The trained Pyro BNN.
    x
        Inputs, passed to the model as a float32 tensor (shape as the model expects it).
    num_samples
        Predictive samples.
    seed
        If given, seeds Pyro before sampling.

    Returns
    -------
    dict of str to numpy.ndarray
        As :func:`pyro2pfp.uncertainty_from_logit_samples`.
    """
    from .analysis.sampling import predictive_logits  # torch and Pyro: `import pyro2pfp` loads neither

    return uncertainty_from_logit_samples(predictive_logits(model, guide, x, num_samples, seed))


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

    def __init__(self, net: PFPNetwork, x_val: Any, *, objective: str = "mutual_information",
                 target_samples: Any = None, y_val: Any = None, num_samples: int = 100,
                 seed: int = 0) -> None:
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
        from .backends.reference import execute  # SciPy: `import pyro2pfp` stays NumPy-only
        from .correlation import with_correlation  # SciPy: `import pyro2pfp` stays NumPy-only

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
              samples: Any = None, net: PFPNetwork | None = None, bounds: tuple[float, float] = (1e-3, 10.0),
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

    Parameters
    ----------
    model, guide
        The trained Pyro BNN (as for :func:`pyro2pfp.convert`).
    x_val
        Validation inputs ``(B, *input_shape)``, unlabelled unless ``objective="nll"``. Use held-out
        in-domain data (never the OOD test set).
    input_shape
        As for ``convert``.
    y_val
        Labels of ``x_val`` (needed for ``"nll"``; otherwise only used for reporting by the returned
        objective's ``evaluate``).
    objective
        One of :data:`CALIBRATION_OBJECTIVES`; ``None`` means ``"nll"`` if ``y_val`` is given, else
        ``"mutual_information"``.
    num_samples
        Samples per input for both PFP logit sampling and Predictive.
    samples
        Precomputed BNN logit samples ``(N, B, K)`` on ``x_val`` (skips Predictive); ``N`` should equal
        ``num_samples`` (a warning otherwise).
    net
        An already converted :class:`~pyro2pfp.PFPNetwork` of ``(model, guide)`` (skips tracing); its
        own calibration factor is ignored.
    bounds, grid, rtol
        Search range, grid size and final relative precision.
    seed
        Seeds the PFP logit draws and (via ``pyro.set_rng_seed``) Predictive.
    return_objective
        Also return the :class:`CalibrationObjective` (its ``history`` holds every evaluated
        ``(c, value)``).

    Returns
    -------
    float or tuple of (float, CalibrationObjective)
        The factor (pass it to ``convert(..., calibration=factor)``).
    """
    from .network import convert  # torch and Pyro: `import pyro2pfp` loads neither

    if objective is None:
        objective = "nll" if y_val is not None else "mutual_information"
    if net is None:
        net = convert(model, guide, input_shape=input_shape, calibration=1.0)
    x = as_input_array(x_val, net.input_shape, "x_val")
    if samples is not None and np.shape(samples)[0] != num_samples:
        warnings.warn(f"samples has {np.shape(samples)[0]} samples per input but num_samples={num_samples}: "
                      "entropy estimates are biased differently for different sample counts", stacklevel=2)
    if objective != "nll" and samples is None:
        from .analysis.sampling import predictive_logits  # torch and Pyro: `import pyro2pfp` loads neither

        samples = predictive_logits(model, guide, x, num_samples=num_samples, seed=seed)
    obj = CalibrationObjective(net, x, objective=objective, target_samples=samples, y_val=y_val,
                               num_samples=num_samples, seed=seed)
    factor = minimise_log_scale(obj, bounds, grid, rtol)
    return (factor, obj) if return_objective else factor
