"""Forms of ``forward`` / ``model()`` from public BNN code that used to stop ``convert`` or fail inside it
(tests/support/forward_forms.py): ``pyro.module("model", self.model)`` on a ``to_pyro_module_`` net that
returns ``logits.exp()`` (an MLP and a CNN with BatchNorm, converted through a container holding model and
guide), a packaged classifier's methods assigning samples to a ``PyroModule[nn.Sequential]`` inside the data
plate, and ``pyro.plate("instances", len(input))``.  Trained in one process, converted in a fresh one; the
bounds are test_store_forms.py's (every model here has exact PFP logit moments)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tests.support import forward_forms as forms

pytestmark = pytest.mark.slow  # trains, and converts in fresh processes


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("forward_forms")
    for step in ("train", "convert"):
        result = subprocess.run([sys.executable, forms.__file__, step, str(out)], capture_output=True, text=True,
                                timeout=1200)
        assert result.returncode == 0, f"{step} failed:\n{result.stderr[-3000:]}"
    return out


@pytest.mark.parametrize("name", forms.ENTRIES)
def test_converts_within_the_bounds_of_its_own_sampling(name, converted):
    truth = np.load(converted / f"{name}-truth.npz")
    pfp = np.load(converted / f"{name}-pfp.npz")
    se = np.sqrt(truth["var"] / forms.MC_SAMPLES)
    assert np.median(np.abs(truth["mean"]) / se) > 20  # trained: far from the initial logits
    z = np.abs(pfp["mean"] - truth["mean"]) / se
    assert z.max() <= 4.5 and np.median(z) <= 1.5, (z.max(), np.median(z))
    ratio = np.median(pfp["var"] / truth["var"])
    assert 0.85 <= ratio <= 1.18, ratio
    assert bool(pfp["unchanged"]), "convert changed the user's modules"
