"""The default CPU schedules (pyro2pfp.backends.tvm.schedules): every PFP PrimFunc gets scheduled,
and the scheduled module still matches the float64 NumPy reference at batch sizes that are not
multiples of any split factor (1, 7, 13).

Tolerances: outputs are compared per element with ``|tvm - ref| <= RTOL * scale``, where
``scale`` is the largest magnitude of that output (the mean, resp. variance) over the batch.
That is the float32 bound for these small layers: a sum of K float32 terms is exact to about
``K·2⁻²⁴·Σ|terms|``, and the variance in raw-moment form ``Σ sw·sx − (μw·μx)²`` can lose a few
digits more to cancellation (its terms, not its value, set the error), so the bound is taken
relative to the magnitude of the whole output, not of each element.
"""
from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax

from pyro2pfp.backends.reference import execute
from pyro2pfp.backends.tvm import emit_module, schedules
from pyro2pfp.backends.tvm.schedules import SCHEDULES, schedule_module
from pyro2pfp.network import PFPNetwork
from pyro2pfp.ops.head import append_head
from pyro2pfp.planning.correlated_pools import correlate_max_pools
from pyro2pfp.planning.graph import INPUT, GaussianParam, Layer, LayerGraph
from pyro2pfp.planning.plan import plan
from pyro2pfp.planning.registry import OPS
from tests.support.builders import lenet_graph, mlp_graph
from tests.support.tir import prim_funcs

BATCHES = (1, 7, 13)
RTOL = 2e-5
TARGETS = {
    "native": tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu(),
                                 "num-cores": 2}),
    "llvm": tvm.target.Target("llvm"),
}


# ------------------------------------------------------------------------------ graph builders
def gaussian(rng, shape, mean_scale=0.3, var_scale=0.01):
    return GaussianParam(mean_scale * rng.standard_normal(shape), var_scale * rng.uniform(0.1, 1.0, shape))


def dense(rng, name, inp, k, m):
    return Layer(name, "dense", [inp], (m,), name,
                 params={"weight": gaussian(rng, (m, k), k**-0.5), "bias": gaussian(rng, (m,))})


