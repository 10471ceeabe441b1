"""The files of a compiled predictor: its library (TVM's ``export_library``) and the JSON sidecar
beside it, written here and read back by :func:`pyro2pfp.runtime.deploy.load`.

``export_library(exe, path)`` writes ``path`` (``.so``: a shared library; ``.tar``: the object files,
linked by ``load`` on the machine that loads it), one more library per batch-specialised executable
(``exe.tuned``: static-shape from ``compile(batch_sizes=...)`` or MetaSchedule-tuned from
``compile(tune=...)``) next to it, ``<stem>.batch<B><ext>`` (:func:`batch_library_path`), and
``path + ".json"``: the input shape, whether it takes an input variance, the target, versions, the
sha256 of the library and, under ``"batch_executables"``, ``{"<B>": {"library": file name relative
to the sidecar, "sha256": ...}}`` (:func:`pyro2pfp.runtime.deploy.load` checks them against the files).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterable
from typing import Any

from .._version import __version__
from ..errors import ArgumentError, PFPError
from .targets import host_arch, target_arch

SIDECAR_SUFFIX = ".json"
FORMAT = "pyro2pfp-library/1"

#: Debian's cross compilers, by target architecture.
CROSS_COMPILERS = {"aarch64": "aarch64-linux-gnu-gcc", "arm": "arm-linux-gnueabihf-gcc",
                   "armv7l": "arm-linux-gnueabihf-gcc", "armv8l": "arm-linux-gnueabihf-gcc",
                   "riscv64": "riscv64-linux-gnu-gcc"}
_APT_PACKAGE = {"aarch64-linux-gnu-gcc": "gcc-aarch64-linux-gnu",
                "arm-linux-gnueabihf-gcc": "gcc-arm-linux-gnueabihf",
                "riscv64-linux-gnu-gcc": "gcc-riscv64-linux-gnu"}


#: Sidecar key of the batch-specialised executables: ``{"<batch>": {"library": name, "sha256": hex}}``.
BATCH_KEY = "batch_executables"


def sidecar_path(path: str | os.PathLike) -> str:
    """The metadata file written next to a library: ``path + ".json"``."""
    return os.fspath(path) + SIDECAR_SUFFIX


def batch_library_path(path: str | os.PathLike, batch: int) -> str:
    """Where the executable specialised to ``batch`` is written next to the library ``path``:
    ``net.so`` -> ``net.batch10.so`` (same directory, same extension)."""
    stem, ext = os.path.splitext(os.fspath(path))
    return f"{stem}.batch{int(batch)}{ext}"


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

    return tvm_cc.cross_compiler(cross_compiler(arch, cc))


def cross_compiler(arch: str, cc: str | None = None) -> str:
    """The compiler that links shared libraries for ``arch`` on this machine: ``cc``, else
    ``$PYRO2PFP_CROSS_CC``, else Debian's (:data:`CROSS_COMPILERS`); a clear error if not on PATH."""
    compiler = cc or os.environ.get("PYRO2PFP_CROSS_CC") or CROSS_COMPILERS.get(arch)
    if compiler is None:
        raise PFPError(f"no known cross compiler for {arch}: pass cc='<triple>-gcc' or export a .tar")
    if shutil.which(compiler) is None:
        package = _APT_PACKAGE.get(compiler, f"a {arch} cross toolchain")
        raise PFPError(
            f"exporting a {arch} shared library needs the cross compiler '{compiler}', which is not on "
            f"PATH. Install it (Debian/Ubuntu: apt-get install -y {package}), set PYRO2PFP_CROSS_CC, "
            f"or export a .tar instead (object files only; no toolchain needed, link on the device).")
    return compiler


