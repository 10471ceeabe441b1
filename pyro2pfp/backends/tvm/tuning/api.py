"""Tuning: the public entry points -- :func:`tune` (one batch size), :func:`tune_network` (what
``compile(tune=...)`` runs), :func:`parse_tune_spec` and :func:`with_remote`."""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import tvm
from tvm.s_tir import meta_schedule as ms

from ....errors import ArgumentError, TuningError
from ....planning.plan import PlannedGraph
from ....planning.protocols import ConvertedNetwork
from ....runtime.remote import as_remote
from . import _fast_inspect
from .choose import _any_batch_defaults, _choose, _default_schedules
from .database import FORMAT_VERSION, _apply_database, _locked, _read_meta, _write_meta
from .environment import _check_runs_here, check_environment, default_cache_dir, tuning_target
from .measure import _BatchRunner, _kernel_inputs, _seconds
from .results import KernelChoice, TuneResult
from .search import BUILDERS, SEARCH_OPS, _Progress, _run_search, _select_tasks
from .specialize import _prim_funcs, _schedules_fingerprint, _target_json, specialize_batch, tuning_key

DEFAULT_TRIALS = 64
"""Candidates measured per tuned module when ``trials`` is not given."""


def _print(msg: str) -> None:
    print(msg, flush=True)


def tune(mod: tvm.IRModule, target: Any, *, batch: int, trials: int = DEFAULT_TRIALS,
         work_dir: str | os.PathLike | None = None, progress: bool | Callable[[str], Any] = True,
         plan: PlannedGraph | None = None, cost_model: str = "auto", builder: str = "pool",
         num_trials_per_iter: int | None = None, min_share: float = 0.03,
         search_ops: Sequence[str] | None = SEARCH_OPS, seed: int = 0,
         label: str | None = None, remote: Any = None) -> TuneResult:
    """Tune ``mod`` (symbolic batch) for ``batch`` with MetaSchedule; reuse a previous run's database.

    Parameters
    ----------
    mod
        A Relax IRModule whose ``main``'s first parameter has a (symbolic) batch dimension:
        ``net.mod`` of a PFP network, or any module (e.g. from TVM's torch frontend).
    target
        What :func:`pyro2pfp.runtime.targets.make_target` accepts; ``num-cores`` is
        added if missing (:func:`tuning_target`).
    batch
        The batch size the result is specialised to.
    trials
        Candidates measured in total over all tuned kernels (MetaSchedule's
        ``max_trials_global``).  ``0``: no search, only the default schedules (and naive
        kernels for ops without one).
    work_dir
        Cache root; the run uses ``<work_dir>/<tuning_key>/``.  Default
        :func:`default_cache_dir` (``$PYRO2PFP_CACHE/tuning`` or ``~/.cache/pyro2pfp/tuning``).
    progress
        True prints one line per measured batch of candidates; a callable receives
        the lines; False is silent.
    plan
        The network's ``PlannedGraph`` (``net.plan``), to find each kernel's default
        schedule by layer; without it the schedules read only the PrimFuncs (``pfp.op`` attribute).
    cost_model
        ``"auto"`` (xgb if xgboost is installed, else random), ``"xgb"``, ``"random"``.
    builder
        Where candidates are compiled: ``"pool"`` (default: a persistent pool of worker
        processes, parallel, killed after :data:`~pyro2pfp.backends.tvm.tuning.measure.BUILD_TIMEOUT_SEC`),
        ``"inprocess"`` (this process: no start-up cost, but no timeout), ``"local"``
        (MetaSchedule's own ``LocalBuilder``/``LocalRunner``, new workers per round: slowest,
        fully isolated).
        Candidates are timed in this process except with ``"local"``.
    num_trials_per_iter
        Candidates per search round of one task (default: from the budget).
    min_share
        Kernels with a default schedule are searched only if they take at least this
        fraction of the default-scheduled kernels' time (the others keep their default schedule);
        kernels without one are always searched.
    search_ops
        PFP ops whose kernels are searched (default :data:`SEARCH_OPS`: dense and
        conv2d); the other PFP kernels keep the best of their default schedules.  ``None``:
        search every kernel.  Kernels that are not PFP kernels are always searched.
    seed
        Search seed.
    label
        Prefix of the progress lines.
    remote
        Measure on boards through TVM RPC instead of this machine: ``"tracker:9190/key"``,
        ``"server:9090"`` or a :class:`pyro2pfp.runtime.remote.Remote`.  Candidates are built here and
        timed on the boards by MetaSchedule's ``RPCRunner`` (``remote.parallel`` boards at a
        time); the per-kernel choice is timed and checked on a board too.  The database is
        keyed by the board (tracker key) as well as the target.

    Returns
    -------
    TuneResult
        A :class:`TuneResult`; ``result.build()`` compiles it.
    """
    check_environment()
    t_start = time.perf_counter()
    trials = _checked_budget(builder, trials)
    out = (progress if callable(progress) else _print) if progress else (lambda _msg: None)
    tgt = tuning_target(target)
    remote, board = _measuring_remote(remote, builder, tgt)
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
            # kernels worth searching: by their time with the default schedule (naive if none)
            todo = _tasks_worth_searching(static, tgt, defaults, remote, min_share, search_ops)
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

    result_mod, kernels = _chosen_module(static, funcs, choices, tuned, defaults, any_batch)
    result = TuneResult(mod=result_mod, target=tgt, batch=int(batch), key=key, work_dir=directory,
                        database=database, trials=int(meta["trials"]),
                        seconds=time.perf_counter() - t_start, reused=not tuned_now, kernels=kernels)
    if progress:
        out(_summary_line(result, tuned_now, label))
    return result



