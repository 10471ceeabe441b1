"""Make ``inspect.stack()`` cheap so that MetaSchedule does not stall on a TVMScript import.

``import tvm.s_tir.tensor_intrin`` parses ~500 TVMScript intrinsics, and every ``@T.prim_func``
calls ``inspect.stack()``, which is pathologically slow inside an import (``inspect.getmodule``
scans ``sys.modules`` for every ``<frozen importlib>`` frame): minutes instead of seconds.
MetaSchedule imports that module in every ``TuneContext`` and in every ``LocalBuilder`` worker
process, so an unpatched tuning run either takes many minutes or has every build killed by the
builder's timeout (``LocalBuilder: Timeout, killed after 30.0 seconds``).

:func:`patch` / :func:`patched` replace ``inspect.stack`` with a frame walk that gives the same
``FrameInfo`` records (file, line, function, one line of context) without the module lookup;
:func:`worker_init` is the initializer for MetaSchedule's builder/runner worker processes
(``LocalBuilder(initializer=worker_init)``, :class:`pyro2pfp.backends.tvm.tuning.measure.PooledBuilder`), and
:func:`worker_build` the build job of ``PooledBuilder``'s workers.  This module imports nothing
from ``pyro2pfp`` or TVM at import time, so that these functions can be pickled by value into a
fresh worker (which then does not import ``pyro2pfp``, torch or Pyro).
"""
from __future__ import annotations

import contextlib
import inspect
import linecache
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

_ORIGINAL_STACK = inspect.stack


def _fast_stack(context: int = 1) -> list[inspect.FrameInfo]:
    frame: Any = sys._getframe(1)
    out = []
    while frame is not None:
        filename, lineno = frame.f_code.co_filename, frame.f_lineno
        line = linecache.getline(filename, lineno) if context > 0 else ""
        out.append(inspect.FrameInfo(frame, filename, lineno, frame.f_code.co_name,
                                     [line] if line else None, 0 if line else None))
        frame = frame.f_back
    return out


def patch() -> None:
    """Replace ``inspect.stack`` by the fast frame walk (idempotent)."""
    inspect.stack = _fast_stack


def unpatch() -> None:
    """Restore the original ``inspect.stack``."""
    inspect.stack = _ORIGINAL_STACK


def is_patched() -> bool:
    return inspect.stack is _fast_stack


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """``inspect.stack`` is the fast walk inside the block, and what it was before afterwards."""
    before = inspect.stack
    inspect.stack = _fast_stack
    try:
        yield
    finally:
        inspect.stack = before


def preimport_tensor_intrin() -> None:
    """Import ``tvm.s_tir.tensor_intrin`` (MetaSchedule's ``TuneContext`` does) with the patch on."""
    if "tvm.s_tir.tensor_intrin" in sys.modules:
        return
    with patched():
        import tvm.s_tir.tensor_intrin  # noqa: F401


def worker_init() -> None:
    """Initializer of a MetaSchedule worker process: patch, then pre-import the intrinsics.

    It runs in a fresh interpreter; this module is pickled by value (``cloudpickle``), so the
    worker needs neither ``pyro2pfp`` nor torch/Pyro, only TVM.
    """
    patch()
    import tvm.s_tir.tensor_intrin  # noqa: F401  -- fast under the patch


def worker_build(mod, target, cc=None) -> str:  # noqa: ANN001 -- runs in a MetaSchedule worker process
    """Build one MetaSchedule candidate in a worker process and export it as a shared library;
    returns its path (the in-process runner loads it, or ``RPCRunner`` uploads it to a board).
    ``cc``: the cross compiler that links it for another architecture (``aarch64-linux-gnu-gcc``
    for an AArch64 board); ``None``: the host's.  No ``tvm.s_tir.tensor_intrin`` import is needed
    for the build itself (``worker_init`` already did it, patched)."""
    import tvm
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    rt_mod = tvm.tirx.build(mod, target=target)
    path = os.path.join(tempfile.mkdtemp(prefix="pyro2pfp-ms-"), "candidate.so")
    if cc:
        from tvm.support import cc as tvm_cc

        rt_mod.export_library(path, fcompile=tvm_cc.cross_compiler(cc))
    else:
        rt_mod.export_library(path)
    return path
