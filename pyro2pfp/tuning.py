"""Optional MetaSchedule auto-tuning of a PFP network for one static batch size.

The default compile (:func:`pyro2pfp.tvm_backend.schedules.schedule_module`) gives every PFP
kernel a hand-written schedule that serves *any* batch size.  MetaSchedule only tunes static
shapes, so tuning is per batch size::

    result = tune(net.mod, target, batch=10, trials=64, plan=net.plan)
    exe = tvm.compile(result.mod, target=result.target)      # main(x) now takes exactly (10, ...)

What :func:`tune` does:

1. **specialise** ``main``'s symbolic batch to ``batch`` (``BindSymbolicVars`` +
   ``SpecializePrimFuncBasedOnCallSite``); a module made of high-level Relax operators (e.g. from
   TVM's torch frontend) is also legalised and fused (the ``"zero"`` pipeline), so the tasks are
   the fused kernels;
2. **key** a work directory by a hash of the specialised kernels' structure (not the weights:
   retraining keeps the tuning), the target and the batch: ``<work_dir>/<key>/`` holds
   MetaSchedule's JSON database (``database_workload.json``, ``database_tuning_record.json``),
   its logs and ``pyro2pfp_tuning.json`` (trials done, per-kernel choices).  A second call with
   the same network, target and batch reuses it and tunes nothing (unless more ``trials`` are
   asked for than were done, then it tunes the difference);
3. **time** every kernel with its default schedule, and **search** with MetaSchedule
   (``trials`` candidates in total) the kernels that matter: the PFP ``dense``/``conv2d``
   kernels taking at least ``min_share`` of the time (:data:`SEARCH_OPS`), and every kernel that
   has no default schedule (e.g. the deterministic net from the torch frontend);
4. **pick, per kernel, the fastest correct** of: the tuned schedule, the default schedule applied
   to the specialised kernel, and the any-batch default kernel that ``net.compile()`` uses --
   each checked against the unscheduled kernel on the same data and timed back to back -- so a
   kernel is never slower than in the untuned module (up to timing noise) and never wrong.

A tuned module takes exactly ``batch`` rows (the VM rejects other shapes with a clear error);
:func:`tune_network` builds one executable per requested batch, for ``CompiledPFP`` to dispatch
on the batch size (other batch sizes run the default-scheduled, any-batch module).

The traps of MetaSchedule in TVM 0.27 are handled here rather than on one machine:

* **tvm-ffi 0.1.15.x segfaults** in ``tvm.ir.save_json`` (MetaSchedule's mutators and JSON
  database): :func:`check_environment` raises a clear error instead of crashing; the project pins
  ``apache-tvm-ffi==0.1.14.post1``.
* **130 s import in every builder worker** (``tvm.s_tir.tensor_intrin`` under a slow
  ``inspect.stack``) and a new set of workers per round in MetaSchedule's ``LocalBuilder``: the
  default :class:`PooledBuilder` starts its worker processes once per run, with
  :func:`pyro2pfp._fast_inspect.worker_init` (the ``inspect.stack`` patch, then the import: ~3 s),
  builds candidates in parallel and kills a build that hangs (LLVM can take many minutes on a huge
  unrolled candidate); :class:`InProcessRunner` times the built libraries in this process.  The
  in-process ``TuneContext`` import is patched too (scoped: ``inspect.stack`` is restored).
  ``builder="inprocess"`` (no workers at all, no timeout) and ``builder="local"`` (MetaSchedule's
  own builder and runner, with the same initializer) are the alternatives.
* **Unaligned NumPy input**: a VM receives a NumPy array without a copy; kernels compiled for
  static shapes may use 64-byte-aligned vector loads (AVX-512) and then segfault about half of the
  time.  Everything here passes TVM-allocated tensors; so must users of a tuned VM
  (``CompiledPFP`` copies its inputs).
* **Wrong kernels**: every candidate schedule of the final module is checked against the
  unscheduled kernel on the same data before it can be chosen (this caught a default schedule that
  vectorises the parallel loop when a pooling output is 1x1 at a static batch).
* **xgboost cost model**: ``cost_model="auto"`` uses ``"xgb"`` when ``xgboost`` is importable
  and ``"random"`` otherwise (xgboost is not a dependency).
* **num-cores**: MetaSchedule needs it in the target; :func:`tuning_target` adds the number of
  physical cores when it is missing (code generation is the same).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import inspect
import json
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.builder import BuilderInput, BuilderResult, PyBuilder
from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback
from tvm.s_tir.meta_schedule.runner import EvaluatorConfig, PyRunner, RunnerInput
from tvm.s_tir.meta_schedule.runner.local_runner import LocalRunnerFuture
from tvm.s_tir.meta_schedule.runner.utils import alloc_argument_common, run_evaluator_common

from . import _fast_inspect
from .errors import TuningError

__all__ = [
    "DEFAULT_TRIALS",
    "SEARCH_OPS",
    "KernelChoice",
    "TuneResult",
    "TuningError",
    "PooledBuilder",
    "InProcessBuilder",
    "InProcessRunner",
    "check_environment",
    "default_cache_dir",
    "specialize_batch",
    "tuning_key",
    "tuning_target",
    "tune",
    "parse_tune_spec",
    "tune_network",
]

DEFAULT_TRIALS = 64
"""Candidates measured per tuned module when ``trials`` is not given."""

CACHE_ENV = "PYRO2PFP_CACHE"
"""Environment variable overriding the cache root (default ``~/.cache/pyro2pfp``)."""

META_FILE = "pyro2pfp_tuning.json"
FORMAT_VERSION = 1

SEARCH = dict(population_size=64, init_measured_ratio=0.2, init_min_unmeasured=16, max_fail_count=2,
              genetic_num_iters=2, genetic_mutate_prob=0.85, genetic_max_fail_count=2, eps_greedy=0.05)
"""MetaSchedule ``EvolutionarySearch`` settings: a small population (the default 512 spends tens of
seconds per round on 2 cores, mostly re-sampling small design spaces)."""

SEARCH_OPS = ("dense", "conv2d")
"""PFP ops searched by default: the reductions, where MetaSchedule's multi-level tiling can beat
the hand schedule.  The erf/exp-bound elementwise kernels (ReLU moments, the Gaussian max of max
pooling) gain nothing from a random search within a small budget, and their candidates are slow to
compile (large expression trees): they keep the best of their default schedules."""

BUILD_TIMEOUT_SEC = 60.0
"""A candidate whose compilation takes longer is killed and counted as failed."""

_EVALUATOR = EvaluatorConfig(number=1, repeat=3, min_repeat_ms=10, enable_cpu_cache_flush=False)
"""Candidate timing: 3 repeats of at least 10 ms each; :class:`InProcessRunner` reports the fastest
repeat (on a machine shared with other jobs the minimum is the stable statistic)."""


# ----------------------------------------------------------------------------------- environment
def check_environment() -> None:
    """Raise :class:`TuningError` for package versions known to crash MetaSchedule."""
    import tvm_ffi

    version = getattr(tvm_ffi, "__version__", "")
    if version.startswith("0.1.15"):
        raise TuningError(
            f"apache-tvm-ffi {version} segfaults in tvm.ir.save_json, which MetaSchedule uses: "
            "install apache-tvm-ffi==0.1.14.post1 (pinned in pyro2pfp's pyproject.toml)")
    for module in ("psutil", "cloudpickle"):
        if importlib.util.find_spec(module) is None:
            raise TuningError(f"MetaSchedule needs the '{module}' package: pip install {module}")


def default_cache_dir() -> Path:
    """``$PYRO2PFP_CACHE/tuning`` or ``~/.cache/pyro2pfp/tuning``."""
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "pyro2pfp")
    return Path(root).expanduser() / "tuning"


def _physical_cores() -> int:
    """Physical cores available to this process (the default TVM thread count as well)."""
    from .tvm_backend.runtime import default_num_threads

    return default_num_threads()


def _check_runs_here(target: tvm.target.Target) -> None:
    """Tuning measures candidates on this machine: refuse a target for another architecture."""
    from .targets import host_arch, target_arch

    if target_arch(target) != host_arch():
        raise TuningError(
            f"cannot tune for {target_arch(target)} on this {host_arch()} machine: MetaSchedule measures "
            "every candidate where it runs; compile without tune= (default schedules) or tune on the device")


def tuning_target(target: Any) -> tvm.target.Target:
    """``target`` (a preset such as ``"rpi4"``, a name, tag, dict or Target) as a
    ``tvm.target.Target`` with ``num-cores`` (MetaSchedule requires it)."""
    from .targets import resolve_target

    tgt = resolve_target(target)
    cores = tgt.attrs.get("num-cores")
    if cores is not None and int(cores) > 0:
        return tgt
    config = dict(tgt.export())
    config.pop("tag", None)
    config["num-cores"] = _physical_cores()
    if "host" in config and isinstance(config["host"], dict):
        config["host"] = dict(config["host"])
    return tvm.target.Target(config)


# ----------------------------------------------------------------------------------- module prep
def batch_var(mod: tvm.IRModule) -> tirx.Var | int:
    """The batch dimension of ``main``'s first parameter (a ``tirx.Var`` if symbolic)."""
    shape = mod["main"].params[0].ty.shape
    dim = shape[0] if shape is not None else None
    if isinstance(dim, tirx.IntImm):
        return int(dim)
    if isinstance(dim, tirx.Var):
        return dim
    raise TuningError(f"main's first parameter has no batch dimension to specialise: {shape}")


