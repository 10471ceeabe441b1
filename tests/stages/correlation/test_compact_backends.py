"""The compact factor plan compiled (backends/tvm/compact_factor.py) and exported to ONNX (correlation/compact_onnx.py,
run by onnxruntime) against the float64 reference: the same rule formulas (ops/<family>.py, ops/compute_compact.py)
on three back ends, so they agree up to float32 rounding (tests/support/backends.py's tolerances).

The nets carry every rule: conv block factors (two directions per channel), the correlated max pool with its
``window_cov`` input, an average pool, a flatten, dense layers with an input residual as factors, a LayerNorm.
"""
from __future__ import annotations

import numpy as np
import pytest

from pyro2pfp import ops as ops  # the op registry: every op family registers itself
from pyro2pfp.correlation import Loadings, execute_compact_all, plan_compact
from pyro2pfp.network import PFPNetwork
from pyro2pfp.planning.correlated_pools import correlate_max_pools
from pyro2pfp.planning.graph import GaussianParam, Layer, LayerGraph
from pyro2pfp.planning.plan import plan
from tests.support.backends import ONNX_RTOL, RTOL, assert_matches, onnx_run
from tests.support.builders import dense_layer, lenet_graph, relu_layer


def _lenet(rng: np.random.Generator) -> LayerGraph:
    return correlate_max_pools(lenet_graph(rng, widths=(3, 5, 16, 12), image=16, mean_scale=0.35, var_scale=0.05))


def _avg_and_layer_norm(rng: np.random.Generator) -> LayerGraph:
    """LeNet's conv2 → relu → *average* pool (3x3, stride 2, padding 1) → flatten → fc1 → relu → fc2 →
    LayerNorm → fc3 → fc4."""
    g = lenet_graph(rng, widths=(3, 5, 16, 12), image=16, mean_scale=0.35, var_scale=0.05)
    head = [layer for layer in g.layers if layer.name in ("conv1", "relu1", "pool1", "conv2", "relu2")]
    attrs = {"kernel": [3, 3], "stride": [2, 2], "padding": [1, 1], "dilation": [1, 1], "ceil_mode": False,
             "divisor": None, "count_include_pad": True}
    avg = Layer(name="avg", op="avg_pool2d", inputs=["relu2"], out_shape=(5, 2, 2), source="avg (test)", attrs=attrs)
    flat = Layer(name="flat", op="reshape", inputs=["avg"], out_shape=(20,), source="flat (test)")
    ln = Layer(name="ln", op="layer_norm", inputs=["fc2"], out_shape=(10,), source="ln (test)",
               attrs={"dims": 1, "eps": 1e-5},
               params={"weight": GaussianParam(rng.uniform(0.5, 1.5, 10), np.zeros(10)),
                       "bias": GaussianParam(0.1 * rng.standard_normal(10), np.zeros(10))})
    layers = [*head, avg, flat, dense_layer(rng, "fc1", "flat", 20, 14, 0.4, 0.03), relu_layer("r3", "fc1", (14,)),
              dense_layer(rng, "fc2", "r3", 14, 10, 0.4, 0.03), ln, dense_layer(rng, "fc3", "ln", 10, 8, 0.4, 0.03),
              dense_layer(rng, "fc4", "fc3", 8, 4, 0.4, 0.03)]
    return correlate_max_pools(LayerGraph(input_shape=(1, 16, 16), layers=layers, output="fc4"))


def _net(make, directions: int) -> PFPNetwork:
    graph = make(np.random.default_rng(3))
    planned = plan(graph)
    planned.factors = plan_compact(planned, directions=directions)
    return PFPNetwork(graph, planned)


@pytest.mark.parametrize("make", [_lenet, _avg_and_layer_norm])
def test_onnx_export_matches_the_reference(make):
    net = _net(make, 2)
    cp = net.plan.factors
    assert cp.directions == {"conv2": 2} and cp.residual
    model = net.to_onnx()
    assert {p.key: p.value for p in model.metadata_props}["pyro2pfp.correlation"] == "compact-factor"
    rng = np.random.default_rng(8)
    for batch in (1, 3):
        x = rng.uniform(0, 1, (batch, 1, 16, 16)).astype(np.float32)
        ref = net.reference(x)
        assert_matches(onnx_run(net, x), ref, ONNX_RTOL)
        net.plan.factors = None  # the compact plan changes the variances: the comparison can fail
        assert not np.allclose(net.reference(x)[1], ref[1], rtol=1e-3)
        net.plan.factors = cp


