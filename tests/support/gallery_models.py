"""A gallery of BNNs written the way Pyro's tutorials and public BNN code write them (issue 16 item 6).

Each entry builds its model and guide in the author's style (not with pyro2pfp's builders), trains a few
hundred SVI steps on small seeded synthetic data, and gives the truth the converted network is compared
with: samples of the predictive ``obs`` (regression) or of the logits (classification) from Pyro's
``Predictive`` on the trained guide (for the ``pyro.random_module`` net: the lifted modules its guide
returns, as that tutorial predicts).  Used by tests/user_code/test_gallery.py and benchmarks/gallery.py, and as a
worker for the cross-process lifecycle (train + save the param store in one process, load + convert in
another)::

    python tests/support/gallery_models.py train NAME DIR     # SVI, save the store + the truth
    python tests/support/gallery_models.py convert NAME DIR   # fresh process: build, load, convert, save PFP's answer
"""
from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyro
import pyro.distributions as dist
import torch
import torch.nn as nn
import torch.nn.functional as F
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal
from pyro.nn import PyroModule, PyroModuleList, PyroSample
from pyro.nn.module import to_pyro_module_

D_IN, HIDDEN, CLASSES = 4, 16, 3
N_TRAIN, N_TEST = 128, 24
MC_SAMPLES = 1000


# ------------------------------------------------------------------------------------------ data
def regression_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g)
    noise = 0.1 + 0.4 * torch.sigmoid(2.0 * x[:, 1])  # input-dependent: the heteroscedastic nets can learn it
    y = torch.sin(1.5 * x[:, 0]) + 0.5 * x[:, 1] + noise * torch.randn(n, generator=g)
    return x, y


def classification_data(n: int, seed: int, d_in: int = D_IN) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()


def _normal_prior(shape: torch.Size | tuple[int, ...], scale: float = 1.0) -> Any:
    return dist.Normal(0.0, scale).expand(list(shape)).to_event(len(shape))


# ------------------------------------------------------------------------------------ (a) tutorial
class BayesianRegression(PyroModule):
    """Pyro's "Bayesian Regression" tutorial, with a hidden layer: ``PyroModule[nn.Linear]`` with
    PyroSample weights, ``sigma ~ Uniform(0, 10)``, ``.squeeze(-1)``, a plate and a Normal ``obs``."""

    def __init__(self, in_features: int = D_IN, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.hidden = PyroModule[nn.Linear](in_features, hidden)
        self.hidden.weight = PyroSample(dist.Normal(0.0, 1.0).expand([hidden, in_features]).to_event(2))
        self.hidden.bias = PyroSample(dist.Normal(0.0, 1.0).expand([hidden]).to_event(1))
        self.linear = PyroModule[nn.Linear](hidden, 1)
        self.linear.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, hidden]).to_event(2))
        self.linear.bias = PyroSample(dist.Normal(0.0, 10.0).expand([1]).to_event(1))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        sigma = pyro.sample("sigma", dist.Uniform(0.0, 10.0))
        mean = self.linear(F.relu(self.hidden(x))).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mean, sigma), obs=y)
        return mean


