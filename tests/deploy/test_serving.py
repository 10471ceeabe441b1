"""Safe to serve: a predictor shared by threads, no silent non-finite or dropped outputs, clear errors
for bad arguments, and exported libraries validated when they are loaded."""
from __future__ import annotations

import json
import threading
import warnings

import numpy as np
import pyro.distributions as dist
import pytest
import torch
import torch.nn as nn
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroSample

import pyro2pfp
from pyro2pfp.errors import (
    ArgumentError,
    InputShapeError,
    LibraryNotFoundError,
    LoadError,
    NumericalError,
    TracingError,
)
from pyro2pfp.network import PFPNetwork
from pyro2pfp.planning.plan import plan
from pyro2pfp.runtime.deploy import FORMAT
from tests.support.builders import mlp_graph

D_IN = 20


@pytest.fixture(scope="module")
def compiled():
    graph = mlp_graph(np.random.default_rng(0), [D_IN, 16, 5])
    net = PFPNetwork(graph, plan(graph, 1.0, "variance"))
    return net, net.compile()


@pytest.fixture(scope="module")
def exported(compiled, tmp_path_factory):
    _, exe = compiled
    path = str(tmp_path_factory.mktemp("lib") / "net.so")
    exe.export_library(path)
    return path


def _hammer(exe, threads: int = 4, calls: int = 2000) -> list:
    """Every thread calls ``exe`` ``calls`` times, cycling through batch sizes; returns mismatches
    against single-threaded results (compared bitwise)."""
    rng = np.random.default_rng(1)
    xs = {b: rng.standard_normal((b, D_IN)).astype(np.float32) for b in (1, 3, 7, 16)}
    expected = {b: tuple(a.copy() for a in exe(x)) for b, x in xs.items()}
    problems: list = []

    def work(i: int) -> None:
        try:
            for k in range(calls):
                b = (1, 3, 7, 16)[(i + k) % 4]
                mean, var = exe(xs[b])
                if not (np.array_equal(mean, expected[b][0]) and np.array_equal(var, expected[b][1])):
                    problems.append((i, k, b))
                    return
        except Exception as exc:  # noqa: BLE001 -- reported by the test
            problems.append((i, repr(exc)))

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return problems


@pytest.mark.slow
def test_one_compiled_predictor_shared_by_threads(compiled):
    assert _hammer(compiled[1]) == []


@pytest.mark.slow
def test_one_loaded_predictor_shared_by_threads(exported):
    assert _hammer(pyro2pfp.load(exported)) == []


def test_profiling_while_other_threads_call_the_same_predictor(compiled):
    """``exe.profile`` runs in the calling thread's VM, so it may overlap calls from other threads,
    including the thread that created the predictor (the "in_vm" method instruments and runs
    ``main``: the VM's whole state)."""
    _, exe = compiled  # created by this (the main) thread
    x = np.random.default_rng(2).standard_normal((3, D_IN)).astype(np.float32)
    expected = tuple(a.copy() for a in exe(x))
    problems: list = []

    def profile() -> None:
        try:
            for _ in range(20):
                exe.profile(x, repeats=3, method="in_vm")
        except Exception as exc:  # noqa: BLE001 -- reported by the test
            problems.append(repr(exc))

    worker = threading.Thread(target=profile)
    worker.start()
    calls = 0
    while worker.is_alive() or calls < 100:
        mean, var = exe(x)
        calls += 1
        if not (np.array_equal(mean, expected[0]) and np.array_equal(var, expected[1])):
            problems.append(f"mismatch at call {calls}")
            break
    worker.join()
    assert problems == []


def test_float32_overflow_is_an_error_not_a_silent_inf(compiled):
    net, exe = compiled
    x = np.full((2, D_IN), 2e19, np.float32)
    ref_mean, ref_var = net.reference(x)
    assert np.isfinite(ref_mean).all() and np.isfinite(ref_var).all()  # float64 is fine
    with pytest.raises(NumericalError, match=r"not finite.*float32.*net.reference"):
        exe(x)


def test_input_beyond_float32_range_has_its_own_message(compiled):
    net, exe = compiled
    x = np.full((1, D_IN), 1e39)
    with pytest.raises(InputShapeError, match="beyond float32's range"):
        exe(x)
    assert np.isfinite(net.reference(x)[0]).all()  # float64 reference accepts it
    with pytest.raises(InputShapeError, match="NaN or infinite"):
        exe(np.full((1, D_IN), np.inf))


