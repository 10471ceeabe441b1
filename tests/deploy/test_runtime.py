"""The compiled predictor's call path (CompiledPFP): cached aligned inputs, zero-copy outputs,
tuned-batch dispatch, per-kernel profile and thread control."""
from __future__ import annotations

import os

import numpy as np
import pytest

from pyro2pfp.backends.tvm import runtime
from pyro2pfp.backends.tvm.build import mark_prim_funcs_noalias
from pyro2pfp.backends.tvm.tuning import api as tuning_api
from pyro2pfp.errors import InputShapeError, NumericalError, PFPError
from pyro2pfp.network import PFPNetwork
from pyro2pfp.planning.plan import plan
from tests.support.builders import mlp_graph


def tiny_net(input_variance: bool = False) -> PFPNetwork:
    graph = mlp_graph(np.random.default_rng(0), [12, 8, 3])
    graph.input_variance = input_variance
    return PFPNetwork(graph, plan(graph))


@pytest.fixture(scope="module")
def net_exe():
    net = tiny_net()
    return net, net.compile("llvm")


def assert_close_to_reference(net, outs, x, x_var=None):
    for got, ref in zip(outs, net.reference(x, x_var)):
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


def test_outputs_are_fresh_arrays_per_call(net_exe):
    net, exe = net_exe
    rng = np.random.default_rng(0)
    x1, x2 = rng.uniform(-1, 1, (2, 4, 12)).astype(np.float32)
    mean1, var1 = exe(x1)
    kept = mean1.copy(), var1.copy()
    mean2, var2 = exe(x2)  # same batch size: the cached input tensor is reused
    np.testing.assert_array_equal(mean1, kept[0])
    np.testing.assert_array_equal(var1, kept[1])
    assert not np.shares_memory(mean1, mean2)
    assert_close_to_reference(net, (mean1, var1), x1)
    assert_close_to_reference(net, (mean2, var2), x2)
    x1[:] = 0  # the caller's array is not the VM's input buffer
    np.testing.assert_array_equal(exe(x2)[0], mean2)


def test_any_dtype_layout_and_batch(net_exe):
    net, exe = net_exe
    x = np.random.default_rng(1).uniform(-1, 1, (12, 5))
    strided = x.T  # (5, 12) float64, not C-contiguous
    assert_close_to_reference(net, exe(strided), strided)
    for batch in (1, 3, 7, 1):
        xb = np.random.default_rng(batch).uniform(-1, 1, (batch, 12)).astype(np.float32)
        assert_close_to_reference(net, exe(xb), xb)


def test_bad_inputs_name_the_problem(net_exe):
    _, exe = net_exe
    with pytest.raises(InputShapeError, match=r"x\[None\]"):
        exe(np.zeros(12, np.float32))
    with pytest.raises(InputShapeError, match="expected"):
        exe(np.zeros((2, 11), np.float32))
    with pytest.raises(InputShapeError, match="NaN"):
        exe(np.full((2, 12), np.nan, np.float32))
    with pytest.raises(InputShapeError, match="real numbers"):
        exe(np.zeros((2, 12), np.complex64))
    # the float32 fast path (one dot Σx²) must still find a single bad entry, and must not refuse
    # finite values whose sum of squares overflows
    one_inf = np.zeros((3, 12), np.float32)
    one_inf[2, 5] = -np.inf
    with pytest.raises(InputShapeError, match="1 NaN or infinite"):
        exe(one_inf)
    from pyro2pfp.runtime.inputs import as_input_array

    for rows in (1, 2, 5000):
        huge = np.full((rows, 12), 3e38, np.float32)
        assert as_input_array(huge, (12,)) is huge
        for bad in (np.nan, np.inf, -np.inf):
            x = huge.copy()
            x[rows - 1, 3] = bad
            with pytest.raises(InputShapeError, match="1 NaN or infinite"):
                as_input_array(x, (12,))
            x[rows - 1, 3] = 0.0
            x[0, 0] = bad  # first entry too (a dot's partial sums)
            with pytest.raises(InputShapeError, match="1 NaN or infinite"):
                as_input_array(x, (12,))


