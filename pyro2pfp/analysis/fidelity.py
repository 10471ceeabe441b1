"""A converted network that checks its own fidelity against sampling: ``convert(..., check=x)``.

PFP propagates moments in closed form, under approximations (independent activations, Gaussian
pre-activations) that hold better for some networks than for others.  :func:`check_fidelity` tests
them on the user's own inputs: it runs the machinery of :func:`pyro2pfp.diagnose` (``num_samples``
weight sets drawn from the guide, each run through the traced torch model; the float64 NumPy reference
of the plan on the PFP side) and compares the logits' moments with the Monte Carlo ones.  The bounds come from the
sample count ``n`` alone, so they say "further from sampling than ``n`` samples can explain":

* variance ratio (PFP / MC, median over the logits' elements and the inputs): it passes when
  ``|ln ratio| ≤ tolerance·σ``, ``σ`` the noise of the median measured by splitting the samples into
  groups (:func:`pyro2pfp.analysis.mc_compare.median_ratio_noise`: the elements share the weight samples, so
  their errors are correlated and the median's noise is not known in advance), at most the
  per-element relative standard error ``√(2/(n−1))`` of a Gaussian's sampled variance (the bound
  when every element's error were the same; ``n = 150``, ``tolerance = 4``: [0.63, 1.59]) and at
  least a tenth of it;
* mean error (median over elements of ``|μ_PFP − μ_MC|`` in MC standard deviations, see
  :mod:`pyro2pfp.analysis.mc_compare`): the MC mean is off by ``sd/√n``, so it passes when the median is at most
  ``tolerance/√n`` (0.33 sd at ``n = 150``; an exact mean gives ≈ 0.67/√n).

The medians over elements are used, not the worst element, because a network has thousands of
elements and the same ``n`` weight samples drive them all.  When the logits fail, the warning
(:class:`~pyro2pfp.errors.FidelityWarning`) names the first planned layer whose figures leave the same
bounds (where the approximation breaks), with its figures and how long the check took.

Cost: ``n`` guide samples and ``n`` torch forward passes of the whole batch, plus one more trace of
the model; the message and ``FidelityCheck.seconds`` give the time taken.  It is off by
default and runs once, in ``convert``; keep the batch small (8–32 inputs).  Model, guide, param store
and random number generators are left as they were.
"""
from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import ArgumentError, FidelityError, FidelityWarning, PFPError, PosteriorError, brief
from ..planning.protocols import ConvertedNetwork
from .mc_compare import Diagnosis, LayerFidelity, compare, random_elements, store_mismatches

DEFAULT_SAMPLES = 150
DEFAULT_TOLERANCE = 4.0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FidelityBounds:
    """What ``n`` Monte Carlo samples can tell apart (module docstring)."""

    num_samples: int
    tolerance: float = DEFAULT_TOLERANCE

    @property
    def mean_error(self) -> float:
        """Largest median mean error (in MC sd) that sampling noise explains."""
        return self.tolerance / math.sqrt(self.num_samples)

    @property
    def ratio(self) -> tuple[float, float]:
        """The widest interval of median variance ratios that sampling noise explains (every element's
        error the same); :meth:`ratio_for` narrows it by the measured noise of a layer."""
        half = self.tolerance * math.sqrt(2.0 / (self.num_samples - 1))
        return math.exp(-half), math.exp(half)

    def ratio_for(self, row: LayerFidelity) -> tuple[float, float]:
        """The interval of median variance ratios that sampling noise explains for ``row``: ``tolerance``
        times its measured noise (``row.ratio_noise``), clamped to [1/10, 1] of :attr:`ratio`'s."""
        widest = math.sqrt(2.0 / (self.num_samples - 1))
        noise = row.ratio_noise if math.isfinite(row.ratio_noise) else widest
        half = self.tolerance * min(max(noise, 0.1 * widest), widest)
        return math.exp(-half), math.exp(half)

    def violations(self, row: LayerFidelity) -> list[str]:
        """What of ``row`` leaves the bounds, as phrases (empty: within; NaN figures, a layer with no
        random element, are never a violation)."""
        out = []
        lo, hi = self.ratio_for(row)
        if not lo <= row.ratio_median <= hi and not math.isnan(row.ratio_median):
            out.append(f"variance ratio (PFP/MC, median) {row.ratio_median:.3g} outside [{lo:.2f}, {hi:.2f}]")
        if row.mean_error > self.mean_error:
            out.append(f"mean error (median, in MC sd) {row.mean_error:.3g} above {self.mean_error:.2f}")
        return out


