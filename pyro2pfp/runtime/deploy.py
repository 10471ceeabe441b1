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
:class:`~pyro2pfp.runtime.predictor.CompiledPFP` (input validation included) as ``net.compile``.
A predictor with batch-specialised executables (``net.compile(..., batch_sizes=[10])`` or
``tune=...``) also writes one library per batch size, ``lenet.batch10.so``, listed in the sidecar with
its sha256; copy those too: :func:`load` loads them back, so a call with 10 rows runs the specialised
executable as in the process that compiled it.

**Cross-compilation.** A target whose ``mtriple`` names another architecture than this machine's
(``"aarch64"``, the board presets below, ``"raspberry-pi/4b-aarch64"``, any TVM tag or target dict)
is compiled by TVM's LLVM; the returned predictor cannot run here, but exports: ``.tar`` needs no
toolchain, ``.so`` needs the cross linker (Debian/Ubuntu: ``apt-get install gcc-aarch64-linux-gnu``).
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Any

import numpy as np

from ..errors import ArgumentError, LibraryNotFoundError, LoadError
from . import tvm_runtime as rt
from .library_files import (
    BATCH_KEY,
    FORMAT,
    SIDECAR_SUFFIX,
    _native_stderr_filtered,
    _sha256,
    batch_library_path,
    export_library,
    sidecar_path,
)
from .onnx_runtime import OnnxPredictor
from .predictor import CompiledPFP
from .targets import PRESET_HELP, TARGET_PRESETS, _norm_arch, host_arch, is_cross_target, resolve_target, target_arch

__all__ = ["TARGET_PRESETS", "PRESET_HELP", "FORMAT", "resolve_target", "target_arch", "host_arch",
           "is_cross_target", "export_library", "load", "read_metadata", "sidecar_path",
           "batch_library_path"]


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The sidecar metadata of an exported library (``path`` is the library or its ``.json``)."""
    path = os.fspath(path)
    meta_path = path if path.endswith(SIDECAR_SUFFIX) else sidecar_path(path)
    if not os.path.exists(meta_path):
        raise LoadError(
            f"{meta_path} not found: pyro2pfp.load needs the metadata file that exe.export_library() "
            f"writes next to the library (input shape, input variance). Copy it along with "
            f"{os.path.basename(path)}, or pass input_shape=... and input_variance=... to load().")
    try:
        with open(meta_path) as f:
            info = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoadError(f"{meta_path} is not a pyro2pfp metadata file: {exc}") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise LoadError(f"{meta_path} is not a pyro2pfp metadata file (format {FORMAT!r} expected)")
    return info


def _metadata_signature(info: dict[str, Any], meta: str, input_shape: Any,
                        input_variance: bool | None) -> tuple[tuple[int, ...], bool]:
    """(input shape, input-variance flag) from the arguments, else the metadata (checked)."""
    shape = input_shape if input_shape is not None else info.get("input_shape")
    takes_var = input_variance if input_variance is not None else info.get("input_variance")
    if shape is None or takes_var is None:
        missing = [k for k, v in (("input_shape", shape), ("input_variance", takes_var)) if v is None]
        raise LoadError(f"{meta} has no {' or '.join(missing)}: re-export the library, or pass "
                        f"{'=..., '.join(missing)}=... to load()")
    if isinstance(shape, str | bytes) or not isinstance(shape, list | tuple) or not shape or not all(
            isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
        where = "load(input_shape=...)" if input_shape is not None else meta
        raise LoadError(f"{where}: input_shape must be a list of positive ints, got {shape!r}")
    if not isinstance(takes_var, bool):
        where = "load(input_variance=...)" if input_variance is not None else meta
        raise LoadError(f"{where}: input_variance must be true or false, got {takes_var!r}")
    return tuple(shape), takes_var


def _last_line(exc: BaseException) -> str:
    """The last line of ``exc``'s message (TVM puts the reason there, after its traceback), else its type."""
    text = str(exc).strip()
    return text.splitlines()[-1] if text else type(exc).__name__


def _check_signature(vm: Any, device: Any, path: str, shape: tuple[int, ...], takes_var: bool, head: Any = None,
                     batch: int = 1) -> None:
    """The library's own ``main`` (run by ``vm``) must take what the metadata says: its arity, and one
    call on zeros of ``(batch, *shape)`` giving ``batch`` rows."""
    arity = int(vm.module["get_function_arity"]("main"))
    if arity != 1 + int(takes_var):
        raise LoadError(f"{path}: the library's main takes {arity} input(s), but its metadata says "
                        f"input_variance={takes_var} ({1 + int(takes_var)} input(s)); the two files do not belong "
                        "together: re-export them")
    zeros = [np.zeros((batch, *shape), np.float32)] * arity
    try:
        mean, var = vm["main"](*[rt.tensor(z, device) for z in zeros])
        mean, var = np.from_dlpack(mean), np.from_dlpack(var)
    except Exception as exc:
        first = _last_line(exc)
        raise LoadError(f"{path}: the library does not accept input of shape (batch, "
                        f"{', '.join(map(str, shape))}) that its metadata (or load's input_shape) states "
                        f"(tried batch {batch}: {first}); the library and the shape do not belong together") from None
    if (mean.shape != var.shape and not head) or mean.shape[:1] != (batch,) or var.shape[:1] != (batch,):
        raise LoadError(f"{path}: main returned outputs of shapes {mean.shape} and {var.shape} for {batch} "
                        "input(s); this is not a pyro2pfp library")


