"""Models written the way their authors write them, one per class of code that used to stop
``convert`` — device moves and views in ``forward``, ``pyro.random_module`` in the course-notebook
forms, samples assigned to module attributes — trained here, checked across processes by
tests/user_code/test_gallery_classes.py::

    python tests/support/gallery_classes.py train DIR    # SVI per model, save each param store + Predictive's answer
    python tests/support/gallery_classes.py convert DIR  # fresh process: build, load each store, convert, save PFP's
                                                         # answer

All are one-hidden-layer networks with mean-field posteriors and deterministic inputs: PFP's logit
moments are exact, so only the Monte Carlo error of the truth remains.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pyro
import pyro.distributions as dist
import torch
import torch.nn as nn
import torch.nn.functional as F
from pyro.distributions import Categorical, Normal
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroSample

D_IN, HIDDEN, CLASSES = 8, 12, 3
N_TRAIN, N_TEST, STEPS = 128, 16, 150
MC_SAMPLES = 600
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, 4, generator=g)  # small "images", flattened by the models
    flat = x.reshape(n, -1)
    return x, (flat[:, 0] > 0).long() + (flat[:, 1] > 0.5).long()


# ------------------------------------------------------------------- (a) device moves and views
class DeviceMovesNet(PyroModule):
    """A tutorial-style MLP whose forward moves itself and its input to ``device`` and views the
    input as ``x.view(-1, 8)``; the hidden layer is the Pyro modules tutorial's own ``Linear``
    (``self.bias + input @ self.weight``), the plate sized by ``x.size(0)``."""

    class Linear(PyroModule):
        def __init__(self, in_size: int, out_size: int) -> None:
            super().__init__()
            self.weight = PyroSample(dist.Normal(0.0, 1.0).expand([in_size, out_size]).to_event(2))
            self.bias = PyroSample(dist.Normal(0.0, 1.0).expand([out_size]).to_event(1))

        def forward(self, input_: torch.Tensor) -> torch.Tensor:
            return self.bias + input_ @ self.weight

    def __init__(self) -> None:
        super().__init__()
        self.hidden = DeviceMovesNet.Linear(D_IN, HIDDEN)
        self.out = PyroModule[nn.Linear](HIDDEN, CLASSES)
        self.out.weight = PyroSample(dist.Normal(0.0, 1.0).expand([CLASSES, HIDDEN]).to_event(2))
        self.out.bias = PyroSample(dist.Normal(0.0, 1.0).expand([CLASSES]).to_event(1))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        self.to(device)
        x = x.to(device)
        if torch.cuda.is_available():
            x = x.cuda()
        h = F.relu(self.hidden(x.view(-1, D_IN)))
        logits = self.out(h).cpu()
        with pyro.plate("data", x.size(0)):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


# ------------------------------------------------------------------------ (b) random_module forms
class NN(nn.Module):
    def __init__(self, input_size: int, hidden_size: int, output_size: int) -> None:
        super(NN, self).__init__()  # noqa: UP008  (as the notebook writes it)
        self.fc1 = nn.Linear(input_size, hidden_size)
        self.out = nn.Linear(hidden_size, output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, D_IN)
        output = self.fc1(x)
        output = F.relu(output)
        output = self.out(output)
        return output


def notebook_random_module() -> tuple[Callable[..., Any], Callable[..., Any], NN]:
    """The course notebook: a model function lifting ``net``, a guide lifting it with its own Normal
    priors built from ``pyro.param``; both take ``(x_data, y_data)``; the model returns nothing."""
    net = NN(D_IN, HIDDEN, CLASSES)
    log_softmax = nn.LogSoftmax(dim=1)
    softplus = torch.nn.Softplus()

    def model(x_data: torch.Tensor, y_data: torch.Tensor) -> None:
        fc1w_prior = Normal(loc=torch.zeros_like(net.fc1.weight), scale=torch.ones_like(net.fc1.weight))
        fc1b_prior = Normal(loc=torch.zeros_like(net.fc1.bias), scale=torch.ones_like(net.fc1.bias))
        outw_prior = Normal(loc=torch.zeros_like(net.out.weight), scale=torch.ones_like(net.out.weight))
        outb_prior = Normal(loc=torch.zeros_like(net.out.bias), scale=torch.ones_like(net.out.bias))
        priors = {"fc1.weight": fc1w_prior.to_event(2), "fc1.bias": fc1b_prior.to_event(1),
                  "out.weight": outw_prior.to_event(2), "out.bias": outb_prior.to_event(1)}
        lifted_module = pyro.random_module("module", net, priors)
        lifted_reg_model = lifted_module()
        lhat = log_softmax(lifted_reg_model(x_data))
        with pyro.plate("data", x_data.shape[0]):
            pyro.sample("obs", Categorical(logits=lhat), obs=y_data)

    def guide(x_data: torch.Tensor, y_data: torch.Tensor) -> nn.Module:
        priors = {}
        for name, p in net.named_parameters():
            mu_param = pyro.param(f"{name}_mu", lambda p=p: 0.1 * torch.randn_like(p))
            sigma_param = softplus(pyro.param(f"{name}_sigma", lambda p=p: torch.full_like(p, -3.0)))
            priors[name] = Normal(loc=mu_param, scale=sigma_param).to_event(p.dim())
        lifted_module = pyro.random_module("module", net, priors)
        return lifted_module()

    return model, guide, net


class BayesianClassifier(PyroModule):
    """The same as methods of a PyroModule whose forward moves the net and the input to ``device``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = NN(D_IN, HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.net.to(device)
        return self.net(x.to(device))

    def model(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        priors = {n: Normal(torch.zeros_like(p), torch.ones_like(p)).to_event(p.dim())
                  for n, p in self.net.named_parameters()}
        lifted = pyro.random_module("module", self.net, priors)()
        logits = lifted(x.to(device))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", Categorical(logits=logits), obs=y)
        return logits

    def guide(self, x: torch.Tensor, y: torch.Tensor) -> nn.Module:
        dists = {}
        for n, p in self.net.named_parameters():
            mu = pyro.param(f"guide.{n}.mu", lambda p=p: 0.1 * torch.randn_like(p))
            sigma = F.softplus(pyro.param(f"guide.{n}.sigma", lambda p=p: torch.full_like(p, -3.0)))
            dists[n] = Normal(mu, sigma).to_event(p.dim())
        return pyro.random_module("module", self.net, dists)()


# ------------------------------------------------------------ (c) samples assigned to attributes
class SequentialBNN(PyroModule):
    """``layer.weight = pyro.sample(...)`` in ``model()`` and in the guide, on a
    ``PyroModule[nn.Sequential]`` with Dropout whose Linear layers had their parameters removed."""

    def __init__(self, p: float = 0.2) -> None:
        super().__init__()
        self.net = PyroModule[nn.Sequential](
            PyroModule[nn.Linear](D_IN, HIDDEN), nn.ReLU(), nn.Dropout(p), PyroModule[nn.Linear](HIDDEN, CLASSES))
        self.linears = [self.net[0], self.net[3]]
        for layer in self.linears:
            del layer.weight
            del layer.bias

    def model(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        for i, layer in enumerate(self.linears):
            layer.weight = pyro.sample(f"w{i}", dist.Normal(torch.zeros(layer.out_features, layer.in_features),
                                                             1.0).to_event(2))
            layer.bias = pyro.sample(f"b{i}", dist.Normal(torch.zeros(layer.out_features), 1.0).to_event(1))
        logits = self.net(x.view(x.shape[0], -1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits

    def guide(self, x: torch.Tensor, y: torch.Tensor | None = None) -> None:
        for i, layer in enumerate(self.linears):
            w_shape, b_shape = (layer.out_features, layer.in_features), (layer.out_features,)
            w_loc = pyro.param(f"w{i}_loc", lambda s=w_shape: 0.1 * torch.randn(s))
            w_scale = pyro.param(f"w{i}_scale", lambda s=w_shape: torch.full(s, 0.05),
                                 constraint=dist.constraints.positive)
            b_loc = pyro.param(f"b{i}_loc", lambda s=b_shape: torch.zeros(s))
            b_scale = pyro.param(f"b{i}_scale", lambda s=b_shape: torch.full(s, 0.05),
                                 constraint=dist.constraints.positive)
            layer.weight = pyro.sample(f"w{i}", dist.Normal(w_loc, w_scale).to_event(2))
            layer.bias = pyro.sample(f"b{i}", dist.Normal(b_loc, b_scale).to_event(1))


# ------------------------------------------------------------------------------------ the entries
def _entry(name: str) -> dict[str, Any]:
    """``model``/``guide`` (what SVI trains), ``truth(x, n)`` (samples of the logits) and
    ``convert()`` (as the user calls it) for one entry, freshly built."""
    import pyro2pfp

    shape = (2, 4)
    if name == "device-moves":
        model = DeviceMovesNet()
        guide = AutoNormal(model, init_scale=0.01)
        return {"model": model, "guide": guide, "modules": [model],
                "truth": lambda x, n: Predictive(model, guide=guide, num_samples=n, return_sites=("_RETURN",))(x)[
                    "_RETURN"],
                "convert": lambda: pyro2pfp.convert(model, guide, input_shape=shape)}
    if name in ("notebook-function", "notebook-net"):
        model, guide, net = notebook_random_module()
        target = model if name == "notebook-function" else net
        return {"model": model, "guide": guide, "modules": [net],
                "truth": lambda x, n: torch.stack([guide(None, None)(x) for _ in range(n)]),
                "convert": lambda: pyro2pfp.convert(target, guide, input_shape=shape)}
    if name in ("methods-model", "methods-module"):
        bnn = BayesianClassifier()
        target = bnn.model if name == "methods-model" else bnn
        return {"model": bnn.model, "guide": bnn.guide, "modules": [bnn],
                "truth": lambda x, n: torch.stack([bnn.guide(None, None)(x) for _ in range(n)]),
                "convert": lambda: pyro2pfp.convert(target, bnn.guide, input_shape=shape)}
    if name == "setattr-sequential":
        bnn = SequentialBNN()

        def truth(x: torch.Tensor, n: int) -> torch.Tensor:
            bnn.eval()  # Dropout off at prediction, as PFP converts it
            return Predictive(bnn.model, guide=bnn.guide, num_samples=n, return_sites=("_RETURN",))(x)["_RETURN"]

        return {"model": bnn.model, "guide": bnn.guide, "modules": [bnn], "truth": truth,
                "convert": lambda: pyro2pfp.convert(bnn.model, bnn.guide, input_shape=shape)}
    raise KeyError(name)


ENTRIES = ("device-moves", "notebook-function", "notebook-net", "methods-model", "methods-module",
           "setattr-sequential")
_TRAINED_AS = {"notebook-net": "notebook-function", "methods-module": "methods-model"}  # same model, other call


def _module_state(modules: list[nn.Module]) -> list[tuple[str, str, bool]]:
    """What convert must leave as it found it: each attribute's type, and the train/eval mode."""
    return sorted((f"{i}.{path}.{key}", type(value).__name__, m.training)
                  for i, module in enumerate(modules) for path, m in module.named_modules()
                  for key, value in [*m._parameters.items(), *((k, v) for k, v in vars(m).items()
                                                               if isinstance(v, torch.Tensor))])


def train(out_dir: str) -> None:
    x, y = data(N_TRAIN, 0)
    x_test, _ = data(N_TEST, 7)
    for name in ENTRIES:
        if name in _TRAINED_AS:
            continue
        pyro.clear_param_store()
        pyro.set_rng_seed(1)
        entry = _entry(name)
        svi = SVI(entry["model"], entry["guide"], pyro.optim.Adam({"lr": 0.03}), Trace_ELBO())
        for _ in range(STEPS):
            svi.step(x, y)
        with torch.no_grad():
            samples = entry["truth"](x_test, MC_SAMPLES).double().numpy()
        pyro.get_param_store().save(os.path.join(out_dir, f"{name}.pt"))
        np.savez(os.path.join(out_dir, f"{name}-truth.npz"), x=x_test.numpy(), mean=samples.mean(0),
                 var=samples.var(0, ddof=1))


def convert(out_dir: str) -> None:
    x, y = data(4, 3)
    for name in ENTRIES:
        trained = _TRAINED_AS.get(name, name)
        truth = np.load(os.path.join(out_dir, f"{trained}-truth.npz"))
        pyro.clear_param_store()
        entry = _entry(name)
        pyro.get_param_store().load(os.path.join(out_dir, f"{trained}.pt"))
        before = _module_state(entry["modules"])
        net = entry["convert"]()
        unchanged = _module_state(entry["modules"]) == before
        entry["guide"](x, y)  # the user's own guide still runs on their objects
        mean, var = net.reference(truth["x"])
        np.savez(os.path.join(out_dir, f"{name}-pfp.npz"), mean=mean, var=var, unchanged=unchanged)


if __name__ == "__main__":
    torch.set_num_threads(1)
    (train if sys.argv[1] == "train" else convert)(sys.argv[2])
