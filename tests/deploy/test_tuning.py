"""Auto-tuning (pyro2pfp.backends.tvm.tuning): batch specialisation, database keying and reuse, the per-kernel
fallback to the default schedule, and one real (tiny) MetaSchedule run whose module must match the
float64 NumPy reference."""
from __future__ import annotations

import inspect
import json
import time

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from pyro2pfp.backends.tvm import tuning
from pyro2pfp.backends.tvm.tuning import _fast_inspect, api, choose, database, measure, search, specialize
from pyro2pfp.network import PFPNetwork
from pyro2pfp.planning.plan import plan
from tests.support.builders import lenet_graph, mlp_graph


@pytest.fixture(autouse=True)
def _quick_kernel_timing(monkeypatch):
    """Choosing among schedules times each kernel; a coarse timing is enough for these tests."""
    monkeypatch.setitem(measure.KERNEL_TIMING, "repeat", 2)
    monkeypatch.setitem(measure.KERNEL_TIMING, "min_repeat_ms", 2)


TARGET = tuning.tuning_target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})
RTOL = 2e-5


def tiny_mlp(seed: int = 0, sizes=(16, 8, 4), fuse: bool = False) -> PFPNetwork:
    """An MLP whose ReLU is its own kernel by default (a ReLU fused into the dense kernel binds
    Let expressions, which MetaSchedule cannot search: test_fused_kernels_keep_their_default)."""
    graph = mlp_graph(np.random.default_rng(seed), list(sizes))
    return PFPNetwork(graph, plan(graph), fuse=fuse)


def assert_matches_reference(net: PFPNetwork, vm: relax.VirtualMachine, batch: int, seed: int = 1) -> None:
    x = np.random.default_rng(seed).uniform(-1, 1, (batch, *net.input_shape)).astype(np.float32)
    # never hand a NumPy array to a VM directly: it is passed without a copy, and kernels compiled
    # for static shapes assume 64-byte aligned buffers (AVX-512 aligned loads segfault otherwise)
    out = vm["main"](tvm.runtime.tensor(x))
    for got, ref in zip(out, net.reference(x)):
        scale = np.abs(ref).max()
        np.testing.assert_allclose(got.numpy(), ref, rtol=0, atol=RTOL * scale)


# ------------------------------------------------------------------------------ pure helpers
def test_parse_tune_spec_forms_and_errors():
    assert tuning.parse_tune_spec(None) == {}
    assert tuning.parse_tune_spec(False) == {}
    assert tuning.parse_tune_spec(10) == {"batches": (10,)}
    assert tuning.parse_tune_spec([1, 10, 1]) == {"batches": (1, 10)}
    spec = tuning.parse_tune_spec({"batch": 10, "trials": 64, "work_dir": "/tmp/x"})
    assert spec == {"batches": (10,), "trials": 64, "work_dir": "/tmp/x"}
    with pytest.raises(TypeError, match="batch size"):
        tuning.parse_tune_spec(True)
    with pytest.raises(TypeError, match="needs a 'batch'"):
        tuning.parse_tune_spec({"trials": 3})
    with pytest.raises(TypeError, match="unknown tune option"):
        tuning.parse_tune_spec({"batch": 1, "trails": 3})
    with pytest.raises(ValueError, match="positive"):
        tuning.parse_tune_spec({"batch": [0]})


def test_tuning_target_adds_num_cores():
    tgt = tuning.tuning_target("llvm")
    assert int(tgt.attrs["num-cores"]) >= 1
    assert tgt.kind.name == "llvm"
    explicit = tvm.target.Target({"kind": "llvm", "num-cores": 3})
    assert tuning.tuning_target(explicit).same_as(explicit)


def test_refuses_to_tune_for_another_architecture(tmp_path):
    net = tiny_mlp()
    arm = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]}
    with pytest.raises(tuning.TuningError, match="aarch64"):
        tuning.tune(net.mod, arm, batch=1, trials=1, work_dir=tmp_path, progress=False)


def test_check_environment_rejects_segfaulting_ffi(monkeypatch):
    import tvm_ffi

    monkeypatch.setattr(tvm_ffi, "__version__", "0.1.15.post2", raising=False)
    with pytest.raises(tuning.TuningError, match="0.1.14.post1"):
        tuning.check_environment()


