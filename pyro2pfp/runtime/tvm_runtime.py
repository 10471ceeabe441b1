"""The TVM *runtime* without the TVM compiler: what loading and running an exported library needs.

``import tvm`` loads the whole compiler (``libtvm_compiler.so``, ~250 MB, and the Python packages of
Relax, TIR, TE, ...: seconds and hundreds of MB), although running a library needs only
``libtvm_runtime.so`` (~3 MB) and the FFI (``tvm_ffi``).  This module loads just those two -- from the
installed ``apache-tvm`` and ``apache-tvm-ffi`` wheels -- and offers the few operations a predictor
uses: :func:`load_module`, :class:`VirtualMachine` (the Relax VM of an executable), :func:`empty`,
:func:`cpu`, and the thread pool (:func:`num_threads`, :func:`config_threadpool`).  The objects are
the FFI's own (``tvm_ffi.Module``, ``tvm_ffi.Tensor``); :func:`as_tvm` turns one into the
``tvm`` package's class when compiler-side code (profiling: the VM's instrument hook) needs it.

If ``tvm`` is already imported its libraries are loaded and are used as they are.

``tvm_ffi`` imports torch if it can, for its optional torch interoperability; pyro2pfp hands the
runtime NumPy arrays only, so when torch is not imported yet it is hidden from that one import (torch
stays importable afterwards): on a machine with torch installed, loading a library then costs no
torch import (seconds and hundreds of MB).  A ``.tar`` library (object files) is linked with the system compiler
through ``tvm``'s own ``load_module``, which imports ``tvm``.

Threads: TVM's CPU thread pool is process-wide and sized when it first starts.  TVM sizes it to half
the logical CPUs on x86 ("ignore hyper-threading"), which is *one* thread on a 2-core VM without SMT,
and pins the calling thread to core 0 (after which every torch/OpenBLAS thread started by that
thread shares core 0).  Importing this module therefore sets, unless already set,
``TVM_NUM_THREADS`` to the cores this process may use (:func:`default_num_threads`) and
``TVM_BIND_THREADS=0``.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from typing import Any

import numpy as np

from ..errors import LoadError

__all__ = ["VirtualMachine", "as_tvm", "available_cpus", "config_threadpool", "cpu", "default_num_threads",
           "empty", "ffi", "load_module", "num_threads", "tensor", "virtual_machine"]

KDL_CPU = 1
"""DLPack's device type of the CPU."""
POOLED_ALLOCATOR = 2
"""The Relax VM's pooled allocator (what ``tvm.relax.VirtualMachine`` uses by default)."""


def available_cpus() -> list[int]:
    """The logical CPUs this process may run on (its affinity)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover -- not Linux
        return list(range(os.cpu_count() or 1))


def default_num_threads() -> int:
    """Physical cores available to this process (CPU affinity), at least 1."""
    available = len(available_cpus())
    try:
        import psutil

        physical = psutil.cpu_count(logical=False) or available
    except Exception:  # noqa: BLE001 -- psutil missing or unsupported platform
        physical = available
    return max(1, min(available, physical))


if "TVM_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in os.environ:
    os.environ["TVM_NUM_THREADS"] = str(default_num_threads())
os.environ.setdefault("TVM_BIND_THREADS", "0")

_FFI: Any = None


def _import_ffi_without_torch() -> Any:
    """``import tvm_ffi`` with torch hidden from it when torch is not imported yet (see the module doc)."""
    if "tvm_ffi" in sys.modules or "torch" in sys.modules:
        import tvm_ffi

        return tvm_ffi
    sys.modules["torch"] = None  # type: ignore[assignment]  # "import torch" raises ImportError
    try:
        import tvm_ffi
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return tvm_ffi


def _runtime_library() -> str:
    """``libtvm_runtime.so`` of the installed ``apache-tvm`` (found without importing ``tvm``)."""
    spec = importlib.util.find_spec("tvm")
    roots = [os.path.dirname(spec.origin)] if spec is not None and spec.origin else []
    names = {"linux": "libtvm_runtime.so", "darwin": "libtvm_runtime.dylib", "win32": "tvm_runtime.dll"}
    name = names.get(sys.platform, "libtvm_runtime.so")
    env = os.environ.get("TVM_LIBRARY_PATH")
    candidates = ([os.path.join(env, name)] if env else []) + [
        os.path.join(root, sub, name) for root in roots for sub in ("lib", "lib64", "")]
    for path in candidates:
        if os.path.isfile(path):
            return path
    raise LoadError(f"the TVM runtime library {name} was not found (looked in {', '.join(candidates) or 'nowhere'}): "
                    "install the TVM runtime with pip install 'apache-tvm==0.27.*'")


def ffi() -> Any:
    """The ``tvm_ffi`` module, with the TVM runtime library loaded (once per process)."""
    global _FFI
    if _FFI is None:
        module = _import_ffi_without_torch()
        if "tvm" not in sys.modules:  # else tvm has loaded its libraries already
            ctypes.CDLL(_runtime_library(), ctypes.RTLD_GLOBAL)
        _FFI = module
    return _FFI


def cpu() -> Any:
    """The CPU device: ``tvm.cpu()`` if ``tvm`` is imported, else the FFI's."""
    tvm = sys.modules.get("tvm")
    if tvm is not None and hasattr(tvm, "cpu"):
        return tvm.cpu()
    return ffi().device("cpu", 0)


