"""The kernels of a network compiled on several threads (pyro2pfp.backends.tvm.build): the same
executable as ``tvm.compile`` (bitwise equal outputs), one LLVM module per part, exportable, and the
caller's PassContext applied on every thread."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from pyro2pfp.backends.tvm import build as build_module
from pyro2pfp.backends.tvm.build import KERNELS_PER_PART, KernelPool, build, build_jobs
from pyro2pfp.backends.tvm.schedules import schedule_module
from pyro2pfp.errors import ArgumentError
from pyro2pfp.network import PFPNetwork
from pyro2pfp.planning.plan import plan
from tests.support.builders import lenet_graph

TARGET = tvm.target.Target("llvm")


@pytest.fixture(scope="module", autouse=True)
def _no_kernel_cache():
    """These tests are about compiling: the kernel cache (tests/stages/backends/test_kernel_cache.py)
    would load their kernels instead."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYRO2PFP_KERNEL_CACHE", "off")
        yield


@pytest.fixture(scope="module")
def lenet():
    """A small LeNet (conv/ReLU/max pool/dense): ~10 distinct kernels, scheduled."""
    graph = lenet_graph(np.random.default_rng(0), widths=(3, 4, 12, 8), image=12)
    net = PFPNetwork(graph, plan(graph))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, *net.input_shape)).astype(np.float32)
    return net, schedule_module(net.mod, net.plan, TARGET), x


@pytest.fixture(scope="module")
def tvm_compiled_outputs(lenet) -> list[np.ndarray]:
    """The scheduled LeNet built by ``tvm.compile`` in one piece, run on the fixture's input: what the
    pool-based builds must reproduce bitwise (built once for the tests that compare with it)."""
    _, scheduled, x = lenet
    return run(tvm.compile(scheduled, target=TARGET), x)


@pytest.fixture(scope="module")
def parallel_build(lenet):
    """The scheduled LeNet built on 2 threads with the default PassContext (read-only in the tests)."""
    _, scheduled, _ = lenet
    return build(scheduled, TARGET, jobs=2)


def llvm_modules(executable) -> int:
    """LLVM modules linked into an executable (the library and everything it imports)."""
    stack, count = list(executable.mod.imports), 0
    while stack:
        mod = stack.pop()
        count += mod.kind == "llvm"
        stack.extend(mod.imports)
    return count


def run(executable, x: np.ndarray) -> list[np.ndarray]:
    vm = relax.VirtualMachine(executable, tvm.cpu())
    return [t.numpy() for t in vm["main"](tvm.runtime.tensor(x))]


def kernel_count(mod: tvm.IRModule) -> int:
    lowered = relax.get_pipeline("default")(mod)
    return sum(isinstance(f, tvm.tirx.PrimFunc) for f in lowered.functions.values())


