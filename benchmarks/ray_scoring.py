"""Scoring on Ray Data against the single-process loop: rows/s for 1 and 2 workers, Ray's per-row
overhead, and the two ways of leaving CPUs to Ray Data's own tasks (prints tables; no assertions).

    PYTHONPATH=. .venv/bin/python benchmarks/ray_scoring.py [--rows 40000] [--repeat 3] \\
        [--markdown docs/generated/ray-scoring.md]

LeNet-5 converted from Pyro (an untrained posterior: throughput does not depend on the weights' values),
compiled for ``--target`` and exported; ``--rows`` MNIST digits (repeated).  On one local Ray instance
with this machine's CPUs (``ray.init(num_cpus=os.cpu_count())``, started once, not timed):

* ``loop``: ``exe(x[i:i + batch])`` over the rows in this process, with 1 TVM thread (what one worker
  does) and with one thread per core (a user's loop on this machine);
* ``Ray Data, N workers``: ``ray.data.from_numpy`` blocks of 16 batches (in the object store before
  the clock starts) → ``map_batches(Scorer, compute=ActorPoolStrategy(size=N), num_cpus=actor_cpus,
  batch_size=batch)`` → ``iter_batches`` in order, as ``pyro2pfp score`` runs it; timed on ``--rows``
  and on half as many.  *Wall* rows/s is ``--rows`` over the whole run (the workers' start-up and
  the network's load included); *marginal* rows/s is what the second half of the rows adds,
  ``(rows / 2) / (t(rows) − t(rows / 2))``: the rate of a long run, without the fixed start-up
  ``t(rows) − rows / marginal``;
* ``pyro2pfp score``: :func:`pyro2pfp.runtime.ray_scoring.score_files` on ``.npy`` shards on disk, Parquet
  files out (reading, writing and the order check included), with the default sizing (one worker per
  CPU, :func:`~pyro2pfp.runtime.ray_scoring.actor_cpus` each) and with a CPU reserved instead (one worker fewer,
  1 CPU each).

Ray's overhead at 1 worker is ``loop (1 thread) / Ray (1 worker, marginal) − 1``, and per row
``1 / Ray − 1 / loop``.  The machine must be quiet for these rates to mean anything: the header states
the load average.  The *CPU µs per row* depend much less on the load: the CPU time (user + system, all
threads) the workers spent from the end of their start-up to their last batch (each worker reports its
own ``time.process_time()`` with every batch), plus this process's (the driver: Ray Data's executor,
ordering, collecting), over the rows -- Ray's own processes (raylet, GCS) left out.  Their ratio to the
loop's is Ray's overhead in CPU time, a figure that holds under load.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from pyro2pfp.runtime.scoring import Scorer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from markdown_report import add_markdown_argument, table, write_markdown  # noqa: E402


class TimedScorer(Scorer):
    """The scorer, adding to every batch its worker's pid and the CPU time it has spent since its start-up
    ended (defined in the script run as ``__main__``, so cloudpickle ships it to the workers by value)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cpu0 = time.process_time()

    def __call__(self, batch):
        out = super().__call__(batch)
        rows = len(out["mean"])
        out["pid"] = np.full(rows, os.getpid(), dtype=np.int64)
        out["cpu"] = np.full(rows, time.process_time() - self.cpu0)
        return out


def workers_cpu(pids: np.ndarray, cpu: np.ndarray) -> float:
    """Seconds of CPU all workers spent scoring: each worker's last report, summed."""
    return float(sum(cpu[pids == pid].max() for pid in np.unique(pids)))


def export_lenet(directory: str, target: str) -> str:
    import pyro
    import torch

    import pyro2pfp
    from pyro2pfp_experiments.zoo import BayesianLeNet5, make_guide

    pyro.clear_param_store()
    model = BayesianLeNet5()
    guide = make_guide(model, init_scale=0.05)
    guide(torch.zeros(2, 1, 28, 28), torch.zeros(2, dtype=torch.long))
    net = pyro2pfp.convert(model, guide, input_shape=(1, 28, 28), correlation="mean-field")
    path = os.path.join(directory, "lenet5.so")
    net.compile(target).export_library(path)
    return path


def digits(rows: int) -> np.ndarray:
    from pyro2pfp_experiments.datasets import load_mnist

    _, _, x, _ = load_mnist(n_train=0, n_test=1000)
    x = np.asarray(x, np.float32).reshape(-1, 1, 28, 28)
    return np.ascontiguousarray(np.resize(x, (rows, 1, 28, 28)))


