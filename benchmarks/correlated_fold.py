"""The correlated Clark fold of LeNet-5's pools (``max_pool2d`` with ``window_cov`` covariances, the
default plan) scheduled as one loop nest against one elementwise nest per fold stage
(``backends/tvm/ops/pooling.py``, ``CORRELATED_ONE_NEST``), timed in the same process, alternately.

Both modules are built from the same emitted LeNet-5 (``benchmarks/latency.py``'s, untrained guide);
each round profiles both (``pyro2pfp.runtime.profiling.profile``: every kernel timed alone, C++ timing loop), so
load changes hit both alike; the table gives each pool kernel's median over the rounds and their ratio.
The outputs of the two are checked to be bitwise equal.

    PYTHONPATH=. .venv/bin/python benchmarks/correlated_fold.py [--batch 10] [--rounds 6] [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("TVM_BIND_THREADS", "0")
    warnings.simplefilter("ignore")
    import numpy as np
    import pyro
    import torch
    import tvm
    from tvm import relax

    import pyro2pfp
    from pyro2pfp.backends.tvm.build import build
    from pyro2pfp.backends.tvm.ops import pooling
    from pyro2pfp.backends.tvm.schedules import schedule_module
    from pyro2pfp.backends.tvm.sharing import share_identical_kernels
    from pyro2pfp.runtime.profiling import profile
    from pyro2pfp.runtime.targets import resolve_target

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import latency

    pyro.clear_param_store()
    model, guide, _, shape = latency.build_models("lenet")
    guide(torch.zeros(2, *shape), torch.zeros(2, dtype=torch.long))
    net = pyro2pfp.convert(model, guide, input_shape=shape)
    target = resolve_target("native")
    x = np.random.default_rng(0).uniform(0, 1, (args.batch, *shape)).astype(np.float32)
    vms = {}
    for one_nest in (False, True):
        pooling.CORRELATED_ONE_NEST.append(one_nest)
        try:
            mod = schedule_module(share_identical_kernels(net.mod), net.plan, target)
        finally:
            pooling.CORRELATED_ONE_NEST.pop()
        vms[one_nest] = relax.VirtualMachine(build(mod, target), tvm.cpu())
    outs = {k: [t.numpy() for t in vm["main"](tvm.runtime.tensor(x))] for k, vm in vms.items()}
    for a, b in zip(outs[False], outs[True]):
        assert np.array_equal(a, b), "the two schedules disagree"
    times: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for _ in range(args.rounds):
        for one_nest, vm in vms.items():
            prof = profile(vm, [x], repeats=10)
            times[one_nest].append({r.name: r.us for r in prof.kernels if r.op == "max_pool2d"})
    print(f"LeNet-5, batch {args.batch}, {args.threads} thread(s), {args.rounds} rounds, load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'kernel':<40} {'per-stage us':>12} {'one nest us':>12} {'ratio':>6}")
    for name in times[True][0]:
        old = float(np.median([t[name] for t in times[False]]))
        new = float(np.median([t[name] for t in times[True]]))
        print(f"{name:<40} {old:>12.1f} {new:>12.1f} {old / new:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
