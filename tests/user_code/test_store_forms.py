"""The param store is the source of truth for every parameter, the deterministic ones too: models whose
deterministic layers are registered in the store (``pyro.random_module`` with priors for some parameters
only, ``pyro.module`` in the model, the guide or both, a ``PyroModule``'s own parameters;
tests/support/store_forms.py) are trained in one process and converted in a fresh one, where the rebuilt
module objects hold their initial values and only the loaded store holds the trained ones.

Each converted network must agree with the author's own prediction made in the training process: every logit
mean within 4.5 Monte Carlo standard errors (the median within 1.5; an exact mean gives about 0.67), the median
variance ratio in [0.85, 1.18] (600 samples: a per-element sd of 0.058); the plan printout says which layers'
values come from the store because the module object held others; and convert leaves the user's modules as it
found them.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.support import store_forms as forms
from tests.support.cross_process import assert_matches_sampling, train_then_convert

pytestmark = pytest.mark.slow  # trains, and converts in fresh processes

# Forms whose module objects are stale in the fresh process (the store's values differ from theirs).
STALE = {"rm-notebook": "module$$$fc1.weight", "rm-notebook-net": "module$$$fc1.weight",
         "rm-methods": "module$$$fc1.weight", "module-in-model": "$$$0.weight",
         "module-in-guide": "body$$$0.weight", "module-in-both": "body$$$0.weight", "plain-parameters": "w_in"}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return train_then_convert(forms.__file__, tmp_path_factory.mktemp("store_forms"))


@pytest.mark.parametrize("name", forms.ENTRIES)
def test_converts_with_the_stores_values_in_a_fresh_process(name, converted):
    truth = np.load(converted / f"{forms.TRAINED_AS.get(name, name)}-truth.npz")
    pfp = np.load(converted / f"{name}-pfp.npz")
    assert_matches_sampling(truth, pfp, forms.MC_SAMPLES)
    summary = str(pfp["summary"])
    assert len(pfp["stale"]) > 0 and STALE[name] in summary and "module object holds other values" in summary, \
        summary
