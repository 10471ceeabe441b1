"""Prediction-time cost of the correlation-aware NumPy prototype (pyro2pfp.correlation) against the
mean-field NumPy reference on ResNet-8/20 (3×32×32, batch 1, best of 3).

    PYTHONPATH=. python benchmarks/correlation_cost.py
"""
import time

import numpy as np
import torch

import pyro2pfp
from pyro2pfp.correlation import execute_correlated
from pyro2pfp_experiments.zoo import bayesian_resnet, he_posterior

torch.manual_seed(0)
for blocks in (1, 3):
    m=bayesian_resnet(blocks); x=torch.randn(1,3,32,32); g=he_posterior(m,x)
    net=pyro2pfp.convert(m,g,input_shape=(3,32,32)); xn=x.numpy().astype(np.float64)
    def t(f, n=3):
        ts=[]
        for _ in range(n):
            a=time.perf_counter(); f(); ts.append(time.perf_counter()-a)
        return 1e3*min(ts)
    print(f"resnet{6*blocks+2}: NumPy reference {t(lambda: net.reference(xn)):.0f} ms, correlated prototype {t(lambda: execute_correlated(net.plan, xn)):.0f} ms (batch 1, best of 3)")
