"""Apply each deliberate breakage of :data:`~tests.breakage.breakages.BREAKAGES` alone to a copy of the
repository and check that the fast loop fails on it.

    python -m tests.breakage.run                 # all of them (CI runs this after the test suite)
    python -m tests.breakage.run --list          # what they are
    python -m tests.breakage.run --only NAME ... # some of them

The checkout is never modified: the repository (without ``.git``, virtual environments and caches) is
copied once into a temporary directory, and each breakage is applied to the copy, tested and taken back
before the next.  For each, ``pytest -x -m "not slow and not board"`` runs in the copy (its ``tests``
importing the copy's ``pyro2pfp`` through ``PYTHONPATH``, caches pointed into the temporary directory so
that nothing built from the unbroken code is reused): first on the tests the entry names
(``Breakage.first``), then, if those pass, on the whole fast loop.  The first failing test is reported.

A breakage counts as caught only when a test fails (pytest's exit status 1); one that makes collection
or import fail (a test that cannot be written wrongly, not a check of the numbers) is an error of the
list, as is an entry whose ``old`` text is not in its file.  Exit status 0 when every breakage was
caught, else 1.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.breakage.breakages import BREAKAGES, Breakage

REPO = Path(__file__).resolve().parents[2]
FAST = "not slow and not board"
IGNORED = (".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache",
           "site", "build", "dist", "*.egg-info")
TIMEOUT = 900  # seconds for one pytest run; the fast loop takes about 3 minutes on two quiet cores


def copy_repository(dst: Path) -> Path:
    """The repository's files (what a checkout holds, without caches) in ``dst/repo``."""
    target = dst / "repo"
    shutil.copytree(REPO, target, ignore=shutil.ignore_patterns(*IGNORED), symlinks=True)
    return target


def environment(copy: Path, scratch: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # the broken and restored files are compiled afresh
    # tuned schedules and compiled kernels: none from the checkout's runs (the kernel cache is keyed on the
    # kernel as emitted and the back end's source, so the breakages share one without reading stale code)
    env["PYRO2PFP_CACHE"] = str(scratch / "cache")
    env["PYRO2PFP_KERNEL_CACHE"] = str(scratch / "kernel-cache")
    env["XDG_CACHE_HOME"] = str(scratch / "xdg-cache")
    env.pop("PYTEST_ADDOPTS", None)
    return env


def imports_the_copy(copy: Path, env: dict[str, str]) -> None:
    code = "import pyro2pfp, tests; print(pyro2pfp.__file__); print(tests.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=copy, env=env, capture_output=True, text=True, timeout=300)
    paths = out.stdout.split()
    if out.returncode != 0 or len(paths) != 2 or not all(Path(p).resolve().is_relative_to(copy.resolve())
                                                          for p in paths):
        raise SystemExit(f"the copy's tests would not import the copy's package (got {paths}):\n{out.stderr[-2000:]}")


def apply(copy: Path, b: Breakage) -> str:
    """Edit the copy's file; returns its original text."""
    path = copy / b.path
    text = path.read_text()
    found = text.count(b.old)
    if found != 1:
        raise ValueError(f"breakage {b.name}: its text occurs {found} times in {b.path} (expected once): "
                         "update tests/breakage/breakages.py to the code")
    path.write_text(text.replace(b.old, b.new))
    return text


def pytest(copy: Path, env: dict[str, str], paths: list[str], log: Path) -> tuple[int, str | None]:
    """Run the fast loop on ``paths`` in the copy, stopping at the first failure: (exit status, the
    first failed test's id)."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-m", FAST, "-p", "no:cacheprovider",
           "--ignore=tests/breakage", "--durations=0", "--durations-min=1000000", *paths]
    with log.open("w") as f:
        try:
            status = subprocess.run(cmd, cwd=copy, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    timeout=TIMEOUT).returncode
        except subprocess.TimeoutExpired:
            return -1, None
    failed = re.search(r"^(?:FAILED|ERROR) (\S+)", log.read_text(), flags=re.MULTILINE)
    return status, failed.group(1) if failed else None


def check(copy: Path, env: dict[str, str], b: Breakage, logs: Path) -> tuple[str, str, float]:
    """(verdict, detail, seconds) for breakage ``b``: ``caught`` by a test, ``SURVIVED`` the fast loop,
    or ``ERROR``."""
    start = time.perf_counter()
    original = apply(copy, b)
    try:
        log = logs / f"{b.name}.log"
        first = [p for p in b.first if (copy / p.split("::")[0]).exists()]
        for paths in ([first] if first else []) + [["tests"]]:
            status, failed = pytest(copy, env, paths, log)
            if status == 1 and failed and not failed.startswith("tests/breakage"):
                return "caught", failed, time.perf_counter() - start
            if status not in (0, 5):  # 5: none of the first tests is in the fast loop
                tail = "\n".join(log.read_text().splitlines()[-30:])
                detail = f"pytest exit status {status} (not a failing test):\n{tail}"
                return "ERROR", detail, time.perf_counter() - start
        return "SURVIVED", "the whole fast loop passed", time.perf_counter() - start
    finally:
        (copy / b.path).write_text(original)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print the breakages and exit")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these breakages only")
    parser.add_argument("--keep", action="store_true", help="keep the copy and the logs (printed path)")
    args = parser.parse_args(argv)
    chosen = [b for b in BREAKAGES if not args.only or b.name in args.only]
    unknown = set(args.only or ()) - {b.name for b in BREAKAGES}
    if unknown:
        parser.error(f"no breakage named {', '.join(sorted(unknown))}; --list shows them")
    if args.list:
        for b in BREAKAGES:
            print(f"{b.name}\n    {b.what}\n    {b.path}")
        return 0
    scratch = Path(tempfile.mkdtemp(prefix="pyro2pfp-breakage-"))
    try:
        copy = copy_repository(scratch)
        env = environment(copy, scratch)
        imports_the_copy(copy, env)
        logs = scratch / "logs"
        logs.mkdir()
        rows, bad = [], 0
        total = time.perf_counter()
        for b in chosen:
            try:
                verdict, detail, seconds = check(copy, env, b, logs)
            except ValueError as exc:
                verdict, detail, seconds = "ERROR", str(exc), 0.0
            bad += verdict != "caught"
            rows.append((b.name, verdict, detail, seconds))
            print(f"{verdict:8s} {b.name} ({seconds:.0f} s): {detail}", flush=True)
        print(f"\n{len(rows) - bad} of {len(rows)} deliberate breakages caught by the fast loop "
              f"in {time.perf_counter() - total:.0f} s")
        if bad:
            print("a breakage the fast loop does not catch needs a test that fails on it (tests/breakage/breakages.py "
                  "says what each one breaks)")
        return 1 if bad else 0
    finally:
        if args.keep:
            print(f"copy and logs kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
