"""The uncertainty head ``softmax_head`` (``convert(..., head="probs")``, ``pyro2pfp/ops/head.py``):
class probabilities, predictive entropy, expected softmax entropy and mutual information from the
logits' (mean, variance) without sampling, in the compiled module, the NumPy reference and ONNX.

Tolerances.  The head is a fixed quadrature, an approximation, so it is
checked against logit sampling (20,000 draws per input: the Monte Carlo error, ~0.003 on a
probability, is small against the bounds) with the bounds measured for it and stated here, per
regime of the logit variance; and, so that the bounds cannot hide a wrong formula, its probability
error must also be well below that of the plug-in ``softmax(μ)``.  Compiled (float32) and ONNX
against the float64 reference: ``2e-6`` absolute on probabilities and entropies (a few float32 ulps
of values of order 1, summed over 2K + 1 points).
"""
from __future__ import annotations

import functools
import json

import numpy as np
import pyro
import pytest
import torch
import torch.nn as nn
from pyro.infer import autoguide
from pyro.nn import PyroModule
from scipy.special import softmax
from scipy.stats import spearmanr

import pyro2pfp
from pyro2pfp.errors import ArgumentError
from pyro2pfp.network import PFPNetwork
from pyro2pfp.ops.head import HeadOutput, append_head, head_numpy
from pyro2pfp.planning.graph import INPUT, Layer, LayerGraph
from pyro2pfp.planning.plan import plan
from pyro2pfp.runtime.predictor import CompiledPFP
from pyro2pfp.runtime.uncertainty import uncertainty
from tests.support.op_coverage import COMPILED, MONTE_CARLO, covers
from tests.user_code.test_styles import CLASSES, D_IN, HIDDEN, data, fit, likelihood, prior

ATOL32 = 2e-6


def head_net(k: int, input_variance: bool = True) -> PFPNetwork:
    """The head alone on a batch of logits: ``x`` (and ``x_var``) are the logits' mean (and variance)."""
    graph = LayerGraph((k,), [Layer("logits", "scale", [INPUT], (k,), "logits", {"factor": 1.0})], "logits",
                       input_variance=input_variance)
    return PFPNetwork(graph, plan(append_head(graph, "probs")))


@functools.cache
def compiled_head(k: int, input_variance: bool = True) -> tuple[PFPNetwork, CompiledPFP]:
    """``head_net(k)`` and its compiled module, built once per ``(k, input_variance)``: the head alone has no
    weights, so the tests that run it on different logits share one build."""
    net = head_net(k, input_variance)
    return net, net.compile()


def sampled(mean: np.ndarray, var: np.ndarray, n: int = 20_000) -> dict[str, np.ndarray]:
    """Logit sampling (pyro2pfp.uncertainty); one logit z is the two-class pair (0, z)."""
    if mean.shape[1] == 1:
        u = uncertainty(np.concatenate([0 * mean, mean], 1), np.concatenate([0 * var, var], 1), n, seed=1)
        u["probs"] = u["probs"][:, 1:]
        return u
    return uncertainty(mean, var, n, seed=1)


# (classes, sd of the logit means, largest logit variance) -> stated bounds on |head − sampling|
# for probs, predictive entropy, expected entropy, mutual information (nats)
REGIMES = {
    (10, 1.0, 0.25): (0.004, 0.007, 0.006, 0.002),
    (10, 3.0, 1.0): (0.01, 0.015, 0.03, 0.025),
    (3, 2.0, 2.0): (0.012, 0.025, 0.025, 0.03),
    (1, 2.0, 2.0): (0.008, 0.006, 0.009, 0.007),
}


@covers("softmax_head", kind=MONTE_CARLO)
@pytest.mark.parametrize("regime", [pytest.param(r, marks=pytest.mark.slow) if r[0] == 10 else r for r in REGIMES])
def test_head_against_logit_sampling(regime):
    k, mean_sd, var_max = regime
    rng = np.random.default_rng(0)
    mean, var = rng.normal(0, mean_sd, (64, k)), rng.uniform(0, var_max, (64, k))
    out = head_net(k).reference(mean, var)
    u = sampled(mean, var)
    bounds = REGIMES[regime]
    got = (out.probs, out.predictive_entropy, out.expected_entropy, out.mutual_information)
    for value, key, bound in zip(got, ("probs", "total", "aleatoric", "epistemic"), bounds, strict=True):
        err = np.abs(value - u[key]).max()
        assert err <= bound, f"{key}: max error {err:.3g} against sampling > {bound}"
    plug_in = softmax(np.concatenate([0 * mean, mean], 1) if k == 1 else mean, -1)[:, -k:]
    assert np.abs(out.probs - u["probs"]).max() < 0.5 * np.abs(plug_in - u["probs"]).max()
    # the mutual information ranks inputs as sampling does (what OOD detection uses)
    assert spearmanr(out.mutual_information, u["epistemic"]).statistic > 0.95
    # probabilities sum to one, entropies are consistent
    if k > 1:
        np.testing.assert_allclose(out.probs.sum(1), 1.0, atol=1e-12)
    assert np.all(out.mutual_information >= 0)
    assert np.all(out.mutual_information <= out.predictive_entropy + 1e-12)


