"""A saved posterior converts to the trained network, in every Pyro lifecycle.

Cross-process (tests/support/lifecycle_worker.py): one process trains with SVI, saves the param store and
records ``Predictive``'s answers on test inputs (the independent truth); a fresh process per model
builds the model and guide, loads the store (``load(path)`` and ``set_state(torch.load(...))``, with
and without running the guide first), converts, and runs the NumPy reference and the compiled module.

In-process: editing the store after the guide ran changes the network; ``module_local_params``; and
the consistency guard catches a stale posterior (these tests fail if the guard or the sync is removed).
"""
from __future__ import annotations

import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal, AutoLowRankMultivariateNormal, AutoNormal

import pyro2pfp
import pyro2pfp.frontend.posterior as posterior_module
from pyro2pfp.frontend.posterior.guard import check_posterior
from tests.support import lifecycle_worker as worker

WORKER = worker.__file__  # also run as a script in fresh processes
LIFECYCLES = ("load", "set_state", "run-guide-then-load", "run-guide-then-set_state")


PARALLEL_PIPELINES = 2  # the CI machine has 2 cores; each worker uses one torch thread


def _run(*args: str) -> str | None:
    """Run one worker step in a fresh interpreter; the failure message (with its stderr), or None."""
    result = subprocess.run([sys.executable, WORKER, *args], capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        return f"worker {args} failed (exit {result.returncode}):\n{result.stderr[-3000:]}"
    return None


def _pipeline(kind: str, out_dir: str) -> str | None:
    """Train in one process, then convert in a fresh one that only loads the saved store from disk."""
    return _run("train", kind, out_dir) or _run("convert", kind, out_dir)


def _selected_kinds(request: pytest.FixtureRequest) -> list[str]:
    """The kinds whose test was collected and selected (-k, node ids), in collection order."""
    kinds = [item.callspec.params["kind"] for item in request.session.items
             if getattr(item, "originalname", None) == "test_fresh_process_converts_the_saved_posterior"
             and item.module is request.module]
    return kinds or list(worker.KINDS)


@pytest.fixture(scope="module")
def pipelines(request, tmp_path_factory):
    """Every selected kind's train -> convert pipeline, at most PARALLEL_PIPELINES running at once.

    Each pipeline is two fresh subprocesses (~2 s / ~4 s of each is interpreter start-up and
    imports), so running kinds concurrently rather than one after the other halves the wall time;
    each test still waits for and checks its own kind, so failures are reported per kind.
    """
    out = tmp_path_factory.mktemp("lifecycle")
    kinds = sorted(_selected_kinds(request), key=lambda k: not k.endswith("lenet"))  # longest first
    with ThreadPoolExecutor(max_workers=PARALLEL_PIPELINES) as pool:
        futures = {kind: pool.submit(_pipeline, kind, str(out)) for kind in kinds}
        yield out, futures
        for future in futures.values():  # an unselected/failed test must not leave workers behind
            future.cancel()


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(worker.KINDS))
def test_fresh_process_converts_the_saved_posterior(kind, pipelines):
    trained_dir, futures = pipelines
    future: Future[str | None] = futures[kind]
    failure = future.result()
    assert failure is None, failure
    truth = np.load(trained_dir / f"{kind}-truth.npz")
    mc_mean, mc_var = truth["mean"], truth["var"]
    mc_error = np.sqrt(mc_var / worker.MC_SAMPLES)
    # The trained networks are far from their initial values (logits 0): the test can tell them apart.
    assert np.median(np.abs(mc_mean)) > 20 * np.median(mc_error)
    for lifecycle in LIFECYCLES:
        out = np.load(trained_dir / f"{kind}-{lifecycle}.npz")
        mean, var = out["mean"], out["var"]
        agreement = np.mean(mean.argmax(1) == mc_mean.argmax(1))
        ratio = np.median(var / mc_var)
        if kind in worker.EXACT:
            # One hidden layer, deterministic input: PFP's moments are exact, so only MC error remains.
            assert np.all(np.abs(mean - mc_mean) <= 5.5 * mc_error), (lifecycle, np.abs(mean - mc_mean) / mc_error)
            assert 0.85 <= ratio <= 1.15, (lifecycle, ratio)
            assert agreement >= 0.95, (lifecycle, agreement)
        else:  # PFP approximates: correlated weights (low-rank guide), correlated activations (LeNet)
            assert np.median(np.abs(mean - mc_mean) / np.sqrt(mc_var)) <= 0.25, lifecycle
            assert 0.4 <= ratio <= 2.5, (lifecycle, ratio)
            assert agreement >= 0.9, (lifecycle, agreement)
        if "compiled_mean" in out:
            # float32 rounding through several layers, with cancellation in logits near 0 (the
            # LeNet's logits reach ±130): ~1e-4 of the output scale; a stale or wrong net is O(1) off.
            np.testing.assert_allclose(out["compiled_mean"], mean, rtol=1e-4, atol=5e-4 * np.abs(mean).max())
            np.testing.assert_allclose(out["compiled_var"], var, rtol=1e-3, atol=5e-4 * var.max())
    # All four lifecycles give the same network.
    first = np.load(trained_dir / f"{kind}-load.npz")
    for lifecycle in LIFECYCLES[1:]:
        np.testing.assert_array_equal(np.load(trained_dir / f"{kind}-{lifecycle}.npz")["mean"], first["mean"])


