"""The deinterleaved fast path of Gaussian max pooling (windows that tile the input: kernel ==
stride, no padding, no ceil-mode overhang; ``pooling._gaussian_max_pool_deinterleaved``).

Compiled (scheduled, native and generic targets) vs the float64 NumPy reference for several
``k == s`` shapes -- even and odd input sizes (floor mode drops the last row/column), 2x2/2 and
3x3/3, flattened sizes that need padding to whole vectors and ones that do not -- at batch 1
and 7, with a deterministic and a probabilistic input; and LeNet's pool1 takes the fast path.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import tvm
from tvm import relax

from builders import lenet_graph
from pyro2pfp.graph import INPUT, Layer, LayerGraph
from pyro2pfp.plan import plan
from pyro2pfp.reference import execute
from pyro2pfp.tvm_backend import emit_module
from pyro2pfp.tvm_backend.schedules import schedule_module

RTOL = 2e-5
TARGETS = {
    "native": tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu(),
                                 "num-cores": 2}),
    "llvm": tvm.target.Target("llvm"),
}
SHAPES = [  # (input (C, H, W), kernel == stride)
    ((6, 28, 28), 2),   # LeNet pool1: 6x14x14 = 1176 outputs, padded to 1184
    ((3, 8, 10), 2),    # 3x4x5 = 60 -> 64
    ((5, 7, 9), 2),     # odd sizes: last row and column dropped; 5x3x4 = 60
    ((4, 9, 9), 3),     # 3x3/3: 4x3x3 = 36 -> 48
    ((2, 11, 7), 3),    # 3x3/3, odd remainders: 2x3x2
    ((8, 4, 4), 2),     # 8x2x2 = 32: no padding
    ((3, 5, 5), 5),     # the window is the whole plane: one output per channel
]


def pool_graph(in_shape, k, variance: bool) -> LayerGraph:
    c, h, w = in_shape
    out = (c, (h - k) // k + 1, (w - k) // k + 1)
    layer = Layer("p", "max_pool2d", [INPUT], out, "p", attrs={
        "kernel": [k, k], "stride": [k, k], "padding": [0, 0], "dilation": [1, 1], "ceil_mode": False})
    return LayerGraph(in_shape, [layer], "p", input_variance=variance)


def compiled(graph, target, form="variance"):
    planned = plan(graph, moment_form=form)
    mod = emit_module(planned)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a schedule that fails soft is a failure
        scheduled = schedule_module(mod, planned, TARGETS[target])
    return planned, mod, scheduled, relax.VirtualMachine(tvm.compile(scheduled, target=TARGETS[target]), tvm.cpu())


def check(planned, vm, args, what):
    ref = execute(planned, *args)
    out = vm["main"](*[tvm.runtime.tensor(a) for a in args])
    outs = [out] if isinstance(out, tvm.runtime.Tensor) else list(out)
    for got, want, name in zip(outs, ref, ("mean", "var")):
        got = got.numpy()
        assert got.shape == want.shape, what
        scale = np.abs(want).max() + 1e-30
        err = np.abs(got - want).max() / scale
        assert err <= RTOL, f"{what} {name}: relative error {err:.2e}"


@pytest.mark.parametrize("variance", [True, False], ids=["gaussian", "deterministic"])
@pytest.mark.parametrize("target", ["native", "llvm"])
@pytest.mark.parametrize("in_shape, k", SHAPES, ids=[f"{'x'.join(map(str, s))}-k{k}" for s, k in SHAPES])
def test_tiling_max_pool_matches_reference(in_shape, k, target, variance):
    graph = pool_graph(in_shape, k, variance)
    planned, mod, scheduled, vm = compiled(graph, target)
    if variance:  # the fast path is taken (fewer than 16 channels or a multiple of 16 missing)
        assert "deinterleave_v0" in mod["pfp_max_pool2d_p"].script()
        assert "T.vectorized" in scheduled["pfp_max_pool2d_p"].script()
    rng = np.random.default_rng(3)
    for batch in (1, 7):
        x = rng.standard_normal((batch, *in_shape)).astype(np.float32)
        args = [x]
        if variance:
            args.append((0.1 * rng.uniform(0.0, 1.0, x.shape)).astype(np.float32))
        check(planned, vm, args, f"{in_shape} k{k} {target} batch {batch}")


@pytest.mark.parametrize("form", ["variance", "raw"])
def test_tiling_max_pool_limit_cases(form):
    """Zero variances (Clark's max degenerates to the plain max), ties, huge means, and a mix."""
    graph = pool_graph((3, 8, 10), 2, True)
    planned, _, _, vm = compiled(graph, "native", form)
    rng = np.random.default_rng(4)
    shape = (7, 3, 8, 10)
    x = rng.standard_normal(shape).astype(np.float32)
    zero = np.zeros(shape, np.float32)
    check(planned, vm, [x, zero], "zero variance")
    check(planned, vm, [np.ones(shape, np.float32), zero], "ties, zero variance")
    check(planned, vm, [np.ones(shape, np.float32), np.full(shape, 0.5, np.float32)], "ties")
    check(planned, vm, [(1e6 * x).astype(np.float32), (rng.uniform(0, 1, shape) * 1e3).astype(np.float32)],
          "huge means")
    mixed = np.where(rng.uniform(size=shape) < 0.5, 0.0, rng.uniform(0, 1, shape)).astype(np.float32)
    check(planned, vm, [x, mixed], "some variances zero")


def test_static_batch_specialisation_schedules_the_fast_path():
    """The module specialised to a static batch (as MetaSchedule tunes it: 1 or 3) still gets
    the fast path's default schedule, without failing soft, and computes correctly."""
    from pyro2pfp import tuning

    graph = pool_graph((6, 28, 28), 2, True)
    planned = plan(graph)
    mod = emit_module(planned)
    for batch in (1, 3):
        static = tuning.specialize_batch(mod, batch)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            scheduled = schedule_module(static, planned, TARGETS["native"])
        func = scheduled["pfp_max_pool2d_p"]
        assert func.attrs.get("tirx.is_scheduled", False) and "deinterleave_v0" in func.script()
        vm = relax.VirtualMachine(tvm.compile(scheduled, target=TARGETS["native"]), tvm.cpu())
        rng = np.random.default_rng(batch)
        x = rng.standard_normal((batch, 6, 28, 28)).astype(np.float32)
        check(planned, vm, [x, (0.1 * rng.uniform(0, 1, x.shape)).astype(np.float32)], f"static batch {batch}")


def test_lenet_pools_take_their_fast_paths():
    """LeNet pool1 (6 channels) is deinterleaved; pool2 (16 channels) vectorises channels."""
    g = lenet_graph(np.random.default_rng(0))
    planned = plan(g)
    mod = emit_module(planned)
    scheduled = schedule_module(mod, planned, TARGETS["native"])
    pool1 = scheduled["pfp_max_pool2d_pool1"].script()
    assert "deinterleave_v0" in pool1 and "deinterleave_v1" in pool1
    assert "T.vectorized(T.int64(16))" in pool1  # 1176 outputs padded to 1184 = 74 vectors of 16
    pool2 = scheduled["pfp_max_pool2d_pool2"].script()
    assert "deinterleave" not in pool2 and "T.vectorized(T.int64(16))" in pool2
