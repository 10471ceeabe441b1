"""Deployment: compile for a board, export a library, load it back as a predictor.

>>> exe = net.compile("rpi4")                       # or "aarch64", "native", a TVM tag / Target
>>> exe.export_library("lenet_rpi4.so")             # + lenet_rpi4.so.json (input shape etc.)
>>> # on the board (or on this machine for a host target):
>>> exe = pyro2pfp.load("lenet_rpi4.so"); mean, var = exe(x)

**Files.** ``export_library(path)`` writes the library with TVM's own ``export_library`` (``.so``: a
shared library; ``.tar``: the object files, linked by ``load`` on the machine that loads it) and a
*sidecar* ``path + ".json"`` holding what the predictor needs besides the code: the input shape,
whether it takes an input variance, the target and versions (and, from the CLI, the layer plan).
Copy both files.  :func:`load` reads the sidecar and returns the same
:class:`~pyro2pfp.tvm_backend.runtime.CompiledPFP` (input validation included) as ``net.compile``.

**Cross-compilation.** A target whose ``mtriple`` names another architecture than this machine's
(``"aarch64"``, the board presets below, ``"raspberry-pi/4b-aarch64"``, any TVM tag or target dict)
is compiled by TVM's LLVM; the returned predictor cannot run here, but exports: ``.tar`` needs no
toolchain, ``.so`` needs the cross linker (Debian/Ubuntu: ``apt-get install gcc-aarch64-linux-gnu``).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import warnings
from typing import Any

from .errors import PFPError

SIDECAR_SUFFIX = ".json"
FORMAT = "pyro2pfp-library/1"

#: Named targets.  ``"aarch64"`` is any 64-bit ARM with NEON (Advanced SIMD is mandatory in
#: AArch64); the boards are the paper's Raspberry Pi class Cortex-A53 / A72 / A76.
TARGET_PRESETS: dict[str, Any] = {
    "aarch64": {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]},
    "rpi3": {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a53", "mattr": ["+neon"],
             "num-cores": 4},  # Raspberry Pi 3 (BCM2837, 64-bit OS); TVM's arm/rasp3b tag is 32-bit
    "rpi4": "raspberry-pi/4b-aarch64",  # TVM tag: Cortex-A72, 4 cores, +neon, aarch64 host
    "rpi5": {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a76", "mattr": ["+neon"],
             "num-cores": 4},  # Raspberry Pi 5 (BCM2712)
}
PRESET_HELP = {
    "aarch64": "generic 64-bit ARM Linux, NEON",
    "rpi3": "Raspberry Pi 3 (Cortex-A53), 64-bit OS",
    "rpi4": "Raspberry Pi 4 (Cortex-A72), TVM tag raspberry-pi/4b-aarch64",
    "rpi5": "Raspberry Pi 5 (Cortex-A76)",
}
_ARCH_ALIASES = {"arm64": "aarch64", "amd64": "x86_64", "x64": "x86_64", "i686": "x86", "i386": "x86"}
#: Debian's cross compilers, by target architecture.
CROSS_COMPILERS = {"aarch64": "aarch64-linux-gnu-gcc", "arm": "arm-linux-gnueabihf-gcc",
                   "armv7l": "arm-linux-gnueabihf-gcc", "armv8l": "arm-linux-gnueabihf-gcc",
                   "riscv64": "riscv64-linux-gnu-gcc"}
_APT_PACKAGE = {"aarch64-linux-gnu-gcc": "gcc-aarch64-linux-gnu",
                "arm-linux-gnueabihf-gcc": "gcc-arm-linux-gnueabihf",
                "riscv64-linux-gnu-gcc": "gcc-riscv64-linux-gnu"}

__all__ = ["TARGET_PRESETS", "resolve_target", "target_arch", "host_arch", "is_cross_target",
           "compile_network", "export_library", "load", "read_metadata", "sidecar_path"]


# ---------------------------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------------------------


def resolve_target(target: Any = "llvm"):
    """A ``tvm.target.Target`` from a preset name (:data:`TARGET_PRESETS`), ``"llvm"``,
    ``"native"``, a TVM tag, a dict, a JSON dict string or a Target."""
    import tvm

    from .tvm_backend.runtime import make_target

    if isinstance(target, str):
        spec = target.strip()
        if spec in TARGET_PRESETS:
            return tvm.target.Target(TARGET_PRESETS[spec])
        if spec.startswith("{"):
            try:
                target = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise PFPError(f"target {spec!r} is not valid JSON: {exc}") from None
        elif " -" in spec:
            raise PFPError(f"target {spec!r}: TVM 0.27 does not accept 'llvm -mcpu=...' strings; use a "
                           f"preset ({', '.join(TARGET_PRESETS)}), a TVM tag or a JSON dict such as "
                           '\'{"kind": "llvm", "mcpu": "cortex-a72"}\'')
    try:
        return make_target(target)
    except Exception as exc:  # TVM raises ValueError / TVMError with long messages
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PFPError(f"unknown target {target!r} ({first}). Use 'llvm', 'native', a preset "
                       f"({', '.join(TARGET_PRESETS)}), a TVM tag (tvm.target.list_tags()) or a "
                       "target dict.") from None


def _norm_arch(arch: str) -> str:
    arch = arch.lower()
    return _ARCH_ALIASES.get(arch, arch)


def host_arch() -> str:
    """This machine's CPU architecture (``x86_64``, ``aarch64``, …)."""
    return _norm_arch(platform.machine())


