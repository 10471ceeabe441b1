"""Per-kernel profile of a compiled PFP network (the paper's Figure 5 / Table 4).

TVM 0.27 has no ``vm.profile()``; the VM's instrument hook (``vm.set_instrument``) sees every
call the VM makes: the PFP kernels (``pfp_<op>_<layer>`` PrimFuncs) and the VM's builtins
(``vm.builtin.alloc_storage``, ``match_shape``, ...).  :func:`profile` uses it in two ways:

* ``method="isolated"`` (default): one instrumented call of ``main`` records every kernel and a
  private copy of its arguments; each kernel is then timed *alone* by ``time_evaluator`` on the
  compiled library (C++ loop, median of ``repeats``; a Python loop would let the thread pool's
  workers fall asleep between calls, and waking them can cost more than the kernel).  ``total_us``
  is the median of ``main`` timed by
  ``vm.time_evaluator`` (C++ loop, no Python), and the ``(vm overhead)`` row is
  ``total - sum(kernels)``: allocation, shape checks and dispatch inside the VM.
* ``method="in_vm"``: kernels are timed in place, between the instrument's before/after hooks,
  while ``main`` runs ``repeats`` times; ``total_us`` is the wall time of those calls, and the
  ``(vm overhead)`` row holds the builtins, the instrument callbacks and the VM's dispatch.

Either way the rows (kernels plus ``(vm overhead)``) add up to ``total_us``.

``profile(exe, [x])`` accepts a :class:`~pyro2pfp.backends.tvm.runtime.CompiledPFP`, a
``relax.VirtualMachine`` or an executable; arguments may be NumPy arrays or TVM tensors.

**Work per kernel.** ``profile(..., work=kernel_multiply_adds(net, batch))`` (the count:
:func:`pyro2pfp.backends.tvm.kernel_work.kernel_multiply_adds`, which needs the TVM compiler) also gives
each row its multiply-adds and its rate (G multiply-adds/s), and ``reference_rate=`` (e.g. the
deterministic torch net's multiply-adds over its time) a ratio to it, so the kernel that is slowest per
unit of work stands out.
"""
from __future__ import annotations

import collections
import dataclasses
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import ArgumentError, PFPError
from .tvm_runtime import as_tvm

__all__ = ["KernelTime", "Profile", "profile", "split_kernel_name", "OVERHEAD_ROW"]

OVERHEAD_ROW = "(vm overhead)"