def test_one_logit_is_the_two_class_softmax_of_zero_and_the_logit():
    rng = np.random.default_rng(2)
    mean, var = rng.normal(0, 2, (9, 1)), rng.uniform(0, 3, (9, 1))
    probs, stats = head_numpy(np.concatenate([0 * mean, mean], 1), np.concatenate([0 * var, var], 1))
    out = head_net(1).reference(mean, var)
    np.testing.assert_allclose(out.probs, probs[:, 1:], rtol=1e-12)
    np.testing.assert_allclose(np.stack(out[1:], 1), stats, rtol=1e-12)


@pytest.mark.slow
def test_zero_variance_gives_the_softmax_and_no_mutual_information():
    rng = np.random.default_rng(3)
    mean = rng.normal(0, 4, (7, 10))
    var = np.zeros_like(mean)
    net, exe = compiled_head(10)
    ref = net.reference(mean, var)
    np.testing.assert_allclose(ref.probs, softmax(mean, -1), rtol=1e-12)
    assert np.all(ref.mutual_information == 0.0)
    np.testing.assert_allclose(ref.predictive_entropy, ref.expected_entropy, rtol=1e-12)
    got = exe(mean.astype(np.float32), var.astype(np.float32))
    np.testing.assert_allclose(got.probs, softmax(mean.astype(np.float32).astype(np.float64), -1), atol=ATOL32)
    assert np.all(got.mutual_information == 0.0)  # exact in float32 too: deviations from the centre
    # a deterministic network (no input variance, deterministic logits): the same
    _, det = compiled_head(10, input_variance=False)
    out = det(mean.astype(np.float32))
    assert np.all(out.mutual_information == 0.0)
    np.testing.assert_allclose(out.probs, ref.probs, atol=ATOL32)


@pytest.mark.parametrize("case", ["huge_mean", "huge_var", "float32_max_var", "mixed"])
def test_limits_stay_finite(case):
    rng = np.random.default_rng(4)
    mean, var = rng.normal(0, 1, (5, 10)), rng.uniform(0, 1, (5, 10))
    if case == "huge_mean":
        mean = mean * 1e30
    elif case == "huge_var":
        var = var * 1e30
    elif case == "float32_max_var":
        var[:] = np.finfo(np.float32).max
    else:
        mean[:, 0], var[:, 1] = 1e30, 1e30
    net, exe = compiled_head(10)
    for out in (net.reference(mean, var), exe(mean.astype(np.float32), var.astype(np.float32))):
        for value in out:
            assert np.all(np.isfinite(value)), case
        np.testing.assert_allclose(out.probs.sum(1), 1.0, atol=1e-5)
        assert np.all(out.mutual_information >= 0)
        assert np.all(out.predictive_entropy <= np.log(10) + 1e-5)
    if case == "huge_mean":  # one class certain: no entropy at all
        ref = net.reference(mean, var)
        assert np.all(ref.predictive_entropy < 1e-12) and np.all(ref.mutual_information < 1e-12)


@covers("softmax_head", kind=COMPILED)
@pytest.mark.parametrize("k", [10, 3, 1])
@pytest.mark.parametrize("batch", [1, 7])
def test_compiled_and_onnx_match_the_reference(k, batch):
    ort = pytest.importorskip("onnxruntime")  # ONNX only; the compiled comparison below always runs
    net, exe = compiled_head(k)
    rng = np.random.default_rng(5)
    mean = rng.normal(0, 3, (batch, k)).astype(np.float32)
    var = rng.uniform(0, 3, (batch, k)).astype(np.float32)
    ref = net.reference(mean, var)
    got = exe(mean, var)
    assert isinstance(got, HeadOutput) and got.probs.dtype == np.float32
    for a, b in zip(got, ref, strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=ATOL32)
    sess = ort.InferenceSession(net.to_onnx().SerializeToString(), providers=["CPUExecutionProvider"])
    assert [o.name for o in sess.get_outputs()] == ["probs", "uncertainty"]
    probs, stats = sess.run(None, {"x": mean, "x_var": var})
    np.testing.assert_allclose(probs, ref.probs, atol=ATOL32)
    np.testing.assert_allclose(stats, np.stack(ref[1:], 1), atol=ATOL32)


# ------------------------------------------------------------------------------------ a converted MLP
class MLP(PyroModule):
    def __init__(self, classes: int = CLASSES):
        super().__init__()
        self.fc1 = PyroModule[nn.Linear](D_IN, HIDDEN)
        self.fc2 = PyroModule[nn.Linear](HIDDEN, classes)
        for layer in (self.fc1, self.fc2):
            layer.weight = prior(layer.weight.shape)
            layer.bias = prior(layer.bias.shape)

    def forward(self, x, y=None):
        return likelihood(self.fc2(torch.relu(self.fc1(x))), y)