@dataclass(frozen=True)
class FidelityCheck:
    """The result of :func:`check_fidelity` (``net.fidelity`` after ``convert(..., check=x)``)."""

    passed: bool  # the logits' figures are within the bounds
    output: LayerFidelity  # the logits' row
    first_layer: LayerFidelity | None  # the first planned layer outside the bounds (None: none)
    bounds: FidelityBounds
    seconds: float  # how long the check took
    diagnosis: Diagnosis  # every layer's figures (print it for the table)
    correlation: str = "mean-field"  # the network's correlation scheme (net.plan.correlation)

    def message(self) -> str:
        n, inputs = self.diagnosis.num_samples, self.diagnosis.num_inputs
        head = (f"{n} guide samples on {inputs} inputs ({self.seconds:.1f} s): PFP's output '{self.output.name}' "
                f"has {self._figures(self.output)}")
        if self.passed:
            inner = ""
            if self.first_layer is not None:  # an inner layer parts from sampling, the output does not
                inner = (f" (layer '{self.first_layer.name}' ({self.first_layer.op}) is outside the bounds: "
                         f"{'; '.join(self.bounds.violations(self.first_layer))}; the output is not)")
            return f"fidelity check passed: {head}, within the sampling noise{inner}."
        where = ""
        if self.first_layer is not None:
            parts = "; ".join(self.bounds.violations(self.first_layer))
            where = (f" The first layer outside these bounds is '{self.first_layer.name}' "
                     f"({self.first_layer.op}, {parts}).")
        remedy = ("convert(..., correlation='shared-factor') (this network is mean-field: every activation taken "
                  "as independent), or " if self.correlation == "mean-field" else "")
        return (f"PFP's output differs from sampling by more than {n} samples explain: "
                f"{'; '.join(self.bounds.violations(self.output))}.{where} Check: {head}. Print "
                f"net.fidelity.diagnosis for every layer (pyro2pfp.diagnose); remedies: {remedy}a variance "
                "calibration (pyro2pfp.calibrate).")

    @staticmethod
    def _figures(row: LayerFidelity) -> str:
        return f"variance ratio {row.ratio_median:.3g} and mean error {row.mean_error:.3g} sd (medians)"


def check_fidelity(net: ConvertedNetwork, model: Any, guide: Any, x: Any, *, num_samples: int = DEFAULT_SAMPLES,
                   tolerance: float = DEFAULT_TOLERANCE, seed: int = 0, warn: bool = True, traced: Any = None,
                   args: Any = None) -> FidelityCheck:
    """Compare ``net`` (converted from ``model``, ``guide``) with ``num_samples`` guide samples on the
    inputs ``x`` (a batch); warn with a :class:`~pyro2pfp.errors.FidelityWarning` (``warn=True``) when
    the logits' median variance ratio or mean error leaves the bounds of the module docstring, naming the
    first layer that leaves them; log the result (``logging`` at INFO) when they hold.

    Cost: ``num_samples`` guide samples and torch forward passes of ``x`` (see the module docstring).
    Raises :class:`~pyro2pfp.errors.FidelityError` if a deterministic parameter of ``net`` differs from the param
    store's (:func:`pyro2pfp.analysis.mc_compare.store_mismatches`).  ``traced``, ``args``: see :func:`spot_check`.
    """
    if isinstance(x, bool) or x is None:
        raise ArgumentError(f"check= takes a batch of example inputs (batch, *input_shape), got {x!r}")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 10:
        raise ArgumentError(f"the fidelity check needs num_samples >= 10, got {num_samples!r}")
    if not tolerance > 0:
        raise ArgumentError(f"the fidelity check's tolerance must be > 0, got {tolerance!r}")
    if net.input_variance:
        raise ArgumentError("check= needs a network without input variance (convert(..., input_variance=False)): "
                            "the check samples the weights only")
    check_store_values(net)
    t0 = time.perf_counter()
    d = compare(net, model, guide, x, num_samples=num_samples, seed=seed, traced=traced,
                args=args if args is not None and getattr(args, "given", False) else None)
    seconds = time.perf_counter() - t0
    if not d.layers:
        raise ArgumentError("check=: no layer of the converted network could be found in the traced model, so "
                            "there is nothing to compare; run pyro2pfp.diagnose(model, guide, x) to see why")
    bounds = FidelityBounds(num_samples, tolerance)
    rows = {r.name: r for r in d.layers}
    output = rows.get(net.layer_graph.output, d.layers[-1])
    passed = not bounds.violations(output)
    first = next((r for r in d.layers if bounds.violations(r)), None)
    result = FidelityCheck(passed, output, first, bounds, seconds, d, net.plan.correlation)
    if passed:
        log.info(result.message())
    elif warn:
        warnings.warn(result.message(), FidelityWarning, stacklevel=3)
    return result


