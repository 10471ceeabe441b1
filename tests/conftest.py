"""Shared fixtures: Pyro's global state is reset around every test."""
from __future__ import annotations

import os

import pyro
import pytest

os.environ.setdefault("TVM_NUM_THREADS", "2")


@pytest.fixture(autouse=True)
def _fresh_pyro_state():
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    yield
    pyro.clear_param_store()
