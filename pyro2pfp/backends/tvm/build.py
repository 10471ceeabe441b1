"""Build a PFP Relax module into a VM executable, its kernels compiled by LLVM on parallel threads.

``tvm.compile`` lowers and compiles every PrimFunc of a module as *one* LLVM module on one thread,
and the machine code is generated later, again on one thread, when the VM first looks a kernel up
(LLVM's JIT).  Those two steps are most of a network's build (``benchmarks/compile_time.py
--per-op`` measures them per op).  The kernels are independent functions and TVM releases the GIL
while LLVM works, so here they are compiled in parts
of :data:`KERNELS_PER_PART` on a pool of threads (:class:`KernelPool`, :func:`build_jobs` threads):
lowering, LLVM and, for a target this machine runs, the machine code.  ``build_network`` hands each
kernel to the pool as soon as it is scheduled (scheduling is Python and holds the GIL; LLVM compiles
the previous kernels meanwhile) -- and, when it is the compile that emits the module, as soon as it is
emitted (:class:`KernelStream`); :func:`build` runs the Relax pipeline and the VM's code generation as
``tvm.compile`` does, compiles what the pipeline added (its ``shape_func``) or changed (a part whose
kernel is not, structurally, the one the module links is dropped and compiled again), and links the
parts into one executable: the first part's library imports the others, the VM finds a kernel in any
of them, ``export_library`` links every part's object file.  The code is the same as
``tvm.compile``'s (outputs bitwise equal).

``PYRO2PFP_BUILD_JOBS`` (an integer >= 1) sets the number of threads; 1 builds with ``tvm.compile``
unless the kernel cache is on.

Compiled parts are cached on disk (:mod:`~pyro2pfp.backends.tvm.kernel_cache`): a part whose kernels,
target and TVM were compiled before is loaded instead of compiled, and a new one is written there.
The parts are then object files, linked into one shared library when the executable's VM is first
made (``Executable.jit``).
"""
from __future__ import annotations

import concurrent.futures
import os
from typing import Any

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax import vm_build

from ...errors import ArgumentError
from ...planning.plan import PlannedGraph
from ...runtime.targets import is_cross_target, make_target
from ...runtime.tvm_runtime import available_cpus
from . import subnormals
from .kernel_cache import open_cache, source_fingerprint
from .schedules import layers_by_name, schedule_kernel
from .sharing import KernelGroups, share_identical_kernels_pass