# ------------------------------------------------------------------------------------------ spot check
SPOT_SAMPLES = 64  # guide samples of the spot check every convert runs
SPOT_INPUTS = 2  # inputs it compares on
SPOT_MEAN_SE = 6.0  # a gross mean error: the median over the logits beyond this many MC standard errors
SPOT_RATIO_SD = 4.0  # a gross variance ratio: the median beyond this many sd of a sampled variance's log
SPOT_DETERMINISTIC = 1e-3  # a deterministic layer departs: its output off by this fraction of its size (float32)


@dataclass(frozen=True)
class SpotCheck:
    """The figures of :func:`spot_check` (``net.fidelity`` after a ``convert`` without ``check=x``)."""

    passed: bool
    mean_error_se: float  # median over the logits of |μ_PFP − μ_MC| in MC standard errors (sd/√n)
    ratio: float  # median over the logits of var_PFP / var_MC
    ratio_bounds: tuple[float, float]  # what SPOT_RATIO_SD sd of the sampled variances' log allow
    num_samples: int
    num_inputs: int
    seconds: float
    first_layer: LayerFidelity | None = None  # the first layer past the same bounds (on failure)

    def message(self) -> str:
        figures = (f"median mean error {self.mean_error_se:.3g} MC standard errors (gross: above {SPOT_MEAN_SE:g}), "
                   f"median variance ratio PFP/MC {self.ratio:.3g} (gross: outside [{self.ratio_bounds[0]:.2f}, "
                   f"{self.ratio_bounds[1]:.2f}])")
        return f"spot check, {self.num_samples} guide samples on {self.num_inputs} inputs ({self.seconds:.2f} s): " \
               f"{figures}"


def check_store_values(net: ConvertedNetwork) -> None:
    """Raise :class:`~pyro2pfp.errors.FidelityError` naming every deterministic parameter of ``net`` read from
    the param store that differs from the store's values now (:func:`pyro2pfp.analysis.mc_compare.store_mismatches`)."""
    mismatches = store_mismatches(net)
    if mismatches:
        raise FidelityError(f"the converted network's parameters are not the trained model's: {'; '.join(mismatches)}. "
                            "The network was built from other values than the param store holds now (was the store "
                            "changed or loaded after converting?); convert again.")


def _spot_inputs(net: ConvertedNetwork, args: Any) -> np.ndarray:
    """The example inputs the model was traced with, if the user gave them; else a few standard normal inputs
    of the input shape (fixed seed): non-zero, so that every weight matters."""
    if args is not None and getattr(args, "given", False):
        return np.asarray(torch.as_tensor(args[0][:SPOT_INPUTS]).detach().double().numpy())
    g = torch.Generator().manual_seed(0)
    return torch.randn((SPOT_INPUTS, *net.input_shape), generator=g, dtype=torch.float64).numpy()


def _gross(mean_se: float, ratio: float, bounds: tuple[float, float]) -> bool:
    return not (mean_se <= SPOT_MEAN_SE) or not (bounds[0] <= ratio <= bounds[1])


