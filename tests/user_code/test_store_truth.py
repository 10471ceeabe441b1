"""The param store, not the user's module object, holds a trained model's deterministic parameters, and a
network built from other values is never a silent answer.

The course-notebook form (``pyro.random_module`` with priors for the output layer only, a hand-written
guide) shows it without a second process: ``random_module`` lifts a *copy* of ``net``, so SVI trains the
store's tensors and ``net`` keeps its initial values even in the training process -- the way a fresh process
that loaded the store sees every registration form (tests/user_code/test_store_forms.py checks those across
processes).  Breaking the tracer's store read on purpose must make ``convert`` fail, naming the parameter;
``diagnose`` and the spot check name a layer whose weights differ from the store's.
"""
from __future__ import annotations

import numpy as np
import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

import pyro2pfp
import pyro2pfp.frontend.tracing
from pyro2pfp.analysis.fidelity import spot_check
from tests.support import store_forms as forms


@pytest.fixture(scope="module")
def notebook():
    """The notebook's model, guide and net, trained 25 SVI steps; the store's state."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model, guide, net = forms.notebook()
    x, y = forms.data(32, 0)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.1}), Trace_ELBO())
    for _ in range(25):
        svi.step(x, y)
    return model, guide, net, pyro.get_param_store().get_state()


def test_random_module_layers_are_read_from_the_store(notebook):
    model, guide, net, state = notebook
    pyro.get_param_store().set_state(state)
    stored = pyro.get_param_store()["module$$$fc1.weight"].detach()
    initial = net.fc1.weight.detach().clone()
    assert not torch.equal(initial, stored)  # the user's net holds its initial values
    pfp = pyro2pfp.convert(model, guide, input_shape=(forms.D_IN,))
    fc1 = pfp.layer_graph.layer("fc1").params["weight"]
    np.testing.assert_array_equal(fc1.mean, stored.double().numpy())
    assert fc1.store == "module$$$fc1.weight" and fc1.stale
    assert "weight = param store's 'module$$$fc1.weight'" in pfp.summary()
    x, _ = forms.data(8, 3)
    with torch.no_grad():
        samples = torch.stack([guide(None, None)(x) for _ in range(400)]).double().numpy()
    mean, var = pfp.reference(x.numpy())
    se = np.sqrt(samples.var(0, ddof=1) / 400)
    assert np.max(np.abs(mean - samples.mean(0)) / se) < 5  # exact: deterministic input to the one Bayesian layer
    assert 0.8 < np.median(var / samples.var(0, ddof=1)) < 1.25
    assert torch.equal(net.fc1.weight.detach(), initial)  # and still does


def test_a_stale_store_read_fails_the_conversion(notebook, monkeypatch):
    """The tracer's two guards, each alone: the traced parameters against the store (naming the entry), and the
    traced network against the model run eagerly with the store's values."""
    model, guide, _, state = notebook
    pyro.get_param_store().set_state(state)
    # the module's values
    monkeypatch.setattr(pyro2pfp.frontend.tracing, "take_store_values", lambda registrations: None)
    with pytest.raises(pyro2pfp.FidelityError, match=r"parameter fc1\.weight differs from the param store's "
                                                     r"'module\$\$\$fc1\.weight'"):
        pyro2pfp.convert(model, guide, input_shape=(forms.D_IN,))
    monkeypatch.setattr(pyro2pfp.frontend.tracing, "check_store_values", lambda values, names: None)
    with pytest.raises(pyro2pfp.FidelityError, match=r"does not compute what the model 'model' computes"):
        pyro2pfp.convert(model, guide, input_shape=(forms.D_IN,))


def test_diagnose_and_the_spot_check_name_weights_that_differ_from_the_store(notebook):
    """A network converted before the store changed (here: a deterministic layer's weights swapped in the
    store) is named as such by diagnose (a NOTE line) and refused by the spot check and check=x."""
    from pyro2pfp.analysis.fidelity import check_fidelity

    model, guide, _, state = notebook
    store = pyro.get_param_store()
    store.set_state(state)
    pfp = pyro2pfp.convert(model, guide, input_shape=(forms.D_IN,), check=False)
    with torch.no_grad():
        weight = store["module$$$fc2.weight"]
        weight.copy_(weight.flip(0))  # rows swapped: another network
    x, _ = forms.data(4, 3)
    d = pyro2pfp.diagnose(model, guide, x.numpy(), net=pfp, num_samples=20)
    assert d.mismatches == ["layer fc2's weight differs from the param store's 'module$$$fc2.weight' (max "
                            f"|difference| {d.mismatches[0].split('|difference| ')[1]}"]
    assert str(d).startswith("NOTE: layer fc2's weight differs from the param store's 'module$$$fc2.weight'")
    for check in (lambda: spot_check(pfp, model, guide), lambda: check_fidelity(pfp, model, guide, x)):
        with pytest.raises(pyro2pfp.FidelityError, match=r"layer fc2's weight differs from the param store's "
                                                         r"'module\$\$\$fc2\.weight'"):
            check()
