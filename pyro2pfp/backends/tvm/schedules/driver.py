"""The driver: apply each kernel's default schedule (:func:`schedule_module`, :func:`schedule_kernel`,
:func:`schedule_function`), running small static-shape kernels and loop nests on one thread."""
from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import tvm
from tvm import s_tir, tirx

from ....planning.plan import PlannedGraph, PlannedLayer
from ..emit import kernel_info
from .table import _schedule_fn
from .work import kernel_bytes, kernel_work, loop_work

SERIAL_WORK = 1e6
"""A kernel with static shapes (a static-batch executable: ``net.compile(batch_sizes=...)``, tuning)
whose arithmetic (:func:`~.work.kernel_work`) is below this many operations runs on one thread: its
schedule's ``parallel`` calls are dropped (:class:`_ParallelFilter`).  Waking the thread pool and
joining it costs more than splitting a few microseconds of work saves.  Kernels with a symbolic batch
(the any-batch executable) keep their parallel loops: their work is not known when they are compiled.
The three thresholds here were chosen by timing static-batch executables (``benchmarks/latency.py``)."""

SERIAL_BYTES = 1e5
"""A static kernel under :data:`SERIAL_WORK` operations keeps its parallel loops all the same when its
arguments (:func:`~.work.kernel_bytes`) reach this many bytes: a kernel that streams that much data
with little arithmetic per byte (a dense layer at batch 1 reads each weight once) runs faster with each
core reading part of it (from its own cache) than on one core."""

NEST_SERIAL_WORK = 1e5
"""In a static-shape kernel that stays parallel, a parallel loop whose blocks do less than this many
operations (:func:`~.work.loop_work`) runs serially, as a whole kernel does under :data:`SERIAL_WORK`:
a kernel of many small loop nests (a shared-factor load kernel has many, most of 1e2-1e5 operations
at batch 1) otherwise wakes and joins the thread pool once per nest.  See :func:`schedule_function`.
The best threshold depends on the machine (how fast a core computes against what a fork-join costs);
a larger one makes small-batch convolutional nets slower where the cores are fast."""

class _Unchecked:
    """A ``tvm.s_tir.Schedule`` whose primitives skip TVM's Python-side argument type checks.

    TVM wraps every ``Schedule`` primitive in ``s_tir.schedule._type_checker.type_checked``, which binds
    the call's arguments with ``inspect.Signature.bind`` and checks each against its annotation
    (formatting an error message for every alternative of a ``Union`` that does not match) before the
    C++ primitive runs.  For the default schedules that costs about as much as the primitives
    themselves.  The schedules here are fixed code, tested on every
    op: each primitive is called through the wrapper's ``__wrapped__`` (set by ``functools.wraps``),
    so the C++ primitive still validates its arguments and raises on misuse."""

    def __init__(self, sch: s_tir.Schedule) -> None:
        self._sch = sch
        self._methods: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        method = self._methods.get(name)
        if method is None:
            attr = getattr(type(self._sch), name, None)
            code = getattr(attr, "__code__", None)
            raw = getattr(attr, "__wrapped__", None)
            if raw is None or code is None or not code.co_filename.endswith("_type_checker.py"):
                return getattr(self._sch, name)  # not a type-checked primitive: as it is
            method = self._methods[name] = functools.partial(raw, self._sch)
        return method


class _ParallelFilter(_Unchecked):
    """A ``tvm.s_tir.Schedule`` (primitives unchecked, :class:`_Unchecked`) whose ``parallel``
    primitive is recorded (``self.loops``, in call order) and applied only where ``keep(i)`` of the
    call's index ``i`` is true (else the loop stays serial); every other primitive is the schedule's own."""

    def __init__(self, sch: s_tir.Schedule, keep: Callable[[int], bool] = lambda _i: True) -> None:
        super().__init__(sch)
        self._keep = keep
        self.loops: list[Any] = []

    def parallel(self, loop: Any) -> None:
        """Make ``loop`` parallel, unless its call is not kept."""
        index = len(self.loops)
        self.loops.append(loop)
        if self._keep(index):
            _Unchecked.__getattr__(self, "parallel")(loop)