@pytest.mark.slow
def test_parallel_build_is_tvm_compile_split_into_parts(lenet):
    net, scheduled, x = lenet
    serial, parallel = build(scheduled, TARGET, jobs=1), build(scheduled, TARGET, jobs=3)
    n_kernels = kernel_count(scheduled)
    assert llvm_modules(serial) == 1
    assert llvm_modules(parallel) == min(n_kernels, max(3, -(-n_kernels // KERNELS_PER_PART))) > 1
    want, got = run(serial, x), run(parallel, x)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)  # the same kernels, only linked from several modules
    for g, r in zip(got, net.reference(x)):
        assert np.abs(g - r).max() <= 2e-5 * np.abs(r).max()


@pytest.mark.slow
def test_kernels_compiled_while_scheduling_are_linked_not_compiled_again(lenet, tvm_compiled_outputs):
    """``build_network``'s path: each kernel goes to the pool as soon as it is scheduled; the Relax
    pipeline leaves them unchanged, so ``build`` compiles only what it added (``shape_func``) and the
    last partial part."""
    net, scheduled, x = lenet
    pool = KernelPool(TARGET, jobs=2)
    names: list[str] = []
    mod = schedule_module(net.mod, net.plan, TARGET, on_scheduled=lambda n, f: (names.append(n), pool.add(n, f)))
    executable = build(mod, TARGET, kernels=pool)
    early = [name for part, _ in pool.parts[:len(names) // KERNELS_PER_PART] for name in part]
    assert len(early) >= KERNELS_PER_PART and set(early) <= set(names)
    assert not set(early) & set(pool.compiled_late)  # compiled once, while scheduling
    assert "shape_func" in pool.compiled_late
    for g, w in zip(run(executable, x), tvm_compiled_outputs):
        np.testing.assert_array_equal(g, w)


@pytest.mark.slow
def test_kernels_compile_while_the_module_is_emitted(monkeypatch):
    """``net.compile()`` of a network whose module is not emitted yet schedules each distinct kernel as
    it is emitted and hands it to the build threads then (``KernelStream``): parts are compiling before
    emission ends, no kernel of the module is queued twice or compiled again after the Relax pipeline,
    and the executable's outputs equal those of the build that schedules after emitting (bitwise)."""
    from pyro2pfp.backends.tvm import runtime as runtime_module
    from pyro2pfp.backends.tvm.runtime import build_network

    pools: list[KernelPool] = []

    class Spy(KernelPool):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pools.append(self)

    monkeypatch.setattr(runtime_module, "KernelPool", Spy)  # the name build_network calls
    monkeypatch.setenv("PYRO2PFP_BUILD_JOBS", "2")
    graph = lenet_graph(np.random.default_rng(0), widths=(3, 4, 12, 8), image=12)
    fresh, emitted = PFPNetwork(graph, plan(graph)), PFPNetwork(graph, plan(graph))
    parts_when_emitted: list[int] = []
    module = PFPNetwork.module

    def watched(self, on_kernel=None):
        out = module(self, on_kernel=on_kernel)
        parts_when_emitted.append(len(pools[-1].parts) if pools else 0)
        return out

    monkeypatch.setattr(PFPNetwork, "module", watched)
    streamed = build_network(fresh, TARGET)
    (pool,) = pools
    assert parts_when_emitted and parts_when_emitted[0] >= 1  # compiling before the module was finished
    names = [name for part, _ in pool.parts for name in part]
    kernels = {gv.name_hint for gv, f in fresh.mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    assert len(names) == len(set(names))  # nothing queued twice
    assert not set(pool.compiled_late) & kernels  # each kernel compiled once, while emitting
    assert "pfp_conv2d_conv1" in set(names) - set(pool.compiled_late)
    emitted.mod  # noqa: B018 -- emitted first: the build schedules after emitting
    after = build_network(emitted, TARGET)
    x = np.random.default_rng(1).standard_normal((3, *fresh.input_shape)).astype(np.float32)
    for got, want in zip(run(streamed, x), run(after, x)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_a_kernel_that_changed_after_it_was_queued_is_compiled_again(lenet, tvm_compiled_outputs):
    """A part compiled early whose kernel is not the one the module links (here: the unscheduled
    version was queued) is dropped and the module's kernel compiled: the executable runs the
    module's code, never a stale one."""
    net, scheduled, x = lenet
    pool = KernelPool(TARGET, jobs=2)
    for gv, func in net.mod.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc):
            pool.add(gv.name_hint, func)  # unscheduled: not what `scheduled` holds under that name
    executable = build(scheduled, TARGET, kernels=pool)
    queued = {name for part, _ in pool.parts for name in part}
    assert queued and queued - {"shape_func"} <= set(pool.compiled_late)
    for g, w in zip(run(executable, x), tvm_compiled_outputs):
        np.testing.assert_array_equal(g, w)


@pytest.mark.slow
def test_parallel_build_exports_and_loads(lenet, parallel_build, tmp_path):
    _, _, x = lenet
    executable = parallel_build
    path = tmp_path / "lenet.so"
    executable.export_library(str(path))
    loaded = tvm.runtime.load_module(str(path))
    vm = relax.VirtualMachine(loaded, tvm.cpu())
    got = [t.numpy() for t in vm["main"](tvm.runtime.tensor(x))]
    for g, w in zip(got, run(executable, x)):
        np.testing.assert_array_equal(g, w)


@pytest.mark.slow
def test_the_callers_pass_context_applies_on_every_thread(lenet):
    """A pass instrument of the caller's PassContext sees the TIR lowering passes that run on the
    build threads (without the context there, it would see only the Relax pipeline's)."""
    _, scheduled, _ = lenet
    seen: list[str] = []

    @tvm.instrument.pass_instrument
    class Record:
        def run_before_pass(self, _mod, info):
            seen.append(info.name)

    with tvm.transform.PassContext(opt_level=3, instruments=[Record()]):
        build(scheduled, TARGET, jobs=2)
    assert any(name.startswith("tirx.") for name in seen)  # TIR lowering, on the build threads


def test_build_jobs_from_the_environment(monkeypatch):
    monkeypatch.setenv("PYRO2PFP_BUILD_JOBS", "3")
    assert build_jobs() == 3
    monkeypatch.delenv("PYRO2PFP_BUILD_JOBS")
    assert build_jobs() == len(build_module.available_cpus()) >= 1
    for bad in ("0", "-2", "two", "1.5"):
        monkeypatch.setenv("PYRO2PFP_BUILD_JOBS", bad)
        with pytest.raises(ArgumentError, match="PYRO2PFP_BUILD_JOBS"):
            build_jobs()


def llvm_source(executable) -> str:
    """The LLVM IR of every part of an executable."""
    stack, sources = list(executable.mod.imports), []
    while stack:
        mod = stack.pop()
        stack.extend(mod.imports)
        if mod.kind == "llvm":
            sources.append(mod.inspect_source("ll"))
    return "\n".join(sources)


@pytest.mark.slow
def test_kernels_have_no_argument_checks_and_the_vm_still_checks_the_inputs(lenet, parallel_build):
    """``tirx.disable_assert``: the kernels' entry functions check no arguments (TVM's messages such as
    "expected to match", "expected non-NULL data pointer" are gone), unless the caller's PassContext
    says otherwise; inputs of the wrong shape, rank or batch are still refused, by the VM, naming the
    parameter and the dimension."""
    import re

    _, scheduled, x = lenet
    executable = parallel_build
    assert not re.search("expected (to match|non-NULL)", llvm_source(executable))
    with tvm.transform.PassContext(config={"tirx.disable_assert": False}):
        checked = build(scheduled, TARGET, jobs=2)
    assert re.search("expected (to match|non-NULL)", llvm_source(checked))
    vm = relax.VirtualMachine(executable, tvm.cpu())
    batch, *shape = x.shape
    cases = {(batch, shape[0], shape[1] - 1, shape[2]): r"param=x\b.*shape\[2\] mismatch",
             (batch, shape[0] + 1, *shape[1:]): r"param=x\b.*shape\[1\] mismatch",
             (batch, *shape[:-1]): r"param=x\b.*expect Tensor with ndim 4"}
    for bad, message in cases.items():
        with pytest.raises(Exception, match=message):
            vm["main"](tvm.runtime.tensor(np.zeros(bad, np.float32)))
