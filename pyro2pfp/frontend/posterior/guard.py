"""The consistency guard: is the posterior that was read the one the guide actually samples from?

A posterior read from a stale cache (a guide's module parameters that do not reflect the param store)
is a silent wrong answer: the network converts, compiles and predicts, from the wrong weights.  The
guard draws one sample of every weight site with the guide's own sampler (``poutine.trace(guide)``,
which runs the guide, so its parameters are the param store's) and tests it against what was read:

* mean-field sites: the standardised residuals ``r = (z − mean) / sd`` over all ``n`` weights are
  i.i.d. N(0, 1) if the read is right, so ``Σ r²`` is χ²(n) and ``mean(r)`` is N(0, 1/n).  A wrong mean
  (shift ``δ`` sd) raises ``mean(r²)`` by ``δ²``; a scale off by a factor ``k`` multiplies it by
  ``1/k²``.  The test is two-sided at a false-alarm probability of ``ALPHA`` = 1e-9 per statistic
  (χ² quantiles), globally and per site.  Samples are drawn until about ``RESIDUALS`` = 20,000
  residuals are tested (one sample for a net of ≥ 20,000 weights, at most ``MAX_SAMPLES``), so a
  scale off by 20 % (``mean(r²)`` = 0.69 or 1.44 against bounds of about 1 ± 0.07) or a mean off by
  0.2 sd in one direction (``|mean(r)|`` = 0.2 against about 0.04) fails with overwhelming probability.
* correlated Gaussian guides (``AutoMultivariateNormal``, ``AutoLowRankMultivariateNormal``,
  ``AutoLaplaceApproximation``): the flat latent sample is whitened with the guide's own covariance
  around the mean that was read: ``d² = (z − mean)ᵀ Σ⁻¹ (z − mean) = −2 (log p(z) − log p(mean))`` is
  χ²(n) (a full covariance: over the principal directions the float32 sample's rounding cannot reach,
  :func:`resolved_whitening`); the marginal variances that were read must equal ``diag Σ``.
* entries read with variance 0 (deterministic: a scale of exactly 0, a ``Delta``) must be sampled
  exactly at their mean, and entries whose sd float32 cannot resolve (below ``1e-5·|mean|`` or below
  float32's smallest normal number, e.g. scales of 1e-30) within ``k`` sd plus float32's rounding of
  the mean (``k``: the normal quantile at ``ALPHA`` over the number of such entries); the residual
  and whitening statistics use the resolvable entries only (a Gaussian's marginal over a subset of
  its coordinates is the sub-vector and sub-covariance, so the test stays exact);
* every parameter of a ``PyroModule`` guide that the param store also holds must have the store's
  values (a guide's plain ``nn.Parameter``, e.g. ``AutoDiagonalNormal.loc``, is not refreshed by
  running the guide, so a stale one would pass the sampling test: sampler and reader share it).

Guides are sampled with Pyro's argument validation off, so that ``Normal(loc, 0)`` samples ``loc``
(the reader has already rejected NaN, infinite and negative values).  A correlated guide whose
covariance is singular because scales are 0 (``AutoLowRankMultivariateNormal``: torch cannot build
a ``LowRankMultivariateNormal`` whose diagonal has zeros) cannot be sampled at all; its parameters are
then still checked against the param store, and no sample is drawn.  Other guides that cannot be
sampled can opt out with ``convert(..., check_posterior=False)``.
"""
from __future__ import annotations

from typing import Any, NoReturn

import numpy as np
import pyro
import torch
from pyro import poutine
from pyro.infer import autoguide
from pyro.nn import PyroModule
from scipy import stats

from ...errors import PosteriorError
from .readers import call_failure, call_with_model_args
from .store import full_name, module_local_params, named_pyro_modules

ALPHA = 1e-9
RESIDUALS = 20_000  # residuals per check: mean(r²) then has sd 0.01, a 20 % scale error moves it ≥ 0.3
MAX_SAMPLES = 64
_FLOAT32_RESOLUTION = 1e-5
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32; below it sd loses precision
_FLOAT32_EPS = float(np.finfo(np.float32).eps)

SitePosterior = tuple[np.ndarray, np.ndarray]


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().to(torch.float64).numpy()


