"""The suite's own parallel run: ``python -m pytest -n 2`` must keep the tests that share a long-lived fixture on
one worker (tests/conftest.py names an ``xdist_group`` after the fixture; pytest-xdist's ``--dist loadgroup``
schedules a group as one unit).  If the grouping is lost nothing fails: every worker builds the fixture again
(a trained network, a compiled ResNet: minutes each) and the board tests, which must not overlap, run side by
side.  pytest 9.2 changed how node ids are stored and pytest-xdist 3.8's grouping silently stopped working
(pytest-dev/pytest-xdist#1386); this test runs a real two-worker session in a temporary directory, with this
suite's grouping hook, and checks where each test ran.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts a pytest session with two worker processes

REPO = Path(__file__).resolve().parents[2]

_CONFTEST = """
from tests.conftest import pytest_collection_modifyitems  # noqa: F401  (the suite's grouping hook)
"""

_SHARED = """
import os
import pytest

@pytest.fixture(scope="module")
def built_once(tmp_path_factory):
    return os.environ["PYTEST_XDIST_WORKER"]

@pytest.mark.parametrize("i", range(6))
def test_shared(i, built_once):
    open(os.environ["WHERE"], "a").write(f"shared {os.environ['PYTEST_XDIST_WORKER']} {built_once}\\n")
"""

_FREE = """
import os
import time
import pytest

@pytest.mark.parametrize("i", range(6))
def test_free(i):
    time.sleep(0.2)
    open(os.environ["WHERE"], "a").write(f"free {os.environ['PYTEST_XDIST_WORKER']}\\n")
"""


def test_tests_sharing_a_fixture_run_on_one_worker(tmp_path):
    # a package whose first name is `tests` is what the hook groups: the scratch tests live in tests.<name>
    pkg = tmp_path / "scratch" / "tests" / "workers_probe"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "conftest.py").write_text(textwrap.dedent(_CONFTEST))
    (pkg / "test_shared.py").write_text(textwrap.dedent(_SHARED))
    (pkg / "test_free.py").write_text(textwrap.dedent(_FREE))
    (tmp_path / "scratch" / "pytest.ini").write_text("[pytest]\n")
    where = tmp_path / "where.txt"
    # the scratch `tests` package extends this repository's (a namespace search path), so that
    # `tests.conftest` is this suite's
    (tmp_path / "scratch" / "tests" / "__init__.py").write_text(
        f"__path__.append({str(REPO / 'tests')!r})\n")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider", "-q",
         "--rootdir", str(tmp_path / "scratch"), "-c", str(tmp_path / "scratch" / "pytest.ini"),
         str(pkg)],
        cwd=tmp_path / "scratch", capture_output=True, text=True, timeout=300,
        env={**_env(), "WHERE": str(where), "PYTHONPATH": str(tmp_path / "scratch")})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line.split() for line in where.read_text().splitlines()]
    shared = [line for line in lines if line[0] == "shared"]
    assert len(shared) == 6 and len(lines) == 12, lines
    workers = {worker for _, worker, _ in shared}
    assert len(workers) == 1, (
        f"the tests sharing one module fixture ran on workers {sorted(workers)}: the installed pytest and "
        f"pytest-xdist do not schedule xdist_group marks together (see this module's docstring)")


def _env() -> dict[str, str]:
    """This process's environment without pytest's and pytest-xdist's variables (the inner session's own)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