def conv(rng, name, inp, in_shape, out_c, kernel, stride=1, pad=0, dil=1, groups=1):
    c, h, w = in_shape
    size = lambda n: (n + 2 * pad - dil * (kernel - 1) - 1) // stride + 1  # noqa: E731
    return Layer(name, "conv2d", [inp], (out_c, size(h), size(w)), name,
                 attrs={"stride": [stride] * 2, "padding": [pad] * 2, "dilation": [dil] * 2, "groups": groups},
                 params={"weight": gaussian(rng, (out_c, c // groups, kernel, kernel), (c * kernel**2) ** -0.5),
                         "bias": gaussian(rng, (out_c,))})


def relu(name, inp, shape):
    return Layer(name, "relu", [inp], shape, name)


def pool(name, inp, in_shape, kernel, stride):
    c, h, w = in_shape
    out = (c, (h - kernel) // stride + 1, (w - kernel) // stride + 1)
    return Layer(name, "max_pool2d", [inp], out, name,
                 attrs={"kernel": [kernel] * 2, "stride": [stride] * 2, "padding": [0, 0],
                        "dilation": [1, 1], "ceil_mode": False})


def case_graphs() -> dict[str, LayerGraph]:
    """Small graphs covering every op kind, input representation and both conv vector axes."""
    rng = np.random.default_rng(0)
    g = {}
    # dense: deterministic input, M = 20 (vector width 4); then a second-moment input, M = 10
    g["dense"] = LayerGraph((33,), [dense(rng, "fc1", INPUT, 33, 20), relu("r", "fc1", (20,)),
                                    dense(rng, "fc2", "r", 20, 10)], "fc2")
    # odd sizes everywhere (no vector width divides M = 7: scalar register tile)
    g["dense_odd"] = LayerGraph((9,), [dense(rng, "fc", INPUT, 9, 7)], "fc", input_variance=True)
    # conv, output-column vectors (6 channels, 12 columns), padding, probabilistic input -> two pads
    g["conv_cols"] = LayerGraph((2, 12, 12), [conv(rng, "c", INPUT, (2, 12, 12), 6, 5, pad=2)], "c",
                                input_variance=True)
    # conv rows computed wider than the output (28 -> 32 columns, 14 -> 16 with stride 2), deterministic and
    # second-moment inputs: the extra columns read zero padding and are cut off by the epilogue
    w1 = conv(rng, "c1", INPUT, (1, 6, 28), 6, 5, pad=2)
    g["conv_wide"] = LayerGraph((1, 6, 28), [w1, relu("r", "c1", w1.out_shape),
                                             conv(rng, "c2", "r", w1.out_shape, 6, 3, stride=2, pad=1)], "c2")
    # conv, output-channel vectors (16 channels, 5 columns), stride 2, deterministic input
    g["conv_chans"] = LayerGraph((3, 11, 11), [conv(rng, "c", INPUT, (3, 11, 11), 16, 3, stride=2, pad=1)], "c")
    # conv with groups and dilation after a ReLU (second-moment input)
    c1 = conv(rng, "c1", INPUT, (4, 9, 9), 8, 3, pad=1)
    g["conv_groups"] = LayerGraph((4, 9, 9), [c1, relu("r", "c1", c1.out_shape),
                                              conv(rng, "c2", "r", c1.out_shape, 8, 3, dil=2, groups=2)], "c2")
    # correlated max pools (window_cov + Clark's correlated fold): a conv of a Gaussian input into a padded,
    # overlapping 3x3/2/1 pool with the ReLU moved after it
    c1 = conv(rng, "c1", INPUT, (2, 9, 9), 4, 3, pad=1)
    p1 = Layer("p", "max_pool2d", ["r"], (4, 5, 5), "p", attrs={
        "kernel": [3, 3], "stride": [2, 2], "padding": [1, 1], "dilation": [1, 1], "ceil_mode": False})
    g["pool_correlated"] = correlate_max_pools(LayerGraph(
        (2, 9, 9), [c1, relu("r", "c1", c1.out_shape), p1], "p", input_variance=True))
    # a max pool of a GELU of a conv: the in-window covariances through the activation (window_activation)
    c1 = conv(rng, "c1", INPUT, (2, 8, 8), 3, 3, pad=1)
    gelu = Layer("a", "gelu", ["c1"], c1.out_shape, "a", attrs={"approximate": "none"})
    p1 = Layer("p", "max_pool2d", ["a"], (3, 4, 4), "p", attrs={
        "kernel": [2, 2], "stride": [2, 2], "padding": [0, 0], "dilation": [1, 1], "ceil_mode": False})
    g["pool_after_gelu"] = correlate_max_pools(LayerGraph((2, 8, 8), [c1, gelu, p1], "p", input_variance=True))
    # max pooling of Gaussians (Clark's max) and of a deterministic input
    g["pool_gauss"] = LayerGraph((3, 8, 10), [pool("p", INPUT, (3, 8, 10), 2, 2)], "p", input_variance=True)
    g["pool_det"] = LayerGraph((3, 9, 9), [pool("p", INPUT, (3, 9, 9), 3, 2)], "p")
    # Gaussian max pools taking each vector layout: flattened output (LeNet pool1), channels
    # (LeNet pool2), odd sizes (3x3 window, stride 2), and padding + ceil-mode overhang (serial)
    g["pool_flat"] = LayerGraph((6, 28, 28), [pool("p", INPUT, (6, 28, 28), 2, 2)], "p", input_variance=True)
    g["pool_chans"] = LayerGraph((16, 10, 10), [pool("p", INPUT, (16, 10, 10), 2, 2)], "p", input_variance=True)
    g["pool_odd"] = LayerGraph((5, 7, 9), [pool("p", INPUT, (5, 7, 9), 3, 2)], "p", input_variance=True)
    g["pool_pad"] = LayerGraph((3, 7, 7), [Layer("p", "max_pool2d", [INPUT], (3, 4, 4), "p", attrs={
        "kernel": [3, 3], "stride": [2, 2], "padding": [1, 1], "dilation": [1, 1], "ceil_mode": True})],
        "p", input_variance=True)
    # average pooling (with padding: the divisor varies) of Gaussians and of a deterministic input
    avg = {"kernel": [3, 3], "stride": [2, 2], "padding": [1, 1], "dilation": [1, 1], "ceil_mode": False,
           "count_include_pad": False, "divisor": None}
    g["avg_gauss"] = LayerGraph((4, 9, 9), [Layer("p", "avg_pool2d", [INPUT], (4, 5, 5), "p", attrs=avg)], "p",
                                input_variance=True)
    g["avg_det"] = LayerGraph((4, 9, 9), [Layer("p", "avg_pool2d", [INPUT], (4, 5, 5), "p", attrs=avg)], "p")
    # leaky ReLU, a per-channel affine map (eval BatchNorm) and a residual add of Gaussians
    c0 = conv(rng, "c", INPUT, (3, 6, 6), 4, 3, pad=1)
    bn = Layer("bn", "affine", ["c"], c0.out_shape, "bn", params={
        "scale": GaussianParam(rng.uniform(0.5, 2.0, 4), np.zeros(4)),
        "shift": GaussianParam(rng.standard_normal(4), np.zeros(4))})
    g["leaky_affine_add"] = LayerGraph((3, 6, 6), [
        c0, bn, Layer("lr", "leaky_relu", ["bn"], c0.out_shape, "lr", attrs={"slope": 0.1}),
        Layer("sum", "add", ["lr", "c"], c0.out_shape, "sum")], "sum", input_variance=True)
    # relu of Gaussians (3-d) and of a deterministic input
    g["relu_gauss"] = LayerGraph((5, 6, 7), [relu("r", INPUT, (5, 6, 7))], "r", input_variance=True)
    g["relu_det"] = LayerGraph((30,), [relu("r", INPUT, (30,)), dense(rng, "fc", "r", 30, 9)], "fc")
    # a variance input to a dense layer: in the raw-moment plan the planner inserts a `convert`
    g["convert"] = LayerGraph((12,), [dense(rng, "fc", INPUT, 12, 9)], "fc", input_variance=True)
    # layer norm: over the last dim of Gaussians (Gaussian γ, β), and over the last two of a deterministic input
    def ln_params(norm):
        return {"weight": GaussianParam(rng.uniform(0.5, 1.5, norm), rng.uniform(0.0, 0.01, norm)),
                "bias": GaussianParam(rng.standard_normal(norm), rng.uniform(0.0, 0.01, norm))}

    g["layer_norm"] = LayerGraph((3, 12), [Layer("ln", "layer_norm", [INPUT], (3, 12), "ln", {"dims": 1, "eps": 1e-5},
                                                 params=ln_params((12,)))], "ln", input_variance=True)
    g["layer_norm_det"] = LayerGraph((2, 3, 5), [Layer("ln", "layer_norm", [INPUT], (2, 3, 5), "ln",
                                                       {"dims": 2, "eps": 1e-5}, params=ln_params((3, 5)))], "ln")
    # the uncertainty head (pyro2pfp/ops/head.py) on the logits of a dense layer, ten classes and one logit
    for classes in (10, 1):
        g[f"softmax_head_{classes}"] = append_head(
            LayerGraph((6,), [dense(rng, "fc", INPUT, 6, classes)], "fc", input_variance=True), "probs")
    # concatenation: a Gaussian and a deterministic branch along the channels, that with itself along the
    # width; and of deterministic inputs
    c0 = conv(rng, "c", INPUT, (3, 6, 6), 3, 3, pad=1)
    g["concat"] = LayerGraph((3, 6, 6), [
        c0, relu("r", "c", c0.out_shape), Layer("cat", "concat", ["r", INPUT], (6, 6, 6), "cat", attrs={"axis": 0}),
        Layer("wide", "concat", ["cat", "cat"], (6, 6, 12), "wide", attrs={"axis": 2})], "wide")
    g["concat_det"] = LayerGraph((7,), [Layer("cat", "concat", [INPUT, INPUT], (14,), "cat", attrs={"axis": 0})],
                                 "cat")
    # every other registered activation (the generic elementwise kernel), on Gaussians of 3-d shape
    covered = {layer.op for graph in g.values() for layer in graph.layers}
    for name, op in OPS.items():
        if op.activation is not None and name not in covered:
            g[f"act_{name}"] = LayerGraph((3, 5, 6), [Layer("a", name, [INPUT], (3, 5, 6), "a",
                                                            attrs=dict(op.example_attrs))], "a",
                                          input_variance=True)
    return g


GRAPHS = case_graphs()
EXPECT_VECTOR = {  # functions with a vectorizable body and a vector width dividing the vector axis
    "dense": ("pfp_dense_fc1", "pfp_dense_fc2"),
    "conv_cols": ("pfp_conv2d_c",), "conv_chans": ("pfp_conv2d_c",), "conv_wide": ("pfp_conv2d_c1", "pfp_conv2d_c2"),
    "conv_groups": ("pfp_conv2d_c1",),
    "pool_det": ("pfp_max_pool2d_p",), "pool_flat": ("pfp_max_pool2d_p",), "pool_chans": ("pfp_max_pool2d_p",),
    "relu_det": ("pfp_relu_r",), "convert": ("pfp_convert_input_to_second",),
}


def compile_vm(mod, target):
    return relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())



# ------------------------------------------------------------------------------ tests
@pytest.mark.slow
@pytest.mark.parametrize("target, form", [("native", "variance"), ("native", "raw"), ("llvm", "variance")])
@pytest.mark.parametrize("case", list(GRAPHS))
def test_scheduled_matches_reference(case, target, form):
    graph = GRAPHS[case]
    planned = plan(graph, moment_form=form)
    mod = emit_module(planned)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a schedule that fails soft is a failure here
        scheduled = schedule_module(mod, planned, TARGETS[target])
    vm = compile_vm(scheduled, TARGETS[target])
    rng = np.random.default_rng(1)
    for batch in BATCHES:
        x = rng.standard_normal((batch, *graph.input_shape)).astype(np.float32)
        args = [x]
        if graph.input_variance:
            args.append((0.1 * rng.uniform(0.0, 1.0, x.shape)).astype(np.float32))
        ref = execute(planned, *args)
        out = vm["main"](*[tvm.runtime.tensor(a) for a in args])
        for got, want, what in zip(out, ref, ("mean", "var")):
            got = got.numpy()
            assert got.shape == want.shape
            scale = np.abs(want).max() + 1e-30
            err = np.abs(got - want).max() / scale
            assert err <= RTOL, f"{case} {target} batch {batch} {what}: relative error {err:.2e}"


@pytest.mark.slow
def test_every_primfunc_is_scheduled():
    """Each PFP PrimFunc is rewritten: marked scheduled, has a parallel loop, and the ones whose
    body TVM can vectorise have a vector loop."""
    seen_ops = set()
    for (case, graph), form in itertools.product(GRAPHS.items(), ["variance", "raw"]):
        planned = plan(graph, moment_form=form)
        mod = emit_module(planned, fuse=False)  # every op its own kernel (fusion: test_fused_relu...)
        scheduled = schedule_module(mod, planned, TARGETS["native"])
        ops = {f"pfp_{layer.op}_{layer.name}": layer.op for layer in planned.layers}
        for name, func in prim_funcs(scheduled).items():
            op = ops[name]
            seen_ops.add(op)
            assert func.attrs is not None and func.attrs.get("tirx.is_scheduled", False), name
            script = func.script()
            assert "T.parallel" in script, name
            if name in EXPECT_VECTOR.get(case, ()):
                assert "T.vectorized" in script, name
            # the unscheduled function is untouched
            assert prim_funcs(mod)[name].attrs.get("tirx.is_scheduled", False) is False
    # every op that computes something has a default schedule (a view such as reshape emits no kernel)
    # window_closure exists only in shared-factor plans, where the scheme's own kernel computes it
    # (sf_window_closure: test_correlation_backends.py's every-shared-factor-PrimFunc test)
    computing = {name for name, op in OPS.items() if not op.view} - {"window_closure"}
    assert seen_ops == computing, computing - seen_ops
    assert seen_ops <= set(SCHEDULES)


def test_failing_schedule_keeps_the_function_and_warns(monkeypatch):
    graph = GRAPHS["relu_det"]
    planned = plan(graph)
    mod = emit_module(planned)

    def broken(sch, layer, target):
        sch.vectorize(sch.get_loops(sch.get_child_blocks(sch.get_sblock("root"))[0])[0])  # batch axis
        raise AssertionError("not reached: vectorising a symbolic loop raises")

    monkeypatch.setitem(SCHEDULES, "relu", broken)  # replaces the default schedule for this test
    with pytest.warns(RuntimeWarning, match="pfp_relu_r"):
        scheduled = schedule_module(mod, planned, TARGETS["llvm"])
    before, after = prim_funcs(mod), prim_funcs(scheduled)
    assert tvm_ffi.structural_equal(before["pfp_relu_r"], after["pfp_relu_r"])
    assert after["pfp_dense_fc"].attrs.get("tirx.is_scheduled", False)
    # the module still compiles and runs correctly
    vm = compile_vm(scheduled, TARGETS["llvm"])
    x = np.random.default_rng(2).standard_normal((3, 30)).astype(np.float32)
    ref = execute(planned, x)
    out = vm["main"](tvm.runtime.tensor(x))
    np.testing.assert_allclose(out[0].numpy(), ref[0], rtol=0, atol=RTOL * np.abs(ref[0]).max())


def test_unregistered_ops_stay_unscheduled(monkeypatch):
    graph = GRAPHS["dense"]
    planned = plan(graph)
    mod = emit_module(planned, fuse=False)
    monkeypatch.delitem(SCHEDULES, "relu")
    scheduled = schedule_module(mod, planned, TARGETS["llvm"])
    assert tvm_ffi.structural_equal(mod["pfp_relu_r"], scheduled["pfp_relu_r"])
    assert scheduled["pfp_dense_fc1"].attrs.get("tirx.is_scheduled", False)


def test_rescheduling_is_a_no_op():
    graph = GRAPHS["conv_groups"]
    planned = plan(graph)
    once = schedule_module(emit_module(planned), planned, TARGETS["native"])
    twice = schedule_module(once, planned, TARGETS["native"])
    for name, func in prim_funcs(once).items():
        assert tvm_ffi.structural_equal(func, prim_funcs(twice)[name]), name


def test_simd_lanes():
    assert schedules.simd_lanes(tvm.target.Target("llvm")) == 4
    assert schedules.simd_lanes(tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})) == 8
    assert schedules.simd_lanes(tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})) == 16