@dataclasses.dataclass
class KernelTime:
    """One row of a :class:`Profile`: a kernel (or the VM overhead), microseconds per ``main`` call."""

    name: str          # VM call symbol, e.g. "pfp_dense_fc1"
    op: str            # PFP op ("dense", "conv2d", "relu", "max_pool2d", ...) or the symbol
    layer: str         # layer name ("fc1") or ""
    calls: int         # calls per main call
    us: float          # time per main call (all calls of this kernel)
    share: float       # us / total_us
    multiply_adds: float | None = None  # per main call (all calls), when the profile was given the work

    @property
    def rate(self) -> float | None:
        """G multiply-adds per second (None without the work or the time)."""
        if self.multiply_adds is None or self.us <= 0:
            return None
        return self.multiply_adds / self.us * 1e-3

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Profile:
    """Kernel times of one ``main`` call; ``rows`` (kernels by decreasing time, then the
    ``(vm overhead)`` row) sum to ``total_us``."""

    rows: list[KernelTime]
    total_us: float
    batch: int | None
    method: str
    repeats: int
    threads: int | None
    reference_rate: float | None = None  # G multiply-adds/s the rows' rates are compared with
    reference_name: str = ""             # what it is the rate of (e.g. "det torch")

    @property
    def kernels(self) -> list[KernelTime]:
        """The kernel rows (without the overhead row)."""
        return [r for r in self.rows if r.name != OVERHEAD_ROW]

    @property
    def overhead_us(self) -> float:
        return sum(r.us for r in self.rows if r.name == OVERHEAD_ROW)

    def by_op(self) -> dict[str, float]:
        """Microseconds per PFP op type (dense, conv2d, relu, max_pool2d, ...), the overhead
        under ``(vm overhead)``; sums to ``total_us``."""
        out: dict[str, float] = collections.defaultdict(float)
        for r in self.rows:
            out[r.op] += r.us
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def as_dict(self) -> dict[str, Any]:
        return {"total_us": self.total_us, "batch": self.batch, "method": self.method,
                "repeats": self.repeats, "threads": self.threads, "reference_rate": self.reference_rate,
                "rows": [r.as_dict() for r in self.rows], "by_op_us": self.by_op()}

    def table(self, title: str | None = None) -> str:
        """The profile as a text table, then the share per op type."""
        lines = []
        if title:
            lines.append(title)
        work = any(r.multiply_adds is not None for r in self.rows)
        ref = self.reference_rate
        nw = max([28, *(len(r.name) for r in self.rows)])
        ow = max([12, *(len(r.op) for r in self.rows)])
        head = f"{'kernel':<{nw}s} {'op':<{ow}s} {'calls':>5s} {'us':>10s} {'share':>7s}"
        if work:
            head += f" {'M mul-add':>10s} {'G/s':>7s}"
            if ref:
                head += f" {'x' + (self.reference_name or 'ref'):>10s}"
        lines.append(head)
        for r in self.rows:
            line = f"{r.name:<{nw}s} {r.op:<{ow}s} {r.calls:5d} {r.us:10.1f} {100 * r.share:6.1f}%"
            if r.multiply_adds is not None and r.rate is not None:
                line += f" {r.multiply_adds / 1e6:10.2f} {r.rate:7.1f}"
                if ref:
                    line += f" {r.rate / ref:10.2f}"
            lines.append(line)
        lines.append(f"{'total':<{nw}s} {'':<{ow}s} {'':>5s} {self.total_us:10.1f} {100.0:6.1f}%")
        if work:
            total = sum(r.multiply_adds or 0.0 for r in self.rows)
            lines.append(f"multiply-adds {total / 1e6:.2f} M in {self.total_us:.1f} us: "
                         f"{total / self.total_us * 1e-3:.1f} G/s"
                         + (f"; {self.reference_name or 'reference'}: {ref:.2f} G/s" if ref else ""))
        ops = ", ".join(f"{op} {100 * us / self.total_us:.0f}%" for op, us in self.by_op().items()
                        if self.total_us > 0)
        lines.append(f"by op: {ops}   (batch {self.batch}, method {self.method}, "
                     f"{self.repeats} repeats, {self.threads} threads)")
        return "\n".join(lines)

    __str__ = table


def split_kernel_name(symbol: str) -> tuple[str, str]:
    """Fallback for libraries exported without the kernel table (and raw VMs): ``("dense", "fc1")``
    for ``"pfp_dense_fc1"`` (longest registered PFP op -- a kernel or a scheduled op such as the
    shared-factor ``sf_conv_load`` -- that prefixes it); ``(symbol, "")`` for anything else."""
    if symbol.startswith("pfp_"):
        # the op names registered by the TVM back end where it is loaded (the network was compiled in
        # this process); a runtime-only process guesses from the name
        backend = sys.modules.get("pyro2pfp.backends.tvm")
        ops = []
        if backend is not None:
            ops = list(backend.KERNELS) + [op for op in backend.SCHEDULES if op not in backend.KERNELS]
        rest = symbol[4:]
        matches = [op for op in ops if rest.startswith(op + "_")]
        if matches:
            op = max(matches, key=len)
            return op, rest[len(op) + 1:]
        op, _, layer = rest.partition("_")
        return op, layer
    return symbol, ""


def _is_builtin(symbol: str) -> bool:
    return symbol.startswith("vm.") or symbol.startswith("relax.") or symbol.startswith("runtime.")


def _resolve_vm(target: Any, batch: int | None) -> Any:
    """A ``relax.VirtualMachine`` from a CompiledPFP, a VM or an executable."""
    from tvm import relax

    if isinstance(target, relax.VirtualMachine):
        return target
    pick = getattr(target, "vm_for_batch", None)  # a CompiledPFP with batch-specialised VMs
    vm = pick(batch) if callable(pick) and batch is not None else None
    if vm is None:
        vm = getattr(target, "vm", None)
    if vm is not None:
        if isinstance(vm, relax.VirtualMachine):
            return vm
        # a CompiledPFP's runtime-only VM (pyro2pfp.runtime.tvm_runtime): TVM's VM over the same executable
        # has the instrument hook and time_evaluator
        import tvm

        return relax.VirtualMachine(as_tvm(vm.executable), tvm.cpu())
    if getattr(target, "runnable", True) is False:
        raise PFPError("this network was cross-compiled for another CPU architecture: profile it on the device")
    import tvm

    return relax.VirtualMachine(target, tvm.cpu())


