"""Kernels that run with subnormal floats flushed to zero (x86: MXCSR ``FTZ`` and ``DAZ``).

A PFP network carries values far below float32's normal range: the mean of a ReLU of a strongly
negative pre-activation is ``σ·φ(μ/σ) + μ·Φ(μ/σ)``, which underflows gradually, and the variance
terms square such means (``μx²`` of ``|μx| < 1e-19`` is subnormal).  An x86 core computes an
arithmetic instruction with a subnormal operand or result through a micro-code assist of ~100
cycles, so a conv kernel whose input holds a few thousand such means runs several times slower
than on the same input with those means at 0 (ResNet-8's first-stage conv at batch 10: about 5x,
``benchmarks/kernel_rates.py --subnormals``).  With ``FTZ`` (results below the normal range are
written as 0) and ``DAZ`` (subnormal operands are read as 0) set, the same instructions run at full
speed; the values changed are below ``1.2e-38`` in magnitude -- far below float32's resolution of
any sum they enter next to a normal number, and a variance that would be subnormal becomes the
exact 0 whose limit case every formula handles.

:func:`flush_subnormals_pass` rewrites the kernels of :data:`OPS` (x86 targets only; others are
left as they are):

* on entry, the calling thread's control word is saved and ``FTZ | DAZ`` set; on exit the saved word
  is restored -- the caller's floating-point environment is the same after a call as before;
* a kernel with parallel loops first runs one more, of :data:`THREADS` iterations, in which every
  thread of TVM's pool sets ``FTZ | DAZ`` if it does not have them: the worker threads, which run
  nothing but TVM kernels, keep the flags.  (One ``stmxcsr`` per iteration of the kernel's own
  parallel loops would cost more: thousands of iterations in a direct conv at batch 10.)

The control word is read and written with LLVM's ``llvm.x86.sse.stmxcsr`` / ``ldmxcsr``
intrinsics, so the kernels need no runtime support (a library exported for a board runs the same).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import tvm
from tvm import s_tir, tirx

from ...runtime.targets import make_target, target_arch

FTZ_DAZ = 0x8040
"""MXCSR bits 15 (flush to zero) and 6 (denormals are zero)."""
DONE_ATTR = "pfp.flush_subnormals"
OPS = frozenset({"conv2d", "sf_conv_profile", "sf_relu"})
"""The kernels rewritten: those measured slowed by subnormals (the convolutions and the shared-factor
ReLU; ``benchmarks/kernel_rates.py --subnormals``).  Reading and writing the control word costs
~1 us per call (and a parallel launch) on the machine measured, against the 1-15 ms these
kernels take at batch 10: a kernel of a few microseconds (the dense layers of a small MLP, element-wise
kernels) would pay more than it saves."""


def _csr(intrinsic: str, buf: Any, index: int) -> Any:
    return tirx.Evaluate(tirx.call_llvm_intrin("void", f"llvm.x86.sse.{intrinsic}",
                                               tirx.address_of(tirx.BufferLoad(buf, [index]))))


def _local(name: str, size: int) -> Any:
    return tirx.decl_buffer((size,), "int32", name, scope="local")


def _set_in_task(body: Any) -> Any:
    """``body`` preceded by: set ``FTZ | DAZ`` on this thread if not set."""
    word = _local("pfp_mxcsr_task", 1)
    flags = tirx.IntImm("int32", FTZ_DAZ)
    load = tirx.BufferLoad(word, [0])
    missing = tirx.NE(tirx.BitwiseAnd(load, flags), flags)
    set_flags = tirx.SeqStmt([tirx.BufferStore(word, tirx.BitwiseOr(load, flags), [0]), _csr("ldmxcsr", word, 0)])
    return tirx.SeqStmt([tirx.AllocBuffer(word), _csr("stmxcsr", word, 0), tirx.IfThenElse(missing, set_flags, None),
                         body])


THREADS = 16
"""Iterations of the loop that sets the flags on the threads of TVM's pool: the pool runs a parallel
loop as one contiguous chunk per thread, so with up to this many threads each runs at least one."""


def _has_parallel(stmt: Any) -> bool:
    """Whether ``stmt`` holds a parallel loop (reached through loops, sequences and blocks)."""
    if isinstance(stmt, tirx.For):
        return stmt.kind == tirx.ForKind.PARALLEL or _has_parallel(stmt.body)
    if isinstance(stmt, tirx.SeqStmt):
        return any(_has_parallel(s) for s in stmt.seq)
    if isinstance(stmt, s_tir.SBlockRealize):
        return _has_parallel(stmt.block)
    if isinstance(stmt, s_tir.SBlock):
        return _has_parallel(stmt.body)
    if isinstance(stmt, tirx.IfThenElse):
        return _has_parallel(stmt.then_case) or (stmt.else_case is not None and _has_parallel(stmt.else_case))
    return False


def _set_on_pool_threads() -> Any:
    """A parallel loop of :data:`THREADS` iterations, each setting ``FTZ | DAZ`` on its thread."""
    return tirx.For(tirx.Var("pfp_thread", "int32"), 0, THREADS, tirx.ForKind.PARALLEL,
                    _set_in_task(tirx.Evaluate(0)))


def flush_subnormals(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` run with ``FTZ | DAZ`` (module docstring) if it is a kernel of one of :data:`OPS` (and
    was not rewritten before), else ``func`` itself."""
    attrs = func.attrs or {}
    if attrs.get(DONE_ATTR, False) or str(attrs.get("pfp.op", "")) not in OPS:
        return func
    word = _local("pfp_mxcsr", 2)  # [0]: the caller's control word, [1]: with FTZ | DAZ
    body = tirx.SeqStmt([
        tirx.AllocBuffer(word), _csr("stmxcsr", word, 0),
        tirx.BufferStore(word, tirx.BitwiseOr(tirx.BufferLoad(word, [0]), tirx.IntImm("int32", FTZ_DAZ)), [1]),
        _csr("ldmxcsr", word, 1), *([_set_on_pool_threads()] if _has_parallel(func.body) else []), func.body,
        _csr("ldmxcsr", word, 0)])
    return func.with_body(body).with_attr(DONE_ATTR, True)


_enabled = [True]


@contextmanager
def keep_subnormals() -> Iterator[None]:
    """Within this context no kernel is rewritten (:func:`applies` is False): modules built meanwhile
    compute with IEEE subnormals (for benchmarks comparing the two, ``kernel_rates.py --subnormals``)."""
    _enabled.append(False)
    try:
        yield
    finally:
        _enabled.pop()


def applies(target: Any) -> bool:
    """Whether kernels for ``target`` get :func:`flush_subnormals`: an LLVM target for x86-64 (and
    :func:`keep_subnormals` not in force)."""
    if not _enabled[-1]:
        return False
    tgt = make_target(target)
    return tgt.kind.name == "llvm" and target_arch(tgt) == "x86_64"


@tvm.transform.module_pass(opt_level=0, name="pyro2pfp.FlushSubnormals")
def flush_subnormals_pass(mod: tvm.IRModule, _ctx: Any) -> tvm.IRModule:
    """Every PrimFunc of ``mod`` through :func:`flush_subnormals` (the caller checks :func:`applies`)."""
    out = None
    for gv, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc):
            new = flush_subnormals(func)
            if not new.same_as(func):
                out = mod.clone() if out is None else out
                out[gv] = new
    return mod if out is None else out
