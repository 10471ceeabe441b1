"""Cost of sharing one compiled predictor between threads (prints a table; no assertions).

    .venv/bin/python benchmarks/threads.py

Each thread gets its own Relax VMs and input tensors on its first call (pyro2pfp.tvm_backend.runtime):
this measures that first call, the per-call time single-threaded, and the throughput of 1, 2 and 4
Python threads sharing one predictor (MLP 784-100-10, batch 1; TVM threads per call as configured).
"""
from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from builders import mlp_graph  # noqa: E402

from pyro2pfp.network import PFPNetwork  # noqa: E402
from pyro2pfp.plan import plan  # noqa: E402


def main() -> None:
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
    print(f"{'threads':>7}  {'calls/s':>9}  {'us per call (wall / calls)':>27}")
    for n in (1, 2, 4):
        def work() -> None:
            for _ in range(calls // n):
                exe(x)

        pool = [threading.Thread(target=work) for _ in range(n)]
        t0 = time.perf_counter()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        wall = time.perf_counter() - t0
        done = n * (calls // n)
        print(f"{n:>7}  {done / wall:>9.0f}  {1e6 * wall / done:>27.1f}")


if __name__ == "__main__":
    main()