def spot_check(net: ConvertedNetwork, model: Any, guide: Any, *, traced: Any = None, args: Any = None,
               num_samples: int = SPOT_SAMPLES, seed: int = 0) -> SpotCheck:
    """The check ``convert`` runs on every network (unless ``check=False``): raise
    :class:`~pyro2pfp.errors.FidelityError` when ``net`` is grossly unlike what ``model`` and ``guide``
    compute.

    * Its deterministic parameters read from the param store must still equal the store's
      (:func:`pyro2pfp.analysis.mc_compare.store_mismatches` names the layer and the store's entry otherwise).
    * ``num_samples`` (64) guide samples, run through the traced model on a few inputs (the example inputs
      the user gave, else two standard normal inputs of the input shape): over the logits, the median of
      ``|μ_PFP − μ_MC|`` in Monte Carlo standard errors must be at most 6, and the median variance ratio
      PFP/MC within ``exp(±4σ)``, ``σ = √((κ − 1)/n)`` the relative sd of a variance sampled ``n`` times
      (``κ``: the logits' median kurtosis, at least a Gaussian's 3).  At 64 samples of Gaussian logits that
      is [0.49, 2.0]: a mean-field ResNet at 0.28 of the sampled variance fails, a network within its
      approximation's usual error does not.  On failure the per-layer comparison names the first layer past
      the same bounds (a layer that sampling finds deterministic: its output off by more than float32 explains,
      1e-3 of its size).

    Sampling follows the plan's calibration (each weight's deviation from its mean scaled by
    ``√calibration``).  ``traced``, ``args``: the traced model and the model arguments ``convert`` used (else
    the model is traced again).  Costs ``num_samples`` guide samples (one vectorised run of the guide where it
    allows), torch forward passes of two inputs (vectorised over the samples) and the NumPy reference on them;
    model, guide, param store and random state are left as they were.
    """
    t0 = time.perf_counter()
    check_store_values(net)
    xs = _spot_inputs(net, args)
    samples: list[np.ndarray] = []
    try:
        d = compare(net, model, guide, xs, num_samples=num_samples, seed=seed, per_layer=False, traced=traced,
                    args=args, samples=samples, calibration=net.plan.calibration)
    except torch.linalg.LinAlgError:  # a correlated guide whose covariance is singular (scales of 0): no samples
        log.info("spot check skipped: the guide's covariance is singular, so it cannot be sampled (its parameters "
                 "were checked against the param store)")
        return SpotCheck(True, float("nan"), float("nan"), (0.0, float("inf")), 0, len(xs), time.perf_counter() - t0)
    except PFPError:
        raise
    except Exception as exc:  # the guide or model cannot be run as the check runs them
        raise PosteriorError(f"the spot check could not sample the guide on the model's example arguments "
                             f"({brief(exc)}); convert(..., check=False) skips it") from exc
    n = len(samples)
    mc = np.stack(samples) if samples else np.zeros((0,))
    pfp_mean, pfp_var = d.output["pfp_mean"], d.output["pfp_var"]
    if n < 2 or mc.shape[1:] != np.shape(pfp_mean):
        return SpotCheck(True, float("nan"), float("nan"), (0.0, float("inf")), n, len(xs),
                         time.perf_counter() - t0)
    mc_mean, mc_var = mc.mean(0), mc.var(0, ddof=1)
    keep = random_elements(mc_mean, mc_var)
    finite = bool(np.all(np.isfinite(pfp_mean)) and np.all(np.isfinite(pfp_var)))
    if keep.any():
        se = np.sqrt(mc_var[keep] / n)
        mean_se = float(np.median(np.abs(pfp_mean[keep] - mc_mean[keep]) / se)) if finite else float("inf")
        ratio = float(np.median(pfp_var[keep] / mc_var[keep])) if finite else float("nan")
        kurtosis = np.mean((mc - mc_mean) ** 4, 0)[keep] / np.mean((mc - mc_mean) ** 2, 0)[keep] ** 2
        sigma = math.sqrt((max(float(np.median(kurtosis)), 3.0) - 1.0) / n)
    else:  # a deterministic output: the means must agree as float32 computations do
        scale = float(np.max(np.abs(mc_mean))) + 1e-30 if mc_mean.size else 1.0
        mean_se = 0.0 if finite and float(np.max(np.abs(pfp_mean - mc_mean), initial=0.0)) <= SPOT_DETERMINISTIC * \
            scale else float("inf")
        ratio, sigma = 1.0, math.sqrt(2.0 / n)
    bounds = (math.exp(-SPOT_RATIO_SD * sigma), math.exp(SPOT_RATIO_SD * sigma))
    result = SpotCheck(not _gross(mean_se, ratio, bounds), mean_se, ratio, bounds, n, len(xs),
                       time.perf_counter() - t0)
    if result.passed:
        log.info(result.message())
        return result
    per_layer = compare(net, model, guide, xs, num_samples=num_samples, seed=seed, traced=traced, args=args,
                        calibration=net.plan.calibration)
    first = next((r for r in per_layer.layers if r.deterministic_error > SPOT_DETERMINISTIC or (
        _gross(r.mean_error * math.sqrt(n), r.ratio_median, bounds) and not math.isnan(r.ratio_median))), None)
    result = SpotCheck(False, mean_se, ratio, bounds, n, len(xs), time.perf_counter() - t0, first)
    where = ""
    if first is not None and first.deterministic_error > SPOT_DETERMINISTIC:
        where = (f" The first layer past these bounds is '{first.name}' ({first.op}: where sampling is deterministic "
                 f"its output differs by {first.deterministic_error:.3g} of its size).")
    elif first is not None:
        where = (f" The first layer past these bounds is '{first.name}' ({first.op}: median mean error "
                 f"{first.mean_error * math.sqrt(n):.3g} MC standard errors, variance ratio {first.ratio_median:.3g}).")
    remedy = ("convert(..., correlation='shared-factor') (this network is mean-field: every activation taken as "
              "independent), " if net.plan.correlation == "mean-field" else "")
    raise FidelityError(
        f"the converted network is grossly unlike sampling the trained model: {result.message()}.{where} PFP's "
        f"approximations do not hold for this network as planned, or the posterior was read wrongly. Print "
        f"pyro2pfp.diagnose(model, guide, x) for every layer's figures; remedies: {remedy}a variance calibration "
        "(pyro2pfp.calibrate); convert(..., check=False) skips this check and keeps the network as it is.")