@pytest.mark.slow
@pytest.mark.parametrize("form", ["variance", "raw"])
def test_fused_relu_dense_matches_unfused_and_reference(form):
    """A ReLU after a dense layer is computed in the dense kernel's epilogue (one kernel fewer);
    after a conv layer it stays its own kernel; results match the unfused module and the float64
    reference."""
    from pyro2pfp.backends.tvm.fusion import fused_activations

    rng = np.random.default_rng(3)
    for graph in (mlp_graph(rng, [20, 24, 16, 5]), lenet_graph(rng, widths=(2, 4, 8, 6), image=12)):
        planned = plan(graph, moment_form=form)
        fused = fused_activations(planned)
        assert {p: r.name for p, r in fused.items()} == {
            p.inputs[0]: p.name for p in planned.layers
            if p.op == "relu" and p.inputs[0].startswith("fc")}
        mod = emit_module(planned)
        names = set(prim_funcs(mod))
        for producer, relu in fused.items():
            assert f"pfp_dense_{producer}_{relu.name}" in names and f"pfp_relu_{relu.name}" not in names
        x = rng.uniform(-1, 1, (3, *planned.input_shape)).astype(np.float32)
        fused_out = compile_vm(schedule_module(mod, planned, TARGETS["native"]), TARGETS["native"])["main"](
            tvm.runtime.tensor(x))
        plain = emit_module(planned, fuse=False)
        plain_out = compile_vm(schedule_module(plain, planned, TARGETS["native"]), TARGETS["native"])["main"](
            tvm.runtime.tensor(x))
        for got, unfused, ref in zip(fused_out, plain_out, PFPNetwork(graph, planned).reference(x)):
            scale = np.abs(ref).max()
            np.testing.assert_allclose(got.numpy(), ref, rtol=0, atol=2e-5 * scale)
            np.testing.assert_allclose(got.numpy(), unfused.numpy(), rtol=0, atol=2e-6 * scale)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["variance", "raw"])
