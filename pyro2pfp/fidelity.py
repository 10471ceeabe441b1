"""A converted network that checks its own fidelity against sampling: ``convert(..., check=x)``.

PFP propagates moments in closed form, under approximations (independent activations, Gaussian
pre-activations) that hold better for some networks than for others.  :func:`check_fidelity` tests
them on the user's own inputs: it runs the machinery of :func:`pyro2pfp.diagnose` (``num_samples``
weight sets drawn from the guide, each run through the traced torch model; the float64 NumPy reference
of the plan on the PFP side) and compares the logits' moments with the Monte Carlo ones.  The bounds come from the
sample count ``n`` alone, so they say "further from sampling than ``n`` samples can explain":

* variance ratio (PFP / MC, median over the logits' elements and the inputs): it passes when
  ``|ln ratio| ≤ tolerance·σ``, ``σ`` the noise of the median measured by splitting the samples into
  groups (:func:`pyro2pfp.mc_compare.median_ratio_noise`: the elements share the weight samples, so
  their errors are correlated and the median's noise is not known in advance), at most the
  per-element relative standard error ``√(2/(n−1))`` of a Gaussian's sampled variance (the bound
  when every element's error were the same; ``n = 150``, ``tolerance = 4``: [0.63, 1.59]) and at
  least a tenth of it;
* mean error (median over elements of ``|μ_PFP − μ_MC|`` in MC standard deviations, see
  :mod:`pyro2pfp.mc_compare`): the MC mean is off by ``sd/√n``, so it passes when the median is at most
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

from .errors import ArgumentError, FidelityWarning
from .mc_compare import Diagnosis, LayerFidelity, compare

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


def check_fidelity(net: Any, model: Any, guide: Any, x: Any, *, num_samples: int = DEFAULT_SAMPLES,
                   tolerance: float = DEFAULT_TOLERANCE, seed: int = 0, warn: bool = True) -> FidelityCheck:
    """Compare ``net`` (converted from ``model``, ``guide``) with ``num_samples`` guide samples on the
    inputs ``x`` (a batch); warn with a :class:`~pyro2pfp.errors.FidelityWarning` (``warn=True``) when
    the logits' median variance ratio or mean error leaves the bounds of the module docstring, naming the
    first layer that leaves them; log the result (``logging`` at INFO) when they hold.

    Cost: ``num_samples`` guide samples and torch forward passes of ``x`` (see the module docstring).
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
    t0 = time.perf_counter()
    d = compare(net, model, guide, x, num_samples=num_samples, seed=seed)
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
