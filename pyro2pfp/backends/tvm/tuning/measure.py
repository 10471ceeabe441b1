"""Tuning: building and timing kernels -- MetaSchedule builders and runners that avoid its slow
worker start-up (:class:`PooledBuilder`, :class:`InProcessBuilder`, :class:`InProcessRunner`, the
``RPCRunner`` of a remote run), and running/timing one PrimFunc or many built as one module, here or
uploaded to a board (:class:`_BatchRunner`)."""
from __future__ import annotations

import concurrent.futures
import os
import tempfile
import threading
import time
from typing import Any

import numpy as np
import tvm
from tvm import tirx
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.builder import BuilderInput, BuilderResult, PyBuilder
from tvm.s_tir.meta_schedule.runner import EvaluatorConfig, PyRunner, RunnerInput
from tvm.s_tir.meta_schedule.runner.local_runner import LocalRunnerFuture
from tvm.s_tir.meta_schedule.runner.utils import alloc_argument_common, run_evaluator_common

from ....errors import TuningError
from ....runtime.library_files import cross_compiler
from ....runtime.remote import create_session
from ....runtime.targets import host_arch, target_arch
from ..build import KERNELS_PER_PART, build_jobs
from . import _fast_inspect
from .environment import _physical_cores

BUILD_TIMEOUT_SEC = 60.0
"""A candidate whose compilation takes longer is killed and counted as failed."""

_EVALUATOR = EvaluatorConfig(number=1, repeat=3, min_repeat_ms=10, enable_cpu_cache_flush=False)
"""Candidate timing: 3 repeats of at least 10 ms each; :class:`InProcessRunner` reports the fastest
repeat (on a machine shared with other jobs the minimum is the stable statistic)."""


_ARTIFACTS: dict[str, Any] = {}
_ARTIFACTS_LOCK = threading.Lock()


def _build_prim_module(mod: tvm.IRModule, target: tvm.target.Target) -> Any:
    """MetaSchedule's ``default_build`` without its ``import tvm.s_tir.tensor_intrin`` (minutes
    under a slow ``inspect.stack``; not needed for these kernels)."""
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm.tirx.build(mod, target=target)


def _cross_linker(target: tvm.target.Target) -> str | None:
    """The cross compiler that links kernels built for ``target`` here (``aarch64-linux-gnu-gcc``
    for an AArch64 board tuned from an x86 machine; ``$PYRO2PFP_CROSS_CC`` overrides), ``None`` for
    this machine's architecture.  Missing: a :class:`~pyro2pfp.errors.PFPError` with the apt line."""
    arch = target_arch(target)
    return None if arch == host_arch() else cross_compiler(arch)


@derived_object
class InProcessBuilder(PyBuilder):
    """MetaSchedule builder that compiles candidates in the calling process.

    No worker process is started, so there is no per-batch ``import tvm`` (seconds) and no
    ``tvm.s_tir.tensor_intrin`` import (minutes unpatched) per worker.  The built module stays in
    memory under a made-up artifact path that :class:`InProcessRunner` consumes.
    """

    def build(self, build_inputs: list[BuilderInput]) -> list[BuilderResult]:
        results = []
        for build_input in build_inputs:
            try:
                rt_mod = _build_prim_module(build_input.mod, build_input.target)
            except Exception as err:  # noqa: BLE001 -- reported to MetaSchedule as a failed build
                results.append(BuilderResult(None, f"InProcessBuilder: {type(err).__name__}: {err}"))
                continue
            with _ARTIFACTS_LOCK:
                path = f"pyro2pfp-inprocess://{id(rt_mod)}-{len(_ARTIFACTS)}-{time.perf_counter_ns()}"
                _ARTIFACTS[path] = rt_mod
            results.append(BuilderResult(path, None))
        return results