@pytest.fixture(scope="module")
def mlp():
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = MLP()
    guide = autoguide.AutoNormal(model)
    fit(model, guide)
    return model, guide


@pytest.mark.slow
def test_converted_mlp_with_head_end_to_end(mlp, tmp_path):
    model, guide = mlp
    x = data(16, seed=3)[0].numpy()
    logits = pyro2pfp.convert(model, guide)
    net = pyro2pfp.convert(model, guide, head="probs")
    assert net.head == "probs" and logits.head is None
    assert net.plan.layers[-1].op == "softmax_head" and net.layer_graph.output == logits.layer_graph.output
    mean, var = logits.reference(x)
    ref = net.reference(x)
    expected = head_numpy(mean, var)
    np.testing.assert_allclose(ref.probs, expected[0], rtol=1e-12)
    np.testing.assert_allclose(np.stack(ref[1:], 1), expected[1], rtol=1e-12)
    # the same network's uncertainty by logit sampling: close (the MC bounds above)
    u = uncertainty(mean, var, 20_000, seed=0)
    assert np.abs(ref.probs - u["probs"]).max() < 0.03
    # compiled, exported, loaded: the same outputs (also from the static batch-16 executable)
    exe = net.compile(batch_sizes=[len(x)])
    got = exe(x)
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    path = tmp_path / "mlp_head.so"
    exe.export_library(path)
    meta = json.loads((tmp_path / "mlp_head.so.json").read_text())
    assert meta["head"] == "probs" and meta["outputs"] == ["probs", "uncertainty"]
    loaded = pyro2pfp.load(path)
    assert loaded.head == "probs" and loaded.vm_for_batch(len(x)) is not loaded.vm
    for a, b in zip(loaded(x), got, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(loaded(x[:3]), exe(x[:3]), strict=True):  # the any-batch executable
        np.testing.assert_array_equal(a, b)
    # a sidecar without the "head" entry (older writer): the kernel table still names the head
    del meta["head"]
    (tmp_path / "mlp_head.so.json").write_text(json.dumps(meta))
    assert pyro2pfp.load(path).head == "probs"
    # without the head nothing changed: (mean, var) of the logits
    plain = logits.compile()(x)
    assert isinstance(plain, tuple) and len(plain) == 2
    np.testing.assert_allclose(plain[0], mean, rtol=1e-4, atol=1e-5)
    # the CLI predicts with a head library
    from pyro2pfp.cli import main

    np.save(tmp_path / "x.npy", x)
    assert main(["predict", str(path), str(tmp_path / "x.npy"), "-o", str(tmp_path / "p.npz")]) == 0
    saved = np.load(tmp_path / "p.npz")
    np.testing.assert_array_equal(saved["mutual_information"], got.mutual_information)


def test_head_argument_errors(mlp):
    model, guide = mlp
    with pytest.raises(ArgumentError, match="head must be None"):
        pyro2pfp.convert(model, guide, head="entropy")
    graph = LayerGraph((2, 3), [Layer("r", "relu", [INPUT], (2, 3), "r")], "r")
    with pytest.raises(ArgumentError, match=r"vector of logits.*\(batch, 2, 3\)"):
        append_head(graph, "probs")
    with pytest.raises(ArgumentError, match="power of two"):
        append_head(LayerGraph((4,), [Layer("r", "relu", [INPUT], (4,), "r")], "r"), "probs", points=12)


@pytest.mark.slow
def test_cli_convert_with_head_and_predict(trained, capsys, monkeypatch):
    """``pyro2pfp convert --head probs`` to a library and to ONNX; ``pyro2pfp predict`` writes the four
    outputs, equal to the head on the in-process network's logits."""
    from pyro2pfp.cli import main

    work, net, x = trained  # tests/conftest.py: a briefly trained MNIST MLP, its builder and parameters
    monkeypatch.chdir(work)
    expected = head_numpy(*net.reference(x))
    for out in ("head.so", "head.onnx"):
        assert main(["convert", "builder.py:build", "-p", "params.pt", "-s", "1,28,28", "--head", "probs",
                     "-o", out]) == 0
        assert main(["predict", out, "digits.npy", "-o", "head_out.npz"]) == 0
        assert "mutual information" in capsys.readouterr().out
        with np.load(work / "head_out.npz") as res:
            np.testing.assert_allclose(res["probs"], expected[0], atol=1e-5)
            for i, key in enumerate(("predictive_entropy", "expected_entropy", "mutual_information")):
                np.testing.assert_allclose(res[key], expected[1][:, i], atol=1e-5)
    assert json.loads((work / "head.so.json").read_text())["head"] == "probs"
