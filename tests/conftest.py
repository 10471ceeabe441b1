"""Shared fixtures: Pyro's global state is reset around every test; the trained CLI MLP is made once
per session."""
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


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """A builder file, a briefly trained MLP saved with pyro.get_param_store().save(), test digits
    (tests/support/cli_mlp.py); shared by the CLI tests and the uncertainty head's CLI test, which
    only read it and write files of their own names into its directory."""
    from tests.support.cli_mlp import train_and_save

    return train_and_save(tmp_path_factory.mktemp("cli"))