@derived_object
class PooledBuilder(PyBuilder):
    """MetaSchedule builder with a *persistent* pool of worker processes and a per-build timeout.

    MetaSchedule's ``LocalBuilder`` starts new workers for every batch of candidates, and each
    pays ``import tvm`` (seconds) plus ``import tvm.s_tir.tensor_intrin`` (minutes unpatched).
    Here the workers start once per tuning run (initializer
    :func:`pyro2pfp.backends.tvm.tuning._fast_inspect.worker_init`:
    seconds, patched) and build candidates in parallel; a candidate whose compilation hangs (LLVM on a
    huge unrolled loop nest can take many minutes) is killed after ``timeout_sec`` and reported as a
    failed build.  The shared library is loaded and timed by :class:`InProcessRunner`.
    """

    def __init__(self, max_workers: int | None = None, timeout_sec: float = 60.0) -> None:
        super().__init__()
        import cloudpickle
        from tvm.support.popen_pool import PopenPoolExecutor

        cloudpickle.register_pickle_by_value(_fast_inspect)  # workers need not import pyro2pfp
        self.timeout_sec = float(timeout_sec)
        self.pool = PopenPoolExecutor(max_workers=max_workers or _physical_cores(), timeout=self.timeout_sec,
                                      initializer=_fast_inspect.worker_init)

    def build(self, build_inputs: list[BuilderInput]) -> list[BuilderResult]:
        from tvm.support.popen_pool import StatusKind

        results = []
        jobs = [(b.mod, b.target, _cross_linker(b.target)) for b in build_inputs]
        for res in self.pool.map_with_error_catching(lambda job: _fast_inspect.worker_build(*job), jobs):
            if res.status == StatusKind.COMPLETE:
                results.append(BuilderResult(res.value, None))
            elif res.status == StatusKind.TIMEOUT:
                results.append(BuilderResult(None, f"PooledBuilder: timeout, killed after {self.timeout_sec:.0f} s"))
            else:
                results.append(BuilderResult(None, f"PooledBuilder: {res.value}"))
        return results

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False)


def _random_args(args_info: list[Any], device: Any) -> list[list[Any]]:
    f_fill = tvm.get_global_func("tvm.contrib.random.random_fill_for_measure")
    return alloc_argument_common(f_fill, device, [a.as_json() for a in args_info], 1)


@derived_object
class InProcessRunner(PyRunner):
    """MetaSchedule runner that times :class:`InProcessBuilder`'s modules in this process
    (``time_evaluator``, the same C++ timing loop as MetaSchedule's ``LocalRunner``)."""

    def __init__(self, evaluator_config: EvaluatorConfig | None = None) -> None:
        super().__init__()
        self.evaluator_config = EvaluatorConfig._normalized(evaluator_config or _EVALUATOR)

    def run(self, runner_inputs: list[RunnerInput]) -> list[Any]:
        futures = []
        for runner_input in runner_inputs:
            path = str(runner_input.artifact_path)
            with _ARTIFACTS_LOCK:
                rt_mod = _ARTIFACTS.pop(path, None)
            if rt_mod is None:
                try:  # a shared library exported by PooledBuilder
                    rt_mod = tvm.runtime.load_module(path)
                except Exception as err:  # noqa: BLE001
                    futures.append(LocalRunnerFuture(None, f"InProcessRunner: cannot load {path}: {err}"))
                    continue
            try:
                device = tvm.runtime.device(str(runner_input.device_type), 0)
                args = _random_args(list(runner_input.args_info), device)
                costs = run_evaluator_common(rt_mod, device, self.evaluator_config, args)
                futures.append(LocalRunnerFuture([min(costs)], None))
            except Exception as err:  # noqa: BLE001
                futures.append(LocalRunnerFuture(None, f"InProcessRunner: {type(err).__name__}: {err}"))
        return futures


def _normalized(func: tirx.PrimFunc) -> tvm.IRModule:
    func = func.with_attr("global_symbol", "main").with_attr("tirx.noalias", True)
    return tvm.IRModule({"main": func})


def _kernel_inputs(func: tirx.PrimFunc, seed: int = 0) -> list[np.ndarray]:
    """Deterministic test data for every buffer of ``func``: uniform in [0.1, 1) (non-negative,
    so variances stay valid: no NaN from a square root)."""
    rng = np.random.default_rng(seed)
    mod = _normalized(func)
    arrays = []
    for info in ms.arg_info.ArgInfo.from_prim_func(mod["main"]):
        _, dtype, shape = info.as_json()
        arrays.append(rng.uniform(0.1, 1.0, [int(d) for d in shape]).astype(str(dtype)))
    return arrays


