"""Build a PFP Relax module into a VM executable, its kernels compiled by LLVM in parallel threads.

``tvm.compile`` lowers and compiles every PrimFunc of a module as *one* LLVM module on one thread,
and the machine code is generated later, again on one thread, when the VM first looks a kernel up
(LLVM's JIT).  Those two steps are ~85 % of a network's build (shared-factor ResNet-20: 7.1 s of
lowering + LLVM IR + optimisation, 4.7 s of machine code, of 14 CPU-seconds).  The kernels are
independent functions, and TVM releases the GIL while LLVM works, so :func:`build` runs the Relax
pipeline and the VM's code generation as ``tvm.compile`` does, then splits the module's PrimFuncs
into parts and compiles each part -- lowering, LLVM, and for a target this machine runs, the JIT --
on a pool of threads (:func:`build_jobs`), and links the parts into one executable (the first part's
library imports the others; the VM finds a kernel in any of them).  Results are the same code; an
exported library (``export_library``) links every part's object file.

``PYRO2PFP_BUILD_JOBS`` (an integer >= 1) sets the number of threads; 1 builds exactly as
``tvm.compile`` does.
"""
from __future__ import annotations

import concurrent.futures
import os
from typing import Any

import tvm
from tvm import relax
from tvm.relax import vm_build

from ..errors import ArgumentError
from ..targets import is_cross_target, make_target

#: kernels compiled per LLVM module at most: several modules per thread, so that a slow kernel
#: does not hold one thread while the others idle (a module costs ~3 ms of fixed LLVM set-up)
KERNELS_PER_PART = 4


def available_cpus() -> list[int]:
    """The logical CPUs this process may run on (its affinity)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover -- not Linux
        return list(range(os.cpu_count() or 1))


def build_jobs() -> int:
    """Threads that compile kernels: ``$PYRO2PFP_BUILD_JOBS`` if set (an integer >= 1), else the
    logical CPUs this process may use."""
    value = os.environ.get("PYRO2PFP_BUILD_JOBS", "").strip()
    if not value:
        return max(1, len(available_cpus()))
    try:
        jobs = int(value)
    except ValueError:
        jobs = 0
    if jobs < 1:
        raise ArgumentError(f"PYRO2PFP_BUILD_JOBS={value!r}: expected an integer >= 1 (threads compiling kernels)")
    return jobs


@tvm.transform.module_pass(opt_level=0, name="pyro2pfp.MarkPrimFuncsNoAlias")
def mark_prim_funcs_noalias(mod: tvm.IRModule, _ctx: Any) -> tvm.IRModule:
    """Give every PrimFunc the ``tirx.noalias`` attribute (the PFP kernels have it already).

    Work-around for TVM 0.27: the Relax pipeline adds a host PrimFunc ``shape_func`` (storage
    sizes of a symbolic batch) without the attribute, and then LLVM gets no ``noalias`` for *any*
    kernel of the module: it reloads the register accumulators and recomputes ``x²`` in every
    iteration of the dense reduction (measured 2.5x slower, 32 us -> 80 us for the MLP's first
    layer at batch 10).  Relax calls PrimFuncs in destination-passing style with distinct
    buffers, so the attribute is true of all of them."""
    missing = [gv for gv, func in mod.functions_items() if isinstance(func, tvm.tirx.PrimFunc)
               and not (func.attrs and func.attrs.get("tirx.noalias", False))]
    if not missing:
        return mod
    out = mod.clone()  # a pass must not modify the module it is given
    for gv in missing:
        out[gv] = mod[gv].with_attr("tirx.noalias", True)
    return out


def build(mod: tvm.IRModule, target: Any, relax_pipeline: Any = "default", jobs: int | None = None) -> Any:
    """A ``relax.VMExecutable`` of ``mod`` for ``target``: identical kernels shared
    (:func:`~pyro2pfp.tvm_backend.sharing.share_identical_kernels`), then the Relax pipeline
    ``relax_pipeline`` (a name or a pass), then :func:`mark_prim_funcs_noalias`; the kernels compiled
    on ``jobs`` threads (default :func:`build_jobs`; 1: ``tvm.compile`` itself)."""
    from .sharing import share_identical_kernels_pass

    tgt = make_target(target)
    if isinstance(relax_pipeline, str):
        relax_pipeline = relax.get_pipeline(relax_pipeline)
    pipeline = tvm.transform.Sequential([share_identical_kernels_pass, relax_pipeline, mark_prim_funcs_noalias])
    jobs = build_jobs() if jobs is None else jobs
    host = tgt if tgt.host is None else tgt.host
    if jobs <= 1 or tgt.kind.name != "llvm" or "wasm" in str(host.attrs.get("mtriple", "")):
        # one thread, or a target tvm.compile treats specially (a device, a wasm system library)
        return tvm.compile(mod, target=tgt, relax_pipeline=pipeline)
    with tgt:
        mod = pipeline(mod)
    attrs = dict(mod.attrs) if mod.attrs else {}
    builder = relax.ExecBuilder()
    mod = vm_build._vmcodegen(builder, mod, "bytecode")
    kernels = [(gv.name_hint, func) for gv, func in mod.functions_items() if isinstance(func, tvm.tirx.PrimFunc)]
    libs = compile_kernels(kernels, tgt, jobs, mod.attrs, jit=not is_cross_target(tgt))
    lib = libs[0] if libs else None
    for other in libs[1:]:
        libs[0].import_module(other)
    linked = vm_build._ffi_api.VMLink(builder, tgt, lib, list(attrs.get("external_mods", [])),
                                      dict(attrs.get("const_name_to_constant", {})))
    return relax.VMExecutable(linked)


def compile_kernels(kernels: list[tuple[str, tvm.tirx.PrimFunc]], target: Any, jobs: int, attrs: Any = None,
                    jit: bool = True) -> list[Any]:
    """The PrimFuncs ``kernels`` (name, function) compiled by ``tvm.tirx.build`` in parts of at most
    :data:`KERNELS_PER_PART` on ``jobs`` threads, one runtime module per part (in the order of
    ``kernels``' first members).  ``jit``: each part also generates its machine code on its thread
    (LLVM's JIT, which otherwise runs when the VM first looks a kernel up; only for a target this
    machine runs).  The caller's ``PassContext`` (its config) applies on every thread."""
    if not kernels:
        return []
    n_parts = min(len(kernels), max(jobs, -(-len(kernels) // KERNELS_PER_PART)))
    parts = [kernels[i::n_parts] for i in range(n_parts)]
    context = tvm.transform.PassContext.current()

    def compile_part(part: list[tuple[str, tvm.tirx.PrimFunc]]) -> Any:
        with context:
            lib = tvm.tirx.build(tvm.IRModule(dict(part), attrs=attrs), target=target)
        if jit:
            symbol = part[0][1].attrs.get("global_symbol", part[0][0]) if part[0][1].attrs else part[0][0]
            lib.get_function(str(symbol))  # generates the machine code of the whole part
        return lib

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(jobs, n_parts),
                                               thread_name_prefix="pyro2pfp-build") as pool:
        return list(pool.map(compile_part, parts))