# ---------------------------------------------------------------------------------------------
# In-process lifecycles
# ---------------------------------------------------------------------------------------------


def _trained(guide_cls=AutoNormal, steps: int = 150):
    model = worker.TutorialMLP()
    guide = guide_cls(model)
    x, y = worker.data("mlp")
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.03}), Trace_ELBO())
    for _ in range(steps):
        svi.step(x, y)
    return model, guide, x[:16].numpy()


@pytest.mark.slow
def test_editing_the_store_after_the_guide_ran_changes_the_network():
    model, guide, x = _trained()
    before = pyro2pfp.convert(model, guide).reference(x)[0]
    store = pyro.get_param_store()
    store["AutoNormal.locs.out.bias"] = store["AutoNormal.locs.out.bias"].detach() + torch.tensor([5.0, 0.0, -1.0])
    after = pyro2pfp.convert(model, guide).reference(x)[0]
    np.testing.assert_allclose(after - before, np.tile([5.0, 0.0, -1.0], (len(x), 1)), atol=1e-5)


@pytest.mark.slow
def test_scales_edited_in_the_store_reach_the_variances():
    model, guide, x = _trained()
    store = pyro.get_param_store()
    old_bias_var = store["AutoNormal.scales.out.bias"].detach().double().numpy() ** 2
    var_before = pyro2pfp.convert(model, guide).reference(x)[1]
    store["AutoNormal.scales.out.bias"] = torch.full((3,), 2.0)
    var_after = pyro2pfp.convert(model, guide).reference(x)[1]
    np.testing.assert_allclose(var_after - var_before, np.tile(4.0 - old_bias_var, (len(x), 1)),
                               rtol=1e-6, atol=1e-9)


@pytest.mark.slow
def test_diagonal_guide_loaded_into_a_live_session():
    """AutoDiagonalNormal's ``loc`` is a plain nn.Parameter: running the guide does not refresh it."""
    model, guide, x = _trained(AutoDiagonalNormal)
    trained = pyro2pfp.convert(model, guide).reference(x)
    state = pyro.get_param_store().get_state()
    saved = {k: v.detach().clone() for k, v in state["params"].items()}
    _ = [p.data.zero_() for p in guide.parameters()]  # the live guide drifts (e.g. a restart)
    pyro.get_param_store().set_state({"params": saved, "constraints": state["constraints"]})
    again = pyro2pfp.convert(model, guide).reference(x)
    np.testing.assert_allclose(again[0], trained[0], rtol=1e-12)
    np.testing.assert_allclose(again[1], trained[1], rtol=1e-12)


@pytest.mark.slow
def test_module_local_params(tmp_path):
    """With module_local_params the guide's own state_dict is the posterior (no global store)."""
    with pyro.settings.context(module_local_params=True):
        model, guide, x = _trained(steps=100)
        trained = pyro2pfp.convert(model, guide).reference(x)
        torch.save(guide.state_dict(), tmp_path / "guide.pt")
        model2 = worker.TutorialMLP()
        guide2 = AutoNormal(model2)
        guide2(torch.as_tensor(x[:2]), torch.zeros(2, dtype=torch.long))
        guide2.load_state_dict(torch.load(tmp_path / "guide.pt"))
        again = pyro2pfp.convert(model2, guide2).reference(x)
    np.testing.assert_allclose(again[0], trained[0], rtol=1e-12)
    assert np.abs(trained[0]).max() > 1.0


