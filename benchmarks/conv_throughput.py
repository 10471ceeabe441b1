"""Throughput of the PFP conv2d kernels on the convolutions of LeNet-5 and the ResNets, against torch's
deterministic ``F.conv2d`` on the same shapes, one thread each, timed in alternating rounds in one
process (a loaded machine slows both alike: the ratios of a round are compared, never the times of
different rounds).

A PFP conv of a variance input computes three convolutions per layer -- the mean ``Σ μw·μx`` and the
two variance terms ``Σ μw²·vx`` and ``Σ vw·(μx² + vx)`` (``docs/math.md`` "Compute layers", variance
form) -- and of a deterministic input two (``Σ μw·x``, ``Σ vw·x²``); the shared-factor profile
convolution (``sf_conv_profile``) one per input term.  ``x torch`` is the kernel's rate in those
multiply-adds over torch's rate in its own (the deterministic conv's): 1.0 means the PFP kernel
computes each of its products as fast as torch computes its convolution.

Variants per layer: ``direct`` (the direct kernel, :func:`~pyro2pfp.backends.tvm.ops.winograd.direct_convolutions`)
and ``winograd`` (F(2x2, 3x3), on the layers :func:`~pyro2pfp.backends.tvm.ops.winograd.use_winograd`
picks); ``default`` marks the one ``net.compile()`` uses.

    PYTHONPATH=. .venv/bin/python benchmarks/conv_throughput.py [--batch 10] [--rounds 20] [--cases NAME ...]
        [--callgrind] [--threads 1] [--markdown docs/generated/conv-throughput.md]

``--callgrind`` adds each kernel's instructions per call (``callgrind_kernels.py``: built for an AVX2 CPU,
valgrind does not decode AVX-512) and its multiply-adds per instruction.  Each compiled kernel is
checked against the float64 reference first.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from markdown_report import add_markdown_argument, table, write_markdown  # noqa: E402  (benchmarks/ on the path)

# name: (in channels, out channels, input size, stride, kernel, padding, random input)
CASES = {
    "lenet_conv1": (1, 6, 28, 1, 5, 2, False),
    "lenet_conv2": (6, 16, 14, 1, 5, 0, True),
    "resnet_conv1": (3, 16, 32, 1, 3, 1, False),
    "16-16@32": (16, 16, 32, 1, 3, 1, True),
    "32-32@16": (32, 32, 16, 1, 3, 1, True),
    "64-64@8": (64, 64, 8, 1, 3, 1, True),
    "16-32@32/2": (16, 32, 32, 2, 3, 1, True),
    "32-64@16/2": (32, 64, 16, 2, 3, 1, True),
    "1x1 16-32@32/2": (16, 32, 32, 2, 1, 0, True),
    "1x1 32-64@16/2": (32, 64, 16, 2, 1, 0, True),
}


def build(case: tuple, batch: int, rng):
    """(layer graph, plan, inputs) of one PFP conv layer of ``case``."""
    import numpy as np

    from pyro2pfp.planning.graph import INPUT, GaussianParam, Layer, LayerGraph
    from pyro2pfp.planning.plan import plan

    c, o, n, stride, k, pad, random = case
    out_n = (n + 2 * pad - k) // stride + 1
    weight = GaussianParam(0.1 * rng.standard_normal((o, c, k, k)), 0.01 * rng.uniform(0.1, 1, (o, c, k, k)))
    bias = GaussianParam(0.1 * rng.standard_normal(o), 0.01 * rng.uniform(0.1, 1, o))
    layer = Layer("c", "conv2d", [INPUT], (o, out_n, out_n), "c",
                  attrs={"stride": [stride] * 2, "padding": [pad, pad], "dilation": [1, 1], "groups": 1},
                  params={"weight": weight, "bias": bias})
    graph = LayerGraph((c, n, n), [layer], "c", input_variance=random)
    x = rng.standard_normal((batch, c, n, n)).astype(np.float32)
    inputs = [x] + ([(0.1 * rng.uniform(size=x.shape)).astype(np.float32)] if random else [])
    return graph, plan(graph), inputs, weight, bias


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--callgrind", action="store_true", help="also count instructions per call (AVX2 build)")
    add_markdown_argument(parser)
    args = parser.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("TVM_BIND_THREADS", "0")
    warnings.simplefilter("ignore")
    import numpy as np
    import torch
    import torch.nn.functional as F
    import tvm
    from callgrind_kernels import AVX2_CPU
    from kernel_rates import capture

    import pyro2pfp
    from pyro2pfp.backends.tvm.ops.winograd import direct_convolutions, use_winograd
    from pyro2pfp.network import PFPNetwork

    pyro2pfp.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    rows = []
    for name in args.cases:
        case = CASES[name]
        graph, planned, inputs, weight, bias = build(case, args.batch, rng)
        layer = planned.layers[0]
        variants: dict[str, tuple] = {}
        wino = use_winograd(layer, layer.in_reprs[0])
        ref = PFPNetwork(graph, planned).reference(*inputs)
        for key in ("direct", "winograd") if wino else ("direct",):
            with direct_convolutions() if key == "direct" else contextlib.nullcontext():
                net = PFPNetwork(graph, planned)  # the kernels are emitted here
                exe = net.compile()
                avx2 = net.compile(tvm.target.Target({"kind": "llvm", "mcpu": AVX2_CPU})) if args.callgrind else None
            err = max(float(np.abs(a - r).max() / np.abs(r).max()) for a, r in zip(exe(*inputs), ref))
            assert err < 1e-4, f"{name}: compiled {key} conv disagrees with the reference: {err:.1e}"
            symbol, lib, copies = next(c for c in capture(exe, *inputs) if c[0].startswith("pfp_conv2d"))
            timer = lib.time_evaluator(symbol, tvm.cpu(), number=1, repeat=1, min_repeat_ms=20)
            variants[key] = (symbol, timer, copies, avx2, err)
        c, o, n, stride, k, pad, random = case
        out_n = (n + 2 * pad - k) // stride + 1
        macs = args.batch * o * out_n * out_n * c * k * k
        pfp_macs = macs * (3 if random else 2)
        xt = torch.from_numpy(inputs[0])
        wt = torch.from_numpy(weight.mean.astype(np.float32))
        bt = torch.from_numpy(bias.mean.astype(np.float32))
        ratios: dict[str, list[float]] = {key: [] for key in variants}
        times: dict[str, list[float]] = {key: [] for key in variants}
        with torch.no_grad():
            for _ in range(args.rounds):
                det = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    F.conv2d(xt, wt, bt, stride=stride, padding=pad)
                    det.append(time.perf_counter() - t0)
                t_det = float(np.median(det))
                for key, (_, timer, copies, _, _) in variants.items():
                    t = float(timer(*copies).mean)
                    times[key].append(t)
                    ratios[key].append((pfp_macs / t) / (macs / t_det))
        instr = {}
        if args.callgrind:
            import tempfile

            import callgrind_kernels

            work = tempfile.mkdtemp(prefix="conv_throughput_")
            todo = []
            for key, (symbol, _, copies, avx2, _) in variants.items():
                path = os.path.join(work, f"{key}.so")
                avx2.executable.export_library(path)
                todo.append((path, symbol, [np.from_dlpack(a) for a in copies]))
            instr = dict(zip(variants, callgrind_kernels.count(todo, work_dir=work)))
        default = "winograd" if wino else "direct"
        for key in variants:
            ir = instr.get(key, {}).get("Ir")
            rows.append((name, key + (" *" if key == default else ""), pfp_macs / 1e6,
                         float(np.median(times[key])) * 1e6, *np.percentile(ratios[key], [50, 25, 75]),
                         None if ir is None else ir / 1e6, None if ir is None else pfp_macs / ir))
    note = (f"batch {args.batch}, {args.threads} thread(s), {args.rounds} alternating rounds, load average "
            f"{os.getloadavg()[0]:.1f} at the end (timings under load are not valid: only the ratios of one round "
            f"are compared); * = what net.compile() uses")
    print(note)
    print(f"{'conv':<16} {'variant':<11} {'M mul-add':>9} {'us':>9} {'x torch':>8} {'p25-p75':>11}"
          + (f" {'M instr':>8} {'mul-add/instr':>13}" if args.callgrind else ""))
    cells = []
    for name, key, m, us, med, lo, hi, ir, per in rows:
        line = f"{name:<16} {key:<11} {m:9.2f} {us:9.1f} {med:8.2f} {lo:5.2f}-{hi:<5.2f}"
        cell = [name, key, f"{m:.2f}", f"{us:.1f}", f"{med:.2f}", f"{lo:.2f}-{hi:.2f}"]
        if ir is not None:
            line += f" {ir:8.2f} {per:13.2f}"
            cell += [f"{ir:.2f}", f"{per:.2f}"]
        print(line)
        cells.append(cell)
    columns = ["conv", "variant", "M mul-add", "us", "x torch", "p25-p75"]
    columns += ["M instr (AVX2)", "mul-add/instr"] if args.callgrind else []
    write_markdown(args.markdown, [note, table(columns, cells)])


if __name__ == "__main__":
    main()