# ------------------------------------------------------------------------------ (b) random_module
class NN(nn.Module):
    """The classic "MNIST with pyro.random_module" network (a plain nn.Module)."""

    def __init__(self, input_size: int, hidden_size: int, output_size: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(input_size, hidden_size)
        self.out = nn.Linear(hidden_size, output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self.fc1(x)
        output = F.relu(output)
        output = self.out(output)
        return output


def random_module_classifier() -> tuple[Callable[..., Any], Callable[..., Any], NN]:
    """Model and hand-written guide as that tutorial writes them: Normal priors per tensor, a guide
    with ``pyro.param`` locs and softplus scales that returns the sampled lifted module (with
    ``.to_event`` and a plate over the data, which Pyro's shape validation asks for today)."""
    net = NN(D_IN, HIDDEN, CLASSES)
    log_softmax = nn.LogSoftmax(dim=1)
    softplus = torch.nn.Softplus()

    def model(x_data: torch.Tensor, y_data: torch.Tensor | None) -> torch.Tensor:
        priors = {name: dist.Normal(loc=torch.zeros_like(p), scale=torch.ones_like(p)).to_event(p.dim())
                  for name, p in net.named_parameters()}
        lifted_module = pyro.random_module("module", net, priors)
        lifted_reg_model = lifted_module()
        lhat = log_softmax(lifted_reg_model(x_data))
        with pyro.plate("data", x_data.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=lhat), obs=y_data)
        return lhat

    def guide(x_data: torch.Tensor, y_data: torch.Tensor | None) -> nn.Module:
        dists = {}
        for name, p in net.named_parameters():
            key = name.replace(".", "_")
            mu_param = pyro.param(f"{key}_mu", lambda p=p: 0.1 * torch.randn_like(p))
            sigma_param = softplus(pyro.param(f"{key}_sigma", lambda p=p: torch.full_like(p, -3.0)))
            dists[name] = dist.Normal(loc=mu_param, scale=sigma_param).to_event(p.dim())
        lifted_module = pyro.random_module("module", net, dists)
        return lifted_module()

    return model, guide, net


# ----------------------------------------------------------------------- (c) PyroModuleList, log_sigma
class ListRegression(PyroModule):
    """An MLP kept in a ``PyroModuleList`` (two hidden layers), ``log_sigma`` a PyroSample site of
    the model and the noise ``log_sigma.exp()``."""

    def __init__(self, sizes: tuple[int, ...] = (D_IN, HIDDEN, HIDDEN, 1)) -> None:
        super().__init__()
        self.layers = PyroModuleList([PyroModule[nn.Linear](a, b) for a, b in zip(sizes[:-1], sizes[1:], strict=True)])
        for layer in self.layers:
            layer.weight = PyroSample(_normal_prior(layer.weight.shape))
            layer.bias = PyroSample(_normal_prior(layer.bias.shape))
        self.log_sigma = PyroSample(dist.Normal(-1.0, 1.0))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        mean = self.layers[-1](x)[..., 0]
        sigma = self.log_sigma.exp()
        with pyro.plate("data", mean.shape[0]):
            pyro.sample("obs", dist.Normal(mean, sigma), obs=y)
        return mean


# --------------------------------------------------------------------------- (d) heteroscedastic
class HeteroscedasticRegression(PyroModule):
    """One network, two output columns: the mean and the noise scale (``exp`` of the second column, or
    ``softplus`` + a floor) — the usual heteroscedastic head."""

    def __init__(self, link: str = "exp") -> None:
        super().__init__()
        self.link = link
        self.fc1 = PyroModule[nn.Linear](D_IN, HIDDEN)
        self.fc1.weight = PyroSample(_normal_prior((HIDDEN, D_IN)))
        self.fc1.bias = PyroSample(_normal_prior((HIDDEN,)))
        self.fc2 = PyroModule[nn.Linear](HIDDEN, 2)
        self.fc2.weight = PyroSample(_normal_prior((2, HIDDEN)))
        self.fc2.bias = PyroSample(_normal_prior((2,)))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        out = self.fc2(F.relu(self.fc1(x)))
        if self.link == "exp":
            mu, log_sigma = out[..., 0], out[..., 1]
            sigma = log_sigma.exp()
        else:
            mu, raw = out.unbind(-1)
            sigma = F.softplus(raw) + 1e-3
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("obs", dist.Normal(mu, sigma), obs=y)


# -------------------------------------------------------------------------------------- (e) TyXe
def tyxe_regression(learned_scale: bool = False, activation: type[nn.Module] = nn.ReLU) -> Any:
    """TyXe's regression example style: ``VariationalBNN`` over an ``nn.Sequential`` (ReLU, or Tanh as
    TyXe's own regression example), an IID Normal prior, ``HomoskedasticGaussian(n, scale=0.3)`` (or a
    scale with a LogNormal prior and its own AutoNormal likelihood guide), TyXe's AutoNormal for the net."""
    import tyxe

    import pyro2pfp.compat

    pyro2pfp.compat.patch_pyro_for_tyxe()
    body = nn.Sequential(nn.Linear(D_IN, HIDDEN), activation(), nn.Linear(HIDDEN, 1))
    prior = tyxe.priors.IIDPrior(dist.Normal(0.0, 1.0))
    guide = functools.partial(tyxe.guides.AutoNormal, init_scale=0.01)
    if not learned_scale:
        likelihood = tyxe.likelihoods.HomoskedasticGaussian(N_TRAIN, scale=0.3)
        return tyxe.VariationalBNN(body, prior, likelihood, guide)
    likelihood = tyxe.likelihoods.HomoskedasticGaussian(N_TRAIN, scale=dist.LogNormal(-1.0, 0.5))
    bnn = tyxe.VariationalBNN(body, prior, likelihood, guide)
    # TyXe 0.0.2 hides the weight sites from the likelihood guide without the net's prefix ("0.weight"
    # for "net.0.weight"), so its own likelihood_guide_builder fails under Pyro 1.9: build it here.
    hide = [f"net.{name}" for name in tyxe.util.pyro_sample_sites(bnn.net)] + [likelihood.data_name]
    bnn.likelihood_guide = AutoNormal(pyro.poutine.block(bnn.model, hide=hide), init_scale=0.01)
    return bnn


def tyxe_sigmoid_classifier() -> Any:
    """A TyXe binary classifier returning probabilities: Sigmoid hidden layer, a final ``nn.Sigmoid``
    and ``Bernoulli(n, logit_predictions=False)`` (PFP strips the final sigmoid: logit moments)."""
    import tyxe

    import pyro2pfp.compat

    pyro2pfp.compat.patch_pyro_for_tyxe()
    body = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Sigmoid(), nn.Linear(HIDDEN, 1), nn.Sigmoid())
    return tyxe.VariationalBNN(body, tyxe.priors.IIDPrior(dist.Normal(0.0, 1.0)),
                               tyxe.likelihoods.Bernoulli(N_TRAIN, logit_predictions=False, event_dim=1),
                               functools.partial(tyxe.guides.AutoNormal, init_scale=0.01))


