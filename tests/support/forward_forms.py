"""Models whose ``forward`` (or ``model()``) is written in forms public BNN code uses and that used to stop
``convert`` or fail inside it, checked across processes by tests/user_code/test_forward_forms.py::

    python tests/support/forward_forms.py train DIR     # SVI per model; save each param store and the truth
    python tests/support/forward_forms.py convert DIR   # fresh process: rebuild, load each store, convert

* ``module-exp``: a research code base's ``BNNClassification``: a plain ``nn.Sequential`` (BatchNorm kept
  deterministic) made Bayesian with ``to_pyro_module_`` and ``PyroSample`` priors, ``forward`` registering it
  with ``pyro.module("model", self.model)``, calling ``self.model.forward(X)`` and returning
  ``logits.exp()`` (probabilities, the net ending in ``LogSoftmax``); the guide an ``AutoDiagonalNormal`` made
  in ``setup`` and held by the model; a ``BNNContainer`` (plain ``nn.Module``) holding model and guide is what
  is converted.
* ``module-exp-cnn``: the same on a small CNN (Conv2d, BatchNorm2d, ReLU, Linear).
* ``packaged-setattr``: a packaged classifier's ``model()``/``guide()`` methods that assign ``pyro.sample``
  tensors to the ``PyroModule[nn.Linear]`` layers of a ``PyroModule[nn.Sequential]`` (Linear, ReLU, Dropout)
  and run the layers inside the data plate, with ``Categorical(logits=out).to_event(1)``; hand-written guide
  with softplus scales.
* ``plate-len``: ``pyro.plate("instances", len(input))`` around the likelihood (the batch size fixed as an int).
* ``plate-len-view``: the same, with ``x.view(len(x), -1)`` flattening the input.

The truth is computed in the training process: the logits the author's network computes for guide samples
(for ``module-exp``, the network without its final ``LogSoftmax``, whose output PFP converts).  Every model
has one position per conv channel and mean-field posteriors, so PFP's logit moments are exact (a dense
layer's moments are exact for independent inputs) and only the Monte Carlo error of the truth remains.
"""
from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import pyro
import pyro.distributions as dist
import torch
import torch.nn as nn
import torch.nn.functional as F
from pyro import poutine
from pyro.infer import Predictive
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal
from pyro.nn import PyroModule, PyroSample
from pyro.nn.module import to_pyro_module_

if __name__ == "__main__":  # run as a worker script: the repository root on the path, for tests.support
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.support.store_forms import CLASSES, D_IN, HIDDEN, train_entry  # noqa: E402


