"""Compile time of ``net.compile()`` (default schedules, any batch) for the MLP, LeNet-5, ResNet-8 and
ResNet-20 of ``benchmarks/latency.py`` (the ResNets with the default ``correlation="auto"``, which is the
shared-factor scheme for them, and with ``"mean-field"``: rows ``(mf)``), first with an empty kernel
cache and then again with the kernels cached (a second compile), in CPU seconds of this process and
its children (all threads and the linker, so a loaded machine inflates it less) and wall seconds
(what a user waits: the kernels compile on ``PYRO2PFP_BUILD_JOBS`` threads, default the CPUs this process
may use; measure it on a quiet machine), best of ``--repeats``.

    PYTHONPATH=. .venv/bin/python benchmarks/compile_time.py [--repeats 3] [--markdown docs/generated/compile-time.md]

Budgets (LeNet-5 <= 1 s, ResNet-20 <= 5 s, every second compile <= 1 s) are printed as HOLDS/SHORT
lines, judged on the wall time (the CPU seconds beside it).

    PYTHONPATH=. .venv/bin/python benchmarks/compile_time.py --per-op resnet20

instead compiles each distinct kernel of one net alone and sums per PFP op the CPU seconds of
``tvm.compile`` (TIR passes and LLVM's optimisation), of the JIT (LLVM's machine code, which a
``CompiledPFP`` pays when its VM is created) and the lines of LLVM IR (``--kernels``: one row per
kernel).

    PYTHONPATH=. .venv/bin/python benchmarks/compile_time.py --k-sharing resnet20

instead lists the shared-factor kernels that sharing across layers differing only in the factor width
``K`` would remove, and what compiling them costs (an upper bound on that saving).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from markdown_report import add_markdown_argument, table, write_markdown  # noqa: E402

TARGETS = {"lenet": 1.0, "resnet20": 5.0, "resnet20 (mf)": 5.0}
SECOND_COMPILE = 1.0  # seconds: every net's second compile (kernels from the cache)


def networks(only: str | None = None):
    """(name, PFPNetwork) of the benchmark's nets, with untrained posteriors (the compile time does not
    depend on the weights' values); ``only``: just the net of that name (the others not converted)."""
    import pyro
    import torch
    from latency import build_models, build_resnet  # type: ignore[import-not-found]

    import pyro2pfp
    from pyro2pfp_experiments.zoo import he_posterior

    for name in ("mlp", "lenet"):
        if only not in (None, name):
            continue
        pyro.clear_param_store()
        model, guide, _, shape = build_models(name)
        guide(torch.zeros(2, *shape), torch.zeros(2, dtype=torch.long))  # initialise its parameters
        yield name, pyro2pfp.convert(model, guide, input_shape=shape, check=False)
    for name in ("resnet8", "resnet20"):
        variants = {f"{name} (mf)": "mean-field", name: "shared-factor"}  # "auto" picks shared-factor here
        variants = {k: v for k, v in variants.items() if only in (None, k)}
        if not variants:
            continue
        model, _, _, shape = build_resnet(name)
        guide = he_posterior(model, torch.zeros(2, *shape))
        for label, correlation in variants.items():
            yield label, pyro2pfp.convert(model, guide, input_shape=shape, correlation=correlation,
                                                  check=False)