def _has_relax_ops(mod: tvm.IRModule) -> bool:
    """Whether ``mod`` still calls high-level Relax operators (LegalizeOps would change it)."""
    return not tvm_ffi.structural_equal(relax.transform.LegalizeOps()(mod), mod)


def specialize_batch(mod: tvm.IRModule, batch: int, *, fuse: bool | None = None) -> tvm.IRModule:
    """``mod`` with ``main``'s batch dimension fixed to ``batch`` in Relax and in every PrimFunc.

    Remaining high-level Relax operators are legalised.  ``fuse`` (default: only for a module
    that has no PrimFunc yet, e.g. from TVM's torch frontend) also runs FuseOps + FuseTIR (the
    ``"zero"`` pipeline) so that the tasks are the fused kernels a build would run.  A PFP module
    is not fused: its kernels are already one joint mean/variance PrimFunc per layer, and fusion
    would rename them (``fused_pfp_relu_...``) away from their default schedules.
    """
    batch = int(batch)
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    var = batch_var(mod)
    if isinstance(var, int):
        if var != batch:
            raise TuningError(f"main takes a static batch of {var}, cannot specialise it to {batch}")
        out = mod
    else:
        out = relax.transform.BindSymbolicVars({var: batch}, "main")(mod)
    if fuse is None:
        fuse = not _prim_funcs(mod)
    if fuse and _has_relax_ops(out):
        out = relax.get_pipeline("zero")(out)
    elif _has_relax_ops(out):
        out = relax.transform.LegalizeOps()(out)
    out = relax.transform.SpecializePrimFuncBasedOnCallSite()(out)
    out = relax.transform.DeadCodeElimination(["main"])(out)
    return out