#: kernels compiled per LLVM module at most: several modules per thread, so that a slow kernel
#: does not hold one thread while the others idle, but not one per kernel (each module has a fixed
#: LLVM set-up cost)
KERNELS_PER_PART = 4
#: ... with the kernel cache on: one, so that a kernel is found in the cache whatever it was compiled
#: with before (another network, another order); the fixed cost of a module written as an object file
#: is ~2-20 ms of CPU (LeNet-5's 11 kernels: one module against one per kernel)
KERNELS_PER_CACHED_PART = 1


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
    iteration of the dense reduction (a dense layer runs several times slower).  Relax calls
    PrimFuncs in destination-passing style with distinct buffers, so the attribute is true of all
    of them."""
    missing = [gv for gv, func in mod.functions_items() if isinstance(func, tvm.tirx.PrimFunc)
               and not (func.attrs and func.attrs.get("tirx.noalias", False))]
    if not missing:
        return mod
    out = mod.clone()  # a pass must not modify the module it is given
    for gv in missing:
        out[gv] = mod[gv].with_attr("tirx.noalias", True)
    return out


def build_context() -> tvm.transform.PassContext:
    """The caller's ``PassContext`` (opt level, passes, instruments, config) plus
    ``tirx.disable_assert`` (unless the caller set it): no argument checks in each kernel's entry.

    TVM wraps every kernel in an entry function that checks each buffer argument's type, rank,
    dtype, shape, strides, offset and device -- ~170 lines of LLVM IR per argument, about a third of
    a shared-factor ResNet's code and of its compile time.
    The kernels are called only by the Relax VM, with tensors it allocated from the shapes it
    checked: the network's own arguments are checked by the VM (``R.match_cast`` of ``main``'s
    inputs, a clear error naming the shape) and, before that, by ``CompiledPFP``
    (:func:`~pyro2pfp.runtime.inputs.checked_inputs`)."""
    current = tvm.transform.PassContext.current()
    config = dict(current.config)
    config.setdefault("tirx.disable_assert", True)
    return tvm.transform.PassContext(opt_level=current.opt_level, required_pass=list(current.required_pass),
                                     disabled_pass=list(current.disabled_pass),
                                     instruments=list(current.instruments), config=config)


def parallel(target: Any, jobs: int | None = None) -> bool:
    """Whether :func:`build` compiles the kernels of a module for ``target`` in parts with a
    :class:`KernelPool`: an LLVM CPU target that is not a wasm system library (those ``tvm.compile``
    links specially), and either ``jobs`` (default :func:`build_jobs`) > 1 or the kernel cache on
    (:func:`~.kernel_cache.open_cache`) for a target this machine runs."""
    tgt = make_target(target)
    host = tgt if tgt.host is None else tgt.host
    if tgt.kind.name != "llvm" or "wasm" in str(host.attrs.get("mtriple", "")):
        return False
    jobs = build_jobs() if jobs is None else jobs
    return jobs > 1 or (not is_cross_target(tgt) and open_cache(tgt) is not None)


def _linkable(name: str, func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """``func`` with the attributes the module the VM links will give it (its symbol, ``noalias``)."""
    attrs = func.attrs
    if attrs is None or "global_symbol" not in attrs:
        func = func.with_attr("global_symbol", name)
    if attrs is None or not attrs.get("tirx.noalias", False):
        func = func.with_attr("tirx.noalias", True)  # as mark_prim_funcs_noalias will
    return func


class KernelPool:
    """Compiles kernels on ``jobs`` threads while the caller goes on: :meth:`add` queues a finished
    (scheduled) PrimFunc, every :data:`KERNELS_PER_PART` of them are compiled as one part (one LLVM
    module; for a target this machine runs, its machine code generated too).
    :func:`build` then compiles only what the Relax pipeline added or changed (its ``shape_func``) and
    links the parts.  The caller's ``PassContext`` applies on every thread."""

    def __init__(self, target: Any, jobs: int | None = None) -> None:
        self.target = make_target(target)
        self.jit = not is_cross_target(self.target)
        self.context = build_context()
        # a caller watching the passes (instruments) sees them run: no cache then
        self.cache = open_cache(self.target) if self.jit and not self.context.instruments else None
        self.per_part = KERNELS_PER_CACHED_PART if self.cache is not None else KERNELS_PER_PART
        jobs = build_jobs() if jobs is None else jobs
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="pyro2pfp-build")
        self.queued: list[tuple[str, tvm.tirx.PrimFunc]] = []
        self.parts: list[tuple[dict[str, tvm.tirx.PrimFunc], concurrent.futures.Future[Any]]] = []
        self.compiled_late: list[str] = []  # kernels finish() compiled (not added, or changed since)
        self.added: dict[str, tvm.tirx.PrimFunc] = {}

    def add(self, name: str, func: tvm.tirx.PrimFunc, key: str | None = None) -> None:
        """Queue kernel ``name`` (compiled under that symbol, as the Relax pipeline will name it); a
        kernel added again unchanged (the same function, or a structurally equal one) is not queued twice.
        ``key``: the cache key it is stored under (:meth:`lookup`'s, of the kernel before scheduling)."""
        before = self.added.get(name)
        if before is not None and (before.same_as(func) or tvm_ffi.structural_equal(before, func)):
            return
        self.added[name] = func
        func = _linkable(name, func)
        if key is not None and self.cache is not None:
            self._submit([(name, func)], None, key)
            return
        self.queued.append((name, func))
        if len(self.queued) >= self.per_part:
            self.flush()

    def lookup(self, name: str, func: tvm.tirx.PrimFunc) -> tuple[tvm.tirx.PrimFunc | None, str | None]:
        """Kernel ``name`` as emitted (``func``, not scheduled yet) in the kernel cache: ``(stand-in,
        None)`` if its compiled code is there -- the part is added, and the stand-in (``func`` marked
        scheduled: nothing schedules or compiles it again; the module the VM links may hold it, the VM
        only calls the symbol) goes into the module in its place -- else ``(None, key)``, the key to
        :meth:`add` its scheduled version under; ``(None, None)`` without a cache."""
        if self.cache is None or (func.attrs is not None and func.attrs.get("tirx.is_scheduled", False)):
            return None, None
        key = self.cache.key({name: _linkable(name, func)}, None, self._config(), schedule=source_fingerprint())
        lib = self.cache.load(key, [name])
        if lib is None:
            return None, key
        stand_in = func.with_attr("tirx.is_scheduled", True)
        self.added[name] = stand_in
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        done.set_result(lib)
        self.parts.append(({name: _linkable(name, stand_in)}, done))
        return stand_in, None

    def _config(self) -> dict[str, Any]:
        ctx = self.context
        return {**dict(ctx.config), "opt_level": ctx.opt_level, "required_pass": list(ctx.required_pass),
                "disabled_pass": list(ctx.disabled_pass), "flush_subnormals": subnormals.applies(self.target)}

    def flush(self) -> None:
        """Submit the queued kernels as one part."""
        if self.queued:
            self._submit(self.queued, None)
            self.queued = []

    def _submit(self, kernels: list[tuple[str, tvm.tirx.PrimFunc]], attrs: Any,
                key: str | None = None) -> concurrent.futures.Future[Any]:
        part = dict(kernels)
        future = self.pool.submit(self._compile, part, attrs, key)
        self.parts.append((part, future))
        return future

    def close(self) -> None:
        """Wait for the parts being compiled, drop those not started, stop the threads."""
        self.pool.shutdown(wait=True, cancel_futures=True)

    def _compile(self, part: dict[str, tvm.tirx.PrimFunc], attrs: Any, key: str | None = None) -> Any:
        symbols = None
        # not the Relax VM's host functions (``shape_func``): TVM emits their statements in an order
        # that changes from run to run, so they would never hit; they are small
        host = any(func.attrs is not None and func.attrs.get("tirx.is_host_func", False) for func in part.values())
        if self.cache is not None and not host:
            symbols = [str(func.attrs.get("global_symbol", name)) for name, func in part.items()]
            if key is None:  # keyed on the code compiled (a kernel not looked up before scheduling)
                key = self.cache.key(part, attrs, self._config())
                cached = self.cache.load(key, symbols)
                if cached is not None:
                    return cached
        module = tvm.IRModule(part, attrs=attrs)
        if subnormals.applies(self.target):
            module = subnormals.flush_subnormals_pass(module)
        with self.context:
            lib = tvm.tirx.build(module, target=self.target)
        if self.cache is not None and key is not None and symbols is not None:
            return self.cache.store(key, lib, symbols)  # the object file: machine code made here
        if self.jit:
            name, func = next(iter(part.items()))
            lib.get_function(str(func.attrs.get("global_symbol", name)))  # machine code of the whole part
        return lib

    def finish(self, tir_mod: tvm.IRModule) -> list[Any]:
        """The compiled parts of every PrimFunc of ``tir_mod`` (the module the VM links): a part built
        early is used only if each of its kernels is in ``tir_mod`` unchanged (structurally equal, its
        attributes included); the other kernels are compiled now, in parts.  Waits for all parts."""
        final = {gv.name_hint: func for gv, func in tir_mod.functions_items() if isinstance(func, tvm.tirx.PrimFunc)}
        self.queued = []  # a kernel queued but not submitted is compiled below if tir_mod has it
        libs: list[concurrent.futures.Future[Any]] = []
        covered: set[str] = set()
        for part, future in self.parts:
            if all(name in final and tvm_ffi.structural_equal(final[name], func) for name, func in part.items()):
                libs.append(future)
                covered.update(part)
        rest = [(name, func) for name, func in final.items() if name not in covered]
        self.compiled_late = [name for name, _ in rest]
        for i in range(0, len(rest), self.per_part):
            libs.append(self._submit(rest[i:i + self.per_part], tir_mod.attrs))
        try:
            return [future.result() for future in libs]
        finally:
            self.close()