# ------------------------------------------------------------------------------ (f) to_pyro_module_
class SequentialClassifier(PyroModule):
    """``to_pyro_module_`` over an ``nn.Sequential`` (Linear → BatchNorm1d → LeakyReLU → Linear), the
    Linear weights and biases then given Normal PyroSample priors; BatchNorm's affine parameters stay
    (learned) parameters.  Converted in eval mode (BatchNorm with its running statistics)."""

    def __init__(self) -> None:
        super().__init__()
        net = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.LeakyReLU(0.1),
                            nn.Linear(HIDDEN, CLASSES))
        to_pyro_module_(net)
        for module in net.modules():
            if isinstance(module, nn.Linear):
                for name, value in list(module.named_parameters(recurse=False)):
                    setattr(module, name, PyroSample(_normal_prior(value.shape)))
        self.net = net

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.net(x)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


# ------------------------------------------------------------------------------- (g) a small CNN
IMAGE = 4  # the CNN's inputs are flattened IMAGE x IMAGE images, viewed as (1, IMAGE, IMAGE) by the model


class SiLUConvNet(PyroModule):
    """An MNIST-tutorial-style CNN: the flattened input ``x.view(-1, 1, 4, 4)``, ``PyroModule[nn.Conv2d]``
    with PyroSample weights, ``nn.BatchNorm2d`` (eval mode at prediction), SiLU, average pooling, flatten,
    a Bayesian ``nn.Linear`` head; ``Categorical(logits=...)`` likelihood, returns the logits."""

    def __init__(self, channels: int = 6) -> None:
        super().__init__()
        self.conv = PyroModule[nn.Conv2d](1, channels, 3, padding=1)
        self.conv.weight = PyroSample(_normal_prior((channels, 1, 3, 3)))
        self.conv.bias = PyroSample(_normal_prior((channels,)))
        self.bn = nn.BatchNorm2d(channels)
        self.fc = PyroModule[nn.Linear](channels * (IMAGE // 2) ** 2, CLASSES)
        self.fc.weight = PyroSample(_normal_prior((CLASSES, channels * (IMAGE // 2) ** 2)))
        self.fc.bias = PyroSample(_normal_prior((CLASSES,)))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = F.silu(self.bn(self.conv(x.view(-1, 1, IMAGE, IMAGE))))
        logits = self.fc(torch.flatten(F.avg_pool2d(h, 2), 1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


# -------------------------------------------------------------------------- (h) a 1-D signal CNN
SIGNAL = 16  # the 1-D CNN's inputs are signals of SIGNAL samples, one channel


class BayesianSmallCNN(PyroModule):
    """A scientific-code 1-D CNN: Bayesian ``Conv1d`` (``padding='same'`` with an even kernel) →
    ``BatchNorm1d`` → ReLU → ``MaxPool1d`` → Bayesian ``Conv1d`` → ``BatchNorm1d`` → ReLU →
    ``AdaptiveAvgPool1d(1)`` → Bayesian ``Linear``; the signal gets its channel axis in ``forward``."""

    def __init__(self, channels: int = 6) -> None:
        super().__init__()
        self.conv1 = PyroModule[nn.Conv1d](1, channels, kernel_size=4, padding="same")
        self.conv1.weight = PyroSample(_normal_prior((channels, 1, 4)))
        self.conv1.bias = PyroSample(_normal_prior((channels,)))
        self.bn1 = nn.BatchNorm1d(channels)
        self.pool = nn.MaxPool1d(2)
        self.conv2 = PyroModule[nn.Conv1d](channels, channels, kernel_size=3, padding=1)
        self.conv2.weight = PyroSample(_normal_prior((channels, channels, 3)))
        self.conv2.bias = PyroSample(_normal_prior((channels,)))
        self.bn2 = nn.BatchNorm1d(channels)
        self.gap = nn.AdaptiveAvgPool1d(1)
        self.fc = PyroModule[nn.Linear](channels, CLASSES)
        self.fc.weight = PyroSample(_normal_prior((CLASSES, channels)))
        self.fc.bias = PyroSample(_normal_prior((CLASSES,)))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = x.unsqueeze(1)  # (batch, SIGNAL) -> (batch, 1, SIGNAL)
        h = self.pool(F.relu(self.bn1(self.conv1(h))))
        h = F.relu(self.bn2(self.conv2(h)))
        logits = self.fc(self.gap(h).squeeze(-1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


# ------------------------------------------------------------- (i) a residual CNN with a LayerNorm head
RES_IMAGE = 9  # the residual CNN's inputs are flattened RES_IMAGE x RES_IMAGE images


def _bayes_conv(c_in: int, c_out: int) -> PyroModule:
    conv = PyroModule[nn.Conv2d](c_in, c_out, 3, padding=1)
    conv.weight = PyroSample(_normal_prior((c_out, c_in, 3, 3), 0.5))
    conv.bias = PyroSample(_normal_prior((c_out,), 0.5))
    return conv


class ResidualLayerNormCNN(PyroModule):
    """A public-code residual CNN: a Bayesian stem conv, two pre-activation residual blocks (``BatchNorm2d``
    → ReLU → Bayesian conv, added to the identity), ``MaxPool2d(3)`` of the last residual sum, flatten,
    a Bayesian ``Linear`` → ``LayerNorm`` → GELU → Bayesian ``Linear`` head; ``Categorical(logits=...)``."""

    def __init__(self, channels: int = 4, hidden: int = 16) -> None:
        super().__init__()
        self.stem = _bayes_conv(1, channels)
        self.bn1, self.conv1 = nn.BatchNorm2d(channels), _bayes_conv(channels, channels)
        self.bn2, self.conv2 = nn.BatchNorm2d(channels), _bayes_conv(channels, channels)
        self.pool = nn.MaxPool2d(3)
        flat = channels * (RES_IMAGE // 3) ** 2
        self.fc1 = PyroModule[nn.Linear](flat, hidden)
        self.fc1.weight = PyroSample(_normal_prior((hidden, flat), 0.5))
        self.fc1.bias = PyroSample(_normal_prior((hidden,), 0.5))
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = PyroModule[nn.Linear](hidden, CLASSES)
        self.fc2.weight = PyroSample(_normal_prior((CLASSES, hidden)))
        self.fc2.bias = PyroSample(_normal_prior((CLASSES,)))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = self.stem(x.view(-1, 1, RES_IMAGE, RES_IMAGE))
        h = h + self.conv1(F.relu(self.bn1(h)))
        h = h + self.conv2(F.relu(self.bn2(h)))
        h = torch.flatten(self.pool(h), 1)
        logits = self.fc2(F.gelu(self.norm(self.fc1(h))))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


# ------------------------------------------------------------------------------------ the gallery
@dataclass
class Built:
    """One freshly built entry: what SVI trains, what ``Predictive`` samples, what ``convert`` takes."""

    model: Any
    guide: Any
    bnn: Any = None  # a TyXe VariationalBNN (convert(bnn))
    net: Any = None  # the random_module's nn.Module
    input_shape: tuple[int, ...] = (D_IN,)
    convert_options: dict[str, Any] | None = None  # extra convert() arguments the entry needs

    def convert(self, **kwargs: Any) -> Any:
        import pyro2pfp

        kwargs = {**(self.convert_options or {}), **kwargs}
        if self.bnn is not None:
            return pyro2pfp.convert(self.bnn, **kwargs)
        return pyro2pfp.convert(self.model, self.guide, input_shape=self.input_shape, **kwargs)


@dataclass
class Entry:
    name: str
    task: str  # "regression" (truth: obs) or "classification" (truth: logits)
    build: Callable[[], Built]
    style: str
    exact: bool  # PFP's output moments are exact (one hidden layer, mean-field, deterministic input)
    steps: int = 300
    d_in: int = D_IN  # input features (the CNN's: a flattened image)

    def data(self, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.task == "regression":
            return regression_data(n, seed)
        return classification_data(n, seed, self.d_in)


def _rm() -> Built:
    model, guide, net = random_module_classifier()
    return Built(model, guide, net=net)


def _tyxe(learned: bool, activation: type[nn.Module] = nn.ReLU) -> Built:
    bnn = tyxe_regression(learned, activation)
    return Built(bnn.model, bnn.guide, bnn=bnn)


def _tyxe_bernoulli() -> Built:
    bnn = tyxe_sigmoid_classifier()
    return Built(bnn.model, bnn.guide, bnn=bnn)


GALLERY = {e.name: e for e in [
    Entry("tutorial-regression", "regression", lambda: (lambda m: Built(m, AutoDiagonalNormal(m, init_scale=0.01)))(
        BayesianRegression()), "Pyro regression tutorial: PyroModule[nn.Linear], sigma ~ Uniform(0, 10), "
        ".squeeze(-1), AutoDiagonalNormal", exact=True),
    Entry("random-module-classifier", "classification", _rm,
          "pyro.random_module MNIST style: nn.Module lifted, hand-written guide(x_data, y_data)", exact=True),
    Entry("modulelist-log-sigma", "regression", lambda: (lambda m: Built(m, AutoNormal(m, init_scale=0.01)))(
        ListRegression()), "PyroModuleList MLP (2 hidden layers), log_sigma PyroSample, AutoNormal", exact=False),
    Entry("heteroscedastic-exp", "regression", lambda: (lambda m: Built(m, AutoNormal(m, init_scale=0.01)))(
        HeteroscedasticRegression("exp")), "heteroscedastic head: out[..., 0] mean, exp(out[..., 1]) scale; "
        "returns the obs sample", exact=False),
    Entry("heteroscedastic-softplus", "regression", lambda: (lambda m: Built(m, AutoNormal(m, init_scale=0.01)))(
        HeteroscedasticRegression("softplus")), "heteroscedastic head: out.unbind(-1), softplus(raw) + 1e-3",
        exact=False),
    Entry("tyxe-regression", "regression", lambda: _tyxe(False),
          "TyXe VariationalBNN, HomoskedasticGaussian(n, scale=0.3)", exact=True),
    Entry("tyxe-learned-scale", "regression", lambda: _tyxe(True),
          "TyXe VariationalBNN, HomoskedasticGaussian(n, scale=LogNormal(-1, 0.5)) with a likelihood guide",
          exact=True),
    Entry("tyxe-tanh-regression", "regression", lambda: _tyxe(False, nn.Tanh),
          "TyXe VariationalBNN, Tanh MLP (TyXe's regression example), HomoskedasticGaussian(n, scale=0.3)",
          exact=False),
    Entry("tyxe-sigmoid-bernoulli", "classification", _tyxe_bernoulli,
          "TyXe VariationalBNN, Sigmoid hidden + final Sigmoid, Bernoulli(logit_predictions=False)", exact=False),
    Entry("to-pyro-module-batchnorm", "classification",
          lambda: (lambda m: Built(m, AutoNormal(m, init_scale=0.01)))(SequentialClassifier()),
          "to_pyro_module_(nn.Sequential) Linear-BatchNorm1d-LeakyReLU-Linear, eval mode", exact=True),
    Entry("cnn-silu-batchnorm", "classification",
          lambda: (lambda m: Built(m, AutoNormal(m, init_scale=0.01), input_shape=(IMAGE * IMAGE,),
                                   convert_options={"correlation": "shared-factor"}))(SiLUConvNet()),
          "CNN: x.view(-1, 1, 4, 4), PyroModule[nn.Conv2d], BatchNorm2d, SiLU, avg-pool, Linear, AutoNormal; "
          "converted with correlation='shared-factor' (what 'auto' chooses; mean-field: median variance ratio "
          "0.66)", exact=False, d_in=IMAGE * IMAGE,
          steps=800),
    Entry("cnn1d-signal", "classification",
          lambda: (lambda m: Built(m, AutoNormal(m, init_scale=0.01), input_shape=(SIGNAL,)))(BayesianSmallCNN()),
          "scientific 1-D CNN: Conv1d(padding='same', even kernel), BatchNorm1d, ReLU, MaxPool1d, Conv1d, "
          "AdaptiveAvgPool1d, Linear, AutoNormal", exact=False, d_in=SIGNAL, steps=100),
    Entry("residual-cnn-layernorm", "classification",
          lambda: (lambda m: Built(m, AutoNormal(m, init_scale=0.05), input_shape=(RES_IMAGE * RES_IMAGE,)))(
              ResidualLayerNormCNN()),
          "residual CNN: BatchNorm2d before each Bayesian conv, identity residuals, MaxPool2d(3) of the residual "
          "sum, Linear-LayerNorm-GELU-Linear head, AutoNormal; converted as it stands (correlation 'auto')",
          exact=False, d_in=RES_IMAGE * RES_IMAGE, steps=300),
]}


def train(entry: Entry, built: Built, seed: int = 1) -> None:
    """A few hundred SVI steps (TyXe: ``bnn.fit``) on the entry's training data."""
    pyro.set_rng_seed(seed)
    x, y = entry.data(N_TRAIN, 0)
    if built.bnn is not None:
        y = y[:, None] if entry.task == "regression" else (y > 0).float()[:, None]
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=N_TRAIN)
        built.bnn.fit(loader, pyro.optim.Adam({"lr": 0.02}), entry.steps)
        return
    svi = SVI(built.model, built.guide, pyro.optim.Adam({"lr": 0.02}), Trace_ELBO())
    for _ in range(entry.steps):
        svi.step(x, y)
    if isinstance(built.model, nn.Module):
        built.model.eval()  # BatchNorm: running statistics from here on


def truth_samples(entry: Entry, built: Built, x: torch.Tensor, num_samples: int = MC_SAMPLES) -> np.ndarray:
    """Samples of what PFP predicts, ``(num_samples, batch[, outputs])``: ``obs`` from ``Predictive``
    (regression), the logits (classification: ``Predictive``'s ``_RETURN``; for the random_module net
    the lifted modules its guide returns, evaluated on ``x``)."""
    with torch.no_grad():
        if built.net is not None:  # the random_module tutorial predicts with guide-sampled modules
            return np.stack([built.guide(None, None)(x).double().numpy() for _ in range(num_samples)])
        if built.bnn is not None and entry.task == "classification":  # probabilities: the final sigmoid's input
            logits: list[np.ndarray] = []
            hook = built.bnn.net[-1].register_forward_hook(lambda m, i, o: logits.append(i[0].double().numpy()))
            try:
                Predictive(built.bnn.model, guide=built.bnn.guide, num_samples=num_samples)(x)
            finally:
                hook.remove()
            return np.stack(logits)
        if entry.task == "classification":
            return Predictive(built.model, guide=built.guide, num_samples=num_samples,
                              return_sites=("_RETURN",))(x)["_RETURN"].double().numpy()
        site = built.bnn.likelihood.data_name if built.bnn is not None else "obs"
        model = built.bnn.model if built.bnn is not None else built.model
        guide = built.bnn.guide if built.bnn is not None else built.guide
        samples = Predictive(model, guide=guide, num_samples=num_samples, return_sites=(site,))(x)[site]
        return samples.double().numpy().reshape(num_samples, len(x), -1)[..., 0]


def pfp_answer(entry: Entry, net: Any, x: np.ndarray) -> dict[str, np.ndarray]:
    """PFP's prediction: regression ``net.regression(*net.reference(x))``'s ``mean``/``total``
    (flattened to ``(batch,)``), classification the logit moments; plus the raw ``net.noise``."""
    mean, var = net.reference(x)
    if entry.task == "classification":
        return {"mean": mean, "var": var}
    out = net.regression(mean, var)
    return {"mean": out["mean"].reshape(len(x)), "var": out["total"].reshape(len(x)),
            "epistemic": out["epistemic"].reshape(len(x)), "aleatoric": out["aleatoric"].reshape(len(x))}


def moments(samples: np.ndarray) -> dict[str, np.ndarray]:
    """MC mean, variance and the standard errors of both (``se_var`` from the 4th central moment)."""
    n = len(samples)
    mean, var = samples.mean(0), samples.var(0, ddof=1)
    m4 = ((samples - mean) ** 4).mean(0)
    return {"mc_mean": mean, "mc_var": var, "se_mean": np.sqrt(var / n),
            "se_var": np.sqrt(np.maximum(m4 - var ** 2, 0.0) / n), "n": np.array(n)}


def agreement(entry: Entry, pfp: dict[str, np.ndarray], mc: dict[str, np.ndarray]) -> dict[str, float]:
    """The figures the test checks and benchmarks/gallery.py prints."""
    err = np.abs(pfp["mean"] - mc["mc_mean"]) / mc["se_mean"]
    ratio = pfp["var"] / mc["mc_var"]
    var_err = np.abs(pfp["var"] - mc["mc_var"]) / mc["se_var"]
    out = {"max_mean_err_sd": float(err.max()), "median_mean_err_sd": float(np.median(err)),
           "median_var_ratio": float(np.median(ratio)), "min_var_ratio": float(ratio.min()),
           "max_var_ratio": float(ratio.max()), "max_var_err_se": float(var_err.max())}
    if entry.task == "classification" and pfp["mean"].shape[-1] == 1:  # one logit: its sign
        out["argmax_agreement"] = float(np.mean((pfp["mean"] > 0) == (mc["mc_mean"] > 0)))
    elif entry.task == "classification":
        out["argmax_agreement"] = float(np.mean(pfp["mean"].argmax(-1) == mc["mc_mean"].argmax(-1)))
    return out


def run_in_process(entry: Entry, num_samples: int = MC_SAMPLES) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Train, sample the truth, convert the trained objects: ``(pfp answer, MC moments)``."""
    built = entry.build()
    train(entry, built)
    x, _ = entry.data(N_TEST, 7)
    mc = moments(truth_samples(entry, built, x, num_samples))
    return pfp_answer(entry, built.convert(), x.numpy()), mc


# --------------------------------------------------------------------------- cross-process worker
def cross_process(worker: str, name: str, out_dir: Any, timeout: float = 900) -> tuple[dict, dict]:
    """Run ``worker`` (a script with this module's ``train`` / ``convert`` steps) on entry ``name``: train
    and save in one fresh process, load and convert in another; ``(PFP's answer, the truth)``."""
    import subprocess

    for step in ("train", "convert"):
        result = subprocess.run([sys.executable, worker, step, name, str(out_dir)], capture_output=True, text=True,
                                timeout=timeout)
        assert result.returncode == 0, f"worker {step} {name} failed:\n{result.stderr[-3000:]}"
    return (dict(np.load(os.path.join(out_dir, f"{name}-pfp.npz"))),
            dict(np.load(os.path.join(out_dir, f"{name}-truth.npz"))))


def worker_train(name: str, out_dir: str) -> None:
    entry = GALLERY[name]
    built = entry.build()
    train(entry, built)
    x, _ = entry.data(N_TEST, 7)
    np.savez(os.path.join(out_dir, f"{name}-truth.npz"), x=x.numpy(), **moments(truth_samples(entry, built, x)))
    if isinstance(built.model, nn.Module):  # BatchNorm running statistics are buffers, not in the store
        torch.save({k: v for k, v in built.model.state_dict().items() if "running" in k or "num_batches" in k},
                   os.path.join(out_dir, f"{name}-buffers.pt"))
    pyro.get_param_store().save(os.path.join(out_dir, f"{name}.pt"))


def worker_convert(name: str, out_dir: str) -> None:
    """A fresh process: build the model and guide as the author would, load the saved store, convert."""
    entry = GALLERY[name]
    truth = np.load(os.path.join(out_dir, f"{name}-truth.npz"))
    pyro.clear_param_store()
    built = entry.build()
    buffers = os.path.join(out_dir, f"{name}-buffers.pt")
    if os.path.exists(buffers):
        built.model.load_state_dict(torch.load(buffers), strict=False)
    if isinstance(built.model, nn.Module):
        built.model.eval()
    pyro.get_param_store().load(os.path.join(out_dir, f"{name}.pt"))
    np.savez(os.path.join(out_dir, f"{name}-pfp.npz"), **pfp_answer(entry, built.convert(), truth["x"]))


if __name__ == "__main__":
    step, which, directory = sys.argv[1:4]
    torch.set_num_threads(1)
    (worker_train if step == "train" else worker_convert)(which, directory)
