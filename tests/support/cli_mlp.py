"""A briefly trained MNIST MLP saved the way the command line reads it: a builder file, a param store
saved with ``pyro.get_param_store().save()`` and test digits (used by the CLI tests and the
uncertainty head's CLI test, through the session fixture ``trained`` of tests/conftest.py)."""
from __future__ import annotations

import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyro

if TYPE_CHECKING:
    from pyro2pfp.network import PFPNetwork

BUILDER = textwrap.dedent("""\
    from pyro2pfp_experiments.zoo import BayesianMLP, make_guide

    HIDDEN = {hidden}

    def build():
        model = BayesianMLP(784, (HIDDEN,), 10)
        return model, make_guide(model, init_scale=0.02)
    """)


def train_and_save(work: Path) -> tuple[Path, PFPNetwork, np.ndarray]:
    """Write ``builder.py``, train its MLP one epoch of SVI on 300 digits, save ``params.pt`` and
    ``digits.npy`` (6 test digits) into ``work``; returns ``(work, the network converted in this
    process, the test digits)``.  Seeded, so the result does not depend on which test asks first."""
    import pyro2pfp
    from pyro2pfp.cli import load_builder
    from pyro2pfp_experiments.datasets import load_mnist
    from pyro2pfp_experiments.zoo import train_svi

    (work / "builder.py").write_text(BUILDER.format(hidden=16))
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model, guide = load_builder(str(work / "builder.py") + ":build")()
    x_train, y_train, x_test, _ = load_mnist(n_train=300, n_test=6, seed=0)
    train_svi(model, guide, x_train, y_train, epochs=1, batch_size=100, lr=1e-2)
    pyro.get_param_store().save(str(work / "params.pt"))
    np.save(work / "digits.npy", x_test)
    net = pyro2pfp.convert(model, guide, input_shape=(1, 28, 28))  # the in-process result
    pyro.clear_param_store()
    return work, net, x_test