def build(mod: tvm.IRModule, target: Any, relax_pipeline: Any = "default", jobs: int | None = None,
          kernels: KernelPool | None = None) -> Any:
    """A ``relax.VMExecutable`` of ``mod`` for ``target``: identical kernels shared
    (:func:`~pyro2pfp.backends.tvm.sharing.share_identical_kernels`), then the Relax pipeline
    ``relax_pipeline`` (a name or a pass), then :func:`mark_prim_funcs_noalias`; the kernels compiled
    on ``jobs`` threads (default :func:`build_jobs`; 1: ``tvm.compile`` itself, see :func:`parallel`).
    ``kernels``: a :class:`KernelPool` that already compiles (some of) ``mod``'s kernels."""
    tgt = make_target(target)
    if isinstance(relax_pipeline, str):
        relax_pipeline = relax.get_pipeline(relax_pipeline)
    pipeline = tvm.transform.Sequential([share_identical_kernels_pass, relax_pipeline, mark_prim_funcs_noalias])
    if kernels is None and not parallel(tgt, jobs):
        if subnormals.applies(tgt):  # (KernelPool applies it to each part it compiles)
            pipeline = tvm.transform.Sequential([pipeline, subnormals.flush_subnormals_pass])
        with build_context():
            return tvm.compile(mod, target=tgt, relax_pipeline=pipeline)
    kernels = KernelPool(tgt, jobs) if kernels is None else kernels
    try:
        with kernels.context, tgt:
            mod = pipeline(mod)
        attrs = dict(mod.attrs) if mod.attrs else {}
        builder = relax.ExecBuilder()
        mod = vm_build._vmcodegen(builder, mod, "bytecode")
        tir_mod = tvm.IRModule({gv: f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)},
                               attrs=mod.attrs)
    except BaseException:
        kernels.close()
        raise
    libs = kernels.finish(tir_mod)
    for other in libs[1:]:
        libs[0].import_module(other)
    linked = vm_build._ffi_api.VMLink(builder, tgt, libs[0] if libs else None,
                                      list(attrs.get("external_mods", [])),
                                      dict(attrs.get("const_name_to_constant", {})))
    return relax.VMExecutable(linked)


