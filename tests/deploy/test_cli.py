"""The ``pyro2pfp`` command line: train → save → ``pyro2pfp convert`` → load → ``pyro2pfp predict``,
and the messages users get for bad paths and inputs."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyro
import pytest
import torch

import pyro2pfp
from pyro2pfp.cli import build_parser, main
from tests.support.cli_mlp import BUILDER


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``python -m pyro2pfp ARGS`` (what the installed ``pyro2pfp`` command runs)."""
    return subprocess.run([sys.executable, "-m", "pyro2pfp", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_round_trip_train_save_convert_load_predict(trained, capsys, monkeypatch):
    work, net, x = trained
    # convert in a fresh process, as from the shell (the installed `pyro2pfp` runs the same main)
    result = cli("convert", "builder.py:build", "--params", "params.pt", "--input-shape", "1,28,28",
                 "-o", "net.so", cwd=work)
    assert result.returncode == 0, result.stderr
    assert "wrote net.so" in result.stdout and (work / "net.so.json").is_file()

    monkeypatch.chdir(work)  # predict: the same command, in this process (saves an interpreter start)
    assert main(["predict", "net.so", "digits.npy", "-o", "out.npz"]) == 0
    assert "class" in capsys.readouterr().out
    with np.load(work / "out.npz") as out:
        mean, var = out["mean"], out["var"]
    # the file loads back as the same predictor
    exe = pyro2pfp.runtime.deploy.load(work / "net.so")
    np.testing.assert_array_equal(exe(x)[0], mean)
    np.testing.assert_array_equal(exe(x)[1], var)
    # the CLI used exactly the trained parameters: same compiled network as converting in-process
    mean_here, var_here = net.compile("llvm")(x)
    np.testing.assert_array_equal(mean, mean_here)
    np.testing.assert_array_equal(var, var_here)
    ref_mean, ref_var = net.reference(x)
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-4, atol=1e-4 * np.abs(ref_mean).max())
    np.testing.assert_allclose(var, ref_var, rtol=1e-3, atol=1e-4 * np.abs(ref_var).max())
    assert np.all(var > 0)


@pytest.mark.slow
def test_convert_exports_static_and_tuned_batch_executables(trained, tmp_path, capsys, monkeypatch):
    """``convert --batch-sizes 3 --tune 6``: the static batch-3 and tuned batch-6 executables are
    written next to the library and listed in its sidecar; ``load``/``predict`` run them for 3 and
    6 rows (the MetaSchedule search itself is stubbed out: tested in test_tuning.py)."""
    from pyro2pfp.backends.tvm.tuning import api as tuning_api

    work, net, x = trained
    assert len(x) == 6
    monkeypatch.setattr(tuning_api, "_run_search", lambda *a, **k: None)
    monkeypatch.setenv("PYRO2PFP_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert main(["convert", str(work / "builder.py"), "-p", str(work / "params.pt"), "-s", "1,28,28",
                 "-b", "3", "--tune", "6", "--trials", "1", "-o", "net.so"]) == 0
    out = capsys.readouterr().out
    assert "wrote net.so, net.batch3.so, net.batch6.so and net.so.json" in out
    assert main(["inspect", "net.so"]) == 0
    assert "batch-specialised executables: 3 (net.batch3.so), 6 (net.batch6.so)" in capsys.readouterr().out
    exe = pyro2pfp.load(tmp_path / "net.so")
    assert sorted(exe.tuned) == [3, 6] and exe.vm_for_batch(6) is not exe.vm
    assert main(["predict", "net.so", str(work / "digits.npy"), "-o", "out.npz"]) == 0
    with np.load(tmp_path / "out.npz") as res:
        np.testing.assert_array_equal(res["mean"], exe(x)[0])  # the tuned batch-6 executable, as loaded
        ref_mean, _ = net.reference(x)
        np.testing.assert_allclose(res["mean"], ref_mean, rtol=1e-4, atol=1e-4 * np.abs(ref_mean).max())
    assert main(["convert", str(work / "builder.py"), "-p", str(work / "params.pt"), "-s", "1,28,28",
                 "--remote", "127.0.0.1:9", "-o", "net2.so"]) == 1
    assert "--remote measures tuning candidates on a board: give --tune" in capsys.readouterr().err