def test_fused_relu_after_residual_add(form):
    """A residual block's last ReLU is computed in the ``add`` kernel (``pfp_add_sum_out``, no
    ``pfp_relu_out``), with the same results as one kernel per layer and the float64 reference."""
    from pyro2pfp.backends.tvm.fusion import fused_activations

    rng = np.random.default_rng(4)
    c1 = conv(rng, "c1", INPUT, (3, 6, 6), 4, 3, pad=1)
    c2 = conv(rng, "c2", "r1", (4, 6, 6), 4, 3, pad=1)
    graph = LayerGraph((3, 6, 6), [c1, relu("r1", "c1", c1.out_shape), c2,
                                   Layer("sum", "add", ["c2", "c1"], c1.out_shape, "sum"),
                                   relu("out", "sum", c1.out_shape),
                                   Layer("flat", "reshape", ["out"], (144,), "flat"),
                                   dense(rng, "fc", "flat", 144, 3)], "fc", input_variance=True)
    planned = plan(graph, moment_form=form)
    assert {p: r.name for p, r in fused_activations(planned).items()} == {"sum": "out"}
    names = set(prim_funcs(emit_module(planned)))
    assert "pfp_add_sum_out" in names and "pfp_relu_out" not in names and "pfp_relu_r1" in names
    rng_x = np.random.default_rng(5)
    x = rng_x.standard_normal((3, 3, 6, 6)).astype(np.float32)
    x_var = (0.1 * rng_x.uniform(size=x.shape)).astype(np.float32)
    args = [tvm.runtime.tensor(a) for a in (x, x_var)]
    outs = []
    for fuse in (True, False):
        mod = emit_module(planned, fuse=fuse)
        outs.append(compile_vm(schedule_module(mod, planned, TARGETS["native"]), TARGETS["native"])["main"](*args))
    for got, unfused, ref in zip(*outs, execute(planned, x, x_var)):
        scale = np.abs(ref).max()
        np.testing.assert_allclose(got.numpy(), ref, rtol=0, atol=2e-5 * scale)
        np.testing.assert_allclose(got.numpy(), unfused.numpy(), rtol=0, atol=2e-6 * scale)