def per_op(net_name: str, kernels: bool = False) -> None:
    """CPU seconds of ``tvm.compile`` of each distinct scheduled PrimFunc of one net alone, of its JIT
    (machine code, on the first look-up of its function) and its lines of LLVM IR, summed per PFP op
    (what LLVM spends on each kind of kernel; the whole build adds the Relax VM's code).  ``kernels``:
    also one row per kernel."""
    import collections

    import tvm

    from pyro2pfp.backends.tvm.emit import kernel_info
    from pyro2pfp.backends.tvm.schedules import schedule_module
    from pyro2pfp.backends.tvm.sharing import share_identical_kernels
    from pyro2pfp.runtime.targets import resolve_target

    net = next((net for _, net in networks(only=net_name)), None)
    if net is None:
        raise SystemExit(f"--per-op: no net {net_name!r} (mlp, lenet, resnet8, resnet20, and '<resnet> (mf)')")
    target = resolve_target("native")
    mod = schedule_module(share_identical_kernels(net.mod), net.plan, target)
    rows: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0])
    for gv in sorted(mod.get_global_vars(), key=lambda v: v.name_hint):
        func = mod[gv]
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        c0 = time.process_time()
        exe = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
        c1 = time.process_time()
        exe.jit()["main"]  # LLVM's machine code is made on the first look-up
        c2 = time.process_time()
        lines = exe.mod.inspect_source("ll").count("\n")
        row = rows[str(kernel_info(func)[0])]
        for i, value in enumerate((1, c1 - c0, c2 - c1, lines)):
            row[i] += value
        if kernels:
            print(f"  {gv.name_hint:<44} {1000 * (c1 - c0):>6.0f} ms {1000 * (c2 - c1):>6.0f} ms {lines:>7} lines")
    print(f"{net_name}: {sum(int(r[0]) for r in rows.values())} distinct PrimFuncs")
    print(f"{'op':<18} {'funcs':>5} {'CPU s':>6} {'ms each':>8} {'JIT s':>6} {'IR lines':>9}")
    for op, (n, cpu, jit, lines) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        print(f"{op:<18} {int(n):>5} {cpu:>6.2f} {1000 * cpu / n:>8.0f} {jit:>6.2f} {int(lines):>9}")
    print(f"{'total':<18} {'':>5} {sum(r[1] for r in rows.values()):>6.2f} {'':>8} "
          f"{sum(r[2] for r in rows.values()):>6.2f} {int(sum(r[3] for r in rows.values())):>9}")


def _k_blind_signature(func) -> str:
    """A kernel's signature with every buffer's last dimension and every parameter name blanked: equal
    for the shared-factor kernels of layers that differ only in the factor width ``K`` (and offset)."""
    import re

    text = func.script()
    head = text[text.index("def main("):text.index("):")]
    head = re.sub(r"T\.int64\(\d+\)\)(, \"float32\")", r"K)\1", head)
    return re.sub(r"\w+: T\.Buffer", "T.Buffer", head)


def k_sharing(net_name: str, ops: tuple[str, ...] = ("sf_conv_load", "sf_relu", "sf_add")) -> None:
    """What sharing ``ops``' kernels across layers that differ only in ``K`` would save: the kernels
    of ``net_name`` that would go (each but the first of a group with equal :func:`_k_blind_signature`)
    and the CPU seconds of compiling each alone as a build does (``build_context``: TIR passes, LLVM,
    machine code) -- an upper bound on the build's saving (shape-generic kernels may be larger)."""
    import tvm

    from pyro2pfp.backends.tvm.build import build_context
    from pyro2pfp.backends.tvm.emit import kernel_info
    from pyro2pfp.backends.tvm.schedules import schedule_module
    from pyro2pfp.backends.tvm.sharing import share_identical_kernels
    from pyro2pfp.runtime.targets import resolve_target

    net = next((net for _, net in networks(only=net_name)), None)
    if net is None:
        raise SystemExit(f"--k-sharing: no net {net_name!r}")
    target = resolve_target("native")
    mod = schedule_module(share_identical_kernels(net.mod), net.plan, target)
    first: dict[tuple[str, str], str] = {}
    total = 0.0
    for gv in sorted(mod.get_global_vars(), key=lambda v: v.name_hint):
        func = mod[gv]
        op = kernel_info(func)[0] if isinstance(func, tvm.tirx.PrimFunc) else None
        if op not in ops:
            continue
        key = (str(op), _k_blind_signature(func))
        if key not in first:
            first[key] = gv.name_hint
            continue
        c0 = time.process_time()
        with build_context():
            exe = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
        exe.jit()["main"]
        seconds = time.process_time() - c0
        total += seconds
        print(f"  {gv.name_hint:<44} shares {first[key]:<44} {seconds:.3f} CPU s")
    print(f"{net_name}: sharing {', '.join(ops)} across K would remove these kernels: {total:.2f} CPU s")