def schedule_function(func: tirx.PrimFunc, op: str, layer: PlannedLayer | None, target: tvm.target.Target
                      ) -> tirx.PrimFunc:
    """``func`` with the default schedule of PFP op ``op`` (``layer``: its planned layer, may be
    None; the schedules only read shapes from the PrimFunc itself); raises if a primitive fails.
    A static-shape kernel whose :func:`kernel_work` is below :data:`SERIAL_WORK` and whose arguments
    are below :data:`SERIAL_BYTES` gets the schedule without its parallel loops; in the other
    static-shape kernels, the parallel loops doing less than
    :data:`NEST_SERIAL_WORK` operations in the scheduled kernel are left serial (the schedule is
    made again, skipping those ``parallel`` calls: a loop's work is known only once every block
    computed under it is in place)."""
    fn = _schedule_fn(op)
    if fn is None:
        raise KeyError(f"no schedule registered for PFP op {op!r}")
    sch = s_tir.Schedule(func)
    work = kernel_work(sch)
    if work is None:  # a symbolic extent (any batch): the work is unknown, every parallel loop stays
        fn(_Unchecked(sch), layer, target)
    elif work < SERIAL_WORK and kernel_bytes(sch) < SERIAL_BYTES:
        fn(_ParallelFilter(sch, keep=lambda _i: False), layer, target)
    else:
        recorded = _ParallelFilter(sch)
        fn(recorded, layer, target)
        small = set()
        for index, loop in enumerate(recorded.loops):
            try:
                loop_ops = loop_work(sch, loop)
            except Exception:  # noqa: BLE001 -- a loop handle a later primitive replaced: keep it parallel
                continue
            if loop_ops is not None and loop_ops < NEST_SERIAL_WORK:
                small.add(index)
        if small:
            sch = s_tir.Schedule(func)
            fn(_ParallelFilter(sch, keep=lambda i: i not in small), layer, target)
    out = sch.mod["main"]
    if "global_symbol" not in (func.attrs or {}) and "global_symbol" in (out.attrs or {}):
        out = out.without_attr("global_symbol")
    return out.with_attr("tirx.is_scheduled", True)


def schedule_module(mod: tvm.IRModule, plan: PlannedGraph | None, target: tvm.target.Target,
                    on_scheduled: Callable[[str, tirx.PrimFunc], None] | None = None) -> tvm.IRModule:
    """Apply each op's registered default schedule to its PrimFunc (unregistered ops stay naive).

    PrimFuncs are matched to planned layers by their ``pfp.op`` / ``pfp.layer`` attributes
    (:func:`~pyro2pfp.backends.tvm.emit.kernel_info`); functions that are already scheduled
    (``tirx.is_scheduled``) are left alone.  Returns a new module (``mod`` is not modified).  A
    schedule that raises leaves its function unscheduled and emits a ``RuntimeWarning`` naming it.
    ``on_scheduled(name, func)`` is called with each function as soon as it is scheduled, and with each
    function that came scheduled (e.g. :meth:`~pyro2pfp.backends.tvm.build.KernelPool.add`: LLVM compiles
    it while the next is scheduled).
    """
    if not isinstance(target, tvm.target.Target):
        target = tvm.target.Target(target)
    out = mod.clone()
    layers = layers_by_name(plan)
    for gv in mod.get_global_vars():
        func = mod[gv]
        if not isinstance(func, tirx.PrimFunc):
            continue
        scheduled = schedule_kernel(gv.name_hint, func, layers, target)
        if scheduled is None:
            continue
        if scheduled is not func:
            out[gv] = scheduled
        if on_scheduled is not None:
            on_scheduled(gv.name_hint, scheduled)
    return out


def layers_by_name(plan: PlannedGraph | None) -> dict[str, PlannedLayer]:
    """``{layer name: planned layer}`` of ``plan`` (what :func:`schedule_kernel` looks layers up in)."""
    return {layer.name: layer for layer in getattr(plan, "layers", ())}


def schedule_kernel(name: str, func: tirx.PrimFunc, layers: dict[str, PlannedLayer], target: tvm.target.Target
                    ) -> tirx.PrimFunc | None:
    """Kernel ``name`` with its op's default schedule (:func:`schedule_function`; the op and layer
    from its attributes, ``layers`` from :func:`layers_by_name`): ``func`` itself if it came scheduled
    (hand-written TIR such as ``sf_cholesky``), None if its op has no schedule or the schedule raised
    (fail soft: the naive kernel is correct; a ``RuntimeWarning`` names it)."""
    if func.attrs is not None and func.attrs.get("tirx.is_scheduled", False):
        return func
    op, layer_name = kernel_info(func)
    layer = layers.get(layer_name) if layer_name is not None else None
    if op is None or _schedule_fn(op) is None:
        return None
    try:
        return schedule_function(func, op, layer, target)
    except Exception as err:  # noqa: BLE001 -- fail soft: keep the correct naive kernel
        lines = str(err).strip().splitlines()
        warnings.warn(f"pyro2pfp: the default schedule of {name} ({op}) failed, "
                      f"keeping it unscheduled: {type(err).__name__}: {lines[-1] if lines else ''}",
                      RuntimeWarning, stacklevel=3)
        return None
