"""Dump the default-scheduled TIR of reference networks (MLP, LeNet-5, max/avg pooling) to a file, to
compare the compiled kernels of two checkouts byte for byte (e.g. before/after a refactoring):

    python benchmarks/dump_tir.py /path/to/checkout-A a.txt
    python benchmarks/dump_tir.py /path/to/checkout-B b.txt && diff a.txt b.txt

The target is fixed (LLVM, skylake-avx512) so the output does not depend on the machine.
"""
from __future__ import annotations

import sys

import numpy as np


def main(checkout: str, out_path: str) -> None:
    sys.path.insert(0, checkout)
    try:
        from tests.support import builders
    except ImportError:  # a checkout from before the tests became a package
        sys.path.insert(0, checkout + "/tests")
        import builders  # type: ignore[no-redef]
    import tvm

    import pyro2pfp
    from pyro2pfp.backends.tvm import emit_module
    from pyro2pfp.backends.tvm.schedules import schedule_module
    from pyro2pfp.planning.plan import plan

    cases = {"mlp": lambda: builders.mlp_graph(np.random.default_rng(0), [784, 100, 10]),
             "lenet": lambda: builders.lenet_graph(np.random.default_rng(1)),
             "pool_max": lambda: builders.pool_graph("max", (3, 2, 1, True, 7, 8), True, True),
             "pool_avg": lambda: builders.pool_graph("avg", (3, 2, 1, False, 7, 8), False, False)}
    target = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})
    out = []
    for name, make in cases.items():
        graph = make()
        graph = graph[0] if isinstance(graph, tuple) else graph
        planned = plan(graph)
        out.append(f"### {name}\n{schedule_module(emit_module(planned), planned, target).script()}")
    with open(out_path, "w") as f:
        f.write("\n".join(out))
    print(f"{pyro2pfp.__file__}: {len(out)} networks -> {out_path}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
