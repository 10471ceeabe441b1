"""The deinterleaved fast path of Gaussian max pooling (windows that tile the input: kernel ==
stride, no padding, no ceil-mode overhang; ``pooling._gaussian_max_pool_deinterleaved``).

Compiled (scheduled, native and generic targets) vs the float64 NumPy reference for several
``k == s`` shapes -- even and odd input sizes (floor mode drops the last row/column), 2x2/2 and
3x3/3, flattened sizes that need padding to whole vectors and ones that do not -- at batch 1
and 7, with a deterministic and a probabilistic input; LeNet's pools take the fast path; the chained
fold's limit cases (zero variance, ±1e30, one element far larger) against exact values; and the
general (reduction) path for padding, ceil-mode overhang and overlapping windows.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import tvm
from tvm import relax

from pyro2pfp.backends.reference import execute
from pyro2pfp.backends.tvm import emit_module
from pyro2pfp.backends.tvm.ops.pooling import POOL_REGISTER_TILE
from pyro2pfp.backends.tvm.schedules import schedule_module, simd_lanes
from pyro2pfp.planning.graph import INPUT, Layer, LayerGraph
from pyro2pfp.planning.plan import plan
from tests.support.builders import lenet_graph
from tests.support.op_coverage import COMPILED, covers

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


@pytest.mark.parametrize("variance", [pytest.param(True, marks=pytest.mark.slow), False],
                         ids=["gaussian", "deterministic"])
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


@pytest.mark.slow
def test_static_batch_specialisation_schedules_the_fast_path():
    """The module specialised to a static batch (as MetaSchedule tunes it: 1 or 3) still gets
    the fast path's default schedule, without failing soft, and computes correctly."""
    from pyro2pfp.backends.tvm import tuning

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
    """LeNet pool1 (6 channels) and pool2 (16 channels) are both deinterleaved and fold with a
    chain of K − 1 = 3 Clark stages (no reduction from the identity), on 4 SIMD vectors."""
    g = lenet_graph(np.random.default_rng(0))
    planned = plan(g)
    mod = emit_module(planned)
    scheduled = schedule_module(mod, planned, TARGETS["native"])
    for name in ("pfp_max_pool2d_pool1", "pfp_max_pool2d_pool2"):
        script = scheduled[name].script()
        assert "deinterleave_v0" in script and "deinterleave_v1" in script, name
        assert 'T.sblock("max_pool2d_1_v0")' in script and 'T.sblock("max_pool2d_2_v1")' in script, name
        assert 'T.sblock("max_pool2d_3_v0")' not in script and "max_pool2d_init" not in script, name
        width = POOL_REGISTER_TILE * simd_lanes(TARGETS["native"])  # 64 with AVX-512, 32 with AVX2
        assert f"T.vectorized(T.int64({width}))" in script, name
    # 1176 outputs padded to a multiple of FLAT_PAD
    assert "T.int64(1216)" in scheduled["pfp_max_pool2d_pool1"].script()


def windows(x: np.ndarray, k: int, s: int, p: int) -> np.ndarray:
    """``(batch, C, OH, OW, k·k)``: every window's elements in row-major order (floor mode,
    padding with −inf)."""
    b, c, h, w = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)), constant_values=-np.inf)
    oh, ow = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    taps = [xp[:, :, r:r + s * oh:s, q:q + s * ow:s] for r in range(k) for q in range(k)]
    return np.stack(taps, axis=-1)


GENERAL = [  # (input (C, H, W), kernel, stride, padding, ceil mode): windows that do not tile the input
    ((3, 9, 9), 3, 2, 1, False),   # padding
    ((2, 7, 8), 2, 2, 0, True),    # ceil-mode overhang
    ((4, 6, 6), 3, 1, 0, False),   # overlapping windows
]


