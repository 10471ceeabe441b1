"""Shared-factor PFP compiled (backends/tvm/shared_factor.py and the rules of backends/tvm/ops/) and exported to ONNX
(correlation/onnx_step.py and the rules of ops/<family>.py, run by onnxruntime) against the float64 NumPy reference.

The compiled path compacts ``g`` where the reference does (a Cholesky factor of g·gᵀ instead of
the reference's QR: exact, only g·gᵀ matters), ONNX export skips compaction (K grows; exact too), so
both agree with the reference up to float32 rounding: per output, ``|tvm − ref| ≤ RTOL·max|ref|`` as in
tests/stages/backends/test_schedules.py (a sum of K float32 terms is exact to about ``K·2⁻²⁴·Σ|terms|``).
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import tvm

import pyro2pfp
from pyro2pfp.backends.tvm import emit_module
from pyro2pfp.backends.tvm.emit import kernel_info
from pyro2pfp.backends.tvm.schedules import schedule_module
from pyro2pfp.backends.tvm.sharing import share_identical_kernels
from pyro2pfp.correlation import with_correlation
from pyro2pfp.correlation.factors import fixed_k_plan
from pyro2pfp.network import PFPNetwork
from pyro2pfp.planning.graph import INPUT, Layer, LayerGraph
from pyro2pfp.planning.plan import plan
from tests.support.backends import ONNX_RTOL, RTOL, assert_matches, onnx_run
from tests.support.builders import conv_layer, dense_block_graph, dense_layer, reshape_layer

NATIVE = tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu(), "num-cores": 2})


def _relu(name: str, inp: str, shape: tuple[int, ...], slope: float | None = None) -> Layer:
    if slope is None:
        return Layer(name=name, op="relu", inputs=[inp], out_shape=shape, source=f"{name} (test)")
    return Layer(name=name, op="leaky_relu", inputs=[inp], out_shape=shape, source=f"{name} (test)",
                 attrs={"slope": slope})


def _avg_pool(name: str, inp: str, in_shape: tuple[int, int, int], kernel: int, stride: int, pad: int,
              include_pad: bool) -> Layer:
    c, h, w = in_shape
    out = (c, (h + 2 * pad - kernel) // stride + 1, (w + 2 * pad - kernel) // stride + 1)
    attrs = {"kernel": [kernel] * 2, "stride": [stride] * 2, "padding": [pad] * 2, "ceil_mode": False,
             "count_include_pad": include_pad, "divisor": None}
    return Layer(name=name, op="avg_pool2d", inputs=[inp], out_shape=out, source=f"{name} (test)", attrs=attrs)


def every_rule_graph(rng: np.random.Generator) -> LayerGraph:
    """conv (stride 2, padding, dilation) → BN affine → leaky ReLU → conv → scale → add (residual) →
    ReLU → padded 3×3 average pool (stride 2) → SiLU (the generic Stein rule) → flatten → dense → ReLU →
    dense: every compiled rule (and a dense → ReLU → dense tail whose edges are flat)."""
    c0 = conv_layer(rng, "c0", INPUT, (2, 9, 9), 4, 3, 2, 2, 2, 1, 0.5, 0.02)  # (4, 5, 5)
    shape = c0.out_shape
    bn = Layer(name="bn", op="affine", inputs=["c0"], out_shape=shape, source="bn (test)",
               params={"scale": _det(rng.uniform(0.5, 1.5, 4)), "shift": _det(rng.standard_normal(4))})
    c1 = conv_layer(rng, "c1", "r0", shape, 4, 3, 1, 1, 1, 1, 0.4, 0.02, bias="det")
    half = Layer(name="half", op="scale", inputs=["c1"], out_shape=shape, source="half (test)",
                 attrs={"factor": -0.5})
    add = Layer(name="add", op="add", inputs=["half", "r0"], out_shape=shape, source="add (test)")
    pool = _avg_pool("pool", "r1", shape, 3, 2, 1, False)  # (4, 3, 3)
    act = Layer(name="act", op="silu", inputs=["pool"], out_shape=pool.out_shape, source="act (test)")
    layers = [c0, bn, _relu("r0", "bn", shape, 0.1), c1, half, add, _relu("r1", "add", shape), pool, act,
              reshape_layer("flat", "act", (36,)), dense_layer(rng, "fc1", "flat", 36, 7, 0.3, 0.01),
              _relu("r2", "fc1", (7,)), dense_layer(rng, "fc2", "r2", 7, 3, 0.4, 0.01)]
    return LayerGraph(input_shape=(2, 9, 9), layers=layers, output="fc2")


def _det(values: np.ndarray):
    from pyro2pfp.planning.graph import GaussianParam

    return GaussianParam(values, np.zeros_like(values))


def max_pool_graph(rng: np.random.Generator) -> LayerGraph:
    """LeNet-like: conv → ReLU → 2×2 max pool → conv → ReLU → overlapping padded 3×3 max pool
    (stride 2) → flatten → dense."""
    c0 = conv_layer(rng, "c0", INPUT, (1, 10, 10), 3, 3, 1, 1, 1, 1, 0.5, 0.02)  # (3, 10, 10)
    p0 = _max_pool("p0", "r0", (3, 10, 10), 2, 2, 0)  # (3, 5, 5)
    c1 = conv_layer(rng, "c1", "p0", (3, 5, 5), 4, 3, 1, 1, 1, 1, 0.4, 0.02)  # (4, 5, 5)
    p1 = _max_pool("p1", "r1", (4, 5, 5), 3, 2, 1)  # (4, 3, 3)
    layers = [c0, _relu("r0", "c0", (3, 10, 10)), p0, c1, _relu("r1", "c1", (4, 5, 5)), p1,
              reshape_layer("flat", "p1", (36,)), dense_layer(rng, "fc", "flat", 36, 5, 0.3, 0.01)]
    return LayerGraph(input_shape=(1, 10, 10), layers=layers, output="fc")


def _max_pool(name: str, inp: str, in_shape: tuple[int, int, int], kernel: int, stride: int, pad: int) -> Layer:
    c, h, w = in_shape
    out = (c, (h + 2 * pad - kernel) // stride + 1, (w + 2 * pad - kernel) // stride + 1)
    attrs = {"kernel": [kernel] * 2, "stride": [stride] * 2, "padding": [pad] * 2, "dilation": [1, 1],
             "ceil_mode": False}
    return Layer(name=name, op="max_pool2d", inputs=[inp], out_shape=out, source=f"{name} (test)", attrs=attrs)


@pytest.fixture(scope="module")
def every_rule():
    graph = every_rule_graph(np.random.default_rng(0))
    planned = with_correlation(plan(graph), "shared-factor")
    return graph, planned, PFPNetwork(graph, planned)


@pytest.mark.slow
def test_max_pool_compiled_matches_the_reference():
    graph = max_pool_graph(np.random.default_rng(5))
    net = PFPNetwork(graph, with_correlation(plan(graph), "shared-factor"))
    x = np.random.default_rng(6).standard_normal((3, *graph.input_shape)).astype(np.float32)
    assert_matches(net.compile("native")(x), net.reference(x))
    assert not np.allclose(net.reference(x)[1], PFPNetwork(graph, plan(graph)).reference(x)[1], rtol=1e-3)


@pytest.fixture(scope="module")
def every_rule_static_batch(every_rule):
    """The every-rule net compiled with ``batch_sizes=[3]`` -- the any-batch executable and a static
    batch-3 one -- built once for the three tests that use it (each build of this net is ~5-8 s), and
    the :class:`~pyro2pfp.backends.tvm.build.KernelPool` of each build (any-batch first), on 2 build
    threads.  Every kernel of both must take its default schedule: a schedule that fails soft is a
    failure here."""
    from pyro2pfp.backends.tvm import build as build_module
    from pyro2pfp.backends.tvm import runtime as runtime_module

    _, _, net = every_rule
    pools: list[build_module.KernelPool] = []

    class Spy(build_module.KernelPool):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pools.append(self)

    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        patch.setattr(build_module, "KernelPool", Spy)  # build() makes the static batch's pool
        patch.setattr(runtime_module, "KernelPool", Spy)  # build_network() makes the any-batch one
        patch.setenv("PYRO2PFP_BUILD_JOBS", "2")
        warnings.simplefilter("error", RuntimeWarning)
        return net.compile("native", batch_sizes=[3]), pools


@pytest.mark.slow
def test_every_rule_compiled_matches_the_reference(every_rule, every_rule_static_batch):
    from pyro2pfp.backends.tvm.runtime import CompiledPFP

    graph, planned, net = every_rule
    # the any-batch executable alone (what net.compile("native") returns): every batch size runs it
    compiled, _ = every_rule_static_batch
    exe = CompiledPFP(compiled.executable, net.input_shape, net.input_variance, compiled.target)
    assert not exe.tuned and exe.vm_for_batch(3) is exe.vm
    rng = np.random.default_rng(1)
    for batch in (1, 3):
        x = rng.standard_normal((batch, *graph.input_shape)).astype(np.float32)
        assert_matches(exe(x), net.reference(x))
    # the shared-factor kernels change the result: the mean-field plan's variance is different
    mean_field = PFPNetwork(graph, plan(graph)).reference(x)[1]
    assert not np.allclose(exe(x)[1], mean_field, rtol=0.05)


@pytest.mark.slow
def test_every_rule_compiled_matches_the_reference_without_hermite_factors():
    """``hermite='none'``: the ReLU kernels (mean-field moments and Stein's linear response, no new
    factor) against the reference."""
    from pyro2pfp.correlation import plan_factors

    graph = every_rule_graph(np.random.default_rng(0))
    planned = plan(graph)
    planned.factors = plan_factors(planned, hermite="none")
    net = PFPNetwork(graph, planned)
    x = np.random.default_rng(1).standard_normal((3, *graph.input_shape)).astype(np.float32)
    assert_matches(net.compile("native")(x), net.reference(x))


@pytest.mark.slow
def _correlated_guide_cnn_plan():
    """The correlated-guide forms' CNN (conv -> max pool -> conv -> dense) under a low-rank guide with random
    parameters (as after training), planned with the guide's global factors (the second conv reads the first's
    guide noise: the mean shift)."""
    import pyro
    import torch
    from pyro.infer.autoguide import AutoLowRankMultivariateNormal

    import pyro2pfp
    from tests.support.guide_forms import CNN

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = CNN()
    guide = AutoLowRankMultivariateNormal(model, rank=2)
    guide(torch.zeros(2, 1, 12, 12), torch.zeros(2, dtype=torch.long))
    with torch.no_grad():
        for _, value in pyro.get_param_store().items():
            value.unconstrained().copy_(0.3 * torch.randn_like(value.unconstrained()))
    net = pyro2pfp.convert(model, guide, input_shape=(1, 12, 12), correlation="shared-factor", check=False)
    pyro.clear_param_store()
    assert net.plan.factors is not None and net.plan.factors.guide == 2
    return net.plan


def test_every_shared_factor_primfunc_is_scheduled(every_rule):
    from pyro2pfp.planning.correlated_pools import correlate_max_pools
    from tests.ops.pooling.test_pool_covariance_sources import residual_graph
    from tests.stages.correlation.test_layer_norm_shared import head_graph

    # correlated pools (sf_window_cov, sf_window_closure), a concatenation (sf_concat), a LayerNorm head
    graphs = [correlate_max_pools(max_pool_graph(np.random.default_rng(5)), shared=True),
              dense_block_graph(np.random.default_rng(5), joined=True),
              correlate_max_pools(residual_graph(np.random.default_rng(5)), shared=True),
              head_graph(np.random.default_rng(5))]
    parts = set()
    guided = _correlated_guide_cnn_plan()  # the guide's kernels (sf_conv_guide_*, sf_dense_guide_load)
    for planned in (every_rule[1], guided, *(with_correlation(plan(g), "shared-factor") for g in graphs)):
        mod = emit_module(planned)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a schedule that fails soft is a failure here
            scheduled = schedule_module(mod, planned, NATIVE)
        for gv in scheduled.get_global_vars():
            func = scheduled[gv]
            if not isinstance(func, tvm.tirx.PrimFunc):
                continue
            op, _ = kernel_info(func)
            assert op is not None, gv.name_hint
            parts.add(op)
            assert func.attrs.get("tirx.is_scheduled", False), gv.name_hint
            assert "T.parallel" in func.script(), gv.name_hint
    from pyro2pfp.backends.tvm import SCHEDULES

    assert {op for op in SCHEDULES if op.startswith("sf_")} | {"sf_cholesky"} <= parts


@pytest.mark.slow
def test_compiled_zero_variance_and_large_inputs_stay_finite():
    graph = every_rule_graph(np.random.default_rng(2))
    for layer in graph.layers:
        for key, p in layer.params.items():
            layer.params[key] = _det(p.mean)
    planned = with_correlation(plan(graph), "shared-factor")
    exe = PFPNetwork(graph, planned).compile("native")
    x = np.random.default_rng(3).standard_normal((2, *graph.input_shape)).astype(np.float32)
    mean, var = exe(x)
    assert np.all(var == 0) and np.all(np.isfinite(mean))
    mean, var = exe(1e4 * x)
    assert np.all(np.isfinite(mean)) and np.all(np.isfinite(var)) and np.all(var >= 0)


def test_plans_the_compiled_path_does_not_cover_are_refused(monkeypatch):
    from pyro2pfp.planning.registry import SHARED_EXPORTERS, SHARED_KERNELS

    rng = np.random.default_rng(4)
    conv = conv_layer(rng, "conv", INPUT, (1, 4, 4), 2, 1, 1, 0, 1, 1, 0.5, 0.05)
    graph = LayerGraph(input_shape=(1, 4, 4), layers=[conv], output="conv")
    with pytest.raises(pyro2pfp.ArgumentError, match="moment_form='variance'"):
        emit_module(with_correlation(plan(graph, moment_form="raw"), "shared-factor"))
    monkeypatch.delitem(SHARED_KERNELS, "conv2d")  # as for an op added without a kernel
    with pytest.raises(pyro2pfp.ArgumentError, match="conv \\(test\\): the TVM back end has no .*'conv2d'"):
        emit_module(with_correlation(plan(graph), "shared-factor"))
    monkeypatch.delitem(SHARED_EXPORTERS, "conv2d")
    with pytest.raises(pyro2pfp.ArgumentError, match="conv \\(test\\): ONNX export has no .*'conv2d'"):
        PFPNetwork(graph, with_correlation(plan(graph), "shared-factor")).to_onnx()


@pytest.mark.parametrize("make", [pytest.param(every_rule_graph, marks=pytest.mark.slow), max_pool_graph])
def test_onnx_export_matches_the_reference(make):
    graph = make(np.random.default_rng(7))
    net = PFPNetwork(graph, with_correlation(plan(graph), "shared-factor"))
    model = net.to_onnx()
    assert {p.key: p.value for p in model.metadata_props}["pyro2pfp.correlation"] == "shared-factor"
    rng = np.random.default_rng(8)
    for batch in (1, 4):
        x = rng.standard_normal((batch, *graph.input_shape)).astype(np.float32)
        assert_matches(onnx_run(net, x), net.reference(x), ONNX_RTOL)


def test_onnx_export_refuses_what_it_does_not_cover():
    rng = np.random.default_rng(4)
    conv = conv_layer(rng, "conv", INPUT, (1, 4, 4), 2, 1, 1, 0, 1, 1, 0.5, 0.05)
    graph = LayerGraph(input_shape=(1, 4, 4), layers=[conv], output="conv")
    with pytest.raises(pyro2pfp.ArgumentError, match="moment_form='variance'"):
        PFPNetwork(graph, with_correlation(plan(graph, moment_form="raw"), "shared-factor")).to_onnx()


@pytest.mark.slow
def test_converted_resnet_compiles_and_exports_the_default_plan():
    """A small Bayesian ResNet converted with the default (auto → shared-factor): compiled vs reference."""
    from pyro2pfp_experiments.zoo import bayesian_resnet, he_posterior

    torch.manual_seed(0)
    model = bayesian_resnet(blocks=1, widths=(4, 8))
    x = torch.randn(3, 3, 8, 8)
    net = pyro2pfp.convert(model, he_posterior(model, x, scale=0.03, seed=0), input_shape=(3, 8, 8))
    assert net.plan.correlation == "shared-factor" and net.plan.factors.compact_at
    assert_matches(net.compile("native")(x.numpy()), net.reference(x.numpy()))
    assert_matches(onnx_run(net, x.numpy()), net.reference(x.numpy()), ONNX_RTOL)


@pytest.mark.slow
def test_converted_resnet8_one_kernel_per_relu_matches_the_reference():
    """The ResNet-8 of ``benchmarks/latency.py`` (16/32/64 channels, on 16x16 inputs here) with the
    default plan (shared-factor): every ReLU is one kernel (``sf_relu``, no mean-field ``relu``
    kernel left in the module), and the compiled net gives the reference's results."""
    from pyro2pfp.backends.tvm.emit import kernel_table
    from pyro2pfp_experiments.zoo import bayesian_resnet, he_posterior

    torch.manual_seed(0)
    model = bayesian_resnet(blocks=1)
    x = torch.randn(2, 3, 16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        net = pyro2pfp.convert(model, he_posterior(model, x, scale=0.03, seed=0), input_shape=(3, 16, 16))
    assert net.plan.correlation == "shared-factor"
    relus = {p.name for p in net.plan.layers if p.op == "relu"}
    kernels: dict[str, list[str]] = {}
    for op, layer in kernel_table(emit_module(net.plan, reuse=False)).values():  # every layer's own kernels
        kernels.setdefault(layer, []).append(op)
    assert len(relus) == 7 and all(kernels[name] == ["sf_relu"] for name in relus), kernels
    # ReLUs and conv loadings (and adds) that differ only in their factor widths share one kernel
    fp = fixed_k_plan(net.plan, "the TVM back end", compaction=True)
    callee = _callees(emit_module(net.plan, reuse=False))
    for op in ("relu", "conv2d"):  # (one add per shape here)
        groups: dict[tuple[object, ...], set[str]] = {}
        for p in net.plan.layers:
            if p.op == op and p.name in callee.get(f"sf_{'conv_load' if op == 'conv2d' else op}", {}):
                key = (p.layer.out_shape, net.plan.shape_of(p.inputs[0]), str(p.layer.attrs),
                       str(sorted((k, t.shape) for k, t in p.tensors.items())))  # all but the factor widths
                groups.setdefault(key, set()).add(p.name)
        shared = [names for names in groups.values() if len({fp.width[n] for n in names}) > 1]
        assert shared, (op, groups)  # some layers of one shape differ in K ...
        for names in shared:  # ... and call one kernel
            assert len({callee[f"sf_{'conv_load' if op == 'conv2d' else op}"][n] for n in names}) == 1, (op, names)
    assert_matches(net.compile("native")(x.numpy()), net.reference(x.numpy()))


def _callees(mod: tvm.IRModule) -> dict[str, dict[str, str]]:
    """Per kernel op, each layer's kernel symbol after :func:`share_identical_kernels` (the shared and
    the emitted ``main`` make the same calls in the same order; the emitted one names the layer)."""
    from pyro2pfp.backends.tvm.emit import kernel_table

    def calls(m: tvm.IRModule) -> list[str]:
        return [line.split("R.call_tir(")[1].split(",")[0].strip() for line in m["main"].script().splitlines()
                if "R.call_tir(" in line]

    table = kernel_table(mod)
    out: dict[str, dict[str, str]] = {}
    for emitted, shared in zip(calls(mod), calls(share_identical_kernels(mod)), strict=True):
        if emitted in table:
            op, layer = table[emitted]
            out.setdefault(op, {})[layer] = shared
    return out


@pytest.mark.slow
def test_tuned_shared_factor_resnet_matches_the_reference(tmp_path, monkeypatch):
    """``net.compile(tune=...)`` on a converted shared-factor ResNet (compaction: the hand-written
    Cholesky kernel included): batch specialisation, the per-kernel choice (every kernel's default
    schedule timed and checked against its unscheduled version at the static batch), the build -- the
    tuned executable gives the reference's results at its batch and the any-batch one at another.
    (No search here: ``trials=0``; tests/deploy/test_tuning.py runs a real one.  With a search, the ResNet-8
    of ``benchmarks/latency.py`` tuned for batch 2 with 16 trials matched the reference to 3e-7.)"""
    from pyro2pfp.backends.tvm.tuning import measure
    from pyro2pfp_experiments.zoo import bayesian_resnet, he_posterior

    monkeypatch.setitem(measure.KERNEL_TIMING, "repeat", 2)  # the choice's timing: coarse is enough here
    monkeypatch.setitem(measure.KERNEL_TIMING, "min_repeat_ms", 2)
    torch.manual_seed(0)
    model = bayesian_resnet(blocks=1, widths=(4, 8))
    x = torch.randn(2, 3, 8, 8)
    net = pyro2pfp.convert(model, he_posterior(model, x, scale=0.03, seed=0), input_shape=(3, 8, 8))
    assert net.plan.correlation == "shared-factor" and net.plan.factors.compact_at
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a default schedule rejected by the check: a failure
        exe = net.compile("native", tune={"batch": 2, "trials": 0, "work_dir": str(tmp_path), "progress": False})
    assert exe.vm_for_batch(2) is not exe.vm
    assert_matches(exe(x.numpy()), net.reference(x.numpy()))
    assert_matches(exe(x.numpy()[:1]), net.reference(x.numpy()[:1]))


def _unit_rows(g: np.ndarray) -> np.ndarray:
    norm = np.linalg.norm(g, axis=-1, keepdims=True)
    return g / np.where(norm > 0, norm, 1.0)


def test_cholesky_compaction_keeps_the_gram_matrix_of_degenerate_loadings():
    """The compiled compaction (sf_cholesky) on the Gram matrices it meets: unit rows, a zero row
    (a dead channel), a duplicated row, a row nearly in the span of others, fewer factors than
    rows (rank-deficient) -- L·Lᵀ = g·gᵀ to float32 rounding, L lower-triangular with zero
    padding columns, finite (a zero or negative pivot must not divide)."""
    from pyro2pfp.backends.tvm.shared_factor import cholesky_factor

    rows, width = 12, 16
    rng = np.random.default_rng(3)
    g = rng.standard_normal((5, rows, 40))
    g[1, 4] = 0.0
    g[2, 7] = g[2, 2]
    g[3, 9] = g[3, 0] + 1e-4 * rng.standard_normal(40)
    g[4, :, 5:] = 0.0  # rank 5 < 12 rows
    g = _unit_rows(g)
    gram = (g @ np.swapaxes(g, 1, 2)).astype(np.float32)
    lib = tvm.compile(tvm.IRModule({"main": cholesky_factor(rows, width).with_attr("global_symbol", "main")}),
                      target=NATIVE)
    out = tvm.runtime.tensor(np.full((5, rows, width), np.nan, np.float32))
    lib["main"](tvm.runtime.tensor(gram), out)
    low = out.numpy()
    assert np.isfinite(low).all()
    assert (np.triu(low[:, :, :rows], 1) == 0).all() and (low[:, :, rows:] == 0).all()
    rebuilt = low[:, :, :rows] @ np.swapaxes(low[:, :, :rows], 1, 2)
    exact = [0, 1, 2, 4]
    np.testing.assert_allclose(rebuilt[exact], gram[exact], atol=2e-6)
    # row 9 of input 3 is 1e-4 from the span of row 0: below float32 resolution of the pivot
    # (CHOLESKY_PIVOT_TOL), its residual is dropped -- an error of the residual's size, no more
    np.testing.assert_allclose(rebuilt[3], gram[3], atol=2e-4)
    assert (low[1, 4] == 0).all()  # the dead channel stays without loading


@pytest.mark.slow
def test_compiled_plan_compacts_where_the_reference_does():
    """The TVM back end runs the reference's compaction points (K bounded: ResNet-20 ≤ 320 columns
    instead of 1,488), ONNX export the plan without them (its blocks then start further right)."""
    from pyro2pfp.correlation.factors import aligned, fixed_k_plan
    from pyro2pfp_experiments.zoo import bayesian_resnet, he_posterior

    torch.manual_seed(0)
    model = bayesian_resnet(blocks=3, widths=(16, 32, 64))
    x = torch.randn(2, 3, 32, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net = pyro2pfp.convert(model, he_posterior(model, x, scale=0.02, seed=0), input_shape=(3, 32, 32))
    ref = net.plan.factors
    compiled = fixed_k_plan(net.plan, "the TVM back end", compaction=True)
    exported = fixed_k_plan(net.plan, "ONNX export")
    assert compiled.compact_at == ref.compact_at and len(ref.compact_at) >= 8 and not exported.compact_at
    assert compiled.offsets == ref.offsets and exported.offsets.keys() == ref.offsets.keys()
    assert compiled.width == {name: aligned(k) for name, k in ref.width.items()}
    assert compiled.max_factors == 320 and exported.max_factors > 1400


@pytest.mark.slow
def test_static_batch_executable_is_scheduled_and_matches_the_reference(every_rule, every_rule_static_batch):
    """``compile(batch_sizes=[3])`` re-emits the module with a static batch: every kernel (shared-
    factor ones included) must still take its default schedule (a schedule that fails soft is a
    failure here) and give the reference's results."""
    _, _, net = every_rule
    exe, _ = every_rule_static_batch
    x = np.random.default_rng(8).standard_normal((3, *net.input_shape)).astype(np.float32)
    assert exe.vm_for_batch(3) is not exe.vm
    assert_matches(exe(x), net.reference(x))


def test_normalised_loading_limit_cases(monkeypatch):
    """``normalised`` (the ``g = ℓ/‖ℓ‖`` stage fused into every loading kernel), unscheduled and with
    the row-local schedule, against float64: a zero row gives g = 0 and norm 0; rows of 1e30 (whose
    squares overflow float32) and of 1e-20 (whose squares underflow) keep unit rows and their norm; a
    row below NORM_FLOOR counts as zero; everything finite."""
    from tvm import te

    from pyro2pfp.backends.tvm import schedules
    from pyro2pfp.backends.tvm.schedules import schedule_function
    from pyro2pfp.backends.tvm.shared_factor import NORM_FLOOR, normalised

    monkeypatch.setattr(schedules.driver, "SERIAL_WORK", 0.0)  # this small static kernel: the parallel schedule
    monkeypatch.setattr(schedules.driver, "NEST_SERIAL_WORK", 0.0)
    rng = np.random.default_rng(11)
    ell = rng.standard_normal((2, 6, 48))
    ell[0, 0] = 0.0
    ell[0, 2] *= 1e30
    ell[0, 3] = 0.0
    ell[0, 3, 7] = 0.1 * NORM_FLOOR
    ell[0, 4] = 0.0
    ell[0, 4, 40] = -5.0
    ell[1, 1] *= 1e-20
    ell = ell.astype(np.float32)
    norm64 = np.linalg.norm(ell.astype(np.float64), axis=-1)
    tiny = np.abs(ell).max(axis=-1) <= NORM_FLOOR
    want_norm = np.where(tiny, 0.0, norm64)
    want_g = np.where(tiny[..., None], 0.0, ell / np.where(norm64 > 0, norm64, 1.0)[..., None])

    placeholder = te.placeholder(ell.shape, "float32", name="loading")
    g, norm = normalised(placeholder)
    func = te.create_prim_func([placeholder, g, norm]).with_attr("pfp.op", "sf_add")
    scheduled = schedule_function(func, "sf_add", None, NATIVE)
    assert "T.parallel" in scheduled.script()
    for prim in (func, scheduled):
        lib = tvm.compile(tvm.IRModule({"main": prim.with_attr("global_symbol", "main")}), target=NATIVE)
        out_g = tvm.runtime.tensor(np.full(ell.shape, np.nan, np.float32))
        out_n = tvm.runtime.tensor(np.full(ell.shape[:2], np.nan, np.float32))
        lib["main"](tvm.runtime.tensor(ell), out_g, out_n)
        got_g, got_n = out_g.numpy(), out_n.numpy()
        assert np.isfinite(got_g).all() and np.isfinite(got_n).all()
        np.testing.assert_allclose(got_n, want_norm, rtol=2e-6)
        np.testing.assert_allclose(got_g, want_g, rtol=2e-6, atol=1e-7)
        assert (got_g[0, 0] == 0).all() and got_n[0, 0] == 0 and (got_g[0, 3] == 0).all()
        assert got_g[0, 4, 40] == -1.0 and got_n[0, 4] == 5.0


COMPACTION = ("sf_gram", "sf_cholesky")  # after the layers the plan compacts at


def test_shared_factor_kernels_per_layer(every_rule):
    """The fused kernels: a conv layer with a shared input is one loading kernel (pooling, loading,
    normalisation and β) plus the weights and the profile convolution; a ReLU/leaky ReLU with a shared
    input is exactly one kernel (``sf_relu``, which computes the mean-field moments too: no ``relu``
    kernel), add one shared-factor kernel (no separate normalisation kernel anywhere); the
    ReLU/add/affine/scale kernels read the (B, C, H, W) edges without reshapes."""
    from pyro2pfp.backends.tvm.emit import kernel_table

    _, planned, _ = every_rule
    mod = emit_module(planned, reuse=False)  # every layer's own kernels, named after it
    per_layer: dict[str, list[str]] = {}
    calls = [line for line in mod["main"].script().splitlines() if "R.call_tir(" in line]
    table = kernel_table(mod)
    for line in calls:
        symbol = line.split("R.call_tir(")[1].split(",")[0].strip()
        if symbol in table and table[symbol][0] not in COMPACTION:
            op, layer = table[symbol]
            per_layer.setdefault(layer, []).append(op)
    assert sorted(per_layer["c1"]) == ["conv2d", "sf_conv_load", "sf_conv_profile", "sf_conv_weights"]
    for name, ops in (("r0", ["sf_relu"]), ("r1", ["sf_relu"]), ("r2", ["sf_relu"]), ("add", ["add", "sf_add"]),
                      ("bn", ["affine", "sf_scale"]), ("half", ["scale", "sf_scale"])):
        assert per_layer[name] == ops, (name, per_layer[name])
    assert not any("norm" in op for ops in per_layer.values() for op in ops)
    # the former (batch, rows, group) views: reshapes to three axes
    reshapes = [line.split("R.shape([")[1] for line in mod["main"].script().splitlines() if "R.reshape(" in line]
    assert reshapes and not [shape for shape in reshapes if shape.count(",") == 2], reshapes


def _run_kernel(func: tvm.tirx.PrimFunc, op: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """One PrimFunc of an emitted module, with its default schedule, on NumPy inputs (reshaped to its
    parameters' per-example shapes); its outputs in its own shapes."""
    from pyro2pfp.backends.tvm.schedules import schedule_function

    batch = inputs[0].shape[0]
    shapes = [tuple(int(d) for d in p.shape[1:]) for p in func.params]
    scheduled = schedule_function(func, op, None, NATIVE)
    lib = tvm.compile(tvm.IRModule({"main": scheduled.with_attr("global_symbol", "main")}), target=NATIVE)
    args = [tvm.runtime.tensor(np.ascontiguousarray(a, np.float32).reshape(batch, *shape))
            for a, shape in zip(inputs, shapes)]
    outs = [tvm.runtime.tensor(np.full((batch, *shape), np.nan, np.float32)) for shape in shapes[len(inputs):]]
    lib["main"](*args, *outs)
    return [o.numpy() for o in outs]


def _kernel(mod: tvm.IRModule, symbol: str) -> tvm.tirx.PrimFunc:
    """PrimFunc ``symbol`` of the emitted ``mod``, with the scalar arguments its call passes (the factor
    widths and offset of a kernel shared across layers that differ only in them) bound."""
    from pyro2pfp.backends.tvm.tuning.specialize import bind_scalar_arguments

    func = mod[symbol]
    if not any(isinstance(p, tvm.tirx.Var) for p in func.params):
        return func
    bound = bind_scalar_arguments(mod)
    (copy,) = [gv for gv in bound.get_global_vars() if gv.name_hint.startswith(f"{symbol}_k")]
    return bound[copy]


def _relu_kernel_inputs(planned, name: str, batch: int = 3) -> tuple[np.ndarray, ...]:
    """(μ, v, s, g) of the input edge of ReLU layer ``name`` with the limit cases: a zero-variance
    channel (its profile 0, means of both signs and exact zeros), means of ±1e30, ±1e4 with variances
    of 1e-30 .. 1, single zero-variance elements (there ``s = 0.5``, else ``s`` within ``±√v``, the
    clip every rule applies), ``g`` unit rows with a zero row (a channel without loading)."""
    from pyro2pfp.correlation.factors import fixed_k_plan

    fp = fixed_k_plan(planned, "the TVM back end", compaction=True)
    layer = next(p for p in planned.layers if p.name == name)
    shape = (batch, *layer.layer.out_shape)
    rng = np.random.default_rng(21)
    m = rng.standard_normal(shape)
    v = rng.uniform(0.05, 2.0, shape)
    m[0, 0] = np.round(m[0, 0])  # exact zeros among them
    v[0, 0] = 0.0
    m[0, 1].flat[::2], m[0, 1].flat[1::2] = 1e30, -1e30
    m[1, 2] = rng.choice([-1e4, 1e4], m[1, 2].shape)
    v[1, 2] = 10.0 ** rng.uniform(-30, 0, v[1, 2].shape)
    v[2].flat[::7] = 0.0
    m[2].flat[::14] = 0.0
    s = np.clip(rng.standard_normal(shape) * np.sqrt(v), -np.sqrt(v), np.sqrt(v))
    s[2].flat[::7] = 0.5  # unclipped where v = 0: the σ → 0 limits of Stein's terms enter the channel means
    src = layer.inputs[0]
    g = rng.standard_normal((batch, fp.rows[src], fp.width[src]))
    g[1, 0] = 0.0
    g /= np.where(np.linalg.norm(g, axis=-1, keepdims=True) > 0, np.linalg.norm(g, axis=-1, keepdims=True), 1.0)
    return tuple(a.astype(np.float32) for a in (m, v, s, g))


@pytest.mark.parametrize("name", ["r0", "r1"])  # leaky ReLU (slope 0.1), ReLU
def test_shared_factor_relu_kernel_limit_cases(every_rule, name):
    """The one ``sf_relu`` kernel on its own against float64 -- its mean-field outputs against
    ``moments.relu_moments``/``leaky_relu_moments``, the profile and loadings against the reference
    rule (``ops.activation.relu_shared`` in the float64 reference, clipped to ``±√v_out``) -- on inputs with
    zero-variance rows and elements and huge means: finite, and the reference's values (the
    ``σ = 0`` limits of Stein's terms: ``Φ → [μ > 0]``, ``h = 0``)."""
    from pyro2pfp import moments
    from pyro2pfp.backends.reference._core import Activation
    from pyro2pfp.correlation.factors import fixed_k_plan
    from pyro2pfp.correlation.shared import Shared
    from pyro2pfp.planning.graph import Repr
    from pyro2pfp.planning.registry import SHARED_REFERENCES

    _, planned, _ = every_rule
    fp = fixed_k_plan(planned, "the TVM back end", compaction=True)
    layer = next(p for p in planned.layers if p.name == name)
    mod = emit_module(planned)
    m, v, s, g = _relu_kernel_inputs(planned, name)
    k = fp.width[name]
    mean, second, s_out, g_out = _run_kernel(_kernel(mod, f"pfp_sf_relu_{name}"), "sf_relu", [m, v, s, g])
    assert mean.shape == second.shape == s_out.shape == m.shape and g_out.shape == (*m.shape[:2], k)
    for got in (mean, second, s_out, g_out):
        assert np.isfinite(got).all()
    m64, v64 = m.astype(np.float64), v.astype(np.float64)
    if layer.op == "leaky_relu":
        want_mean, want_var = moments.leaky_relu_moments(m64, v64, layer.layer.attrs["slope"])
    else:
        want_mean, want_var = moments.relu_moments(m64, v64)
    # huge means: compare each output relative to its own size, the rest to the batch's scale
    np.testing.assert_allclose(mean, want_mean, rtol=RTOL, atol=RTOL * np.abs(want_mean[np.abs(m64) < 1e3]).max())
    np.testing.assert_allclose(second, want_var, rtol=RTOL, atol=RTOL * want_var.max())
    assert (second[0, 0] == 0).all() and (mean[0, 0] == np.maximum(m[0, 0], 0) + layer.layer.attrs.get(
        "slope", 0.0) * np.minimum(m[0, 0], 0)).all()
    want, _ = SHARED_REFERENCES[layer.op](layer, [Activation(m64, v64, Repr.VARIANCE)],
                                          [Shared(s.astype(np.float64), g.astype(np.float64))], fp, want_var)
    sd = np.sqrt(np.maximum(want_var, 0.0))
    want_s = np.clip(want.s, -sd, sd)
    assert_matches((s_out, g_out), (want_s, want.g))
    assert (s_out[0, 0] == 0).all() and (s_out[2].flat[::7] == 0).all()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["r0", "r1"])
def test_shared_factor_relu_mean_field_outputs_are_the_mean_field_kernels(every_rule, name):
    """``sf_relu`` computes the layer's mean-field outputs with the mean-field kernel's expressions
    (the registry rule, ``activation_moments``): on the same inputs, bitwise its outputs."""
    graph, planned, _ = every_rule
    layer = next(p for p in planned.layers if p.name == name)
    m, v, s, g = _relu_kernel_inputs(planned, name)
    mean, second, _, _ = _run_kernel(_kernel(emit_module(planned), f"pfp_sf_relu_{name}"), "sf_relu",
                                 [m, v, s, g])
    mean_field = emit_module(plan(graph), fuse=False)[f"pfp_{layer.op}_{name}"]
    want_mean, want_var = _run_kernel(mean_field, layer.op, [m, v])  # on a flat (batch, N) view here
    assert np.array_equal(mean.reshape(want_mean.shape), want_mean)
    assert np.array_equal(second.reshape(want_var.shape), want_var)


@pytest.mark.slow
def test_every_kernel_goes_to_the_build_threads_while_scheduling(every_rule, every_rule_static_batch):
    """``net.compile()`` hands each kernel to the build threads as soon as it is final: the scheduled
    ones, the hand-written ``sf_cholesky`` (it comes scheduled) and the last partial part (flushed
    when scheduling ends), so after the Relax pipeline only what it added is compiled (the any-batch
    build of the fixture's compile)."""
    graph, _, net = every_rule
    exe, pools = every_rule_static_batch
    assert len(pools) == 2  # the any-batch build, then the static batch-3 one
    pool = pools[0]
    handed = {name for part, _ in pool.parts for name in part} - set(pool.compiled_late)
    kernels = {gv.name_hint for gv, f in net.mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    cholesky = {name for name in kernels if "sf_cholesky" in name}
    assert cholesky and cholesky <= handed
    assert not set(pool.compiled_late) & kernels  # each of the network's kernels compiled once, early
    x = np.random.default_rng(2).standard_normal((2, *graph.input_shape)).astype(np.float32)
    assert_matches(exe(x), net.reference(x))
