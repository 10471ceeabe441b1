"""convert(..., check=x): the network compares itself with samples of the guide and warns, naming the
first layer that parts from sampling, when the output moments differ beyond the sampling noise (the spot check
every convert runs refuses gross differences: tests/fidelity/test_spot_check.py)."""
from __future__ import annotations

import logging
import math
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroSample

import pyro2pfp
from pyro2pfp.analysis.fidelity import FidelityBounds
from pyro2pfp.diagnosis import layer_fidelity


def _prior(*shape: int) -> PyroSample:
    return PyroSample(dist.Normal(0.0, 1.0).expand(list(shape)).to_event(len(shape)))


class TinyPoolCNN(PyroModule):
    """conv 3x3 (2 channels) → ReLU → 2x2 max pool → Linear: with the conv bias' posterior variance
    dominating, the four inputs of every pooling window are almost perfectly correlated, which the
    mean-field Clark max (independent inputs) gets wrong: variance too small, mean too large."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = PyroModule[nn.Conv2d](1, 2, 3, padding=1)
        self.conv.weight, self.conv.bias = _prior(2, 1, 3, 3), _prior(2)
        self.fc = PyroModule[nn.Linear](32, 3)
        self.fc.weight, self.fc.bias = _prior(3, 32), _prior(3)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.fc(torch.flatten(F.max_pool2d(F.relu(self.conv(x)), 2), 1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


class OneHiddenMLP(PyroModule):
    """Linear → ReLU → Linear on a deterministic input: PFP's output moments are exact."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = PyroModule[nn.Linear](5, 12)
        self.fc1.weight, self.fc1.bias = _prior(12, 5), _prior(12)
        self.fc2 = PyroModule[nn.Linear](12, 3)
        self.fc2.weight, self.fc2.bias = _prior(3, 12), _prior(3)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.fc2(F.relu(self.fc1(x)))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


def _guide(model: PyroModule, x: torch.Tensor, scales: dict[str, float] | None = None) -> AutoNormal:
    rng = np.random.default_rng(0)
    locs = {"conv.bias": 1.0}  # every conv unit mostly active: the max is over correlated, comparable inputs

    def init(site: dict) -> torch.Tensor:
        shape = tuple(site["fn"].shape())
        if site["name"] in locs:
            return torch.full(shape, locs[site["name"]])
        return torch.as_tensor(0.3 * rng.standard_normal(shape), dtype=torch.float32)

    guide = AutoNormal(model, init_loc_fn=init, init_scale=0.02)
    guide(x, torch.zeros(len(x), dtype=torch.long))
    with torch.no_grad():
        for site, scale in (scales or {}).items():
            pyro.get_param_store()[f"AutoNormal.scales.{site}"] = torch.full_like(
                pyro.param(f"AutoNormal.scales.{site}"), scale)
    return guide


def _store_snapshot() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in pyro.get_param_store().items()}


@pytest.mark.slow
def test_check_warns_at_max_pooling_and_leaves_the_user_state_alone():
    model = TinyPoolCNN()
    x = torch.randn(4, 1, 8, 8)
    guide = _guide(model, x, {"conv.bias": 1.0})
    store = _store_snapshot()
    pyro.set_rng_seed(5)
    # the paper's independent max pool: the rule this check must catch; so grossly that the spot check every
    # convert runs refuses it, naming the pool
    with pytest.raises(pyro2pfp.FidelityError, match=r"first layer past these bounds is 'max_pool2d'"):
        pyro2pfp.convert(model, guide, input_shape=(1, 8, 8), correlation="mean-field", max_pool="independent")
    pyro.set_rng_seed(5)
    pyro2pfp.convert(model, guide, input_shape=(1, 8, 8), correlation="mean-field", max_pool="independent",
                     check=False)
    rng_without_check = torch.get_rng_state(), np.random.get_state()[1].copy()
    pyro.set_rng_seed(5)
    with pytest.warns(pyro2pfp.FidelityWarning) as record:
        net = pyro2pfp.convert(model, guide, input_shape=(1, 8, 8), correlation="mean-field",
                               max_pool="independent", check=x)
    # the check consumed no random numbers of the caller's streams, and changed no parameter
    assert torch.equal(torch.get_rng_state(), rng_without_check[0])
    assert np.array_equal(np.random.get_state()[1], rng_without_check[1])
    assert store.keys() == dict(pyro.get_param_store().items()).keys()
    for k, v in pyro.get_param_store().items():
        assert torch.equal(v.detach(), store[k]), k
    message = str(record[0].message)
    check = net.fidelity
    assert not check.passed and check.first_layer is not None
    assert check.first_layer.op == "max_pool2d" and "'max_pool2d'" in message
    assert "150 guide samples on 4 inputs" in message and f"({check.seconds:.1f} s)" in message
    assert "correlation='shared-factor'" in message  # the remedy for a mean-field plan
    # the layers before the pooling are within the bounds: it is where mean-field PFP breaks
    rows = {r.name: r for r in check.diagnosis.layers}
    assert not check.bounds.violations(rows["conv"]) and not check.bounds.violations(rows["relu"])
    assert check.bounds.violations(check.output)


