"""Models whose deterministic parameters live in the param store, written the way public code writes them,
checked across processes by tests/user_code/test_store_forms.py::

    python tests/support/store_forms.py train DIR     # SVI per model; save each param store and the truth
    python tests/support/store_forms.py convert DIR   # fresh process: rebuild, load each store, convert, save
                                                      # PFP's answer

Every model has deterministic layers (trained, registered in the param store) and a Bayesian part; in a fresh
process the rebuilt module objects hold their *initial* values, and only the param store holds the trained
ones (``pyro.get_param_store().load(path)`` restores nothing else).  The truth is computed in the training
process, where module and store share their tensors, the way each author predicts: Predictive on the model
and guide, or the notebook's ``[guide(None, None)(x) for _ in range(n)]``.

* ``rm-notebook``: a course notebook's MNIST-style classifier: three ``nn.Linear`` + Tanh layers and the
  output layer made Bayesian by ``pyro.random_module("module", net, priors)`` with priors for ``out`` only,
  a hand-written guide (``pyro.param`` locs and softplus scales); ``convert(model, guide)``.
* ``rm-notebook-net``: the same, ``convert(net, guide)``.
* ``rm-methods``: the same as methods of a ``PyroModule`` (``convert(bnn.model, bnn.guide)``).
* ``module-in-model``: a ``PyroModule`` whose ``forward`` registers a plain ``nn.Sequential`` feature
  extractor with ``pyro.module("features", self.body)`` and ends in a Bayesian ``PyroModule[nn.Linear]``;
  ``AutoNormal``.
* ``module-in-guide``: a model function on a plain feature extractor and a functional Bayesian last layer
  (``pyro.sample("w", ...)``, ``feats @ w.T + b``); only the guide registers the extractor
  (``pyro.module("body", body)``), so SVI trains it through the guide.
* ``module-in-both``: the same with ``pyro.module("body", body)`` in the model and the guide.
* ``plain-parameters``: a ``PyroModule`` with a hidden layer of plain ``nn.Parameter`` s (``F.linear``), a
  deterministic ``PyroModule[nn.Linear]`` and a Bayesian output layer; ``AutoNormal``.

All are mean-field with a deterministic input to their only Bayesian layer, so PFP's logit moments are
exact and only the Monte Carlo error of the truth remains.
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

D_IN, HIDDEN, CLASSES = 8, 16, 3
N_TRAIN, N_TEST, STEPS = 128, 16, 200
MC_SAMPLES = 600


def data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()


# ------------------------------------------------------------------------------ random_module notebook
class NN(nn.Module):
    def __init__(self, input_size: int, hidden_size: int, output_size: int) -> None:
        super(NN, self).__init__()  # noqa: UP008  (as the notebook writes it)
        self.fc1 = nn.Linear(input_size, hidden_size)
        self.fc2 = nn.Linear(hidden_size, hidden_size)
        self.fc3 = nn.Linear(hidden_size, hidden_size)
        self.out = nn.Linear(hidden_size, output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = torch.tanh(self.fc1(x))
        output = torch.tanh(self.fc2(output))
        output = torch.tanh(self.fc3(output))
        return self.out(output)


def notebook() -> tuple[Callable[..., Any], Callable[..., Any], NN]:
    net = NN(D_IN, HIDDEN, CLASSES)
    log_softmax = nn.LogSoftmax(dim=1)
    softplus = torch.nn.Softplus()

    def model(x_data: torch.Tensor, y_data: torch.Tensor) -> None:
        outw_prior = Normal(loc=torch.zeros_like(net.out.weight), scale=torch.ones_like(net.out.weight))
        outb_prior = Normal(loc=torch.zeros_like(net.out.bias), scale=torch.ones_like(net.out.bias))
        priors = {"out.weight": outw_prior.to_event(2), "out.bias": outb_prior.to_event(1)}
        lifted_module = pyro.random_module("module", net, priors)
        lifted_reg_model = lifted_module()
        lhat = log_softmax(lifted_reg_model(x_data))
        with pyro.plate("data", x_data.shape[0]):
            pyro.sample("obs", Categorical(logits=lhat), obs=y_data)

    def guide(x_data: torch.Tensor, y_data: torch.Tensor) -> nn.Module:
        outw_mu_param = pyro.param("outw_mu", torch.randn_like(net.out.weight))
        outw_sigma_param = softplus(pyro.param("outw_sigma", torch.full_like(net.out.weight, -3.0)))
        outb_mu_param = pyro.param("outb_mu", torch.randn_like(net.out.bias))
        outb_sigma_param = softplus(pyro.param("outb_sigma", torch.full_like(net.out.bias, -3.0)))
        priors = {"out.weight": Normal(loc=outw_mu_param, scale=outw_sigma_param).to_event(2),
                  "out.bias": Normal(loc=outb_mu_param, scale=outb_sigma_param).to_event(1)}
        lifted_module = pyro.random_module("module", net, priors)
        return lifted_module()

    return model, guide, net


class BayesianLastLayer(PyroModule):
    """The notebook as methods of a PyroModule that holds the net."""

    def __init__(self) -> None:
        super().__init__()
        self.net = NN(D_IN, HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def model(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        priors = {n: Normal(torch.zeros_like(p), torch.ones_like(p)).to_event(p.dim())
                  for n, p in self.net.named_parameters() if n.startswith("out.")}
        lifted = pyro.random_module("module", self.net, priors)()
        logits = lifted(x)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", Categorical(logits=logits), obs=y)
        return logits

    def guide(self, x: torch.Tensor, y: torch.Tensor) -> nn.Module:
        dists = {}
        for n, p in self.net.named_parameters():
            if n.startswith("out."):
                mu = pyro.param(f"guide.{n}.mu", lambda p=p: 0.1 * torch.randn_like(p))
                sigma = F.softplus(pyro.param(f"guide.{n}.sigma", lambda p=p: torch.full_like(p, -3.0)))
                dists[n] = Normal(mu, sigma).to_event(p.dim())
        return pyro.random_module("module", self.net, dists)()


# ------------------------------------------------------------------------------------------ pyro.module
def _body() -> nn.Sequential:
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh())


class FeaturesAndBayesianHead(PyroModule):
    """``pyro.module("features", self.body)`` in forward; a Bayesian PyroModule[nn.Linear] head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _body()
        self.head = PyroModule[nn.Linear](HIDDEN, CLASSES)
        self.head.weight = PyroSample(dist.Normal(0.0, 1.0).expand([CLASSES, HIDDEN]).to_event(2))
        self.head.bias = PyroSample(dist.Normal(0.0, 1.0).expand([CLASSES]).to_event(1))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        pyro.module("features", self.body)
        logits = self.head(self.body(x))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