@pytest.mark.slow
def test_elementwise_kernel_on_a_flat_view_where_that_widens_the_vector():
    """LeNet's relu2 (16×10×10): the last two axes give 4 lanes (100 = 4·25), one flat axis 16
    (1600 = 64·25): the kernel runs on a (batch, 1600) view with a 16-lane vector (AVX-512 target),
    results as the reference; relu1 (6×28×28: 784 = 16·49 already) keeps its 4-D kernel."""
    from pyro2pfp.backends.tvm.ops.activation import flat_widens_vector

    assert flat_widens_vector((16, 10, 10)) and not flat_widens_vector((6, 28, 28))
    assert not flat_widens_vector((100,)) and not flat_widens_vector((3, 5, 5))  # 75 = odd: no gain
    graph = lenet_graph(np.random.default_rng(4))
    planned = plan(graph)
    target = tvm.target.Target({"kind": "llvm", "mcpu": "znver4"})  # AVX-512: 16 fp32 lanes
    scheduled = schedule_module(emit_module(planned), planned, target)
    kernels = {gv.name_hint: scheduled[gv] for gv in scheduled.get_global_vars()
               if isinstance(scheduled[gv], tvm.tirx.PrimFunc)}
    relu2, relu1 = kernels["pfp_relu_relu2"].script(), kernels["pfp_relu_relu1"].script()
    assert "T.Buffer((batch, T.int64(1600))" in relu2 and "T.int64(10), T.int64(10))" not in relu2
    assert "T.vectorized(T.int64(16))" in relu2
    assert "T.Buffer((batch, T.int64(6), T.int64(28), T.int64(28))" in relu1
    net = PFPNetwork(graph, planned)
    x = np.random.default_rng(5).standard_normal((3, *graph.input_shape)).astype(np.float32)
    for got, want in zip(net.compile("native")(x), net.reference(x)):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.slow
