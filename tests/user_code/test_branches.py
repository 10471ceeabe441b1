"""Nets whose branches are joined by ``torch.cat`` (tests/support/branch_models.py), as their authors write
them: a TyXe heteroscedastic regressor with a mean and a softplus-scale output layer joined by
``torch.cat([mean, scale], -1)``, the same in plain Pyro, and an Inception-style two-branch CNN.

Across processes (train + save the param store in one, build + load + convert in a fresh one) against
``Predictive`` run in the training process (1000 samples), with the gallery's bounds from the sample
count (tests/user_code/test_gallery.py): ``|Δmean| ≤ 5`` MC standard errors, ``|Δvar| ≤ 6`` standard
errors of the MC variance and the median variance ratio within [0.85, 1.15] (approximate models: a hidden
layer before each head, a softplus scale column, ReLU + pooling before the CNN's Linear); the CNN's
argmax agrees on ≥ 95 % of the inputs.  In-process: which column is the mean and which the scale."""
from __future__ import annotations

import warnings

import numpy as np
import pyro
import pytest

from pyro2pfp.frontend.noise import HeteroscedasticNoise
from tests.support import branch_models as B
from tests.support import gallery_models as G

WORKER = B.__file__


@pytest.mark.parametrize("name", ["tyxe-two-heads", "pyro-two-heads"])
def test_the_heads_joined_by_cat_are_read_as_mean_and_scale(name):
    """The network ends at the concatenation; the mean is its column 0 and the scale its column 1
    (TyXe: its first and second half, the scale as given; plain Pyro: read from the likelihood,
    ``softplus`` and the floor as the link)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    entry = B.BRANCHES[name]
    built = entry.build()
    x, y = entry.data(8, 0)
    if built.bnn is not None:
        built.bnn.guide(x)
    else:
        built.guide(x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net = built.convert()
    assert net.plan.layer(net.plan.output).op == "concat"
    noise = net.noise
    assert isinstance(noise, HeteroscedasticNoise) and noise.output_shape == (2,)
    assert noise.mean_index.reshape(-1).tolist() == [0] and noise.scale_index.reshape(-1).tolist() == [1]
    if name == "tyxe-two-heads":
        assert noise.link == ()
    else:
        assert [step.op for step in noise.link] == ["aten.softplus.default", "aten.add.Tensor"]
    out = net.regression(*net.reference(x.numpy()))
    assert np.all(out["aleatoric"] > 0) and np.all(np.isfinite(out["total"]))


def _check(entry: G.Entry, pfp: dict, mc: dict) -> dict:
    a = G.agreement(entry, pfp, mc)
    assert a["max_mean_err_sd"] <= 5.0, a
    assert a["max_var_err_se"] <= 6.0 and 0.85 <= a["median_var_ratio"] <= 1.15, a
    if entry.task == "classification":
        assert a["argmax_agreement"] >= 0.95, a
        assert np.median(np.abs(mc["mc_mean"])) > 20 * np.median(mc["se_mean"])  # trained, not all-zero logits
    else:
        epistemic_only = np.abs(pfp["epistemic"] - mc["mc_var"]) / mc["se_var"]
        assert epistemic_only.max() > 10.0, epistemic_only.max()  # the scale head matters
    return a


@pytest.mark.slow
@pytest.mark.parametrize("name", list(B.BRANCHES))
def test_a_net_of_joined_branches_in_a_fresh_process(name, tmp_path):
    """Train and save in one process, load and convert in another, compare with Predictive."""
    pfp, truth = G.cross_process(WORKER, name, tmp_path)
    _check(B.BRANCHES[name], pfp, truth)
