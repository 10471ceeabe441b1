"""Correlated Gaussian guides across processes, checked by tests/user_code/test_guide_forms.py::

    python tests/support/guide_forms.py train DIR     # SVI per entry; save each param store and the truth
    python tests/support/guide_forms.py convert DIR   # fresh process: rebuild, load each store, convert
                                                      # (correlation='auto'), save the three back ends' answers

Models written as tutorials write them (``PyroModule[nn.Linear]``/``[nn.Conv2d]`` with ``PyroSample`` priors,
``pyro.plate`` + ``Categorical``), trained briefly (wide posteriors):

* ``lowrank-mlp``: an 8-32-32-3 ReLU classifier, ``AutoLowRankMultivariateNormal(rank=5)``;
* ``lowrank-cnn``: conv(1→4, 3)-ReLU-max pool-conv(4→8, 3)-ReLU-flatten-dense(72→3) on 12×12 images,
  ``AutoLowRankMultivariateNormal(rank=5)``;
* ``mvn-mlp``: the MLP with ``AutoMultivariateNormal`` (1,443 latent dimensions: its top 32 directions).

The truth is ``Predictive`` on the same guide in the training process (``MC_SAMPLES`` samples of the logits: their
mean, variance and kurtosis, which sets the variance's sampling error).
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import numpy as np
import pyro
import pyro.distributions as dist
import torch
import torch.nn as nn
import torch.nn.functional as F
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoLowRankMultivariateNormal, AutoMultivariateNormal
from pyro.nn import PyroModule, PyroSample

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.support.store_forms import CLASSES, D_IN  # noqa: E402

HIDDEN = 32
N_TRAIN, N_TEST, STEPS = 256, 16, 300
MC_SAMPLES = 2000
ENTRIES = ("lowrank-mlp", "lowrank-cnn", "mvn-mlp")


def _linear(a: int, b: int) -> PyroModule:
    layer = PyroModule[nn.Linear](a, b)
    layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand([b, a]).to_event(2))
    layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand([b]).to_event(1))
    return layer


def _conv(a: int, b: int, k: int) -> PyroModule:
    layer = PyroModule[nn.Conv2d](a, b, k)
    layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand([b, a, k, k]).to_event(4))
    layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand([b]).to_event(1))
    return layer


class MLP(PyroModule):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.out = _linear(D_IN, HIDDEN), _linear(HIDDEN, HIDDEN), _linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        logits = self.out(x)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


class CNN(PyroModule):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2, self.fc = _conv(1, 4, 3), _conv(4, 8, 3), _linear(72, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x))
        logits = self.fc(torch.flatten(x, 1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


def data(name: str, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and labels: 3 classes of Gaussian blobs (features), or of noisy bars (12×12 images)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    if name.endswith("cnn"):
        img = 0.3 * torch.randn(n, 1, 12, 12, generator=g)
        for c in range(CLASSES):
            img[y == c, 0, 2 + 4 * c:4 + 4 * c, :] += 1.0
        return img, y
    centres = torch.randn(CLASSES, D_IN, generator=torch.Generator().manual_seed(0))
    return centres[y] + 0.8 * torch.randn(n, D_IN, generator=g), y


def entry(name: str) -> tuple[Any, Any]:
    """``(model, guide)``, freshly built."""
    model = CNN() if name.endswith("cnn") else MLP()
    if name.startswith("mvn"):
        return model, AutoMultivariateNormal(model, init_scale=0.05)
    return model, AutoLowRankMultivariateNormal(model, rank=5, init_scale=0.05)


def train(out_dir: str) -> None:
    for name in ENTRIES:
        x, y = data(name, N_TRAIN, 0)
        x_test, _ = data(name, N_TEST, 7)
        pyro.clear_param_store()
        pyro.set_rng_seed(1)
        model, guide = entry(name)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
        for _ in range(STEPS):
            svi.step(x, y)
        with torch.no_grad():  # in chunks: a full-covariance guide's samples each hold its D × D factor
            samples = np.concatenate([Predictive(model, guide=guide, num_samples=50, return_sites=("_RETURN",))(
                x_test)["_RETURN"].double().numpy() for _ in range(MC_SAMPLES // 50)])
        pyro.get_param_store().save(os.path.join(out_dir, f"{name}.pt"))
        centred = samples - samples.mean(0)
        np.savez(os.path.join(out_dir, f"{name}-truth.npz"), x=x_test.numpy(), mean=samples.mean(0),
                 var=samples.var(0, ddof=1), kurtosis=(centred**4).mean(0) / (centred**2).mean(0) ** 2)


def convert(out_dir: str) -> None:
    import pyro2pfp
    from tests.support.backends import onnx_run

    for name in ENTRIES:
        truth = np.load(os.path.join(out_dir, f"{name}-truth.npz"))
        pyro.clear_param_store()
        model, guide = entry(name)
        pyro.get_param_store().load(os.path.join(out_dir, f"{name}.pt"))
        x = truth["x"]
        # the posterior check on: it whitens the full covariance's float32 samples over the directions their
        # rounding cannot reach (its trained unit-lower-triangular factor over 1,443 dimensions is ill-conditioned)
        net = pyro2pfp.convert(model, guide, input_shape=tuple(x.shape[1:]))
        mean, var = net.reference(x)
        with warnings.catch_warnings():  # "the guide's correlations between weights are dropped"
            warnings.simplefilter("ignore")
            marginals = pyro2pfp.convert(model, guide, input_shape=tuple(x.shape[1:]), correlation="mean-field",
                                         check=False, check_posterior=False)
        mf_mean, mf_var = marginals.reference(x)
        onnx_mean, onnx_var = onnx_run(net, x)
        tvm_mean, tvm_var = (np.asarray(a) for a in net.compile()(x))
        info = net.plan.guide_factors
        np.savez(os.path.join(out_dir, f"{name}-pfp.npz"), mean=mean, var=var, onnx_mean=onnx_mean,
                 onnx_var=onnx_var, mf_mean=mf_mean, mf_var=mf_var, tvm_mean=tvm_mean, tvm_var=tvm_var,
                 summary=str(net.summary()),
                 guide=0 if net.plan.factors is None else net.plan.factors.guide, k=info.k if info else 0)


if __name__ == "__main__":
    torch.set_num_threads(1)
    (train if sys.argv[1] == "train" else convert)(sys.argv[2])
