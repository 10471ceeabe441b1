"""Per-kernel profile (pyro2pfp.runtime.profiling) and the latency benchmark's smoke run."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from pyro2pfp.backends.tvm.kernel_work import kernel_multiply_adds
from pyro2pfp.network import PFPNetwork
from pyro2pfp.planning.plan import plan
from pyro2pfp.runtime.profiling import OVERHEAD_ROW, Profile, profile, split_kernel_name
from tests.support.builders import lenet_graph, mlp_graph

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def small_lenet() -> PFPNetwork:
    graph = lenet_graph(np.random.default_rng(0), widths=(2, 4, 8, 6), image=12)
    return PFPNetwork(graph, plan(graph))


@pytest.fixture(scope="module")
def lenet_exe():
    net = small_lenet()
    return net, net.compile("llvm")


def main_kernels(mod: tvm.IRModule) -> set[str]:
    """Names of the PrimFuncs ``main`` calls (the PFP kernels)."""
    called = set(re.findall(r"R\.call_tir\((?:cls\.)?(\w+),", mod["main"].script()))
    return {gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc) and gv.name_hint in called}


def test_split_kernel_name():
    assert split_kernel_name("pfp_dense_fc1") == ("dense", "fc1")
    assert split_kernel_name("pfp_max_pool2d_pool_1") == ("max_pool2d", "pool_1")
    assert split_kernel_name("pfp_relu_relu") == ("relu", "relu")
    assert split_kernel_name("fused_matmul_add") == ("fused_matmul_add", "")
    # shared-factor kernels (scheduled ops, not layer kernels): the op is the longest prefix
    import pyro2pfp.backends.tvm  # noqa: F401 -- registers the sf_* schedules

    assert split_kernel_name("pfp_sf_conv_load_layers_7_conv2") == ("sf_conv_load", "layers_7_conv2")
    assert split_kernel_name("pfp_sf_relu_relu_10") == ("sf_relu", "relu_10")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["isolated", "in_vm"])
def test_one_row_per_kernel_and_rows_sum_to_total(lenet_exe, method):
    net, exe = lenet_exe
    x = np.random.default_rng(1).uniform(0, 1, (3, *net.input_shape)).astype(np.float32)
    prof = profile(exe, [x], repeats=5, method=method)
    assert isinstance(prof, Profile) and prof.batch == 3 and prof.method == method
    names = [r.name for r in prof.kernels]
    pfp = {n for n in names if n.startswith("pfp_")}
    assert pfp == main_kernels(net.mod)              # every PFP kernel, once
    assert len(names) == len(set(names))
    assert prof.rows[-1].name == OVERHEAD_ROW
    assert sum(r.us for r in prof.rows) == pytest.approx(prof.total_us, rel=1e-9)
    assert sum(r.share for r in prof.rows) == pytest.approx(1.0, rel=1e-9)
    assert all(r.us > 0 and r.calls == 1 for r in prof.kernels)
    # how the kernels' sum compares with the call's time is a timing (medians of separate repeats, so
    # even in place their sum can exceed the call's median on a loaded machine): benchmarks/latency.py
    # prints it, no test asserts it
    ops = prof.by_op()
    assert {"conv2d", "relu", "max_pool2d", "dense"} <= set(ops)
    assert sum(ops.values()) == pytest.approx(prof.total_us, rel=1e-9)
    text = prof.table("title")
    assert "pfp_conv2d_conv1" in text and "by op:" in text and text.startswith("title")
    assert prof.as_dict()["rows"][0]["name"] == prof.rows[0].name


def test_kernel_multiply_adds_counts_the_direct_products_and_the_definitions_multiplications():
    net = small_lenet()
    layers = {layer.name: layer for layer in net.plan.layers}
    for batch in (1, 3):
        work = kernel_multiply_adds(net, batch)
        # conv1 reads the deterministic input (1 product per tap for the mean, 1 for the variance),
        # conv2 a variance input (1 + 2): positions x |W| x products x batch
        for name, products in (("conv1", 2), ("conv2", 3)):
            layer = layers[name]
            positions = int(np.prod(layer.layer.out_shape[1:]))
            assert work[f"pfp_conv2d_{name}"] == batch * positions * layer.tensors["weight_mean"].size * products
        # every other kernel: the multiplications of its TIR, linear in the batch
        relu = next(k for k in work if k.startswith("pfp_relu"))
        assert work[relu] > 0
        if batch == 3:
            assert work[relu] == 3 * kernel_multiply_adds(net, 1)[relu]


def test_profile_rows_carry_work_and_rates(lenet_exe):
    net, exe = lenet_exe
    x = np.random.default_rng(1).uniform(0, 1, (2, *net.input_shape)).astype(np.float32)
    work = kernel_multiply_adds(net, 2)
    prof = profile(exe, [x], repeats=3, work=work, reference_rate=1.0, reference_name="torch")
    conv = next(r for r in prof.kernels if r.name == "pfp_conv2d_conv2")
    assert conv.multiply_adds == work["pfp_conv2d_conv2"] * conv.calls
    assert conv.rate == pytest.approx(conv.multiply_adds / conv.us * 1e-3)
    text = prof.table()
    assert "G/s" in text and "xtorch" in text and "multiply-adds" in text
    assert OVERHEAD_ROW not in {r.name for r in prof.rows if r.multiply_adds is not None}


def test_profile_accepts_vm_and_executable_and_checks_method():
    graph = mlp_graph(np.random.default_rng(0), [16, 8, 4])
    net = PFPNetwork(graph, plan(graph))
    ex = tvm.compile(net.mod, target="llvm")
    x = np.ones((2, 16), np.float32)
    for target in (ex, relax.VirtualMachine(ex, tvm.cpu())):
        prof = profile(target, [x], repeats=3)
        assert {r.name for r in prof.kernels} >= {"pfp_dense_fc1_relu1", "pfp_dense_fc2"}
    with pytest.raises(ValueError, match="method"):
        profile(ex, [x], method="bogus")


@pytest.mark.slow
def test_latency_benchmark_quick_runs(tmp_path):
    env = dict(os.environ, PYRO2PFP_CACHE=str(tmp_path), TVM_NUM_THREADS="2")
    # --budget 0.02: seconds of timing per measurement (quick: 0.3, ~10 s of this run); no timing is
    # asserted, only that every row, check and profile is produced and every check agrees
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "latency.py"), "--quick",
                           "--budget", "0.02"], capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    for needle in ("Pyro Predictive(30)", "torch vmap", "det TVM", "PFP NumPy reference", "PFP TVM, tuned",
                   "load average", "threads: TVM 2", "targets (this run", "per-kernel profile"):
        assert needle in out, needle
    assert "MISMATCH" not in out