def test_fast_inspect_patch_is_scoped_and_equivalent():
    original = inspect.stack
    with _fast_inspect.patched():
        assert inspect.stack is not original
        fast = [(f.filename, f.lineno, f.function) for f in inspect.stack()][:3]
    assert inspect.stack is original
    slow = [(f.filename, f.lineno, f.function) for f in inspect.stack()][:3]
    assert [f[0] for f in fast] == [f[0] for f in slow] and [f[2] for f in fast] == [f[2] for f in slow]


def test_specialize_batch_makes_every_kernel_static():
    net = tiny_mlp()
    static = tuning.specialize_batch(net.mod, 3)
    assert specialize.batch_var(static) == 3
    for gv, func in static.functions_items():
        if isinstance(func, tirx.PrimFunc):
            assert "batch" not in func.script(), gv.name_hint
    with pytest.raises(ValueError):
        tuning.specialize_batch(net.mod, 0)
    with pytest.raises(tuning.TuningError, match="static batch of 3"):
        tuning.specialize_batch(static, 4)


def test_key_depends_on_structure_target_batch_not_weights():
    a, b = tiny_mlp(seed=0), tiny_mlp(seed=1)  # same shapes, different weights
    key = lambda net, batch, tgt=TARGET: tuning.tuning_key(tuning.specialize_batch(net.mod, batch), tgt, batch)  # noqa: E731
    assert key(a, 4) == key(a, 4) == key(b, 4)
    assert key(a, 4) != key(a, 5)
    assert key(a, 4) != key(tiny_mlp(sizes=(16, 8, 5)), 4)
    assert key(a, 4) != key(a, 4, tuning.tuning_target("llvm"))


# ------------------------------------------------------------------------------ reuse / fallback
@pytest.mark.slow
def test_database_is_keyed_reused_and_topped_up(tmp_path, monkeypatch):
    """The search itself is monkeypatched: this is about the work dir, the metadata, reuse and the
    per-kernel choice among default / tuned (an empty database: every kernel keeps its default).
    ``min_share=0``: which kernels are searched must not depend on timings (a loaded machine)."""
    calls = []
    monkeypatch.setattr(api, "_run_search", lambda tasks, *a, **k: calls.append((len(tasks), a[2])))
    net = tiny_mlp()
    lines = []
    first = tuning.tune(net.mod, TARGET, batch=5, trials=6, plan=net.plan, work_dir=tmp_path,
                        progress=lines.append, min_share=0.0)
    assert calls == [(2, 6)]  # the two dense kernels (ReLU keeps its default), budget 6
    assert not first.reused and first.trials == 6
    assert first.work_dir.parent == tmp_path and first.work_dir.name == first.key
    meta = json.loads((first.work_dir / database.META_FILE).read_text())
    assert meta["trials"] == 6 and meta["batch"] == 5
    assert {k.choice for k in first.kernels} <= {"default", "any-batch"}
    assert {k.name for k in first.kernels} == set(meta["choices"])
    assert any("tuning 2 kernel(s)" in line for line in lines)

    again = tuning.tune(net.mod, TARGET, batch=5, trials=6, plan=net.plan, work_dir=tmp_path,
                        progress=False, min_share=0.0)
    assert calls == [(2, 6)] and again.reused and again.work_dir == first.work_dir
    retrained = tuning.tune(tiny_mlp(seed=7).mod, TARGET, batch=5, trials=4, plan=net.plan, work_dir=tmp_path,
                            progress=False, min_share=0.0)
    assert calls == [(2, 6)] and retrained.work_dir == first.work_dir  # weights do not matter
    more = tuning.tune(net.mod, TARGET, batch=5, trials=10, plan=net.plan, work_dir=tmp_path,
                       progress=False, min_share=0.0)
    assert calls == [(2, 6), (2, 4)] and more.trials == 10  # only the difference is searched
    other = tuning.tune(net.mod, TARGET, batch=2, trials=6, plan=net.plan, work_dir=tmp_path,
                        progress=False, min_share=0.0)
    assert other.work_dir != first.work_dir

    vm = relax.VirtualMachine(first.build(), tvm.cpu())
    assert_matches_reference(net, vm, 5)
    with pytest.raises(Exception, match="5"):  # the tuned module takes exactly batch 5
        vm["main"](tvm.runtime.tensor(np.zeros((4, 16), np.float32)))


def _pretend_tuned(static, defaults):
    tuned = static.clone()
    for name, func in defaults.items():  # pretend the database scheduled every kernel
        tuned[tuned.get_global_var(name)] = func.with_attr("tirx.is_scheduled", True).with_attr("tuned", 1)
    return tuned


