"""An AArch64 Python on an x86 machine: Debian's ``python3`` for arm64 run by ``qemu-aarch64``, with the
manylinux aarch64 wheels of NumPy and the TVM runtime -- what a Raspberry Pi 4 with 64-bit Raspberry
Pi OS runs ``pyro2pfp.load`` with.

:func:`aarch64_python` builds it once under ``~/.cache/pyro2pfp/`` (``$PYRO2PFP_AARCH64_PYTHON``
overrides the directory): ``debootstrap --foreign`` fetches the Debian release whose Python is this
interpreter's version (no emulation needed for that stage), the packages are unpacked with ``dpkg -x``
into ``root/``, and ``pip download --platform manylinux_2_28_aarch64`` fetches the wheels of this
machine's NumPy, apache-tvm and apache-tvm-ffi (and typing_extensions), unpacked into ``site/``.
:func:`run` then runs a script there: ``qemu-aarch64 -cpu cortex-a72`` with ``QEMU_LD_PREFIX=root``
and ``PYTHONPATH=site:...``.  Neither torch, Pyro, SciPy nor anything else is installed in it.

Needs (Debian/Ubuntu): ``apt-get install -y qemu-user debootstrap dpkg`` and network access the first time.
"""
from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["BoardPythonError", "DEBIAN_RELEASES", "aarch64_python", "run"]

#: The Debian release whose python3 is each Python version (the host's must match: cp3XX wheels).
DEBIAN_RELEASES = {(3, 11): "bookworm", (3, 13): "trixie"}
MIRROR = "http://deb.debian.org/debian"
WHEELS = ("numpy", "apache-tvm", "apache-tvm-ffi", "typing_extensions")


class BoardPythonError(RuntimeError):
    """The AArch64 Python cannot be set up here (a tool is missing, no network, another Python version)."""


def _version() -> tuple[int, int]:
    return sys.version_info.major, sys.version_info.minor


def cache_dir() -> Path:
    """``$PYRO2PFP_AARCH64_PYTHON`` or ``~/.cache/pyro2pfp/aarch64-python<X.Y>-tvm-<version>``."""
    env = os.environ.get("PYRO2PFP_AARCH64_PYTHON")
    if env:
        return Path(env)
    tvm = importlib.metadata.version("apache-tvm")
    return Path.home() / ".cache" / "pyro2pfp" / f"aarch64-python{'.'.join(map(str, _version()))}-tvm-{tvm}"


def _tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise BoardPythonError(f"{name} not found: apt-get install -y {package}")
    return path


def _check(cmd: list[str], timeout: float) -> None:
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        raise BoardPythonError(f"took over {timeout:g} s: {' '.join(cmd)}") from err
    if result.returncode != 0:
        raise BoardPythonError(f"failed ({result.returncode}): {' '.join(cmd)}\n{result.stderr[-1500:]}")


def aarch64_python(timeout: float = 1800.0) -> tuple[str, Path, Path]:
    """``(qemu-aarch64, root, site)``: the emulator, the arm64 root holding ``usr/bin/python3.X``, and
    the directory holding the aarch64 wheels' packages (built once, see the module doc)."""
    qemu = _tool("qemu-aarch64", "qemu-user")
    cache = cache_dir()
    root, site, ready = cache / "root", cache / "site", cache / "ready"
    if ready.is_file():
        return qemu, root, site
    release = DEBIAN_RELEASES.get(_version())
    if release is None:
        raise BoardPythonError(f"no Debian release with Python {'.'.join(map(str, _version()))} is known "
                               f"({DEBIAN_RELEASES}): the aarch64 wheels must match this interpreter")
    python = "python{}.{}".format(*_version())
    debootstrap, dpkg = _tool("debootstrap", "debootstrap"), _tool("dpkg", "dpkg")
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    _check([debootstrap, "--arch=arm64", "--foreign", "--variant=minbase",
            f"--include={python}-minimal,lib{python}-stdlib,libstdc++6", release, str(root), MIRROR], timeout)
    for deb in sorted((root / "var" / "cache" / "apt" / "archives").glob("*.deb")):
        _check([dpkg, "-x", str(deb), str(root)], timeout)
    if not (root / "usr" / "bin" / python).is_file():
        raise BoardPythonError(f"{root}/usr/bin/{python} missing after unpacking Debian {release}")
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    with tempfile.TemporaryDirectory(prefix="pyro2pfp-a64py-") as tmp:
        _check([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                "--platform", "manylinux_2_28_aarch64", "--python-version", "{}.{}".format(*_version()),
                "-d", tmp, *pins], timeout)
        site.mkdir()
        for wheel in Path(tmp).glob("*.whl"):
            with zipfile.ZipFile(wheel) as zf:
                zf.extractall(site)
    ready.write_text(" ".join(pins) + "\n")
    return qemu, root, site


def run(args: list[str], *, pythonpath: tuple[str, ...] = (), timeout: float = 900.0,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python3.X args...`` in the AArch64 Python (Cortex-A72), ``pythonpath`` after its wheels."""
    qemu, root, site = aarch64_python()
    python = root / "usr" / "bin" / "python{}.{}".format(*_version())
    full_env = dict(env if env is not None else os.environ, QEMU_LD_PREFIX=str(root),
                    PYTHONPATH=os.pathsep.join([str(site), *pythonpath]), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([qemu, "-cpu", "cortex-a72", str(python), *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env)