def test_block_factors_are_stored_per_channel():
    """conv2's factors stay (B, C, P, r) blocks up to the flatten (no zeros for the other channels); the dense
    layer turns them into C·r global columns."""
    net = _net(_lenet, 2)
    keep: dict[str, Loadings | None] = {"conv2": None, "pool2": None, "flatten": None, "fc1": None}
    execute_compact_all(net.plan, np.random.default_rng(0).uniform(0, 1, (2, 1, 16, 16)), keep=keep)
    assert keep["conv2"] is not None and keep["conv2"].block["conv2"].shape == (2, 5, 16, 2)
    assert keep["pool2"] is not None and keep["pool2"].block["conv2"].shape == (2, 5, 4, 2)
    assert keep["flatten"] is not None and keep["flatten"].block_shape["conv2"] == (5, 4, 2)
    assert keep["fc1"] is not None and keep["fc1"].glob["conv2"].shape == (2, 16, 10) and not keep["fc1"].block


@pytest.mark.slow
@pytest.mark.parametrize("make", [_lenet, _avg_and_layer_norm])
def test_compiled_matches_the_reference(make):
    net = _net(make, 2)
    exe = net.compile("native")
    rng = np.random.default_rng(9)
    for batch in (1, 3):
        x = rng.uniform(0, 1, (batch, 1, 16, 16)).astype(np.float32)
        assert_matches(exe(x), net.reference(x), RTOL)
    big = rng.uniform(0, 1, (2, 1, 16, 16)).astype(np.float32) * 1e3
    assert all(np.all(np.isfinite(t)) for t in exe(big))


@pytest.mark.parametrize("make", [_lenet, _avg_and_layer_norm])
def test_each_rule_is_one_kernel_with_the_default_schedule(make):
    """Each layer's compact rule is one kernel (op ``compact``) of the emitted module -- no Relax operator is left
    for the Relax pipeline to legalize into kernels without our schedules -- and the default schedules schedule
    every kernel (a flatten's ``reshape`` stays a view); in each rule kernel the reduction with the most work
    accumulates over a vectorised output axis (when that axis is a multiple of 4)."""
    import tvm
    from tvm import relax, s_tir

    from pyro2pfp.backends.tvm.emit import kernel_info
    from pyro2pfp.backends.tvm.schedules import schedule_module
    from pyro2pfp.backends.tvm.tuning.specialize import specialize_batch
    from pyro2pfp.runtime.targets import resolve_target

    net = _net(make, 2)
    mod = net.mod
    calls = {b.value.op.name for block in mod["main"].body.blocks for b in block.bindings
             if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)}
    assert calls <= {"relax.call_tir", "relax.reshape"}, calls  # (a reshape is a view: no kernel)
    prims = {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    rules = {name for name, f in prims.items() if kernel_info(f)[0] == "compact"}
    carried = [layer.name for layer in net.plan.layers if layer.name not in net.plan.factors.terminal]
    assert rules and len(rules) <= len(carried) + len(net.plan.factors.terminal)
    assert len(prims) <= 2 * len(net.plan.layers)
    specialize_batch(mod, 3)  # the kernels' buffers take a static batch (static executables, tuning, profiles)
    scheduled = schedule_module(mod, net.plan, resolve_target("native"))
    for name, func in scheduled.functions_items():
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        assert func.attrs.get("tirx.is_scheduled", False), name
        if name.name_hint not in rules:
            continue
        sch = s_tir.Schedule(func)
        reductions = []
        for block in sch.get_child_blocks(sch.get_sblock("root")):
            stmt = sch.get(block)
            spatial = [iv for iv in stmt.iter_vars if iv.iter_type == tvm.tirx.IterVar.DataPar]
            if len(spatial) < len(stmt.iter_vars):
                loops = [sch.get(loop) for loop in sch.get_loops(block)]
                size = np.prod([int(lp.extent) if isinstance(lp.extent, tvm.tirx.IntImm) else 1 for lp in loops])
                inner = spatial[-1].dom.extent
                lanes = int(inner) % 4 == 0 if isinstance(inner, tvm.tirx.IntImm) else False
                reductions.append((size, lanes, any(lp.kind == tvm.tirx.ForKind.VECTORIZED for lp in loops),
                                   stmt.name_hint))
        if reductions:
            _, lanes, vectorised, block_name = max(reductions)
            assert vectorised or not lanes, (name.name_hint, block_name)
