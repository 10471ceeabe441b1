#!/usr/bin/env python
"""Each PFP kernel's rate against torch's whole-net rate, measured in alternating rounds in one process
(so that a shared, loaded machine slows both alike), and -- optionally -- each kernel's instruction
count under ``valgrind --tool=callgrind`` (independent of the load).

    PYTHONPATH=. .venv/bin/python benchmarks/kernel_rates.py --net resnet8 --batch 10
        [--ops conv] [--rounds 30] [--threads 2] [--correlation auto] [--max-pool correlated]
        [--predictive] [--subnormals] [--callgrind] [--keep DIR] [--markdown docs/generated/kernel-rates.md]

The nets are those of ``benchmarks/latency.py`` (LeNet-5 and the MLP with their guides initialised, not
trained; the ResNets with an untrained He-scale posterior): kernel speed does not depend on the values.
Per round: torch's deterministic net (posterior means) is timed (median of a few calls), then every
selected kernel alone on a copy of its arguments from one call of the compiled network (a C++ timing
loop, ``time_evaluator``); the kernel's rate (its multiply-adds,
:func:`pyro2pfp.backends.tvm.kernel_work.kernel_multiply_adds`,
over its time) is divided by torch's (the deterministic net's multiply-adds over its time) of the
same round.  The table gives the median of those ratios over the rounds and their 25th-75th percentiles.
``--ops`` is a regular expression on the kernels' ops (default: the conv kernels whose rate
``latency.py``'s target checks, ``conv`` but not ``window``; ``.`` selects every kernel).

``--predictive`` also alternates ``pyro.infer.Predictive(num_samples=30)`` (LeNet-5 and the MLP: the
guide of the net) with ``exe(x)`` and prints the median ratio of their times (``latency.py``'s ``xPred``).

``--subnormals``: the network is built a second time with its kernels computing IEEE subnormals
(:func:`pyro2pfp.backends.tvm.subnormals.keep_subnormals`; by default the conv and shared-factor ReLU
kernels flush them to zero), and each round also times every selected kernel of that build on its own
arguments and both whole calls ``exe(x)``: the ``kept/flushed`` column is the median ratio of a kernel's
two times in a round, and the whole-call ratio is printed above the table.

``--callgrind``: every selected kernel's instructions per call under ``valgrind --tool=callgrind``
(``callgrind_kernels.py``: one thread, a library built for an AVX2 CPU since valgrind does not decode
AVX-512); ``--cache-sim`` adds callgrind's simulated first- and last-level data misses per call.

Threads: ``--threads 1`` (default) for both TVM and torch; on a loaded machine a parallel loop waits
for its slowest thread, which makes two-thread ratios much noisier.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from markdown_report import add_markdown_argument  # noqa: E402  (benchmarks/ on the path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--net", default="resnet8", choices=["mlp", "lenet", "resnet8", "resnet20"])
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--ops", default=r"^(?!window).*conv", help="regular expression on the kernels' ops")
    ap.add_argument("--correlation", default="auto", choices=["auto", "mean-field", "shared-factor", "compact-factor"])
    ap.add_argument("--max-pool", default="correlated", choices=["correlated", "independent"])
    ap.add_argument("--predictive", action="store_true", help="also exe(x) against Predictive(30), alternating")
    ap.add_argument("--callgrind", action="store_true", help="also count instructions per kernel call")
    ap.add_argument("--cache-sim", action="store_true", help="with --callgrind: simulate the caches")
    ap.add_argument("--keep", metavar="DIR", help="keep the exported library and arguments in DIR")
    ap.add_argument("--subnormals", action="store_true",
                    help="also time each kernel (and exe(x)) built to keep IEEE subnormals, alternating")
    add_markdown_argument(ap)
    return ap.parse_args(argv)


def build(args: argparse.Namespace):
    """(PFP net, deterministic torch net, input batch, Pyro model, guide)."""
    import latency
    import torch

    import pyro2pfp

    model, guide, det, shape, x = latency.model_with_inputs(args.net, args.batch)
    net = pyro2pfp.convert(model, guide, input_shape=shape, correlation=args.correlation, max_pool=args.max_pool,
                           check=False)
    post = latency.posterior(guide, det)
    with torch.no_grad():
        for name, p in det.named_parameters():
            if name in post:
                p.copy_(post[name][0])
    det.eval()
    return net, det, x, model, guide


def capture(exe, *inputs):
    """``[(symbol, library, [argument copies])]`` of one call of the compiled network, in call order."""
    import numpy as np
    import tvm
    from tvm import relax
    from tvm.runtime.vm import VMInstrumentReturnKind

    vm = exe.vm if isinstance(exe.vm, relax.VirtualMachine) else relax.VirtualMachine(exe.executable, tvm.cpu())
    libs = []
    todo = list(vm.module.imports)
    while todo:  # the kernels' libraries, also those imported by another (a build in parts)
        m = todo.pop()
        if hasattr(m, "implements_function"):
            libs.append(m)
        todo += list(getattr(m, "imports", []))
    out = []

    def record(func, symbol, before, ret, *call_args):
        if before and not symbol.startswith(("vm.", "relax.", "runtime.")):
            copies = [tvm.runtime.tensor(np.from_dlpack(a).copy(), tvm.cpu()) if isinstance(a, tvm.runtime.Tensor)
                      else a for a in call_args]
            lib = next((m for m in libs if m.implements_function(symbol)), None)
            out.append((symbol, lib, copies))
        return VMInstrumentReturnKind.NO_OP

    vm.set_instrument(record)
    try:
        vm["main"](*[tvm.runtime.tensor(a) for a in inputs])
    finally:
        vm.set_instrument(None)
    return out


def quantiles(values):
    import numpy as np

    return tuple(float(q) for q in np.percentile(values, [25, 50, 75]))


def time_call(fn, *args, calls: int = 3) -> float:
    """Median wall time of ``calls`` calls of ``fn(*args)``."""
    import numpy as np

    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("TVM_BIND_THREADS", "0")
    warnings.simplefilter("ignore")
    import latency
    import numpy as np
    import torch
    import tvm
    from markdown_report import table, write_markdown

    from pyro2pfp.backends.tvm.kernel_work import kernel_multiply_adds
    from pyro2pfp.backends.tvm.subnormals import keep_subnormals

    torch.set_num_threads(args.threads)
    net, det, x, model, guide = build(args)
    exe = net.compile()
    ref = net.reference(x)
    got = exe(x)
    err = max(float(np.abs(g - r).max() / (np.abs(r).max() + 1e-30)) for g, r in zip(got, ref))
    work = kernel_multiply_adds(net, args.batch)
    kernels = exe.kernels or {}
    pattern = re.compile(args.ops)
    chosen = {}
    for symbol, lib, copies in capture(exe, x):
        op = kernels.get(symbol, (symbol, ""))[0]
        if pattern.search(op) and symbol in work and symbol not in chosen:
            chosen[symbol] = (op, lib, copies)
    kept_exe, kept = None, {}
    if args.subnormals:
        with keep_subnormals():
            kept_exe = net.compile()
        for symbol, lib, copies in capture(kept_exe, x):
            if symbol in chosen and symbol not in kept:
                kept[symbol] = lib.time_evaluator(symbol, tvm.cpu(), number=1, repeat=1, min_repeat_ms=20), copies
    det_macs = latency.det_multiply_adds(net) * args.batch
    xt = torch.as_tensor(x)
    timers = {s: lib.time_evaluator(s, tvm.cpu(), number=1, repeat=1, min_repeat_ms=20)
              for s, (_, lib, _) in chosen.items()}
    ratios: dict[str, list[float]] = {s: [] for s in chosen}
    us: dict[str, list[float]] = {s: [] for s in chosen}
    kept_ratios: dict[str, list[float]] = {s: [] for s in kept}
    torch_rates, pred_ratios, whole_kept = [], [], []
    predictive = None
    if args.predictive:
        import pyro

        predictive = pyro.infer.Predictive(model, guide=guide, num_samples=30, return_sites=("_RETURN",))
    with torch.no_grad():
        det(xt)
        for _ in range(args.rounds):
            rate = det_macs / time_call(det, xt, calls=5) * 1e-9
            torch_rates.append(rate)
            for symbol, (_, _, copies) in chosen.items():
                t = float(timers[symbol](*copies).mean)
                us[symbol].append(t * 1e6)
                ratios[symbol].append(work[symbol] / t * 1e-9 / rate)
                if symbol in kept:
                    timer, kept_copies = kept[symbol]
                    kept_ratios[symbol].append(float(timer(*kept_copies).mean) / t)
            if kept_exe is not None:
                whole_kept.append(time_call(kept_exe, x) / time_call(exe, x))
            if predictive is not None:
                t_pred = time_call(predictive, xt, calls=1)
                pred_ratios.append(t_pred / time_call(exe, x, calls=5))
    load = os.getloadavg()[0]
    notes = [f"{args.net}, batch {args.batch}, correlation {net.plan.correlation}, {args.threads} thread(s), "
             f"{args.rounds} alternating rounds; load average {load:.1f} at the end (timings under load are not "
             f"valid: only the ratios of one round are compared); compiled vs float64 reference: rel. error "
             f"{err:.1e}"]
    lo, med, hi = quantiles(torch_rates)
    notes.append(f"torch whole net: {det_macs / 1e6:.1f} M multiply-adds, {med:.1f} G/s (p25-p75 {lo:.1f}-{hi:.1f})")
    if pred_ratios:
        lo, med, hi = quantiles(pred_ratios)
        notes.append(f"Predictive(30) / exe(x): {med:.0f}x (p25-p75 {lo:.0f}-{hi:.0f})")
    if whole_kept:
        lo, med, hi = quantiles(whole_kept)
        notes.append(f"exe(x) with IEEE subnormals / with subnormals flushed: {med:.2f}x (p25-p75 {lo:.2f}-{hi:.2f})")
    instr = {}
    if args.callgrind and chosen:
        import callgrind_kernels

        work_dir = args.keep or tempfile.mkdtemp(prefix="kernel_rates_")
        os.makedirs(work_dir, exist_ok=True)
        lib_path = os.path.join(work_dir, "net.so")
        avx2 = net.compile(tvm.target.Target({"kind": "llvm", "mcpu": callgrind_kernels.AVX2_CPU}))
        avx2.executable.export_library(lib_path)
        todo = [(lib_path, symbol, [np.from_dlpack(a) if not isinstance(a, int) else a for a in copies])
                for symbol, (_, _, copies) in chosen.items()]
        instr = dict(zip(chosen, callgrind_kernels.count(todo, args.cache_sim, work_dir)))
    columns = ["kernel", "op", "M mul-add", "us", "x torch", "p25-p75"]
    columns += ["kept/flushed"] if kept else []
    columns += ["M instr", "mul-add/instr"] if instr else []
    columns += ["K D1 miss", "K LL miss"] if instr and args.cache_sim else []
    rows = []
    for symbol, (op, _, _) in sorted(chosen.items(), key=lambda kv: -float(np.median(us[kv[0]]))):
        lo, med, hi = quantiles(ratios[symbol])
        row = [symbol, op, f"{work[symbol] / 1e6:.2f}", f"{float(np.median(us[symbol])):.1f}", f"{med:.2f}",
               f"{lo:.2f}-{hi:.2f}"]
        if kept:
            row.append(f"{float(np.median(kept_ratios[symbol])):.2f}" if symbol in kept_ratios else "-")
        if instr:
            ev = instr[symbol]
            row += [f"{ev['Ir'] / 1e6:.2f}", f"{work[symbol] / ev['Ir']:.2f}"]
            if args.cache_sim:
                row += [f"{ev['D1'] / 1e3:.1f}", f"{ev['LL'] / 1e3:.1f}"]
        rows.append(row)
    for note in notes:
        print(note)
    widths = [max(len(str(c)), *(len(str(r[k])) for r in rows)) for k, c in enumerate(columns)]
    for line in [columns, *rows]:
        print(" ".join(f"{str(v):<{w}}" if k < 2 else f"{str(v):>{w}}" for k, (v, w) in enumerate(zip(line, widths))))
    write_markdown(args.markdown, ["\n\n".join(notes), table(columns, rows)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