def _as_tensors(args: Sequence[Any], device: Any) -> list[Any]:
    import tvm
    import tvm_ffi

    out = []
    for a in args:
        if isinstance(a, tvm_ffi.Tensor):  # also the runtime-only predictor's (pyro2pfp.runtime.tvm_runtime)
            out.append(a)
        else:
            if hasattr(a, "detach"):
                a = a.detach().cpu().numpy()
            out.append(tvm.runtime.tensor(np.ascontiguousarray(a, dtype=np.float32), device))
    return out


def _threads() -> int | None:
    try:
        import tvm

        return int(tvm.runtime.num_threads())
    except Exception:  # noqa: BLE001
        return None


def _copy_arg(a: Any, device: Any) -> Any:
    import tvm
    import tvm_ffi

    if isinstance(a, tvm_ffi.Tensor):
        return tvm.runtime.tensor(np.from_dlpack(a), device)
    return a


def _time_call(func: Any, args: list[Any], repeats: int, target_us: float = 200.0) -> float:
    """Median microseconds of one ``func(*args)`` call: ``repeats`` rounds of enough calls to
    take about ``target_us`` each."""
    for _ in range(2):
        func(*args)
    t0 = time.perf_counter()
    func(*args)
    one = max(time.perf_counter() - t0, 1e-7)
    inner = int(min(1000, max(1, target_us * 1e-6 / one)))
    samples = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        for _ in range(inner):
            func(*args)
        samples.append((time.perf_counter() - t0) / inner)
    return float(np.median(samples)) * 1e6


def profile(target: Any, args: Sequence[Any], repeats: int = 30, *, method: str = "isolated",
            func_name: str = "main", work: Mapping[str, float] | None = None,
            reference_rate: float | None = None, reference_name: str = "") -> Profile:
    """Time every kernel of one ``main(*args)`` call.

    Parameters
    ----------
    target
        A ``CompiledPFP`` (``net.compile()``), a ``relax.VirtualMachine`` or an executable.
    args
        The arguments of ``main`` (``[x]`` or ``[x, x_var]``), NumPy arrays, torch tensors
        or TVM tensors of shape ``(batch, *input_shape)``.
    repeats
        Timing rounds (medians are reported).
    method
        ``"isolated"`` (each kernel timed alone on a copy of its arguments; total from
        ``vm.time_evaluator``) or ``"in_vm"`` (kernels timed in place by the instrument hook
        over ``repeats`` calls of ``main``).
    work
        ``{kernel symbol: multiply-adds of one call}`` (:func:`kernel_multiply_adds`), for the
        rows' multiply-adds and rates.
    reference_rate, reference_name
        A rate (G multiply-adds/s) the rows are compared with, and
        what it is the rate of.

    Returns
    -------
    Profile
        Rows -- one per kernel (by decreasing time) and one
        ``(vm overhead)`` row -- sum to ``total_us``.
    """
    import tvm
    from tvm.runtime.vm import VMInstrumentReturnKind

    if method not in ("isolated", "in_vm"):
        raise ArgumentError(f"method must be 'isolated' or 'in_vm', got {method!r}")
    device = tvm.cpu()
    batch = None
    if args:
        shape = getattr(args[0], "shape", None)
        batch = int(shape[0]) if shape is not None and len(shape) else None
    vm = _resolve_vm(target, batch)
    tensors = _as_tensors(args, device)
    main = vm[func_name]
    main(*tensors)  # warm up

    if method == "in_vm":
        rows, total_us = _profile_in_vm(vm, main, tensors, repeats, VMInstrumentReturnKind)
    else:
        rows, total_us = _profile_isolated(vm, main, tensors, repeats, device, func_name,
                                           VMInstrumentReturnKind)
    kernels = getattr(target, "kernels", None) or {}  # (op, layer) from the PrimFuncs' attributes
    rows = [dataclasses.replace(row, op=kernels[row.name][0], layer=kernels[row.name][1])
            if row.name in kernels else row for row in rows]
    if work:
        rows = [dataclasses.replace(row, multiply_adds=work[row.name] * row.calls)
                if row.name in work else row for row in rows]
    return Profile(rows=rows, total_us=total_us, batch=batch, method=method, repeats=repeats,
                   threads=_threads(), reference_rate=reference_rate, reference_name=reference_name)