def time_loop(path: str, x: np.ndarray, batch: int, threads: int) -> tuple[float, float]:
    """(rows/s, CPU s) of ``exe(x[i:i + batch])`` over ``x`` in this process with ``threads`` TVM threads."""
    import pyro2pfp

    exe = pyro2pfp.load(path)
    pyro2pfp.set_num_threads(threads)
    exe(x[:batch])
    c0, t0 = time.process_time(), time.perf_counter()
    for i in range(0, len(x), batch):
        exe(x[i:i + batch])
    return len(x) / (time.perf_counter() - t0), time.process_time() - c0


def time_ray(ray, path: str, blocks: list, batch: int, workers: int, cpus: float
             ) -> tuple[float, float, float, np.ndarray]:
    """(seconds, workers' CPU s, driver's CPU s, means) of the scorer on ``workers`` actors over ``blocks``."""
    ds = ray.data.from_numpy(blocks).map_batches(
        TimedScorer, fn_constructor_args=(path,), fn_constructor_kwargs={"column": "data", "num_threads": 1},
        compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=cpus, batch_size=batch, batch_format="numpy")
    c0, t0 = time.process_time(), time.perf_counter()
    outs = list(ds.iter_batches(batch_size=None, batch_format="numpy"))
    seconds, driver = time.perf_counter() - t0, time.process_time() - c0
    pids, cpu = (np.concatenate([o[k] for o in outs]) for k in ("pid", "cpu"))
    return seconds, workers_cpu(pids, cpu), driver, np.concatenate([o["mean"] for o in outs])