def _check_sha256(path: str, recorded: str, verify_sha256: bool, what: str) -> None:
    """``path``'s sha256 must be ``recorded``: a :class:`LoadError` naming it (with
    ``verify_sha256=False`` a warning)."""
    if recorded == _sha256(path):
        return
    message = (f"{path} is not the {what} its metadata file was written for (sha256 mismatch): re-export "
               "the files together")
    if verify_sha256:
        raise LoadError(message + ", or load(..., verify_sha256=False) to accept it")
    warnings.warn(message, stacklevel=3)


def _load_module(path: str) -> Any:
    """``path`` loaded by the TVM runtime (:func:`pyro2pfp.runtime.tvm_runtime.load_module`; TVM's save/load
    noise dropped); a :class:`LoadError` naming it."""
    try:
        with _native_stderr_filtered():
            return rt.load_module(path)
    except Exception as exc:
        first = _last_line(exc)
        raise LoadError(f"cannot load {path} as a pyro2pfp library with the TVM runtime: {first}") from exc


def _batch_library_files(info: dict[str, Any], meta: str, verify_sha256: bool) -> dict[int, str]:
    """``{batch: library path}`` of the batch-specialised executables the sidecar lists under
    :data:`~pyro2pfp.runtime.library_files.BATCH_KEY` (none for a sidecar without that key).  Each file must be a
    plain file name in the sidecar's directory (nothing outside it is loaded), exist, and have the
    recorded sha256 -- the checks the main library gets; every failure is a :class:`LoadError`
    naming the file."""
    entries = info.get(BATCH_KEY)
    if entries is None:
        return {}
    if not isinstance(entries, dict):
        raise LoadError(f"{meta}: {BATCH_KEY!r} must map batch sizes to {{'library': ..., 'sha256': ...}}, "
                        f"got {entries!r}")
    directory = os.path.dirname(os.path.abspath(meta))
    files = {}
    for key, entry in entries.items():
        batch = int(key) if isinstance(key, str) and key.isdigit() and int(key) > 0 else None
        name = entry.get("library") if isinstance(entry, dict) else None
        recorded = entry.get("sha256") if isinstance(entry, dict) else None
        if batch is None or not isinstance(name, str) or not isinstance(recorded, str):
            raise LoadError(f"{meta}: {BATCH_KEY}[{key!r}] must be a batch size >= 1 mapped to "
                            f"{{'library': file name, 'sha256': hex digest}}, got {entry!r}")
        if name in ("", ".", "..") or os.path.basename(name) != name or (os.altsep and os.altsep in name):
            raise LoadError(f"{meta}: the batch-{batch} library {name!r} must be a file name in the metadata "
                            "file's directory (no path)")
        file = os.path.join(directory, name)
        if not os.path.isfile(file):
            raise LoadError(f"{file} not found: {os.path.basename(meta)} lists it as the executable for batch "
                            f"{batch}; copy it along with the library and its metadata file (every file the "
                            "metadata lists), or re-export them")
        _check_sha256(file, recorded, verify_sha256, f"batch-{batch} library")
        files[batch] = file
    return dict(sorted(files.items()))


def _relax_executable(module: Any, path: str, what: str) -> Any:
    """``module`` if a Relax VM can run it; else a :class:`LoadError` naming ``path`` (``what`` it is)."""
    try:
        rt.virtual_machine(module, rt.cpu())
    except Exception as exc:
        raise LoadError(f"{path} ({what}) is not a Relax executable the TVM runtime can run: "
                        f"{_last_line(exc)}") from exc
    return module


