"""Reference Pyro Bayesian neural networks, written the way ordinary Pyro users write them.

The models are the paper's networks: a fully connected MLP (784-100-10 by default) and
LeNet-5. Every weight and bias is a ``PyroSample`` with an i.i.d. ``Normal(0, prior_scale)``
prior; the likelihood is ``Categorical(logits=...)`` on a ``pyro.plate("data", ...)``
observed site named ``"obs"``; ``forward`` returns the logits. Site names are module
paths (``fc1.weight``, ``conv1.bias``, ...).

The module also provides a mean-field ``AutoNormal`` guide factory, an SVI trainer
with KL annealing and mini-batch likelihood scaling (:func:`train_svi`), and the
sampling baseline :func:`predictive_logits`.

KL annealing
------------
:func:`train_svi` maximises, per mini-batch ``B`` of a data set of size ``N``::

    ELBO_e = (N / |B|) * E_q[log p(y_B | x_B, w)] - A(e) * KL(q(w) || p(w))

with ``A(e) = kl_max * (e + 1) / epochs`` for epochs ``e = 0 .. epochs - 1`` (rising
linearly from about 0 to ``kl_max``). It is implemented with
:class:`AnnealingMessenger`, a poutine handler that multiplies the ``scale`` of
*latent* sample sites (in both model and guide) by ``A(e)`` and the ``scale`` of
*observed* sites by ``N / |B|``; :class:`pyro.infer.Trace_ELBO` then weights
``log p(w)`` by the model sites' scale and ``log q(w)`` by the guide sites' scale, so the
(single-sample Monte Carlo) KL estimate is multiplied by ``A(e)`` while the likelihood is
multiplied by ``N / |B|`` only. (``TraceMeanField_ELBO`` buys nothing here: ``AutoNormal``
samples an auxiliary ``<site>_unconstrained`` Normal plus a ``Delta`` at ``<site>``, so
its "analytic" KL falls back to the same Monte Carlo estimate, and Pyro's
``kl(Delta, p)`` ignores the Delta's ``log_density``, i.e. it would drop the Jacobian of
constrained latent sites.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroSample
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample
from torch import nn

from pyro2pfp.analysis.sampling import predictive_logits

__all__ = ["predictive_logits"]  # re-exported: the sampling baseline lives in the library

__all__ = [
    "AnnealingMessenger",
    "BayesianLeNet5",
    "BayesianMLP",
    "ResNet",
    "bayesian_resnet",
    "he_init_loc",
    "he_posterior",
    "kl_factor",
    "make_guide",
    "predictive_logits",
    "train_svi",
]


def _bayesian_linear(in_features: int, out_features: int, prior_scale: float) -> PyroModule:
    """A ``PyroModule[nn.Linear]`` whose weight and bias have Normal(0, prior_scale) priors."""
    layer = PyroModule[nn.Linear](in_features, out_features)
    layer.weight = PyroSample(
        dist.Normal(0.0, prior_scale).expand([out_features, in_features]).to_event(2)
    )
    layer.bias = PyroSample(dist.Normal(0.0, prior_scale).expand([out_features]).to_event(1))
    return layer


def _bayesian_conv2d(
    in_channels: int, out_channels: int, kernel_size: int, prior_scale: float, padding: int = 0
) -> PyroModule:
    """A ``PyroModule[nn.Conv2d]`` whose weight and bias have Normal(0, prior_scale) priors."""
    layer = PyroModule[nn.Conv2d](in_channels, out_channels, kernel_size, padding=padding)
    layer.weight = PyroSample(
        dist.Normal(0.0, prior_scale)
        .expand([out_channels, in_channels, kernel_size, kernel_size])
        .to_event(4)
    )
    layer.bias = PyroSample(dist.Normal(0.0, prior_scale).expand([out_channels]).to_event(1))
    return layer


class BayesianMLP(PyroModule):
    """Fully connected Bayesian classifier (the paper's MLP is ``784-100-10``).

    Layers are the attributes ``fc1 .. fcN`` (``N = len(hidden) + 1``), each a
    ``PyroModule[nn.Linear]`` whose ``weight`` and ``bias`` are ``PyroSample`` sites with
    i.i.d. ``Normal(0, prior_scale)`` priors, so the latent site names are
    ``fc1.weight``, ``fc1.bias``, ..., ``fcN.bias``. Hidden layers use ``F.relu``.

    Args:
        in_features: Input size after flattening (784 for MNIST).
        hidden: Hidden layer widths, e.g. ``(100,)`` or ``(400, 400)``; may be empty.
        out_features: Number of classes.
        prior_scale: Standard deviation of the Normal prior on every weight and bias.
    """

    def __init__(
        self,
        in_features: int = 784,
        hidden: Sequence[int] = (100,),
        out_features: int = 10,
        prior_scale: float = 1.0,
    ) -> None:
        super().__init__()
        widths = [int(in_features), *(int(h) for h in hidden), int(out_features)]
        self.n_layers: int = len(widths) - 1
        for i in range(self.n_layers):
            setattr(self, f"fc{i + 1}", _bayesian_linear(widths[i], widths[i + 1], prior_scale))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """Return the logits ``(B, out_features)``; observe ``y`` (if given) at site ``"obs"``."""
        x = x.view(x.size(0), -1)
        for i in range(1, self.n_layers):
            x = F.relu(getattr(self, f"fc{i}")(x))
        logits = getattr(self, f"fc{self.n_layers}")(x)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


class BayesianLeNet5(PyroModule):
    """Bayesian LeNet-5 for ``(B, 1, 28, 28)`` inputs.

    ``conv1`` (5x5, padding 2, 1 -> c1) -> relu -> max-pool 2 -> ``conv2`` (5x5, c1 -> c2)
    -> relu -> max-pool 2 -> flatten (c2 * 5 * 5) -> ``fc1`` (-> f1) -> relu -> ``fc2``
    (-> f2) -> relu -> ``fc3`` (-> 10 logits). Every weight and bias is a ``PyroSample``
    with i.i.d. ``Normal(0, prior_scale)`` prior (sites ``conv1.weight``, ...,
    ``fc3.bias``).

    Args:
        prior_scale: Standard deviation of the Normal prior on every weight and bias.
        c1: Channels of ``conv1`` (6 in LeNet-5).
        c2: Channels of ``conv2`` (16 in LeNet-5).
        f1: Width of ``fc1`` (120 in LeNet-5).
        f2: Width of ``fc2`` (84 in LeNet-5).
        out_features: Number of classes.
    """

    def __init__(
        self,
        prior_scale: float = 1.0,
        c1: int = 6,
        c2: int = 16,
        f1: int = 120,
        f2: int = 84,
        out_features: int = 10,
    ) -> None:
        super().__init__()
        self.conv1 = _bayesian_conv2d(1, c1, 5, prior_scale, padding=2)
        self.conv2 = _bayesian_conv2d(c1, c2, 5, prior_scale)
        self.fc1 = _bayesian_linear(c2 * 5 * 5, f1, prior_scale)
        self.fc2 = _bayesian_linear(f1, f2, prior_scale)
        self.fc3 = _bayesian_linear(f2, out_features, prior_scale)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """Return the logits ``(B, out_features)``; observe ``y`` (if given) at site ``"obs"``."""
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        logits = self.fc3(x)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


def make_guide(
    model: Callable[..., Any],
    init_scale: float = 1e-4,
    init_loc_fn: Callable[..., torch.Tensor] | None = None,
) -> AutoNormal:
    """Build the mean-field ``AutoNormal`` guide used throughout the project.

    Args:
        model: The Pyro model (e.g. a :class:`BayesianMLP`).
        init_scale: Initial posterior standard deviation of every latent site.
        init_loc_fn: Optional Pyro init strategy for the posterior means
            (e.g. ``pyro.infer.autoguide.init_to_sample``); AutoNormal's default
            (``init_to_feasible``) is used when ``None``.

    Returns:
        An uninitialised ``AutoNormal``; its parameters are created on the first call
        and live in Pyro's global param store under ``AutoNormal.locs.<site>`` /
        ``AutoNormal.scales.<site>`` -- call ``pyro.clear_param_store()`` before building
        a guide for a different model.
    """
    if init_loc_fn is None:
        return AutoNormal(model, init_scale=init_scale)
    return AutoNormal(model, init_loc_fn=init_loc_fn, init_scale=init_scale)


def kl_factor(epoch: int, epochs: int, kl_max: float = 0.25) -> float:
    """KL annealing weight ``A(epoch) = kl_max * (epoch + 1) / epochs`` (``epoch`` is 0-based).

    Rises linearly from ``kl_max / epochs`` (about 0) in the first epoch to ``kl_max`` in
    the last one.
    """
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    if not 0 <= epoch < epochs:
        raise ValueError(f"epoch must be in [0, {epochs}), got {epoch}")
    return float(kl_max) * (epoch + 1) / epochs


class AnnealingMessenger(Messenger):
    """Poutine handler that rescales latent and observed sample sites differently.

    Every ``sample`` site that is *not* observed has its ``scale`` multiplied by
    ``latent_scale`` (the KL annealing factor ``A(e)``); every observed site has it
    multiplied by ``obs_scale`` (``N / batch_size`` for mini-batches). Apply it to both the
    model and the guide: Trace-ELBO estimators weight ``log p(w)`` by the model site's
    scale and ``log q(w)`` (or the analytic KL) by the guide site's scale.

    The attributes may be changed between SVI steps (e.g. once per epoch).

    Args:
        latent_scale: Factor for latent (unobserved) sites, ``>= 0``.
        obs_scale: Factor for observed sites, ``>= 0``.
    """

    def __init__(self, latent_scale: float = 1.0, obs_scale: float = 1.0) -> None:
        super().__init__()
        if latent_scale < 0 or obs_scale < 0:
            raise ValueError(
                f"scales must be >= 0, got latent_scale={latent_scale}, obs_scale={obs_scale}"
            )
        self.latent_scale = float(latent_scale)
        self.obs_scale = float(obs_scale)

    def _process_message(self, msg: dict[str, Any]) -> None:
        if msg["type"] != "sample" or site_is_subsample(msg):  # plates are not random variables
            return
        factor = self.obs_scale if msg["is_observed"] else self.latent_scale
        msg["scale"] = factor * msg["scale"]


def _as_tensor(a: Any, dtype: torch.dtype) -> torch.Tensor:
    """Convert numpy arrays / sequences / tensors to a CPU tensor of ``dtype``."""
    if isinstance(a, torch.Tensor):
        return a.detach().to(dtype=dtype)
    return torch.as_tensor(np.asarray(a), dtype=dtype)


def train_svi(
    model: Callable[..., Any],
    guide: Callable[..., Any],
    x: np.ndarray | torch.Tensor,
    y: np.ndarray | torch.Tensor,
    *,
    epochs: int,
    batch_size: int = 100,
    lr: float = 1e-3,
    kl_max: float = 0.25,
    seed: int = 0,
    progress: bool | Callable[[int, float], Any] = False,
) -> list[float]:
    """Train ``guide`` for ``model`` with mini-batch SVI, Adam and linear KL annealing.

    In epoch ``e`` (0-based) each step minimises the negative of::

        (N / |B|) * E_q[log p(y_B | x_B, w)] - kl_factor(e, epochs, kl_max) * KL(q || p)

    using :class:`pyro.infer.Trace_ELBO` (one-sample Monte Carlo KL) on model and guide
    wrapped in :class:`AnnealingMessenger`.
    Mini-batches are a fresh random permutation each epoch; the last batch may be
    smaller and is scaled by its own size. The model is called as ``model(x_B, y_B)``.
    Parameters are kept in Pyro's global param store (this function does not clear it).

    Args:
        model: Pyro model taking ``(x, y)``.
        guide: Guide for ``model`` (e.g. from :func:`make_guide`).
        x: Inputs, numpy array or tensor (converted to float32).
        y: Integer labels (converted to int64).
        epochs: Number of passes over the data (``>= 1``).
        batch_size: Mini-batch size.
        lr: Adam learning rate (``pyro.optim.Adam({"lr": lr})``).
        kl_max: Final KL weight ``A`` (the paper uses 0.25); ``1.0`` is the plain ELBO.
        seed: Passed to ``pyro.set_rng_seed`` (torch, numpy and random) before training.
        progress: ``True`` prints one line per epoch (epoch, loss, KL factor, seconds);
            a callable is called as ``progress(epoch, loss)`` with the 1-based epoch.

    Returns:
        The mean per-step loss (negative annealed ELBO, at full-data-set scale) of each
        epoch. Because ``A(e)`` grows every epoch, losses of different epochs are not
        comparable: for BNNs with many weights and a small ``init_scale`` the ``A(e) * KL``
        term dominates and the reported loss typically *increases* from epoch to epoch
        even while the fit improves (pass ``kl_max=0`` to see the likelihood term alone).
    """
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if kl_max < 0:
        raise ValueError(f"kl_max must be >= 0, got {kl_max}")
    x_t = _as_tensor(x, torch.float32)
    y_t = _as_tensor(y, torch.int64)
    n = int(x_t.shape[0])
    if n == 0 or int(y_t.shape[0]) != n:
        raise ValueError(f"x and y must have the same non-zero length, got {n} and {y_t.shape[0]}")

    pyro.set_rng_seed(seed)
    annealer = AnnealingMessenger()

    def annealed_model(*args: Any, **kwargs: Any) -> Any:
        with annealer:
            return model(*args, **kwargs)

    def annealed_guide(*args: Any, **kwargs: Any) -> Any:
        with annealer:
            return guide(*args, **kwargs)

    svi = SVI(annealed_model, annealed_guide, pyro.optim.Adam({"lr": lr}), Trace_ELBO())
    losses: list[float] = []
    for epoch in range(epochs):
        t0 = time.perf_counter()
        annealer.latent_scale = kl_factor(epoch, epochs, kl_max)
        perm = torch.randperm(n)
        total, steps = 0.0, 0
        for start in range(0, n, batch_size):
            idx = perm[start : start + batch_size]
            annealer.obs_scale = n / len(idx)
            total += svi.step(x_t[idx], y_t[idx])
            steps += 1
        loss = total / steps
        losses.append(loss)
        if callable(progress):
            progress(epoch + 1, loss)
        elif progress:
            print(
                f"epoch {epoch + 1:3d}/{epochs}  loss {loss:14.2f}  "
                f"kl_factor {annealer.latent_scale:.4f}  {time.perf_counter() - t0:6.2f}s",
                flush=True,
            )
    return losses


# --------------------------------------------------------------------------------------------
# ResNet-style Bayesian nets, written the TyXe way
# --------------------------------------------------------------------------------------------
class _BasicBlock(nn.Module):
    """conv3x3 → BN → ReLU → conv3x3 → BN, plus the shortcut (identity, or 1×1 conv → BN when the
    shape changes), then ReLU (He et al. 2016, CIFAR variant with projection shortcuts)."""

    def __init__(self, in_c: int, out_c: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_c, out_c, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_c)
        self.conv2 = nn.Conv2d(out_c, out_c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_c)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_c != out_c:
            self.shortcut = nn.Sequential(nn.Conv2d(in_c, out_c, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(out_c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR-style ResNet: conv3x3 → BN → ReLU → ``len(widths)`` stages of ``blocks`` basic blocks
    (the first block of every later stage has stride 2) → global average pooling → Linear.
    ``blocks=1, widths=(16, 32, 64)`` is a ResNet-8, ``blocks=3`` a ResNet-20."""

    def __init__(self, blocks: int = 1, widths: Sequence[int] = (16, 32, 64), in_channels: int = 3,
                 out_features: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        stages, in_c = [], widths[0]
        for i, w in enumerate(widths):
            for j in range(blocks):
                stages.append(_BasicBlock(in_c, w, 2 if (i > 0 and j == 0) else 1))
                in_c = w
        self.layers = nn.Sequential(*stages)
        self.fc = nn.Linear(in_c, out_features)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """Return the logits; observe ``y`` (if given) at site ``"obs"``."""
        out = self.layers(F.relu(self.bn1(self.conv1(x))))
        logits = self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


def bayesian_resnet(blocks: int = 1, widths: Sequence[int] = (16, 32, 64), in_channels: int = 3,
                    out_features: int = 10, prior_scale: float = 1.0) -> PyroModule:
    """A :class:`ResNet` made Bayesian the TyXe way: ``pyro.nn.module.to_pyro_module_`` and a
    ``PyroSample`` ``Normal(0, prior_scale)`` prior on every conv/linear weight and bias (sites
    ``conv1.weight``, ``layers.0.conv1.weight``, …, ``fc.bias``); BatchNorm parameters stay plain
    parameters and the net is put in eval mode (running statistics)."""
    net = ResNet(blocks, widths, in_channels, out_features)
    pyro.nn.module.to_pyro_module_(net)
    for module in net.modules():
        if isinstance(module, nn.Conv2d | nn.Linear):
            for name, p in list(module.named_parameters(recurse=False)):
                setattr(module, name, PyroSample(
                    dist.Normal(0.0, prior_scale).expand(list(p.shape)).to_event(p.dim())))
    return net.eval()


def he_init_loc(site: dict[str, Any], rng: np.random.Generator | None = None) -> torch.Tensor:
    """AutoNormal ``init_loc_fn``: weights ~ N(0, 2/fan_in) (He), the last Linear (site name
    starting with ``fc``) N(0, 1/fan_in), biases 0.  The normals come from ``rng`` (NumPy) when
    given, else from torch's global generator."""
    shape = site["fn"].shape()
    if len(shape) < 2:
        return torch.zeros(shape)
    fan_in = int(np.prod(shape[1:]))
    gain = 1.0 if site["name"].startswith("fc") else 2.0
    noise = torch.randn(shape) if rng is None else torch.as_tensor(rng.standard_normal(tuple(shape)),
                                                                   dtype=torch.float32)
    return noise * (gain / fan_in) ** 0.5


def he_posterior(model: Callable[..., Any], x: torch.Tensor, scale: float = 0.02,
                     seed: int = 0) -> AutoNormal:
    """An untrained ``AutoNormal`` posterior for the fidelity benchmarks: means at He scale
    (:func:`he_init_loc`), every posterior standard deviation ``scale``; initialised by one call
    on ``x`` (clears the param store).  Works for any model of this module.

    The means are drawn from a NumPy generator seeded with ``seed``, not from torch's global
    generator: with ``torch.manual_seed(seed)`` the means would be the very normals that the
    first guide sample after ``pyro.set_rng_seed(seed)`` draws (same stream, same site order),
    so that sample's weight noise would be proportional to the means (a 37-sd outlier of the
    ResNet-20 logits; it alone made 65 % of a 200-sample Monte Carlo variance)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    rng = np.random.default_rng(seed)
    guide = make_guide(model, init_scale=scale, init_loc_fn=lambda site: he_init_loc(site, rng))
    guide(x, torch.zeros(len(x), dtype=torch.long))
    return guide
