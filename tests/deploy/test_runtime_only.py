"""The runtime a board carries: an exported library loads, runs, and is checked with NumPy and the TVM
runtime alone -- in a process where torch, Pyro and SciPy are not installed (importing them raises),
as on a Raspberry Pi with ``pip install --no-deps pyro2pfp`` + NumPy + ``apache-tvm``."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import pyro2pfp
from pyro2pfp.network import PFPNetwork
from pyro2pfp.ops.head import append_head
from pyro2pfp.planning.plan import plan
from tests.support.builders import mlp_graph

#: what a board does not have: importing any of them raises ModuleNotFoundError in the child process
NOT_INSTALLED = ("torch", "pyro", "scipy")

RUNTIME_ONLY = """\
import json, sys

NOT_INSTALLED = {not_installed!r}


class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in NOT_INSTALLED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)


sys.meta_path.insert(0, NotInstalled())
import numpy as np
import pyro2pfp
from pyro2pfp.cli import load_predictor, main

lib, head_lib, onnx_path, x_path, out = sys.argv[1:]
x = np.load(x_path)
exe = pyro2pfp.load(lib)
mean, var = exe(x)                               # 3 rows: the batch-specialised executable
mean4, var4 = exe(np.concatenate([x, x[:1]]))    # 4 rows: the any-batch one
metrics = pyro2pfp.uncertainty(mean, var, num_samples=50, seed=0)
try:
    exe(x[0])
    shape_error = None
except pyro2pfp.InputShapeError as exc:
    shape_error = str(exc)
head = pyro2pfp.load(head_lib)(x)
from pyro2pfp.runtime.scoring import Scorer

scored = Scorer(lib, metrics=True)({{"id": np.arange(3), "x": x}})
onnx_mean, onnx_var = load_predictor(onnx_path)(x)
cli_predict = main(["predict", lib, x_path, "-o", out + ".cli.npz", "--show", "0"])
cli_inspect = main(["inspect", lib])
try:
    pyro2pfp.convert
    convert_error = None
except pyro2pfp.PFPError as exc:
    convert_error = str(exc)
imported = sorted({{m.partition(".")[0] for m in sys.modules}} & {{*NOT_INSTALLED, "tvm", "onnx"}})

import tvm  # the compiler, which profiling a predictor loaded without it needs

rows = len(exe.profile(x, repeats=1).rows)
np.savez(out, mean=mean, var=var, mean4=mean4, var4=var4, probs=head.probs,
         mutual_information=head.mutual_information, epistemic=metrics["epistemic"], onnx_mean=onnx_mean,
         onnx_var=onnx_var, scored_mean=scored["mean"], scored_epistemic=scored["epistemic"])
print(json.dumps({{"imported": imported, "specialised": exe.vm_for_batch(3) is not exe.vm,
                  "shape_error": shape_error, "convert_error": convert_error, "cli": [cli_predict, cli_inspect],
                  "profile_rows": rows}}))
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A small MLP exported with a batch-3 executable, the same MLP with the uncertainty head, its ONNX
    file, and three inputs."""
    tmp = tmp_path_factory.mktemp("runtime_only")
    graph = mlp_graph(np.random.default_rng(0), [12, 8, 3])
    net = PFPNetwork(graph, plan(graph))
    net.compile("llvm", batch_sizes=[3]).export_library(tmp / "mlp.so")
    net.to_onnx(tmp / "mlp.onnx")
    PFPNetwork(graph, plan(append_head(graph, "probs"))).compile("llvm").export_library(tmp / "head.so")
    x = np.random.default_rng(1).uniform(0, 1, (3, 12)).astype(np.float32)
    np.save(tmp / "x.npy", x)
    return tmp, x


@pytest.mark.slow
def test_a_board_without_torch_pyro_or_scipy_loads_predicts_and_checks(exported):
    """In a process where torch, Pyro and SciPy cannot be imported: ``pyro2pfp.load`` (with the
    batch-specialised executable the sidecar lists), calls, the input checks, ``uncertainty()``, a
    network with the uncertainty head, the dataset scorer, the ONNX predictor and the CLI's
    ``predict`` / ``inspect`` all work, without importing TVM's compiler either; the outputs are
    bit-identical to ``pyro2pfp.load`` in this process (the full package).  ``pyro2pfp.convert`` says
    what is missing.  Importing the compiler afterwards, the loaded predictor is profiled."""
    tmp, x = exported
    (tmp / "child.py").write_text(RUNTIME_ONLY.format(not_installed=NOT_INSTALLED))
    result = subprocess.run([sys.executable, str(tmp / "child.py"), str(tmp / "mlp.so"), str(tmp / "head.so"),
                             str(tmp / "mlp.onnx"), str(tmp / "x.npy"), str(tmp / "out")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["imported"] == ["onnx"]  # onnx for the .onnx file only: no torch, Pyro, SciPy or tvm
    assert report["specialised"] and report["cli"] == [0, 0] and report["profile_rows"] > 0
    assert "expected (batch, 12)" in report["shape_error"] or "x[None]" in report["shape_error"]
    assert "torch" in report["convert_error"] and "pyro2pfp.load" in report["convert_error"]
    assert "mlp.so: compiled pyro2pfp network" in result.stdout

    full = pyro2pfp.load(tmp / "mlp.so")
    with np.load(tmp / "out.npz") as out, np.load(tmp / "out.cli.npz") as cli:
        mean, var = full(x)
        for got, want in ((out["mean"], mean), (out["var"], var), (cli["mean"], mean), (cli["var"], var)):
            np.testing.assert_array_equal(got, want)
        mean4, var4 = full(np.concatenate([x, x[:1]]))
        np.testing.assert_array_equal(out["mean4"], mean4)
        np.testing.assert_array_equal(out["var4"], var4)
        np.testing.assert_array_equal(out["epistemic"],
                                      pyro2pfp.uncertainty(mean, var, num_samples=50, seed=0)["epistemic"])
        np.testing.assert_array_equal(out["scored_mean"], mean)
        from pyro2pfp.runtime.scoring import Scorer

        np.testing.assert_array_equal(out["scored_epistemic"], Scorer(tmp / "mlp.so", metrics=True)(x)["epistemic"])
        head = pyro2pfp.load(tmp / "head.so")(x)
        np.testing.assert_array_equal(out["probs"], head.probs)
        np.testing.assert_array_equal(out["mutual_information"], head.mutual_information)
        np.testing.assert_allclose(out["onnx_mean"], mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out["onnx_var"], var, rtol=1e-4, atol=1e-7)


@pytest.mark.slow
def test_importing_the_package_imports_no_converter():
    """``import pyro2pfp`` (and the CLI) imports neither torch, Pyro, SciPy nor TVM; ``pyro2pfp.convert``
    and the op registry come when first used, and ``pyro2pfp.diagnose`` is the function, as before."""
    code = ("import sys, pyro2pfp, pyro2pfp.cli\n"
            "print(sorted({m.partition('.')[0] for m in sys.modules} & {'torch', 'pyro', 'scipy', 'tvm', 'tvm_ffi'}))\n"
            "convert = pyro2pfp.convert\n"
            "from pyro2pfp.planning.registry import OPS\n"
            "from pyro2pfp.diagnosis import layer_fidelity\n"  # its module: pyro2pfp.diagnose stays the function
            "print(convert.__module__, 'torch' in sys.modules, 'dense' in OPS, pyro2pfp.diagnose.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["[]", "pyro2pfp.network True True diagnose"]
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
        pyro2pfp.no_such_thing  # noqa: B018
