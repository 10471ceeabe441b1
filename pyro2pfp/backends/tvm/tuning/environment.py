"""Tuning: the environment -- package versions MetaSchedule needs, the tuning target (with
``num-cores``), the host check (candidates are measured where they run) and the cache root."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import tvm

from ....errors import TuningError
from ....runtime.targets import host_arch, resolve_target, target_arch
from ..runtime import default_num_threads

CACHE_ENV = "PYRO2PFP_CACHE"
"""Environment variable overriding the cache root (default ``~/.cache/pyro2pfp``)."""


def check_environment() -> None:
    """Raise :class:`TuningError` for package versions known to crash MetaSchedule."""
    import tvm_ffi

    version = getattr(tvm_ffi, "__version__", "")
    if version.startswith("0.1.15"):
        raise TuningError(
            f"apache-tvm-ffi {version} segfaults in tvm.ir.save_json, which MetaSchedule uses: "
            "install apache-tvm-ffi==0.1.14.post1 (pinned in pyro2pfp's pyproject.toml)")
    for module in ("psutil", "cloudpickle"):
        if importlib.util.find_spec(module) is None:
            raise TuningError(f"MetaSchedule needs the '{module}' package: pip install {module}")


def default_cache_dir() -> Path:
    """``$PYRO2PFP_CACHE/tuning`` or ``~/.cache/pyro2pfp/tuning``."""
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "pyro2pfp")
    return Path(root).expanduser() / "tuning"


def _physical_cores() -> int:
    """Physical cores available to this process (the default TVM thread count as well)."""
    return default_num_threads()


def _check_runs_here(target: tvm.target.Target) -> None:
    """Tuning measures candidates on this machine: refuse a target for another architecture."""
    if target_arch(target) != host_arch():
        raise TuningError(
            f"cannot tune for {target_arch(target)} on this {host_arch()} machine: MetaSchedule measures "
            "every candidate where it runs; compile without tune= (default schedules), or measure on a board of "
            "that architecture with remote='tracker-host:9190/key' (TVM RPC)")


def tuning_target(target: Any) -> tvm.target.Target:
    """``target`` (a preset such as ``"rpi4"``, a name, tag, dict or Target) as a
    ``tvm.target.Target`` with ``num-cores`` (MetaSchedule requires it)."""
    tgt = resolve_target(target)
    cores = tgt.attrs.get("num-cores")
    if cores is not None and int(cores) > 0:
        return tgt
    config = dict(tgt.export())
    config.pop("tag", None)
    config["num-cores"] = _physical_cores()
    if "host" in config and isinstance(config["host"], dict):
        config["host"] = dict(config["host"])
    return tvm.target.Target(config)
