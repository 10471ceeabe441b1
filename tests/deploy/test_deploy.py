"""Deployment: export_library / pyro2pfp.runtime.deploy.load round trips, cross-compilation for AArch64,
and (with qemu-user and the AArch64 TVM runtime) running the AArch64 library against x86.

Set-up needed for the AArch64 tests (Debian/Ubuntu; CI installs them):
    apt-get install -y gcc-aarch64-linux-gnu g++-aarch64-linux-gnu qemu-user debootstrap
The qemu test also needs the AArch64 TVM runtime: the two libraries ``libtvm_runtime.so`` and
``libtvm_ffi.so`` of the manylinux aarch64 wheels of the installed apache-tvm / apache-tvm-ffi
versions.  It looks in ``$PYRO2PFP_AARCH64_RUNTIME`` or ``~/.cache/pyro2pfp/``, and otherwise
fetches them once with ``pip download --platform manylinux_2_28_aarch64``.
``PYRO2PFP_SKIP_QEMU=1`` skips that one test (e.g. offline); nothing is skipped by default.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pyro
import pytest
import torch

import pyro2pfp
from pyro2pfp.backends.tvm.compile import compile_network
from pyro2pfp.errors import InputShapeError, PFPError
from pyro2pfp.network import PFPNetwork
from pyro2pfp.planning.plan import plan
from pyro2pfp.runtime import deploy
from pyro2pfp_experiments.zoo import BayesianLeNet5, make_guide
from tests.support.builders import mlp_graph

CROSS_GCC = "aarch64-linux-gnu-gcc"
APT_LINE = "apt-get install -y gcc-aarch64-linux-gnu g++-aarch64-linux-gnu qemu-user debootstrap"
EM_AARCH64, ET_REL, ET_DYN = 183, 1, 3


def elf_header(data: bytes) -> tuple[int, int, int]:
    """(EI_CLASS, e_type, e_machine) of an ELF file (little endian)."""
    assert data[:4] == b"\x7fELF", "not an ELF file"
    assert data[5] == 1, "not little endian"
    e_type, e_machine = struct.unpack_from("<HH", data, 16)
    return data[4], e_type, e_machine


def require(tool: str, package: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"'{tool}' is not installed; the AArch64 deployment tests need it. "
                    f"Install with: {APT_LINE}  (package {package})", pytrace=False)
    return path


@pytest.fixture(scope="module")
def lenet():
    """A converted Pyro LeNet-5 (AutoNormal posterior, σ ≈ 0.05), its x86 predictor and inputs."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = BayesianLeNet5()
    g = torch.Generator().manual_seed(0)
    x = torch.rand(5, 1, 28, 28, generator=g)
    guide = make_guide(model, init_scale=0.05)
    guide(x, torch.randint(0, 10, (5,), generator=g))
    net = pyro2pfp.convert(model, guide, input_shape=(1, 28, 28), calibration=0.5)
    exe = compile_network(net, "llvm")
    pyro.clear_param_store()
    return net, exe, x.numpy()


@pytest.fixture(scope="module")
def lenet_aarch64(lenet, tmp_path_factory):
    """The same LeNet-5 cross-compiled for AArch64, with a static-shape executable for the 5 test
    inputs (``batch_sizes=[5]``), exported as shared libraries (``lenet_a64.so``,
    ``lenet_a64.batch5.so``); its kernels compiled on three threads (several LLVM modules, linked
    into the one library) on any machine."""
    require(CROSS_GCC, "gcc-aarch64-linux-gnu")
    net = lenet[0]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYRO2PFP_BUILD_JOBS", "3")
        exe = net.compile("aarch64", batch_sizes=[len(lenet[2])])
    path = tmp_path_factory.mktemp("a64") / "lenet_a64.so"
    exe.export_library(path)
    return exe, path


