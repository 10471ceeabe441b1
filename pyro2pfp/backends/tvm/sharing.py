"""One compiled kernel per distinct PFP kernel: layers of identical shape share their PrimFunc.

A ResNet repeats its blocks: ResNet-20's 21 conv2d, 19 ReLU and 9 add kernels are only 8, 3 and 3
distinct functions once their ``pfp.layer`` attribute (the name, for profiles) is set aside (the
weights are arguments, not part of the kernel).  LLVM compiles each PrimFunc of the module, so
unshared copies would take most of a ResNet's ``tvm.compile`` time (``docs/performance.md``, "Compile
time").  The emitter already makes most repeated kernels only once (:mod:`.kernel_memo`); this pass
shares the rest (a kernel whose function :mod:`.kernel_memo` cannot describe) and the kernels of a
module emitted elsewhere.
:func:`share_identical_kernels` keeps the first of each group of structurally equal PrimFuncs and
points every ``call_tir`` of the others at it.  Results are unchanged (the same code runs on the
same arguments).  A shared kernel keeps the name of its first layer: a profile row
(``exe.profile``) then counts one call per layer it serves.
"""
from __future__ import annotations

from collections.abc import Collection
from typing import Any

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

_NAME_ATTR = "pfp.layer"


def _shape_key(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """``func`` without what names it (its layer), for comparing kernels."""
    return func.with_attr(_NAME_ATTR, "") if func.attrs and _NAME_ATTR in func.attrs else func


@mutator
class _Redirect(PyExprMutator):
    """Replaces the GlobalVars of ``mapping`` wherever a Relax function refers to them."""

    def __init__(self, mod: tvm.IRModule, mapping: dict[Any, Any]) -> None:
        super().__init__(mod)
        self.mapping = mapping

    def visit_global_var_(self, op: relax.GlobalVar) -> relax.Expr:  # noqa: N802 (TVM's name)
        return self.mapping.get(op, op)


class KernelGroups:
    """Groups of structurally equal PrimFuncs (equal up to ``pfp.layer``), filled one kernel at a
    time: :meth:`first_of` says which earlier kernel a new one duplicates."""

    def __init__(self) -> None:
        self._buckets: dict[int, list[tuple[Any, tvm.tirx.PrimFunc]]] = {}

    def first_of(self, ref: Any, func: tvm.tirx.PrimFunc) -> Any:
        """The ``ref`` (a GlobalVar, a name) of the first kernel added that equals ``func``; None (and
        ``func`` is added under ``ref``) if there is none."""
        key = _shape_key(func)
        bucket = self._buckets.setdefault(tvm_ffi.structural_hash(key), [])
        for first, first_key in bucket:
            if tvm_ffi.structural_equal(first_key, key):
                return first
        bucket.append((ref, key))
        return None


def share_identical_kernels(mod: tvm.IRModule, prefer: Collection[str] = ()) -> tvm.IRModule:
    """``mod`` with each group of structurally equal PrimFuncs (equal up to ``pfp.layer``) reduced
    to one member -- one named in ``prefer`` if any (the kernels already compiled while the module
    was emitted, :class:`~pyro2pfp.backends.tvm.runtime.KernelStream`), else the first by name --
    every call redirected to it; ``mod`` itself is not modified."""
    groups = KernelGroups()
    mapping: dict[Any, Any] = {}
    for gv in sorted(mod.get_global_vars(), key=lambda v: (v.name_hint not in prefer, v.name_hint)):
        func = mod[gv]
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        first = groups.first_of(gv, func)
        if first is not None:
            mapping[gv] = first
    if not mapping:
        return mod
    out = tvm.IRModule({gv: func for gv, func in mod.functions_items() if gv not in mapping},
                       attrs=mod.attrs)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            out[gv] = _Redirect(out, mapping).visit_expr(func)
    return out


@tvm.transform.module_pass(opt_level=0, name="pyro2pfp.ShareIdenticalKernels")
def share_identical_kernels_pass(mod: tvm.IRModule, _ctx: Any) -> tvm.IRModule:
    """:func:`share_identical_kernels` as a module pass (first in :func:`~pyro2pfp.backends.tvm.build.build`)."""
    return share_identical_kernels(mod)