class KernelStream:
    """Schedules each kernel as the module is emitted and hands it to a :class:`KernelPool`, so LLVM
    starts on the first kernels while the later ones are still being emitted (emitting a large
    shared-factor network takes long enough that the build threads would otherwise sit idle).

    ``add(name, func)`` is :func:`~pyro2pfp.backends.tvm.emit.emit_module`'s ``on_kernel``: a kernel
    structurally equal to an earlier one (up to its layer name) is skipped -- it will share that one's
    code (:func:`~pyro2pfp.backends.tvm.sharing.share_identical_kernels` with ``prefer=``
    :attr:`scheduled`) -- any other is scheduled (:func:`~.schedules.schedule_kernel`) and queued.
    :meth:`scheduled_module` then puts the scheduled kernels into the shared module, so that
    ``schedule_module`` only re-announces them (the pool does not queue a kernel twice) and
    :meth:`KernelPool.finish` finds each compiled part's kernels unchanged."""

    def __init__(self, plan: PlannedGraph | None, target: Any, pool: KernelPool) -> None:
        self.target, self.pool = make_target(target), pool
        self.layers = layers_by_name(plan)
        self.groups = KernelGroups()
        self.scheduled: dict[str, tvm.tirx.PrimFunc] = {}  # name -> its scheduled function
        self.emitted: dict[str, tvm.tirx.PrimFunc] = {}  # name -> the function scheduled

    def add(self, name: str, func: tvm.tirx.PrimFunc) -> None:
        """Schedule and queue kernel ``name`` unless an earlier kernel equals it (or its compiled code
        is in the kernel cache: :meth:`KernelPool.lookup`; nothing to schedule then)."""
        if name in self.scheduled or self.groups.first_of(name, func) is not None:
            return
        stand_in, key = self.pool.lookup(name, func)
        if stand_in is not None:
            self.scheduled[name], self.emitted[name] = stand_in, func
            return
        scheduled = schedule_kernel(name, func, self.layers, self.target)
        if scheduled is not None:
            self.scheduled[name], self.emitted[name] = scheduled, func
            self.pool.add(name, scheduled, key=key)

    def scheduled_module(self, shared: tvm.IRModule) -> tvm.IRModule:
        """``shared`` (the emitted module after sharing, with ``prefer=self.scheduled``) with the
        kernels scheduled here in place of their unscheduled versions -- only where the module holds
        the very function that was scheduled (anything else is scheduled by ``schedule_module``)."""
        out = shared.clone()
        for gv, func in shared.functions_items():
            emitted = self.emitted.get(gv.name_hint)
            if emitted is not None and (emitted.same_as(func) or tvm_ffi.structural_equal(emitted, func)):
                out[gv] = self.scheduled[gv.name_hint]
        return out