def kernel_counts(mod) -> tuple[int, int]:
    """(PrimFuncs, ``call_tir`` calls) of an emitted module: the kernels made and the kernel calls."""
    import tvm
    import tvm_ffi
    from tvm import relax

    calls = [0]

    def count(call) -> None:
        if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.call_tir":
            calls[0] += 1

    tvm_ffi.structural_walk(mod["main"], (relax.Call, count))
    return sum(isinstance(f, tvm.tirx.PrimFunc) for _, f in mod.functions_items()), calls[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--per-op", metavar="NET", help="instead: compile time of each distinct kernel of NET "
                        "(e.g. 'resnet20', 'resnet20 (mf)'), summed per PFP op")
    parser.add_argument("--kernels", action="store_true", help="with --per-op: one row per kernel too")
    parser.add_argument("--k-sharing", metavar="NET", help="instead: the compile time that sharing the "
                        "shared-factor kernels of NET across layers differing only in K would save")
    add_markdown_argument(parser)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    if args.k_sharing:
        k_sharing(args.k_sharing)
        return
    if args.per_op:
        per_op(args.per_op, args.kernels)
        return
    import tempfile

    import numpy as np

    from pyro2pfp.backends.tvm.build import build_jobs

    def cpu_s() -> float:  # this process and its children (the linker)
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def timed(net) -> tuple[float, float]:
        net._mod = None  # re-emit too: compile() is what a user calls after convert
        t0, c0 = time.perf_counter(), cpu_s()
        exe = net.compile()
        exe(np.zeros((1, *net.input_shape), np.float32))  # its first VM links the kernels
        return time.perf_counter() - t0, cpu_s() - c0

    print(f"load average {os.getloadavg()[0]:.1f}, kernels compiled on {build_jobs()} thread(s)")
    print(f"{'net':<14} {'CPU s':>6} {'wall s':>7} {'2nd CPU s':>9} {'2nd wall s':>10} {'kernels':>8} {'calls':>6}")
    best, second, counts = {}, {}, {}
    for name, net in networks():
        cold, warm = [], []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as cache:  # an empty kernel cache: a first compile
                os.environ["PYRO2PFP_KERNEL_CACHE"] = cache
                cold.append(timed(net))
                warm.append(timed(net))  # the same architecture again: kernels from the cache
            del os.environ["PYRO2PFP_KERNEL_CACHE"]
        best[name] = (min(w for w, _ in cold), min(c for _, c in cold))
        second[name] = (min(w for w, _ in warm), min(c for _, c in warm))
        counts[name] = kernel_counts(net.mod)
        (wall, cpu), (wall2, cpu2), (made, calls) = best[name], second[name], counts[name]
        print(f"{name:<14} {cpu:>6.2f} {wall:>7.2f} {cpu2:>9.2f} {wall2:>10.2f} {made:>8} {calls:>6}")
    for name, limit in TARGETS.items():
        wall_s, cpu = best[name]
        verdict = "HOLDS" if wall_s <= limit else "SHORT"
        print(f"{verdict}: {name} compile {wall_s:.2f} s wall <= {limit:.0f} s ({cpu:.2f} CPU s)")
    for name, (wall_s, cpu) in second.items():
        verdict = "HOLDS" if wall_s <= SECOND_COMPILE else "SHORT"
        print(f"{verdict}: {name} second compile {wall_s:.2f} s wall <= {SECOND_COMPILE:.0f} s ({cpu:.2f} CPU s)")
    write_markdown(args.markdown, [
        table(["net", "wall s", "CPU s", "second compile wall s", "second compile CPU s", "kernels", "kernel calls"],
              [[name, f"{w:.2f}", f"{c:.2f}", f"{second[name][0]:.2f}", f"{second[name][1]:.2f}",
                str(counts[name][0]), str(counts[name][1])] for name, (w, c) in best.items()]),
        f"`net.compile()` after `convert` and its first call (module emission and linking included), best of "
        f"{args.repeats}, with an empty kernel cache; *second compile*: the same again, its kernels in the cache. "
        f"Kernels compiled on {build_jobs()} thread(s); CPU s counts the linker too; `(mf)`: "
        f"`correlation=\"mean-field\"`; *kernels*: the PrimFuncs the emitter made (each compiled once), "
        f"*kernel calls*: the `call_tir`s of the module (one or more per layer)."])


if __name__ == "__main__":
    main()
