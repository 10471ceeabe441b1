"""Identical kernels are compiled once (pyro2pfp.backends.tvm.sharing): repeated blocks share one
PrimFunc, and the shared build computes exactly what the unshared one does."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from pyro2pfp.backends.tvm.build import build
from pyro2pfp.backends.tvm.emit import emit_module
from pyro2pfp.backends.tvm.schedules import schedule_module
from pyro2pfp.backends.tvm.sharing import share_identical_kernels
from pyro2pfp.network import PFPNetwork
from pyro2pfp.planning.graph import INPUT, Layer, LayerGraph
from pyro2pfp.planning.plan import plan
from tests.support.builders import conv_layer, relu_layer
from tests.support.tir import prim_funcs

TARGET = tvm.target.Target("llvm")


def repeated_blocks() -> PFPNetwork:
    """Three conv(4→4, 3x3, pad 1) + ReLU blocks of the same shape, a residual add of the last two,
    then a conv of another shape: 3 identical convs (+ 1 distinct), 3 identical ReLUs."""
    rng = np.random.default_rng(0)
    shape = (4, 6, 6)
    layers: list[Layer] = []
    prev = INPUT
    for k in range(3):
        layers += [conv_layer(rng, f"c{k}", prev, shape, 4, 3, 1, 1, 1, 1, 0.3, 0.01),
                   relu_layer(f"r{k}", f"c{k}", shape)]
        prev = f"r{k}"
    layers += [Layer("sum", "add", ["r1", "r2"], shape, "sum"),
               conv_layer(rng, "head", "sum", shape, 2, 3, 2, 0, 1, 1, 0.3, 0.01)]
    graph = LayerGraph(shape, layers, "head", input_variance=True)
    return PFPNetwork(graph, plan(graph))



def test_the_emitter_makes_each_distinct_kernel_once():
    """Layers whose kernels would be equal call one PrimFunc as soon as the module is emitted (the
    kernel memo): the same kernels as emitting every layer's own and sharing them afterwards, and the
    same calls."""
    net = repeated_blocks()
    own = emit_module(net.plan, reuse=False)
    once = emit_module(net.plan)
    assert sum(n.startswith("pfp_conv2d") for n in prim_funcs(own)) == 4
    assert sorted(prim_funcs(once)) == sorted(prim_funcs(share_identical_kernels(own)))
    assert sum(n.startswith("pfp_conv2d") for n in prim_funcs(once)) == 2  # c0/c1/c2 one kernel; head its own
    assert share_identical_kernels(once) is once  # nothing left to share
    assert once["main"].script().count("R.call_tir(") == own["main"].script().count("R.call_tir(")


@pytest.mark.slow
def test_identical_kernels_are_shared_and_give_the_same_numbers():
    net = repeated_blocks()
    scheduled = schedule_module(emit_module(net.plan, reuse=False), net.plan, TARGET)  # every layer its own
    shared = share_identical_kernels(scheduled)
    before, after = prim_funcs(scheduled), prim_funcs(shared)
    convs_before = [n for n in before if n.startswith("pfp_conv2d")]
    convs_after = [n for n in after if n.startswith("pfp_conv2d")]
    assert len(convs_before) == 4 and len(convs_after) == 2  # c0/c1/c2 are one kernel; head its own
    assert sum(n.startswith("pfp_relu") for n in after) == 1
    assert "pfp_conv2d_head" in after
    assert set(after) <= set(before) and prim_funcs(scheduled) == before  # the input module is untouched
    # every call of the shared module names a kernel it still has
    calls = shared["main"].script()
    assert all(name in calls for name in after if name.startswith("pfp_"))
    assert not any(name in calls for name in set(before) - set(after))

    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 4, 6, 6)).astype(np.float32)
    x_var = (0.05 * rng.uniform(size=x.shape)).astype(np.float32)
    args = [tvm.runtime.tensor(a) for a in (x, x_var)]
    unshared_vm = relax.VirtualMachine(tvm.compile(scheduled, target=TARGET), tvm.cpu())
    shared_vm = relax.VirtualMachine(build(scheduled, TARGET), tvm.cpu())  # build() shares
    want = [t.numpy() for t in unshared_vm["main"](*args)]
    got = [t.numpy() for t in shared_vm["main"](*args)]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)  # the same code on the same arguments: bitwise equal
    ref = net.reference(x, x_var)
    for g, r in zip(got, ref):
        assert np.abs(g - r).max() <= 2e-5 * np.abs(r).max()


def test_nothing_to_share_returns_the_module():
    rng = np.random.default_rng(0)
    graph = LayerGraph((3, 5, 5), [conv_layer(rng, "c", INPUT, (3, 5, 5), 2, 3, 1, 0, 1, 1, 0.3, 0.01)], "c")
    net = PFPNetwork(graph, plan(graph))
    assert share_identical_kernels(net.mod) is net.mod