@pytest.mark.slow
def test_fallback_picks_faster_valid_schedule():
    """``_choose`` keeps, per kernel, the faster of tuned and default -- and never a schedule whose
    outputs differ from the unscheduled kernel's (a miscompile)."""
    net = tiny_mlp()
    static = tuning.specialize_batch(net.mod, 2)
    defaults = choose._default_schedules(static, net.plan, TARGET)
    assert set(defaults) == {"pfp_dense_fc1", "pfp_relu_relu1", "pfp_dense_fc2"}
    tuned = _pretend_tuned(static, defaults)
    fake_us = {"pfp_dense_fc1": (5.0, 9.0), "pfp_relu_relu1": (1.0, 0.5), "pfp_dense_fc2": (2.0, 1.5)}
    wrong = {"pfp_dense_fc2"}  # its "tuned" schedule computes garbage
    real_run = measure.run_prim_func

    def fake_run(func, arrays, time_it=True):
        for name in defaults:
            for kind, f in (("naive", static[name]), ("default", defaults[name]), ("tuned", tuned[name])):
                if f.same_as(func):
                    outs, _ = real_run(static[name], TARGET, arrays, time_it=False)
                    if kind == "tuned" and name in wrong:
                        outs = [o + 1.0 for o in outs]
                    return outs, (fake_us[name][kind == "tuned"] * 1e-6 if time_it else None)
        raise AssertionError("unknown kernel")

    with pytest.warns(RuntimeWarning, match="pfp_dense_fc2 computes different values"):
        choices = choose._choose(static, tuned, defaults, TARGET, run=fake_run)
    assert {n: c["choice"] for n, c in choices.items()} == {
        "pfp_dense_fc1": "default", "pfp_relu_relu1": "tuned", "pfp_dense_fc2": "default"}
    assert all(set(c["times_us"]) == ({"default"} if n == "pfp_dense_fc2" else {"default", "tuned"})
               for n, c in choices.items())
    assert choices["pfp_dense_fc2"]["rejected"] == ["tuned"]


@pytest.mark.slow
def test_tune_network_builds_one_executable_per_batch(tmp_path, monkeypatch):
    monkeypatch.setattr(api, "_run_search", lambda *a, **k: None)
    net = tiny_mlp()
    exes = tuning.tune_network(net, TARGET, {"batch": [1, 3], "trials": 2, "work_dir": str(tmp_path),
                                             "progress": False})
    assert sorted(exes) == [1, 3]
    for batch, ex in exes.items():
        assert_matches_reference(net, relax.VirtualMachine(ex, tvm.cpu()), batch)


# ------------------------------------------------------------------------------ a real search
@pytest.mark.slow
def test_real_metaschedule_run_matches_reference(tmp_path):
    """A real MetaSchedule search (in-process builder and runner) on a tiny MLP, a few trials:
    the database is written, the tuned module matches the reference, a second call reuses it."""
    net = tiny_mlp(sizes=(32, 16, 4))
    t0 = time.perf_counter()
    lines = []
    result = tuning.tune(net.mod, TARGET, batch=4, trials=8, plan=net.plan, work_dir=tmp_path,
                         progress=lines.append, num_trials_per_iter=4, min_share=0.0, search_ops=None)
    took = time.perf_counter() - t0
    assert not result.reused
    # ReLU binds Let expressions, which MetaSchedule 0.27 cannot analyse: only the dense kernels
    # are searched even with search_ops=None (ReLU keeps its default schedule)
    static = tuning.specialize_batch(net.mod, 4)
    assert search._binds_let(static["pfp_relu_relu1"]) and not search._binds_let(static["pfp_dense_fc1"])
    assert any("tuning 2 kernel(s)" in line for line in lines), lines
    records = result.database.get_all_tuning_records()
    assert len(records) >= 4, lines
    assert any(line.endswith(" s") and "trials" in line for line in lines), lines
    assert all(k.choice in ("tuned", "default", "any-batch") for k in result.kernels)
    assert_matches_reference(net, relax.VirtualMachine(result.build(), tvm.cpu()), 4)
    # force the tuned schedules (whatever was faster) and check them against the reference too
    static = tuning.specialize_batch(net.mod, 4)
    forced = database._apply_database(static, result.database, result.target)
    scheduled = [gv.name_hint for gv, f in forced.functions_items()
                 if isinstance(f, tirx.PrimFunc) and f.attrs.get("tirx.is_scheduled", False)]
    assert scheduled, "no kernel got a tuned schedule from the database"
    assert_matches_reference(net, relax.VirtualMachine(tvm.compile(forced, result.target), tvm.cpu()), 4)
    t1 = time.perf_counter()
    again = tuning.tune(net.mod, TARGET, batch=4, trials=8, plan=net.plan, work_dir=tmp_path, progress=False)
    assert again.reused and time.perf_counter() - t1 < max(5.0, took / 2)


