"""Read a mean-field Gaussian posterior from a Pyro guide, through the guide's own API.

Result: ``{site_name: (loc, var)}`` with float64 NumPy arrays, ``var = scale²`` (Pyro guides keep the
standard deviation).  Supported:

* :class:`~pyro.infer.autoguide.AutoNormal` and subclasses: ``guide._get_loc_and_scale(site)``.
* :class:`~pyro.infer.autoguide.AutoContinuous` guides with a Gaussian posterior
  (``AutoDiagonalNormal``, ``AutoLowRankMultivariateNormal``, ``AutoMultivariateNormal``,
  ``AutoLaplaceApproximation``): ``guide._loc_scale()`` (flat mean and marginal standard deviation)
  unpacked per site with ``guide._unpack_latent``.  Correlations are dropped (PFP is mean-field) and
  a warning says so for the non-diagonal guides.
* Any other guide (hand-written, TyXe, …): the guide is traced once and each sample site's
  distribution is read (``Independent`` is unwrapped to its ``Normal`` base).

Latent sites must have real support (a Normal/Laplace/… prior on the real line), so that the
guide's unconstrained Gaussian is the posterior of the weight itself.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.distributions import constraints
from pyro.infer import autoguide

from ..errors import PosteriorError

SitePosterior = tuple[np.ndarray, np.ndarray]  # (loc, var), float64


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().to(torch.float64).numpy().copy()


def _is_real_support(support: Any) -> bool:
    while isinstance(support, constraints.independent):
        support = support.base_constraint
    return support is constraints.real


def _check_real_support(guide: Any, name: str, fn: Any) -> None:
    if not _is_real_support(fn.support):
        raise PosteriorError(
            f"sample site '{name}' has support {fn.support} (prior {type(fn).__name__}); the "
            f"{type(guide).__name__} posterior of such a site is not Gaussian in the weight itself. "
            "PFP needs weights with real support (e.g. Normal or Laplace priors)."
        )


def _from_autonormal(guide: autoguide.AutoNormal) -> dict[str, SitePosterior]:
    out = {}
    for name, site in guide.prototype_trace.iter_stochastic_nodes():
        _check_real_support(guide, name, site["fn"])
        loc, scale = guide._get_loc_and_scale(name)
        out[name] = (_np(loc), _np(scale) ** 2)
    return out


_CORRELATED = (autoguide.AutoMultivariateNormal, autoguide.AutoLowRankMultivariateNormal)


def _from_autocontinuous(guide: autoguide.AutoContinuous) -> dict[str, SitePosterior]:
    if isinstance(guide, autoguide.AutoNormalizingFlow):
        raise PosteriorError(
            f"{type(guide).__name__} is a normalizing-flow guide: its posterior is not Gaussian, so "
            "PFP cannot represent it. Use AutoNormal or AutoDiagonalNormal."
        )
    try:
        loc, scale = guide._loc_scale()
    except NotImplementedError as exc:
        raise PosteriorError(
            f"{type(guide).__name__} does not expose a Gaussian (loc, scale); PFP needs a Gaussian "
            "posterior (AutoNormal, AutoDiagonalNormal, AutoLowRankMultivariateNormal, "
            "AutoMultivariateNormal)."
        ) from exc
    if isinstance(guide, _CORRELATED):
        warnings.warn(
            f"{type(guide).__name__} models correlations between weights; PFP is mean-field and "
            "uses only the marginal variances (correlations are dropped).",
            stacklevel=6,  # the user's convert() call
        )
    scales = {site["name"]: value for site, value in guide._unpack_latent(scale)}
    out = {}
    for site, value in guide._unpack_latent(loc):
        name = site["name"]
        _check_real_support(guide, name, site["fn"])
        out[name] = (_np(value), _np(scales[name]) ** 2)
    return out


def _unwrap(fn: Any) -> Any:
    while isinstance(fn, dist.Independent | torch.distributions.Independent):
        fn = fn.base_dist
    return fn


def _from_trace(guide: Any, example_args: tuple, sites: Iterable[str]) -> dict[str, SitePosterior]:
    try:
        with torch.no_grad():
            trace = poutine.trace(guide).get_trace(*example_args)
    except Exception as exc:  # the guide's own error, re-raised with context
        raise PosteriorError(
            f"could not run the guide {type(guide).__name__} to read its posterior: {exc}"
        ) from exc
    out = {}
    for name in sites:
        site = trace.nodes.get(name)
        if site is None or site["type"] != "sample":
            continue
        fn = _unwrap(site["fn"])
        if not isinstance(fn, torch.distributions.Normal):
            raise PosteriorError(
                f"guide {type(guide).__name__} samples site '{name}' from {type(fn).__name__}; PFP "
                "needs a mean-field Gaussian (Normal) posterior for every weight."
            )
        loc, scale = torch.broadcast_tensors(fn.loc, fn.scale)
        out[name] = (_np(loc), _np(scale) ** 2)
    return out


def read_guide(guide: Any, sites: Iterable[str], example_args: tuple) -> dict[str, SitePosterior]:
    """Posterior ``(loc, var)`` of every site in ``sites`` that the guide defines, read through the
    guide's own API from its current parameters (see :func:`pyro2pfp.posterior.read_posterior`, which
    first brings them in line with the param store).

    Sites the guide does not define are simply absent from the result (the caller decides whether
    that is an error).  ``example_args`` are model arguments used only to trace guides that must be
    run to reveal their distributions.
    """
    sites = list(sites)
    if isinstance(guide, autoguide.AutoDelta):
        raise PosteriorError(
            f"{type(guide).__name__} gives point estimates (no posterior variance) for sites "
            f"{sites[:3]}…; PFP needs a Gaussian posterior. Train with AutoNormal instead."
        )
    if isinstance(guide, autoguide.AutoGuide) and not isinstance(guide, autoguide.AutoGuideList):
        if guide.prototype_trace is None:
            raise PosteriorError(
                f"the {type(guide).__name__} guide has never been run, so it holds no posterior. "
                "Train it with SVI (or call it once with the model's arguments) before converting."
            )
        if isinstance(guide, autoguide.AutoNormal):
            return _from_autonormal(guide)
        if isinstance(guide, autoguide.AutoContinuous):
            return _from_autocontinuous(guide)
    return _from_trace(guide, example_args, sites)