def chi2_mean_square_bounds(n: int, alpha: float = ALPHA) -> tuple[float, float]:
    """Two-sided bounds on ``mean(r²)`` of ``n`` i.i.d. N(0, 1) values at false-alarm ``alpha``."""
    return float(stats.chi2.ppf(alpha / 2, n) / n), float(stats.chi2.isf(alpha / 2, n) / n)


def mean_bound(n: int, alpha: float = ALPHA) -> float:
    """Two-sided bound on ``|mean(r)|`` of ``n`` i.i.d. N(0, 1) values at false-alarm ``alpha``."""
    return float(stats.norm.isf(alpha / 2) / np.sqrt(n))


def _sample_guide(guide: Any, example_args: tuple, singular_ok: bool) -> Any:
    """One trace of the guide, or None if ``singular_ok`` and its covariance is singular."""
    try:
        with torch.no_grad(), poutine.block(), pyro.validation_enabled(False):
            return poutine.trace(lambda: call_with_model_args(guide, example_args)).get_trace()
    except Exception as exc:
        if singular_ok and isinstance(exc, torch.linalg.LinAlgError):
            return None
        _raise_sampling_error(guide, example_args, exc)


def _raise_sampling_error(guide: Any, example_args: tuple, exc: Exception) -> NoReturn:
    raise PosteriorError(
        f"the consistency check could not sample the guide {type(guide).__name__}: "
        f"{call_failure(guide, example_args, exc)}. "
        "If this guide cannot be sampled, convert with "
        "check_posterior=False (then nothing checks that the posterior read is the trained one)."
    ) from exc


def resolvable(loc: np.ndarray, var: np.ndarray) -> np.ndarray:
    """Entries whose sd a float32 sample resolves: above ``1e-5·|mean|`` and float32's smallest normal."""
    return (var > (_FLOAT32_RESOLUTION * np.abs(loc)) ** 2) & (var >= _FLOAT32_TINY ** 2)


def _unresolved_failure(name: str, z: np.ndarray, loc: np.ndarray, var: np.ndarray, k: float) -> str | None:
    """Entries of variance 0 must be sampled at their mean exactly, the other unresolvable ones within
    ``k`` sd plus float32's rounding of the mean; a failure message naming the count, else None."""
    exact = var == 0
    bad = int(np.count_nonzero(z[exact] != loc[exact]))
    if bad:
        return f"'{name}': {bad} entries read as deterministic (variance 0) were sampled at another value"
    tiny = ~exact & ~resolvable(loc, var)
    sd = np.sqrt(var[tiny])
    tol = k * sd * (1 + 1e-6) + 2 * _FLOAT32_EPS * (np.abs(loc[tiny]) + k * sd) + 2.0 ** -140
    far = int(np.count_nonzero(np.abs(z[tiny] - loc[tiny]) > tol))
    if far:
        return (f"'{name}': {far} entries read with an sd below float32's resolution were sampled more than "
                f"{k:.3g} sd from their mean")
    return None


def _describe(name: str, n: int, mean: float, mean_square: float) -> str:
    return f"'{name}' ({n} weights: mean residual {mean:+.3g} sd, mean squared residual {mean_square:.3g})"


def _residual_failures(residuals: dict[str, np.ndarray]) -> list[str]:
    """Sites (and 'all weights') whose residual statistics fall outside the bounds."""
    failures = []
    per_site_alpha = ALPHA / max(len(residuals), 1)
    for name, r in residuals.items():
        if r.size == 0:
            continue
        lo, hi = chi2_mean_square_bounds(r.size, per_site_alpha)
        ms, m = float(np.mean(r * r)), float(np.mean(r))
        if not (lo <= ms <= hi) or abs(m) > mean_bound(r.size, per_site_alpha):
            failures.append(_describe(name, r.size, m, ms))
    everything = np.concatenate([r for r in residuals.values()]) if residuals else np.zeros(0)
    if everything.size and not failures:
        lo, hi = chi2_mean_square_bounds(everything.size)
        ms, m = float(np.mean(everything ** 2)), float(np.mean(everything))
        if not (lo <= ms <= hi) or abs(m) > mean_bound(everything.size):
            failures.append(_describe("all weights", everything.size, m, ms))
    return failures


