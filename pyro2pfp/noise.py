"""Regression: the likelihood's noise, so a converted network can give the predictive variance.

For a model whose likelihood is ``Normal(f(x), sigma)`` the predictive distribution of ``obs`` has
(law of total variance, with the weights and ``sigma`` independent under a mean-field posterior)

    E[obs]   = E[f(x)]                        (PFP's mean)
    Var[obs] = Var[f(x)] + E[sigma²]          (epistemic, from the weights: PFP's variance;
                                                aleatoric: the noise)

``sigma`` may be a latent site (``sigma ~ Uniform(0, 10)``, ``HalfNormal``, ``LogNormal``, a
``log_sigma`` site used as ``exp(log_sigma)``, …), a ``PyroParam`` or a constant.  It is found by
running the model once eagerly with every latent site at its posterior mean and reading the
likelihood's ``scale``; the site it depends on is found by perturbing each non-weight site.
``E[sigma²]`` is then exact for a point estimate or a constant, and computed by Gauss–Hermite
quadrature (``NODES`` = 64 nodes, exact for polynomials of degree < 128 in the latent Normal) over
the guide's Normal of the site in unconstrained space otherwise — e.g. ``E[exp(2z)]`` of a LogNormal
to ~1e-12 relative.  A noise scale that depends on the input (a heteroscedastic head) or on several
sites is not supported yet: ``noise`` is then ``None`` with the reason.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyro
import torch
from pyro import poutine
from pyro.poutine.messenger import Messenger
from pyro.poutine.subsample_messenger import _Subsample

from .posterior import SiteReading, call_with_model_args, unwrap_independent

NODES = 64


@dataclass
class NoiseModel:
    """A Normal likelihood's noise: ``expected_variance`` = E[sigma²] per output (network output shape
    without the batch), from site ``site`` (None: a parameter or constant); ``how`` says how."""

    likelihood_site: str
    site: str | None
    expected_variance: np.ndarray
    how: str


@dataclass
class NoNoiseModel:
    """Why a model has no (supported) regression noise: ``reason``."""

    reason: str


class _AtValues(Messenger):
    """Latent sites take the given values; the likelihood (any other sample site) is recorded."""

    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.values = values
        self.likelihoods: list[tuple[str, Any]] = []

    def _pyro_sample(self, msg: Any) -> None:
        if isinstance(msg["fn"], _Subsample):
            return
        if msg["name"] in self.values and not msg["is_observed"]:
            msg["value"] = self.values[msg["name"]]
        else:
            self.likelihoods.append((msg["name"], msg["fn"]))
            if msg["value"] is None:
                msg["value"] = msg["fn"].mean if hasattr(msg["fn"], "mean") else torch.zeros(())
        msg["done"] = True
        msg["stop"] = True


def _value(reading: SiteReading) -> torch.Tensor:
    if reading.mean is not None:
        return torch.as_tensor(reading.mean, dtype=torch.float32)
    assert reading.latent is not None
    loc, _, transform = reading.latent
    return transform(torch.as_tensor(loc, dtype=torch.float32))


def _likelihood_scale(model: Any, values: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[str, Any]:
    """(likelihood site, its scale tensor or None) of one eager run with the sites at ``values``."""
    capture = _AtValues(values)
    with torch.no_grad(), poutine.block(), pyro.validation_enabled(False), capture:
        call_with_model_args(model, (x,))
    if len(capture.likelihoods) != 1:
        return "", None
    name, fn = capture.likelihoods[0]
    fn = unwrap_independent(fn)
    return name, fn.scale.detach().to(torch.float64) if isinstance(fn, torch.distributions.Normal) else None


def _quadrature(reading: SiteReading, scale_at: Any) -> np.ndarray:
    """E[scale(v)²] for the site ``v`` ~ its posterior, elementwise (mean-field)."""
    if reading.kind == "point" or reading.latent is None:
        return scale_at(_value(reading)) ** 2
    loc, sd, transform = reading.latent
    nodes, weights = np.polynomial.hermite.hermgauss(NODES)
    total = 0.0
    for t, w in zip(nodes, weights, strict=True):
        z = torch.as_tensor(loc + np.sqrt(2.0) * sd * t, dtype=torch.float64)
        total = total + w / np.sqrt(np.pi) * scale_at(transform(z).to(torch.float32)) ** 2
    return np.asarray(total)


def find_noise(model: Any, readings: dict[str, SiteReading], nonweight_sites: set[str],
               input_shape: tuple[int, ...]) -> NoiseModel | NoNoiseModel:
    """The model's regression noise, or why there is none (see the module docstring)."""
    x = torch.randn((3, *input_shape), generator=torch.Generator().manual_seed(0))
    values = {site: _value(r) for site, r in readings.items() if r.mean is not None or r.latent is not None}
    try:
        name, scale = _likelihood_scale(model, values, x)
    except Exception as exc:  # the model's own error: no noise model, not a failed conversion
        return NoNoiseModel(f"running the model eagerly failed: {type(exc).__name__}: {exc}")
    if scale is None:
        return NoNoiseModel("the likelihood is not a single Normal(mean, scale) site (classification?)")
    rows = scale.reshape(x.shape[0], -1) if scale.dim() and scale.shape[0] == x.shape[0] else None
    if rows is not None and not torch.allclose(rows, rows[:1].expand_as(rows)):
        return NoNoiseModel("the noise scale depends on the input (a heteroscedastic head): not supported yet")
    per_output = rows[0] if rows is not None else scale.reshape(-1)
    depends = []
    for site in sorted(nonweight_sites & set(values)):
        moved = dict(values, **{site: values[site] * 1.5 + 0.1})
        _, other = _likelihood_scale(model, moved, x)
        if other is None or other.shape != scale.shape or not torch.equal(other, scale):
            depends.append(site)
    if not depends:
        return NoiseModel(name, None, (per_output ** 2).numpy(), "a parameter or constant: exact")
    if len(depends) > 1:
        return NoNoiseModel(f"the noise scale depends on several sites {depends}: not supported yet")
    site = depends[0]

    def scale_at(value: torch.Tensor) -> np.ndarray:
        _, s = _likelihood_scale(model, dict(values, **{site: value}), x)
        assert s is not None
        return (s.reshape(x.shape[0], -1)[0] if s.dim() and s.shape[0] == x.shape[0] else s.reshape(-1)).numpy()

    reading = readings[site]
    how = "exact (point estimate)" if reading.kind == "point" or reading.latent is None else \
        f"Gauss-Hermite quadrature, {NODES} nodes, over the guide's Normal of '{site}'"
    return NoiseModel(name, site, _quadrature(reading, scale_at), how)
