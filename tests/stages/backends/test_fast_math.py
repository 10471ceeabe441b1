"""The vectorisable float32 ``fast_exp``/``fast_erf`` of the TVM back end against float64 NumPy,
and that kernels using them compile to vector code without libm calls."""
from __future__ import annotations

import re

import numpy as np
import scipy.special
import tvm
from tvm import s_tir, te

from pyro2pfp.backends.tvm.fast_math import EXP_MAX, EXP_MIN, fast_erf, fast_exp

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})


def _build(fn, n):
    a = te.placeholder((n,), "float32", name="a")
    out = te.compute((n,), lambda i: fn(a[i]), name="out")
    sch = s_tir.Schedule(te.create_prim_func([a, out]))
    (loop,) = sch.get_loops(sch.get_sblock("out"))
    sch.vectorize(sch.split(loop, [None, 16])[1])
    return tvm.tirx.build(sch.mod, target=TARGET)


def _run(lib, x):
    out = tvm.runtime.tensor(np.zeros_like(x))
    lib(tvm.runtime.tensor(x), out)
    return out.numpy().astype(np.float64)


def test_fast_exp_accuracy_and_limits():
    x = np.concatenate([np.linspace(-100.0, 90.0, 200_000), [0.0, -0.0, 1e-30, -1e-30, EXP_MIN, EXP_MAX,
                                                             -1e30, -np.inf, np.finfo(np.float32).min]])
    x = np.concatenate([x.astype(np.float32), np.zeros((-len(x)) % 16, np.float32)])
    got = _run(_build(fast_exp, len(x)), x)
    want = np.exp(x.astype(np.float64))
    assert np.all(np.isfinite(got))
    normal = (x >= EXP_MIN) & (x <= EXP_MAX)
    ulp = np.spacing(want[normal].astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(got[normal] - want[normal]) / ulp) <= 2.0  # measured: < 1 ulp
    assert np.all(got[x < EXP_MIN] == 0.0)  # below FLT_MIN (denormal results): exactly 0, never NaN
    assert np.all(got[x > EXP_MAX] <= np.finfo(np.float32).max)  # saturates, never inf
    assert got[x == 0.0].min() == 1.0 and got[x == 0.0].max() == 1.0  # exp(0) = 1 exactly
    # EXP_MIN is the least float32 whose exp is a normal float: lanes below it are clamped to it
    # before the select, so they compute this value -- never a denormal (x86 microcode, 2x slower)
    tiny = np.finfo(np.float32).tiny
    assert np.float32(EXP_MIN) == EXP_MIN and np.exp(EXP_MIN) >= tiny
    assert np.exp(np.float64(np.nextafter(np.float32(EXP_MIN), np.float32(-np.inf)))) < tiny
    assert got[x == np.float32(EXP_MIN)].min() >= tiny


def test_fast_erf_accuracy():
    x = np.concatenate([np.linspace(-6.0, 6.0, 100_000), [0.0, 40.0, -40.0]]).astype(np.float32)
    x = np.concatenate([x, np.zeros((-len(x)) % 16, np.float32)])
    got = _run(_build(fast_erf, len(x)), x)
    assert np.max(np.abs(got - scipy.special.erf(x.astype(np.float64)))) <= 4e-7


def test_fast_math_vectorises_without_libm_calls():
    for fn in (fast_exp, fast_erf):
        asm = _build(fn, 64).inspect_source("asm")
        assert not re.search(r"call.*\b(expf|erff|exp|erf)\b", asm)
        if "avx512f" in set(tvm.target.codegen.llvm_get_cpu_features(TARGET)):
            assert "zmm" in asm