def target_arch(target: Any) -> str:
    """The CPU architecture a target generates code for (from its ``mtriple``; host if unset)."""
    triple = _target_triple(target)
    return _norm_arch(triple.split("-")[0]) if triple else host_arch()


def _target_triple(target: Any) -> str:
    t = resolve_target(target)
    triple = str(t.attrs.get("mtriple", "") or "")
    if not triple and t.host is not None:
        triple = str(t.host.attrs.get("mtriple", "") or "")
    return triple


def is_cross_target(target: Any) -> bool:
    """Whether code for ``target`` cannot run on this machine (another CPU architecture)."""
    return target_arch(target) != host_arch()


def compile_network(net: Any, target: Any = "native", *, schedule: bool = True, tune: Any = None,
                    num_threads: int | None = None):
    """``net.compile(target)`` with presets and cross-compilation.

    Host targets give a runnable :class:`~pyro2pfp.tvm_backend.runtime.CompiledPFP`; targets for
    another architecture give one that only exports (``exe.export_library(path)``); those cannot
    be tuned here (MetaSchedule measures candidates on the machine it runs on).
    """
    from .tvm_backend import runtime

    tgt = resolve_target(target)
    if not is_cross_target(tgt):
        return runtime.compile_network(net, tgt, schedule=schedule, tune=tune, num_threads=num_threads)
    if tune is not None and tune is not False:
        raise PFPError(f"cannot tune for {target_arch(tgt)} on this {host_arch()} machine: MetaSchedule "
                       "measures every candidate where it runs; compile without tune= or tune on the device")
    executable = runtime.build_network(net, tgt, schedule)
    return runtime.CompiledPFP.for_cross_target(executable, net.input_shape, net.input_variance, tgt)


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------


def sidecar_path(path: str | os.PathLike) -> str:
    """The metadata file written next to a library: ``path + ".json"``."""
    return os.fspath(path) + SIDECAR_SUFFIX


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


_NOISE = re.compile(r"Warning: Scope (Saving|Loaded):\s*$")


