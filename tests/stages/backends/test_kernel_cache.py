"""The disk cache of compiled kernels (pyro2pfp.backends.tvm.kernel_cache): a second compile of the same
architecture loads every kernel, with the same results; anything that changes a kernel's code misses;
the cached executable exports; concurrent processes share one directory; a cache that cannot be used
is a warning, not an error."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tvm

from pyro2pfp.backends.tvm import kernel_cache
from pyro2pfp.backends.tvm.build import KernelPool
from pyro2pfp.backends.tvm.runtime import build_network
from pyro2pfp.backends.tvm.schedules import driver
from pyro2pfp.network import PFPNetwork
from pyro2pfp.planning.plan import plan
from tests.support.builders import lenet_graph

TARGET = tvm.target.Target("llvm")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def small_lenet(seed: int) -> PFPNetwork:
    graph = lenet_graph(np.random.default_rng(seed), widths=(2, 4, 8, 6), image=12)
    return PFPNetwork(graph, plan(graph))


def run(net: PFPNetwork, x: np.ndarray, executable=None) -> list[np.ndarray]:
    from tvm import relax

    vm = relax.VirtualMachine(executable if executable is not None else build_network(net, TARGET), tvm.cpu())
    return [t.numpy() for t in vm["main"](tvm.runtime.tensor(x))]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PYRO2PFP_KERNEL_CACHE", str(tmp_path / "kernels"))
    return tmp_path / "kernels"


def entries(directory) -> list:
    return sorted(p for p in directory.glob("*/*") if p.suffix == ".o")


def test_cache_location_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PYRO2PFP_KERNEL_CACHE", "off")
    assert kernel_cache.cache_root() is None and kernel_cache.open_cache(TARGET) is None
    monkeypatch.delenv("PYRO2PFP_KERNEL_CACHE")
    monkeypatch.setenv("PYRO2PFP_CACHE", str(tmp_path / "c"))
    assert kernel_cache.cache_root() == tmp_path / "c" / "kernels"
    monkeypatch.delenv("PYRO2PFP_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert kernel_cache.cache_root() == tmp_path / "x" / "pyro2pfp" / "kernels"


@pytest.mark.slow
def test_a_second_compile_of_the_architecture_loads_every_kernel(cache_dir, monkeypatch):
    x = np.random.default_rng(2).standard_normal((3, 1, 12, 12)).astype(np.float32)
    first = small_lenet(0)
    run(first, x)
    cache = kernel_cache.open_cache(TARGET)
    assert cache is not None and cache.hits == 0 and cache.misses > 0
    stored = entries(cache_dir)
    assert len(stored) == cache.misses  # one object file per kernel
    other = small_lenet(1)  # other weights: the same kernels
    misses = cache.misses
    scheduled: list[str] = []
    schedule_function = driver.schedule_function
    monkeypatch.setattr(driver, "schedule_function",
                        lambda func, op, *args: (scheduled.append(op), schedule_function(func, op, *args))[1])
    got = run(other, x)
    assert cache.misses == misses and cache.hits == misses
    assert scheduled == []  # found before scheduling: nothing scheduled, nothing compiled
    assert entries(cache_dir) == stored
    monkeypatch.setenv("PYRO2PFP_KERNEL_CACHE", "off")
    for g, w in zip(got, run(other, x)):
        np.testing.assert_array_equal(g, w)  # the same machine code, loaded instead of compiled


@pytest.mark.slow
def test_a_changed_kernel_or_target_misses(cache_dir, monkeypatch):
    net = small_lenet(0)
    run(net, np.zeros((1, 1, 12, 12), np.float32))
    cache = kernel_cache.open_cache(TARGET)
    found: dict[str, bool] = {}
    load = kernel_cache.KernelCache.load

    def spy(self, key, symbols):
        out = load(self, key, symbols)
        found.update({s: out is not None for s in symbols})
        return out

    monkeypatch.setattr(kernel_cache.KernelCache, "load", spy)
    build_network(net, TARGET, schedule=False)  # other code (no schedule) under the same names
    pfp = {name for name in found if name.startswith("pfp_")}
    assert len(pfp) >= 6 and not any(found[name] for name in pfp)  # every PFP kernel misses
    other_target = tvm.target.Target({"kind": "llvm", "mcpu": "x86-64"})
    assert kernel_cache.open_cache(other_target).dir != cache.dir


def test_a_pass_context_with_instruments_bypasses_the_cache(cache_dir):
    @tvm.instrument.pass_instrument
    class Record:
        def run_before_pass(self, _mod, _info):
            pass

    assert KernelPool(TARGET).cache is not None
    with tvm.transform.PassContext(opt_level=3, instruments=[Record()]):
        assert KernelPool(TARGET).cache is None


def test_an_unusable_cache_directory_is_a_warning(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("PYRO2PFP_KERNEL_CACHE", str(blocker / "kernels"))
    with pytest.warns(RuntimeWarning, match="kernel cache"):
        assert kernel_cache.open_cache(TARGET) is None


def test_prune_keeps_the_most_recently_used(cache_dir):
    cache = kernel_cache.open_cache(TARGET)
    for i, name in enumerate(("old", "mid", "new")):
        path = cache.dir / f"{name}.o"
        path.write_bytes(b"x" * 1000)
        os.utime(path, (1000 + i, 1000 + i))
    stale = cache.dir / ".left.tmp"
    stale.write_bytes(b"x")
    os.utime(stale, (0, 0))
    cache.prune(2500)
    assert sorted(p.name for p in cache.dir.iterdir()) == ["mid.o", "new.o"]


@pytest.mark.slow
def test_a_cached_executable_exports_and_loads(cache_dir, tmp_path):
    import pyro2pfp

    net = small_lenet(0)
    x = np.random.default_rng(2).standard_normal((2, 1, 12, 12)).astype(np.float32)
    net.compile("llvm")
    exe = net.compile("llvm")  # every kernel from the cache
    assert kernel_cache.open_cache(TARGET).hits > 0
    path = tmp_path / "net.so"
    exe.export_library(str(path))
    loaded = pyro2pfp.load(str(path))
    for g, w in zip(loaded(x), exe(x)):
        np.testing.assert_array_equal(g, w)


@pytest.mark.slow
def test_concurrent_processes_share_one_cache(cache_dir):
    script = textwrap.dedent("""
        import sys
        import numpy as np
        sys.path.insert(0, sys.argv[1])
        from tests.stages.backends.test_kernel_cache import small_lenet
        net = small_lenet(0)
        x = np.random.default_rng(2).standard_normal((2, 1, 12, 12)).astype(np.float32)
        mean, var = net.compile("llvm")(x)
        ref_mean, ref_var = net.reference(x)
        assert np.abs(mean - ref_mean).max() <= 1e-4 * np.abs(ref_mean).max()
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=ROOT, PYRO2PFP_KERNEL_CACHE=str(cache_dir), PYRO2PFP_BUILD_JOBS="1")
    procs = [subprocess.Popen([sys.executable, "-c", script, ROOT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0 and out.strip() == "ok", err[-2000:]
    assert entries(cache_dir) and not list(cache_dir.glob("*/.*.tmp"))
