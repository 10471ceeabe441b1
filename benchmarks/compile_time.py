"""Compile time of ``net.compile()`` (default schedules, any batch) for the MLP, LeNet-5, ResNet-8 and
ResNet-20 of ``benchmarks/latency.py`` (the ResNets with the default ``correlation="auto"``, which is the
shared-factor scheme for them, and with ``"mean-field"``: rows ``(mf)``), in CPU seconds of this
process (``time.process_time``, so a loaded machine does not inflate it) and wall seconds, best of
``--repeats``.

    PYTHONPATH=. .venv/bin/python benchmarks/compile_time.py [--repeats 3]

Issue 13's targets (LeNet-5 <= 2 s, ResNet-20 <= 5 s) are printed as HOLDS/SHORT lines.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TARGETS = {"lenet": 2.0, "resnet20": 5.0, "resnet20 (mf)": 5.0}


def networks():
    """(name, PFPNetwork) of the benchmark's nets, with untrained posteriors (the compile time does not
    depend on the weights' values)."""
    import pyro
    import torch
    from latency import build_models, build_resnet  # type: ignore[import-not-found]

    import pyro2pfp
    from pyro2pfp_experiments.zoo import he_posterior

    for name in ("mlp", "lenet"):
        pyro.clear_param_store()
        model, guide, _, shape = build_models(name)
        guide(torch.zeros(2, *shape), torch.zeros(2, dtype=torch.long))  # initialise its parameters
        yield name, pyro2pfp.convert(model, guide, input_shape=shape)
    for name in ("resnet8", "resnet20"):
        model, _, _, shape = build_resnet(name)
        guide = he_posterior(model, torch.zeros(2, *shape))
        for correlation in ("mean-field", "shared-factor"):  # "auto" picks shared-factor for these nets
            suffix = "" if correlation == "shared-factor" else " (mf)"
            yield name + suffix, pyro2pfp.convert(model, guide, input_shape=shape, correlation=correlation)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print(f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'net':<14} {'CPU s':>6} {'wall s':>7}")
    best = {}
    for name, net in networks():
        cpu, wall = [], []
        for _ in range(args.repeats):
            net._mod = None  # re-emit too: compile() is what a user calls after convert
            t0, c0 = time.perf_counter(), time.process_time()
            net.compile()
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - t0)
        best[name] = min(cpu)
        print(f"{name:<14} {min(cpu):>6.2f} {min(wall):>7.2f}")
    for name, limit in TARGETS.items():
        verdict = "HOLDS" if best[name] <= limit else "SHORT"
        print(f"{verdict}: {name} compile {best[name]:.2f} CPU s <= {limit:.0f} s")


if __name__ == "__main__":
    main()