@contextlib.contextmanager
def _native_stderr_filtered():
    """Drop the ``Warning: Scope Saving:`` lines TVM's C++ runtime prints on export/load."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            kept = [line for line in text.splitlines() if line.strip() and not _NOISE.search(line)]
            if kept:
                sys.stderr.write("\n".join(kept) + "\n")


def _cross_fcompile(arch: str, cc: str | None):
    from tvm.support import cc as tvm_cc

    compiler = cc or os.environ.get("PYRO2PFP_CROSS_CC") or CROSS_COMPILERS.get(arch)
    if compiler is None:
        raise PFPError(f"no known cross compiler for {arch}: pass cc='<triple>-gcc' or export a .tar")
    if shutil.which(compiler) is None:
        package = _APT_PACKAGE.get(compiler, f"a {arch} cross toolchain")
        raise PFPError(
            f"exporting a {arch} shared library needs the cross compiler '{compiler}', which is not on "
            f"PATH. Install it (Debian/Ubuntu: apt-get install -y {package}), set PYRO2PFP_CROSS_CC, "
            f"or export a .tar instead (object files only; no toolchain needed, link on the device).")
    return tvm_cc.cross_compiler(compiler)


def export_library(exe: Any, path: str | os.PathLike, *, cc: str | None = None,
                   metadata: dict[str, Any] | None = None) -> str:
    """Write ``exe`` (a CompiledPFP) to ``path`` (``.so`` or ``.tar``) plus ``path + ".json"``.

    For a cross target, ``.so`` is linked with the target's cross compiler (``cc`` or
    ``$PYRO2PFP_CROSS_CC`` overrides the default, e.g. ``aarch64-linux-gnu-gcc``); ``.tar`` holds
    the object files and needs no toolchain.  ``metadata``: extra JSON-serialisable entries for the
    sidecar (the CLI stores the layer plan).  Returns the library path.
    """
    import tvm

    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".so", ".tar"):
        raise PFPError(f"{path}: the library must end in .so (shared library) or .tar (object files); "
                       "for ONNX use net.to_onnx(path)")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise PFPError(f"cannot write {path}: directory {directory} does not exist")
    executable = exe.executable
    if not hasattr(executable, "export_library"):
        raise PFPError(f"this predictor ({type(executable).__name__}) cannot be exported")
    arch = target_arch(exe.target)
    kwargs = {}
    if ext == ".so" and arch != host_arch():
        kwargs["fcompile"] = _cross_fcompile(arch, cc)
    elif ext == ".so" and cc:
        from tvm.support import cc as tvm_cc

        kwargs["fcompile"] = tvm_cc.cross_compiler(cc)
    with _native_stderr_filtered():
        executable.export_library(path, **kwargs)

    from . import __version__

    info = {
        "format": FORMAT,
        "library": os.path.basename(path),
        "sha256": _sha256(path),
        "input_shape": list(exe.input_shape),
        "input_variance": bool(exe.input_variance),
        "inputs": ["x", "x_var"] if exe.input_variance else ["x"],
        "outputs": ["mean", "var"],
        "dtype": "float32",
        "target": json.loads(str(exe.target)),
        "target_arch": arch,
        "pyro2pfp_version": __version__,
        "tvm_version": tvm.__version__,
    }
    info.update(getattr(exe, "metadata_extra", None) or {})
    info.update(metadata or {})
    with open(sidecar_path(path), "w") as f:
        json.dump(info, f, indent=2)
        f.write("\n")
    return path


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The sidecar metadata of an exported library (``path`` is the library or its ``.json``)."""
    path = os.fspath(path)
    meta_path = path if path.endswith(SIDECAR_SUFFIX) else sidecar_path(path)
    if not os.path.exists(meta_path):
        raise PFPError(
            f"{meta_path} not found: pyro2pfp.load needs the metadata file that exe.export_library() "
            f"writes next to the library (input shape, input variance). Copy it along with "
            f"{os.path.basename(path)}, or pass input_shape=... and input_variance=... to load().")
    try:
        with open(meta_path) as f:
            info = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise PFPError(f"{meta_path} is not a pyro2pfp metadata file: {exc}") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise PFPError(f"{meta_path} is not a pyro2pfp metadata file (format {FORMAT!r} expected)")
    return info


def load(path: str | os.PathLike, *, input_shape: tuple[int, ...] | None = None,
         input_variance: bool | None = None):
    """Load a library written by ``exe.export_library(path)``: a predictor that behaves like ``exe``.

    Returns a :class:`~pyro2pfp.tvm_backend.runtime.CompiledPFP`: ``exe(x[, x_var]) -> (mean, var)``
    float32 NumPy arrays, same input checks.  The input shape and input-variance flag come from
    ``path + ".json"``; ``input_shape`` / ``input_variance`` override them (or replace a lost
    sidecar).  Uses ``tvm.runtime.load_module`` (a ``.tar`` is linked here with the system compiler).
    """
    import tvm

    from .tvm_backend.runtime import CompiledPFP

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such library: {path}")
    if input_shape is not None and input_variance is not None:
        info: dict[str, Any] = {}
        if os.path.exists(sidecar_path(path)):
            info = read_metadata(path)
    else:
        info = read_metadata(path)
    shape = tuple(int(d) for d in (input_shape if input_shape is not None else info["input_shape"]))
    takes_var = bool(input_variance if input_variance is not None else info["input_variance"])
    arch = info.get("target_arch")
    if arch and _norm_arch(arch) != host_arch():
        raise PFPError(
            f"{path} was compiled for {arch}; this machine is {host_arch()}. Copy {os.path.basename(path)} "
            f"and {os.path.basename(sidecar_path(path))} to an {arch} machine with pyro2pfp (or the TVM "
            f"runtime) installed and load it there.")
    if info.get("sha256") and info["sha256"] != _sha256(path):
        warnings.warn(f"{path} differs from the library the metadata file was written for "
                      "(sha256 mismatch); re-export both files together", stacklevel=2)
    try:
        with _native_stderr_filtered():
            lib = tvm.runtime.load_module(path)
    except Exception as exc:
        first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise PFPError(f"cannot load {path} with the TVM runtime: {first}") from exc
    target: Any = info.get("target", "llvm")
    try:
        target = tvm.target.Target(json.loads(target)) if isinstance(target, str) else tvm.target.Target(target)
    except Exception:  # informational only
        target = tvm.target.Target("llvm")
    exe = CompiledPFP(lib, shape, takes_var, target)
    keep = ("model", "builder", "plan", "calibration", "moment_form", "source", "params")
    exe.metadata_extra = {k: v for k, v in info.items() if k in keep}
    exe.library_path = path
    return exe