@pytest.fixture(scope="module")
def sf_resnet():
    """A small Bayesian ResNet (the zoo's, widths 4 and 8, 3x16x16 inputs) whose default plan is
    shared factors (He-scale posterior, sd 0.05), its mean-field twin, and three inputs."""
    from pyro2pfp_experiments.zoo import bayesian_resnet, he_posterior

    torch.manual_seed(0)
    model = bayesian_resnet(blocks=1, widths=(4, 8))
    x = np.random.default_rng(1).standard_normal((3, 3, 16, 16)).astype(np.float32)
    guide = he_posterior(model, torch.as_tensor(x), scale=0.05, seed=0)
    net = pyro2pfp.convert(model, guide, input_shape=(3, 16, 16))
    assert net.plan.correlation == "shared-factor"
    # the mean-field twin is wrong on purpose (its logit variances are ~2x too small): the spot check refuses it
    with pytest.raises(pyro2pfp.FidelityError, match="variance ratio"):
        pyro2pfp.convert(model, guide, input_shape=(3, 16, 16), correlation="mean-field")
    mean_field = pyro2pfp.convert(model, guide, input_shape=(3, 16, 16), correlation="mean-field", check=False)
    return net, mean_field, x


def assert_shared_factor_outputs(mean: np.ndarray, var: np.ndarray, sf_resnet) -> None:
    """``(mean, var)`` are the shared-factor reference's to float32 rounding, and the scheme matters on
    this net: the mean-field variances are far off (else this check could not tell the two apart)."""
    net, mean_field, x = sf_resnet
    ref_mean, ref_var = net.reference(x)
    for got, want in ((mean, ref_mean), (var, ref_var)):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
    assert np.median(ref_var / mean_field.reference(x)[1]) > 1.5


# ---------------------------------------------------------------------------------------------
# Export and load on this machine
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("ext", [".so", ".tar"])
def test_lenet_export_load_rerun_identical(lenet, tmp_path, ext):
    net, exe, x = lenet
    mean, var = exe(x)
    path = tmp_path / f"lenet{ext}"
    assert exe.export_library(path) == str(path)
    meta = json.loads((tmp_path / f"lenet{ext}.json").read_text())
    assert meta["input_shape"] == [1, 28, 28] and meta["input_variance"] is False
    assert meta["target_arch"] == deploy.host_arch() and meta["inputs"] == ["x"]

    loaded = deploy.load(path)
    assert loaded.input_shape == (1, 28, 28) and loaded.input_variance is False and loaded.runnable
    mean2, var2 = loaded(x)
    np.testing.assert_array_equal(mean2, mean)  # the same code: bit-identical outputs
    np.testing.assert_array_equal(var2, var)
    for batch in (1, 3):  # dynamic batch survives export
        m, v = loaded(x[:batch])
        np.testing.assert_array_equal(m, mean[:batch])
    # the loaded predictor keeps the input validation of the compiled one
    with pytest.raises(InputShapeError, match=r"x\[None\]"):
        loaded(x[0])
    with pytest.raises(InputShapeError, match="expected"):
        loaded(np.zeros((2, 1, 28, 27), np.float32))
    with pytest.raises(InputShapeError, match="NaN"):
        loaded(np.full((1, 1, 28, 28), np.nan, np.float32))
    # and still agrees with the float64 reference
    ref_mean, ref_var = net.reference(x)
    np.testing.assert_allclose(mean2, ref_mean, rtol=1e-4, atol=1e-4 * np.abs(ref_mean).max())
    np.testing.assert_allclose(var2, ref_var, rtol=1e-3, atol=1e-4 * np.abs(ref_var).max())