def test_x_var_is_never_dropped_silently(compiled):
    net, exe = compiled
    x = np.zeros((2, D_IN), np.float32)
    for fn in (exe, net.reference):
        with pytest.raises(InputShapeError, match="without input variance"):
            fn(x, np.ones_like(x))
    graph = mlp_graph(np.random.default_rng(0), [D_IN, 4])
    graph.input_variance = True
    noisy = PFPNetwork(graph, plan(graph, 1.0, "variance"))
    with pytest.raises(InputShapeError, match=r"x_var has shape \(3, 20\), x has \(2, 20\)"):
        noisy.reference(x, np.ones((3, D_IN)))


def test_half_precision_tensors_are_converted_and_complex_refused(compiled):
    net, exe = compiled
    x = torch.randn(2, D_IN)
    for dtype in (torch.bfloat16, torch.float16):
        low = x.to(dtype)
        np.testing.assert_array_equal(exe(low)[0], exe(low.float().numpy())[0])
        np.testing.assert_array_equal(net.reference(low)[0], net.reference(low.double().numpy())[0])
    with pytest.raises(InputShapeError, match="real numbers"):
        exe(torch.randn(2, D_IN, dtype=torch.complex64))


class _Tiny(PyroModule):
    def __init__(self, branch: bool = False, dropout: bool = False):
        super().__init__()
        self.fc = PyroModule[nn.Linear](4, 3)
        self.fc.weight = PyroSample(dist.Normal(0.0, 1.0).expand([3, 4]).to_event(2))
        self.drop = nn.Dropout(0.5) if dropout else nn.Identity()
        self.branch = branch

    def forward(self, x, y=None):
        out = self.fc(self.drop(x))
        if self.branch and x.shape[0] > 1:  # batch-dependent control flow
            out = torch.relu(out)
        return out


def _tiny(**kwargs):
    model = _Tiny(**kwargs)
    guide = AutoNormal(model)
    guide(torch.zeros(2, 4))
    return model, guide


def test_batch_dependent_control_flow_is_refused_naming_the_line():
    model, guide = _tiny(branch=True)
    with pytest.raises(TracingError, match=r"differently at batch 1.*test_serving.py, line \d+, in forward"):
        pyro2pfp.convert(model, guide)
    model, guide = _tiny()
    pyro2pfp.convert(model, guide)  # the same model without the branch converts


def test_train_mode_converts_eval_semantics_with_a_warning():
    model, guide = _tiny(dropout=True)
    model.train()
    with pytest.warns(UserWarning, match=r"train mode \(drop\).*eval semantics"):
        train_net = pyro2pfp.convert(model, guide)
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eval_net = pyro2pfp.convert(model, guide)
    x = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(train_net.reference(x)[0], eval_net.reference(x)[0])


@pytest.mark.parametrize("calibration", [None, "0.5", True, [1.0]])
def test_calibration_must_be_a_number(calibration):
    model, guide = _tiny()
    with pytest.raises(pyro2pfp.PFPError, match="calibration must be a number"):
        pyro2pfp.convert(model, guide, calibration=calibration)


def test_input_shape_types():
    model, guide = _tiny()
    assert pyro2pfp.convert(model, guide, input_shape=4).input_shape == (4,)  # one feature dimension
    for bad in ("4", (4.0,), None.__class__, [True]):
        with pytest.raises(InputShapeError, match="input_shape must be a tuple of positive ints"):
            pyro2pfp.convert(model, guide, input_shape=bad)


# ---------------------------------------------------------------------------------------------
# Loading exported libraries
# ---------------------------------------------------------------------------------------------


def _copy(exported, tmp_path, edit=None):
    """A copy of the library under a new name (never overwrite a loaded .so: it is mapped) with the
    sidecar edited by ``edit``."""
    import shutil

    path = str(tmp_path / f"copy{len(list(tmp_path.glob('copy*.so')))}.so")
    shutil.copy(exported, path)
    with open(exported + ".json") as f:
        meta = json.load(f)
    if edit:
        edit(meta)
    with open(path + ".json", "w") as f:
        json.dump(meta, f)
    return path