def general_graph(in_shape, k, s, pad, ceil, variance: bool = True) -> LayerGraph:
    c, h, w = in_shape

    def size(n: int) -> int:
        span = n + 2 * pad - k
        out = (-(-span // s) if ceil else span // s) + 1
        return out - 1 if ceil and (out - 1) * s >= n + pad else out

    layer = Layer("p", "max_pool2d", [INPUT], (c, size(h), size(w)), "p", attrs={
        "kernel": [k, k], "stride": [s, s], "padding": [pad, pad], "dilation": [1, 1], "ceil_mode": ceil})
    return LayerGraph(in_shape, [layer], "p", input_variance=variance)


@covers("max_pool2d", kind=COMPILED)
@pytest.mark.parametrize("case", GENERAL, ids=["pad", "overhang", "overlap"])
def test_general_max_pool_matches_reference(case):
    """Windows with padding, overhang or overlap take the reduction path (no deinterleaving copy) and
    match the float64 reference, also at the limit cases."""
    in_shape, k, s, pad, ceil = case
    planned, mod, _, vm = compiled(general_graph(in_shape, k, s, pad, ceil), "native")
    assert "deinterleave" not in mod["pfp_max_pool2d_p"].script()
    rng = np.random.default_rng(5)
    shape = (3, *in_shape)
    x = rng.standard_normal(shape).astype(np.float32)
    check(planned, vm, [x, (0.1 * rng.uniform(0, 1, shape)).astype(np.float32)], f"{case}")
    check(planned, vm, [x, np.zeros(shape, np.float32)], f"{case} zero variance")
    check(planned, vm, [(1e30 * np.sign(x)).astype(np.float32), np.ones(shape, np.float32)], f"{case} ±1e30")


def tap_checks(func: tvm.tirx.PrimFunc, block: str) -> int:
    """The ``if_then_else`` calls inside the body of ``block`` of ``func`` (its window taps' bounds
    checks, when the taps are not read from a padded stage)."""
    from tvm import s_tir

    from pyro2pfp.backends.tvm.schedules import walk

    sch = s_tir.Schedule(func)
    found = []
    walk(sch.get(sch.get_sblock(block)), lambda node: found.append(node) if isinstance(
        node, tvm.ir.expr.Call) and isinstance(node.op, tvm.ir.Op) and node.op.name.endswith(".if_then_else") else None)
    return len(found)


@pytest.mark.parametrize("case", GENERAL[:2], ids=["pad", "overhang"])
def test_overhanging_windows_fold_padded_taps(case):
    """With padding or overhang the taps come from one padded stage (``pad_v0``/``pad_v1``): the Clark
    combiner uses each tap several times and TVM substitutes the tap expression into every use, so a
    bounds check per tap made LLVM spend ~4 s on a 3x3 / stride-2 / padding-1 pool (0.2 s now).  The
    shared-factor kernel (``sf_maxpool``, one stage per fold step) reads its three taps the same way."""
    from pyro2pfp.backends.tvm.emit import kernel_info
    from pyro2pfp.correlation import with_correlation
    from tests.stages.correlation.test_correlation_backends import max_pool_graph

    in_shape, k, s, pad, ceil = case
    func = emit_module(plan(general_graph(in_shape, k, s, pad, ceil)))["pfp_max_pool2d_p"]
    assert tap_checks(func, "pad_v0") == 1 and tap_checks(func, "max_pool2d") == 0
    planned = with_correlation(plan(max_pool_graph(np.random.default_rng(0))), "shared-factor")
    mod = emit_module(planned)
    folds = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc) and kernel_info(f) == (
        "sf_maxpool", "p1")]  # the graph's 3x3 / stride-2 / padding-1 pool
    assert len(folds) == 1 and tap_checks(folds[0], "pad_v2") == 1
    assert all(tap_checks(folds[0], f"correlated_max_{t}_v{v}") == 0 for t in range(1, 9) for v in (0, 1, 2))


def run(vm, args):
    out = vm["main"](*[tvm.runtime.tensor(a) for a in args])
    return [t.numpy() for t in out]