def test_input_variance_flag_survives_export(tmp_path):
    graph = mlp_graph(np.random.default_rng(0), [12, 8, 3])
    graph.input_variance = True
    net = PFPNetwork(graph, plan(graph))
    exe = compile_network(net, "llvm")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 12)).astype(np.float32)
    xv = rng.uniform(0, 0.1, x.shape).astype(np.float32)
    exe.export_library(tmp_path / "mlp.so")
    loaded = pyro2pfp.runtime.deploy.load(tmp_path / "mlp.so")
    assert loaded.input_variance
    for a, b in zip(loaded(x, xv), exe(x, xv)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(pyro2pfp.InputShapeError, match="x_var"):
        loaded(x)


LOAD_IN_A_NEW_PROCESS = """\
import json, sys
import numpy as np
import tvm
import pyro2pfp

path, x_path, out_path = sys.argv[1:4]
x = np.load(x_path)
exe = pyro2pfp.load(path)
mean, var = exe(x)
static = exe.vm_for_batch(x.shape[0])
try:  # a static-shape executable takes exactly its batch size
    static["main"](tvm.runtime.tensor(np.zeros((x.shape[0] + 1, *x.shape[1:]), np.float32)))
    takes_other_sizes = True
except Exception:
    takes_other_sizes = False
np.savez(out_path, mean=mean, var=var, mean4=exe(np.concatenate([x, x[:1]]))[0])
print(json.dumps({"tuned": sorted(exe.tuned), "specialised": static is not exe.vm,
                  "takes_other_sizes": takes_other_sizes}))
"""


def _load_in_a_new_process(tmp_path: Path, path: Path, x: np.ndarray) -> tuple[dict, dict]:
    """Run :data:`LOAD_IN_A_NEW_PROCESS` on library ``path`` and input ``x``: (its JSON report, its outputs)."""
    np.save(tmp_path / "x.npy", x)
    (tmp_path / "load.py").write_text(LOAD_IN_A_NEW_PROCESS)
    result = subprocess.run([sys.executable, str(tmp_path / "load.py"), str(path), str(tmp_path / "x.npy"),
                             str(tmp_path / "out.npz")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    with np.load(tmp_path / "out.npz") as out:
        return json.loads(result.stdout.strip().splitlines()[-1]), dict(out)


@pytest.mark.slow
def test_shared_factor_resnet_survives_export_and_load_in_a_new_process(sf_resnet, tmp_path):
    """The default plan of a ResNet (shared factors: kernels with scalar factor-width arguments, the
    hand-written Cholesky TIR) exported and loaded by ``pyro2pfp.load`` in a fresh process, as users
    deploy: bit-identical to the compiling process's predictor, equal to the float64 reference to
    float32 rounding -- and not the mean-field network (whose logit variances are ~2x smaller here),
    so a library that lost the scheme's kernels would fail.  (Static-batch executables of the scheme:
    ``test_correlation_backends``; their export: the MLP test below -- one compile here keeps it short.)"""
    net, _, x = sf_resnet
    exe = net.compile("native")
    path = tmp_path / "resnet.so"
    exe.export_library(path)
    report, out = _load_in_a_new_process(tmp_path, path, x)
    assert report == {"tuned": [], "specialised": False, "takes_other_sizes": True}
    mean, var = exe(x)
    np.testing.assert_array_equal(out["mean"], mean)
    np.testing.assert_array_equal(out["var"], var)
    np.testing.assert_array_equal(out["mean4"], exe(np.concatenate([x, x[:1]]))[0])
    assert_shared_factor_outputs(out["mean"], out["var"], sf_resnet)


@pytest.mark.slow
def test_batch_specialised_executable_survives_export_and_load_in_a_new_process(tmp_path):
    """``compile(batch_sizes=[3])`` → ``export_library`` writes ``mlp.batch3.so`` next to ``mlp.so``
    and lists it (name, sha256) in the sidecar; ``pyro2pfp.load`` in a fresh process gives back a
    predictor whose batch-3 calls run that static executable (it refuses other sizes, unlike the
    any-batch one), with outputs bit-identical to the compiling process's.  A missing or altered
    extra file is a LoadError naming it; a sidecar without the key (older exports) still loads."""
    from pyro2pfp.errors import LoadError

    graph = mlp_graph(np.random.default_rng(0), [12, 8, 3])
    net = PFPNetwork(graph, plan(graph))
    exe = net.compile("native", batch_sizes=[3])
    path = tmp_path / "mlp.so"
    exe.export_library(path)
    extra = tmp_path / "mlp.batch3.so"
    meta = json.loads(Path(f"{path}.json").read_text())
    assert meta["batch_executables"] == {"3": {"library": "mlp.batch3.so",
                                               "sha256": hashlib.sha256(extra.read_bytes()).hexdigest()}}
    assert elf_header(extra.read_bytes()[:64])[1] == ET_DYN

    x = np.random.default_rng(1).standard_normal((3, 12)).astype(np.float32)
    report, out = _load_in_a_new_process(tmp_path, path, x)
    assert report == {"tuned": [3], "specialised": True, "takes_other_sizes": False}
    mean, var = exe(x)
    assert exe.vm_for_batch(3) is not exe.vm
    np.testing.assert_array_equal(out["mean"], mean)  # the same static executable: bit-identical
    np.testing.assert_array_equal(out["var"], var)
    np.testing.assert_array_equal(out["mean4"], exe(np.concatenate([x, x[:1]]))[0])  # 4 rows: any-batch
    ref_mean, _ = net.reference(x)
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-4, atol=1e-5 * np.abs(ref_mean).max())
    exe.export_library(tmp_path / "mlp.tar")  # object files, linked by load: the same for the extra one
    with tarfile.open(tmp_path / "mlp.batch3.tar") as tar:
        assert any(m.name.endswith(".o") for m in tar.getmembers())
    from_tar = pyro2pfp.load(tmp_path / "mlp.tar")
    assert sorted(from_tar.tuned) == [3] and from_tar.vm_for_batch(3) is not from_tar.vm
    np.testing.assert_array_equal(from_tar(x)[0], mean)

    # the extra file is checked like the library: missing, altered, or outside the sidecar's directory
    def copy_set(name: str, edit=None) -> Path:
        """The three files under new names (never overwrite a loaded .so), the sidecar edited."""
        lib, batch_lib = tmp_path / f"{name}.so", tmp_path / f"{name}.batch3.so"
        shutil.copy(path, lib)
        shutil.copy(extra, batch_lib)
        info = json.loads(Path(f"{path}.json").read_text())
        info["batch_executables"]["3"]["library"] = batch_lib.name
        if edit:
            edit(info, batch_lib)
        Path(f"{lib}.json").write_text(json.dumps(info))
        return lib

    missing = copy_set("missing", lambda info, f: f.unlink())
    with pytest.raises(LoadError, match=r"missing\.batch3\.so not found.*batch 3"):
        pyro2pfp.load(missing)
    altered = copy_set("altered", lambda info, f: f.write_bytes(f.read_bytes() + b"\0"))
    with pytest.raises(LoadError, match=r"altered\.batch3\.so is not the batch-3 library.*sha256 mismatch"):
        pyro2pfp.load(altered)
    swapped = copy_set("swapped", lambda info, f: shutil.copy(path, f))  # the any-batch library in its place
    with pytest.raises(LoadError, match=r"swapped\.batch3\.so.*sha256 mismatch"):
        pyro2pfp.load(swapped)
    with pytest.warns(UserWarning, match="sha256 mismatch"):  # accepted when told, and then checked by a call
        assert sorted(pyro2pfp.load(swapped, verify_sha256=False).tuned) == [3]
    # a TVM library that is no Relax executable in the batch slot: the error names that file, not mlp.so
    import tvm
    from tvm.script import tirx as T

    @T.prim_func
    def plain(a: T.Buffer((4,), "float32")):
        for i in range(4):
            a[i] = T.float32(0)

    not_relax = tmp_path / "plain.so"
    tvm.compile(plain, target="llvm").export_library(str(not_relax))
    foreign = copy_set("foreign", lambda info, f: (shutil.copy(not_relax, f), info["batch_executables"]["3"].update(
        sha256=hashlib.sha256(f.read_bytes()).hexdigest())))
    with pytest.raises(LoadError, match=r"foreign\.batch3\.so \(the batch-3 executable .*\) is not a Relax executable"):
        pyro2pfp.load(foreign)
    elsewhere = copy_set("elsewhere", lambda info, f: info["batch_executables"]["3"].update(
        library=str(tmp_path / "mlp.batch3.so")))
    with pytest.raises(LoadError, match="must be a file name in the metadata file's directory"):
        pyro2pfp.load(elsewhere)
    # re-exporting to the same path with fewer batch sizes removes the earlier export's extra library
    # (and only it: a file the sidecar never listed stays)
    net.compile("native", batch_sizes=[3, 5]).export_library(tmp_path / "again.so")
    assert (tmp_path / "again.batch5.so").is_file()
    (tmp_path / "again.batch7.so").write_bytes(b"not ours")
    exe.export_library(tmp_path / "again.so")
    assert not (tmp_path / "again.batch5.so").exists() and (tmp_path / "again.batch3.so").is_file()
    assert (tmp_path / "again.batch7.so").read_bytes() == b"not ours"
    assert sorted(pyro2pfp.load(tmp_path / "again.so").tuned) == [3]
    old = copy_set("old", lambda info, f: info.pop("batch_executables"))  # a sidecar from before the key
    loaded = pyro2pfp.load(old)
    assert loaded.tuned == {} and loaded.vm_for_batch(3) is loaded.vm
    np.testing.assert_allclose(loaded(x)[0], mean, rtol=1e-5, atol=1e-6 * np.abs(mean).max())


@pytest.mark.slow
def test_load_errors_are_clear(lenet, tmp_path):
    _, exe, x = lenet
    with pytest.raises(FileNotFoundError, match="no such library"):
        deploy.load(tmp_path / "missing.so")
    path = tmp_path / "net.so"
    exe.export_library(path)
    os.rename(f"{path}.json", tmp_path / "elsewhere.json")
    with pytest.raises(PFPError, match=r"net\.so\.json not found.*export_library"):
        deploy.load(path)
    loaded = deploy.load(path, input_shape=(1, 28, 28), input_variance=False)  # explicit metadata
    np.testing.assert_array_equal(loaded(x)[0], exe(x)[0])
    with pytest.raises(PFPError, match=r"must end in \.so .* or \.tar"):
        exe.export_library(tmp_path / "net.dll")
    with pytest.raises(PFPError, match="does not exist"):
        exe.export_library(tmp_path / "no" / "net.so")
    (tmp_path / "junk.so").write_bytes(b"not a library")
    (tmp_path / "junk.so.json").write_text(json.dumps({"format": deploy.FORMAT, "input_shape": [1],
                                                       "input_variance": False}))
    with pytest.raises(PFPError, match="cannot load"):
        deploy.load(tmp_path / "junk.so")


def test_targets_and_presets():
    assert deploy.target_arch("llvm") == deploy.host_arch()
    assert not deploy.is_cross_target("llvm") and not deploy.is_cross_target("native")
    a64 = deploy.resolve_target("aarch64")
    assert a64.attrs["mtriple"] == "aarch64-linux-gnu" and "+neon" in list(a64.attrs["mattr"])
    cpus = {name: str(deploy.resolve_target(name).attrs.get("mcpu")) for name in ("rpi3", "rpi4", "rpi5")}
    assert cpus == {"rpi3": "cortex-a53", "rpi4": "cortex-a72", "rpi5": "cortex-a76"}
    assert deploy.is_cross_target("rpi4") == (deploy.host_arch() != "aarch64")
    assert deploy.target_arch("raspberry-pi/4b-aarch64") == "aarch64"  # a TVM tag directly
    assert deploy.target_arch('{"kind": "llvm", "mtriple": "aarch64-linux-gnu"}') == "aarch64"
    with pytest.raises(PFPError, match="JSON dict"):
        deploy.resolve_target("llvm -mcpu=cortex-a72")
    with pytest.raises(PFPError, match="preset"):
        deploy.resolve_target("raspberry-pi-9000")


# ---------------------------------------------------------------------------------------------
# Cross-compilation for AArch64
# ---------------------------------------------------------------------------------------------


@pytest.mark.board
def test_aarch64_library_is_an_aarch64_elf_shared_object_with_neon(lenet, lenet_aarch64, tmp_path):
    _, _, x = lenet
    exe, path = lenet_aarch64
    assert not exe.runnable
    data = Path(path).read_bytes()
    assert elf_header(data) == (2, ET_DYN, EM_AARCH64)  # ELFCLASS64, shared object, AArch64
    meta = json.loads(Path(f"{path}.json").read_text())
    assert meta["target_arch"] == "aarch64" and meta["input_shape"] == [1, 28, 28]
    assert meta["sha256"] == hashlib.sha256(data).hexdigest()
    static = Path(path).with_name("lenet_a64.batch5.so")  # the batch_sizes=[5] executable
    assert meta["batch_executables"] == {"5": {"library": static.name,
                                               "sha256": hashlib.sha256(static.read_bytes()).hexdigest()}}
    assert elf_header(static.read_bytes()[:64]) == (2, ET_DYN, EM_AARCH64)
    objdump = shutil.which("aarch64-linux-gnu-objdump")
    if objdump:  # binutils-aarch64-linux-gnu comes with the cross gcc
        dis = subprocess.run([objdump, "-d", str(path)], capture_output=True, text=True, check=True).stdout
        assert dis.count(".4s") > 50, "no NEON (Advanced SIMD) float32x4 instructions found"
    # it cannot run here, and says so
    with pytest.raises(PFPError, match="compiled for aarch64"):
        exe(x)
    if deploy.host_arch() != "aarch64":
        with pytest.raises(PFPError, match="compiled for aarch64"):
            deploy.load(path)
    # .tar: object files only, no toolchain needed
    exe.export_library(tmp_path / "lenet_a64.tar")
    with tarfile.open(tmp_path / "lenet_a64.tar") as tar:
        objects = [m for m in tar.getmembers() if m.name.endswith(".o")]
        assert len(objects) >= 3  # one per part the kernels were compiled in (PYRO2PFP_BUILD_JOBS=3)
        for member in objects:
            assert elf_header(tar.extractfile(member).read(64)) == (2, ET_REL, EM_AARCH64)


@pytest.mark.board
def test_board_preset_compiles_with_tvm_tag(tmp_path):
    require(CROSS_GCC, "gcc-aarch64-linux-gnu")
    graph = mlp_graph(np.random.default_rng(0), [16, 8, 4])
    exe = compile_network(PFPNetwork(graph, plan(graph)), "rpi4")
    assert str(exe.target.attrs["mcpu"]) == "cortex-a72"
    exe.export_library(tmp_path / "mlp_rpi4.so")
    assert elf_header((tmp_path / "mlp_rpi4.so").read_bytes()[:64]) == (2, ET_DYN, EM_AARCH64)


@pytest.mark.board
def test_missing_cross_compiler_message(lenet_aarch64, tmp_path, monkeypatch):
    exe, _ = lenet_aarch64
    monkeypatch.setenv("PYRO2PFP_CROSS_CC", "no-such-aarch64-gcc")
    with pytest.raises(PFPError, match=r"apt-get install|export a \.tar"):
        exe.export_library(tmp_path / "x.so")


# ---------------------------------------------------------------------------------------------
# Run the AArch64 library under qemu-user with the AArch64 TVM runtime; compare with x86
# ---------------------------------------------------------------------------------------------

RUNNER_SOURCE = r"""
// Minimal C++ driver: load an exported pyro2pfp library with the TVM runtime and run main().
// usage: pfp_run LIB.so OUT_PREFIX SHAPE(comma separated, incl. batch) X.bin [XVAR.bin]
// Writes OUT_PREFIX.mean.bin and OUT_PREFIX.var.bin (raw float32).
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

namespace ffi = tvm::ffi;

struct CPUAlloc {
  void AllocData(DLTensor* t) { t->data = std::aligned_alloc(64, (ffi::GetDataSize(*t) + 63) / 64 * 64); }
  void FreeData(DLTensor* t) { std::free(t->data); }
};

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s LIB OUT_PREFIX SHAPE X.bin [XVAR.bin]\n", argv[0]);
    return 2;
  }
  std::vector<int64_t> shape;
  std::stringstream ss(argv[3]);
  for (std::string tok; std::getline(ss, tok, ',');) shape.push_back(std::stoll(tok));
  DLDevice dev{kDLCPU, 0};
  DLDataType f32{kDLFloat, 32, 1};
  ffi::Module lib = ffi::Module::LoadFromFile(argv[1]);
  ffi::Module vm = lib->GetFunction("vm_load_executable").value()().cast<ffi::Module>();
  vm->GetFunction("vm_initialization").value()(static_cast<int>(kDLCPU), 0, 2);  // CPU 0, pooled
  ffi::Function main_fn = vm->GetFunction("main").value();
  std::vector<ffi::Tensor> inputs;
  for (int i = 4; i < argc; ++i) {
    std::ifstream f(argv[i], std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    ffi::Tensor t = ffi::Tensor::FromNDAlloc(CPUAlloc(), ffi::Shape(shape), f32, dev);
    if (bytes.size() != ffi::GetDataSize(*t.GetDLTensorPtr())) {
      std::fprintf(stderr, "%s: %zu bytes, expected %zu\n", argv[i], bytes.size(),
                   ffi::GetDataSize(*t.GetDLTensorPtr()));
      return 1;
    }
    std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
    inputs.push_back(t);
  }
  ffi::Any out = inputs.size() == 1 ? main_fn(inputs[0]) : main_fn(inputs[0], inputs[1]);
  auto outs = out.cast<ffi::Array<ffi::Tensor>>();
  const char* names[2] = {"mean", "var"};
  for (int i = 0; i < 2; ++i) {
    ffi::Tensor t = outs[i];
    std::ofstream f(std::string(argv[2]) + "." + names[i] + ".bin", std::ios::binary);
    f.write(static_cast<const char*>(t.data_ptr()), ffi::GetDataSize(*t.GetDLTensorPtr()));
  }
  std::printf("pfp_run: ok, %zu outputs\n", outs.size());
  return 0;
}
"""


def aarch64_tvm_runtime() -> Path:
    """A directory with the AArch64 libtvm_runtime.so and libtvm_ffi.so of the installed versions
    (:func:`pyro2pfp_experiments.emulated_board.aarch64_runtime`: the cache the emulated RPC board
    of tests/deploy/test_remote_aarch64.py uses too)."""
    from pyro2pfp_experiments.emulated_board import EmulatedBoardError, aarch64_runtime

    try:
        return aarch64_runtime()
    except EmulatedBoardError as err:
        pytest.fail(f"{err}\nOr PYRO2PFP_SKIP_QEMU=1 to skip this test.", pytrace=False)


def build_runner(runtime: Path, workdir: Path) -> Path:
    import tvm_ffi

    gxx = require("aarch64-linux-gnu-g++", "g++-aarch64-linux-gnu")
    ffi_root = Path(tvm_ffi.__file__).parent
    source = workdir / "pfp_run.cc"
    source.write_text(RUNNER_SOURCE)
    exe = workdir / "pfp_run"
    cmd = [gxx, "-std=c++17", "-O1", str(source), "-o", str(exe),
           f"-I{ffi_root / 'include'}", f"-I{ffi_root / '3rdparty' / 'dlpack' / 'include'}",
           f"-L{runtime}", "-Wl,--no-as-needed", "-ltvm_runtime", "-ltvm_ffi", f"-Wl,-rpath-link,{runtime}"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return exe


@pytest.fixture(scope="module")
def qemu(tmp_path_factory):
    """``run(library, x) -> (mean, var)``: an exported AArch64 library run on ``x`` under qemu-user
    (Cortex-A72) by the C++ driver with the AArch64 TVM runtime (built once per module)."""
    if os.environ.get("PYRO2PFP_SKIP_QEMU") == "1":
        pytest.skip("PYRO2PFP_SKIP_QEMU=1")
    if deploy.host_arch() == "aarch64":
        pytest.skip("running natively on aarch64: covered by the export/load tests")
    qemu_bin = require("qemu-aarch64", "qemu-user")
    require(CROSS_GCC, "gcc-aarch64-linux-gnu")
    workdir = tmp_path_factory.mktemp("qemu")
    runtime = aarch64_tvm_runtime()
    runner = build_runner(runtime, workdir)
    env = dict(os.environ, QEMU_LD_PREFIX="/usr/aarch64-linux-gnu", LD_LIBRARY_PATH=str(runtime))
    calls = itertools.count()

    def run(library: Path, x: np.ndarray, check: bool = True) -> tuple[np.ndarray, np.ndarray] | None:
        """The library's flat (mean, var) outputs; with ``check=False`` None if the run failed and wrote
        nothing (a failed run that wrote outputs is an error either way)."""
        out = workdir / f"out{next(calls)}"
        x.astype(np.float32).tofile(f"{out}.x.bin")
        result = subprocess.run([qemu_bin, "-cpu", "cortex-a72", str(runner), str(library), str(out),
                                 ",".join(map(str, x.shape)), f"{out}.x.bin"],
                                env=env, capture_output=True, text=True, timeout=300, cwd=workdir)
        wrote = Path(f"{out}.mean.bin").exists()
        if result.returncode != 0 and not check:
            assert not wrote, f"{library.name} failed after writing outputs"
            return None
        assert result.returncode == 0, f"{library.name}: {result.stderr[-2000:]}"
        return np.fromfile(f"{out}.mean.bin", dtype=np.float32), np.fromfile(f"{out}.var.bin", dtype=np.float32)

    return run


@pytest.mark.board
def test_aarch64_library_runs_under_qemu_and_matches_x86(lenet, lenet_aarch64, qemu):
    _, exe_x86, x = lenet
    _, path = lenet_aarch64
    mean, var = exe_x86(x)
    # the any-batch library and the static batch-5 one (batch_sizes=[5]) exported next to it
    for library in (Path(path), Path(path).with_name("lenet_a64.batch5.so")):
        mean_a64, var_a64 = (a.reshape(mean.shape) for a in qemu(library, x))
        # same network, another ISA (FMA contraction, other vector widths): float32 rounding apart
        np.testing.assert_allclose(mean_a64, mean, rtol=1e-5, atol=1e-5 * np.abs(mean).max())
        np.testing.assert_allclose(var_a64, var, rtol=1e-4, atol=1e-5 * np.abs(var).max())
    # the static library takes exactly 5 rows: it really is the batch-specialised executable
    assert qemu(Path(path).with_name("lenet_a64.batch5.so"), x[:4], check=False) is None


BOARD_PYTHON_SCRIPT = """\
import json, platform, sys
import numpy as np
import pyro2pfp

lib, x_path, out = sys.argv[1:]
x = np.load(x_path)
exe = pyro2pfp.load(lib)
mean, var = exe(x)            # 5 rows: the batch-5 executable the sidecar lists
mean4, var4 = exe(x[:4])      # the any-batch one
np.savez(out, mean=mean, var=var, mean4=mean4, var4=var4)
print(json.dumps({"machine": platform.machine(), "specialised": exe.vm_for_batch(len(x)) is not exe.vm,
                  "imported": sorted({m.partition(".")[0] for m in sys.modules} & {"torch", "pyro", "scipy", "tvm"})}))
"""


@pytest.mark.board
def test_pyro2pfp_load_in_an_aarch64_python_matches_x86(lenet, lenet_aarch64, tmp_path):
    """The board's Python route: ``pyro2pfp.load`` + predict in an AArch64 CPython under qemu-user
    (Cortex-A72) that has only NumPy and the TVM runtime wheels (manylinux aarch64) installed -- no
    torch, Pyro or SciPy (:mod:`pyro2pfp_experiments.board_python`) -- on the cross-compiled LeNet and
    its batch-5 executable, against the x86 predictor to float32 rounding."""
    if os.environ.get("PYRO2PFP_SKIP_QEMU") == "1":
        pytest.skip("PYRO2PFP_SKIP_QEMU=1")
    if deploy.host_arch() == "aarch64":
        pytest.skip("running natively on aarch64: covered by the export/load tests")
    from pyro2pfp_experiments.board_python import BoardPythonError, run

    _, exe_x86, x = lenet
    _, path = lenet_aarch64
    np.save(tmp_path / "x.npy", x)
    (tmp_path / "board.py").write_text(BOARD_PYTHON_SCRIPT)
    try:
        result = run([str(tmp_path / "board.py"), str(path), str(tmp_path / "x.npy"), str(tmp_path / "out.npz")],
                     pythonpath=(str(Path(pyro2pfp.__file__).resolve().parents[1]),))
    except BoardPythonError as err:
        pytest.fail(f"{err}\nOr PYRO2PFP_SKIP_QEMU=1 to skip this test.", pytrace=False)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"machine": "aarch64", "specialised": True, "imported": []}
    with np.load(tmp_path / "out.npz") as out:
        for rows, suffix in ((x, ""), (x[:4], "4")):
            mean, var = exe_x86(rows)
            # same network, another ISA (FMA contraction, other vector widths): float32 rounding apart
            np.testing.assert_allclose(out["mean" + suffix], mean, rtol=1e-5, atol=1e-5 * np.abs(mean).max())
            np.testing.assert_allclose(out["var" + suffix], var, rtol=1e-4, atol=1e-5 * np.abs(var).max())


@pytest.mark.board
def test_shared_factor_resnet_for_aarch64_runs_under_qemu(sf_resnet, qemu, tmp_path):
    """The shared-factor plan cross-compiled for AArch64 (NEON: 4 lanes where the factor axis is
    padded to 16 columns; the float64 Cholesky TIR) runs under qemu and gives the float64 reference's
    moments to float32 rounding -- not the mean-field ones."""
    net, _, x = sf_resnet
    require(CROSS_GCC, "gcc-aarch64-linux-gnu")
    net.compile("aarch64").export_library(tmp_path / "resnet_a64.so")
    mean, var = qemu(tmp_path / "resnet_a64.so", x)
    assert_shared_factor_outputs(mean.reshape(len(x), -1), var.reshape(len(x), -1), sf_resnet)
