"""Score input shards on Ray Data, one Parquet file per shard: what ``pyro2pfp score`` runs.

>>> from pyro2pfp.runtime.ray_scoring import score_files
>>> report = score_files(["net.so"], ["pool/"], "scored/", metrics=True)   # a local Ray instance
>>> report.written, report.skipped, report.failed

The pipeline: the driver plans the shards from their headers (:mod:`pyro2pfp.runtime.shards`) and cuts them
into chunks of rows; Ray Data reads every chunk in a task on the driver's node (so only that machine
needs the input files), scores it in a pool of :class:`~pyro2pfp.runtime.scoring.Scorer` actors (each loads
the network once; the library's files travel to the workers as :class:`~pyro2pfp.runtime.scoring.ModelFiles`),
and streams the outputs back in order; the driver writes each shard's rows to
``OUT/<shard>.parquet`` when the shard is complete (atomically: a file there is always whole).

* **Resumable**: a shard whose output file exists is skipped.
* **Exactly once**: Ray restarts a worker that dies and runs its batch again; the driver checks that
  every shard's rows arrive once, in order (a gap or a repeat is an :class:`~pyro2pfp.errors.InternalError`,
  never a wrong file).
* **A bad shard** (unreadable, or inputs of the wrong shape, NaN, ...) is reported by name
  (``report.failed``) and the others complete: the run starts again without it, skipping the
  shards already written.
* **Sizing**: one worker per CPU of the cluster, each with one TVM thread and :func:`actor_cpus` of a
  logical CPU, so that every node keeps :data:`RESERVED_CPUS` for Ray Data's own tasks (reading,
  :data:`READ_CPUS` each): actors holding whole CPUs would leave the read tasks none and the run would
  never finish.
"""
from __future__ import annotations

import gc
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import errors
from ..errors import InternalError, PFPError
from .scoring import ModelFiles, Scorer
from .shards import ROW, Shard, ShardError, expand_inputs, output_path, plan_chunks, plan_shard, read_rows, write_scored
from .tvm_runtime import available_cpus

__all__ = ["READ_CPUS", "RESERVED_CPUS", "ScoreReport", "actor_cpus", "score_files"]

READ_CPUS = 0.25
"""Logical CPUs of a read task (reading a chunk is a copy from the page cache, not computation)."""
RESERVED_CPUS = 0.5
"""Logical CPUs every node keeps free of scoring actors, for Ray Data's read tasks."""
SHARD = "shard"
"""The column naming each row's shard (its index in the plan) between the reader and the driver."""


@dataclass
class ScoreReport:
    """What :func:`score_files` did: output files written, shards skipped (their output existed), shards
    that failed (``{input path: message}``), rows scored, and the wall time of the scoring."""

    written: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    rows: int = 0
    seconds: float = 0.0
    workers: int = 0
    cpus_per_worker: float = 0.0


def actor_cpus(node_cpus: Sequence[float]) -> float:
    """Logical CPUs per scoring actor: ``1 − RESERVED_CPUS / c``, ``c`` the smallest node's CPU count, so
    that a node full of actors (one per CPU) still has :data:`RESERVED_CPUS` for read tasks (at least 0.1)."""
    smallest = min((c for c in node_cpus if c > 0), default=1.0)
    return max(0.1, round(1.0 - RESERVED_CPUS / smallest, 4))


def _read_chunk(batch: dict[str, np.ndarray], shards: list[Shard]) -> dict[str, np.ndarray]:
    """Ray Data read task: one chunk ``{"shard", "start", "stop"}`` → its rows
    (:func:`~pyro2pfp.runtime.shards.read_rows`)."""
    shard_id, start, stop = (int(batch[k][0]) for k in (SHARD, "start", "stop"))
    return read_rows(shards[shard_id], start, stop, shard_id)


