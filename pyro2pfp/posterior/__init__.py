"""Stage 2: the posterior ``{site: (mean, var)}`` of a trained Pyro guide, as the param store holds it.

One reader for everything (``convert``, ``calibrate``, the CLI): :func:`read_posterior`

1. builds the parameters of an autoguide that has never run (a guide made in a fresh process before
   ``pyro.get_param_store().load(path)``) — :func:`~.store.setup_guide_prototype`;
2. brings the model's and the guide's parameters in line with the param store (they are a cache of
   it) — :func:`~.store.sync_with_param_store`;
3. reads each site's mean and variance through the guide's own API — :func:`~.readers.read_guide`;
4. checks that one sample of the guide is plausible under what was read —
   :func:`~.guard.check_posterior` (opt out with ``check=False`` for guides that cannot be sampled).

So the converted network reflects the param store at the moment of the call, whether the store was
filled by training, ``load``, ``set_state`` or ``store[name] = value``, and whether or not the guide
has run since.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .guard import check_posterior
from .readers import SitePosterior, read_guide
from .store import setup_guide_prototype, sync_with_param_store

__all__ = ["read_posterior", "SitePosterior", "check_posterior", "sync_with_param_store",
           "setup_guide_prototype"]


def read_posterior(model: Any, guide: Any, sites: Iterable[str], example_args: tuple, *,
                   check: bool = True) -> dict[str, SitePosterior]:
    """Posterior ``(mean, var)`` (float64 arrays, ``var = scale²``) of every site in ``sites`` that the
    guide defines, as the param store holds it now.

    ``model``: the Pyro model (its parameters are synchronised with the store too; it is run, with the
    likelihood hidden, only to set up an autoguide that has never run).  ``example_args``: model
    arguments (an example input batch), used to run/sample the guide.  Sites the guide does not
    define are absent from the result (the caller decides whether that is an error).
    """
    sites = list(sites)
    setup_guide_prototype(model, guide, example_args, set(sites))
    sync_with_param_store(model, "the model")
    sync_with_param_store(guide, f"the {type(guide).__name__} guide")
    posterior = read_guide(guide, sites, example_args)
    if check:
        check_posterior(guide, posterior, example_args)
    return posterior