def time_score_files(path: str, shards: list[str], rows: int, batch: int, workers: int | None,
                     cpus: float | None) -> tuple[float, int, float, float]:
    """(rows/s, workers, CPUs per worker, CPU s per row of the workers and the driver) of ``score_files``
    on the shards, into a fresh directory."""
    import pyarrow.parquet as pq

    from pyro2pfp.runtime.ray_scoring import score_files

    c0 = time.process_time()
    with tempfile.TemporaryDirectory() as out:
        report = score_files([path], shards, out, workers=workers, cpus_per_worker=cpus, batch_size=batch,
                             progress=False, scorer=TimedScorer)
        driver = time.process_time() - c0
        tables = [pq.read_table(os.path.join(out, name), columns=["pid", "cpu"]) for name in os.listdir(out)]
    assert report.rows == rows and not report.failed, report
    pids, cpu = (np.concatenate([t.column(k).to_numpy() for t in tables]) for k in ("pid", "cpu"))
    return rows / report.seconds, report.workers, report.cpus_per_worker, (workers_cpu(pids, cpu) + driver) / rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=40_000, help="rows scored per run (default 40000)")
    parser.add_argument("--batch", type=int, default=256, help="rows per network call (default 256)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per configuration; medians (default 3)")
    parser.add_argument("--target", default="llvm", help="compile target (default llvm)")
    parser.add_argument("--shards", type=int, default=8, help=".npy shards for pyro2pfp score (default 8)")
    add_markdown_argument(parser)
    args = parser.parse_args()

    import ray

    from pyro2pfp.runtime.ray_scoring import actor_cpus
    from pyro2pfp.runtime.tvm_runtime import available_cpus

    cpus = len(available_cpus())
    load_before = os.getloadavg()[0]
    tmp = tempfile.mkdtemp(prefix="ray_scoring_")
    path = export_lenet(tmp, args.target)
    x = digits(args.rows)
    shard_rows = -(-args.rows // args.shards)
    shards = []
    for i in range(args.shards):
        shards.append(os.path.join(tmp, f"part{i:03d}.npy"))
        np.save(shards[-1], x[i * shard_rows:(i + 1) * shard_rows])
    block = 16 * args.batch
    blocks = [x[i:i + block] for i in range(0, len(x), block)]

    import pyro2pfp

    reference = pyro2pfp.load(path)(x[:2000])[0]
    loop_runs = {t: [time_loop(path, x, args.batch, t) for _ in range(args.repeat)] for t in sorted({1, cpus})}
    loop = {t: statistics.median(r[0] for r in runs) for t, runs in loop_runs.items()}
    loop_cpu = {t: statistics.median(r[1] for r in runs) / args.rows for t, runs in loop_runs.items()}
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, logging_level=logging.ERROR)
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    fraction = actor_cpus([cpus])
    half = blocks[: len(blocks) // 2]
    half_rows = sum(len(b) for b in half)
    times: dict[tuple[int, int], list[float]] = {}
    cpu_runs: dict[int, list[tuple[float, float]]] = {}
    for _ in range(args.repeat):
        for workers in sorted({1, 2, cpus}):
            for part in (blocks, half):
                seconds, worker_cpu, driver_cpu, means = time_ray(ray, path, part, args.batch, workers, fraction)
                np.testing.assert_array_equal(means[:2000], reference)  # the same numbers as in this process
                times.setdefault((workers, len(part)), []).append(seconds)
                if part is blocks:
                    cpu_runs.setdefault(workers, []).append((worker_cpu / args.rows, driver_cpu / args.rows))
    ray_rates = {}  # workers: (wall rows/s, marginal rows/s, start-up s, workers' CPU s per row, driver's)
    for workers in sorted({1, 2, cpus}):
        full, short = (statistics.median(times[(workers, len(p))]) for p in (blocks, half))
        marginal = (args.rows - half_rows) / max(full - short, 1e-9)
        ray_rates[workers] = (args.rows / full, marginal, full - args.rows / marginal,
                              statistics.median(r[0] for r in cpu_runs[workers]),
                              statistics.median(r[1] for r in cpu_runs[workers]))
    sizing = {}
    for name, workers, per in (("default: one worker per CPU, fractional CPUs", None, None),
                               ("a CPU reserved: one worker fewer, 1 CPU each", max(1, cpus - 1), 1.0)):
        results = [time_score_files(path, shards, args.rows, args.batch, workers, per) for _ in range(args.repeat)]
        sizing[name] = (statistics.median(r[0] for r in results), results[0][1], results[0][2],
                        statistics.median(r[3] for r in results))
    ray.shutdown()

    rows = [[f"loop, {t} TVM thread(s)", "-", f"{rate:,.0f}", f"{rate:,.0f}", "-", f"{1e6 / rate:.1f}",
             f"{1e6 * loop_cpu[t]:.1f}", "-"] for t, rate in loop.items()]
    rows += [[f"Ray Data, {w} worker(s)", f"{fraction:g}", f"{wall:,.0f}", f"{marginal:,.0f}", f"{startup:.1f}",
              f"{1e6 / marginal:.1f}", f"{1e6 * cpu:.1f}", f"{1e6 * driver:.1f}"]
             for w, (wall, marginal, startup, cpu, driver) in ray_rates.items()]
    lines = [table(["run", "CPUs per worker", "wall rows/s", "marginal rows/s", "start-up s", "µs per row",
                    "CPU µs per row (workers)", "CPU µs per row (driver)"], rows)]
    one, two = ray_rates[1][1], ray_rates.get(2, ray_rates[1])[1]
    overhead = loop[1] / one - 1
    per_row = 1e6 / one - 1e6 / loop[1]
    summary = (f"LeNet-5 ({args.target}), batch {args.batch}, {args.rows:,} rows, median of {args.repeat}. "
               f"2 workers / 1 worker (marginal rows/s): **{two / one:.2f}x**; Ray's overhead at 1 worker against "
               f"the 1-thread loop: **{overhead:+.0%}** ({per_row:+.1f} µs per row); 1 worker's wall rate against "
               f"the loop: {loop[1] / ray_rates[1][0] - 1:+.0%} (worker start-up included). CPU time per row at 1 "
               f"worker against the 1-thread loop: the worker {ray_rates[1][3] / loop_cpu[1] - 1:+.0%}, the worker "
               f"and the driver {(ray_rates[1][3] + ray_rates[1][4]) / loop_cpu[1] - 1:+.0%}.")
    load = max(load_before, os.getloadavg()[0])
    if load > 0.5 * cpus:  # other processes took CPU time from the runs
        summary += (f" **The machine was loaded** (load average up to {load:.1f} on {cpus} CPUs): other processes "
                    "took CPU time from the runs, so these figures do not measure the scorer; rerun on a quiet "
                    "machine.")
    sizing_rows = [[name, workers, f"{per:g}", f"{rate:,.0f}", f"{1e6 * cpu:.1f}"]
                   for name, (rate, workers, per, cpu) in sizing.items()]
    lines += [summary, "`pyro2pfp score` (.npy shards → Parquet, reading, writing and the order check included):",
              table(["actor sizing", "workers", "CPUs per worker", "rows/s", "CPU µs per row (workers + driver)"],
                    sizing_rows)]
    print("\n\n".join(lines))
    write_markdown(args.markdown, lines)


if __name__ == "__main__":
    main()
