"""Match the guide's latent sites to what the model does with them — no silent mismatch.

Every latent site of the guide must be one of

* a **weight**: a ``PyroSample`` attribute of a module, or a site sampled in ``forward`` whose value
  flows into the network's output (``w = pyro.sample("w", …)`` then ``x @ w``; the lifted parameters
  ``module$$$fc1.weight`` of ``pyro.random_module``).  Its posterior must have a mean and a variance
  (Gaussian, or a non-Gaussian posterior matched by its two moments);
* a **non-weight** site: sampled by the model but not flowing into the output (a likelihood's noise
  scale ``sigma``, …).  Any posterior is fine (``AutoDelta`` too): PFP does not propagate it.

A guide site the model never samples (a typo, a guide of another model, a wrapped guide that
samples under other names) is an error listing the unmatched sites and the model's parameters, and
so is a guide with latent sites but a network without a single random weight.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from ..errors import PosteriorError
from .posterior import SiteReading


def guide_name(guide: Any) -> str:
    return getattr(guide, "__name__", None) or type(guide).__name__


def require_weight_posterior(site: str, where: str, reading: SiteReading, guide: Any) -> None:
    """Raise unless the posterior of weight ``site`` (used at ``where``) has a mean and a variance."""
    if reading.usable_as_weight:
        return
    why = {"point": "a point estimate without a variance (AutoDelta, trained as MAP): PFP needs each weight's "
                    "posterior variance. Use AutoNormal for the weights (an AutoDelta part of an "
                    "AutoGuideList is fine for non-weight sites such as a noise scale)",
           "unsupported": "a posterior without closed-form mean and variance; PFP needs each weight's mean and "
                          "variance: use a Normal posterior (or another with finite mean and variance) for "
                          "the weights"}.get(reading.kind, reading.kind)
    raise PosteriorError(f"site '{site}' is a weight ({where}), but the guide {guide_name(guide)} gives it "
                         f"{why} [{reading.reason}]")


def _guide_model_name(guide: Any) -> str:
    """The class or function name of the model an autoguide was built for ('' if unknown)."""
    try:
        model = getattr(guide, "model", None)
    except Exception:  # an autoguide's model property on a guide that lost its model
        return ""
    if model is None or not callable(model):
        return ""
    while isinstance(model, functools.partial) and model.args:  # InitMessenger(init)(model): partial(…, model)
        model = model.args[-1]
    return getattr(model, "__name__", None) or type(model).__name__


def check_all_matched(readings: dict[str, SiteReading], weight_sites: Iterable[str],
                      nonweight_sites: Iterable[str], model_parameters: Iterable[str], guide: Any,
                      model_name: str = "") -> None:
    """Raise if a guide site is neither a weight nor a non-weight site of the model (with the remedy
    of passing the guide's own model when the model uses none of them), or if the guide has latent
    sites but none of them is a weight."""
    weights, others = set(weight_sites), set(nonweight_sites)
    unmatched = sorted(set(readings) - weights - others)
    names = sorted(model_parameters)
    if unmatched and not weights and not others and not names:
        trained_for = _guide_model_name(guide)
        raise PosteriorError(
            f"the model {model_name or 'passed'} uses none of the guide {guide_name(guide)}'s sites "
            f"{unmatched[:6]}{' …' if len(unmatched) > 6 else ''}: it samples no site and has no parameters, so "
            "it does not run the network whose posterior the guide holds. Pass the model the guide was trained "
            f"for{f' ({trained_for})' if trained_for else ''}: the network itself (a PyroModule with PyroSample "
            "weights), or a model function that runs it (pyro.random_module style), as convert(model, guide).")
    if unmatched:
        raise PosteriorError(
            f"the guide {guide_name(guide)} samples sites {unmatched[:6]}{' …' if len(unmatched) > 6 else ''} "
            f"that the model never samples; the model's weights are {sorted(weights)[:8] or 'none'} and its "
            f"parameters {names[:8]}{' …' if len(names) > 8 else ''}. Is the guide the one trained for this "
            "model (site names must match the model's sample sites)?")
    if readings and not weights:
        raise PosteriorError(
            f"the guide {guide_name(guide)} has latent sites {sorted(readings)[:6]}, but none of them is a weight "
            f"of the network (all are {', '.join(sorted(others)[:4])}: sampled by the model but not flowing "
            "into its output), so the converted network would be deterministic. PFP propagates weight "
            "uncertainty: put PyroSample priors on the weights.")