def _correlated_latent(guide: Any, trace: Any) -> dict | None:
    if not isinstance(guide, autoguide.AutoContinuous) or isinstance(guide, autoguide.AutoDiagonalNormal):
        return None
    node = trace.nodes.get(f"_{guide._pyro_name}_latent")
    return node if node is not None and node["type"] == "sample" else None


def _check_correlated(guide: Any, node: dict, posterior: dict[str, SitePosterior],
                      whitened: list[tuple[float, int]], cache: dict) -> list[str]:
    """The read marginal variances against the guide's covariance; appends the squared whitened
    residual of the flat latent around the read means (and its size) to ``whitened`` (a full covariance:
    :func:`resolved_whitening`, whose decomposition ``cache`` keeps between samples)."""
    fn = node["fn"]
    z = node["value"].detach().to(torch.float64)
    sites = [site["name"] for site, _ in guide._unpack_latent(z)]
    if any(name not in posterior for name in sites):
        return []
    loc = torch.cat([torch.as_tensor(posterior[n][0]).reshape(-1) for n in sites])
    var = torch.cat([torch.as_tensor(posterior[n][1]).reshape(-1) for n in sites])
    if loc.shape != z.shape:
        return [f"the flat latent has {z.numel()} entries but the sites read have {loc.numel()}"]
    failures = []
    guide_var = fn.variance.detach().to(torch.float64)
    # Variances below float32's smallest normal are 0 or imprecise in the guide's float32 covariance.
    bad = ~torch.isclose(var, guide_var, rtol=1e-4, atol=_FLOAT32_TINY)
    if bad.any():
        failures.append(f"{int(bad.sum())} marginal variances read differ from the guide's covariance diagonal")
    # Whiten the resolvable coordinates only: their marginal is the sub-vector's Gaussian.
    keep = torch.as_tensor(resolvable(loc.numpy(), var.numpy()))
    low_rank = isinstance(fn, torch.distributions.LowRankMultivariateNormal)
    if low_rank:
        cov_diag = fn.cov_diag.detach().to(torch.float64)
        keep &= cov_diag > 0
    n = int(keep.sum())
    if n == 0:
        return failures
    if low_rank:
        gaussian = torch.distributions.LowRankMultivariateNormal(
            loc[keep], fn.cov_factor.detach().to(torch.float64)[keep], cov_diag[keep])
        whitened.append((float(-2.0 * (gaussian.log_prob(z[keep]) - gaussian.log_prob(loc[keep]))), n))
    else:
        whitened.append(resolved_whitening(z[keep] - loc[keep], fn.scale_tril.detach()[keep], loc[keep], cache))
    return failures


