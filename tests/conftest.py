"""Shared fixtures: Pyro's global state is reset around every test; the trained CLI MLP is made once
per session.

Under pytest-xdist (``python -m pytest -n 2``; ``--dist loadgroup`` is in pyproject's ``addopts``):

* tests that share a fixture of this suite that is built once per module, class or session (a trained
  model, a compiled network, an RPC tracker and its servers) run on the same worker, so that each such
  fixture is still built once: :func:`pytest_collection_modifyitems` gives every test an ``xdist_group``
  named after the shared fixtures it is connected to (through tests that use several);
* the ``board`` tests (RPC servers on loopback ports, qemu boards, the cross toolchain) run on one
  worker, one after another -- a test that starts its own servers or processes and must not overlap
  others can join them with ``@pytest.mark.xdist_group("board")``;
* each worker runs TVM's thread pool and torch on one thread: two workers on two cores are busy already,
  and TVM's pool spins while it waits, so two pools of two threads on two cores slow each other down.
"""
from __future__ import annotations

import os

import pytest

_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER:
    os.environ.setdefault("TVM_NUM_THREADS", "1")
os.environ.setdefault("TVM_NUM_THREADS", "2")
# every kernel the emitter reuses for a later layer is made again and checked equal (backends/tvm/kernel_memo.py)
os.environ.setdefault("PYRO2PFP_VERIFY_KERNEL_REUSE", "1")

import pyro  # noqa: E402  (after TVM_NUM_THREADS: importing the package reads it)

if _WORKER:
    import torch

    torch.set_num_threads(1)

BOARD_GROUP = "board"


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


def _shared_fixtures(item: pytest.Item) -> list[str]:
    """The fixtures of this suite that ``item`` uses and that live longer than one test."""
    info = getattr(item, "_fixtureinfo", None)
    shared = []
    for name, defs in (info.name2fixturedefs.items() if info is not None else ()):
        fixture = defs[-1]
        module = getattr(fixture.func, "__module__", "") or ""
        if fixture.scope != "function" and module.split(".")[0] == "tests":
            shared.append(f"{module}.{name}")
    return shared


def xdist_groups(items: list[pytest.Item]) -> dict[str, str]:
    """``nodeid -> group`` for the tests that must share a worker: the ``board`` tests, and the tests
    connected through shared fixtures (:func:`_shared_fixtures`; a union of every fixture set that
    overlaps, named after its first fixture).  Tests not listed go to whichever worker is free."""
    parent: dict[str, str] = {}

    def find(a: str) -> str:
        while parent.setdefault(a, a) != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    uses = {}
    for item in items:
        keys = _shared_fixtures(item)
        if item.get_closest_marker("board") is not None:
            keys.append(BOARD_GROUP)
        for key in keys[1:]:
            parent[find(key)] = find(keys[0])
        uses[item.nodeid] = keys
    return {nodeid: find(keys[0]) for nodeid, keys in uses.items() if keys}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _WORKER:
        return
    groups = xdist_groups(items)
    for item in items:
        if item.nodeid in groups and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
