"""The deployment lifecycle as users live it, one step per process (run by tests/user_code/test_lifecycle.py).

    python lifecycle_worker.py train KIND DIR     # SVI, save the param store + Predictive's answers
    python lifecycle_worker.py convert KIND DIR   # fresh process: build, load, convert, compare

Models and guides are written the way Pyro's tutorials, TyXe and public BNN code write them (not
with pyro2pfp's own builders).  The truth the converted network is compared with is
``pyro.infer.Predictive`` run in the *training* process, before anything was saved.
"""
from __future__ import annotations

import functools
import json
import os
import sys

import numpy as np
import pyro
import pyro.distributions as dist
import torch
import torch.nn as nn
import torch.nn.functional as F
from pyro import poutine
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal, AutoGuideList, AutoLowRankMultivariateNormal, AutoNormal
from pyro.nn import PyroModule, PyroSample

D_IN, HIDDEN, CLASSES, IMAGE = 8, 24, 3, 12
MC_SAMPLES = 2000


class TutorialMLP(PyroModule):
    """The Pyro tutorial style: PyroModule[nn.Linear] children with PyroSample priors."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = PyroModule[nn.Linear](D_IN, HIDDEN)
        self.fc1.weight = PyroSample(dist.Normal(0.0, 1.0).expand([HIDDEN, D_IN]).to_event(2))
        self.fc1.bias = PyroSample(dist.Normal(0.0, 1.0).expand([HIDDEN]).to_event(1))
        self.out = PyroModule[nn.Linear](HIDDEN, CLASSES)
        self.out.weight = PyroSample(dist.Normal(0.0, 1.0).expand([CLASSES, HIDDEN]).to_event(2))
        self.out.bias = PyroSample(dist.Normal(0.0, 1.0).expand([CLASSES]).to_event(1))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.out(F.relu(self.fc1(x)))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


class SmallLeNet(PyroModule):
    """A LeNet-style CNN: conv → relu → max-pool ×2 → flatten → linear ×2, Normal priors."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = PyroModule[nn.Conv2d](1, 4, 3, padding=1)
        self.conv2 = PyroModule[nn.Conv2d](4, 6, 3)
        self.fc1 = PyroModule[nn.Linear](6 * 2 * 2, 16)
        self.fc2 = PyroModule[nn.Linear](16, CLASSES)
        for layer in (self.conv1, self.conv2, self.fc1, self.fc2):
            layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand(layer.weight.shape).to_event(layer.weight.dim()))
            layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand(layer.bias.shape).to_event(1))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        logits = self.fc2(F.relu(self.fc1(x.view(x.size(0), -1))))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


def handwritten_guide(model: TutorialMLP):
    """A guide written by hand (Bayes-by-backprop style): loc and softplus(rho) params per site."""
    shapes = {"fc1.weight": (HIDDEN, D_IN), "fc1.bias": (HIDDEN,),
              "out.weight": (CLASSES, HIDDEN), "out.bias": (CLASSES,)}

    def guide(x, y=None):
        for site, shape in shapes.items():
            loc = pyro.param(f"{site}_loc", lambda shape=shape: 0.1 * torch.randn(shape))
            rho = pyro.param(f"{site}_rho", lambda shape=shape: torch.full(shape, -5.0))
            pyro.sample(site, dist.Normal(loc, F.softplus(rho)).to_event(len(shape)))

    return guide


def _tyxe_bnn():
    import tyxe

    import pyro2pfp.compat

    pyro2pfp.compat.patch_pyro_for_tyxe()
    body = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
    return tyxe.VariationalBNN(body, tyxe.priors.IIDPrior(dist.Normal(0.0, 1.0)),
                               tyxe.likelihoods.Categorical(dataset_size=256),
                               functools.partial(tyxe.guides.AutoNormal, init_scale=0.01))


def guide_list(model: TutorialMLP):
    """An AutoGuideList: AutoNormal on the first layer, AutoDiagonalNormal on the output layer."""
    first = ["fc1.weight", "fc1.bias"]
    guide = AutoGuideList(model)
    guide.append(AutoNormal(poutine.block(model, expose=first), init_scale=0.01))
    guide.append(AutoDiagonalNormal(poutine.block(model, hide=first), init_scale=0.01))
    return guide