def load(path: str | os.PathLike, *, input_shape: tuple[int, ...] | None = None,
         input_variance: bool | None = None, verify_sha256: bool = True):
    """Load a library written by ``exe.export_library(path)``, or an ONNX model written by
    ``net.to_onnx(path)``: a predictor that behaves like the one exported.

    Parameters
    ----------
    path
        The library (``.so``, ``.tar``; its metadata is ``path + ".json"``) or an ``.onnx`` file (run
        with onnxruntime; its input shape and input-variance flag come from the model itself).
    input_shape, input_variance
        Override the metadata's input shape and input-variance flag (or replace a lost sidecar).
    verify_sha256
        ``False`` accepts a library changed since export (e.g. re-linked on the device).

    Returns
    -------
    CompiledPFP or OnnxPredictor
        ``exe(x[, x_var]) -> (mean, var)`` float32 NumPy arrays with the same input checks as the
        exported predictor (a network converted with ``head="probs"``: a
        :class:`~pyro2pfp.ops.head.HeadOutput`, as its sidecar's ``"head"`` says).

    Raises
    ------
    LoadError
        Naming the path, for any failure of the checks below.

    Notes
    -----
    Uses the TVM runtime's module loader (a ``.tar`` is linked here with the system compiler).

    What is checked: the
    library exists and is a TVM library with a Relax ``main``; the metadata file parses and has the
    input shape and flag; the library's sha256 equals the one recorded at export (pass
    ``verify_sha256=False`` to accept a library changed since, e.g. re-linked on the device); the
    target architecture is this machine's; and the library's own ``main`` takes what the metadata
    says (its number of inputs, and one call on zeros of the stated shape).  The batch-specialised
    executables the sidecar lists (``net.batch10.so``, from ``net.compile(batch_sizes=...)`` or
    ``tune=...``) are loaded into ``exe.tuned`` (calls with that many rows run them) after the same
    checks: each file is in the sidecar's directory, exists, has its recorded sha256, and its
    ``main`` takes the stated inputs at its batch size; a missing or changed one is a ``LoadError``
    naming it (never a silent fall-back to the any-batch executable).

    Loading and running need only NumPy and the TVM runtime (:mod:`pyro2pfp.runtime.tvm_runtime`): neither
    torch, Pyro nor the TVM compiler is imported (``exe.target`` imports ``tvm`` when read).
    """
    path = os.fspath(path)
    if path.lower().endswith(".onnx"):
        if input_shape is not None or input_variance is not None:
            raise ArgumentError(f"{path}: an ONNX model states its own input shape and input variance; "
                                "input_shape= and input_variance= are for compiled libraries")
        if not os.path.isfile(path):
            raise LibraryNotFoundError(f"no such ONNX model: {path}")

        return OnnxPredictor(path)
    if path.endswith(SIDECAR_SUFFIX) and os.path.isfile(path[: -len(SIDECAR_SUFFIX)]):
        raise LoadError(f"{path} is the metadata file: pass the library itself, "
                        f"pyro2pfp.load({path[: -len(SIDECAR_SUFFIX)]!r})")
    if not os.path.isfile(path):
        raise LibraryNotFoundError(f"no such library: {path}")
    meta = sidecar_path(path)
    info: dict[str, Any] = {}
    if input_shape is None or input_variance is None or os.path.exists(meta):
        info = read_metadata(path)
    shape, takes_var = _metadata_signature(info, meta, input_shape, input_variance)
    arch = info.get("target_arch")
    if arch and _norm_arch(arch) != host_arch():
        raise LoadError(
            f"{path} was compiled for {arch}; this machine is {host_arch()}. Copy {os.path.basename(path)} "
            f"and {os.path.basename(sidecar_path(path))} to an {arch} machine with pyro2pfp (or the TVM "
            f"runtime) installed and load it there.")
    if info.get("sha256"):
        _check_sha256(path, info["sha256"], verify_sha256, "library")
    batch_files = _batch_library_files(info, meta, verify_sha256)
    lib = _load_module(path)
    specialised = {batch: _relax_executable(_load_module(file), file, f"the batch-{batch} executable {meta} lists")
                   for batch, file in batch_files.items()}
    target: Any = info.get("target") or "llvm"
    if isinstance(target, str) and target.lstrip().startswith("{"):
        try:
            target = json.loads(target)
        except ValueError:  # informational only: CompiledPFP.target falls back to llvm
            target = "llvm"
    if not isinstance(target, dict | str):
        target = "llvm"
    try:
        exe = CompiledPFP(lib, shape, takes_var, target, tuned=specialised)
    except Exception as exc:
        first = _last_line(exc)
        raise LoadError(f"cannot load {path} as a pyro2pfp library with the TVM runtime: {first}") from exc
    head = info.get("head")
    if head is None and any(isinstance(v, list | tuple) and v and v[0] == "softmax_head"
                            for v in (info.get("kernels") or {}).values()):
        head = "probs"  # a sidecar without the "head" entry: the kernel table names the head's kernel
    if head not in (None, "probs"):
        raise LoadError(f"{meta}: unknown head {head!r} (expected null or \"probs\")")
    _check_signature(exe.vm, exe.device, path, shape, takes_var, head)
    for batch, file in batch_files.items():
        _check_signature(exe.vm_for_batch(batch), exe.device, file, shape, takes_var, head, batch=batch)
    exe.head = head
    keep = ("model", "builder", "plan", "calibration", "moment_form", "source", "params")
    exe.metadata_extra = {k: v for k, v in info.items() if k in keep}
    exe.library_path = path
    exe.kernels = {str(k): (str(v[0]), str(v[1])) for k, v in (info.get("kernels") or {}).items()
                   if isinstance(v, list | tuple) and len(v) == 2}
    return exe