def _rows(kernel_us: dict[str, float], calls: dict[str, int], total_us: float) -> list[KernelTime]:
    rows = []
    for name, us in sorted(kernel_us.items(), key=lambda kv: -kv[1]):
        op, layer = split_kernel_name(name)
        rows.append(KernelTime(name, op, layer, calls[name], us, us / total_us if total_us > 0 else 0.0))
    overhead = total_us - sum(kernel_us.values())
    rows.append(KernelTime(OVERHEAD_ROW, OVERHEAD_ROW, "", 0, overhead,
                           overhead / total_us if total_us > 0 else 0.0))
    return rows


def _instrumented(vm: Any, hook: Any, run: Any) -> None:
    """``run()`` with ``hook`` as the VM's instrument (removed afterwards, also on error)."""
    vm.set_instrument(hook)
    try:
        run()
    finally:
        vm.set_instrument(None)


def _profile_isolated(vm: Any, main: Any, tensors: list[Any], repeats: int, device: Any, func_name: str,
                      kinds: Any) -> tuple[list[KernelTime], float]:
    import tvm

    captured: list[tuple[str, Any, list[Any]]] = []

    def record(func: Any, symbol: str, before: bool, ret: Any, *call_args: Any) -> Any:
        if before and not _is_builtin(symbol):
            captured.append((symbol, func, [_copy_arg(a, device) for a in call_args]))
        return kinds.NO_OP

    _instrumented(vm, record, lambda: main(*tensors))
    kernel_us: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)
    libs = [m for m in getattr(vm.module, "imports", ()) if hasattr(m, "implements_function")]
    for symbol, func, call_args in captured:
        lib = next((m for m in libs if m.implements_function(symbol)), None)
        if lib is not None and all(isinstance(a, tvm.runtime.Tensor) for a in call_args):
            # C++ timing loop (as for the total): a Python loop lets the thread pool's workers
            # fall asleep between calls, and waking them up can cost more than the kernel
            timer = lib.time_evaluator(symbol, device, number=1, repeat=max(5, repeats), min_repeat_ms=2)
            kernel_us[symbol] += float(np.median(timer(*call_args).results)) * 1e6
        else:
            kernel_us[symbol] += _time_call(func, call_args, repeats)
        calls[symbol] += 1
    timer = vm.time_evaluator(func_name, device, number=1, repeat=max(5, repeats), min_repeat_ms=5)
    total_us = float(np.median(timer(*tensors).results)) * 1e6
    return _rows(dict(kernel_us), dict(calls), total_us), total_us


def _profile_in_vm(vm: Any, main: Any, tensors: list[Any], repeats: int,
                   kinds: Any) -> tuple[list[KernelTime], float]:
    per_call: list[dict[str, float]] = []
    counts: dict[str, int] = collections.defaultdict(int)
    current: dict[str, float] = collections.defaultdict(float)
    start: dict[str, float] = {}

    def record(func: Any, symbol: str, before: bool, ret: Any, *call_args: Any) -> Any:
        if _is_builtin(symbol):
            return kinds.NO_OP
        if before:
            start[symbol] = time.perf_counter()
        else:
            current[symbol] += time.perf_counter() - start.pop(symbol)
        return kinds.NO_OP

    totals = []

    def timed_calls() -> None:
        for _ in range(max(1, repeats)):
            current.clear()
            t0 = time.perf_counter()
            main(*tensors)
            totals.append(time.perf_counter() - t0)
            per_call.append(dict(current))

    _instrumented(vm, record, timed_calls)

    def kernel_calls(func: Any, symbol: str, before: bool, ret: Any, *call_args: Any) -> Any:
        if before and not _is_builtin(symbol):
            counts[symbol] += 1
        return kinds.NO_OP

    _instrumented(vm, kernel_calls, lambda: main(*tensors))
    # medians per kernel, and the overhead from the median call, so the rows add up to the total
    names = sorted({k for d in per_call for k in d})
    kernel_us = {k: float(np.median([d.get(k, 0.0) for d in per_call])) * 1e6 for k in names}
    total_us = float(np.median(totals)) * 1e6
    return _rows(kernel_us, dict(counts), total_us), total_us
