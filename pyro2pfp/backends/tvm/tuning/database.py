"""Tuning: the on-disk cache of one tuning run (``<work_dir>/<key>/``) -- the directory lock, the
``pyro2pfp_tuning.json`` meta file (trials done, per-kernel choices) and applying MetaSchedule's
JSON database to a module."""
from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tvm
from tvm import relax

META_FILE = "pyro2pfp_tuning.json"
FORMAT_VERSION = 1


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Exclusive lock on ``directory`` (two processes tuning the same key wait for each other)."""
    directory.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl  # lazy: POSIX only (elsewhere the directory is not locked)
    except ImportError:  # pragma: no cover -- not POSIX
        yield
        return
    with open(directory / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _read_meta(directory: Path) -> dict[str, Any]:
    try:
        with open(directory / META_FILE) as fh:
            meta = json.load(fh)
        return meta if meta.get("format") == FORMAT_VERSION else {}
    except (OSError, ValueError):
        return {}


def _write_meta(directory: Path, meta: dict[str, Any]) -> None:
    tmp = directory / (META_FILE + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(meta, fh, indent=1, sort_keys=True)
    os.replace(tmp, directory / META_FILE)


def _apply_database(mod: tvm.IRModule, database: Any, target: tvm.target.Target) -> tvm.IRModule:
    with target, database, tvm.transform.PassContext(opt_level=3), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)
