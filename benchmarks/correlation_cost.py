"""Prediction-time cost of shared-factor PFP (``convert(..., correlation="shared-factor")``, NumPy float64
reference) against the mean-field NumPy reference on ResNet-8/20 (3×32×32, batch 1, best of 3), and its
cost model (multiply-adds and stored floats per input, :func:`pyro2pfp.correlation.cost_model`).

    PYTHONPATH=. python benchmarks/correlation_cost.py
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

import pyro2pfp
from pyro2pfp.correlation import cost_model
from pyro2pfp_experiments.zoo import bayesian_resnet, he_posterior


def best_ms(fn: Callable[[], object], repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def main() -> None:
    torch.manual_seed(0)
    for blocks in (1, 3):
        model = bayesian_resnet(blocks)
        x = torch.randn(1, 3, 32, 32)
        guide = he_posterior(model, x)
        mean_field = pyro2pfp.convert(model, guide, input_shape=(3, 32, 32), correlation="mean-field",
                                      check=False)
        shared = pyro2pfp.convert(model, guide, input_shape=(3, 32, 32), correlation="shared-factor",
                                  check=False)
        xn = x.numpy().astype(np.float64)
        ref = best_ms(lambda: mean_field.reference(xn))  # noqa: B023  (called within the iteration)
        corr = best_ms(lambda: shared.reference(xn))  # noqa: B023
        print(f"resnet{6 * blocks + 2}: NumPy reference {ref:.0f} ms, shared factors {corr:.0f} ms "
              f"(batch 1, best of 3); {cost_model(shared.plan).summary()}")


if __name__ == "__main__":
    main()
