"""Shared by the cross-process user-code tests: run a worker's ``train`` then ``convert`` step in fresh
processes, and compare a converted network's logits with the author's own sampled prediction."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np


def train_then_convert(worker: str, out: Path, timeout: int = 1200) -> Path:
    """``python worker train OUT`` then ``python worker convert OUT``, each in a fresh process; ``out``."""
    for step in ("train", "convert"):
        result = subprocess.run([sys.executable, worker, step, str(out)], capture_output=True, text=True,
                                timeout=timeout)
        assert result.returncode == 0, f"{step} failed:\n{result.stderr[-3000:]}"
    return out


def assert_matches_sampling(truth: dict, pfp: dict, mc_samples: int) -> None:
    """A network with exact logit moments against ``mc_samples`` samples of the truth: every mean within 4.5 Monte
    Carlo standard errors (the median within 1.5; an exact mean gives about 0.67), the median variance ratio in
    [0.85, 1.18] (a per-element sd of 0.058 at 600 samples), the truth far from the initial logits (trained),
    and the user's modules left as they were."""
    se = np.sqrt(truth["var"] / mc_samples)
    assert np.median(np.abs(truth["mean"]) / se) > 20  # trained: far from the initial logits
    z = np.abs(pfp["mean"] - truth["mean"]) / se
    assert z.max() <= 4.5 and np.median(z) <= 1.5, (z.max(), np.median(z))
    ratio = np.median(pfp["var"] / truth["var"])
    assert 0.85 <= ratio <= 1.18, ratio
    assert bool(pfp["unchanged"]), "convert changed the user's modules"