# -------------------------------------------------------------------- pyro.module + to_pyro_module_ + exp
class BNNContainer(nn.Module):
    def __init__(self, model: PyroModule, guide: Any) -> None:
        super().__init__()
        self.model = model
        self.guide = guide

    def forward(self, X: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:  # noqa: N803
        return self.model(X, y)


class BNN(PyroModule):
    def __init__(self, model: nn.Module, mean: float, std: float) -> None:
        super().__init__()
        self.model = model
        self.mean = torch.tensor(mean)
        self.std = torch.tensor(std)

    @property
    def __name__(self) -> str:
        return self.model.__class__.__name__

    def setup(self, device: Any) -> None:
        self.to(device)
        self.mean = self.mean.to(device)
        self.std = self.std.to(device)
        self._pyroize()
        self.guide = AutoDiagonalNormal(self, init_scale=0.05)

    def _pyroize(self) -> None:
        to_pyro_module_(self.model)
        for m in self.model.modules():
            if not isinstance(m, nn.BatchNorm1d | nn.BatchNorm2d):
                for name, value in list(m.named_parameters(recurse=False)):
                    setattr(m, name, PyroSample(prior=dist.Normal(self.mean, self.std)
                                                .expand(value.shape).to_event(value.dim())))


class BNNClassification(BNN):
    def forward(self, X: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:  # noqa: N803
        pyro.module("model", self.model)
        logits = self.model.forward(X)
        with pyro.plate("data", X.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits.exp()


class SmallCNN(nn.Module):
    """A conv whose kernel covers the 2×4 "image" (one position per channel), BatchNorm2d, ReLU, a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 6, (2, 4))
        self.bn = nn.BatchNorm2d(6)
        self.fc = nn.Linear(6, CLASSES)
        self.out = nn.LogSoftmax(dim=1)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(torch.relu(self.bn(self.conv(x.view(-1, 1, 2, 4)))), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.fc(self.features(x)))


def _module_exp(cnn: bool) -> tuple[BNNContainer, BNNClassification]:
    body: nn.Module = SmallCNN() if cnn else nn.Sequential(
        nn.Linear(D_IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES), nn.LogSoftmax(dim=1))
    bnn = BNNClassification(body, 0.0, 1.0)
    bnn.setup("cpu")
    return BNNContainer(bnn, bnn.guide), bnn


def _logits_before_log_softmax(bnn: BNNClassification, x: torch.Tensor, n: int) -> torch.Tensor:
    """The author's network without its final LogSoftmax, for ``n`` guide samples (what PFP converts)."""
    out = []
    body = bnn.model
    for _ in range(n):
        sample = poutine.trace(bnn.guide).get_trace(x)
        with poutine.replay(trace=sample), poutine.block(hide_types=["param"]):
            if isinstance(body, nn.Sequential):
                h = x
                for layer in list(body)[:-1]:
                    h = layer(h)
            else:
                h = body.fc(body.features(x))
        out.append(h)
    return torch.stack(out)


# ---------------------------------------------------------------------- a packaged classifier's methods
class PackagedBNN(PyroModule):
    """Layers built in ``initialize_module``; ``model``/``guide`` assign samples to them inside the plate."""

    def __init__(self, hidden_size: int = HIDDEN, dropout: float = 0.2) -> None:
        super().__init__()
        self.hidden_size, self.dropout = hidden_size, dropout
        layers: list[nn.Module] = []
        input_size = D_IN
        for hidden in [self.hidden_size]:
            linear_layer = PyroModule[nn.Linear](input_size, hidden)
            linear_layer.weight = PyroSample(dist.Normal(0., 1.).expand([hidden, input_size]).to_event(2))
            linear_layer.bias = PyroSample(dist.Normal(0., 1.).expand([hidden]).to_event(1))
            layers += [linear_layer, nn.ReLU(), PyroModule[nn.Dropout](self.dropout)]
            input_size = hidden
        output_layer = PyroModule[nn.Linear](input_size, CLASSES)
        output_layer.weight = PyroSample(dist.Normal(0., 1.).expand([CLASSES, input_size]).to_event(2))
        output_layer.bias = PyroSample(dist.Normal(0., 1.).expand([CLASSES]).to_event(1))
        layers.append(output_layer)
        self.layers = PyroModule[nn.Sequential](*layers)

    def model(self, x: torch.Tensor, y: torch.Tensor) -> None:
        for i, layer in enumerate(self.layers):
            if isinstance(layer, PyroModule[nn.Linear]):
                weight_prior = dist.Normal(torch.zeros_like(layer.weight), torch.ones_like(layer.weight)).to_event(2)
                bias_prior = dist.Normal(torch.zeros_like(layer.bias), torch.ones_like(layer.bias)).to_event(1)
                layer.weight = pyro.sample(f"weight_{i}", weight_prior)
                layer.bias = pyro.sample(f"bias_{i}", bias_prior)
        with pyro.plate("data", x.shape[0]):
            out = self.layers(x)
            pyro.sample("obs", dist.Categorical(logits=out).to_event(1), obs=y)

    def guide(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if isinstance(layer, PyroModule[nn.Linear]):
                weight_loc = pyro.param(f"weight_loc_{i}", 0.1 * torch.randn_like(layer.weight))
                weight_scale = F.softplus(pyro.param(f"weight_scale_{i}", torch.full_like(layer.weight, -3.0)))
                bias_loc = pyro.param(f"bias_loc_{i}", torch.zeros_like(layer.bias))
                bias_scale = F.softplus(pyro.param(f"bias_scale_{i}", torch.full_like(layer.bias, -3.0)))
                layer.weight = pyro.sample(f"weight_{i}", dist.Normal(weight_loc, weight_scale).to_event(2))
                layer.bias = pyro.sample(f"bias_{i}", dist.Normal(bias_loc, bias_scale).to_event(1))
        with pyro.plate("data", x.shape[0]):
            out = self.layers(x)
            return F.softmax(out, dim=-1)


def _packaged_logits(bnn: PackagedBNN, x: torch.Tensor, n: int) -> torch.Tensor:
    """The logits of the layers for ``n`` guide samples (the guide assigns them; Dropout off)."""
    bnn.eval()
    out = []
    for _ in range(n):
        bnn.guide(x)
        out.append(bnn.layers(x))
    return torch.stack(out)


# --------------------------------------------------------------------------- the batch size as an int
class PlateLen(PyroModule):
    def __init__(self, view: bool) -> None:
        super().__init__()
        self.view = view
        self.fc1 = PyroModule[nn.Linear](D_IN, HIDDEN)
        self.fc1.weight = PyroSample(dist.Normal(0., 1.).expand([HIDDEN, D_IN]).to_event(2))
        self.fc1.bias = PyroSample(dist.Normal(0., 1.).expand([HIDDEN]).to_event(1))
        self.fc2 = PyroModule[nn.Linear](HIDDEN, CLASSES)
        self.fc2.weight = PyroSample(dist.Normal(0., 1.).expand([CLASSES, HIDDEN]).to_event(2))
        self.fc2.bias = PyroSample(dist.Normal(0., 1.).expand([CLASSES]).to_event(1))

    def forward(self, input: torch.Tensor, output: torch.Tensor | None = None) -> torch.Tensor:  # noqa: A002
        if self.view:
            input = input.view(len(input), -1)  # noqa: A001
        logits = self.fc2(torch.tanh(self.fc1(input)))
        with pyro.plate("instances", len(input)):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=output)
        return logits


# ------------------------------------------------------------------------------------------ the entries
def entry(name: str) -> dict[str, Any]:
    import pyro2pfp

    if name in ("module-exp", "module-exp-cnn"):
        container, bnn = _module_exp(name == "module-exp-cnn")
        return {"model": bnn, "guide": bnn.guide, "modules": [container],
                "truth": lambda x, n: _logits_before_log_softmax(bnn, x, n),
                "convert": lambda: pyro2pfp.convert(container, container.guide, input_shape=(D_IN,))}
    if name == "packaged-setattr":
        bnn = PackagedBNN()
        return {"model": bnn.model, "guide": bnn.guide, "modules": [bnn],
                "truth": lambda x, n: _packaged_logits(bnn, x, n),
                "convert": lambda: pyro2pfp.convert(bnn.model, bnn.guide, input_shape=(D_IN,))}
    if name in ("plate-len", "plate-len-view"):
        model = PlateLen(view=name == "plate-len-view")
        guide = AutoNormal(model, init_scale=0.05)

        def truth(x: torch.Tensor, n: int) -> torch.Tensor:
            return Predictive(model, guide=guide, num_samples=n, return_sites=("_RETURN",))(x)["_RETURN"]

        return {"model": model, "guide": guide, "modules": [model], "truth": truth,
                "convert": lambda: pyro2pfp.convert(model, guide, input_shape=(D_IN,))}
    raise KeyError(name)


ENTRIES = ("module-exp", "module-exp-cnn", "packaged-setattr", "plate-len", "plate-len-view")


def _module_state(modules: list[nn.Module]) -> list[tuple[str, str, bool, float]]:
    return sorted((f"{i}.{path}.{key}", type(value).__name__, m.training, float(value.detach().double().sum()))
                  for i, module in enumerate(modules) for path, m in module.named_modules()
                  for key, value in [*m._parameters.items(), *m._buffers.items()] if value is not None)


def train(out_dir: str) -> None:
    for name in ENTRIES:
        e = train_entry(name, entry, out_dir)
        torch.save({k: v for m in e["modules"] for k, v in m.state_dict().items() if "running" in k},
                   os.path.join(out_dir, f"{name}-buffers.pt"))


def convert(out_dir: str) -> None:
    for name in ENTRIES:
        truth = np.load(os.path.join(out_dir, f"{name}-truth.npz"))
        pyro.clear_param_store()
        e = entry(name)
        pyro.get_param_store().load(os.path.join(out_dir, f"{name}.pt"))
        buffers = torch.load(os.path.join(out_dir, f"{name}-buffers.pt"))
        for module in e["modules"]:  # BatchNorm's running statistics are buffers: the author saves them too
            module.load_state_dict(buffers, strict=False)
            module.eval()
        before = _module_state(e["modules"])
        net = e["convert"]()
        unchanged = _module_state(e["modules"]) == before
        mean, var = net.reference(truth["x"])
        np.savez(os.path.join(out_dir, f"{name}-pfp.npz"), mean=mean, var=var, unchanged=unchanged,
                 summary=str(net.summary()))


if __name__ == "__main__":
    torch.set_num_threads(1)
    (train if sys.argv[1] == "train" else convert)(sys.argv[2])
