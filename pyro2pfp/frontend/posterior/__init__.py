"""Stage 2: the posterior ``{site: (mean, var)}`` of a trained Pyro guide, as the param store holds it.

One reader for everything (``convert``, ``calibrate``, the CLI): :func:`read_posterior`

1. builds the parameters of an autoguide that has never run (a guide made in a fresh process before
   ``pyro.get_param_store().load(path)``) — :func:`~.store.setup_guide_prototype`;
2. brings the model's and the guide's parameters in line with the param store (they are a cache of
   it) — :func:`~.store.sync_with_param_store`;
3. reads each site's mean and variance through the guide's own API — :func:`~.readers.read_guide`
   (scales of 0 are read as variance 0; NaN, infinite or negative values are an error naming the
   site and how many values are bad — :func:`~.readers.check_readings`); a correlated guide's
   covariances between sites are read by :func:`guide_factors` (global factors, into each reading's
   ``factors``);
4. checks that one sample of the guide is plausible under what was read —
   :func:`~.guard.check_posterior` (opt out with ``check=False`` for guides that cannot be sampled).

So the converted network reflects the param store at the moment of the call, whether the store was
filled by training, ``load``, ``set_state`` or ``store[name] = value``, and whether or not the guide
has run since.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pyro

from .correlated import GuideFactors, read_guide_factors
from .guard import check_posterior
from .readers import (
    ModelArgs,
    SitePosterior,
    SiteReading,
    call_failure,
    call_with_model_args,
    check_readings,
    read_guide,
    unwrap_independent,
)
from .store import setup_guide_prototype, sync_with_param_store

__all__ = ["read_posterior", "SitePosterior", "SiteReading", "check_posterior", "sync_with_param_store",
           "setup_guide_prototype", "call_with_model_args", "call_failure", "unwrap_independent", "ModelArgs",
           "ready_to_sample", "GuideFactors", "guide_factors"]


def ready_to_sample(model: Any, guide: Any, example_args: tuple) -> None:
    """Make ``guide`` sample the param store's posterior, as Pyro's ``Predictive`` on it then does: set
    up an autoguide that has never run (likelihood hidden) and bring the model's and guide's cached
    parameters in line with the store.  Unlike :func:`read_posterior` (which ``convert`` runs on objects it
    restores afterwards), this changes the user's guide: for the sampling helpers."""
    setup_guide_prototype(model, guide, example_args, set())
    sync_with_param_store(model, "the model")
    sync_with_param_store(guide, f"the {type(guide).__name__} guide")


def read_posterior(model: Any, guide: Any, example_args: tuple, *, weight_sites: Iterable[str] = (),
                   check: bool = True) -> dict[str, SiteReading]:
    """Every latent site the guide defines (:class:`SiteReading`: mean and variance as float64 arrays,
    ``var = scale²``, and what kind of posterior it is), as the param store holds it now.

    ``model``: the Pyro model (its parameters are synchronised with the store too; it is run, with the
    likelihood hidden, only to set up an autoguide that has never run).  ``example_args``: model
    arguments (an example input batch), used to run/sample the guide.  ``weight_sites``: sites known
    to be weights (never hidden when an autoguide is set up).  Which sites the model uses as weights,
    and whether their readings are usable, is the caller's decision.
    """
    setup_guide_prototype(model, guide, example_args, set(weight_sites))
    sync_with_param_store(model, "the model")
    sync_with_param_store(guide, f"the {type(guide).__name__} guide")
    with pyro.validation_enabled(False):  # Normal(loc, 0) is a valid (deterministic) posterior here
        readings = read_guide(guide, example_args)
    check_readings(readings, guide)
    if check:
        gaussian = {name: (r.mean, r.var) for name, r in readings.items()
                    if r.kind == "gaussian" and r.mean is not None and r.var is not None}
        check_posterior(guide, gaussian, example_args)
    return readings


def guide_factors(guide: Any, readings: dict[str, SiteReading]) -> GuideFactors | None:
    """Read a correlated guide's global factors (:func:`~.correlated.read_guide_factors`; the parts of an
    ``AutoGuideList`` each on their own, their factor columns side by side) into ``readings[site].factors``;
    returns them (None: a guide without correlations between weights)."""
    from pyro.infer import autoguide

    parts = list(guide) if isinstance(guide, autoguide.AutoGuideList) else [guide]
    # the parts of a list side by side, each its own top directions (no candidates to select from)
    found = [f for f in (read_guide_factors(part, readings, candidates=None if len(parts) == 1 else 0)
                         for part in parts) if f is not None]
    if not found:
        return None
    total = sum(f.k for f in found)
    start = 0
    merged = GuideFactors(rank=sum(f.rank for f in found), k=total,
                          kept=min(f.kept for f in found), source=" + ".join(f.source for f in found),
                          keep=sum(f.keep or f.k for f in found))
    for f in found:
        for site, loading in f.loadings.items():
            full = np.zeros(loading.shape[:-1] + (total,))
            full[..., start:start + f.k] = loading
            merged.loadings[site] = full
        start += f.k
    for site, loading in merged.loadings.items():
        readings[site].factors = loading
    return merged