@pytest.mark.slow
def test_check_passes_on_an_exact_network(caplog):
    model = OneHiddenMLP()
    x = torch.randn(6, 5)
    guide = _guide(model, x, {"fc1.weight": 0.3, "fc2.weight": 0.3})
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="pyro2pfp.analysis.fidelity"):
        warnings.simplefilter("error", pyro2pfp.FidelityWarning)
        net = pyro2pfp.convert(model, guide, check=x)
    check = net.fidelity
    assert check.passed and check.first_layer is None
    assert check.output.name == net.layer_graph.output
    assert "fidelity check passed" in caplog.text and "s)" in caplog.text
    spot = pyro2pfp.convert(model, guide).fidelity  # without check=x: the spot check
    assert spot.passed and spot.num_samples == 64
    assert pyro2pfp.convert(model, guide, check=False).fidelity is None


def test_bounds_come_from_the_sample_count():
    """Exact PFP moments pass the bounds on Gaussian samples, for independent and fully correlated elements
    alike; a variance or mean off by twice the tolerance (the bound's distance from exact, doubled) fails them.
    100 repetitions at n = 150 and 40."""
    rng = np.random.default_rng(0)
    for n in (150, 40):
        bounds = FidelityBounds(n)
        lo, hi = bounds.ratio
        assert lo < 1 < hi and math.isclose(math.log(hi), -math.log(lo))
        for rep in range(100):
            sd = rng.uniform(0.5, 2.0, size=(1, 64))
            z = rng.standard_normal((n, 1 if rep % 2 else 64))  # odd reps: every element the same noise
            samples = 3.0 + sd * z
            m, v = samples.mean(0, keepdims=True), samples.var(0, ddof=1, keepdims=True)
            mean, var = np.full_like(m, 3.0), sd**2
            assert not bounds.violations(layer_fidelity("l", "", mean, var, m, v)), (n, rep)
            assert bounds.violations(layer_fidelity("l", "", mean, var / hi**2, m, v)), (n, rep)
            assert bounds.violations(layer_fidelity("l", "", mean, var * hi**2, m, v)), (n, rep)
            assert bounds.violations(layer_fidelity("l", "", mean + 2 * bounds.mean_error * sd, var, m, v)), (n, rep)


def test_median_ratio_bound_follows_the_measured_noise():
    """The variance-ratio bound is tolerance x the median's noise measured on split samples: an output whose
    variance is 20 % short on 160 independently sampled elements fails (the per-element interval alone,
    [0.63, 1.59] at n = 150, would pass it), while exact moments pass for independent and for strongly
    correlated elements (rho = 0.95: the median is then about as noisy as one element) in all but a few
    of 100 repetitions (t with 9 degrees of freedom: P(|t| > 4) = 0.3 %)."""
    import dataclasses

    from pyro2pfp.analysis.mc_compare import SPLITS, median_ratio_noise

    rng = np.random.default_rng(1)
    n, e = 150, 160
    bounds = FidelityBounds(n)
    assert bounds.ratio[0] < 0.8
    false_alarms = {False: 0, True: 0}
    for rep in range(100):
        for correlated in (False, True):
            sd = rng.uniform(0.5, 2.0, size=(e,))
            z = rng.standard_normal((n, e))
            if correlated:
                z = 0.95 * rng.standard_normal((n, 1)) + math.sqrt(1 - 0.95**2) * z
            samples = 3.0 + sd * z
            m, v = samples.mean(0), samples.var(0, ddof=1)
            groups = [samples[k::SPLITS].var(0, ddof=1) for k in range(SPLITS)]
            for scale in (1.0, 0.8):
                var = sd**2 * scale
                row = layer_fidelity("l", "", np.full(e, 3.0), var, m, v)
                row = dataclasses.replace(row, ratio_noise=median_ratio_noise(var, groups, np.ones(e, bool)))
                if scale == 1.0:
                    false_alarms[correlated] += bool(bounds.violations(row))
                elif not correlated:
                    assert bounds.violations(row), rep
    assert false_alarms[False] == 0 and false_alarms[True] <= 3, false_alarms


