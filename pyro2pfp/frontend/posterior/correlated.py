"""The correlated part of a Gaussian guide, as global factors: ``w = mean + Σ_f F[:, f]·z_f + rest``.

A correlated Gaussian guide's latent vector (the concatenation of every site in unconstrained space,
``guide._unpack_latent`` order) has covariance ``Σ``:

* ``AutoLowRankMultivariateNormal``: ``Σ = F·Fᵀ + diag(d²)`` (``get_posterior()``: a
  ``LowRankMultivariateNormal`` with ``cov_factor`` F, D × R, and ``cov_diag`` d²) -- already factors;
* ``AutoMultivariateNormal`` and the ``laplace_approximation()`` of an ``AutoLaplaceApproximation``:
  ``Σ = L·Lᵀ`` (a ``MultivariateNormal``'s ``scale_tril``);
* ``AutoStructured`` with ``"mvn"`` conditionals: per site ``diag(s)·L·Lᵀ·diag(s)`` (a dense block,
  nothing shared between sites).

PFP carries ``k`` global factors ``z ~ N(0, I_k)`` through the network (shared-factor PFP: each factor
enters every layer through its weights and is propagated by the scheme's rules), so the covariance is
written as ``Σ ≈ F_k·F_kᵀ + diag(d²)``: ``F_k`` the top ``k`` principal directions of ``Σ`` (the
eigenvectors of ``Σ`` scaled by the square roots of their eigenvalues, from the SVD of the guide's
own factor -- ``F`` or ``L``, never ``Σ`` itself -- exact for ``D ≤`` :data:`EXACT_SVD_LIMIT`, a
randomized range finder with power iterations beyond; Halko, Martinsson & Tropp, SIAM Review 53(2),
2011, algorithms 4.4 and 5.1) and ``d² = diag(Σ) − diag(F_k·F_kᵀ) ≥ 0``, so every marginal variance
stays exact and what the truncation drops is the covariance between weights outside the ``k``
directions (folded into the independent diagonal).  A low-rank guide of rank ``R ≤ k`` is carried
exactly (``k = R``).  Beyond that, the top :data:`CANDIDATE_FACTORS` directions are read and convert carries
the :data:`MAX_GUIDE_FACTORS` combinations of them that carry the most of the logits' variance
(:mod:`pyro2pfp.correlation.guide_selection`): the covariance's eigenvalues say nothing of what the network
does with a direction.

Constrained sites (a positive site is ``exp`` of its unconstrained latent ``u``): the loading of a site's
value ``T(u)`` on ``z_f`` is ``Cov(T(u), z_f) = E[T'(u)]·Cov(u, z_f)`` (Stein's lemma, exact for
Gaussian ``u``), ``E[T'(u)]`` by Gauss–Hermite quadrature over ``u``'s marginal; loadings are capped
so that ``Σ_f loading² ≤`` the site's variance.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import numpy as np
import torch
from pyro.distributions import transforms as pyro_transforms
from pyro.infer import autoguide

from ...planning.graph import GuideFactorInfo

#: the largest number of global factors carried by default (the cost grows linearly in it)
MAX_GUIDE_FACTORS = 32
#: the number of the covariance's top directions read as candidates for those factors: convert keeps the
#: ``MAX_GUIDE_FACTORS`` of them that carry the most of the logits' variance
#: (:func:`pyro2pfp.correlation.guide_selection.select_guide_directions`)
CANDIDATE_FACTORS = 128
#: below this latent dimension the SVD is exact, above it randomized (a full covariance's exact SVD is
#: O(D³): 20 s for D = 1,443 on a busy 2-core machine, the randomized one O(D²·k))
EXACT_SVD_LIMIT = 512
_OVERSAMPLE, _POWER_ITERATIONS = 10, 4
_GH_POINTS = 32


@dataclass
class GuideFactors:
    """The global factors of a correlated guide: ``loadings[site]`` (the site's shape + ``(k,)``, in the
    site's value space: ``Cov(site, z_f)``), ``rank`` the guide's own number of directions (``R`` of a
    low-rank guide, the latent dimension ``D`` of a full covariance), ``k`` the number of columns read
    (candidates, in the covariance's eigenvalue order), ``keep`` the number to carry (the selection by the
    logits' variance keeps that many; ``keep = k``: all), and ``kept`` the share of the covariance's
    off-diagonal mass that the first ``keep`` directions carry (:func:`kept_share`,
    1 when nothing is truncated); ``source`` names the guide."""

    loadings: dict[str, np.ndarray] = field(default_factory=dict)
    rank: int = 0
    k: int = 0
    kept: float = 1.0
    source: str = ""
    keep: int = 0

    def info(self) -> GuideFactorInfo:
        """The summary the layer graph keeps."""
        return GuideFactorInfo(self.k, self.rank, self.kept, self.source, keep=self.keep or self.k)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().to(torch.float64).numpy().copy()


def top_directions(factor: np.ndarray, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(F_k, σ²)``: the top ``k`` principal directions of ``Σ = A·Aᵀ`` (``A = factor``, D × R) scaled by
    their singular values (``F_k = U_k·S_k``, so ``F_k·F_kᵀ`` is the best rank-``k`` part of ``Σ``), and
    all of ``Σ``'s eigenvalues that were computed (``S²``, descending).  Exact SVD for small ``D`` or
    ``R``, else a randomized range finder (Halko et al. 2011) with a fixed seed."""
    d, r = factor.shape
    if k >= r:
        u, s, _ = np.linalg.svd(factor, full_matrices=False)
        return u * s, s**2
    if min(d, r) <= EXACT_SVD_LIMIT:
        u, s, _ = np.linalg.svd(factor, full_matrices=False)
        return u[:, :k] * s[:k], s**2
    rng = np.random.default_rng(seed)
    q = factor @ rng.standard_normal((r, k + _OVERSAMPLE))
    for _ in range(_POWER_ITERATIONS):
        q, _ = np.linalg.qr(q)
        q, _ = np.linalg.qr(factor @ (factor.T @ q))
    q, _ = np.linalg.qr(q)
    u_small, s, _ = np.linalg.svd(q.T @ factor, full_matrices=False)
    u = q @ u_small
    return u[:, :k] * s[:k], s**2


def kept_share(factor: np.ndarray, kept: np.ndarray) -> float:
    """The share of ``Σ = A·Aᵀ``'s covariance between different coordinates that ``F_k·F_kᵀ`` reproduces:
    ``1 − ‖offdiag(Σ − F_k F_kᵀ)‖² / ‖offdiag(Σ)‖²`` in ``[0, 1]`` (1: nothing dropped), from the factors
    without forming ``Σ`` (``‖A Aᵀ‖_F = ‖AᵀA‖_F``)."""
    diag_full = (factor**2).sum(1)
    diag_kept = (kept**2).sum(1)
    full_sq = float(np.sum((factor.T @ factor) ** 2))
    residual_sq = full_sq - 2 * float(np.sum((kept.T @ factor) ** 2)) + float(np.sum((kept.T @ kept) ** 2))
    off_full = full_sq - float(np.sum(diag_full**2))
    off_residual = residual_sq - float(np.sum((diag_full - diag_kept) ** 2))
    return 1.0 if off_full <= 0 else max(0.0, min(1.0, 1.0 - off_residual / off_full))


def _stein_scale(loc: np.ndarray, scale: np.ndarray, transform: Any) -> np.ndarray:
    """``E[T'(u)]``, ``u ~ N(loc, scale²)`` elementwise, by Gauss–Hermite quadrature (1 for the identity)."""
    if isinstance(transform, torch.distributions.transforms.IndependentTransform):
        transform = transform.base_transform
    if transform is torch.distributions.transforms.identity_transform or \
            isinstance(transform, pyro_transforms.IndependentTransform | type(None)):
        return np.ones_like(loc)
    x, w = np.polynomial.hermite_e.hermegauss(_GH_POINTS)
    u = torch.tensor(loc[..., None] + scale[..., None] * x, dtype=torch.float64, requires_grad=True)
    y = transform(u)
    (grad,) = torch.autograd.grad(y.sum(), u)
    return (grad.detach().numpy() * (w / w.sum())).sum(-1)


def _latent_factor(guide: Any) -> tuple[np.ndarray, str] | None:
    """The guide's flat latent covariance as ``A`` with ``Σ = A·Aᵀ + diag`` (the diagonal stays with the
    marginals), and the guide's description; None for a guide without correlations."""
    name = type(guide).__name__
    # the factors as get_posterior() builds them, without building the distribution (whose constructor
    # factorises Σ and fails for scales of 0, a valid deterministic posterior)
    if isinstance(guide, autoguide.AutoLowRankMultivariateNormal):
        factor = _np(guide.cov_factor) * _np(guide.scale)[:, None]  # type: ignore[arg-type]
        return factor, f"{name} (rank {factor.shape[-1]})"
    if isinstance(guide, autoguide.AutoMultivariateNormal):
        tril = _np(guide.scale)[:, None] * _np(guide.scale_tril)  # type: ignore[arg-type]
        return tril, f"{name} (full covariance, {tril.shape[-1]} dimensions)"
    return None


def read_guide_factors(guide: Any, readings: dict[str, Any], max_factors: int | None = None,
                       candidates: int | None = None) -> GuideFactors | None:
    """The global factors of a correlated ``guide`` (see the module docstring), in the value space of every
    site of ``readings`` (:class:`~pyro2pfp.frontend.posterior.readers.SiteReading`, with their ``latent``); None
    for a guide whose posterior has no correlations between weights.  ``max_factors`` (default
    :data:`MAX_GUIDE_FACTORS`): the number to carry; ``candidates`` (default :data:`CANDIDATE_FACTORS`): the
    number of top directions read, from which convert keeps ``max_factors`` by the logits' variance
    (``kept``: the eigenvalue order's share of the first ``max_factors``, stated when nothing is measured)."""
    max_factors = MAX_GUIDE_FACTORS if max_factors is None else max_factors
    candidates = max(max_factors, CANDIDATE_FACTORS if candidates is None else candidates)
    if isinstance(guide, autoguide.AutoStructured):
        return _structured_factors(guide, readings, max_factors)
    found = _latent_factor(guide)
    if found is None:
        return None
    factor, source = found
    rank = factor.shape[1] if "rank" in source else factor.shape[0]
    keep = min(max_factors, rank, factor.shape[0])
    k = min(candidates, rank, factor.shape[0])
    kept_f, _ = top_directions(factor, k)
    share = 1.0 if keep >= factor.shape[1] else kept_share(factor, kept_f[:, :keep])
    loadings: dict[str, np.ndarray] = {}
    offset = 0
    for site, value in guide._unpack_latent(torch.zeros(factor.shape[0], dtype=torch.float64)):
        size = int(np.prod(value.shape))
        loadings[site["name"]] = kept_f[offset:offset + size].reshape(*value.shape, k)
        offset += size
    return GuideFactors(_to_value_space(loadings, readings), rank, k, share, source, keep)


def _structured_factors(guide: autoguide.AutoStructured, readings: dict[str, Any], max_factors: int
                        ) -> GuideFactors | None:
    """``AutoStructured``'s ``"mvn"`` blocks (independent between sites) as one factor space: the top
    directions of the block-diagonal covariance (each direction loads on one site)."""
    blocks: list[tuple[str, np.ndarray]] = []
    for name, _site in guide._sorted_sites:
        if guide.conditionals[name] != "mvn":
            continue

        scale = _np(attrgetter(name)(guide.scales))
        tril = _np(attrgetter(name)(guide.scale_trils))
        blocks.append((name, scale[:, None] * tril))
    if not blocks:
        return None
    candidates = []  # (eigenvalue, site, direction)
    full_dims = 0
    for name, a in blocks:
        u, s, _ = np.linalg.svd(a, full_matrices=False)
        full_dims += a.shape[0]
        for j in range(min(max_factors, len(s))):
            candidates.append((float(s[j] ** 2), name, u[:, j] * s[j]))
    candidates.sort(key=lambda c: -c[0])
    chosen = candidates[:max_factors]
    k = len(chosen)
    loadings = {name: np.zeros((a.shape[0], k)) for name, a in blocks}
    for f, (_, name, direction) in enumerate(chosen):
        loadings[name][:, f] = direction
    shares = []
    for name, a in blocks:
        shares.append((kept_share(a, loadings[name]), float(np.sum((a.T @ a) ** 2) - np.sum((a**2).sum(1) ** 2))))
    total = sum(w for _, w in shares)
    share = 1.0 if total <= 0 else sum(s * w for s, w in shares) / total
    shaped = {}
    for name, _ in blocks:
        shape = tuple(guide._batch_shapes[name] + guide._unconstrained_event_shapes[name])
        shaped[name] = loadings[name].reshape(*shape, k)
    return GuideFactors(_to_value_space(shaped, readings), full_dims, k, share,
                        f"{type(guide).__name__} ('mvn' blocks: {', '.join(n for n, _ in blocks)})")


def _to_value_space(loadings: dict[str, np.ndarray], readings: dict[str, Any]) -> dict[str, np.ndarray]:
    """Loadings of the unconstrained latents as loadings of the sites' values (Stein's lemma, module
    docstring), capped at the sites' variances."""
    out = {}
    for name, lat in loadings.items():
        reading = readings.get(name)
        if reading is None or reading.mean is None or reading.var is None:
            continue
        lat = lat.reshape(*reading.mean.shape, lat.shape[-1])
        if reading.latent is not None:
            loc, scale, transform = reading.latent
            lat = lat * _stein_scale(np.asarray(loc), np.asarray(scale), transform)[..., None]
        total = (lat**2).sum(-1)
        over = total > reading.var
        if np.any(over):
            lat = lat * np.where(over, np.sqrt(reading.var / np.where(over, total, 1.0)), 1.0)[..., None]
        out[name] = lat
    return out