@pytest.mark.parametrize("builder", [lenet_graph, mlp_graph])
def test_small_static_kernels_run_serially(builder, monkeypatch):
    """In a static-batch module the kernels under ``SERIAL_WORK`` operations and ``SERIAL_BYTES`` bytes of
    arguments lose their parallel loops (and only those); the module still matches the reference;
    any-batch kernels stay parallel."""
    from pyro2pfp.backends.tvm.tuning.specialize import specialize_batch

    rng = np.random.default_rng(0)
    graph = builder(rng) if builder is lenet_graph else builder(rng, [784, 100, 10])
    planned = plan(graph)
    mod = emit_module(planned, fuse=False)
    static = specialize_batch(mod, 7)
    flops = {name: schedules.kernel_work(tvm.s_tir.Schedule(f)) for name, f in prim_funcs(static).items()}
    assert len(set(flops.values())) > 1, flops
    monkeypatch.setattr(schedules.driver, "NEST_SERIAL_WORK", 0.0)  # the kernel rule alone (the nest rule: below)
    # the bytes rule alone: a kernel of few operations that reads or writes many bytes stays parallel
    sizes = {name: schedules.kernel_bytes(tvm.s_tir.Schedule(f)) for name, f in prim_funcs(static).items()}
    assert len(set(sizes.values())) > 1, sizes
    monkeypatch.setattr(schedules.driver, "SERIAL_WORK", float("inf"))
    monkeypatch.setattr(schedules.driver, "SERIAL_BYTES", float(np.median(list(sizes.values()))) + 0.5)
    for name, func in prim_funcs(schedule_module(static, planned, TARGETS["native"])).items():
        assert ("T.parallel" in func.script()) == (sizes[name] >= schedules.driver.SERIAL_BYTES), (name, sizes[name])
    monkeypatch.setattr(schedules.driver, "SERIAL_BYTES", float("inf"))  # the operations rule alone
    monkeypatch.setattr(schedules.driver, "SERIAL_WORK", float(np.median(list(flops.values()))) + 0.5)
    scheduled = schedule_module(static, planned, TARGETS["native"])
    for name, func in prim_funcs(scheduled).items():
        assert ("T.parallel" in func.script()) == (flops[name] >= schedules.driver.SERIAL_WORK), (name, flops[name])
    for name, func in prim_funcs(schedule_module(mod, planned, TARGETS["native"])).items():
        assert "T.parallel" in func.script(), name  # symbolic batch: work unknown at compile time
    x = np.random.default_rng(3).standard_normal((7, *graph.input_shape)).astype(np.float32)
    serial = compile_vm(scheduled, TARGETS["native"])["main"](tvm.runtime.tensor(x))
    monkeypatch.setattr(schedules.driver, "SERIAL_WORK", 0.0)
    parallel = compile_vm(schedule_module(static, planned, TARGETS["native"]), TARGETS["native"])["main"](
        tvm.runtime.tensor(x))
    for got, want, ref in zip(serial, parallel, execute(planned, x)):
        np.testing.assert_array_equal(got.numpy(), want.numpy())  # the same arithmetic, on one thread
        np.testing.assert_allclose(got.numpy(), ref, rtol=0, atol=1e-4 * np.abs(ref).max())


