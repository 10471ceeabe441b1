"""Nets whose branches are joined by ``torch.cat``, written the way their authors write them, as entries
of the gallery (tests/support/gallery_models.py: the same training, truth and PFP answer), and a
worker for the cross-process lifecycle::

    python tests/support/branch_models.py train NAME DIR     # SVI, save the store + Predictive's truth
    python tests/support/branch_models.py convert NAME DIR   # fresh process: build, load, convert

* ``tyxe-two-heads``: a TyXe ``VariationalBNN`` regressor with two output layers, the mean and a
  softplus scale, joined by ``torch.cat([mean, scale], -1)`` (what TyXe's ``HeteroskedasticGaussian``
  splits in half: means first, then scales; ``positive_scale=True``);
* ``pyro-two-heads``: the same in plain Pyro -- two ``PyroModule[nn.Linear]`` heads joined by
  ``torch.cat``, the likelihood ``Normal(out[..., 0], softplus(out[..., 1]) + 1e-3)``;
* ``two-branch-cnn``: an Inception-style CNN -- a 1×1 and a 3×3 conv branch of the image joined along
  the channels, average pooling, a Linear -- ``correlation='auto'`` (shared factors: the pooling sums
  positions of conv outputs).
"""
from __future__ import annotations

import functools
import sys

import pyro
import pyro.distributions as dist
import torch
import torch.nn as nn
import torch.nn.functional as F
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroSample

try:
    from tests.support import gallery_models as G
except ModuleNotFoundError:  # run as a script: the repository root is not on the path yet
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    from tests.support import gallery_models as G

SIDE = 6  # the CNN's images are SIDE × SIDE, given flattened (the gallery's classification data)


class TwoHeads(nn.Module):
    """A shared Tanh hidden layer (TyXe's regression example), a mean head and a softplus scale head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(G.D_IN, G.HIDDEN), nn.Tanh())
        self.mean = nn.Linear(G.HIDDEN, 1)
        self.scale = nn.Linear(G.HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return torch.cat([self.mean(h), F.softplus(self.scale(h))], -1)


def tyxe_two_heads() -> G.Built:
    import tyxe

    import pyro2pfp.compat

    pyro2pfp.compat.patch_pyro_for_tyxe()
    bnn = tyxe.VariationalBNN(TwoHeads(), tyxe.priors.IIDPrior(dist.Normal(0.0, 1.0)),
                              tyxe.likelihoods.HeteroskedasticGaussian(G.N_TRAIN, positive_scale=True),
                              functools.partial(tyxe.guides.AutoNormal, init_scale=0.01))
    return G.Built(bnn.model, bnn.guide, bnn=bnn)


def _linear(i: int, o: int) -> PyroModule:
    layer = PyroModule[nn.Linear](i, o)
    layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand([o, i]).to_event(2))
    layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand([o]).to_event(1))
    return layer


class PyroTwoHeads(PyroModule):
    """Two output layers joined by ``torch.cat``; the likelihood reads the mean and the scale columns."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = _linear(G.D_IN, G.HIDDEN)
        self.mean = _linear(G.HIDDEN, 1)
        self.scale = _linear(G.HIDDEN, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = F.relu(self.hidden(x))
        out = torch.cat([self.mean(h), self.scale(h)], dim=-1)
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("obs", dist.Normal(out[..., 0], F.softplus(out[..., 1]) + 1e-3), obs=y)


class TwoBranchCNN(PyroModule):
    """Inception-style: a 1×1 and a 3×3 conv branch (ReLU each) joined along the channels, 2×2 average
    pooling, flatten, Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.branch1 = PyroModule[nn.Conv2d](1, 4, 1)
        self.branch3 = PyroModule[nn.Conv2d](1, 4, 3, padding=1)
        self.fc = PyroModule[nn.Linear](8 * (SIDE // 2) ** 2, G.CLASSES)
        for layer in (self.branch1, self.branch3, self.fc):
            for name, p in list(layer.named_parameters()):
                setattr(layer, name, PyroSample(dist.Normal(0.0, 1.0).expand(p.shape).to_event(p.dim())))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        image = x.view(-1, 1, SIDE, SIDE)
        h = torch.cat([F.relu(self.branch1(image)), F.relu(self.branch3(image))], dim=1)
        logits = self.fc(F.avg_pool2d(h, 2).flatten(1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


def _autonormal(model: PyroModule, **options: object) -> G.Built:
    return G.Built(model, AutoNormal(model, init_scale=0.01), **options)  # type: ignore[arg-type]


BRANCHES = {e.name: e for e in [
    G.Entry("tyxe-two-heads", "regression", tyxe_two_heads,
            "TyXe VariationalBNN, Tanh body, mean and softplus-scale heads joined by torch.cat([mean, scale], -1), "
            "HeteroskedasticGaussian(n, positive_scale=True)", exact=False),
    G.Entry("pyro-two-heads", "regression", lambda: _autonormal(PyroTwoHeads()),
            "PyroModule mean and scale heads joined by torch.cat, Normal(out[..., 0], softplus(out[..., 1]) + 1e-3)",
            exact=False),
    G.Entry("two-branch-cnn", "classification",
            lambda: _autonormal(TwoBranchCNN(), input_shape=(SIDE * SIDE,)),
            "Inception-style CNN: 1x1 and 3x3 conv branches joined by torch.cat(dim=1), avg-pool, Linear",
            exact=False, d_in=SIDE * SIDE, steps=400),
]}


if __name__ == "__main__":
    step, which, directory = sys.argv[1:4]
    torch.set_num_threads(1)
    G.GALLERY.update(BRANCHES)  # the gallery's worker steps, on these entries
    (G.worker_train if step == "train" else G.worker_convert)(which, directory)