def _progress_printer(total: int, interactive: bool) -> Callable[[int, int, bool], None]:
    start = time.perf_counter()
    last = [start, -1.0]  # time and row count of the last line

    def show(done: int, shards_done: int, final: bool = False) -> None:
        now = time.perf_counter()
        if (not final and now - last[0] < (2.0 if interactive else 5.0)) or done == last[1]:
            return
        last[0], last[1] = now, done
        rate = done / max(now - start, 1e-9)
        print(f"scored {done:,}/{total:,} rows, {shards_done} shard(s) written, {rate:,.0f} rows/s",
              file=sys.stderr, flush=True)

    return show


def score_files(models: Sequence[str | os.PathLike | ModelFiles], inputs: Sequence[str], output_dir: str, *,
                workers: int | None = None, cpus_per_worker: float | None = None, batch_size: int = 256,
                rows_per_block: int | None = None, column: str | None = None, metrics: bool = False,
                num_samples: int = 100, seed: int = 0, ray_address: str | None = None,
                progress: bool = True, scorer: type[Scorer] = Scorer,
                scorer_kwargs: dict[str, Any] | None = None) -> ScoreReport:
    """Score every row of ``inputs`` (files or directories of ``.npy``/``.npz``/Parquet shards) with the
    first of ``models`` each worker can run, writing ``output_dir/<shard>.parquet`` per shard: the
    shard's ``row`` index, its passed-through id columns, ``mean``, ``var`` and, with ``metrics``, the
    uncertainty columns (see :class:`~pyro2pfp.runtime.scoring.Scorer`).

    ``ray_address``: an existing cluster (``"auto"``, ``"HOST:PORT"``); default: the Ray instance this
    process is connected to, else a local one with this machine's CPUs (shut down at the end).
    ``workers``: scoring actors (default one per CPU of the cluster); ``cpus_per_worker``: logical CPUs
    each (default :func:`actor_cpus`); ``batch_size``: rows per call of the network;
    ``rows_per_block``: rows per read task and object-store block (default ``16 * batch_size``, fewer if
    that gives a worker less than two blocks).
    ``scorer``: the actor class (a subclass of :class:`~pyro2pfp.runtime.scoring.Scorer`), ``scorer_kwargs``:
    more of its keyword arguments.
    """
    import ray

    if batch_size < 1:
        raise PFPError(f"batch_size must be >= 1, got {batch_size}")
    os.makedirs(output_dir, exist_ok=True)
    report = ScoreReport()
    shards, outputs = _plan(expand_inputs(inputs), output_dir, column, report)
    bundles = [m if isinstance(m, ModelFiles) else ModelFiles.read(m) for m in models]
    if not bundles:
        raise PFPError("score_files: no model given")
    if bundles[0].metadata().get("input_variance"):
        raise PFPError(f"{bundles[0].name} takes an input variance besides its inputs; pyro2pfp score reads the "
                       "inputs only: run pyro2pfp.runtime.scoring.Scorer in your own Ray Data pipeline, with an "
                       "'x_var' column")
    input_shape = bundles[0].input_shape()
    for shard in shards:
        if input_shape is not None and (why := shard.mismatch(input_shape)):
            report.failed[shard.path] = f"{shard.path}: {why}"
    started = False
    if not ray.is_initialized():
        kwargs: dict[str, Any] = ({"address": ray_address} if ray_address
                                  else {"address": "local", "num_cpus": len(available_cpus())})
        ray.init(include_dashboard=False, configure_logging=True, logging_level=logging.WARNING, **kwargs)
        started = True
    try:
        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True
        ctx.raise_original_map_exception = True  # a worker's PFPError reaches the driver as it was raised
        ctx.enable_progress_bars = bool(progress) and sys.stderr.isatty()
        nodes = [n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")]
        report.workers = workers or max(1, int(sum(nodes)))
        report.cpus_per_worker = cpus_per_worker or actor_cpus(nodes)
        kwargs = {"metrics": metrics, "num_samples": num_samples, "seed": seed, "id_columns": [SHARD, ROW],
                  "num_threads": max(1, int(report.cpus_per_worker + 0.5)), **(scorer_kwargs or {})}
        pending = [i for i, s in enumerate(shards) if s.path not in report.failed]
        if rows_per_block is None:  # 16 batches, or fewer so that every worker gets two blocks
            per_worker = -(-sum(shards[i].rows for i in pending) // (2 * report.workers * batch_size))
            rows_per_block = batch_size * max(1, min(16, per_worker))
        t0 = time.perf_counter()
        while pending:
            try:
                _run(ray, shards, outputs, pending, bundles, kwargs, scorer, report, batch_size, rows_per_block,
                     progress)
                break
            except Exception as exc:  # noqa: BLE001 -- Ray wraps the workers' errors
                path, message = _failed_shard(exc, shards)
                if path is None or path not in {shards[i].path for i in pending}:
                    original = _original(exc, PFPError) or _quoted_error(exc)
                    if original is not None and original is not exc:
                        raise original from None  # a worker's error about no one shard (the models, ...)
                    raise
                report.failed[path] = message
                pending = [i for i in pending if shards[i].path not in report.failed
                           and outputs[i] not in report.written]
        report.seconds = time.perf_counter() - t0
    finally:
        if started:
            ray.shutdown()
    return report


def _plan(files: list[str], output_dir: str, column: str | None, report: ScoreReport) -> tuple[list[Shard], list[str]]:
    """The shards to score (every file's header read; a bad one goes to ``report.failed``) and their
    output paths; shards whose output exists go to ``report.skipped``."""
    outputs: dict[str, str] = {}
    shards, paths = [], []
    for file in files:
        out = output_path(output_dir, file)
        if out in outputs:
            raise PFPError(f"inputs {outputs[out]} and {file} would both be written to {out}: rename one")
        outputs[out] = file
        if os.path.exists(out):
            report.skipped.append(out)
            continue
        try:
            shards.append(plan_shard(file, column))
        except ShardError as exc:
            report.failed[file] = str(exc)
            continue
        paths.append(out)
    return shards, paths


def _run(ray: Any, shards: list[Shard], outputs: list[str], pending: list[int], bundles: list[ModelFiles],
         kwargs: dict[str, Any], scorer: type[Scorer], report: ScoreReport, batch_size: int, rows_per_block: int,
         progress: bool) -> None:
    """One pass of the pipeline over the ``pending`` shards."""
    chunks = [{SHARD: i, "start": a, "stop": b} for i in pending for a, b in plan_chunks(shards[i], rows_per_block)]
    for i in pending:
        if shards[i].rows == 0:
            write_scored(outputs[i], {ROW: np.zeros(0, np.int64)})
            report.written.append(outputs[i])
    if not chunks:
        return
    _wait_for_cpus(ray, report.workers * report.cpus_per_worker + READ_CPUS)
    here = {"ray.io/node-id": ray.get_runtime_context().get_node_id()}  # the driver's node (its files)
    ds = ray.data.from_items(chunks, override_num_blocks=len(chunks))
    ds = ds.map_batches(_read_chunk, batch_size=1, fn_kwargs={"shards": shards}, num_cpus=READ_CPUS,
                        label_selector=here)
    ds = ds.map_batches(scorer, fn_constructor_args=(bundles,), fn_constructor_kwargs=kwargs,
                        compute=ray.data.ActorPoolStrategy(size=report.workers), num_cpus=report.cpus_per_worker,
                        batch_size=batch_size, batch_format="numpy")
    total = sum(shards[i].rows for i in pending)
    show = _progress_printer(total, sys.stderr.isatty()) if progress else None
    parts: dict[int, list[dict[str, np.ndarray]]] = {}
    next_row: dict[int, int] = {}
    done = 0
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
        for shard_id in np.unique(batch[SHARD]):
            rows = batch[SHARD] == shard_id
            part = {k: v[rows] for k, v in batch.items() if k != SHARD}
            i, first = int(shard_id), int(part[ROW][0])
            expected = next_row.get(i, 0)
            if first != expected or not np.array_equal(part[ROW], np.arange(first, first + len(part[ROW]))):
                raise InternalError(f"{shards[i].path}: rows arrived out of order or twice (row {first} after "
                                    f"{expected - 1}); nothing was written for this shard. Please report it")
            parts.setdefault(i, []).append(part)
            next_row[i] = first + len(part[ROW])
            done += len(part[ROW])
            if next_row[i] == shards[i].rows:
                pieces = parts.pop(i)
                write_scored(outputs[i], {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]})
                report.written.append(outputs[i])
                if progress:
                    print(f"wrote {outputs[i]} ({shards[i].rows:,} rows)", file=sys.stderr, flush=True)
        report.rows = done
        if show:
            show(done, len(report.written), False)
    if show:
        show(done, len(report.written), True)
    incomplete = [shards[i].path for i in pending if shards[i].rows and outputs[i] not in report.written]
    if incomplete:
        raise InternalError(f"the run ended before every row of {incomplete} was scored; nothing was written "
                            "for them. Please report it")


def _wait_for_cpus(ray: Any, cpus: float, timeout: float = 120.0) -> None:
    """Wait (at most ``timeout`` seconds) until the cluster has ``cpus`` logical CPUs free: after a failed
    pass, Ray Data lets the pass's actors go when the last reference to them does, and a new pool started
    while they hold their CPUs would wait for ever for its actors (an exception's traceback can hold
    those references in a cycle that only the garbage collector breaks)."""
    gc.collect()
    deadline = time.monotonic() + timeout
    while ray.available_resources().get("CPU", 0.0) + 1e-6 < min(cpus, ray.cluster_resources().get("CPU", 0.0)):
        if time.monotonic() > deadline:
            return  # other jobs hold the CPUs: the pool starts when they free them
        time.sleep(0.5)


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it wraps, the originals first where Ray wrapped one: a
    ``RayTaskError``'s ``cause`` (its own text holds the remote traceback), ``__cause__``, ``__context__``."""
    seen: set[int] = set()
    out: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        cause = getattr(e, "cause", None)
        if isinstance(cause, BaseException):
            todo.append(cause)
            continue
        out.append(e)
        todo.extend([e.__context__, e.__cause__])
    return out


def _original(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first exception of type ``kind`` in :func:`_chain`, or ``None``."""
    return next((e for e in _chain(exc) if isinstance(e, kind)), None)


_QUOTED = re.compile(r"pyro2pfp\.errors\.(\w+): (.+)")


def _quoted_error(exc: BaseException) -> PFPError | None:
    """The last pyro2pfp error quoted in the text of ``exc``'s chain: Ray passes an exception raised in
    an actor's ``__init__`` (a worker that can run none of the models) on as text only
    (``ActorDiedError``)."""
    for e in _chain(exc):
        found = _QUOTED.findall(str(e))
        if found:
            name, message = found[-1]
            kind = getattr(errors, name, None)
            kind = kind if isinstance(kind, type) and issubclass(kind, PFPError) else PFPError
            return kind(message.strip())
    return None


def _failed_shard(exc: BaseException, shards: list[Shard]) -> tuple[str | None, str]:
    """The input shard an error of the pipeline is about and the message for it, or ``(None, "")``: a
    :class:`~pyro2pfp.runtime.shards.ShardError`, or a scorer's error naming rows of a shard (the shard of its
    first non-finite row when a batch spans two)."""
    for e in _chain(exc):
        if isinstance(e, ShardError):
            return e.shard, str(e)
        rows = getattr(e, "rows", None)
        if isinstance(e, PFPError) and isinstance(rows, dict) and SHARD in rows:
            first_bad = getattr(e, "first_bad", None) or {}
            path = shards[int(first_bad.get(SHARD, rows[SHARD][0]))].path
            return path, f"{path}: {e}"
    return None, ""