@pytest.mark.slow
@pytest.mark.parametrize("guide_cls", [AutoNormal, AutoDiagonalNormal])
def test_guard_catches_a_stale_posterior(guide_cls, tmp_path, monkeypatch):
    """Without the sync, the stale (initial) guide parameters would be read: the guard must say so."""
    _trained(guide_cls)
    pyro.get_param_store().save(tmp_path / "params.pt")
    pyro.clear_param_store()
    model = worker.TutorialMLP()
    guide = guide_cls(model)
    guide(*[torch.as_tensor(a) for a in (worker.data("mlp", n=4))])
    pyro.get_param_store().load(tmp_path / "params.pt")
    monkeypatch.setattr(posterior_module, "sync_with_param_store", lambda *args, **kwargs: None)
    with pytest.raises(pyro2pfp.PosteriorError, match="not the one the guide samples"):
        pyro2pfp.convert(model, guide)
    monkeypatch.undo()
    net = pyro2pfp.convert(model, guide)  # with the sync, the same objects convert
    assert np.abs(net.reference(worker.data("mlp", n=8)[0].numpy())[0]).max() > 1.0


@pytest.mark.slow
def test_guard_rejects_wrong_scales_and_means():
    """The guard's bounds: the true posterior passes; a scale off by 20 % or a mean off by 0.2 sd fails."""
    model, guide, x = _trained()
    sites = ["fc1.weight", "fc1.bias", "out.weight", "out.bias"]
    true = {s: tuple(np.asarray(a, dtype=np.float64) for a in
                     (guide._get_loc_and_scale(s)[0].detach(), guide._get_loc_and_scale(s)[1].detach() ** 2))
            for s in sites}
    args = (torch.as_tensor(x),)
    for seed in range(5):
        pyro.set_rng_seed(seed)
        check_posterior(guide, true, args)
    # HIDDEN*D_IN + ... = 276 weights: 20 % off in scale moves mean(r²) to 0.69 / 1.56.
    for factor in (1.2 ** 2, 1 / 1.2 ** 2, 4.0):
        wrong = {s: (m, v * factor) for s, (m, v) in true.items()}
        with pytest.raises(pyro2pfp.PosteriorError, match="mean squared residual"):
            check_posterior(guide, wrong, args)
    shifted = {s: (m + 0.2 * np.sqrt(v), v) for s, (m, v) in true.items()}
    with pytest.raises(pyro2pfp.PosteriorError, match="residual"):
        check_posterior(guide, shifted, args)
    deterministic = dict(true, **{"out.bias": (true["out.bias"][0], np.zeros(3))})
    with pytest.raises(pyro2pfp.PosteriorError, match="deterministic"):
        check_posterior(guide, deterministic, args)


@pytest.mark.slow
def test_guard_on_a_correlated_guide():
    """Low-rank guide: the whitened latent residual around the read means, and the read marginals."""
    model, guide, x = _trained(lambda m: AutoLowRankMultivariateNormal(m, rank=2, init_scale=0.01))
    net = pyro2pfp.convert(model, guide)
    read = {layer.params[p].site: (layer.params[p].mean, layer.params[p].var)
            for layer in net.layer_graph.layers for p in layer.params if layer.params[p].site}
    args = (torch.as_tensor(x),)
    check_posterior(guide, read, args)
    with pytest.raises(pyro2pfp.PosteriorError, match="whitened"):
        check_posterior(guide, {s: (m + 0.2 * np.sqrt(v), v) for s, (m, v) in read.items()}, args)
    with pytest.raises(pyro2pfp.PosteriorError, match="marginal variances"):
        check_posterior(guide, {s: (m, 1.2 * v) for s, (m, v) in read.items()}, args)


def test_never_run_guide_without_a_store_is_an_error():
    model = worker.TutorialMLP()
    with pytest.raises(pyro2pfp.PosteriorError, match="param store is empty"):
        pyro2pfp.convert(model, AutoNormal(model))
    assert len(pyro.get_param_store()) == 0  # the initial values were not left in the store


def test_store_of_another_model_is_an_error():
    """A guide that was never run, with a store that holds another model's posterior."""
    other = worker.SmallLeNet()
    AutoNormal(other)(torch.zeros(2, 1, worker.IMAGE, worker.IMAGE), torch.zeros(2, dtype=torch.long))
    model = worker.TutorialMLP()
    with pytest.raises(pyro2pfp.PosteriorError, match="same model and guide"):
        pyro2pfp.convert(model, AutoNormal(model))
