"""Tuning: the MetaSchedule search -- which kernels are searched (:data:`SEARCH_OPS`, their share
of the time, no ``Let``), the evolutionary search settings, the builder/runner choice, the cost
model and the progress lines."""
from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback

from ....planning.registry import OPS
from ..emit import kernel_table
from . import _fast_inspect
from .environment import _physical_cores
from .measure import _EVALUATOR, BUILD_TIMEOUT_SEC, InProcessBuilder, InProcessRunner, PooledBuilder, _rpc_runner

SEARCH = dict(population_size=64, init_measured_ratio=0.2, init_min_unmeasured=16, max_fail_count=2,
              genetic_num_iters=2, genetic_mutate_prob=0.85, genetic_max_fail_count=2, eps_greedy=0.05)
"""MetaSchedule ``EvolutionarySearch`` settings: a small population (the default 512 spends tens of
seconds per round on 2 cores, mostly re-sampling small design spaces)."""

SEARCH_OPS = tuple(name for name, op in OPS.items() if op.compute_layer)
"""PFP ops searched by default: the compute layers (dense, conv2d), the reductions, where MetaSchedule's
multi-level tiling can beat the hand schedule.  The erf/exp-bound elementwise kernels (ReLU moments, the
Gaussian max of max pooling) gain nothing from a random search within a small budget, and their candidates are slow to
compile (large expression trees): they keep the best of their default schedules."""

BUILDERS = ("pool", "inprocess", "local")
"""Where candidates are compiled: ``tune(builder=...)``."""


def _resolve_cost_model(cost_model: str) -> str:
    if cost_model == "auto":
        return "xgb" if importlib.util.find_spec("xgboost") is not None else "random"
    return cost_model


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


def _select_tasks(static: tvm.IRModule, target: tvm.target.Target, base_us: dict[str, float],
                  min_share: float, search_ops: Sequence[str] | None = None) -> list[Any]:
    """The extracted tasks worth searching: PFP kernels of ``search_ops`` taking at least
    ``min_share`` of the default-scheduled time, and every kernel without a default schedule."""
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