def test_load_checks_the_sidecar_against_the_library(exported, tmp_path):
    wrong_shape = _copy(exported, tmp_path, lambda m: m.update(input_shape=[7]))
    with pytest.raises(LoadError, match=r"does not accept input of shape \(batch, 7\)"):
        pyro2pfp.load(wrong_shape)
    wrong_flag = _copy(exported, tmp_path, lambda m: m.update(input_variance=True))
    with pytest.raises(LoadError, match="main takes 1 input"):
        pyro2pfp.load(wrong_flag)
    missing = _copy(exported, tmp_path, lambda m: m.pop("input_shape"))
    with pytest.raises(LoadError, match="has no input_shape"):
        pyro2pfp.load(missing)
    ok = pyro2pfp.load(_copy(exported, tmp_path))
    assert ok(np.zeros((1, D_IN), np.float32))[0].shape == (1, 5)


def test_load_refuses_a_changed_library_unless_told(exported, tmp_path):
    path = _copy(exported, tmp_path, lambda m: m.update(sha256="0" * 64))
    with pytest.raises(LoadError, match="sha256 mismatch.*verify_sha256=False"):
        pyro2pfp.load(path)
    with pytest.warns(UserWarning, match="sha256 mismatch"):
        exe = pyro2pfp.load(path, verify_sha256=False)
    assert exe(np.zeros((2, D_IN), np.float32))[1].shape == (2, 5)


def test_load_errors_are_pfp_errors_with_the_path(tmp_path):
    missing = str(tmp_path / "nothing.so")
    with pytest.raises(LibraryNotFoundError, match="nothing.so") as info:
        pyro2pfp.load(missing)
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, pyro2pfp.PFPError)
    fake = tmp_path / "fake.so"
    fake.write_bytes(b"not a library")
    (tmp_path / "fake.so.json").write_text(json.dumps({"format": FORMAT}))
    with pytest.raises(LoadError, match="fake.so"):
        pyro2pfp.load(str(fake), input_shape=(D_IN,), input_variance=False)
    (tmp_path / "fake.so.json").write_text("{not json")
    with pytest.raises(LoadError, match="not a pyro2pfp metadata file"):
        pyro2pfp.load(str(fake))


# ---------------------------------------------------------------------------------------------
# Wrong arguments to the public API are PFPErrors (ArgumentError is also a ValueError)
# ---------------------------------------------------------------------------------------------


def test_input_variance_must_be_a_bool():
    model, guide = _tiny()
    with pytest.raises(ArgumentError, match="input_variance must be True or False, got 'no'"):
        pyro2pfp.convert(model, guide, input_variance="no")  # bool("no") would be True


@pytest.mark.parametrize("kwargs, match", [
    ({"num_threads": 0}, "num_threads must be a positive int, got 0"),
    ({"num_threads": "2"}, "num_threads must be a positive int, got '2'"),
    ({"tune": "x"}, r"tune='x'.*a batch size, a list of them or a dict"),
    ({"tune": -1}, r"tune=-1.*positive ints"),
])
def test_compile_arguments_are_checked_before_building(compiled, kwargs, match):
    net, _ = compiled
    with pytest.raises(ArgumentError, match=match) as info:
        net.compile(**kwargs)
    assert isinstance(info.value, pyro2pfp.PFPError) and isinstance(info.value, ValueError)
    with pytest.raises(ArgumentError, match="num_threads must be a positive int"):
        pyro2pfp.set_num_threads(2.0)


def test_profile_and_uncertainty_arguments_are_pfp_errors(compiled):
    net, exe = compiled
    x = np.zeros((2, D_IN), np.float32)
    with pytest.raises(ArgumentError, match="method must be 'isolated' or 'in_vm'"):
        exe.profile(x, method="fast")
    mean, var = net.reference(x)
    with pytest.raises(ArgumentError, match="num_samples must be >= 1"):
        pyro2pfp.uncertainty(mean, var, num_samples=0)
    with pytest.raises(ArgumentError, match="var must be non-negative"):
        pyro2pfp.uncertainty(mean, -np.ones_like(var))
    with pytest.raises(ArgumentError, match="at least one in-domain and one out-of-domain"):
        pyro2pfp.auroc(np.array([]), np.array([1.0]))


def test_load_names_the_library_when_given_its_metadata_file_or_a_bad_override(exported):
    with pytest.raises(LoadError, match=r"is the metadata file: pass the library itself.*net\.so'\)"):
        pyro2pfp.load(exported + ".json")
    with pytest.raises(LoadError, match=r"load\(input_shape=\.\.\.\): input_shape must be a list of positive ints"):
        pyro2pfp.load(exported, input_shape="20")