@pytest.mark.parametrize("shape", [(1, 10), (3, 4), (100, 10), (7, 1000)])
def test_output_check_finds_every_non_finite_entry_and_accepts_huge_finite_values(shape):
    """``check_finite_outputs``' one-dot fast path against ``np.isfinite`` at every kind of bad value,
    beside zeros (``inf·0``) and beside huge finite values (whose squares overflow the dot)."""
    from pyro2pfp.runtime.inputs import check_finite_outputs

    rng = np.random.default_rng(0)
    for fill in (0.0, 1.0, 3e38, -3e38):
        mean = np.full(shape, fill, np.float32)
        var = np.abs(rng.standard_normal(shape)).astype(np.float32)
        check_finite_outputs(mean, var)  # all finite: no error, however large
        for bad in (np.nan, np.inf, -np.inf):
            for which in ("mean", "var"):
                for index in ((0, 0), (shape[0] - 1, shape[1] - 1), (shape[0] // 2, shape[1] // 3)):
                    m, v = mean.copy(), var.copy()
                    (m if which == "mean" else v)[index] = bad
                    with pytest.raises(NumericalError, match=f"1 of {m.size} {which} entries"):
                        check_finite_outputs(m, v)


def test_input_variance_shapes_are_checked():
    net = tiny_net(input_variance=True)
    exe = net.compile("llvm")
    x = np.random.default_rng(2).uniform(-1, 1, (3, 12)).astype(np.float32)
    x_var = np.full_like(x, 1e-2)
    assert_close_to_reference(net, exe(x, x_var), x, x_var)
    with pytest.raises(InputShapeError, match="x_var has shape"):
        exe(x, x_var[:2])
    with pytest.raises(InputShapeError, match="non-negative"):
        exe(x, -x_var)


def test_profile_method(net_exe):
    net, exe = net_exe
    prof = exe.profile(np.ones((2, 12), np.float32), repeats=3)
    assert {r.name for r in prof.kernels} >= {"pfp_dense_fc1_relu1", "pfp_dense_fc2"}
    assert prof.batch == 2 and prof.total_us > 0


@pytest.mark.slow
def test_compile_with_tune_dispatches_by_batch(tmp_path, monkeypatch):
    """``compile(tune=...)`` builds one batch-specialised executable per batch (the search itself
    is stubbed out: the real MetaSchedule run is tested in test_tuning.py) and calls with that
    batch size run it; other sizes run the any-batch executable."""
    monkeypatch.setattr(tuning_api, "_run_search", lambda *a, **k: None)
    net = tiny_net()
    exe = net.compile("llvm", tune={"batch": [3], "trials": 1, "work_dir": str(tmp_path), "progress": False})
    assert sorted(exe.tuned) == [3]
    assert exe.vm_for_batch(3) is not exe.vm and exe.vm_for_batch(4) is exe.vm
    for batch in (3, 4, 1):
        x = np.random.default_rng(batch).uniform(-1, 1, (batch, 12)).astype(np.float32)
        assert_close_to_reference(net, exe(x), x)
    assert exe.profile(np.ones((3, 12), np.float32), repeats=2).batch == 3


@pytest.mark.slow
def test_compile_with_batch_sizes_builds_static_executables():
    """``compile(batch_sizes=...)``: one static-shape executable per size named (the symbolic batch
    bound: the VM's main takes only that size), used for calls of that size; others run the
    any-batch executable; both agree with the reference.  Bad sizes are refused by name."""
    import tvm

    from pyro2pfp.errors import ArgumentError

    net = tiny_net()
    exe = net.compile("llvm", batch_sizes=[2, 5, 2])
    assert sorted(exe.tuned) == [2, 5]
    assert exe.vm_for_batch(5) is not exe.vm and exe.vm_for_batch(4) is exe.vm
    x5 = np.random.default_rng(5).uniform(-1, 1, (5, 12)).astype(np.float32)
    with pytest.raises(Exception, match="5|shape"):  # the static executable refuses another batch size
        exe.vm_for_batch(2)["main"](tvm.runtime.tensor(x5))
    for batch in (2, 5, 3):
        x = np.random.default_rng(batch).uniform(-1, 1, (batch, 12)).astype(np.float32)
        assert_close_to_reference(net, exe(x), x)
    for bad in (0, [1, -2], ["1"], 2.5, [True]):
        with pytest.raises(ArgumentError, match="batch_sizes"):
            net.compile("llvm", batch_sizes=bad)
    cross = net.compile("aarch64", batch_sizes=1)  # built for the device; exported with the library
    assert not cross.runnable and sorted(cross.tuned) == [1]
    assert any('target triple = "aarch64' in m.inspect_source() for m in cross.tuned[1].mod.imports)


def test_cannot_tune_for_another_architecture():
    with pytest.raises(PFPError, match="aarch64"):
        tiny_net().compile("aarch64", tune=1)


def test_thread_control():
    assert os.environ.get("TVM_BIND_THREADS") is not None  # set (to 0 unless the user chose) on import
    assert runtime.default_num_threads() >= 1
    before = runtime.num_threads()
    try:
        assert runtime.set_num_threads(1) == 1 and runtime.num_threads() == 1
    finally:
        runtime.set_num_threads(before)
    assert runtime.num_threads() == before
    with pytest.raises(ValueError, match="positive"):
        runtime.set_num_threads(0)


def test_every_kernel_is_compiled_noalias(net_exe):
    """TVM 0.27's Relax pipeline adds a ``shape_func`` without ``tirx.noalias``, which costs every
    kernel of the module its noalias (2.5x slower dense); ``build`` marks them all."""
    import tvm
    from tvm import relax

    net, _ = net_exe
    lowered = relax.get_pipeline("default")(net.mod)
    funcs = {gv.name_hint: f for gv, f in lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    assert "shape_func" in funcs and not funcs["shape_func"].attrs.get("tirx.noalias", False)
    marked = mark_prim_funcs_noalias(lowered)
    assert all(f.attrs.get("tirx.noalias", False) for f in marked.functions.values()
               if isinstance(f, tvm.tirx.PrimFunc))
