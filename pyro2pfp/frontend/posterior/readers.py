"""Read every latent site of a Pyro guide, through the guide's own API.

Result: ``{site_name: SiteReading}``.  PFP's linear layers need only each weight's mean and variance,
so a reading is one of

* ``gaussian``: the guide's posterior of the site is Gaussian in the site's value (``var = scale²``,
  Pyro guides keep the standard deviation) — read exactly;
* ``moments``: a non-Gaussian posterior with closed-form mean and variance (e.g. a positive site
  under ``AutoNormal``: ``exp`` of a Normal, i.e. LogNormal with mean ``exp(μ + σ²/2)`` and variance
  ``(exp(σ²) − 1)·exp(2μ + σ²)``) — *moment-matched*: PFP then treats the weight as Gaussian with
  those moments (exact for the mean of a linear layer, and for its variance given independent
  inputs; the shape beyond two moments is dropped);
* ``point``: a point estimate (``AutoDelta``, a guide trained as MAP): fine for a non-weight site
  such as a noise scale, an error for a weight;
* ``unsupported``: anything else (``reason`` says what), an error only if the site is a weight.

Guides read through their own API:

* :class:`~pyro.infer.autoguide.AutoNormal` and subclasses: ``guide._get_loc_and_scale(site)``.
* :class:`~pyro.infer.autoguide.AutoContinuous` guides with a Gaussian posterior
  (``AutoDiagonalNormal``, ``AutoLowRankMultivariateNormal``, ``AutoMultivariateNormal``, the
  ``laplace_approximation()`` of an ``AutoLaplaceApproximation``): ``guide._loc_scale()`` (flat mean
  and marginal standard deviation) unpacked per site with ``guide._unpack_latent``.  Correlations
  are dropped (PFP is mean-field) and a warning says so for the non-diagonal guides.
* :class:`~pyro.infer.autoguide.AutoStructured` with ``"normal"``/``"mvn"``/``"delta"`` conditionals
  and no dependencies between sites: each site is ``loc + aux`` in unconstrained space with ``aux``
  Gaussian (``scale`` per element; ``mvn``: ``diag(scale)·L·Lᵀ·diag(scale)``, whose marginals are
  ``scale²·Σ_j L_ij²``; the correlations as global factors, :mod:`pyro2pfp.frontend.posterior.correlated`).
* :class:`~pyro.infer.autoguide.AutoGuideList`: each part through its own reader.
* Any other guide (hand-written, TyXe, …): the guide is traced once and each sample site's
  distribution is read (``Independent`` unwrapped; ``Normal``; an affine transform of a Normal; a
  ``Delta``, which the guide's author chose for that site, as a Gaussian of variance 0).

Scales of exactly 0 (a collapsed posterior, ``Normal(loc, 0)``, a ``Delta``) are read as variance 0:
the weight is deterministic there.  Pyro's argument validation rejects ``Normal(loc, 0)``, so guides
are run for reading and checking with validation off; :func:`check_readings` then rejects NaN,
infinite and negative values itself, naming the site, its shape and how many values are bad.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import numpy as np
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.distributions import constraints
from pyro.distributions.transforms import AffineTransform, ComposeTransform, ExpTransform, IndependentTransform
from pyro.infer import autoguide
from pyro.poutine.subsample_messenger import _Subsample

from ...errors import PosteriorError, brief

SitePosterior = tuple[np.ndarray, np.ndarray]  # (mean, var), float64


@dataclass
class SiteReading:
    """The posterior of one latent site as PFP sees it: ``mean``/``var`` (float64, the site's shape)
    for ``kind`` in ``gaussian``/``moments``/``point`` (``var`` 0); ``reason`` says what it is."""

    kind: str
    mean: np.ndarray | None = None
    var: np.ndarray | None = None
    reason: str = ""
    shape: tuple[int, ...] = ()
    # The site as transform(z), z ~ Normal(loc, scale) elementwise, where the guide says so:
    # (loc, scale, torch Transform); used to integrate functions of the site by quadrature.
    latent: tuple[np.ndarray, np.ndarray, Any] | None = None
    # Cov(site, z_f) with the guide's global factors z (the site's shape + (k,)), for a correlated guide
    # (:mod:`pyro2pfp.frontend.posterior.correlated`); None: the site is independent of every other.
    factors: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.mean is not None:
            self.shape = tuple(self.mean.shape)

    @property
    def usable_as_weight(self) -> bool:
        return self.kind in ("gaussian", "moments")


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().to(torch.float64).numpy().copy()


def _base_constraint(support: Any) -> Any:
    while isinstance(support, constraints.independent):
        support = support.base_constraint
    return support


def _transform_of(support: Any) -> Any:
    """The bijection from the real line to ``support`` that Pyro's autoguides use."""
    return dist.transforms.biject_to(support)


def _reading(loc: torch.Tensor, scale: torch.Tensor, support: Any, what: str) -> SiteReading:
    """A Normal(loc, scale) in unconstrained space, pushed to ``support`` by Pyro's bijection."""
    transform = _transform_of(support)
    latent = (_np(loc), _np(scale), transform)
    if _base_constraint(support) is constraints.real:
        return SiteReading("gaussian", _np(loc), _np(scale) ** 2, what, latent=latent)
    base = transform
    while isinstance(base, IndependentTransform):
        base = base.base_transform
    parts = base.parts if isinstance(base, ComposeTransform) else [base]
    if all(isinstance(p, ExpTransform | AffineTransform) for p in parts) and \
            sum(isinstance(p, ExpTransform) for p in parts) == 1 and isinstance(parts[0], ExpTransform):
        # exp of a Normal is LogNormal(loc, scale); a following affine a + b·v maps the moments.
        lognormal = dist.LogNormal(loc, scale)
        mean, var = lognormal.mean, lognormal.variance
        for p in parts[1:]:
            assert isinstance(p, AffineTransform)
            mean, var = p.loc + p.scale * mean, p.scale ** 2 * var
        return SiteReading("moments", _np(mean), _np(var),
                           f"{what}: support {support}, exp of a Normal (LogNormal), moment-matched", latent=latent)
    return SiteReading("unsupported", reason=f"{what}: support {support}, a Normal pushed through "
                                             f"{type(transform).__name__} (no closed-form moments)",
                       shape=tuple(loc.shape), latent=latent)


def _from_autonormal(guide: autoguide.AutoNormal) -> dict[str, SiteReading]:
    out = {}
    assert guide.prototype_trace is not None
    for name, site in guide.prototype_trace.iter_stochastic_nodes():
        loc, scale = guide._get_loc_and_scale(name)
        out[name] = _reading(loc, scale, site["fn"].support, type(guide).__name__)
    return out


def _from_autocontinuous(guide: autoguide.AutoContinuous) -> dict[str, SiteReading]:
    if isinstance(guide, autoguide.AutoNormalizingFlow):
        raise PosteriorError(
            f"{type(guide).__name__} is a normalizing-flow guide: its posterior is not Gaussian, so "
            "PFP cannot represent it. Use AutoNormal or AutoDiagonalNormal.")
    if isinstance(guide, autoguide.AutoLaplaceApproximation):
        raise PosteriorError(
            "an AutoLaplaceApproximation is trained as a point estimate (MAP); its Gaussian is "
            "guide.laplace_approximation(*model_args), which needs the training data (the Hessian of "
            "the loss). Convert that: pyro2pfp.convert(model, guide.laplace_approximation(x, y)).")
    try:
        loc, scale = guide._loc_scale()
    except NotImplementedError as exc:
        raise PosteriorError(
            f"{type(guide).__name__} does not expose a Gaussian (loc, scale); PFP needs a Gaussian "
            "posterior (AutoNormal, AutoDiagonalNormal, AutoLowRankMultivariateNormal, "
            "AutoMultivariateNormal).") from exc
    scales = {site["name"]: value for site, value in guide._unpack_latent(scale)}
    return {site["name"]: _reading(value, scales[site["name"]], site["fn"].support, type(guide).__name__)
            for site, value in guide._unpack_latent(loc)}


def _from_autostructured(guide: autoguide.AutoStructured) -> dict[str, SiteReading]:
    """Read an AutoStructured guide (see the module docstring); dependencies between sites are refused."""
    what = type(guide).__name__
    dependencies = guide.dependencies  # a dict once the guide has run (its prototype is set up)
    assert isinstance(dependencies, dict), dependencies
    linked = sorted(name for name, deps in dependencies.items() if deps)
    if linked:
        raise PosteriorError(
            f"{what} with dependencies between sites ({', '.join(linked)} depend on other sites): the marginal "
            "posterior of a site then mixes its upstream sites; PFP reads AutoStructured guides without "
            "dependencies (conditionals 'normal', 'mvn' or 'delta'). Use AutoNormal or drop `dependencies`.")
    out = {}
    for name, site in guide._sorted_sites:
        conditional = guide.conditionals[name]
        shape = guide._batch_shapes[name] + guide._unconstrained_event_shapes[name]
        loc = attrgetter(name)(guide.locs).detach()
        if conditional == "delta":
            value = _transform_of(site["fn"].support)(loc.reshape(shape))
            out[name] = SiteReading("point", _np(value), np.zeros(tuple(value.shape)), f"{what}: 'delta' conditional")
            continue
        if conditional not in ("normal", "mvn"):
            out[name] = SiteReading("unsupported", reason=f"{what}: a custom conditional {conditional!r}",
                                    shape=tuple(site["value"].shape))
            continue
        sd = attrgetter(name)(guide.scales).detach()
        if conditional == "mvn":
            sd = sd * attrgetter(name)(guide.scale_trils).detach().pow(2).sum(-1).sqrt()
        out[name] = _reading(loc.reshape(shape), sd.reshape(shape), site["fn"].support, what)
    return out


def _from_delta(guide: autoguide.AutoDelta) -> dict[str, SiteReading]:
    values = guide.median()
    return {name: SiteReading("point", _np(value), np.zeros(tuple(value.shape)),
                              f"{type(guide).__name__}: a point estimate (no posterior variance)")
            for name, value in values.items()}


def unwrap_independent(fn: Any) -> Any:
    """The base distribution under any ``Independent`` wrappers (Pyro's subclasses torch's)."""
    while isinstance(fn, torch.distributions.Independent):
        fn = fn.base_dist
    return fn


def _read_distribution(fn: Any, what: str) -> SiteReading:
    """A traced sample site's distribution: Normal, an affine map of a Normal, Delta, or moments."""
    shape = tuple(fn.shape())
    fn = unwrap_independent(fn)
    if isinstance(fn, torch.distributions.Normal):
        loc, scale = torch.broadcast_tensors(fn.loc, fn.scale)
        return SiteReading("gaussian", _np(loc), _np(scale) ** 2, what,
                           latent=(_np(loc), _np(scale), torch.distributions.transforms.identity_transform))
    latent = None
    if isinstance(fn, torch.distributions.TransformedDistribution) and \
            isinstance(unwrap_independent(fn.base_dist), torch.distributions.Normal):
        normal = unwrap_independent(fn.base_dist)
        loc, scale = torch.broadcast_tensors(normal.loc, normal.scale)
        latent = (_np(loc), _np(scale), ComposeTransform(list(fn.transforms)))
    if isinstance(fn, torch.distributions.TransformedDistribution):
        base = unwrap_independent(fn.base_dist)
        if isinstance(base, torch.distributions.Normal) and all(isinstance(t, AffineTransform) for t in fn.transforms):
            mean, var = base.loc, base.scale ** 2
            for t in fn.transforms:
                assert isinstance(t, AffineTransform)
                mean, var = t.loc + t.scale * mean, t.scale ** 2 * var
            mean, var = torch.broadcast_tensors(mean, var)
            return SiteReading("gaussian", _np(mean), _np(var), f"{what}: affine map of a Normal")
    if isinstance(fn, dist.Delta):  # a point mass: a Gaussian of variance 0, the weight is deterministic
        value = _np(fn.v)
        return SiteReading("gaussian", value, np.zeros_like(value), f"{what}: Delta (variance 0)",
                           latent=(value, np.zeros_like(value), torch.distributions.transforms.identity_transform))
    try:
        mean, var = torch.broadcast_tensors(fn.mean, fn.variance)
    except NotImplementedError:
        return SiteReading("unsupported", reason=f"{what}: {type(fn).__name__} (no closed-form mean/variance)",
                           shape=shape, latent=latent)
    if torch.isfinite(mean).all() and torch.isfinite(var).all():
        return SiteReading("moments", _np(mean), _np(var),
                           f"{what}: {type(fn).__name__}, moment-matched (mean and variance)", latent=latent)
    return SiteReading("unsupported", reason=f"{what}: {type(fn).__name__} with infinite moments", shape=shape,
                       latent=latent)


class ModelArgs(tuple):
    """The arguments the model and guide are called with while converting: the positional ones (the input
    batch first), ``kwargs``, and whether the user ``given`` them (``convert(..., example_args=...)``).
    Without them, only the input batch is known and further required positional parameters get ``None``
    (``guide(x, y)`` written with the model's signature, ``y`` unused when sampling)."""

    kwargs: dict[str, Any]
    given: bool

    def __new__(cls, args: Any = (), kwargs: dict[str, Any] | None = None, given: bool = False) -> ModelArgs:
        self = super().__new__(cls, tuple(args))
        self.kwargs = dict(kwargs or {})
        self.given = given
        return self

    def replaced(self, args: Any) -> ModelArgs:
        """The same kind of arguments with other positional values."""
        return ModelArgs(args, self.kwargs, self.given)


def _positional_parameters(fn: Callable[..., Any]) -> list[inspect.Parameter] | None:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    return [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def padded_parameters(fn: Callable[..., Any], example_args: tuple) -> list[str]:
    """The required positional parameters of ``fn`` that :func:`call_with_model_args` fills with ``None``."""
    kwargs = getattr(example_args, "kwargs", {})
    params = _positional_parameters(fn)
    if params is None or getattr(example_args, "given", False):
        return []
    return [p.name for p in params[len(example_args):] if p.default is p.empty and p.name not in kwargs]


def call_with_model_args(fn: Callable[..., Any], example_args: tuple) -> Any:
    """Call a model or guide with ``example_args`` (a tuple, or :class:`ModelArgs` with keyword arguments);
    required positional parameters beyond them get ``None`` unless the user gave the arguments."""
    kwargs = getattr(example_args, "kwargs", {})
    return fn(*example_args, *([None] * len(padded_parameters(fn, example_args))), **kwargs)


def call_failure(fn: Callable[..., Any], example_args: tuple, exc: BaseException) -> str:
    """``exc`` raised by ``call_with_model_args(fn, example_args)``, with the parameters that were missing
    and the remedy: ``TypeError: ... (the guide was called as guide(x, cll=None): ...)``."""
    name = getattr(fn, "__name__", None) or type(fn).__name__
    text = brief(exc)
    padded = padded_parameters(fn, example_args)
    params = _positional_parameters(fn) or []
    if padded:
        shown = ", ".join(["x", *[f"{p}=None" for p in padded]])
        needed = ", ".join(["x", *[p.name for p in params[len(example_args):] if p.name in padded]])
        return (f"{text}. convert() called it as {name}({shown}): it only has a batch of inputs, and "
                f"{', '.join(padded)} got None. Pass what {name} needs: convert(model, guide, "
                f"example_args=({needed}), ...) with a few real inputs and labels (or example_kwargs=...); "
                "they are used to run the model and guide, and never enter the network")
    if getattr(example_args, "given", False) and isinstance(exc, TypeError) and "argument" in str(exc):
        return (f"{text}. convert() called {name} with example_args of {len(example_args)} value(s) and "
                f"example_kwargs {sorted(getattr(example_args, 'kwargs', {}))}: pass every argument {name} needs")
    return text


def _from_trace(guide: Any, example_args: tuple) -> dict[str, SiteReading]:
    try:
        with torch.no_grad(), poutine.block():
            trace = poutine.trace(lambda: call_with_model_args(guide, example_args)).get_trace()
    except Exception as exc:  # the guide's own error, re-raised with context
        raise PosteriorError(
            f"could not run the guide {getattr(guide, '__name__', type(guide).__name__)} to read its "
            f"posterior: {call_failure(guide, example_args, exc)}") from exc
    what = getattr(guide, "__name__", type(guide).__name__)
    return {name: _read_distribution(site["fn"], what) for name, site in trace.nodes.items()
            if site["type"] == "sample" and not site["is_observed"]
            and not (site["infer"] or {}).get("is_auxiliary", False)
            and not isinstance(site["fn"], _Subsample)}


def _count(what: str, bad: np.ndarray) -> str | None:
    n = int(np.count_nonzero(bad))
    return f"{n} {what}" if n else None


def check_readings(readings: dict[str, SiteReading], guide: Any) -> None:
    """Raise :class:`PosteriorError` if a site's posterior holds NaN, an infinite Gaussian mean or
    variance, or a negative scale, naming the site, its shape and how many values are bad (a guide
    whose training diverged, a param store written with NaN).  Scales of exactly 0 are valid: the
    site is deterministic there."""
    what = getattr(guide, "__name__", None) or type(guide).__name__
    for name, r in readings.items():
        if r.mean is None or r.var is None:
            continue
        gaussian = r.kind == "gaussian"
        problems = [_count("NaN means", np.isnan(r.mean)), _count("NaN variances", np.isnan(r.var)),
                    _count("infinite means", np.isinf(r.mean)) if gaussian else None,
                    _count("infinite variances", np.isinf(r.var)) if gaussian else None,
                    _count("negative variances", r.var < 0)]
        if r.latent is not None:
            problems.append(_count("negative scales", np.asarray(r.latent[1]) < 0))
        found = [p for p in problems if p]
        if found:
            raise PosteriorError(
                f"the guide {what} gives site '{name}' (shape {tuple(r.mean.shape)}, {r.mean.size} values) "
                f"{', '.join(found)}: a posterior needs finite means and scales ≥ 0. Did training diverge, "
                "or was the param store written with invalid values?")


def read_guide(guide: Any, example_args: tuple) -> dict[str, SiteReading]:
    """Every latent site the guide defines, read through the guide's own API from its current
    parameters (see :func:`pyro2pfp.frontend.posterior.read_posterior`, which first brings them in line with
    the param store)."""
    if isinstance(guide, autoguide.AutoGuideList):
        out: dict[str, SiteReading] = {}
        for part in guide:
            out.update(read_guide(part, example_args))
        return out
    if isinstance(guide, autoguide.AutoGuide) and guide.prototype_trace is None \
            and not isinstance(guide, autoguide.AutoCallable):
        raise PosteriorError(
            f"the {type(guide).__name__} guide has never been run, so it holds no posterior. "
            "Train it with SVI (or load its trained param store) before converting.")
    if isinstance(guide, autoguide.AutoDelta):
        return _from_delta(guide)
    if isinstance(guide, autoguide.AutoNormal):
        return _from_autonormal(guide)
    if isinstance(guide, autoguide.AutoStructured):
        return _from_autostructured(guide)
    if isinstance(guide, autoguide.AutoContinuous):
        return _from_autocontinuous(guide)
    return _from_trace(guide, example_args)