def virtual_machine(executable: Any, device: Any) -> Any:
    """The Relax VM of ``executable`` on ``device`` (from :func:`cpu`): TVM's own
    (``tvm.relax.VirtualMachine``, with ``time_evaluator`` and the instrument hook) if ``tvm`` was
    imported when the device was made, else :class:`VirtualMachine`."""
    tvm = sys.modules.get("tvm")
    if tvm is not None and isinstance(device, tvm.runtime.Device):
        from tvm.runtime.vm import VirtualMachine as TVMVirtualMachine

        plain = isinstance(executable, ffi().Module) and not isinstance(executable, tvm.runtime.Module)
        return TVMVirtualMachine(as_tvm(executable) if plain else executable, device)
    return VirtualMachine(executable, device)


def load_module(path: str) -> Any:
    """The library ``path`` loaded by the TVM runtime (``.tar``: linked here by ``tvm``'s loader)."""
    path = os.path.realpath(path)
    if path.endswith((".tar", ".o")):
        import tvm

        return tvm.runtime.load_module(path)
    return ffi().load_module(path)


def empty(shape: tuple[int, ...], dtype: str, device: Any = None) -> Any:
    """An uninitialised tensor allocated by the TVM runtime (aligned as its kernels expect; ``device``
    None: the CPU)."""
    lib = ffi()
    alloc = lib.get_global_func("runtime.TVMTensorAllocWithScope")
    return alloc(lib.Shape([int(d) for d in shape]), lib.dtype(dtype), cpu() if device is None else device, None)


def tensor(array: np.ndarray, device: Any) -> Any:
    """A TVM tensor holding a copy of ``array``."""
    out = empty(array.shape, str(array.dtype), device)
    np.copyto(np.from_dlpack(out), array)
    return out


def num_threads() -> int:
    """Threads TVM's CPU kernels run on (process-wide)."""
    return int(ffi().get_global_func("runtime.NumThreads")())


def config_threadpool(mode: int, n: int, cpus: list[int]) -> None:
    """TVM's ``runtime.config_threadpool`` (``mode`` -3: share all cores, no pinning)."""
    ffi().get_global_func("runtime.config_threadpool")(mode, n, [str(c) for c in cpus])


def as_tvm(obj: Any) -> Any:
    """``obj`` (an FFI object) as an instance of the ``tvm`` package's class for it (``tvm.runtime.Module``
    for a module loaded here), for compiler-side code such as TVM's own VM (profiling); imports ``tvm``."""
    import tvm  # noqa: F401 -- registers the tvm classes of the FFI objects

    return ffi().Array([obj])[0]  # an object read back from a container gets the class now registered


class VirtualMachine:
    """The Relax VM of an executable (``tvm.relax.VirtualMachine`` without ``tvm``): ``vm["main"]``,
    and ``vm.module`` the VM module (``get_function_arity`` etc.).  ``executable``: a module loaded
    by :func:`load_module`, or a ``tvm`` executable (its ``jit()`` module is used)."""

    def __init__(self, executable: Any, device: Any) -> None:
        lib = ffi()
        self.executable = executable if isinstance(executable, lib.Module) else executable.jit()
        self.module = self.executable["vm_load_executable"]()
        self.module["vm_initialization"](KDL_CPU, int(device.index), POOLED_ALLOCATOR)

    def __getitem__(self, name: str) -> Any:
        return self.module[name]

    def __getattr__(self, name: str) -> Any:
        """The rest of ``tvm.relax.VirtualMachine``'s API (``time_evaluator``, ...) from TVM's own VM
        over the same executable (imports ``tvm``; a VM of its own: its state is not this one's)."""
        if name.startswith("_") or name in ("executable", "module"):
            raise AttributeError(name)
        tvm_vm = self.__dict__.get("_tvm_vm")
        if tvm_vm is None:
            import tvm

            tvm_vm = self.__dict__["_tvm_vm"] = virtual_machine(self.executable, tvm.cpu())
        return getattr(tvm_vm, name)