@pytest.mark.slow
def test_onnx_output_inspect_and_predict(trained, capsys, monkeypatch):
    work, net, x = trained
    monkeypatch.chdir(work)
    assert main(["convert", "builder.py", "-p", "params.pt", "-s", "1,28,28", "-o", "net.onnx"]) == 0
    assert main(["inspect", "net.onnx"]) == 0
    out = capsys.readouterr().out
    assert "input  x: float32 (batch, 1, 28, 28)" in out and "Erf" in out
    assert main(["predict", "net.onnx", "digits.npy", "-o", "onnx_out.npz"]) == 0
    with np.load(work / "onnx_out.npz") as res:
        ref_mean, ref_var = net.reference(x)
        np.testing.assert_allclose(res["mean"], ref_mean, rtol=1e-4, atol=1e-4 * np.abs(ref_mean).max())
        np.testing.assert_allclose(res["var"], ref_var, rtol=1e-3, atol=1e-4 * np.abs(ref_var).max())
    # inspect of the builder prints the layer plan (net.summary())
    capsys.readouterr()
    assert main(["inspect", "builder.py:build", "--params", "params.pt"]) == 0
    out = capsys.readouterr().out  # no --input-shape: the Linear first layer gives (784,)
    assert out.splitlines()[2].split() == ["input", "(784,)", "deterministic"]
    assert [line.split()[:2] for line in out.splitlines()[3:6]] == [["fc1", "dense"], ["relu", "relu"],
                                                                    ["fc2", "dense"]]
    assert out.splitlines()[-1] == net.summary().splitlines()[-1]


@pytest.mark.slow
def test_inspect_library_prints_metadata_and_plan(trained, capsys):
    work, _, _ = trained
    lib = work / "net.so"
    if not lib.exists():  # independent of test order
        assert main(["convert", str(work / "builder.py"), "-p", str(work / "params.pt"), "-s", "1,28,28",
                     "-o", str(lib)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(lib)]) == 0
    out = capsys.readouterr().out
    assert "compiled pyro2pfp network" in out and "BayesianMLP" in out and "fc1" in out


def _error(argv: list[str], capsys) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("pyro2pfp ") and "error:" in err and "Traceback" not in err
    return err


@pytest.mark.slow
def test_clear_errors_for_bad_paths_and_inputs(trained, tmp_path, capsys):
    work, _, x = trained
    builder, params = str(work / "builder.py"), str(work / "params.pt")
    out = str(tmp_path / "net.so")
    assert "builder file" in _error(["convert", str(tmp_path / "nope.py:build"), "-o", out], capsys)
    err = _error(["convert", builder + ":make", "-p", params, "-o", out], capsys)
    assert "no function 'make'" in err and "build" in err
    assert "not found" in _error(["convert", builder, "-p", str(tmp_path / "nope.pt"), "-o", out], capsys)
    assert "must end in" in _error(["convert", builder, "-p", params, "-o", str(tmp_path / "net.pt")], capsys)
    assert "does not exist" in _error(["convert", builder, "-p", params, "-o", "/no/such/dir/n.so"], capsys)
    assert "unknown target" in _error(["convert", builder, "-p", params, "-o", out, "-t", "foo"], capsys)
    assert "add --correlation shared-factor" in _error(["convert", builder, "-p", params, "-o", out,
                                                         "--injection", "rescaled"], capsys)
    np.save(tmp_path / "junk.npy", np.zeros(3))
    assert "not a file written by pyro.get_param_store().save()" in _error(
        ["convert", builder, "-p", str(tmp_path / "junk.npy"), "-o", out], capsys)
    torch.save({"w": torch.zeros(2)}, tmp_path / "state_dict.pt")
    assert "not a Pyro param store" in _error(
        ["convert", builder, "-p", str(tmp_path / "state_dict.pt"), "-o", out], capsys)
    # predict
    assert "not found" in _error(["predict", str(tmp_path / "nope.so"), "x.npy", "-o", "o.npz"], capsys)
    lib = work / "net.so"
    if lib.exists():
        np.save(tmp_path / "wrong.npy", np.zeros((2, 3, 28, 28), np.float32))
        assert "expected (batch, 1, 28, 28)" in _error(
            ["predict", str(lib), str(tmp_path / "wrong.npy"), "-o", str(tmp_path / "o.npz")], capsys)
        assert "not found" in _error(["predict", str(lib), str(tmp_path / "no.npy"), "-o",
                                      str(tmp_path / "o.npz")], capsys)
    # argparse errors: exit status 2 with a usage line
    with pytest.raises(SystemExit) as info:
        main(["convert", builder, "-s", "1,a", "-o", out])
    assert info.value.code == 2 and "is not a shape" in capsys.readouterr().err


@pytest.mark.slow
def test_param_store_is_loaded_with_weights_only(trained, tmp_path, capsys):
    """A param store file carrying code is refused (torch.load weights_only=True)."""
    work, _, _ = trained
    marker = tmp_path / "pwned"
    evil = textwrap.dedent(f"""\
        import pathlib, torch
        class Evil:
            def __reduce__(self):
                return (pathlib.Path.touch, (pathlib.Path({str(marker)!r}),))
        torch.save({{"params": {{"a": torch.zeros(1)}}, "constraints": {{"a": Evil()}}}}, {str(tmp_path / 'evil.pt')!r})
        """)
    subprocess.run([sys.executable, "-c", evil], check=True)
    err = _error(["inspect", str(work / "builder.py"), "-p", str(tmp_path / "evil.pt")], capsys)
    assert "not loaded" in err and "weights_only" in err
    assert not marker.exists()


