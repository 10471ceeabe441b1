"""Throughput of the PFP conv2d kernel (default schedule) on ResNet shapes, against torch's deterministic
conv2d on the same shapes, both on one thread.

A PFP conv computes three convolutions per layer -- the mean ``Σ μw·μx`` and the two variance
terms ``Σ μw²·vx`` and ``Σ vw·(μx² + vx)`` (``docs/math.md`` "Compute layers", variance form) -- so at equal arithmetic
throughput it takes 3x the deterministic conv's time.  This script prints the GFLOP/s of both
(counting 2 flops per multiply-add, 3 products per PFP tap) and the time ratio, which is what bounds
a ResNet's PFP/deterministic latency ratio once the convs dominate (batch >= 10).

``direct`` is the direct PFP conv kernel (``compute.conv2d``); ``Winograd`` the F(2x2, 3x3) kernel
(``winograd.py``) on the layers :func:`~pyro2pfp.tvm_backend.ops.winograd.use_winograd` picks
(``-`` elsewhere); ``default`` is what ``net.compile()`` uses.  Both count the direct algorithm's
flops (so Winograd's GFLOP/s is "effective": 2.25x fewer multiplies are done).

    PYTHONPATH=. .venv/bin/python benchmarks/conv_throughput.py [--batch 10] [--repeats 60]

Times are the minimum over ``--repeats`` calls (``exe(x, x_var)`` from NumPy, resp. ``F.conv2d``).
"""
from __future__ import annotations

import argparse
import time
import warnings

import numpy as np

CASES = [(16, 16, 32, 1), (32, 32, 16, 1), (64, 64, 8, 1), (16, 32, 32, 2), (32, 64, 16, 2)]


def best_time(fn, args: tuple, repeats: int, **kwargs) -> float:
    fn(*args, **kwargs)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    import torch
    import torch.nn.functional as F

    import pyro2pfp
    from pyro2pfp.graph import INPUT, GaussianParam, Layer, LayerGraph
    from pyro2pfp.network import PFPNetwork
    from pyro2pfp.plan import plan
    from pyro2pfp.tvm_backend.ops.winograd import direct_convolutions, use_winograd

    pyro2pfp.set_num_threads(1)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    print(f"batch {args.batch}, one thread; load average {__import__('os').getloadavg()[0]:.1f}")
    print(f"{'conv (3x3, pad 1)':<24} {'direct ms':>9} {'GFLOP/s':>8} {'Winograd ms':>11} {'GFLOP/s':>8} "
          f"{'torch ms':>9} {'GFLOP/s':>8} {'default/torch':>13}")
    for c, o, n, stride in CASES:
        out_n = (n + 2 - 3) // stride + 1
        weight = GaussianParam(0.1 * rng.standard_normal((o, c, 3, 3)), 0.01 * rng.uniform(0.1, 1, (o, c, 3, 3)))
        bias = GaussianParam(0.1 * rng.standard_normal(o), 0.01 * rng.uniform(0.1, 1, o))
        layer = Layer("c", "conv2d", [INPUT], (o, out_n, out_n), "c",
                      attrs={"stride": [stride] * 2, "padding": [1, 1], "dilation": [1, 1], "groups": 1},
                      params={"weight": weight, "bias": bias})
        graph = LayerGraph((c, n, n), [layer], "c", input_variance=True)
        planned = plan(graph)
        x = rng.standard_normal((args.batch, c, n, n)).astype(np.float32)
        v = (0.1 * rng.uniform(size=x.shape)).astype(np.float32)
        with direct_convolutions():
            exes = {"direct": PFPNetwork(graph, planned).compile()}
        if use_winograd(planned.layers[0], planned.layers[0].in_reprs[0]):
            exes["winograd"] = PFPNetwork(graph, planned).compile()
        ref = PFPNetwork(graph, planned).reference(x, v)
        times = {}
        for key, exe in exes.items():
            err = max(float(np.abs(a - r).max() / np.abs(r).max()) for a, r in zip(exe(x, v), ref))
            assert err < 1e-4, f"compiled {key} conv disagrees with the reference: {err:.1e}"
            times[key] = best_time(exe, (x, v), args.repeats)
        xt, wt, bt = torch.from_numpy(x), torch.from_numpy(weight.mean.astype(np.float32)), torch.from_numpy(
            bias.mean.astype(np.float32))
        with torch.no_grad():
            det = best_time(F.conv2d, (xt, wt, bt), args.repeats, stride=stride, padding=1)
        macs = args.batch * o * out_n * out_n * c * 9
        name = f"{c}->{o}, {n}x{n}, stride {stride}"
        direct, wino = times["direct"], times.get("winograd")
        wino_cols = (f"{wino * 1e3:>11.3f} {6 * macs / wino / 1e9:>8.1f}" if wino is not None
                     else f"{'-':>11} {'-':>8}")
        default = wino if wino is not None else direct
        print(f"{name:<24} {direct * 1e3:>9.3f} {6 * macs / direct / 1e9:>8.1f} {wino_cols} {det * 1e3:>9.3f} "
              f"{2 * macs / det / 1e9:>8.1f} {default / det:>12.2f}x")


if __name__ == "__main__":
    main()
