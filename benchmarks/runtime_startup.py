"""Start-up cost of serving an exported library: import + load + first prediction, and peak memory
(prints a table; no assertions).

    .venv/bin/python benchmarks/runtime_startup.py [--repeat 3] [--baseline /path/to/other/checkout]

For a Bayesian MLP (784-100-10) and LeNet-5 converted from Pyro (untrained posteriors: start-up does
not depend on the weights' values) and exported with a batch-100 executable, each case runs in a fresh
Python process on 100 MNIST digits:

* ``runtime``: ``import pyro2pfp; pyro2pfp.load(lib)(x)`` -- NumPy and the TVM runtime only;
* ``full package``: the same after importing what converting imports (torch, Pyro, the TVM compiler,
  ``pyro2pfp.convert``) -- the process of a user who converts and serves in one place;
* ``cli predict``: ``python -m pyro2pfp predict lib x.npy -o out.npz``.

``--baseline DIR`` runs the ``runtime`` and ``cli predict`` cases with ``DIR`` (another checkout of
pyro2pfp, e.g. before a change) first on ``PYTHONPATH`` too.  Wall time is the child process's
(interpreter start-up included), median over ``--repeat`` runs; peak RSS is the child's ``VmHWM``
(largest over the runs; Linux).  The machine is shared: run it on an idle one for figures to quote.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = """\
import sys, time
t0 = time.perf_counter()
{prelude}
import numpy as np
import pyro2pfp
exe = pyro2pfp.load(sys.argv[1])
mean, var = exe(np.load(sys.argv[2]))
elapsed = time.perf_counter() - t0
heavy = sorted({{m.partition(".")[0] for m in sys.modules}} & {{"torch", "pyro", "scipy", "tvm"}})
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(elapsed, peak / 1024, ",".join(heavy) or "-")
"""
FULL_PRELUDE = "import torch, pyro, tvm, pyro2pfp\npyro2pfp.convert"


def export_nets(directory: str) -> dict[str, tuple[str, str]]:
    """``{name: (library, inputs.npy)}`` for the MLP and LeNet-5, exported with a batch-100 executable."""
    import pyro
    import torch

    import pyro2pfp
    from pyro2pfp_experiments.datasets import load_mnist
    from pyro2pfp_experiments.zoo import BayesianLeNet5, BayesianMLP, make_guide

    _, _, x_test, _ = load_mnist(n_train=0, n_test=100)
    x_test = np.asarray(x_test, np.float32)
    out = {}
    for name, model, shape in (("MLP 784-100-10", BayesianMLP(784, (100,), 10), (784,)),
                               ("LeNet-5", BayesianLeNet5(), (1, 28, 28))):
        pyro.clear_param_store()
        guide = make_guide(model, init_scale=0.05)
        x = x_test.reshape(len(x_test), *shape)
        guide(torch.as_tensor(x[:2]), torch.zeros(2, dtype=torch.long))
        net = pyro2pfp.convert(model, guide, input_shape=shape)
        stem = os.path.join(directory, name.split()[0].lower().replace("-", ""))
        net.compile("llvm", batch_sizes=[len(x)]).export_library(stem + ".so")
        np.save(stem + "_x.npy", x)
        out[name] = (stem + ".so", stem + "_x.npy")
    return out


def run_child(args: list[str], pythonpath: str) -> tuple[float, float, float, str]:
    """(wall s, in-process s, peak RSS MB, heavy modules imported) of one child process."""
    env = dict(os.environ, PYTHONPATH=pythonpath)
    t0 = time.perf_counter()  # cwd: not a checkout, so that PYTHONPATH decides which pyro2pfp runs
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=600,
                            cwd=tempfile.gettempdir())
    wall = time.perf_counter() - t0
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])}: {result.stderr[-1500:]}")
    inner, rss, heavy = result.stdout.split()[-3:] if args[0] == "-c" else ("nan", "nan", "-")
    return wall, float(inner), float(rss), heavy


def run_cli(lib: str, x: str, out: str, pythonpath: str) -> tuple[float, float]:
    """(wall s, peak RSS MB) of ``python -m pyro2pfp predict``."""
    code = ("import runpy, sys\nsys.argv = ['pyro2pfp', 'predict', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('pyro2pfp', run_name='__main__')\nexcept SystemExit as e:\n"
            "    assert not e.code, e.code\n"
            "status = open('/proc/self/status').read().split('VmHWM:')[1].split()[0]\n"
            "print(0, int(status) / 1024, '-')")
    wall, _, rss, _ = run_child(["-c", code, lib, x, "-o", out, "--show", "0"], pythonpath)
    return wall, rss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--baseline", metavar="DIR", help="another pyro2pfp checkout to compare with")
    args = p.parse_args()
    paths = {"this checkout": ROOT}
    if args.baseline:
        paths["baseline"] = os.path.abspath(args.baseline)
    with tempfile.TemporaryDirectory(prefix="pyro2pfp-startup-") as tmp:
        nets = export_nets(tmp)
        header = (f"{'net':<15} {'case':<28} {'wall s':>7} {'in-process s':>13} {'peak RSS MB':>12}  "
                  "heavy modules imported")
        print(f"median of {args.repeat} fresh processes, 100 MNIST digits; peak RSS: largest run")
        print(header)
        print("-" * len(header))
        for name, (lib, x) in nets.items():
            cases = []
            for label, root in paths.items():
                tag = "" if label == "this checkout" else f" ({label})"
                runtime = CHILD.format(prelude="")
                cases.append((f"runtime{tag}", lambda r=root, c=runtime: run_child(["-c", c, lib, x], r)))
                cases.append((f"cli predict{tag}", lambda r=root: (*run_cli(lib, x, os.path.join(tmp, "o.npz"), r),)))
            full = CHILD.format(prelude=FULL_PRELUDE)
            cases.append(("full package", lambda c=full: run_child(["-c", c, lib, x], ROOT)))
            for label, fn in cases:
                runs = [fn() for _ in range(args.repeat)]
                wall = statistics.median(r[0] for r in runs)
                if len(runs[0]) == 2:  # the CLI: wall and RSS only
                    inner, rss, heavy = float("nan"), max(r[1] for r in runs), "-"
                else:
                    inner = statistics.median(r[1] for r in runs)
                    rss, heavy = max(r[2] for r in runs), runs[0][3]
                inner_text = "" if inner != inner else f"{inner:.2f}"
                print(f"{name:<15} {label:<28} {wall:>7.2f} {inner_text:>13} {rss:>12.0f}  {heavy}")
    print(json.dumps({"python": sys.version.split()[0], "cpus": len(os.sched_getaffinity(0))}))


if __name__ == "__main__":
    main()
