"""The Winograd F(2x2, 3x3) kernel of the mean-field PFP conv2d (pyro2pfp/backends/tvm/ops/winograd.py):
its transforms, the rule that picks it, and the compiled kernel against the float64 reference.

Tolerances are those of the direct kernel's tests (``tests.support.builders.assert_compute_layer``: the float32
bound ``2·(K + 4)·2⁻²⁴·Σ|terms|`` of a sum of K products), not widened.
"""
from __future__ import annotations

import numpy as np
import pytest
import tvm

from pyro2pfp.backends.reference.arrays import conv2d_nchw
from pyro2pfp.backends.tvm import emit
from pyro2pfp.backends.tvm.ops import winograd
from pyro2pfp.backends.tvm.ops.winograd import WINO_AT, WINO_BT, WINO_G, direct_convolutions, use_winograd
from pyro2pfp.network import PFPNetwork
from pyro2pfp.planning.graph import INPUT, LayerGraph
from pyro2pfp.planning.plan import plan
from tests.support.builders import assert_compute_layer, conv_layer, relu_layer

TARGETS = {
    "native": tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu(),
                                 "num-cores": 2}),
    "llvm": tvm.target.Target("llvm"),  # 128-bit vectors: other tile sizes
}


def conv_graph(rng, c: int, o: int, h: int, w: int, mean_scale: float = 0.1, var_scale: float = 1e-2,
               bias: str = "prob", stride: int = 1, kernel: int = 3, pad: int = 1, groups: int = 1,
               input_variance: bool = True) -> LayerGraph:
    layer = conv_layer(rng, "conv", INPUT, (c, h, w), o, kernel, stride, pad, 1, groups, mean_scale, var_scale, bias)
    return LayerGraph(input_shape=(c, h, w), layers=[layer], output="conv", input_variance=input_variance)


def winograd_funcs(mod) -> list[str]:
    """Names of the PrimFuncs of ``mod`` that are Winograd convs (have a ``wino_gemm`` block)."""
    out = []
    for gv in mod.get_global_vars():
        func = mod[gv]
        if isinstance(func, tvm.tirx.PrimFunc) and "wino_gemm" in func.script():
            out.append(gv.name_hint)
    return out


def test_transform_matrices_compute_the_convolution():
    """``Aᵀ[(G g Gᵀ) ⊙ (Bᵀ d B)]A`` is the 2x2 valid correlation of a 4x4 tile with a 3x3 filter
    (float64, to rounding), and ``filter_transform`` is ``G w Gᵀ`` per (c, o)."""
    rng = np.random.default_rng(0)
    for _ in range(5):
        d, g = rng.standard_normal((4, 4)), rng.standard_normal((3, 3))
        y = WINO_AT @ ((WINO_G @ g @ WINO_G.T) * (WINO_BT @ d @ WINO_BT.T)) @ WINO_AT.T
        direct = np.array([[np.sum(d[i:i + 3, j:j + 3] * g) for j in range(2)] for i in range(2)])
        np.testing.assert_allclose(y, direct, rtol=0, atol=1e-12)
    w = rng.standard_normal((5, 4, 3, 3))  # OIHW
    u = winograd.filter_transform(w)
    assert u.shape == (4, 4, 4, 5) and u.dtype == np.float32
    np.testing.assert_allclose(u[:, :, 2, 3], WINO_G @ w[3, 2] @ WINO_G.T, rtol=1e-6)


@pytest.mark.parametrize("c,o,h,w", [(16, 16, 32, 32), (32, 32, 16, 16), (64, 64, 8, 8)])
def test_rule_picks_winograd_on_the_resnet_stride1_convs(c, o, h, w):
    rng = np.random.default_rng(1)
    p = plan(conv_graph(rng, c, o, h, w)).layers[0]
    assert use_winograd(p, p.in_reprs[0])
    with direct_convolutions():
        assert not use_winograd(p, p.in_reprs[0])


