"""The compiled predictor: run a compiled PFP network from NumPy (or torch) with the TVM runtime.

:class:`CompiledPFP` is what ``net.compile(...)`` and :func:`pyro2pfp.load` return.  It needs only
NumPy and the TVM runtime (:mod:`pyro2pfp.runtime.tvm_runtime`: ``libtvm_runtime`` through ``tvm_ffi``, not
the TVM compiler), so a library exported on a development machine loads and runs on a board with
NumPy and ``apache-tvm`` installed and neither torch nor Pyro.  Threads: see
:mod:`pyro2pfp.runtime.tvm_runtime` (``TVM_NUM_THREADS``, no pinning); :func:`set_num_threads` changes the
count later.
"""
from __future__ import annotations

import threading
import warnings
from typing import Any

import numpy as np

from ..errors import ArgumentError, PFPError
from . import tvm_runtime as rt
from .inputs import checked_inputs, compiled_outputs
from .library_files import export_library
from .profiling import profile
from .remote import benchmark
from .targets import host_arch, target_arch
from .tvm_runtime import default_num_threads

__all__ = ["CompiledPFP", "default_num_threads", "num_threads", "set_num_threads"]


def num_threads() -> int:
    """Threads TVM's CPU kernels run on (process-wide)."""
    return rt.num_threads()