# at batch 3 the default max-pool schedule of this tiny net (1x1 pooled output) vectorises its
# parallel loop and computes wrong values; the output check rejects it (and warns)
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*computes different values:RuntimeWarning")
def test_conv_pool_kernels_get_defaults_in_a_specialised_module(tmp_path, monkeypatch):
    """Every op of LeNet keeps a working (default) schedule after batch specialisation."""
    monkeypatch.setattr(api, "_run_search", lambda *a, **k: None)
    graph = lenet_graph(np.random.default_rng(0), widths=(2, 4, 8, 6), image=12)
    net = PFPNetwork(graph, plan(graph))
    result = tuning.tune(net.mod, TARGET, batch=3, trials=0, plan=net.plan, work_dir=tmp_path, progress=False)
    pfp = [k for k in result.kernels if k.name.startswith("pfp_")]
    assert {k.name.split("_")[1] for k in pfp} == {"conv2d", "relu", "max", "dense"}
    # every kernel keeps its default schedule unless that one fails the output check at this
    # static batch (then the unscheduled kernel is used): never a wrong kernel
    assert all(k.choice in ("default", "any-batch") for k in pfp)
    assert all(not k.name.startswith("fused_") for k in result.kernels)  # PFP kernels are not re-fused
    assert_matches_reference(net, relax.VirtualMachine(result.build(), tvm.cpu()), 3)


def test_inprocess_builder_and_runner_round_trip():
    """The in-process builder/runner pair MetaSchedule calls: build a candidate, time it."""
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo
    from tvm.s_tir.meta_schedule.builder import BuilderInput
    from tvm.s_tir.meta_schedule.runner import RunnerInput

    net = tiny_mlp()
    static = tuning.specialize_batch(net.mod, 2)
    mod = measure._normalized(static["pfp_dense_fc1"])
    (built,) = tuning.InProcessBuilder().build([BuilderInput(mod, TARGET)])
    assert built.error_msg is None
    args = ArgInfo.from_prim_func(mod["main"])
    (future,) = tuning.InProcessRunner().run([RunnerInput(built.artifact_path, "cpu", args)])
    result = future.result()
    assert result.error_msg is None and len(result.run_secs) == 1 and float(result.run_secs[0]) > 0
    (missing,) = tuning.InProcessRunner().run([RunnerInput("/nonexistent/x.so", "cpu", args)])
    assert missing.result().error_msg is not None


@pytest.mark.slow
def test_fused_kernels_keep_their_default(tmp_path, monkeypatch):
    """With the ReLU fused into the first dense kernel (the default module), only the second dense
    kernel is searched; the fused one keeps its default schedule and the result is correct."""
    calls = []
    monkeypatch.setattr(api, "_run_search", lambda tasks, *a, **k: calls.append([t.task_name for t in tasks]))
    net = tiny_mlp(fuse=True)
    static = tuning.specialize_batch(net.mod, 2)
    assert search._binds_let(static["pfp_dense_fc1_relu1"])
    result = tuning.tune(net.mod, TARGET, batch=2, trials=4, plan=net.plan, work_dir=tmp_path, progress=False,
                         min_share=0.0)
    assert calls == [["pfp_dense_fc2"]]
    assert {k.name: k.choice for k in result.kernels}["pfp_dense_fc1_relu1"] in ("default", "any-batch")
    assert_matches_reference(net, relax.VirtualMachine(result.build(), tvm.cpu()), 2)


def test_the_schedule_fingerprint_covers_every_op_family_file(monkeypatch):
    """Cached per-kernel choices are invalidated when any default schedule changes: the schedules live in
    backends/tvm/schedules/ *and* the op family files backends/tvm/ops/<family>.py."""
    from pyro2pfp.backends.tvm.ops import compute

    before = specialize._schedules_fingerprint()
    real = inspect.getsource

    def edited(module):
        return real(module) + ("\n# edited" if module is compute else "")

    monkeypatch.setattr(specialize.inspect, "getsource", edited)
    assert specialize._schedules_fingerprint() != before