@pytest.mark.slow
def test_store_from_another_model_is_reported(trained, tmp_path, capsys):
    work, _, _ = trained
    (tmp_path / "other.py").write_text(BUILDER.format(hidden=16).replace("BayesianMLP(784", "BayesianMLP(784")
                                       .replace("make_guide(model, init_scale=0.02)",
                                                "__import__('pyro').infer.autoguide.AutoDiagonalNormal(model)"))
    err = _error(["inspect", str(tmp_path / "other.py"), "-p", str(work / "params.pt")], capsys)
    assert "has no values for the guide's parameters" in err and "same model and guide" in err
    (tmp_path / "wide.py").write_text(BUILDER.format(hidden=8))
    err = _error(["inspect", str(tmp_path / "wide.py"), "-p", str(work / "params.pt")], capsys)
    assert "shape" in err


def test_help_is_for_newcomers(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for needed in ("convert", "inspect", "predict", "bench", "pyro.get_param_store().save",
                   "returns (model, guide)", "examples:"):
        assert needed in text
    sub = build_parser()._subparsers._group_actions[0].choices
    for name in ("convert", "inspect", "predict", "bench"):
        assert sub[name].format_help()
    assert "rpi4" in sub["convert"].format_help()
    script = Path(sys.executable).with_name("pyro2pfp")
    if script.exists():  # the installed entry point ([project.scripts])
        result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0 and "convert" in result.stdout


@pytest.mark.slow
def test_bench_never_runs_code_from_the_working_directory(trained, tmp_path, capsys, monkeypatch):
    """A benchmarks/latency.py under the current directory is not executed (it could be anyone's)."""
    work, _, _ = trained
    marker = tmp_path / "executed"
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "latency.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\ndef bench(*a, **k):\n    return 'from cwd'\n")
    monkeypatch.chdir(tmp_path)
    assert main(["bench", str(work / "builder.py"), "-p", str(work / "params.pt"), "--input-shape", "1,28,28",
                 "--batch-sizes", "1", "--samples", "2", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "from cwd" not in out and "PFP TVM ms" in out
    assert not marker.exists()


@pytest.mark.slow
def test_internal_errors_are_short_unless_debug(trained, capsys, monkeypatch):
    """A PFPError is one line (exit 1); anything else is an 'internal error' (exit 2), traceback only
    with --debug."""
    work, _, _ = trained
    argv = ["inspect", str(work / "builder.py"), "-p", str(work / "params.pt")]

    def broken(*args, **kwargs):
        raise RuntimeError("something deep\nbroke")

    monkeypatch.setattr(pyro2pfp.cli.commands, "convert_from_args", broken)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "internal error" in err and "something deep broke" in err and "Traceback" not in err
    assert "--debug" in err
    assert main(["--debug", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: something deep" in err


def test_trials_default_is_the_librarys():
    """Without ``--trials`` the tune spec leaves the budget to ``pyro2pfp.backends.tvm.tuning`` (no second default
    to drift); with it, the given number is passed on."""
    from pyro2pfp.cli import _tune_spec

    parser = build_parser()
    spec = _tune_spec(parser.parse_args(["convert", "builder.py", "-p", "p.pt", "--tune", "10", "-o", "n.so"]))
    assert spec == {"batch": [10]}
    spec = _tune_spec(parser.parse_args(["convert", "builder.py", "-p", "p.pt", "--tune", "10", "--trials", "5",
                                         "-o", "n.so"]))
    assert spec == {"batch": [10], "trials": 5}


LABELLED_BUILDER = textwrap.dedent("""\
    import pyro, pyro.distributions as dist, torch

    def build():
        def model(X, cll):
            W = pyro.sample("W", dist.Normal(torch.zeros(4, 3), 1.0).to_event(2))
            with pyro.plate("data", cll.size(0)):
                pyro.sample("obs", dist.Categorical(logits=X.mm(W)), obs=cll)

        def guide(X, cll):
            cll.size(0)  # a guide that reads the labels
            loc = pyro.param("W_loc", torch.zeros(4, 3))
            scale = pyro.param("W_scale", torch.ones(4, 3), constraint=dist.constraints.positive)
            pyro.sample("W", dist.Normal(loc, scale).to_event(2))

        return model, guide
    """)


@pytest.mark.slow
def test_example_arguments_for_models_that_need_the_labels(tmp_path, capsys):
    (tmp_path / "labelled.py").write_text(LABELLED_BUILDER)
    pyro.clear_param_store()
    pyro.param("W_loc", torch.randn(4, 3))
    pyro.param("W_scale", torch.full((4, 3), 0.1), constraint=pyro.distributions.constraints.positive)
    pyro.get_param_store().save(str(tmp_path / "params.pt"))
    argv = ["inspect", str(tmp_path / "labelled.py"), "-p", str(tmp_path / "params.pt"), "-s", "4"]
    err = _error(argv, capsys)
    assert "cll got None" in err and "example_args=(x, cll)" in err
    np.savez(tmp_path / "example.npz", np.random.rand(5, 4).astype(np.float32), np.array([0, 1, 2, 0, 1]))
    assert main([*argv, "--example", str(tmp_path / "example.npz")]) == 0
    assert "dense" in capsys.readouterr().out
