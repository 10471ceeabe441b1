"""Shared-factor PFP with ``injection='rescaled'`` compiled (TVM) and exported (ONNX) against the float64
NumPy reference (``ops/compute.py`` ``conv2d_shared``), with the tolerances of
tests/stages/correlation/test_correlation_backends.py: per output, ``|got − ref| ≤ RTOL·max|ref|``.

The compiled rule reuses the mean-field conv kernel's weight-noise term (a third output of that kernel
with a variance input; the variance itself with a deterministic one) instead of the regression
convolution on the input mean: the tests also check that the module has that shape.
"""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch
import tvm

from pyro2pfp.backends.tvm import emit_module
from pyro2pfp.backends.tvm.emit import kernel_table
from pyro2pfp.correlation import plan_factors
from pyro2pfp.network import PFPNetwork
from pyro2pfp.planning.graph import INPUT, LayerGraph
from pyro2pfp.planning.plan import PlannedGraph, plan
from tests.support.backends import ONNX_RTOL, RTOL, assert_matches, onnx_run
from tests.support.builders import conv_layer, dense_layer, relu_layer, reshape_layer


def with_injection(planned: PlannedGraph, injection: str) -> PlannedGraph:
    return dataclasses.replace(planned, factors=plan_factors(planned, injection=injection))


def conv_dense_graph(rng: np.random.Generator) -> LayerGraph:
    """conv (deterministic input: no shared input) → ReLU → conv (stride 2: a shared input) → ReLU →
    flatten → dense: both conv cases of the rule and a dense layer after them."""
    c0 = conv_layer(rng, "c0", INPUT, (2, 8, 8), 4, 3, 1, 1, 1, 1, 0.5, 0.02)  # (4, 8, 8)
    c1 = conv_layer(rng, "c1", "r0", (4, 8, 8), 6, 3, 2, 1, 1, 1, 0.4, 0.02)  # (6, 4, 4)
    layers = [c0, relu_layer("r0", "c0", (4, 8, 8)), c1, relu_layer("r1", "c1", (6, 4, 4)),
              reshape_layer("flat", "r1", (96,)), dense_layer(rng, "fc", "flat", 96, 5, 0.2, 0.01)]
    return LayerGraph(input_shape=(2, 8, 8), layers=layers, output="fc")


def _kernels(planned: PlannedGraph) -> tuple[tvm.IRModule, dict[str, dict[str, str]]]:
    """The emitted module and ``{layer: {op: PrimFunc symbol}}``."""
    mod = emit_module(planned, reuse=False)  # every layer's own kernels, named after it
    per_layer: dict[str, dict[str, str]] = {}
    for symbol, (op, layer) in kernel_table(mod).items():
        per_layer.setdefault(layer, {})[op] = symbol
    return mod, per_layer


def test_rescaled_module_reuses_the_weight_noise_term():
    """The rescaled plan's kernels: the conv with a shared input keeps its weights and profile kernels
    (the propagated term) but its mean-field kernel returns the weight-noise term as one more output
    and its weights kernel has no regression weights on the input mean (``w_mu``); the first conv
    (deterministic input, no shared input) has no weights or profile kernel at all."""
    graph = conv_dense_graph(np.random.default_rng(0))
    planned = plan(graph)
    reg_mod, reg = _kernels(with_injection(planned, "regression"))
    res_mod, res = _kernels(with_injection(planned, "rescaled"))
    assert sorted(reg["c0"]) == ["conv2d", "sf_conv_load", "sf_conv_profile", "sf_conv_weights"]
    assert sorted(res["c0"]) == ["conv2d", "sf_conv_load"]
    assert sorted(res["c1"]) == sorted(reg["c1"])
    n_params = {name: len(mod[layers["c1"]["conv2d"]].params) for name, mod, layers in
                (("regression", reg_mod, reg), ("rescaled", res_mod, res))}
    assert n_params["rescaled"] == n_params["regression"] + 1
    assert len(res_mod[res["c0"]["conv2d"]].params) == len(reg_mod[reg["c0"]["conv2d"]].params)
    assert "w_mu" in reg_mod[reg["c1"]["sf_conv_weights"]].script()
    weights = res_mod[res["c1"]["sf_conv_weights"]].script()
    assert "w_mu" not in weights and "w_s" in weights
    assert res["fc"] == reg["fc"]  # the dense rule does not depend on the injection


@pytest.mark.parametrize("backend", ["compiled", "onnx"])
def test_rescaled_conv_and_dense_match_the_reference(backend):
    graph = conv_dense_graph(np.random.default_rng(1))
    planned = plan(graph)
    net = PFPNetwork(graph, with_injection(planned, "rescaled"))
    run = net.compile("native") if backend == "compiled" else (lambda x: onnx_run(net, x))
    rng = np.random.default_rng(2)
    for batch in (1, 3):
        x = rng.standard_normal((batch, *graph.input_shape)).astype(np.float32)
        want = net.reference(x)
        assert_matches(run(x), want, RTOL if backend == "compiled" else ONNX_RTOL)
    # the rule changes the output: the regression plan's variance is another
    regression = PFPNetwork(graph, with_injection(planned, "regression")).reference(x)[1]
    assert not np.allclose(want[1], regression, rtol=1e-3)


@pytest.mark.slow
def test_rescaled_resnet_block_compiles_exports_and_matches_the_reference():
    """A converted Bayesian ResNet-8 (16/32/64 channels, 16x16 inputs: the block convs take the
    Winograd kernels, mean-field and profile) with the rescaled plan: every kernel scheduled (a
    schedule that fails soft is a failure), the Winograd mean-field conv returning the weight-noise
    term (its third output transform), the any-batch and a static-batch executable and the ONNX
    export against the reference."""
    import pyro2pfp
    from pyro2pfp.backends.tvm.schedules import schedule_module
    from pyro2pfp_experiments.zoo import bayesian_resnet, he_posterior

    torch.manual_seed(0)
    model = bayesian_resnet(blocks=1)
    x = torch.randn(2, 3, 16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        base = pyro2pfp.convert(model, he_posterior(model, x, scale=0.03, seed=0), input_shape=(3, 16, 16))
    assert base.plan.correlation == "shared-factor"
    planned = with_injection(base.plan, "rescaled")
    net = PFPNetwork(base.layer_graph, planned)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        native = tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu(),
                                    "num-cores": 2})
        scheduled = schedule_module(emit_module(planned), planned, native)
    wino_noise = 0
    for gv in scheduled.get_global_vars():
        func = scheduled[gv]
        if isinstance(func, tvm.tirx.PrimFunc):
            assert func.attrs.get("tirx.is_scheduled", False), gv.name_hint
            wino_noise += "wino_out_n" in func.script()
    assert wino_noise > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        exe = net.compile("native", batch_sizes=[2])
    xs = x.numpy()
    want = net.reference(xs)
    assert exe.vm_for_batch(2) is not exe.vm
    assert_matches(exe(xs), want, RTOL)
    assert_matches(exe(xs[:1]), net.reference(xs[:1]), RTOL)
    assert_matches(onnx_run(net, xs), want, ONNX_RTOL)
    assert not np.allclose(want[1], base.reference(xs)[1], rtol=1e-3)