def run_prim_func(func: tirx.PrimFunc, target: tvm.target.Target, arrays: list[np.ndarray], *,
                  time_it: bool = True, repeat: int | None = None, min_repeat_ms: int | None = None
                  ) -> tuple[list[np.ndarray], float | None]:
    """Build ``func`` alone, run it once on copies of ``arrays`` (all its buffers, DPS order) and
    return every buffer afterwards; with ``time_it`` also the fastest of ``repeat`` timed repeats
    (seconds; the minimum is the stable statistic on a machine shared with other jobs)."""
    rt_mod = _build_prim_module(_normalized(func), target)
    return _run_built(rt_mod, rt_mod.entry_name, arrays, time_it, repeat, min_repeat_ms)


KERNEL_TIMING = {"repeat": 5, "min_repeat_ms": 20}
"""How each candidate kernel is timed when the schedules are chosen (fastest of ``repeat`` repeats
of at least ``min_repeat_ms``)."""


def _run_built(rt_mod: Any, symbol: str, arrays: list[np.ndarray], time_it: bool, repeat: int | None = None,
               min_repeat_ms: int | None = None, device: Any = None) -> tuple[list[np.ndarray], float | None]:
    repeat = KERNEL_TIMING["repeat"] if repeat is None else repeat
    min_repeat_ms = KERNEL_TIMING["min_repeat_ms"] if min_repeat_ms is None else min_repeat_ms
    device = tvm.cpu() if device is None else device
    # TVM-allocated (64-byte aligned) copies: kernels compiled for static shapes may use aligned
    # vector loads, and a NumPy buffer handed over without a copy can be misaligned (segfault)
    args = [tvm.runtime.tensor(a.copy(), device) for a in arrays]
    rt_mod[symbol](*args)
    outputs = [a.numpy() for a in args]
    seconds = None
    if time_it:
        timer = rt_mod.time_evaluator(symbol, device, number=1, repeat=repeat, min_repeat_ms=min_repeat_ms)
        seconds = float(np.min(timer(*args).results))
    return outputs, seconds


def _build_parts(entries: dict[str, tirx.PrimFunc], target: tvm.target.Target) -> dict[str, Any]:
    """``{symbol: built module holding it}`` for ``entries`` (``{symbol: PrimFunc}``, each
    ``global_symbol`` set), built for this machine as :class:`~pyro2pfp.backends.tvm.build.KernelPool`
    builds a network: parts of :data:`~pyro2pfp.backends.tvm.build.KERNELS_PER_PART` kernels on
    :func:`~pyro2pfp.backends.tvm.build.build_jobs` threads (TVM releases the GIL while LLVM works), each
    part's machine code generated on its thread too (LLVM's JIT would otherwise generate the code of the
    whole module on the first call, on one thread).  A part that does not build is left out (its
    kernels are then built one by one when run)."""
    items = list(entries.items())
    parts = [dict(items[i:i + KERNELS_PER_PART]) for i in range(0, len(items), KERNELS_PER_PART)]

    def compile_part(part: dict[str, tirx.PrimFunc]) -> Any:
        try:
            rt_mod = _build_prim_module(tvm.IRModule(part), target)
            rt_mod.get_function(next(iter(part)))  # the machine code of the whole part, on this thread
        except Exception:  # noqa: BLE001 -- one bad candidate: its part's kernels are built one by one
            return None
        return rt_mod

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, build_jobs()),
                                               thread_name_prefix="pyro2pfp-tune-build") as pool:
        built = list(pool.map(compile_part, parts))
    return {sym: rt_mod for part, rt_mod in zip(parts, built, strict=True) if rt_mod is not None for sym in part}


