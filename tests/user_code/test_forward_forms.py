"""Forms of ``forward`` / ``model()`` from public BNN code that used to stop ``convert`` or fail inside it
(tests/support/forward_forms.py): ``pyro.module("model", self.model)`` on a ``to_pyro_module_`` net that
returns ``logits.exp()`` (an MLP and a CNN with BatchNorm, converted through a container holding model and
guide), a packaged classifier's methods assigning samples to a ``PyroModule[nn.Sequential]`` inside the data
plate, and ``pyro.plate("instances", len(input))``.  Trained in one process, converted in a fresh one; the
bounds are test_store_forms.py's (every model here has exact PFP logit moments)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.support import forward_forms as forms
from tests.support.cross_process import assert_matches_sampling, train_then_convert
from tests.support.store_forms import MC_SAMPLES

pytestmark = pytest.mark.slow  # trains, and converts in fresh processes


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return train_then_convert(forms.__file__, tmp_path_factory.mktemp("forward_forms"))


@pytest.mark.parametrize("name", forms.ENTRIES)
def test_converts_within_the_bounds_of_its_own_sampling(name, converted):
    assert_matches_sampling(np.load(converted / f"{name}-truth.npz"), np.load(converted / f"{name}-pfp.npz"),
                            MC_SAMPLES)