def _checked_budget(builder: str, trials: int) -> int:
    """``trials`` as an int, after checking it and ``builder``."""
    if builder not in BUILDERS:
        raise ArgumentError(f"builder must be one of {BUILDERS}, got {builder!r}")
    trials = int(trials)
    if trials < 0:
        raise ArgumentError(f"trials must be >= 0, got {trials}")
    return trials


def _summary_line(result: TuneResult, tuned_now: bool, label: str) -> str:
    """The progress line that ends a run: what was done, how long it took, how many kernels are tuned."""
    n_tuned = sum(k.choice == "tuned" for k in result.kernels)
    how = ("tuned" if tuned_now else "no search (trials=0)" if result.trials == 0
           else f"reused the database ({result.trials} trials)")
    return f"[{label}] {how}, {result.seconds:.1f} s: {n_tuned}/{len(result.kernels)} kernels use a tuned schedule"

def _measuring_remote(remote: Any, builder: str, tgt: Any) -> tuple[Any, str | None]:
    """``(remote, board)``: the boards candidates are timed on (a :class:`pyro2pfp.runtime.remote.Remote`,
    checked to have a server) and their tag -- ``(None, None)`` for this machine, checked to run ``tgt``."""
    if remote is None:
        _check_runs_here(tgt)
        return None, None
    remote = as_remote(remote)
    remote.servers()  # no server under the key: a clear error now, not a queue that never ends
    if builder != "pool":
        raise TuningError(f"tuning on {remote.address} needs builder='pool' (libraries written to disk "
                          f"for upload), got {builder!r}")
    return remote, remote.tag


def _tasks_worth_searching(static: tvm.IRModule, tgt: Any, defaults: dict[str, Any], remote: Any,
                           min_share: float, search_ops: Sequence[str] | None) -> list[Any]:
    """The tasks :func:`_select_tasks` picks by each kernel's time with its default schedule (naive if none)."""
    _fast_inspect.preimport_tensor_intrin()  # TuneContext imports it: seconds instead of minutes
    run = _BatchRunner(list(defaults.values()), tgt, remote)
    try:
        base_us = {name: _seconds(run(f, _kernel_inputs(f))) * 1e6 for name, f in defaults.items()}
    finally:
        run.close()  # its RPC session must not hold the board during the search (one board: a deadlock)
    return _select_tasks(static, tgt, base_us, min_share, search_ops)


def _chosen_module(static: tvm.IRModule, funcs: dict[str, Any], choices: dict[str, Any], tuned: dict[str, Any],
                   defaults: dict[str, Any], any_batch: dict[str, Any]) -> tuple[tvm.IRModule, list[KernelChoice]]:
    """``static`` with every kernel replaced by its chosen version, and the choices, slowest kernel first."""
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
    return result_mod, kernels


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
        raise ArgumentError(f"tune batch sizes must be positive ints, got {batches!r}")
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
                        "pyro2pfp.runtime.remote.validate)")
    spec = parse_tune_spec(tune)
    spec["batch"] = list(spec.pop("batches"))
    spec["remote"] = remote
    return spec


def tune_network(net: ConvertedNetwork, target: Any, spec: Any) -> dict[int, Any]:
    """Tune ``net`` (a :class:`~pyro2pfp.network.PFPNetwork`) for each batch of ``spec`` (what
    ``compile(tune=...)`` takes, see :func:`parse_tune_spec`) and build them:
    ``{batch: VM executable specialised to that batch}``."""
    options = parse_tune_spec(spec)
    batches = options.pop("batches", ())
    return {batch: tune(net.mod, target, batch=batch, plan=net.plan, **options).build()
            for batch in batches}