def functional_last_layer(in_model: bool) -> tuple[Callable[..., Any], Callable[..., Any], nn.Module]:
    """A plain feature extractor and a functional Bayesian last layer; ``pyro.module("body", body)`` in the
    guide, and in the model too when ``in_model``."""
    body = _body()

    def model(x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        if in_model:
            pyro.module("body", body)
        w = pyro.sample("w", dist.Normal(torch.zeros(CLASSES, HIDDEN), 1.0).to_event(2))
        b = pyro.sample("b", dist.Normal(torch.zeros(CLASSES), 1.0).to_event(1))
        logits = body(x) @ w.T + b
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits

    def guide(x: torch.Tensor, y: torch.Tensor | None = None) -> None:
        pyro.module("body", body)
        w_loc = pyro.param("w_loc", 0.1 * torch.randn(CLASSES, HIDDEN))
        w_scale = pyro.param("w_scale", torch.full((CLASSES, HIDDEN), 0.05), constraint=dist.constraints.positive)
        b_loc = pyro.param("b_loc", torch.zeros(CLASSES))
        b_scale = pyro.param("b_scale", torch.full((CLASSES,), 0.05), constraint=dist.constraints.positive)
        pyro.sample("w", dist.Normal(w_loc, w_scale).to_event(2))
        pyro.sample("b", dist.Normal(b_loc, b_scale).to_event(1))

    return model, guide, body


class PlainParameters(PyroModule):
    """A hidden layer of plain nn.Parameters used with F.linear, a deterministic PyroModule[nn.Linear], and a
    Bayesian head."""

    def __init__(self) -> None:
        super().__init__()
        self.w_in = nn.Parameter(0.3 * torch.randn(HIDDEN, D_IN))
        self.b_in = nn.Parameter(torch.zeros(HIDDEN))
        self.hidden = PyroModule[nn.Linear](HIDDEN, HIDDEN)
        self.out = PyroModule[nn.Linear](HIDDEN, CLASSES)
        self.out.weight = PyroSample(dist.Normal(0.0, 1.0).expand([CLASSES, HIDDEN]).to_event(2))
        self.out.bias = PyroSample(dist.Normal(0.0, 1.0).expand([CLASSES]).to_event(1))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.relu(self.hidden(torch.tanh(F.linear(x, self.w_in, self.b_in))))
        logits = self.out(h)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


# ------------------------------------------------------------------------------------------ the entries
def _predictive(model: Any, guide: Any) -> Callable[[torch.Tensor, int], torch.Tensor]:
    def truth(x: torch.Tensor, n: int) -> torch.Tensor:
        return Predictive(model, guide=guide, num_samples=n, return_sites=("_RETURN",))(x)["_RETURN"]
    return truth


def entry(name: str) -> dict[str, Any]:
    """``model``/``guide`` (trained by SVI), ``truth(x, n)`` (``n`` samples of the logits, as the author
    predicts), ``modules`` (the user's objects) and ``convert()`` (as the user calls it), freshly built."""
    import pyro2pfp

    if name in ("rm-notebook", "rm-notebook-net"):
        model, guide, net = notebook()
        target = model if name == "rm-notebook" else net
        return {"model": model, "guide": guide, "modules": [net],
                "truth": lambda x, n: torch.stack([guide(None, None)(x) for _ in range(n)]),
                "convert": lambda: pyro2pfp.convert(target, guide, input_shape=(D_IN,))}
    if name == "rm-methods":
        bnn = BayesianLastLayer()
        return {"model": bnn.model, "guide": bnn.guide, "modules": [bnn],
                "truth": lambda x, n: torch.stack([bnn.guide(None, None)(x) for _ in range(n)]),
                "convert": lambda: pyro2pfp.convert(bnn.model, bnn.guide, input_shape=(D_IN,))}
    if name in ("module-in-model", "plain-parameters"):
        model = FeaturesAndBayesianHead() if name == "module-in-model" else PlainParameters()
        guide = AutoNormal(model, init_scale=0.05)
        return {"model": model, "guide": guide, "modules": [model], "truth": _predictive(model, guide),
                "convert": lambda: pyro2pfp.convert(model, guide, input_shape=(D_IN,))}
    if name in ("module-in-guide", "module-in-both"):
        model, guide, body = functional_last_layer(in_model=name == "module-in-both")
        return {"model": model, "guide": guide, "modules": [body], "truth": _predictive(model, guide),
                "convert": lambda: pyro2pfp.convert(model, guide, input_shape=(D_IN,))}
    raise KeyError(name)


ENTRIES = ("rm-notebook", "rm-notebook-net", "rm-methods", "module-in-model", "module-in-guide", "module-in-both",
           "plain-parameters")
TRAINED_AS = {"rm-notebook-net": "rm-notebook"}  # the same model and store, converted another way


def _module_state(modules: list[nn.Module]) -> list[tuple[str, str, bool, float]]:
    """What convert must leave as it found it: each parameter's type and sum, and the train/eval mode."""
    return sorted((f"{i}.{path}.{key}", type(value).__name__, m.training, float(value.detach().sum()))
                  for i, module in enumerate(modules) for path, m in module.named_modules()
                  for key, value in m._parameters.items() if value is not None)


def train_entry(name: str, make: Callable[[str], dict[str, Any]], out_dir: str) -> dict[str, Any]:
    """Train entry ``name`` (built by ``make``) as its author would, then save its param store
    (``<name>.pt``) and its own sampled prediction on the test inputs (``<name>-truth.npz``); the entry."""
    x, y = data(N_TRAIN, 0)
    x_test, _ = data(N_TEST, 7)
    pyro.clear_param_store()
    pyro.set_rng_seed(1)
    e = make(name)
    svi = SVI(e["model"], e["guide"], pyro.optim.Adam({"lr": 0.03}), Trace_ELBO())
    for _ in range(STEPS):
        svi.step(x, y)
    for module in e["modules"]:
        module.eval()
    with torch.no_grad():
        samples = e["truth"](x_test, MC_SAMPLES).double().numpy()
    pyro.get_param_store().save(os.path.join(out_dir, f"{name}.pt"))
    np.savez(os.path.join(out_dir, f"{name}-truth.npz"), x=x_test.numpy(), mean=samples.mean(0),
             var=samples.var(0, ddof=1))
    return e


def train(out_dir: str) -> None:
    for name in ENTRIES:
        if name not in TRAINED_AS:
            train_entry(name, entry, out_dir)


def convert(out_dir: str) -> None:
    for name in ENTRIES:
        trained = TRAINED_AS.get(name, name)
        truth = np.load(os.path.join(out_dir, f"{trained}-truth.npz"))
        pyro.clear_param_store()
        e = entry(name)
        pyro.get_param_store().load(os.path.join(out_dir, f"{trained}.pt"))
        before = _module_state(e["modules"])
        net = e["convert"]()
        unchanged = _module_state(e["modules"]) == before
        mean, var = net.reference(truth["x"])
        stale = [f"{layer.name}.{role}" for layer in net.layer_graph.layers
                 for role, p in layer.params.items() if p.stale]
        np.savez(os.path.join(out_dir, f"{name}-pfp.npz"), mean=mean, var=var, unchanged=unchanged,
                 summary=str(net.summary()), stale=np.array(stale, dtype=str))


if __name__ == "__main__":
    torch.set_num_threads(1)
    (train if sys.argv[1] == "train" else convert)(sys.argv[2])
