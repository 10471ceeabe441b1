"""What one run of a Pyro model gives as the network's output, with its likelihood made inert.

A model's ``forward`` ends in a likelihood (``pyro.sample("obs", Categorical(logits=z), obs=y)``), which
PFP strips: it is not part of the network.  While the model runs for conversion (traced, or run eagerly
to check the traced network against it), :class:`LikelihoodSites` records every sample site that no
other handler has given a value (the likelihood, or a latent site when ``latent`` says so) and makes it
return its observed value or the mean that feeds it, so nothing is sampled and no data are needed.
:func:`network_output` then says what the run's output is: the model's return value, or -- when it
returns nothing (``None``) or its likelihood's sample -- the tensor the likelihood is built from
(:func:`pyro2pfp.frontend.output_chain.network_output_of`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from pyro.poutine.messenger import Messenger
from pyro.poutine.subsample_messenger import _Subsample

from .output_chain import network_output_of
from .posterior.readers import unwrap_independent


def likelihood_mean(fn: Any) -> torch.Tensor:
    """What a model that returns its likelihood's sample is taken to return: the ``loc`` (the network
    output) of a Normal-like likelihood, else a placeholder."""
    loc = getattr(unwrap_independent(fn), "loc", None)
    return loc if isinstance(loc, torch.Tensor) else torch.zeros(())


class LikelihoodSites(Messenger):
    """Record, and make inert, the sample sites that reach this handler without a value.

    ``latent(msg)``: a value for a latent site (or None: the site is treated as a likelihood).  Sites
    another handler has already decided (``done``, e.g. replayed from a guide trace) are left alone;
    plates keep working.  ``likelihoods``: ``[(name, distribution)]`` of the sites made inert;
    ``placeholders``: the values they returned where nothing was observed (held, so that no other tensor
    takes the ``id`` of one that was freed)."""

    def __init__(self, latent: Callable[[dict], torch.Tensor | None] | None = None) -> None:
        super().__init__()
        self.latent = latent
        self.likelihoods: list[tuple[str, Any]] = []
        self.placeholders: list[torch.Tensor] = []

    def _pyro_sample(self, msg: dict) -> None:
        if isinstance(msg["fn"], _Subsample) or msg.get("done"):
            return
        value = self.latent(msg) if self.latent is not None and not msg["is_observed"] else None
        if value is not None:
            msg["value"] = value
        else:
            self.likelihoods.append((msg["name"], msg["fn"]))
            if msg["value"] is None:
                placeholder = likelihood_mean(msg["fn"])
                msg["value"] = placeholder
                self.placeholders.append(placeholder)
        msg["done"] = True
        msg["stop"] = True


def network_output(out: Any, sites: LikelihoodSites) -> Any:
    """The run's network output: ``out`` (what the model returned), or the tensor its one likelihood is
    built from when the model returns nothing or the likelihood's (placeholder) sample."""
    if out is None or any(out is p for p in sites.placeholders):
        built_from = [t for t in (network_output_of(fn) for _, fn in sites.likelihoods) if t is not None]
        if len(built_from) == 1:
            return built_from[0]
    return out