@pytest.mark.parametrize("case", [
    dict(c=16, o=32, h=32, w=32, stride=2),          # the downsampling convs stay direct
    dict(c=16, o=32, h=16, w=16, kernel=1, pad=0),   # 1x1 shortcut
    dict(c=3, o=16, h=32, w=32),                     # the stem: 3 input channels
    dict(c=16, o=8, h=16, w=16),                     # fewer than 16 output channels
    dict(c=16, o=24, h=16, w=16),                    # not whole 16-lane vectors
    dict(c=16, o=16, h=15, w=16),                    # odd output height: no whole 2x2 tiles
    dict(c=16, o=16, h=16, w=16, kernel=5, pad=2),
    dict(c=16, o=16, h=16, w=16, groups=2),
    dict(c=16, o=16, h=16, w=16, input_variance=False),  # deterministic input (first layer)
])
def test_rule_keeps_direct_kernel_elsewhere(case):
    rng = np.random.default_rng(2)
    p = plan(conv_graph(rng, **case)).layers[0]
    assert not use_winograd(p, p.in_reprs[0])
    # the raw-moment plan (input as E[x²], weights as E[w²]) always stays direct
    q = plan(conv_graph(rng, 16, 16, 16, 16), moment_form="raw").layers[0]
    assert not use_winograd(q, q.in_reprs[0])


def compile_and_run(graph: LayerGraph, x, xv, target="native"):
    net = PFPNetwork(graph, plan(graph))
    names = winograd_funcs(net.mod)
    exe = net.compile(TARGETS[target])
    return net, names, net.reference(x, xv), exe(x, xv)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["native", "llvm"])
@pytest.mark.parametrize("c,o,h,w,batch,bias", [
    (16, 16, 8, 8, 1, "prob"), (16, 32, 6, 10, 3, "det"), (32, 16, 4, 12, 2, "none"),
    (24, 16, 10, 6, 2, "prob"),
])
def test_compiled_winograd_conv_matches_reference(target, c, o, h, w, batch, bias):
    rng = np.random.default_rng(c * 1000 + o + h)
    graph = conv_graph(rng, c, o, h, w, bias=bias)
    x = rng.standard_normal((batch, c, h, w)).astype(np.float32)
    xv = (0.1 * rng.uniform(size=x.shape)).astype(np.float32)
    net, names, ref, out = compile_and_run(graph, x, xv, target)
    assert names == ["pfp_conv2d_conv"]  # the Winograd kernel is the one compiled
    layer = graph.layers[0]
    a = layer.attrs
    assert_compute_layer(layer, x, xv, ref, out,
                         lambda t, wt: conv2d_nchw(t, wt, a["stride"], a["padding"], a["dilation"], a["groups"]),
                         "variance")
    assert np.all(out[1] >= 0)


@pytest.mark.slow
@pytest.mark.parametrize("mean_scale,var_scale,x_scale,x_var", [
    (0.1, 0.0, 1.0, 0.0),        # zero variances everywhere: the variance is exactly 0
    (1.0, 1e-12, 1e4, 1e-6),     # huge means, tiny variances
    (1e-3, 1e-30, 1e-3, 1e-30),  # tiny everything
    (10.0, 1e4, 10.0, 1e2),      # huge variances
])
def test_winograd_limit_cases(mean_scale, var_scale, x_scale, x_var):
    rng = np.random.default_rng(5)
    graph = conv_graph(rng, 16, 16, 8, 8, mean_scale=mean_scale, var_scale=var_scale,
                       bias="prob" if var_scale else "det")
    x = (x_scale * rng.standard_normal((2, 16, 8, 8))).astype(np.float32)
    xv = (x_var * rng.uniform(size=x.shape)).astype(np.float32)
    net, names, ref, out = compile_and_run(graph, x, xv)
    assert names == ["pfp_conv2d_conv"]
    assert all(np.all(np.isfinite(t)) for t in out) and np.all(out[1] >= 0)
    if var_scale == 0.0 and x_var == 0.0:
        assert np.all(out[1] == 0.0) and np.all(ref[1] == 0.0)
    layer = graph.layers[0]
    assert_compute_layer(layer, x, xv, ref, out, lambda t, wt: conv2d_nchw(t, wt, [1, 1], [1, 1], [1, 1], 1),
                         "variance")