KINDS = {
    "autonormal-mlp": (TutorialMLP, AutoNormal),
    "diagonal-mlp": (TutorialMLP, AutoDiagonalNormal),
    "lowrank-mlp": (TutorialMLP, functools.partial(AutoLowRankMultivariateNormal, rank=2, init_scale=0.01)),
    "handwritten-mlp": (TutorialMLP, handwritten_guide),
    "guidelist-mlp": (TutorialMLP, guide_list),
    "tyxe-mlp": (None, None),
    "autonormal-lenet": (SmallLeNet, AutoNormal),
}
# Mean-field posterior, one hidden layer, deterministic input: PFP's logit moments are exact.
# (The low-rank guide correlates the weights, which PFP drops: approximate.)
EXACT = {"autonormal-mlp", "diagonal-mlp", "handwritten-mlp", "guidelist-mlp", "tyxe-mlp"}


def build(kind: str):
    """Fresh (model, guide, thing to pass to convert) for ``kind``."""
    if kind == "tyxe-mlp":
        bnn = _tyxe_bnn()
        return bnn.net, bnn.net_guide, bnn
    model_cls, guide_fn = KINDS[kind]
    model = model_cls()
    guide = guide_fn(model)
    return model, guide, None


def data(kind: str, n: int = 256, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if kind.endswith("lenet"):
        x = torch.randn(n, 1, IMAGE, IMAGE, generator=g)
        x[:, :, :6, :6] += 1.5 * (torch.arange(n) % CLASSES == 0).float()[:, None, None, None]
        x[:, :, 6:, 6:] += 1.5 * (torch.arange(n) % CLASSES == 1).float()[:, None, None, None]
        return x, torch.arange(n) % CLASSES
    x = torch.randn(n, D_IN, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return x, y


def train(kind: str, out_dir: str) -> None:
    pyro.set_rng_seed(1)
    model, guide, bnn = build(kind)
    x, y = data(kind)
    if bnn is not None:
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)
        bnn.fit(loader, pyro.optim.Adam({"lr": 0.02}), 60)
    else:
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.03}), Trace_ELBO())
        for _ in range(300):
            svi.step(x, y)
    x_test, _ = data(kind, n=48, seed=7)
    with torch.no_grad():
        logits = Predictive(model, guide=guide, num_samples=MC_SAMPLES, return_sites=("_RETURN",))(
            x_test)["_RETURN"].double().numpy()
    pyro.get_param_store().save(os.path.join(out_dir, f"{kind}.pt"))
    np.savez(os.path.join(out_dir, f"{kind}-truth.npz"), x=x_test.numpy(), mean=logits.mean(0),
             var=logits.var(0, ddof=1))


def _load(path: str, how: str) -> None:
    if how == "load":
        pyro.get_param_store().load(path)
    else:
        pyro.get_param_store().set_state(torch.load(path, weights_only=False))


def convert(kind: str, out_dir: str) -> None:
    """Every lifecycle of a fresh process; writes one npz per lifecycle and a JSON summary."""
    import pyro2pfp

    truth = np.load(os.path.join(out_dir, f"{kind}-truth.npz"))
    x = truth["x"]
    path = os.path.join(out_dir, f"{kind}.pt")
    summary = {}
    for run_first in (False, True):
        for how in ("load", "set_state"):
            pyro.clear_param_store()
            model, guide, bnn = build(kind)
            if run_first:  # e.g. one Predictive call, or the guide run once as Pyro's docs advise
                xb, yb = torch.as_tensor(x[:2]), torch.zeros(2, dtype=torch.long)
                with torch.no_grad():
                    guide(xb) if bnn is not None else guide(xb, yb)
            _load(path, how)
            net = pyro2pfp.convert(bnn) if bnn is not None else pyro2pfp.convert(model, guide, input_shape=x.shape[1:])
            mean, var = net.reference(x)
            lifecycle = f"{'run-guide-then-' if run_first else ''}{how}"
            outputs = {"mean": mean, "var": var}
            if lifecycle == "load":  # compiled once per kind (compiling is the slow part)
                outputs["compiled_mean"], outputs["compiled_var"] = net.compile()(x)
            np.savez(os.path.join(out_dir, f"{kind}-{lifecycle}.npz"), **outputs)
            summary[lifecycle] = True
    with open(os.path.join(out_dir, f"{kind}-done.json"), "w") as f:
        json.dump(summary, f)


if __name__ == "__main__":
    step, kind, directory = sys.argv[1:4]
    torch.set_num_threads(1)
    (train if step == "train" else convert)(kind, directory)