def set_num_threads(n: int) -> int:
    """Run TVM's CPU kernels on ``n`` threads (process-wide; at most the size of the thread pool,
    which is fixed when it starts: set ``TVM_NUM_THREADS`` before the first run for more).
    Threads are not pinned to cores.  Returns the number now in use."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ArgumentError(f"num_threads must be a positive int, got {n!r}")
    rt.config_threadpool(-3, n, rt.available_cpus())  # -3: kSpecifyThreadShareAllCore (no pinning)
    got = num_threads()
    if got != n:
        warnings.warn(f"pyro2pfp: TVM's thread pool has {got} thread(s), asked for {n}: set "
                      f"TVM_NUM_THREADS={n} before the first TVM kernel runs", RuntimeWarning, stacklevel=2)
    return got


class _ThreadState:
    """What one thread needs to call the network: its own VMs (a Relax VM keeps per-call state in
    its register file and is not safe to share) and its own cached input tensors."""

    def __init__(self, vm: Any, tuned_vms: dict[int, Any]) -> None:
        self.vm, self.tuned_vms = vm, tuned_vms
        self.main = vm["main"]
        self.tuned_mains = {b: tvm_vm["main"] for b, tvm_vm in tuned_vms.items()}
        self.inputs: dict[tuple[int, ...], tuple[list[Any], list[np.ndarray]]] = {}


class CompiledPFP:
    """A compiled PFP network: ``exe(x[, x_var]) -> (mean, var)`` float32 NumPy arrays.

    ``x``: ``(batch, *input_shape)`` NumPy array or torch tensor, any batch size.  The input is
    checked (shape, real, finite, within float32 range), copied into a TVM-allocated, 64-byte
    aligned input tensor cached per batch size (a VM would otherwise get the caller's buffer, whose
    alignment the kernels may not assume), and the outputs are zero-copy NumPy views of the tensors
    the VM returns (fresh for every call), checked to be finite (float32 overflow raises
    :class:`~pyro2pfp.errors.NumericalError`; ``net.reference`` computes in float64).  ``tuned``:
    ``{batch: executable}`` specialised for one batch size -- tuned by MetaSchedule
    (``net.compile(tune=...)``) or static-shape with the default schedules (``net.compile(batch_sizes=
    ...)``); a call with one of those batch sizes runs that executable, other sizes the any-batch one.

    **Threads**: one predictor may be shared by any number of threads.  Each thread gets its own
    Relax VMs and input tensors on its first call (the executable and its constants are shared),
    so concurrent calls give exactly the single-threaded results.
    """

    _target: Any

    def __init__(self, executable: Any, input_shape: tuple[int, ...], input_variance: bool,
                 target: Any, tuned: dict[int, Any] | None = None) -> None:
        self.executable = executable
        self.input_shape = tuple(input_shape)
        self.input_variance = input_variance
        self.target = target  # a tvm.target.Target, or a loaded library's JSON spec (converted when read)
        self.device = rt.cpu()
        self.vm: Any = rt.virtual_machine(executable, self.device)  # None: cross-compiled (for_cross_target)
        self.tuned = dict(tuned or {})
        self._tuned_vms = {b: rt.virtual_machine(ex, self.device) for b, ex in self.tuned.items()}
        self._local = threading.local()
        self._local.state = _ThreadState(self.vm, self._tuned_vms)
        self.metadata_extra: dict[str, Any] = {}  # from an exported library's sidecar (pyro2pfp.load)
        # {kernel symbol: (PFP op, layer)} from the PrimFuncs' attributes (profiling reads it)
        self.kernels: dict[str, tuple[str, str]] = {}
        self.library_path: str | None = None
        # "probs": the module ends in the uncertainty head (outputs (probs, stats), see pyro2pfp.ops.head)
        self.head: str | None = None

    @property
    def target(self) -> Any:
        """The ``tvm.target.Target`` the network was compiled for.  A loaded library's comes from its
        sidecar as JSON and becomes a ``Target`` when first read (which imports ``tvm``; running the
        network does not need it)."""
        if isinstance(self._target, dict | str):
            import tvm

            try:
                self._target = tvm.target.Target(self._target)
            except Exception:  # noqa: BLE001 -- informational only
                self._target = tvm.target.Target("llvm")
        return self._target

    @target.setter
    def target(self, value: Any) -> None:
        self._target = value

    def _state(self) -> _ThreadState:
        state = getattr(self._local, "state", None)
        if state is None:  # first call from this thread: VMs of its own over the shared executables
            state = self._local.state = _ThreadState(
                rt.virtual_machine(self.executable, self.device),
                {b: rt.virtual_machine(ex, self.device) for b, ex in self.tuned.items()})
        return state

    def vm_for_batch(self, batch: int) -> Any:
        """The VM a call with ``batch`` rows runs in the calling thread (a tuned one if there is one
        for that size); :meth:`profile` times this one, so profiling is as thread-safe as calls."""
        state = self._state()
        return state.tuned_vms.get(int(batch), state.vm)

    def _input_buffers(self, shape: tuple[int, ...], count: int, state: _ThreadState | None = None
                       ) -> tuple[list[Any], list[np.ndarray]]:
        """This thread's cached input tensors of ``shape`` and NumPy views of them."""
        cache = (state or self._state()).inputs
        buffers = cache.get(shape)
        if buffers is None:
            if len(cache) >= 8:  # bounded cache: many batch sizes
                cache.pop(next(iter(cache)))
            tensors = [rt.empty(shape, "float32", self.device) for _ in range(count)]
            buffers = cache[shape] = (tensors, [np.from_dlpack(t) for t in tensors])
        return buffers

    def _args(self, x: Any, x_var: Any, state: _ThreadState | None = None) -> list:
        """The checked inputs copied into this thread's cached, aligned input tensors (``state``: the
        calling thread's, if the caller has it already)."""
        arrays = checked_inputs(x, x_var, self.input_shape, self.input_variance, np.float32)
        tensors, views = self._input_buffers(arrays[0].shape, len(arrays), state)
        for array, view in zip(arrays, views, strict=True):
            np.copyto(view, array)
        return tensors

    def __call__(self, x: Any, x_var: Any = None) -> Any:
        """``(mean, var)`` of the logits; with the uncertainty head (``self.head == "probs"``) a
        :class:`~pyro2pfp.ops.head.HeadOutput` ``(probs, predictive_entropy, expected_entropy,
        mutual_information)``."""
        state = self._state()
        args = self._args(x, x_var, state)
        main = state.tuned_mains.get(args[0].shape[0], state.main) if state.tuned_mains else state.main
        out = main(*args)  # indexing the returned tvm_ffi Array is cheaper than unpacking it
        return compiled_outputs(np.from_dlpack(out[0]), np.from_dlpack(out[1]), self.head)

    def profile(self, x: Any, x_var: Any = None, *, repeats: int = 30, method: str = "isolated",
                remote: Any = None):
        """Time every kernel of one call on ``x`` (the paper's Figure 5 / Table 4): a
        :class:`pyro2pfp.runtime.profiling.Profile` (``print(prof)`` shows the table; ``prof.by_op()`` the
        share per PFP op).  ``remote`` (``"tracker:9190/key"``, ``"host:port"`` or a
        :class:`pyro2pfp.runtime.remote.Remote`): upload the library to a board and time the whole call
        there with ``time_evaluator`` (a :class:`pyro2pfp.runtime.remote.RemoteTiming`; no per-kernel split)."""
        if remote is not None:
            return benchmark(self, x, remote, x_var, repeats=repeats)

        if not self.runnable:
            raise PFPError("this network was cross-compiled for another CPU architecture: profile it on the device")
        return profile(self, self._args(x, x_var), repeats=repeats, method=method)

    # -- deployment (implemented in pyro2pfp.runtime.deploy) ------------------------------------------

    @classmethod
    def for_cross_target(cls, executable: Any, input_shape: tuple[int, ...], input_variance: bool,
                         target: Any, tuned: dict[int, Any] | None = None) -> CompiledPFP:
        """A predictor compiled for another CPU architecture: it cannot run here, only export (and be
        uploaded to a board, :mod:`pyro2pfp.runtime.remote`).  ``tuned``: ``{batch: executable}`` specialised
        for one batch size (static-shape or tuned on the board), exported with it and run on the
        device for calls of that size, as :class:`CompiledPFP` does here."""
        self = cls.__new__(cls)
        self.executable = executable
        self.input_shape = tuple(input_shape)
        self.input_variance = input_variance
        self.target = target
        self.device = None
        self.vm = None
        self.tuned, self._tuned_vms = {int(b): ex for b, ex in (tuned or {}).items()}, {}
        self._local = threading.local()
        self.head = None
        self.metadata_extra, self.kernels, self.library_path = {}, {}, None
        arch = target_arch(target)

        def not_here(*_: Any) -> None:
            raise PFPError(
                f"this network was compiled for {arch} and cannot run on this {host_arch()} machine: "
                f"exe.export_library('net.so') and run it on the device with pyro2pfp.load('net.so')")

        state = self._local.state = _ThreadState.__new__(_ThreadState)
        state.main, state.tuned_mains, state.inputs = not_here, {}, {}
        state.vm, state.tuned_vms = None, {}

        def every_thread() -> _ThreadState:
            return state

        self._state = every_thread  # type: ignore[method-assign]
        return self

    @property
    def runnable(self) -> bool:
        """False for a cross-compiled predictor (another CPU architecture): export it instead."""
        return self.vm is not None

    def export_library(self, path: Any, *, cc: str | None = None, metadata: dict | None = None) -> str:
        """Write the compiled network to ``path`` (``.so`` or ``.tar``) with TVM's ``export_library``
        plus ``path + ".json"`` (input shape, input-variance flag, target); ``pyro2pfp.load(path)``
        gives back a predictor with the same outputs.  Every batch-specialised executable
        (``self.tuned``: ``compile(batch_sizes=...)`` or ``tune=...``) is written too, next to
        ``path`` as ``<stem>.batch<B><ext>`` (``net.batch10.so``), and listed in the sidecar with its
        sha256; ``load`` loads them back, so calls of those sizes run them there as well.  Cross
        targets: ``.so`` uses the cross compiler (``cc``, default ``aarch64-linux-gnu-gcc`` for
        AArch64), ``.tar`` needs no toolchain.  Returns ``path``."""
        return export_library(self, path, cc=cc, metadata=metadata)
