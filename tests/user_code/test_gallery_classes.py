"""Models written the way their authors write them, one per class of code that used to stop
``convert`` (tests/support/gallery_classes.py): device moves and views in ``forward``, the Pyro modules
tutorial's ``Linear``, ``pyro.random_module`` as course notebooks write it (``convert(model, guide)``,
``convert(net, guide)``, methods of a PyroModule: ``convert(bnn.model, bnn.guide)``, ``convert(bnn,
bnn.guide)``), samples assigned to the layers of a ``PyroModule[nn.Sequential]`` with Dropout.

One process trains each model and records ``Predictive``'s answer (the guide's own samples); a fresh
process builds the models as their authors do, loads the saved param stores and converts.  Exact
moments (one hidden layer, mean-field, deterministic input): every logit mean within 5.5 Monte Carlo
standard errors, the median variance ratio in [0.85, 1.18]; and the user's modules as they were.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tests.support import gallery_classes as gallery

pytestmark = pytest.mark.slow  # trains, converts or starts processes

WORKER = gallery.__file__  # run as a script in fresh processes


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("gallery_classes")
    for step in ("train", "convert"):
        result = subprocess.run([sys.executable, WORKER, step, str(out)], capture_output=True, text=True,
                                timeout=900)
        assert result.returncode == 0, f"{step} failed:\n{result.stderr[-3000:]}"
    return out


@pytest.mark.parametrize("name", gallery.ENTRIES)
def test_converts_within_the_bounds_of_its_own_sampling(name, converted):
    truth = np.load(converted / f"{gallery._TRAINED_AS.get(name, name)}-truth.npz")
    pfp = np.load(converted / f"{name}-pfp.npz")
    se = np.sqrt(truth["var"] / gallery.MC_SAMPLES)
    assert np.median(np.abs(truth["mean"]) / se) > 20  # trained: far from the initial logits
    err = np.abs(pfp["mean"] - truth["mean"]) / se
    assert err.max() <= 5.5, err.max()
    ratio = np.median(pfp["var"] / truth["var"])
    assert 0.85 <= ratio <= 1.18, ratio
    assert bool(pfp["unchanged"]), "convert changed the user's modules"
