"""Compile and run time of the Gaussian max-pool kernel (Clark's max, default schedule) for the window
kinds of ``backends/tvm/ops/pooling.py``: windows that tile the input (LeNet's pools: the deinterleaved
chain), and windows with padding (a ResNet stem's 3x3 / stride-2 / padding-1 pool), ceil-mode overhang
or overlap (the reduction path; with padding or overhang its taps come from a padded copy of the input).

For each case: CPU seconds of building the one-layer network (``net.compile()``: emission, schedule and
LLVM), and the median / minimum of ``exe(x, x_var)`` on one TVM thread; the relative error against the
float64 reference is checked.

    PYTHONPATH=. .venv/bin/python benchmarks/pool_kernels.py [--batch 1] [--repeats 30]
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

# (name, input (C, H, W), kernel, stride, padding, ceil mode)
CASES = [
    ("LeNet pool1 (tiles)", (6, 28, 28), 2, 2, 0, False),
    ("ResNet stem 3x3/2 pad 1", (64, 112, 112), 3, 2, 1, False),
    ("3x3/2 pad 1, small", (4, 5, 5), 3, 2, 1, False),
    ("2x2/2 ceil overhang", (8, 15, 15), 2, 2, 0, True),
    ("3x3/1 overlap", (16, 16, 16), 3, 1, 0, False),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    os.environ["TVM_NUM_THREADS"] = "1"
    import torch
    import torch.nn.functional as F

    from pyro2pfp.network import PFPNetwork
    from pyro2pfp.planning.graph import INPUT, Layer, LayerGraph
    from pyro2pfp.planning.plan import plan

    print(f"batch {args.batch}, one TVM thread; build CPU s; exe(x, x_var) median / min ms; rel. error vs reference")
    rng = np.random.default_rng(0)
    for name, (c, h, w), k, s, pad, ceil in CASES:
        out = tuple(F.max_pool2d(torch.zeros(1, c, h, w), k, s, pad, ceil_mode=ceil).shape[1:])  # torch's size
        layer = Layer("pool", "max_pool2d", [INPUT], out, name, attrs={
            "kernel": [k, k], "stride": [s, s], "padding": [pad, pad], "dilation": [1, 1], "ceil_mode": ceil})
        graph = LayerGraph((c, h, w), [layer], "pool", input_variance=True)
        net = PFPNetwork(graph, plan(graph))
        t0 = time.process_time()
        exe = net.compile()
        build = time.process_time() - t0
        x = rng.standard_normal((args.batch, c, h, w)).astype(np.float32)
        x_var = (0.1 * rng.uniform(0, 1, x.shape)).astype(np.float32)
        mean, var = exe(x, x_var)
        ref_mean, ref_var = net.reference(x, x_var)
        err = max(np.abs(mean - ref_mean).max() / np.abs(ref_mean).max(), np.abs(var - ref_var).max() / ref_var.max())
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            exe(x, x_var)
            times.append(time.perf_counter() - t0)
        print(f"{name:26s} {c}x{h}x{w} -> {out[0]}x{out[1]}x{out[2]}: build {build:5.2f} CPU s, "
              f"{1e3 * np.median(times):7.3f} / {1e3 * np.min(times):7.3f} ms, rel. error {err:.1e}")


if __name__ == "__main__":
    main()