class _BatchRunner:
    """Builds many PrimFuncs and runs them by identity: for this machine in parts on parallel threads
    (:func:`_build_parts`), for a board as one module (one upload); a kernel whose build failed is
    built alone when run.  With ``remote`` (a :class:`pyro2pfp.runtime.remote.Remote`) the module is uploaded
    and run on a board."""

    def __init__(self, funcs: list[tirx.PrimFunc], target: tvm.target.Target, remote: Any = None) -> None:
        self.target = target
        self.remote = remote
        self.device = None
        self.symbols = {}
        self.rt_mod = None
        self.modules: dict[str, Any] = {}  # symbol -> the built module that holds it
        entries = {}
        for i, f in enumerate(funcs):
            sym = f"pyro2pfp_candidate_{i}"
            self.symbols[id(f)] = (f, sym)
            entries[sym] = f.with_attr("global_symbol", sym).with_attr("tirx.noalias", True)
        if remote is None:
            self.modules = _build_parts(entries, target)
            return
        try:
            built = _build_prim_module(tvm.IRModule(entries), target)
        except Exception as exc:  # noqa: BLE001
            raise TuningError(f"the kernels to time on {remote.address} do not build as one module") from exc
        self.rt_mod, self.device = _upload_module(built, remote, target)
        self.modules = dict.fromkeys(entries, self.rt_mod)

    def close(self) -> None:
        """Drop the built modules (and with them the RPC session of a remote run: the board is free)."""
        self.rt_mod = self.device = None
        self.symbols = {}
        self.modules = {}

    def __call__(self, func: tirx.PrimFunc, arrays: list[np.ndarray], time_it: bool = True
                 ) -> tuple[list[np.ndarray], float | None]:
        entry = self.symbols.get(id(func))
        if self.remote is not None:
            if entry is None or not entry[0].same_as(func):
                raise TuningError(f"kernel {func} was not uploaded to {self.remote.address}")
            return self.remote._bounded("running a kernel on the board", lambda: _run_built(
                self.rt_mod, entry[1], arrays, time_it, device=self.device), timeout=self.remote.session_timeout)
        if entry is None or not entry[0].same_as(func) or entry[1] not in self.modules:
            return run_prim_func(func, self.target, arrays, time_it=time_it)
        return _run_built(self.modules[entry[1]], entry[1], arrays, time_it)


def _upload_module(rt_mod: Any, remote: Any, target: tvm.target.Target) -> tuple[Any, Any]:
    """Export ``rt_mod`` (built for ``target``: linked with the cross compiler for another
    architecture), upload it to a board of ``remote`` and load it there: (module, device)."""
    from tvm.support import cc as tvm_cc

    linker = _cross_linker(target)
    session = remote.connect()
    with tempfile.TemporaryDirectory(prefix="pyro2pfp-rpc-") as tmp:
        path = os.path.join(tmp, "kernels.so")
        if linker:
            rt_mod.export_library(path, fcompile=tvm_cc.cross_compiler(linker))
        else:
            rt_mod.export_library(path)
        name = f"pyro2pfp_kernels_{os.getpid()}_{time.perf_counter_ns()}.so"
        remote._bounded("uploading kernels", lambda: session.upload(path, name), timeout=remote.session_timeout)
    loaded = remote._bounded("loading kernels on the board", lambda: session.load_module(name),
                             timeout=remote.session_timeout)
    return loaded, session.cpu()


def _seconds(result: tuple[Any, float | None]) -> float:
    """The time of a ``(outputs, seconds)`` result that was asked to time the call."""
    seconds = result[1]
    if seconds is None:
        raise TuningError("a kernel run that was asked to be timed returned no time")
    return seconds


def time_prim_func(func: tirx.PrimFunc, target: tvm.target.Target, *, repeat: int | None = None,
                   min_repeat_ms: int | None = None) -> float:
    """Seconds of one call of ``func`` (static shapes), built alone: the fastest of ``repeat``."""
    return _seconds(run_prim_func(func, target, _kernel_inputs(func), repeat=repeat, min_repeat_ms=min_repeat_ms))


def _rpc_runner(remote: Any) -> Any:
    """MetaSchedule's ``RPCRunner``: candidates uploaded to and timed on ``remote.parallel`` boards."""
    return ms.runner.RPCRunner(rpc_config=remote.rpc_config(), evaluator_config=_EVALUATOR,
                               max_workers=int(remote.parallel),
                               f_create_session=None if remote.key else create_session)
