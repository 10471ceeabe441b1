"""Kernels run with subnormal floats flushed to zero (pyro2pfp/backends/tvm/subnormals.py): the conv kernels
of a network flush a subnormal variance term to 0, agree with the float64 reference, and leave the calling
thread's floating-point control word as they found it; the rewrite touches only the kernels it names."""
from __future__ import annotations

import platform

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from pyro2pfp.backends.tvm import subnormals
from pyro2pfp.network import PFPNetwork
from pyro2pfp.planning.graph import INPUT, LayerGraph
from pyro2pfp.planning.plan import plan
from tests.support.builders import conv_layer

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                reason="FTZ/DAZ through MXCSR is x86-only (other targets are not rewritten)")


@T.prim_func
def _swap_mxcsr(old: T.Buffer((1,), "int32"), new: T.int32):
    T.func_attr({"global_symbol": "swap_mxcsr"})
    word = T.alloc_buffer((1,), "int32", scope="local")
    T.evaluate(T.call_llvm_intrin("void", "llvm.x86.sse.stmxcsr", T.address_of(word[0])))
    old[0] = word[0]
    word[0] = new
    T.evaluate(T.call_llvm_intrin("void", "llvm.x86.sse.ldmxcsr", T.address_of(word[0])))


@pytest.fixture(scope="module")
def mxcsr():
    """``swap(word) -> previous word`` of the calling thread's MXCSR."""
    lib = tvm.compile(tvm.IRModule({"swap_mxcsr": _swap_mxcsr}), target="llvm")
    out = tvm.runtime.tensor(np.zeros(1, np.int32))

    def swap(word: int) -> int:
        lib["swap_mxcsr"](out, word)
        return int(out.numpy()[0])

    return swap


def _conv_net(rng, c: int, o: int, n: int) -> PFPNetwork:
    layer = conv_layer(rng, "conv", INPUT, (c, n, n), o, 3, 1, 1, 1, 1, 0.5, 1e-2, "det")
    graph = LayerGraph(input_shape=(c, n, n), layers=[layer], output="conv", input_variance=True)
    return PFPNetwork(graph, plan(graph))


@pytest.mark.parametrize("channels", [4, 16], ids=["direct", "winograd"])
def test_conv_flushes_subnormal_terms_and_restores_the_control_word(mxcsr, channels):
    """An input mean of 1e-20 has a subnormal square (1e-40): with zero input variance and a
    deterministic bias, the output variance of a window of such means is ``Σ vw·μx²`` -- subnormal
    in IEEE arithmetic, 0 with FTZ/DAZ; the output means (normal numbers) agree with the float64
    reference.  The calling thread's control word is the same after the call, whatever it was
    before (default, or FTZ/DAZ set)."""
    rng = np.random.default_rng(0)
    net = _conv_net(rng, channels, 16, 8)
    exe = net.compile()
    x = np.full((2, channels, 8, 8), 1e-20, np.float32)
    x[:, :, :2] = 1.0  # normal means in the first rows: normal variances in the first three output rows
    v = np.zeros_like(x)
    ref_mean, ref_var = net.reference(x, v)
    default = mxcsr(0x1F80)  # the x86 default: all exceptions masked, round to nearest, no FTZ/DAZ
    for word in (0x1F80, 0x1F80 | subnormals.FTZ_DAZ):
        mxcsr(word)
        mean, var = exe(x, v)
        # the control bits (not the sticky exception flags 0-5, which any arithmetic sets)
        assert mxcsr(word) & ~0x3F == word, "the kernel changed the caller's MXCSR"
        scale = np.abs(ref_mean).max()
        np.testing.assert_allclose(mean, ref_mean, rtol=0, atol=1e-5 * scale)
        assert np.all(var >= 0)
        # wherever the reference variance is subnormal in float32, the kernel's is exactly 0
        tiny = (ref_var > 0) & (ref_var < np.finfo(np.float32).tiny)
        assert tiny.any(), "the test input must give subnormal variances"
        assert np.all(var[tiny] == 0)
    mxcsr(default)


def test_only_the_named_kernels_are_rewritten():
    """The pass rewrites the kernels of ``OPS`` (once: a second pass changes nothing) and nothing else."""
    rng = np.random.default_rng(1)
    net = _conv_net(rng, 4, 16, 8)
    mod = net.mod
    once = subnormals.flush_subnormals_pass(mod)
    twice = subnormals.flush_subnormals_pass(once)
    rewritten = set()
    for gv, func in once.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc):
            op = str((func.attrs or {}).get("pfp.op", ""))
            done = bool((func.attrs or {}).get(subnormals.DONE_ATTR, False))
            assert done == (op in subnormals.OPS), gv.name_hint
            if done:
                rewritten.add(gv.name_hint)
                assert "llvm.x86.sse.ldmxcsr" in func.script()
            assert twice[gv].same_as(func)
    assert rewritten, "the conv kernel must be rewritten"
    assert subnormals.applies(tvm.target.Target("llvm"))
    assert not subnormals.applies(tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu"}))


_TWO_THREADS = """
import numpy as np
import tests.stages.backends.test_subnormals as t
from pyro2pfp.runtime.predictor import num_threads
assert num_threads() == 2
net = t._conv_net(np.random.default_rng(0), 16, 16, 8)
x = np.full((16, 16, 8, 8), 1e-20, np.float32)
x[:, :, :2] = 1.0
v = np.zeros_like(x)
_, ref_var = net.reference(x, v)
_, var = net.compile()(x, v)
tiny = (ref_var > 0) & (ref_var < np.finfo(np.float32).tiny)
assert tiny[:8].any() and tiny[8:].any()
assert np.all(var[tiny] == 0), "a thread of the pool computed with subnormals"
"""


def test_every_thread_of_the_pool_flushes():
    """With two threads in TVM's pool (a fresh process: the pool's size is fixed when it starts), the
    outputs of both halves of the batch -- one per thread -- have their subnormal variances flushed."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = {**os.environ, "TVM_NUM_THREADS": "2", "PYTHONPATH": root}
    done = subprocess.run([sys.executable, "-c", _TWO_THREADS], env=env, capture_output=True, text=True, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
