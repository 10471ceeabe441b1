"""Shared fixtures: Pyro's global state is reset around every test."""
from __future__ import annotations

import os
import sys

import pyro
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/builders.py, tests/stats.py
os.environ.setdefault("TVM_NUM_THREADS", "2")


@pytest.fixture(autouse=True)
def _fresh_pyro_state():
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    yield
    pyro.clear_param_store()
