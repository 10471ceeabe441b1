"""A disk cache of compiled kernels: a second compile of the same architecture (another convert of the
same model, the same network in another process, the test suite) reuses LLVM's machine code.

:class:`~pyro2pfp.backends.tvm.build.KernelPool` compiles a network's kernels in parts (a few kernels per
LLVM module).  With the cache, each part's machine code is written as an object file under a key of
everything that determines it -- each kernel's scheduled TIR (its ``tvm_ffi.structural_hash``: shapes,
dtypes, the schedule, the symbol), the module attributes, the target, the build's ``PassContext``
config, the TVM and tvm-ffi versions and :data:`FORMAT` -- and the part is used as a
``static_library`` module of that file.  The weights are not part of a kernel (they are arguments), so
a network retrained or converted again hits the cache.  A change of our kernel code or of a default
schedule changes the TIR, hence the key: stale entries are never used, only left to age out.

The executable then links its parts into one shared library when its VM is first created
(``Executable.jit``, one linker call), and ``export_library`` writes the same object files.

Where: ``$PYRO2PFP_KERNEL_CACHE`` (a directory; ``off`` disables the cache), else
``$PYRO2PFP_CACHE/kernels``, else ``$XDG_CACHE_HOME/pyro2pfp/kernels`` (default ``~/.cache/...``).
Entries sit in one sub-directory per TVM version and target.  Safe under concurrent processes
(pytest-xdist workers, several users of one home directory): an entry is written to a temporary
file and renamed into place, so a reader sees a whole file or none; two processes compiling the same
part both write it, the last rename wins, and the contents are the same.  The cache is pruned to
``$PYRO2PFP_KERNEL_CACHE_MB`` (default :data:`DEFAULT_LIMIT_MB`) megabytes, least recently used first,
when a process first opens it.  A directory that cannot be written is a warning, not an error: the
compile goes on without the cache.  Only kernels compiled for this machine are cached (a cross
target's are not).
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import tvm
import tvm_ffi

from ..._version import __version__

ENV = "PYRO2PFP_KERNEL_CACHE"
LIMIT_ENV = "PYRO2PFP_KERNEL_CACHE_MB"
DEFAULT_LIMIT_MB = 512
FORMAT = 2
"""Changed whenever what an entry holds, or how a part is compiled, changes (the key holds it)."""
_STALE_TMP_S = 3600.0  # temporary files older than this are left-overs of a killed process

_lock = threading.Lock()
_opened: dict[str, KernelCache | None] = {}


def cache_root() -> Path | None:
    """The cache directory (module docstring), or None when ``$PYRO2PFP_KERNEL_CACHE`` is ``off``."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() in ("off", "0", "no", "false", "none"):
        return None
    if value:
        return Path(value).expanduser()
    root = os.environ.get("PYRO2PFP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "pyro2pfp")
    return Path(root).expanduser() / "kernels"


_fingerprint: list[str] = []


def source_fingerprint() -> str:
    """A hash of the TVM back end's source (every module of ``pyro2pfp/backends/tvm``: kernels,
    default schedules, build) and the package version: the key of a kernel looked up before it is
    scheduled (the schedules read only the PrimFunc and the target), so a change of that code misses."""
    if not _fingerprint:
        root = Path(__file__).resolve().parent
        h = hashlib.sha256(str(__version__).encode())
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
        _fingerprint.append(h.hexdigest())
    return _fingerprint[0]


def _digest(*parts: Any) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(str(part).encode())
        h.update(b"\0")
    return h.hexdigest()


class KernelCache:
    """The entries of one target in one cache directory (:func:`open_cache`)."""

    def __init__(self, directory: Path, target: tvm.target.Target) -> None:
        self.target = target
        self.dir = directory / f"tvm-{tvm.__version__}-{_digest(str(target))[:16]}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.hits = 0
        self.misses = 0

    def key(self, part: dict[str, Any], attrs: Any, config: dict[str, Any], schedule: str = "") -> str:
        """The key of a part (``{symbol: PrimFunc}``, compiled as one module with ``attrs`` under a
        ``PassContext`` with ``config``).  ``schedule``: for a part of PrimFuncs *before* their default
        schedule, the fingerprint of the code that schedules them (:func:`source_fingerprint`)."""
        kernels = [(name, tvm_ffi.structural_hash(func, map_free_vars=True)) for name, func in part.items()]
        attrs_hash = tvm_ffi.structural_hash(attrs, map_free_vars=True) if attrs is not None else 0
        return _digest(FORMAT, tvm.__version__, getattr(tvm_ffi, "__version__", ""), str(self.target),
                       sorted((k, str(v)) for k, v in config.items()), attrs_hash, kernels, schedule)

    def path(self, key: str) -> Path:
        return self.dir / f"{key}.o"

    def load(self, key: str, symbols: list[str]) -> Any:
        """The cached part (a ``static_library`` module) or None."""
        path = self.path(key)
        if not path.is_file():
            self.misses += 1
            return None
        try:
            os.utime(path)  # recently used: pruned last
        except OSError:
            pass
        self.hits += 1
        return tvm.runtime.load_static_library(str(path), symbols)

    def store(self, key: str, lib: Any, symbols: list[str]) -> Any:
        """Write the compiled part ``lib`` (an LLVM module) under ``key``; returns the part as a
        ``static_library`` module of the written file (or ``lib`` itself if it cannot be written)."""
        path = self.path(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            lib.write_to_file(str(tmp), "o")
            os.replace(tmp, path)
        except OSError as exc:
            _warn_once(f"pyro2pfp: could not write the kernel cache {self.dir} ({exc}); compiling without it")
            try:
                tmp.unlink()
            except OSError:
                pass
            return lib
        return tvm.runtime.load_static_library(str(path), symbols)

    def prune(self, limit_bytes: float) -> None:
        """Delete the least recently used entries (of every target) until the cache holds at most
        ``limit_bytes``, and temporary files a killed process left."""
        entries = []
        now = time.time()
        for path in self.dir.parent.glob("*/*"):
            try:
                st = path.stat()
            except OSError:
                continue
            if path.name.endswith(".tmp"):
                if now - st.st_mtime > _STALE_TMP_S:
                    _unlink(path)
                continue
            entries.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= limit_bytes:
                break
            _unlink(path)
            total -= size


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _limit_bytes() -> float:
    value = os.environ.get(LIMIT_ENV, "").strip()
    try:
        return float(value) * 2**20 if value else DEFAULT_LIMIT_MB * 2**20
    except ValueError:
        return DEFAULT_LIMIT_MB * 2**20


def open_cache(target: tvm.target.Target) -> KernelCache | None:
    """The kernel cache of ``target`` (once per process, pruned when first opened), or None when the
    cache is off or its directory cannot be made."""
    root = cache_root()
    if root is None:
        return None
    name = f"{root}|{target}"
    with _lock:
        if name in _opened:
            return _opened[name]
        try:
            cache: KernelCache | None = KernelCache(root, target)
        except OSError as exc:
            _warn_once(f"pyro2pfp: cannot use the kernel cache {root} ({exc}); compiling without it "
                       f"(set {ENV} to a writable directory, or to 'off')")
            cache = None
        if cache is not None:
            cache.prune(_limit_bytes())
        _opened[name] = cache
        return cache
