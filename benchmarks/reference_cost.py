"""What the float64 reference of a shared-factor plan costs next to the mean-field reference of the same net.

The shared-factor reference (``net.reference`` of a ``correlation="shared-factor"`` plan) is what
``pyro2pfp.diagnose``, ``check=`` and the spot check every ``convert`` runs execute.  For each net (CIFAR
ResNet-8 and ResNet-20 of ``benchmarks/latency.py``, and a CIFAR ResNet-18: widths 64-128-256-512, two
basic blocks per stage; untrained ``AutoNormal`` posteriors at He scale, ``zoo.he_posterior``) it converts
the net once with ``correlation="shared-factor"`` and times, alternating, ``--repeats`` runs of the float64
reference on ``--inputs`` random inputs with the factor plan and with it removed (mean-field), best of each;
the ratio of the two is the figure to read on a loaded machine (both measured in the same run, alternating).

    PYTHONPATH=. python benchmarks/reference_cost.py [--nets resnet8,resnet20,resnet18] [--inputs 16]
                                                     [--repeats 3] [--markdown docs/generated/reference-cost.md]

NumPy's BLAS threads follow ``OPENBLAS_NUM_THREADS`` (the page states what it was); on a 2-core machine that
other processes load, ``OPENBLAS_NUM_THREADS=1`` gives steadier times.  Target: the shared-factor reference
within 5x the mean-field one (printed as HOLDS/SHORT).
"""
from __future__ import annotations

import argparse
import copy
import os
import time
import warnings

import numpy as np
import torch
from markdown_report import add_markdown_argument, table, write_markdown

import pyro2pfp
from pyro2pfp.backends.reference import execute
from pyro2pfp_experiments.zoo import bayesian_resnet, he_posterior

NETS = {
    "resnet8": lambda: bayesian_resnet(blocks=1),
    "resnet20": lambda: bayesian_resnet(blocks=3),
    "resnet18": lambda: bayesian_resnet(blocks=2, widths=(64, 128, 256, 512)),
}
SHAPE = (3, 32, 32)
TARGET = 5.0  # shared-factor reference / mean-field reference


def measure(name: str, inputs: int, repeats: int) -> dict:
    torch.manual_seed(0)
    model = NETS[name]()
    guide = he_posterior(model, torch.randn(2, *SHAPE))
    net = pyro2pfp.convert(model, guide, input_shape=SHAPE, correlation="shared-factor", check=False)
    shared = net.plan
    assert shared.factors is not None
    mean_field = copy.copy(shared)
    mean_field.factors = None
    x = np.random.default_rng(0).standard_normal((inputs, *SHAPE))
    times: dict[str, list[float]] = {"mf": [], "sf": []}
    for _ in range(repeats):
        for key, graph in (("mf", mean_field), ("sf", shared)):
            t = time.perf_counter()
            execute(graph, x)
            times[key].append(time.perf_counter() - t)
    mf, sf = min(times["mf"]), min(times["sf"])
    return {"net": name, "layers": len(shared.layers), "k": shared.factors.max_factors, "mf": mf, "sf": sf}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nets", default="resnet8,resnet20,resnet18")
    parser.add_argument("--inputs", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    add_markdown_argument(parser)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    blas = os.environ.get("OPENBLAS_NUM_THREADS", "unset (OpenBLAS's default: every CPU)")
    load_before = os.getloadavg()[0]
    rows = [measure(name, args.inputs, args.repeats) for name in args.nets.split(",")]
    load_after = os.getloadavg()[0]
    print(f"load average {load_before:.1f} before, {load_after:.1f} after; OPENBLAS_NUM_THREADS {blas}")
    print(f"{'net':<10} {'K max':>6} {'mean-field s':>13} {'shared-factor s':>16} {'ratio':>6}")
    for r in rows:
        print(f"{r['net']:<10} {r['k']:>6} {r['mf']:>13.2f} {r['sf']:>16.2f} {r['sf'] / r['mf']:>6.2f}")
    for r in rows:
        ratio = r["sf"] / r["mf"]
        print(f"{'HOLDS' if ratio <= TARGET else 'SHORT'}: {r['net']} shared-factor reference {ratio:.2f}x the "
              f"mean-field reference <= {TARGET:.0f}x")
    write_markdown(args.markdown, [
        table(["net", "layers", "factor columns (max K)", "mean-field reference (s)", "shared-factor reference (s)",
               "ratio (same run)"],
              [(r["net"], r["layers"], r["k"], f"{r['mf']:.2f}", f"{r['sf']:.2f}", f"{r['sf'] / r['mf']:.2f}")
               for r in rows]),
        f"`net.reference` in float64 on {args.inputs} inputs of 3×32×32, best of {args.repeats} alternating runs; "
        f"the mean-field column runs the same plan with its factor plan removed. Load average {load_before:.1f} "
        f"before and {load_after:.1f} after the runs (2 cores shared): read the ratio, measured in the same run, "
        f"rather than the seconds. `OPENBLAS_NUM_THREADS`: {blas}."])


if __name__ == "__main__":
    main()