def resolved_whitening(residual: torch.Tensor, rows: torch.Tensor, mean: torch.Tensor, cache: dict
                       ) -> tuple[float, int]:
    """``(d², m)``: the squared whitened ``residual`` (float64) of a sample ``mean + rows·ε`` drawn in float32
    (``Σ = rows·rowsᵀ``), over the ``m`` principal directions of ``Σ`` that its float32 rounding cannot reach.
    A trained full covariance is ill-conditioned (a unit-lower-triangular factor over 1,443 dimensions:
    eigenvalues from 1e4 down to 1e-29), and whitening along a direction of sd ``σ_j`` divides the sample's
    rounding error ``δ`` by ``σ_j``: whitened over all directions, a correct sample's mean square is 1e23,
    not 1.  Along the directions ``u_j`` with ``σ_j ≥ 100·‖δ‖`` -- ``‖δ‖`` taken as ten times the rounding
    of the same float32 product measured on a fixed probe, plus float32's rounding of a sample's size
    (``‖mean‖ + 3·‖rows‖_F``) -- ``u_jᵀ(value − mean)/σ_j`` are i.i.d. N(0, 1) up to 0.01 (a Gaussian's
    projection on orthonormal directions), so ``d²`` is χ²(m) for a right posterior.  The eigenvectors of
    ``Σ`` (float64; their eigenvalues' rounding, ``1e-16·λ_max``, is far below the threshold) are computed
    once per guide (``cache``)."""
    if "whiten" not in cache:
        rows64 = rows.to(torch.float64)
        probe = torch.randn(rows.shape[1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        rounding = float(torch.linalg.vector_norm((rows @ probe.to(rows.dtype)).to(torch.float64) - rows64 @ probe))
        size = float(torch.linalg.vector_norm(mean.to(torch.float64)) + 3 * torch.linalg.matrix_norm(rows64))
        eig, u = torch.linalg.eigh(rows64 @ rows64.T)  # faster than the SVD of rows
        sd = eig.clamp(min=0.0).sqrt()
        use = sd >= 100 * (10 * rounding + _FLOAT32_EPS * size)
        cache["whiten"] = u[:, use].T / sd[use, None]
    y = cache["whiten"] @ residual
    return float(y @ y), int(y.numel())


def stale_parameters(guide: Any) -> list[str]:
    """Param-store names whose values differ from the ``PyroModule`` guide parameter of that name."""
    if not isinstance(guide, PyroModule) or module_local_params():
        return []
    store = pyro.get_param_store()
    stale = []
    for sub in named_pyro_modules(guide):
        for attr, param in sub._parameters.items():
            if param is None:
                continue
            name = full_name(sub, attr.removesuffix("_unconstrained"))
            if name in store:
                stored = store._params[name]
                if stored.shape != param.shape or not torch.equal(stored.detach(), param.detach()):
                    stale.append(name)
    return stale


def num_samples_for(n: int) -> int:
    """Guide samples to draw so that about ``RESIDUALS`` residuals are tested (at most ``MAX_SAMPLES``):
    one sample of a large net already has the power to see a scale 20 % off; a small one needs more."""
    return int(min(MAX_SAMPLES, max(1, -(-RESIDUALS // max(n, 1)))))


def check_posterior(guide: Any, posterior: dict[str, SitePosterior], example_args: tuple) -> None:
    """Raise :class:`PosteriorError` unless samples of the guide are plausible under ``posterior``
    (``{site: (mean, var)}``, float64).  See the module docstring for the test and its bounds."""
    if not posterior:
        return
    failures = [f"the guide's parameter '{name}' differs from the param store's"
                for name in stale_parameters(guide)]
    n = sum(loc.size for loc, _ in posterior.values())
    unresolved = sum(int(np.count_nonzero(~resolvable(loc, var))) for loc, var in posterior.values())
    k = float(stats.norm.isf(ALPHA / 2 / max(unresolved, 1)))
    residuals: dict[str, list[np.ndarray]] = {name: [] for name in posterior}
    whitened: list[tuple[float, int]] = []
    cache: dict = {}
    for _ in range(num_samples_for(n)):
        trace = _sample_guide(guide, example_args, singular_ok=unresolved > 0 and isinstance(guide, PyroModule))
        if trace is None:  # a singular covariance (scales of 0): the parameters were checked above
            break
        for name, (loc, var) in posterior.items():
            node = trace.nodes.get(name)
            if node is None or node["type"] != "sample":
                failures.append(f"'{name}' was read from the guide but the guide does not sample it")
                continue
            z = _np(node["value"])
            if z.shape != loc.shape:
                failures.append(f"'{name}': read with shape {loc.shape}, sampled with shape {z.shape}")
                continue
            failure = _unresolved_failure(name, z, loc, var, k)
            if failure is not None:
                failures.append(failure)
            fine = resolvable(loc, var)
            residuals[name].append(((z - loc)[fine] / np.sqrt(var[fine])).ravel())
        correlated = _correlated_latent(guide, trace)
        if correlated is not None:
            failures += _check_correlated(guide, correlated, posterior, whitened, cache)
        if failures:
            break
    if whitened:
        d2, dof = sum(d for d, _ in whitened), sum(k for _, k in whitened)
        lo, hi = chi2_mean_square_bounds(dof)
        if not (lo <= d2 / dof <= hi):
            failures.append(f"the whitened latent samples have mean square {d2 / dof:.3g} "
                            f"(expected 1 within [{lo:.3g}, {hi:.3g}])")
    elif not failures:
        failures += _residual_failures({k: np.concatenate(v) for k, v in residuals.items() if v})
    if failures:
        unique = list(dict.fromkeys(failures))
        raise PosteriorError(
            f"the posterior read from the {type(guide).__name__} guide is not the one the guide samples "
            f"from: {'; '.join(unique[:5])}{' …' if len(unique) > 5 else ''}. The guide's parameters "
            "probably do not reflect the param store (a stale cache), or the guide computes its "
            "distribution in a way the reader does not follow. Please report this; to convert anyway, "
            "pass check_posterior=False.")
