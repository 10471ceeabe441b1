#!/usr/bin/env python
"""Check and time the default CPU schedules (``pyro2pfp.backends.tvm.schedules``).

Builds the paper's two PFP networks with random Gaussian weights (no Pyro, no training):

* MLP 784-100-10 (dense, relu, dense);
* LeNet-5: conv 5x5 pad 2 1->6 on 28x28, relu, maxpool 2, conv 5x5 6->16, relu, maxpool 2,
  flatten, dense 400->120, relu, 84, relu, 10;

compiles each unscheduled and scheduled for each target, checks that the scheduled module matches
the float64 NumPy reference (float32 tolerance) at every batch size, and prints the median latency
of one call (``vm.time_evaluator``: a C++ timing loop, no Python overhead) per batch size.

    python benchmarks/schedule_check.py                    # both nets, batches 1 10 100, both targets
    python benchmarks/schedule_check.py --nets mlp --batches 1 7 --profile

Runs with ``TVM_NUM_THREADS=2`` unless ``--threads`` says otherwise.  Exit status 1 if a scheduled
module does not match the reference.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TOLERANCE = 1e-4  # max |tvm - ref| / max |ref|, per output (mean, variance)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nets", nargs="+", default=["mlp", "lenet"], choices=["mlp", "lenet"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 10, 100])
    ap.add_argument("--targets", nargs="+", default=["native", "llvm"], choices=["native", "llvm"],
                    help="native: llvm with this CPU's mcpu and num-cores 2; llvm: generic x86-64")
    ap.add_argument("--threads", type=int, default=2, help="TVM_NUM_THREADS (default 2)")
    ap.add_argument("--repeat", type=int, default=7, help="timing repeats (the median is reported)")
    ap.add_argument("--min-repeat-ms", type=int, default=100, help="minimum duration of one repeat")
    ap.add_argument("--profile", action="store_true", help="also print per-kernel times (VM instrument)")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def build_graphs(seed: int):
    import numpy as np

    from pyro2pfp.planning.graph import INPUT, GaussianParam, Layer, LayerGraph

    rng = np.random.default_rng(seed)

    def gaussian(shape, fan_in):
        mean = rng.standard_normal(shape) / np.sqrt(fan_in)
        return GaussianParam(mean, rng.uniform(0.1, 1.0, shape) * 0.05 / fan_in)

    def dense(name, inp, k, m):
        return Layer(name, "dense", [inp], (m,), f"{name} (random)",
                     params={"weight": gaussian((m, k), k), "bias": gaussian((m,), 10)})

    def conv(name, inp, c, o, hw, pad):
        return Layer(name, "conv2d", [inp], (o, hw, hw), f"{name} (random)",
                     attrs={"stride": [1, 1], "padding": [pad, pad], "dilation": [1, 1], "groups": 1},
                     params={"weight": gaussian((o, c, 5, 5), c * 25), "bias": gaussian((o,), 10)})

    def relu(name, inp, shape):
        return Layer(name, "relu", [inp], shape, f"{name} (random)")

    def pool(name, inp, shape):
        return Layer(name, "max_pool2d", [inp], shape, f"{name} (random)",
                     attrs={"kernel": [2, 2], "stride": [2, 2], "padding": [0, 0], "dilation": [1, 1],
                            "ceil_mode": False})

    mlp = LayerGraph((784,), [dense("fc1", INPUT, 784, 100), relu("relu1", "fc1", (100,)),
                              dense("fc2", "relu1", 100, 10)], "fc2")
    lenet = LayerGraph((1, 28, 28), [
        conv("conv1", INPUT, 1, 6, 28, 2), relu("relu1", "conv1", (6, 28, 28)), pool("pool1", "relu1", (6, 14, 14)),
        conv("conv2", "pool1", 6, 16, 10, 0), relu("relu2", "conv2", (16, 10, 10)), pool("pool2", "relu2", (16, 5, 5)),
        Layer("flatten", "reshape", ["pool2"], (400,), "flatten (random)"),
        dense("fc1", "flatten", 400, 120), relu("relu3", "fc1", (120,)),
        dense("fc2", "relu3", 120, 84), relu("relu4", "fc2", (84,)),
        dense("fc3", "relu4", 84, 10),
    ], "fc3")
    return {"mlp": mlp, "lenet": lenet}


def main() -> int:
    args = parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    import numpy as np
    import tvm
    from tvm import relax
    from tvm.runtime.vm import VMInstrumentReturnKind

    from pyro2pfp.backends.reference import execute
    from pyro2pfp.backends.tvm import emit_module
    from pyro2pfp.backends.tvm.schedules import schedule_module
    from pyro2pfp.planning.plan import plan

    targets = {
        "native": tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu(),
                                     "num-cores": 2}),
        "llvm": tvm.target.Target("llvm"),
    }
    dev = tvm.cpu()
    graphs = build_graphs(args.seed)
    rng = np.random.default_rng(args.seed + 1)
    print(f"TVM {tvm.__version__}, TVM_NUM_THREADS={os.environ['TVM_NUM_THREADS']}, "
          f"cpu {tvm.target.codegen.llvm_get_system_cpu()}, load average {os.getloadavg()[0]:.1f}")

    rows, failures, profiles = [], [], []
    for net in args.nets:
        planned = plan(graphs[net])
        mod = emit_module(planned)
        inputs = {b: rng.uniform(0.0, 1.0, (b, *planned.input_shape)).astype(np.float32) for b in args.batches}
        refs = {b: execute(planned, x) for b, x in inputs.items()}
        for tname in args.targets:
            target = targets[tname]
            vms, build_s = {}, {}
            for kind in ("unscheduled", "scheduled"):
                t0 = time.perf_counter()
                m = schedule_module(mod, planned, target) if kind == "scheduled" else mod
                vms[kind] = relax.VirtualMachine(tvm.compile(m, target=target), dev)
                build_s[kind] = time.perf_counter() - t0
            for batch in args.batches:
                x = tvm.runtime.tensor(inputs[batch], dev)
                times, errs = {}, {}
                for kind, vm in vms.items():
                    out = vm["main"](x)
                    errs[kind] = [float(np.abs(o.numpy() - r).max() / (np.abs(r).max() + 1e-30))
                                  for o, r in zip(out, refs[batch])]
                    timer = vm.time_evaluator("main", dev, number=1, repeat=args.repeat,
                                              min_repeat_ms=args.min_repeat_ms)
                    times[kind] = timer(x).median * 1e3
                    if args.profile:
                        profiles.append((net, tname, batch, kind, _profile(vm, x, VMInstrumentReturnKind)))
                if max(errs["scheduled"]) > TOLERANCE:
                    failures.append(f"{net}/{tname}/batch {batch}: relative error {errs['scheduled']}")
                rows.append((net, tname, batch, times["unscheduled"], times["scheduled"],
                             times["unscheduled"] / times["scheduled"], max(errs["scheduled"]),
                             build_s["unscheduled"], build_s["scheduled"]))

    header = ("net", "target", "batch", "unscheduled ms", "scheduled ms", "speedup", "sched rel err",
              "build s (u/s)")
    table = [header] + [(n, t, str(b), f"{u:.3f}", f"{s:.3f}", f"{u / s:.1f}x", f"{e:.1e}", f"{bu:.1f}/{bs:.1f}")
                        for n, t, b, u, s, _, e, bu, bs in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    print()
    for i, r in enumerate(table):
        print("  ".join(c.rjust(w) if i and j >= 2 else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    for net, tname, batch, kind, prof in profiles:
        print(f"\n{net} {tname} batch {batch} {kind}: per-kernel mean us  " +
              "  ".join(f"{k.removeprefix('pfp_')}={v:.1f}" for k, v in prof))
    if failures:
        print("\nMISMATCH vs reference:\n  " + "\n  ".join(failures))
        return 1
    print(f"\nall scheduled outputs match the float64 reference (max relative error <= {TOLERANCE:g})")
    return 0


def _profile(vm, x, kinds, calls: int = 20) -> list[tuple[str, float]]:
    """Mean wall time per call of every PFP kernel, via the VM instrument hook."""
    stats = collections.defaultdict(lambda: [0, 0.0])
    start = {}

    def instrument(func, symbol, before, ret, *call_args):
        if before:
            start[symbol] = time.perf_counter()
        else:
            stats[symbol][0] += 1
            stats[symbol][1] += time.perf_counter() - start[symbol]
        return kinds.NO_OP

    vm.set_instrument(instrument)
    try:
        for _ in range(calls):
            vm["main"](x)
    finally:
        vm.set_instrument(None)
    items = [(k, v[1] / v[0] * 1e6) for k, v in stats.items() if k.startswith("pfp_")]
    return sorted(items, key=lambda kv: -kv[1])


if __name__ == "__main__":
    sys.exit(main())
