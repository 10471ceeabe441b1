"""Cost of sharing one compiled predictor between threads (prints a table; no assertions).

    .venv/bin/python benchmarks/threads.py

Each thread gets its own Relax VMs and input tensors on its first call (pyro2pfp.backends.tvm.runtime):
this measures that first call, the per-call time single-threaded, and the throughput of 1, 2 and 4
Python threads sharing one predictor (MLP 784-100-10, batch 1; TVM threads per call as configured),
calling it concurrently and with the calls serialised by a lock (the alternative design: one VM
behind a lock).  Every Python thread that launches TVM kernels gets its own TVM worker pool, so
more Python threads than cores oversubscribe the machine; the table shows what that costs here.
"""
from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from pyro2pfp.network import PFPNetwork  # noqa: E402
from pyro2pfp.planning.plan import plan  # noqa: E402
from tests.support.builders import mlp_graph  # noqa: E402


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def memory_per_thread(threads: int = 8) -> None:
    """Resident memory added by the per-thread VMs of a predictor with ~43 MB of weights."""
    sizes = [784, 2000, 2000, 10]
    graph = mlp_graph(np.random.default_rng(0), sizes)
    exe = PFPNetwork(graph, plan(graph, 1.0, "variance")).compile()
    x = np.zeros((1, 784), np.float32)
    exe(x)
    before = _rss_mb()
    barrier = threading.Barrier(threads + 1)

    def first_call() -> None:
        exe(x)
        barrier.wait()  # all threads (and their VMs) alive when memory is read

    pool = [threading.Thread(target=first_call) for _ in range(threads)]
    for t in pool:
        t.start()
    barrier.wait()
    after = _rss_mb()
    for t in pool:
        t.join()
    weights = sum(a * b for a, b in zip(sizes[:-1], sizes[1:])) * 2 * 4 / 2**20
    print(f"memory: MLP {'-'.join(map(str, sizes))} ({weights:.0f} MB of float32 weight means and variances): "
          f"+{(after - before) / threads:.1f} MB resident per extra thread ({threads} threads)")


def main() -> None:
    memory_per_thread()
    graph = mlp_graph(np.random.default_rng(0), [784, 100, 10])
    exe = PFPNetwork(graph, plan(graph, 1.0, "variance")).compile()
    x = np.random.default_rng(1).random((1, 784), dtype=np.float32)
    for _ in range(200):
        exe(x)
    calls = 3000
    t0 = time.perf_counter()
    for _ in range(calls):
        exe(x)
    single = (time.perf_counter() - t0) / calls

    first: list[float] = []

    def first_call() -> None:
        t = time.perf_counter()
        exe(x)
        first.append(time.perf_counter() - t)

    worker = threading.Thread(target=first_call)
    worker.start()
    worker.join()
    print(f"single thread: {1e6 * single:.1f} us per call; first call in a new thread: {1e3 * first[0]:.2f} ms")
    lock = threading.Lock()

    def serialised(xs: np.ndarray) -> None:
        with lock:
            exe(xs)

    print(f"{'threads':>7}  {'calls/s, concurrent':>19}  {'calls/s, serialised by a lock':>29}")
    for n in (1, 2, 4):
        rates = []
        for call in (exe, serialised):
            def work(call=call, n=n) -> None:
                for _ in range(calls // n):
                    call(x)

            pool = [threading.Thread(target=work) for _ in range(n)]
            t0 = time.perf_counter()
            for t in pool:
                t.start()
            for t in pool:
                t.join()
            rates.append(n * (calls // n) / (time.perf_counter() - t0))
        print(f"{n:>7}  {rates[0]:>19.0f}  {rates[1]:>29.0f}")

if __name__ == "__main__":
    main()