@pytest.mark.parametrize("k", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_chain_limit_cases(k):
    """The chained fold (windows that tile the input) at its limits, against exact values:

    * zero variance: the result is the plain max (exactly) with variance exactly 0;
    * means ±1e30 with unit variances: finite, and the float64 reference's values;
    * one window element far larger than the others (+1e4, variance 0.5): its moments exactly.
    """
    in_shape = (5, 3 * k, 2 * k)  # 5x3x2 = 30 outputs: padded, one register tile
    planned, _, _, vm = compiled(pool_graph(in_shape, k, True), "native")
    rng = np.random.default_rng(6)
    shape = (4, *in_shape)
    x = rng.standard_normal(shape).astype(np.float32)
    zero = np.zeros(shape, np.float32)
    mean, var = run(vm, [x, zero])
    np.testing.assert_array_equal(mean, windows(x, k, k, 0).max(axis=-1))
    np.testing.assert_array_equal(var, 0.0)

    huge = (1e30 * np.where(rng.uniform(size=shape) < 0.5, -1.0, 1.0)).astype(np.float32)
    ones = np.ones(shape, np.float32)
    mean, var = run(vm, [huge, ones])
    assert np.all(np.isfinite(mean)) and np.all(np.isfinite(var))
    check(planned, vm, [huge, ones], "±1e30")

    big = x.copy()
    win = windows(np.arange(x.size, dtype=np.float64).reshape(shape), k, k, 0)
    pick = rng.integers(0, k * k, size=win.shape[:-1])  # one element of each window, any position
    flat = np.take_along_axis(win, pick[..., None], axis=-1)[..., 0].astype(np.int64)
    big.reshape(-1)[flat.reshape(-1)] = 1e4
    v = (0.1 * rng.uniform(0, 1, shape)).astype(np.float32)
    v.reshape(-1)[flat.reshape(-1)] = 0.5
    mean, var = run(vm, [big, v])
    np.testing.assert_array_equal(mean, 1e4)
    np.testing.assert_array_equal(var, 0.5)
    check(planned, vm, [big, v], "one element far larger")


@pytest.mark.parametrize("target", ["native", "llvm"])
def test_correlated_fold_runs_as_one_nest_with_the_same_results(target):
    """The correlated Clark fold of LeNet's pools (windows that tile the input, covariances from
    ``window_cov``) is scheduled as one loop nest -- one parallel loop, every fold stage computed at it --
    and gives bitwise the results of one elementwise nest per stage, within the tolerance of the
    reference."""
    from pyro2pfp.backends.tvm.ops import pooling
    from pyro2pfp.planning.correlated_pools import correlate_max_pools

    g = correlate_max_pools(lenet_graph(np.random.default_rng(0)))
    planned = plan(g)
    mod = emit_module(planned)
    rng = np.random.default_rng(1)
    x = rng.uniform(0, 1, (3, *g.input_shape)).astype(np.float32)
    outs = {}
    for one_nest in (True, False):
        pooling.CORRELATED_ONE_NEST.append(one_nest)
        try:
            scheduled = schedule_module(mod, planned, TARGETS[target])
        finally:
            pooling.CORRELATED_ONE_NEST.pop()
        folds = [name for name, _ in ((gv.name_hint, f) for gv, f in scheduled.functions_items())
                 if name.startswith("pfp_max_pool2d") and "correlated_max_1" in scheduled[name].script()]
        assert len(folds) == 2
        if one_nest:
            assert all(scheduled[name].script().count("T.parallel(") == 1 for name in folds)
        vm = relax.VirtualMachine(tvm.compile(scheduled, target=TARGETS[target]), tvm.cpu())
        outs[one_nest] = [t.numpy() for t in vm["main"](tvm.runtime.tensor(x))]
    for a, b in zip(outs[True], outs[False]):
        np.testing.assert_array_equal(a, b)
    ref = execute(planned, x.astype(np.float64))
    for o, r in zip(outs[True], ref):
        assert np.abs(o - r).max() <= 1e-4 * np.abs(r).max()