def parallel_loop_works(func) -> list[float]:
    """:func:`schedules.loop_work` of every parallel loop of a scheduled PrimFunc."""
    sch = tvm.s_tir.Schedule(func)
    seen, works = set(), []
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        for loop in sch.get_loops(block):
            stmt = sch.get(loop)
            if int(stmt.kind) == 1 and not any(stmt.same_as(s) for s in seen):  # ForKind.PARALLEL
                seen.add(stmt)
                works.append(schedules.loop_work(sch, loop))
    return works


@pytest.mark.slow
def test_small_parallel_loops_of_static_kernels_run_serially(monkeypatch):
    """In the static-batch kernels that stay parallel, the parallel loops doing less than
    ``NEST_SERIAL_WORK`` operations (measured on the scheduled kernel) are made serial and only those:
    every parallel loop left does at least that much, fewer are parallel than with the rule off, and
    the module computes bitwise what the all-parallel one does (and matches the reference)."""
    from pyro2pfp.backends.tvm.tuning.specialize import specialize_batch

    graph = lenet_graph(np.random.default_rng(0))
    planned = plan(graph)
    static = specialize_batch(emit_module(planned, fuse=False), 7)
    monkeypatch.setattr(schedules.driver, "SERIAL_WORK", 0.0)  # the nest rule alone
    monkeypatch.setattr(schedules.driver, "NEST_SERIAL_WORK", 0.0)
    every = schedule_module(static, planned, TARGETS["native"])
    works_all = [w for f in prim_funcs(every).values() for w in parallel_loop_works(f)]
    threshold = float(np.median(works_all)) + 0.5
    monkeypatch.setattr(schedules.driver, "NEST_SERIAL_WORK", threshold)
    some = schedule_module(static, planned, TARGETS["native"])
    works_some = [w for f in prim_funcs(some).values() for w in parallel_loop_works(f)]
    assert works_some and min(works_some) >= threshold
    assert sorted(works_some) == sorted(w for w in works_all if w >= threshold)
    x = np.random.default_rng(3).standard_normal((7, *graph.input_shape)).astype(np.float32)
    got = compile_vm(some, TARGETS["native"])["main"](tvm.runtime.tensor(x))
    want = compile_vm(every, TARGETS["native"])["main"](tvm.runtime.tensor(x))
    for g, w, ref in zip(got, want, execute(planned, x)):
        np.testing.assert_array_equal(g.numpy(), w.numpy())
        np.testing.assert_allclose(g.numpy(), ref, rtol=0, atol=1e-4 * np.abs(ref).max())


