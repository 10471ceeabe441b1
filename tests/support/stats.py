"""Monte Carlo moment checks with a bound derived from the sample count (shared test helper).

A PFP op claims the exact mean ``μ`` and variance ``v`` of every output element.  Given ``N``
independent draws of the output (or importance-weighted draws), the estimates

    μ̂ = mean(X),      v̂ = mean((X − μ̂)²)

are asymptotically normal with standard errors

    se(μ̂) = sqrt(var(X) / N),      se(v̂) = sqrt((m4 − var²) / N)

(``m4`` the 4th central moment, estimated from the same draws).  Every output element gives two
hypotheses (mean, variance); the threshold ``z`` is Bonferroni-corrected so that the probability
that *any* of them fires for a correct formula is at most ``alpha`` (default 1e-6 per call):

    z = Φ⁻¹(1 − alpha / (2·n_hypotheses))     (two-sided)

Nothing is a hand-picked tolerance: the bound shrinks like 1/√N, and the only additive term is
a floating-point rounding allowance proportional to machine epsilon.

Details that keep the check valid (and not flaky) in corner cases:

* **Importance weights.**  ``weights`` (same shape as the draws) turn the estimates into
  importance-sampling estimates ``mean(w·X)``; the standard errors then come from the influence
  functions ``w·D`` and ``w·D² − 2A·w·D`` (``D = X − c``, ``A = mean(w·D)``), which reduce to the
  formulas above when ``w ≡ 1``.  Used where plain sampling would never hit the event that
  carries the moments (ReLU with ``μ/σ = −8``: ``P(a > 0) ≈ 6e-16``).
* **Mean standard error under the null.**  For plain sampling the mean's standard error is
  ``sqrt(max(var̂, v_formula)/N)``: under the hypothesis "the formula is right" the true standard
  error is ``sqrt(v_formula/N)``, and taking the larger of the two keeps a rare-event-dominated
  sample (whose sample variance happens to be too small) from producing a spurious rejection.
* **Variance estimate** is bias-corrected (``+ se(μ̂)²``, i.e. the ``N/(N−1)`` factor).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import ndtri

EPS = float(np.finfo(np.float64).eps)
DEFAULT_ALPHA = 1e-6


def z_threshold(n_hypotheses: int, alpha: float = DEFAULT_ALPHA) -> float:
    """Two-sided Bonferroni z threshold: P(any of ``n_hypotheses`` |Z| > z) ≤ ``alpha``."""
    return float(ndtri(1.0 - alpha / (2.0 * n_hypotheses)))


@dataclass
class MomentCheck:
    """Result of comparing claimed moments with a Monte Carlo sample (all arrays flat, per element).

    The decisions use errors and bounds in units of each element's sample spread (``scale``), so
    that tiny (1e-150) or huge values neither underflow nor overflow in the 4th-moment estimate.
    """

    n: int
    claimed_mean: np.ndarray
    claimed_var: np.ndarray | None
    mc_mean: np.ndarray
    mc_var: np.ndarray
    ratio_mean: np.ndarray  # |error| / bound, per element (> 1: rejected)
    ratio_var: np.ndarray
    z: float

    @property
    def mean_ok(self) -> np.ndarray:
        return self.ratio_mean <= 1.0

    @property
    def var_ok(self) -> np.ndarray:
        return self.ratio_var <= 1.0

    @property
    def ok(self) -> bool:
        return bool(np.all(self.mean_ok) and np.all(self.var_ok))

    def score(self) -> float:
        """Largest error / bound ratio (> 1 means rejected)."""
        return float(max(np.max(self.ratio_mean, initial=0.0), np.max(self.ratio_var, initial=0.0)))

    def report(self, max_rows: int = 12) -> str:
        lines = [f"N={self.n}, z={self.z:.3f}, worst error/bound={self.score():.3g}",
                 " elem       claimed mean           MC mean   |err|/bound"
                 "        claimed var            MC var   |err|/bound"]
        bad = np.flatnonzero(~(self.mean_ok & self.var_ok))
        rows = bad if bad.size else np.arange(self.mc_mean.size)
        for i in rows[:max_rows]:
            cv = np.nan if self.claimed_var is None else self.claimed_var[i]
            lines.append(
                f"{i:5d} {self.claimed_mean[i]:18.10g} {self.mc_mean[i]:17.10g} "
                f"{self.ratio_mean[i]:13.3g} {cv:18.10g} {self.mc_var[i]:17.10g} "
                f"{self.ratio_var[i]:13.3g}")
        return "\n".join(lines)


def _ratio(err: np.ndarray, bound: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        r = err / bound
    r = np.where(err == 0, 0.0, r)  # 0/0: no error at all
    return np.where(np.isnan(r), np.inf, r)  # NaN claims are rejected


def check_moments(samples: np.ndarray, mean: np.ndarray, var: np.ndarray | None, *,
                  weights: np.ndarray | None = None, alpha: float = DEFAULT_ALPHA) -> MomentCheck:
    """Compare claimed ``mean``/``var`` (shape ``samples.shape[1:]``) with ``N = samples.shape[0]`` draws.

    ``var=None`` checks the mean only.  ``weights`` are importance weights (same shape as
    ``samples``), or ``None`` for plain sampling.  With weights the moments are estimated about 0
    (``mean(w·X)``, ``mean(w·X²)``): centring would bring in ``mean(w)``, whose variance can be
    astronomically large; the caller's proposal must keep ``|E X|`` not much larger than the spread.
    """
    x = np.asarray(samples, dtype=np.float64)
    n = x.shape[0]
    x = x.reshape(n, -1)
    m = x.shape[1]
    mean = np.broadcast_to(np.asarray(mean, dtype=np.float64), samples.shape[1:]).reshape(-1)
    if var is not None:
        var = np.broadcast_to(np.asarray(var, dtype=np.float64), samples.shape[1:]).reshape(-1)
    w = None if weights is None else np.asarray(weights, dtype=np.float64).reshape(n, -1)

    # Centre (plain sampling: on the estimated mean, two passes, so huge offsets do not cancel in
    # D²) and scale each element by its largest deviation, so D⁴ neither under- nor overflows.
    if w is None:
        c0 = np.where(np.isfinite(mean), mean, 0.0)
        center = c0 + (x - c0).mean(axis=0)
    else:
        center = np.zeros(m)
    scale = np.max(np.abs(x - center), axis=0)
    scale = np.where(scale > 0, scale, 1.0)
    d = (x - center) / scale
    wd = d if w is None else w * d
    a = wd.mean(axis=0)
    se_mean_sample = wd.std(axis=0) / np.sqrt(n)
    wd2 = d * wd
    v_hat = wd2.mean(axis=0) - a * a + se_mean_sample**2  # normalised units
    se_var = (wd2 - 2.0 * a * wd).std(axis=0) / np.sqrt(n)

    claimed_m = (mean - center) / scale
    claimed_v = None if var is None else var / scale / scale
    se_mean = se_mean_sample
    if w is None and claimed_v is not None:
        se_mean = np.sqrt(np.maximum(se_mean_sample**2, np.maximum(claimed_v, 0.0) / n))

    # Rounding allowance: pairwise summation of N terms plus evaluation of the formula itself
    # (relative to the magnitudes involved, incl. the centre that was subtracted).
    rounding = 64 * EPS * (np.log2(n) + 1)
    mag = np.abs(center) / scale
    fp_mean = rounding * (np.abs(wd).mean(axis=0) + mag + np.abs(claimed_m))
    fp_var = rounding * (np.abs(wd2).mean(axis=0) + 2 * mag * np.abs(wd).mean(axis=0)
                         + (0.0 if claimed_v is None else np.abs(claimed_v)))

    z = z_threshold(2 * m if var is not None else m, alpha)
    ratio_mean = _ratio(np.abs(a - claimed_m), z * se_mean + fp_mean)
    ratio_var = (np.zeros(m) if claimed_v is None
                 else _ratio(np.abs(v_hat - claimed_v), z * se_var + fp_var))
    return MomentCheck(n=n, claimed_mean=mean, claimed_var=var, mc_mean=center + scale * a,
                       mc_var=v_hat * scale * scale, ratio_mean=ratio_mean, ratio_var=ratio_var, z=z)


def assert_moments_agree(samples: np.ndarray, mean: np.ndarray, var: np.ndarray | None,
                         **kwargs) -> MomentCheck:
    """Assert that the claimed moments are consistent with the sample; returns the check."""
    res = check_moments(samples, mean, var, **kwargs)
    assert np.all(np.isfinite(res.claimed_mean)), res.report()
    if var is not None:
        assert np.all(np.isfinite(res.claimed_var)), res.report()
    assert res.ok, "claimed moments disagree with Monte Carlo:\n" + res.report()
    return res


def assert_check_rejects(samples: np.ndarray, mean: np.ndarray, var: np.ndarray | None,
                         **kwargs) -> MomentCheck:
    """Assert that the check rejects the (deliberately wrong) claimed moments."""
    res = check_moments(samples, mean, var, **kwargs)
    assert not res.ok, "the Monte Carlo check failed to reject a wrong formula:\n" + res.report()
    return res


def variance_ratio_band(samples: np.ndarray, alpha: float = 1e-4) -> tuple[float, float]:
    """Where the median over outputs of ``claimed variance / sample variance`` lies, with probability at
    least ``1 − alpha``, when the claimed variances are the true ones: ``exp(±z·se)``.

    ``samples``: ``(N, *outputs)`` draws.  Each output's sample variance ``v̂`` has the relative standard
    error ``se_i = sqrt((m4 − v̂²)/N)/v̂`` (from its 4th central moment; ``sqrt(2/N)`` for a Gaussian
    output), so ``log(v/v̂)`` is ``N(0, se_i²)`` to first order; ``se`` is the median of the ``se_i`` and
    ``z = Φ⁻¹(1 − alpha/2)``.  The outputs share the draws (the same weight samples for every input), so
    their ratios are correlated: the median is given the spread of one output's ratio, which is
    conservative (an independent median would spread less).  Nothing is hand-picked: the band narrows
    like ``1/√N``.
    """
    n = samples.shape[0]
    x = np.asarray(samples, dtype=np.float64).reshape(n, -1)
    centred = x - x.mean(axis=0)
    var = (centred**2).sum(axis=0) / (n - 1)
    m4 = (centred**4).mean(axis=0)
    live = var > 0
    rel_se = np.sqrt(np.maximum(m4[live] - var[live] ** 2, 0.0) / n) / var[live]
    half = float(ndtri(1.0 - alpha / 2.0)) * float(np.median(rel_se))
    return float(np.exp(-half)), float(np.exp(half))


def median_variance_ratio(claimed_var: np.ndarray, samples: np.ndarray) -> float:
    """The median over outputs of ``claimed_var / sample variance`` (outputs whose draws all agree left out)."""
    var = np.asarray(samples, dtype=np.float64).var(axis=0, ddof=1)
    live = var > 0
    return float(np.median(np.asarray(claimed_var, dtype=np.float64)[live] / var[live]))