@pytest.mark.slow
def test_rounding_stays_in_each_outputs_window():
    """F(2x2, 3x3) rounds each output only with the values of its own 3x3 window: the input
    column a 2x2 tile's output does not see enters only transform positions that output's
    ``Aᵀ`` row weights by an exact 0.  So an output whose window has zero variance gets exactly
    0 even next to huge variances (no rounding noise of its neighbours; the float32 bound of the
    direct kernel holds per output), and every variance stays >= 0."""
    rng = np.random.default_rng(6)
    graph = conv_graph(rng, 16, 16, 8, 8, var_scale=0.0, bias="det")
    x = rng.standard_normal((4, 16, 8, 8)).astype(np.float32)
    xv = np.zeros_like(x)
    xv[:, :, :, 3::4] = 1e6 * rng.uniform(0.5, 1, xv[:, :, :, 3::4].shape)  # input columns 3, 7: huge
    net, names, ref, out = compile_and_run(graph, x, xv)
    assert names == ["pfp_conv2d_conv"]
    assert np.all(out[1] >= 0)
    zero = ref[1] == 0.0  # output columns 0, 1 and 5 see no huge input column (windows -1..2, 4..6)
    assert zero.sum() == 4 * 16 * 8 * 3
    assert np.all(out[1][zero] == 0.0)  # column 5 shares its tile (input columns 3..6) with column 4
    layer = graph.layers[0]
    assert_compute_layer(layer, x, xv, ref, out, lambda t, wt: conv2d_nchw(t, wt, [1, 1], [1, 1], [1, 1], 1),
                         "variance")


@pytest.mark.slow
def test_two_layer_net_and_direct_context_give_the_direct_kernel():
    """conv → ReLU → conv: both convs Winograd (the second one's input comes from the ReLU as a
    variance); under ``direct_convolutions()`` none is, and both modules agree with the reference."""
    rng = np.random.default_rng(8)
    c1 = conv_layer(rng, "c1", INPUT, (16, 8, 8), 16, 3, 1, 1, 1, 1, 0.1, 1e-3)
    r1 = relu_layer("r1", "c1", (16, 8, 8))
    c2 = conv_layer(rng, "c2", "r1", (16, 8, 8), 32, 3, 1, 1, 1, 1, 0.1, 1e-3)
    graph = LayerGraph(input_shape=(16, 8, 8), layers=[c1, r1, c2], output="c2", input_variance=True)
    x = rng.standard_normal((3, 16, 8, 8)).astype(np.float32)
    xv = (0.01 * rng.uniform(size=x.shape)).astype(np.float32)
    net, names, ref, out = compile_and_run(graph, x, xv)
    assert sorted(names) == ["pfp_conv2d_c1", "pfp_conv2d_c2"]
    with direct_convolutions():
        direct = PFPNetwork(graph, plan(graph))
        assert winograd_funcs(direct.mod) == []
        out_d = direct.compile(TARGETS["native"])(x, xv)
    for o, od, r in zip(out, out_d, ref):
        np.testing.assert_allclose(o, r, rtol=1e-4, atol=1e-4 * np.abs(r).max())
        np.testing.assert_allclose(od, r, rtol=1e-4, atol=1e-4 * np.abs(r).max())
    # every PrimFunc of the compiled module is scheduled (the Winograd one by schedule_conv2d)
    from pyro2pfp.backends.tvm.schedules import schedule_module
    scheduled = schedule_module(net.mod, net.plan, TARGETS["native"])
    for gv in scheduled.get_global_vars():
        func = scheduled[gv]
        if isinstance(func, tvm.tirx.PrimFunc) and emit.kernel_info(func)[0] == "conv2d":
            assert func.attrs.get("tirx.is_scheduled", False), gv.name_hint


@pytest.mark.slow
def test_static_batch_executables_schedule_the_winograd_kernel():
    """``compile(batch_sizes=...)`` specialises the kernels to a static batch (a batch loop of
    extent 1 at batch 1): the Winograd schedule still applies (no fallback warning) and matches
    the reference at those sizes and at another (symbolic) one."""
    import warnings

    rng = np.random.default_rng(9)
    graph = conv_graph(rng, 16, 32, 8, 8)
    net = PFPNetwork(graph, plan(graph))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed schedule warns
        exe = net.compile(TARGETS["native"], batch_sizes=[1, 3])
    layer = graph.layers[0]
    for batch in (1, 3, 2):
        x = rng.standard_normal((batch, 16, 8, 8)).astype(np.float32)
        xv = (0.1 * rng.uniform(size=x.shape)).astype(np.float32)
        assert_compute_layer(layer, x, xv, net.reference(x, xv), exe(x, xv),
                             lambda t, wt: conv2d_nchw(t, wt, [1, 1], [1, 1], [1, 1], 1), "variance")