@pytest.mark.slow
def test_auto_picks_the_compact_plan_where_a_dense_layer_sums_conv_positions(monkeypatch):
    """conv → pool → flatten → dense: ``auto`` picks the compact factor plan (its cost model accepts it) and the
    plan printout says what it carries and why; over the cost budget it keeps mean-field and warns that the dense
    layer sums positions sharing a conv's weight noise, with the shared-factor plan's cost and why not compact;
    an MLP, and an explicit ``correlation='mean-field'``, convert without that warning."""
    from pyro2pfp.correlation import compact

    model = TinyPoolCNN()
    x = torch.randn(4, 1, 8, 8)
    guide = _guide(model, x)
    monkeypatch.setattr(compact, "COST_BUDGET", 1.5)  # this tiny net's conv directions cost x1.37
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net = pyro2pfp.convert(model, guide, input_shape=(1, 8, 8))
    assert not [w for w in caught if "sums positions" in str(w.message)]
    assert net.plan.correlation == "compact-factor"
    printout = net.summary().splitlines()[-1]
    assert "block factors of" in printout and "chosen by correlation='auto'" in printout, printout
    monkeypatch.undo()
    with pytest.warns(pyro2pfp.PFPWarning, match=r"'fc' sums positions of conv channels.*shared-factor' keeps it at "
                                                  r"[0-9.]+x the multiply-adds.*over the budget x1.3"):
        net = pyro2pfp.convert(model, guide, input_shape=(1, 8, 8))
    assert net.plan.correlation == "mean-field"
    for other, xs, correlation in ((TinyPoolCNN(), x, "mean-field"), (OneHiddenMLP(), torch.randn(4, 5), "auto")):
        pyro.clear_param_store()
        guide = _guide(other, xs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pyro2pfp.convert(other, guide, input_shape=tuple(xs.shape[1:]), correlation=correlation)
        assert not [w for w in caught if "sums positions" in str(w.message)], correlation


@pytest.mark.slow
def test_bad_check_arguments():
    from pyro2pfp.analysis.fidelity import check_fidelity

    model = OneHiddenMLP()
    x = torch.randn(3, 5)
    guide = _guide(model, x)
    net = pyro2pfp.convert(model, guide)
    with pytest.raises(pyro2pfp.InputShapeError):
        check_fidelity(net, model, guide, torch.randn(3, 4))
    with pytest.raises(pyro2pfp.ArgumentError, match="example inputs"):
        check_fidelity(net, model, guide, True)
    with pytest.raises(pyro2pfp.ArgumentError, match="input variance"):
        pyro2pfp.convert(model, guide, input_variance=True, check=x)


def test_cli_convert_check(tmp_path, capsys):
    from pyro2pfp.cli import main

    (tmp_path / "builder.py").write_text(
        "import torch\nfrom tests.fidelity.test_fidelity import OneHiddenMLP, _guide\n"
        "def build():\n    m = OneHiddenMLP()\n    return m, _guide(m, torch.randn(2, 5))\n")
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32))
    out = tmp_path / "net.onnx"
    assert main(["convert", str(tmp_path / "builder.py") + ":build", "--check", str(tmp_path / "x.npy"),
                 "-o", str(out)]) == 0
    assert "fidelity check passed: 150 guide samples on 4 inputs" in capsys.readouterr().out
    assert out.exists()
    builder = str(tmp_path / "builder.py") + ":build"
    assert main(["convert", builder, "-o", str(out)]) == 0  # the spot check every conversion ends with
    assert "spot check, 64 guide samples on 2 inputs" in capsys.readouterr().out
    assert main(["convert", builder, "--no-check", "-o", str(out)]) == 0
    assert "spot check" not in capsys.readouterr().out
    assert main(["convert", builder, "--no-check", "--check", str(tmp_path / "x.npy"), "-o", str(out)]) == 1
    assert "--check X.npy and --no-check: give one" in capsys.readouterr().err
