"""Compare a PFP network's (mean, variance) of the logits with Monte Carlo samples of the BNN."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class SamplingAgreement:
    """How PFP logits agree with sampled logits of the same (model, guide).

    * ``argmax_agreement``: fraction of inputs whose PFP mean and MC mean logits have the same argmax.
    * ``mean_rel_error``: ``‖μ_PFP − μ_MC‖ / ‖μ_MC‖`` over all logits.
    * ``var_rel_error``: ``‖v_PFP − v_MC‖ / ‖v_MC‖`` over all logits.
    * ``mean_z`` / ``var_z``: largest difference in units of the MC standard error (sampling noise alone
      gives values of a few units).
    """

    argmax_agreement: float
    mean_rel_error: float
    var_rel_error: float
    mean_z: float
    var_z: float
    num_samples: int

    def __str__(self) -> str:
        return (f"argmax agreement {100 * self.argmax_agreement:.1f} %, mean logits rel. error "
                f"{100 * self.mean_rel_error:.2f} %, variance rel. error {100 * self.var_rel_error:.1f} % "
                f"({self.num_samples} samples; max |Δ| = {self.mean_z:.1f} / {self.var_z:.1f} standard errors)")


def sampling_agreement(pfp_mean: np.ndarray, pfp_var: np.ndarray, mc_logits: np.ndarray) -> SamplingAgreement:
    """Agreement of PFP (mean, var), each (B, K), with MC logits (N, B, K)."""
    n = mc_logits.shape[0]
    mc_mean = mc_logits.mean(0)
    centred = mc_logits - mc_mean
    mc_var = (centred**2).sum(0) / (n - 1)
    m4 = (centred**4).mean(0)
    se_mean = np.sqrt(mc_var / n)
    se_var = np.sqrt(np.maximum(m4 - mc_var**2, 0.0) / n)
    tiny = np.finfo(np.float64).tiny
    return SamplingAgreement(
        argmax_agreement=float(np.mean(pfp_mean.argmax(-1) == mc_mean.argmax(-1))),
        mean_rel_error=float(np.linalg.norm(pfp_mean - mc_mean) / max(np.linalg.norm(mc_mean), tiny)),
        var_rel_error=float(np.linalg.norm(pfp_var - mc_var) / max(np.linalg.norm(mc_var), tiny)),
        mean_z=float(np.max(np.abs(pfp_mean - mc_mean) / np.maximum(se_mean, tiny))),
        var_z=float(np.max(np.abs(pfp_var - mc_var) / np.maximum(se_var, tiny))),
        num_samples=n,
    )


def median_seconds(fn: Callable[[], Any], repeats: int = 20, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))