def export_library(exe: Any, path: str | os.PathLike, *, cc: str | None = None,
                   metadata: dict[str, Any] | None = None, batches: Iterable[int] | None = None) -> str:
    """Write ``exe`` (a CompiledPFP) to ``path`` (``.so`` or ``.tar``) plus ``path + ".json"``.

    Every batch-specialised executable of ``exe.tuned`` (``{batch: executable}``) is written too,
    to :func:`batch_library_path` (``net.batch10.so``), and listed in the sidecar under
    :data:`BATCH_KEY` with its file name (relative to the sidecar) and sha256; ``batches`` limits
    them to those sizes (default: all; :func:`pyro2pfp.runtime.remote.upload` writes only the one it runs).
    For a cross target, ``.so`` is linked with the target's cross compiler (``cc`` or
    ``$PYRO2PFP_CROSS_CC`` overrides the default, e.g. ``aarch64-linux-gnu-gcc``); ``.tar`` holds
    the object files and needs no toolchain.  ``metadata``: extra JSON-serialisable entries for the
    sidecar (the CLI stores the layer plan).  Batch libraries that an earlier export to the same
    ``path`` listed and this one does not are removed (so the directory holds what the sidecar lists;
    no other file is touched).  Returns the library path.
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
    specialised = _batch_executables(exe, batches)
    earlier = _listed_batch_files(path)
    for what in (executable, *specialised.values()):
        if not hasattr(what, "export_library"):
            raise PFPError(f"this predictor ({type(what).__name__}) cannot be exported")
    arch = target_arch(exe.target)
    kwargs = {}
    if ext == ".so" and arch != host_arch():
        kwargs["fcompile"] = _cross_fcompile(arch, cc)
    elif ext == ".so" and cc:
        from tvm.support import cc as tvm_cc

        kwargs["fcompile"] = tvm_cc.cross_compiler(cc)
    with _native_stderr_filtered():
        executable.export_library(path, **kwargs)
        batch_files = {}
        for batch, specialised_exe in specialised.items():
            batch_path = batch_library_path(path, batch)
            specialised_exe.export_library(batch_path, **kwargs)
            batch_files[str(batch)] = {"library": os.path.basename(batch_path), "sha256": _sha256(batch_path)}

    info = {
        "format": FORMAT,
        "library": os.path.basename(path),
        "sha256": _sha256(path),
        "input_shape": list(exe.input_shape),
        "input_variance": bool(exe.input_variance),
        "inputs": ["x", "x_var"] if exe.input_variance else ["x"],
        "outputs": ["probs", "uncertainty"] if getattr(exe, "head", None) else ["mean", "var"],
        "head": getattr(exe, "head", None),
        "dtype": "float32",
        "target": json.loads(str(exe.target)),
        "target_arch": arch,
        "pyro2pfp_version": __version__,
        "tvm_version": tvm.__version__,
        "kernels": {symbol: list(op_layer) for symbol, op_layer in getattr(exe, "kernels", {}).items()},
    }
    info.update(getattr(exe, "metadata_extra", None) or {})
    info.update(metadata or {})
    info[BATCH_KEY] = batch_files  # the files written now, whatever the extra metadata says
    with open(sidecar_path(path), "w") as f:
        json.dump(info, f, indent=2)
        f.write("\n")
    for stale in earlier - {batch_library_path(path, int(b)) for b in batch_files}:
        os.remove(stale)  # an earlier export's batch library that this one does not list
    return path


def _listed_batch_files(path: str) -> set[str]:
    """The batch libraries an earlier export to ``path`` wrote and listed in its sidecar (only files
    of the :func:`batch_library_path` names that exist: nothing else is ever removed); empty if there
    is no readable sidecar."""
    try:
        with open(sidecar_path(path)) as f:
            entries = json.load(f).get(BATCH_KEY) or {}
    except (OSError, ValueError, AttributeError):
        return set()
    files = set()
    for key, entry in entries.items() if isinstance(entries, dict) else ():
        if not (isinstance(key, str) and key.isdigit() and int(key) > 0 and isinstance(entry, dict)):
            continue
        ours = batch_library_path(path, int(key))
        if entry.get("library") == os.path.basename(ours) and os.path.isfile(ours):
            files.add(ours)
    return files


def _batch_executables(exe: Any, batches: Iterable[int] | None) -> dict[int, Any]:
    """``exe.tuned`` (``{batch: executable}``) in batch order, limited to ``batches`` if given (a size
    without an executable is an :class:`~pyro2pfp.errors.ArgumentError`)."""
    tuned = {int(b): e for b, e in (getattr(exe, "tuned", None) or {}).items()}
    if batches is None:
        return dict(sorted(tuned.items()))
    wanted = sorted({int(b) for b in batches})
    missing = [b for b in wanted if b not in tuned]
    if missing:
        raise ArgumentError(f"export_library(batches={wanted}): no batch-specialised executable for "
                            f"{missing}; this predictor has {sorted(tuned) or 'none'}")
    return {b: tuned[b] for b in wanted}