def _prim_funcs(mod: tvm.IRModule) -> dict[str, tirx.PrimFunc]:
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


def _target_json(target: tvm.target.Target) -> str:
    return json.dumps(dict(target.export()), sort_keys=True, default=str)


def tuning_key(mod: tvm.IRModule, target: tvm.target.Target, batch: int, board: str | None = None) -> str:
    """Hex key of a tuning run: the specialised kernels' structure, the target, the batch, TVM,
    and the board (the RPC tracker key of a remote run; ``None``: this machine).

    The weights (Relax constants) do not enter it: retraining a network keeps its tuning.
    """
    h = hashlib.sha256()
    h.update(f"pyro2pfp-tuning-v{FORMAT_VERSION}|tvm {tvm.__version__}|batch {int(batch)}|".encode())
    if board is not None:
        h.update(f"board {board}|".encode())
    h.update(_target_json(target).encode())
    for name, func in sorted(_prim_funcs(mod).items()):
        h.update(f"|{name}:{tvm_ffi.structural_hash(func)}".encode())
    return h.hexdigest()[:20]


def _schedules_fingerprint() -> str:
    """Hash of the default-schedule source: the per-kernel choices depend on it."""
    from .tvm_backend import schedules

    try:
        src = inspect.getsource(schedules)
    except OSError:  # pragma: no cover -- no source (zipped install)
        src = schedules.__file__ or ""
    return hashlib.sha256(src.encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------- build / run
_ARTIFACTS: dict[str, Any] = {}
_ARTIFACTS_LOCK = threading.Lock()


def _build_prim_module(mod: tvm.IRModule, target: tvm.target.Target) -> Any:
    """MetaSchedule's ``default_build`` without its ``import tvm.s_tir.tensor_intrin`` (up to
    130 s under a slow ``inspect.stack``; not needed for these kernels)."""
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm.tirx.build(mod, target=target)


def _cross_linker(target: tvm.target.Target) -> str | None:
    """The cross compiler that links kernels built for ``target`` here (``aarch64-linux-gnu-gcc``
    for an AArch64 board tuned from an x86 machine; ``$PYRO2PFP_CROSS_CC`` overrides), ``None`` for
    this machine's architecture.  Missing: a :class:`~pyro2pfp.errors.PFPError` with the apt line."""
    from .exporting import cross_compiler
    from .targets import host_arch, target_arch

    arch = target_arch(target)
    return None if arch == host_arch() else cross_compiler(arch)


@derived_object
class InProcessBuilder(PyBuilder):
    """MetaSchedule builder that compiles candidates in the calling process.

    No worker process is started, so there is no per-batch ``import tvm`` (4-8 s) and no
    ``tvm.s_tir.tensor_intrin`` import (up to 130 s) per worker.  The built module stays in
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
    pays ``import tvm`` (4-8 s) plus ``import tvm.s_tir.tensor_intrin`` (up to 130 s unpatched).
    Here the workers start once per tuning run (initializer :func:`pyro2pfp._fast_inspect.worker_init`:
    ~3 s patched) and build candidates in parallel; a candidate whose compilation hangs (LLVM on a
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


class _BatchRunner:
    """Builds many PrimFuncs as one module (one LLVM compile instead of one per kernel) and runs
    them by identity; falls back to one build per function if the joint build fails.  With
    ``remote`` (a :class:`pyro2pfp.remote.Remote`) the module is uploaded and run on a board."""

    def __init__(self, funcs: list[tirx.PrimFunc], target: tvm.target.Target, remote: Any = None) -> None:
        self.target = target
        self.remote = remote
        self.device = None
        self.symbols = {}
        self.rt_mod = None
        entries = {}
        for i, f in enumerate(funcs):
            sym = f"pyro2pfp_candidate_{i}"
            self.symbols[id(f)] = (f, sym)
            entries[sym] = f.with_attr("global_symbol", sym).with_attr("tirx.noalias", True)
        try:
            self.rt_mod = _build_prim_module(tvm.IRModule(entries), target)
        except Exception:  # noqa: BLE001 -- one bad candidate: build them one by one
            self.rt_mod = None
        if remote is not None:
            if self.rt_mod is None:
                raise TuningError(f"the kernels to time on {remote.address} do not build as one module")
            self.rt_mod, self.device = _upload_module(self.rt_mod, remote, target)

    def close(self) -> None:
        """Drop the built module (and with it the RPC session of a remote run: the board is free)."""
        self.rt_mod = self.device = None
        self.symbols = {}

    def __call__(self, func: tirx.PrimFunc, arrays: list[np.ndarray], time_it: bool = True
                 ) -> tuple[list[np.ndarray], float | None]:
        entry = self.symbols.get(id(func))
        if self.remote is not None:
            if entry is None or not entry[0].same_as(func):
                raise TuningError(f"kernel {func} was not uploaded to {self.remote.address}")
            return self.remote._bounded("running a kernel on the board", lambda: _run_built(
                self.rt_mod, entry[1], arrays, time_it, device=self.device), timeout=self.remote.session_timeout)
        if self.rt_mod is None or entry is None or not entry[0].same_as(func):
            return run_prim_func(func, self.target, arrays, time_it=time_it)
        return _run_built(self.rt_mod, entry[1], arrays, time_it)


def _upload_module(rt_mod: Any, remote: Any, target: tvm.target.Target) -> tuple[Any, Any]:
    """Export ``rt_mod`` (built for ``target``: linked with the cross compiler for another
    architecture), upload it to a board of ``remote`` and load it there: (module, device)."""
    import tempfile

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


def _same_outputs(got: list[np.ndarray], want: list[np.ndarray], rtol: float = 1e-3) -> bool:
    """Every buffer equal up to ``rtol`` of its largest magnitude (reduction order may differ)."""
    for g, w in zip(got, want):
        scale = float(np.nanmax(np.abs(w))) if w.size else 0.0
        if not np.allclose(g, w, rtol=0, atol=rtol * max(scale, 1e-30), equal_nan=True):
            return False
    return True


# ----------------------------------------------------------------------------------- progress
@derived_object
class _Progress(PyMeasureCallback):
    """Prints one line per measured batch of candidates: trials done, task, best time."""

    def __init__(self, names: list[str], total: int, label: str, out: Callable[[str], Any],
                 start_trials: int = 0) -> None:
        super().__init__()
        self.names, self.total, self.label, self.out = names, total, label, out
        self.done, self.start_trials = 0, start_trials
        self.best: dict[int, float] = {}
        self.failed = 0
        self.t0 = time.perf_counter()

    def apply(self, task_scheduler: Any, task_id: int, measure_candidates: Any, builder_results: Any,
              runner_results: Any) -> None:
        n = len(runner_results)
        self.done += n
        for res in runner_results:
            secs = list(res.run_secs) if res.run_secs is not None else []
            if res.error_msg is not None or not secs:
                self.failed += 1
                continue
            t = float(np.mean([float(s) for s in secs]))
            self.best[task_id] = min(self.best.get(task_id, float("inf")), t)
        best = self.best.get(task_id)
        best_txt = f"{best * 1e6:9.1f} us" if best is not None else "   (none)  "
        self.out(f"[{self.label}] {self.start_trials + self.done:4d}/{self.total} trials  "
                 f"{self.names[task_id]:<28s} best {best_txt}  failed {self.failed}  "
                 f"{time.perf_counter() - self.t0:6.1f} s")


# ----------------------------------------------------------------------------------- results
@dataclasses.dataclass
class KernelChoice:
    """Which schedule one kernel of the tuned module uses, and the measured times (us)."""

    name: str
    choice: str                     # "tuned", "default", "any-batch" or "naive"
    times_us: dict[str, float]      # per candidate schedule
    rejected: list[str] = dataclasses.field(default_factory=list)  # failed the output check


@dataclasses.dataclass
class TuneResult:
    """Outcome of :func:`tune`.

    ``mod``: the batch-specialised IRModule with the chosen schedules (``tvm.compile`` it with
    ``target``); ``batch``; ``work_dir`` (this run's keyed directory); ``database``
    (MetaSchedule ``JSONDatabase``); ``trials`` done in total; ``seconds`` spent in this call;
    ``reused`` (True when nothing was tuned in this call); ``kernels``: one
    :class:`KernelChoice` per PrimFunc.
    """

    mod: tvm.IRModule
    target: tvm.target.Target
    batch: int
    key: str
    work_dir: Path
    database: Any
    trials: int
    seconds: float
    reused: bool
    kernels: list[KernelChoice]

    def build(self) -> Any:
        """``tvm.compile(self.mod, target=self.target)`` (through
        :func:`pyro2pfp.tvm_backend.runtime.build`: every kernel compiled with ``noalias``)."""
        from .tvm_backend.runtime import build

        return build(self.mod, self.target)

    def summary(self) -> str:
        lines = [f"tuned for batch {self.batch}: {self.trials} trials, work dir {self.work_dir}"
                 f"{' (reused)' if self.reused else ''}",
                 f"{'kernel':<30s} {'choice':>9s} {'tuned us':>9s} {'default us':>11s} {'any-batch us':>13s}"
                 f" {'naive us':>9s}"]
        for k in self.kernels:
            c = [f"{k.times_us[n]:.1f}" if n in k.times_us else "-" for n in ("tuned", "default", "any-batch", "naive")]
            bad = f"  (rejected: {', '.join(k.rejected)} -- wrong results)" if k.rejected else ""
            lines.append(f"{k.name:<30s} {k.choice:>9s} {c[0]:>9s} {c[1]:>11s} {c[2]:>13s} {c[3]:>9s}{bad}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------- helpers
@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Exclusive lock on ``directory`` (two processes tuning the same key wait for each other)."""
    directory.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover -- not POSIX
        yield
        return
    with open(directory / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _read_meta(directory: Path) -> dict[str, Any]:
    try:
        with open(directory / META_FILE) as fh:
            meta = json.load(fh)
        return meta if meta.get("format") == FORMAT_VERSION else {}
    except (OSError, ValueError):
        return {}


def _write_meta(directory: Path, meta: dict[str, Any]) -> None:
    tmp = directory / (META_FILE + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(meta, fh, indent=1, sort_keys=True)
    os.replace(tmp, directory / META_FILE)


def _default_schedules(mod: tvm.IRModule, plan: Any, target: tvm.target.Target) -> dict[str, tirx.PrimFunc]:
    """The default (hand-written) schedule of every PFP kernel of ``mod`` that has one."""
    from .tvm_backend import schedules
    from .tvm_backend._core import kernel_info

    layers = {layer.name: layer for layer in getattr(plan, "layers", ())}
    out = {}
    for name, func in _prim_funcs(mod).items():
        op, layer_name = kernel_info(func)
        layer = layers.get(layer_name) if layer_name is not None else None
        if op is None or schedules._schedule_fn(op) is None:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out[name] = schedules.schedule_function(func, op, layer, target)
        except Exception:  # noqa: BLE001 -- the same fail-soft rule as schedule_module
            continue
    return out


def _any_batch_defaults(mod: tvm.IRModule, plan: Any, target: tvm.target.Target,
                        names: set[str]) -> dict[str, tirx.PrimFunc]:
    """The default-scheduled kernels of the *symbolic-batch* module (what ``net.compile()``
    runs), for the kernels the specialised module has too.  They accept any batch, so they are
    candidates in the specialised module as well: the tuned module is then never slower, kernel
    by kernel, than the untuned one (a schedule applied to the static kernel can differ)."""
    from .tvm_backend import schedules
    from .tvm_backend._core import kernel_table

    if not set(kernel_table(mod)) & names:
        return {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scheduled = schedules.schedule_module(mod, plan, target)
    return {name: f for name, f in _prim_funcs(scheduled).items()
            if name in names and f.attrs is not None and f.attrs.get("tirx.is_scheduled", False)}


def _resolve_cost_model(cost_model: str) -> str:
    if cost_model == "auto":
        return "xgb" if importlib.util.find_spec("xgboost") is not None else "random"
    return cost_model


def _apply_database(mod: tvm.IRModule, database: Any, target: tvm.target.Target) -> tvm.IRModule:
    with target, database, tvm.transform.PassContext(opt_level=3), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)


def _print(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------------- tune
def tune(mod: tvm.IRModule, target: Any, *, batch: int, trials: int = DEFAULT_TRIALS,
         work_dir: str | os.PathLike | None = None, progress: bool | Callable[[str], Any] = True,
         plan: Any = None, cost_model: str = "auto", builder: str = "pool",
         num_trials_per_iter: int | None = None, min_share: float = 0.03,
         search_ops: Sequence[str] | None = SEARCH_OPS, seed: int = 0,
         label: str | None = None, remote: Any = None) -> TuneResult:
    """Tune ``mod`` (symbolic batch) for ``batch`` with MetaSchedule; reuse a previous run's database.

    Args:
        mod: a Relax IRModule whose ``main``'s first parameter has a (symbolic) batch dimension:
            ``net.mod`` of a PFP network, or any module (e.g. from TVM's torch frontend).
        target: what :func:`pyro2pfp.targets.make_target` accepts; ``num-cores`` is
            added if missing (:func:`tuning_target`).
        batch: the batch size the result is specialised to.
        trials: candidates measured in total over all tuned kernels (MetaSchedule's
            ``max_trials_global``).  ``0``: no search, only the default schedules (and naive
            kernels for ops without one).
        work_dir: cache root; the run uses ``<work_dir>/<tuning_key>/``.  Default
            :func:`default_cache_dir` (``$PYRO2PFP_CACHE/tuning`` or ``~/.cache/pyro2pfp/tuning``).
        progress: True prints one line per measured batch of candidates; a callable receives
            the lines; False is silent.
        plan: the network's ``PlannedGraph`` (``net.plan``), to find each kernel's default
            schedule by layer; without it the schedules read only the PrimFuncs (``pfp.op`` attribute).
        cost_model: ``"auto"`` (xgb if xgboost is installed, else random), ``"xgb"``, ``"random"``.
        builder: where candidates are compiled: ``"pool"`` (default: a persistent pool of worker
            processes, parallel, killed after :data:`BUILD_TIMEOUT_SEC`), ``"inprocess"`` (this
            process: no start-up cost, but no timeout), ``"local"`` (MetaSchedule's own
            ``LocalBuilder``/``LocalRunner``, new workers per round: slowest, fully isolated).
            Candidates are timed in this process except with ``"local"``.
        num_trials_per_iter: candidates per search round of one task (default: from the budget).
        min_share: kernels with a default schedule are searched only if they take at least this
            fraction of the default-scheduled kernels' time (the others keep their default schedule);
            kernels without one are always searched.
        search_ops: PFP ops whose kernels are searched (default :data:`SEARCH_OPS`: dense and
            conv2d); the other PFP kernels keep the best of their default schedules.  ``None``:
            search every kernel.  Kernels that are not PFP kernels are always searched.
        seed: search seed.
        label: prefix of the progress lines.
        remote: measure on boards through TVM RPC instead of this machine: ``"tracker:9190/key"``,
            ``"server:9090"`` or a :class:`pyro2pfp.remote.Remote`.  Candidates are built here and
            timed on the boards by MetaSchedule's ``RPCRunner`` (``remote.parallel`` boards at a
            time); the per-kernel choice is timed and checked on a board too.  The database is
            keyed by the board (tracker key) as well as the target.

    Returns:
        a :class:`TuneResult`; ``result.build()`` compiles it.
    """
    check_environment()
    if builder not in BUILDERS:
        raise ValueError(f"builder must be one of {BUILDERS}, got {builder!r}")
    t_start = time.perf_counter()
    trials = int(trials)
    if trials < 0:
        raise ValueError(f"trials must be >= 0, got {trials}")
    out = (progress if callable(progress) else _print) if progress else (lambda _msg: None)
    tgt = tuning_target(target)
    board = None
    if remote is not None:
        from .remote import as_remote

        remote = as_remote(remote)
        remote.servers()  # no server under the key: a clear error now, not a queue that never ends
        board = remote.tag
        if builder != "pool":
            raise TuningError(f"tuning on {remote.address} needs builder='pool' (libraries written to disk "
                              f"for upload), got {builder!r}")
    else:
        _check_runs_here(tgt)
    static = specialize_batch(mod, batch)
    key = tuning_key(static, tgt, batch, board)
    root = Path(work_dir).expanduser() if work_dir is not None else default_cache_dir()
    directory = root / key
    label = label or f"tune batch {batch}"
    funcs = _prim_funcs(static)
    if not funcs:
        raise TuningError("the module has no PrimFunc to tune")

    with _locked(directory):
        meta = _read_meta(directory)
        done = int(meta.get("trials", 0)) if meta else 0
        fingerprint = _schedules_fingerprint()
        defaults = _default_schedules(static, plan, tgt)
        any_batch = _any_batch_defaults(mod, plan, tgt, set(funcs))
        tuned_now = False
        if trials > done:
            _fast_inspect.preimport_tensor_intrin()  # TuneContext imports it: ~3 s instead of ~130 s
            # kernels worth searching: by their time with the default schedule (naive if none)
            run = _BatchRunner(list(defaults.values()), tgt, remote)
            try:
                base_us = {name: _seconds(run(f, _kernel_inputs(f))) * 1e6 for name, f in defaults.items()}
            finally:
                run.close()  # its RPC session must not hold the board during the search (one board: a deadlock)
            todo = _select_tasks(static, tgt, base_us, min_share, search_ops)
            if todo:
                tuned_now = True
                n_tasks = len(todo)
                budget = trials - done
                per_iter = num_trials_per_iter or max(2, min(16, budget // max(1, 2 * n_tasks)))
                out(f"[{label}] tuning {n_tasks} kernel(s), {budget} trials "
                    f"({per_iter} per round), work dir {directory}")
                _run_search(todo, tgt, directory, budget, per_iter, cost_model, builder, seed,
                            _Progress([t.task_name for t in todo], trials, label, out, done), remote)
            meta = {}
        if not meta:
            meta = {"format": FORMAT_VERSION, "key": key, "batch": int(batch), "trials": 0,
                    "target": _target_json(tgt), "tvm": tvm.__version__, "board": board}
        database = ms.database.JSONDatabase(work_dir=str(directory), module_equality="structural")
        tuned = _apply_database(static, database, tgt)
        choices = meta.get("choices") if meta.get("schedules") == fingerprint and not tuned_now else None
        if choices is None or set(choices) != set(funcs):
            choices = _choose(static, tuned, defaults, tgt, any_batch, remote=remote)
            meta.update({"choices": choices, "schedules": fingerprint})
        meta["trials"] = max(int(meta.get("trials", 0)), trials)
        _write_meta(directory, meta)

    result_mod = static.clone()
    kernels = []
    for name, func in funcs.items():
        entry = choices[name]
        choice = entry["choice"]
        if choice == "tuned":
            new = tuned[name]
        elif choice == "default":
            new = defaults[name]
        elif choice == "any-batch":
            new = any_batch[name]
        else:
            new = func
        result_mod[result_mod.get_global_var(name)] = new
        kernels.append(KernelChoice(name, choice, dict(entry["times_us"]), list(entry.get("rejected", []))))
    kernels.sort(key=lambda k: -min(k.times_us.values(), default=0.0))
    result = TuneResult(mod=result_mod, target=tgt, batch=int(batch), key=key, work_dir=directory,
                        database=database, trials=int(meta["trials"]),
                        seconds=time.perf_counter() - t_start, reused=not tuned_now, kernels=kernels)
    if progress:
        n_tuned = sum(k.choice == "tuned" for k in kernels)
        how = ("tuned" if tuned_now else "no search (trials=0)" if result.trials == 0
               else f"reused the database ({result.trials} trials)")
        out(f"[{label}] {how}, {result.seconds:.1f} s: {n_tuned}/{len(kernels)} kernels use a tuned schedule")
    return result


def _select_tasks(static: tvm.IRModule, target: tvm.target.Target, base_us: dict[str, float],
                  min_share: float, search_ops: Sequence[str] | None = None) -> list[Any]:
    """The extracted tasks worth searching: PFP kernels of ``search_ops`` taking at least
    ``min_share`` of the default-scheduled time, and every kernel without a default schedule."""
    from .tvm_backend._core import kernel_table

    ops = {name: op for name, (op, _) in kernel_table(static).items()}
    tasks = ms.relax_integration.extract_tasks(static, target)
    total = sum(base_us.values())
    chosen = []
    for task in tasks:
        name = task.task_name
        if _binds_let(task.dispatched[0]["main"]) if task.dispatched else False:
            continue  # MetaSchedule (0.27) cannot analyse Let expressions: keeps its default schedule
        if name not in base_us:
            chosen.append(task)
            continue
        if search_ops is not None and ops.get(name) not in search_ops:
            continue
        if total > 0 and base_us[name] < min_share * total:
            continue
        chosen.append(task)
    return chosen


def _binds_let(func: tirx.PrimFunc) -> bool:
    """Whether ``func`` binds values with ``Let`` expressions (the PFP kernels that share alpha,
    Phi, phi between their outputs do).  MetaSchedule's feature extraction and FLOP estimate in
    TVM 0.27 stop on them (``InternalError: Do not have a default for prim.Let``)."""
    found = False

    def visit(node: Any, visitor: Any) -> None:
        nonlocal found
        if isinstance(node, tirx.Let):
            found = True
        elif not found:
            visitor.default_visit(node)

    tvm_ffi.structural_visit(func.body, visit)
    return found


def _run_search(tasks: list[Any], target: tvm.target.Target, directory: Path, budget: int, per_iter: int,
                cost_model: str, builder: str, seed: int, progress: Any, remote: Any = None) -> None:
    strategy = ms.search_strategy.EvolutionarySearch(**SEARCH)
    ms_logger = logging.getLogger("tvm.s_tir.meta_schedule")
    level = ms_logger.level
    for handler in list(ms_logger.handlers):
        if handler.get_name() is None:  # MetaSchedule's dictConfig lists its logger's handlers by
            ms_logger.removeHandler(handler)  # name and fails on an unnamed one (seen after an RPC run)
    ms_logger.setLevel(logging.WARNING)  # the console handler MetaSchedule creates gets this level
    try:
        contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(
            extracted_tasks=tasks, work_dir=str(directory), space="post-order-apply",
            strategy=strategy, num_threads=_physical_cores(), seed=seed)
        _tune_contexts(contexts, weights, target, directory, budget, per_iter, cost_model, builder, progress,
                       remote)
    finally:
        ms_logger.setLevel(level)


BUILDERS = ("pool", "inprocess", "local")


def _tune_contexts(contexts: list[Any], weights: list[float], target: tvm.target.Target, directory: Path,
                   budget: int, per_iter: int, cost_model: str, builder_kind: str, progress: Any,
                   remote: Any = None) -> None:
    callbacks = [ms.measure_callback.AddToDatabase(), ms.measure_callback.UpdateCostModel(), progress]
    pooled = None
    if builder_kind == "local":
        builder = ms.builder.LocalBuilder(max_workers=_physical_cores(), timeout_sec=BUILD_TIMEOUT_SEC,
                                          initializer=_fast_inspect.worker_init)
        runner = ms.runner.LocalRunner(timeout_sec=60, evaluator_config=_EVALUATOR,
                                       initializer=_fast_inspect.worker_init)
        import cloudpickle

        cloudpickle.register_pickle_by_value(_fast_inspect)
        callbacks.insert(1, ms.measure_callback.RemoveBuildArtifact())
    elif builder_kind == "inprocess":
        builder, runner = InProcessBuilder(), InProcessRunner(_EVALUATOR)
    else:
        builder = pooled = PooledBuilder(timeout_sec=BUILD_TIMEOUT_SEC)
        runner = InProcessRunner(_EVALUATOR) if remote is None else _rpc_runner(remote)
        callbacks.insert(1, ms.measure_callback.RemoveBuildArtifact())
    try:
        ms.tune.tune_tasks(
            tasks=contexts, task_weights=weights, work_dir=str(directory),
            max_trials_global=budget, max_trials_per_task=budget, num_trials_per_iter=per_iter,
            builder=builder, runner=runner, database="json", cost_model=_resolve_cost_model(cost_model),
            measure_callbacks=callbacks,
            task_scheduler="gradient", module_equality="structural")
    finally:
        if pooled is not None:
            pooled.shutdown()


def _rpc_runner(remote: Any) -> Any:
    """MetaSchedule's ``RPCRunner``: candidates uploaded to and timed on ``remote.parallel`` boards."""
    from .remote import create_session

    return ms.runner.RPCRunner(rpc_config=remote.rpc_config(), evaluator_config=_EVALUATOR,
                               max_workers=int(remote.parallel),
                               f_create_session=None if remote.key else create_session)


def _choose(static: tvm.IRModule, tuned: tvm.IRModule, defaults: dict[str, tirx.PrimFunc],
            target: tvm.target.Target, any_batch: dict[str, tirx.PrimFunc] | None = None,
            run: Callable[..., tuple[list[np.ndarray], float | None]] | None = None, remote: Any = None
            ) -> dict[str, dict[str, Any]]:
    """Per kernel: check each available schedule against the unscheduled kernel on the same data
    (a schedule that computes something else -- a miscompile -- is never chosen), time them back
    to back and keep the fastest.  ``run(func, arrays, time_it)`` runs one candidate (default:
    all candidates built as one module)."""
    per_kernel: dict[str, tuple[tirx.PrimFunc, dict[str, tirx.PrimFunc]]] = {}
    for name, func in _prim_funcs(static).items():
        candidates: dict[str, tirx.PrimFunc] = {}
        tuned_func = tuned[name]
        if tuned_func.attrs is not None and tuned_func.attrs.get("tirx.is_scheduled", False) \
                and not tvm_ffi.structural_equal(tuned_func, func):
            candidates["tuned"] = tuned_func
        if name in defaults:
            candidates["default"] = defaults[name]
        if any_batch and name in any_batch:
            candidates["any-batch"] = any_batch[name]
        per_kernel[name] = (func, candidates)
    if run is None:
        run = _BatchRunner([f for func, cands in per_kernel.values() for f in (func, *cands.values())], target,
                           remote)
    choices = {}
    for name, (func, candidates) in per_kernel.items():
        arrays = _kernel_inputs(func)
        want, naive_s = run(func, arrays, time_it=not candidates)
        times: dict[str, float] = {}
        rejected = []
        for kind, f in candidates.items():
            try:
                got, seconds = run(f, arrays, time_it=True)
            except Exception:  # noqa: BLE001 -- a candidate that does not build/run is not chosen
                rejected.append(kind)
                continue
            if not _same_outputs(got, want):
                rejected.append(kind)
                warnings.warn(f"pyro2pfp.tuning: the {kind} schedule of {name} computes different values "
                              f"than the unscheduled kernel at this batch size (a TVM miscompile?); not used",
                              RuntimeWarning, stacklevel=3)
                continue
            times[kind] = _seconds((got, seconds)) * 1e6
        if not times:  # nothing valid: the unscheduled kernel
            times["naive"] = (naive_s if naive_s is not None else _seconds(run(func, arrays, time_it=True))) * 1e6
        best = min(times, key=times.__getitem__)
        choices[name] = {"choice": best, "times_us": times, "rejected": rejected}
    return choices


# ----------------------------------------------------------------------------------- network API
def parse_tune_spec(tune: Any) -> dict[str, Any]:
    """Normalise ``compile(tune=...)``: an int (batch), a list of batches, or a dict with
    ``batch`` (int or list) and optional ``trials``, ``work_dir``, ``progress``, ``cost_model``,
    ``builder``, ``min_share``, ``search_ops``, ``seed``.  Returns a dict with ``batches`` (a tuple)."""
    if tune is None or tune is False:
        return {}
    if isinstance(tune, bool):
        raise TypeError("tune=True needs a batch size: tune=10 or tune={'batch': 10, 'trials': 64}")
    if isinstance(tune, int):
        spec: dict[str, Any] = {"batch": tune}
    elif isinstance(tune, Sequence) and not isinstance(tune, str):
        spec = {"batch": list(tune)}
    elif isinstance(tune, dict):
        spec = dict(tune)
    else:
        raise TypeError(f"tune must be a batch size, a list of them or a dict, got {type(tune).__name__}")
    allowed = {"batch", "trials", "work_dir", "progress", "cost_model", "builder", "min_share",
               "search_ops", "seed", "remote"}
    unknown = set(spec) - allowed
    if unknown:
        raise TypeError(f"unknown tune option(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    if "batch" not in spec:
        raise TypeError("tune needs a 'batch' (MetaSchedule tunes one static batch size at a time)")
    batches = spec.pop("batch")
    batches = [batches] if isinstance(batches, int) else list(batches)
    if not batches or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in batches):
        raise ValueError(f"tune batch sizes must be positive ints, got {batches!r}")
    spec["batches"] = tuple(dict.fromkeys(batches))
    return spec


def with_remote(tune: Any, remote: Any) -> Any:
    """``compile(tune=..., remote=...)``: the tune spec with ``remote`` added (``remote`` without
    ``tune`` is an error: there is nothing to measure on the board at compile time)."""
    if remote is None:
        return tune
    if tune is None or tune is False:
        raise TypeError("compile(remote=...) measures tuning candidates on the board: give tune= too "
                        "(to time or validate a compiled network on a board: exe.profile(x, remote=...), "
                        "pyro2pfp.remote.validate)")
    spec = parse_tune_spec(tune)
    spec["batch"] = list(spec.pop("batches"))
    spec["remote"] = remote
    return spec


def tune_network(net: Any, target: Any, spec: Any) -> dict[int, Any]:
    """Tune ``net`` (a :class:`~pyro2pfp.network.PFPNetwork`) for each batch of ``spec`` (what
    ``compile(tune=...)`` takes, see :func:`parse_tune_spec`) and build them:
    ``{batch: VM executable specialised to that batch}``."""
    options = parse_tune_spec(spec)
    batches = options.pop("batches", ())
    return {batch: tune(net.mod, target, batch=batch, plan=net.plan, **options).build()
            for batch in batches}