def test_conv_rows_computed_in_whole_vectors():
    """A conv whose output columns are its vector axis but not a multiple of 16 lanes computes its rows
    16-wide where that adds at most a quarter (LeNet conv1: 28 -> 32), and writes only the real columns."""
    from pyro2pfp.backends.tvm.ops.compute import computed_width

    assert computed_width(6, 28) == 32 and computed_width(6, 14) == 16
    assert computed_width(16, 28) == 28  # 16 channels fill a vector: the schedule vectorises those
    assert computed_width(6, 12) == 12 and computed_width(6, 32) == 32 and computed_width(6, 7) == 7
    import re

    planned = plan(GRAPHS["conv_wide"])
    mod = emit_module(planned)
    funcs = prim_funcs(schedule_module(mod, planned, TARGETS["native"]))
    for name, width in (("pfp_conv2d_c1", 28), ("pfp_conv2d_c2", 14)):
        acc = re.search(r"conv2d_v0 = T.sblock_alloc_buffer\(\((.*)\)\)", prim_funcs(mod)[name].script())
        assert acc is not None and acc.group(1).endswith(f"T.int64({-(-width // 16) * 16})"), (name, acc)
        if schedules.simd_lanes(TARGETS["native"]) == 16:
            assert "T.vectorized(T.int64(16))" in funcs[name].script(), name


def test_unchecked_primitives_schedule_the_same_and_still_reject_misuse():
    """The default schedules call TVM's primitives without its Python type checks
    (``schedules._Unchecked``): the same schedule results, and a wrong argument is still an error
    (from the C++ primitive) rather than a silently wrong kernel."""
    from tvm import s_tir, te

    a = te.placeholder((64, 48), "float32", name="a")
    b = te.compute((64, 48), lambda i, j: a[i, j] * 2.0, name="b")
    func = te.create_prim_func([a, b])

    def schedule(sch):
        i, j = sch.get_loops(sch.get_sblock("b"))
        jo, ji = sch.split(j, factors=[None, 16])
        sch.vectorize(ji)
        sch.parallel(i)
        return sch.mod["main"]

    checked = schedule(s_tir.Schedule(func))
    unchecked = schedule(schedules._Unchecked(s_tir.Schedule(func)))
    assert tvm_ffi.structural_equal(checked, unchecked)
    sch = schedules._Unchecked(s_tir.Schedule(func))
    assert sch.split.func is s_tir.Schedule.split.__wrapped__  # TVM's type-checking wrapper bypassed
    block = sch.get_sblock("b")
    with pytest.raises(Exception, match="(?i)loop|sref|type|convert"):
        sch.split(block, factors=[None, 16])  # a block where a loop is expected
