"""An emulated AArch64 board over TVM RPC: a tracker on 127.0.0.1 and one board registered under
``qemu-a72`` whose sessions run in the AArch64 TVM runtime under ``qemu-aarch64 -cpu cortex-a72``
(:mod:`pyro2pfp_experiments.emulated_board`).  Networks cross-compiled for the Raspberry Pi 4
(``net.compile("rpi4")``) are uploaded, run, timed and validated against the float64 reference
through ``pyro2pfp.runtime.remote`` and the CLI, and tuned with MetaSchedule's ``RPCRunner`` measuring on the
board, as on a real Pi.  An x86 library is refused by the board (it really is AArch64); a session
past its timeout is ended (its AArch64 process too) and the board serves on; a board whose starting
process is killed stops by itself.

Needs what ``tests/deploy/test_deploy.py``'s qemu test needs: ``apt-get install -y gcc-aarch64-linux-gnu
g++-aarch64-linux-gnu qemu-user`` and the AArch64 TVM runtime (fetched once with ``pip download``
into ``~/.cache/pyro2pfp/``); ``PYRO2PFP_SKIP_QEMU=1`` skips this module (e.g. offline).  Every wait
is bounded; the tracker and the board (with any session it serves) are killed at the end.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from pyro2pfp.backends.tvm import tuning
from pyro2pfp.backends.tvm.tuning import measure
from pyro2pfp.errors import InputShapeError, PFPError, RemoteError
from pyro2pfp.network import PFPNetwork
from pyro2pfp.planning.plan import plan
from pyro2pfp.runtime.remote import Remote, fixed_inputs, upload, validate
from tests.deploy.test_remote import _kill, free_port, spawn
from tests.support.builders import lenet_graph, mlp_graph

pytestmark = [pytest.mark.board,
              pytest.mark.skipif(os.environ.get("PYRO2PFP_SKIP_QEMU") == "1", reason="PYRO2PFP_SKIP_QEMU=1")]

KEY = "qemu-a72"
START_TIMEOUT = 120.0  # python -m tvm.exec.* imports TVM: slow on a loaded 2-core machine


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """A TVM tracker and the emulated AArch64 board registered under ``qemu-a72`` (an EmulatedBoard)."""
    from pyro2pfp_experiments.emulated_board import EmulatedBoard, EmulatedBoardError

    log = tmp_path_factory.mktemp("board") / "board.log"
    port = free_port()
    tracker = spawn([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(port),
                     "--port-end", str(port + 1), "--silent"])
    emulated = EmulatedBoard(tracker=("127.0.0.1", port), key=KEY, log=log, start_timeout=START_TIMEOUT,
                             session_timeout=90, connect_timeout=10)
    try:
        try:
            emulated.start()
        except EmulatedBoardError as err:
            pytest.fail(f"{err}\n--- board log ---\n{log.read_text() if log.exists() else ''}", pytrace=False)
        yield emulated
    finally:
        emulated.stop()
        _kill([tracker])


@pytest.fixture(scope="module")
def direct(tmp_path_factory):
    """A second emulated board, without a tracker: its Remote is the server itself (``127.0.0.1:<port>``)."""
    from pyro2pfp_experiments.emulated_board import EmulatedBoard, EmulatedBoardError

    log = tmp_path_factory.mktemp("direct") / "board.log"
    emulated = EmulatedBoard(log=log, start_timeout=START_TIMEOUT, session_timeout=90, connect_timeout=10)
    try:
        try:
            emulated.start()
        except EmulatedBoardError as err:
            pytest.fail(f"{err}\n--- board log ---\n{log.read_text() if log.exists() else ''}", pytrace=False)
        yield emulated.remote
    finally:
        emulated.stop()


@pytest.fixture(scope="module")
def board(emulated):
    """The board through the tracker: ``127.0.0.1:<tracker port>/qemu-a72``."""
    return emulated.remote


@pytest.fixture(scope="module")
def mlp():
    graph = mlp_graph(np.random.default_rng(0), [16, 8, 4])
    net = PFPNetwork(graph, plan(graph), fuse=False)
    return net, net.compile("llvm"), net.compile("rpi4")


def test_cross_compiled_net_runs_on_the_emulated_board(board, direct, mlp):
    net, exe_x86, exe_a64 = mlp
    assert not exe_a64.runnable and str(exe_a64.target.attrs["mcpu"]) == "cortex-a72"
    x = fixed_inputs(net.input_shape, 10, seed=3)
    mean, var = upload(exe_a64, board)(x)
    want_mean, want_var = exe_x86(x)
    # the same network compiled for another ISA (NEON, FMA contraction): float32 rounding apart
    np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-6 * np.abs(want_mean).max())
    np.testing.assert_allclose(var, want_var, rtol=1e-4, atol=1e-6 * np.abs(want_var).max())
    ref_mean, ref_var = net.reference(x)
    assert np.abs(mean - ref_mean).max() < 1e-5 * np.abs(ref_mean).max()
    report = validate(net, exe_a64, board, count=16)
    assert report.ok and report.inputs == 16 and report.remote == f"127.0.0.1:{board.port}/{KEY}"
    assert max(report.max_rel_error_mean, report.max_rel_error_var) < 1e-5
    # several sessions in a row on one server, directly (no tracker queue): each session is closed
    # when done, else the next connection would not be answered within connect_timeout
    assert direct.key is None
    timing = exe_a64.profile(x, remote=direct, repeats=3)
    assert timing.batch == 10 and timing.repeats == 3 and 0 < timing.min_ms <= timing.median_ms
    again = validate(net, exe_a64, direct, count=16)
    assert again.max_abs_error_mean == report.max_abs_error_mean  # the same library, the same inputs
    assert upload(exe_a64, direct)(x)[0].shape == mean.shape


def test_the_board_is_aarch64_and_refuses_an_x86_library(board, mlp):
    net, exe_x86, exe_a64 = mlp
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match="loading the library on the board.*compiled for x86_64"):
        upload(exe_x86, board)
    assert time.monotonic() - t0 < 60
    assert validate(net, exe_a64, board, count=4).ok  # the failed session did not keep the board busy


def test_conv_net_with_input_variance_on_the_emulated_board(board):
    graph = lenet_graph(np.random.default_rng(1), widths=(3, 4, 12, 8), image=12)
    graph.input_variance = True
    net = PFPNetwork(graph, plan(graph))
    exe_a64 = net.compile("rpi4")
    report = validate(net, exe_a64, board, count=8)  # x_var = 1e-2 everywhere (pyro2pfp.runtime.remote.validate)
    assert report.ok, str(report)
    x = fixed_inputs(net.input_shape, 3, seed=7)
    x_var = np.full_like(x, 0.05)
    got = upload(exe_a64, board)(x, x_var)
    for g, w in zip(got, net.reference(x, x_var)):
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-5 * np.abs(w).max())
    with pytest.raises(InputShapeError, match="x_var"):  # checked here, before anything is sent
        upload(exe_a64, board)(x)


BUILDER = """\
from pyro2pfp_experiments.zoo import BayesianMLP, make_guide

def build():
    import torch

    model = BayesianMLP(6, (5,), 3)
    guide = make_guide(model, init_scale=0.02)
    guide(torch.zeros(2, 6), torch.zeros(2, dtype=torch.long))  # initialise the posterior
    return model, guide
"""


def test_cli_validate_and_bench_for_rpi4_on_the_emulated_board(board, tmp_path, capsys):
    from pyro2pfp.cli import main

    (tmp_path / "builder.py").write_text(BUILDER)
    spec = f"{board.host}:{board.port}/{KEY}"
    assert main(["validate", str(tmp_path / "builder.py"), "-t", "rpi4", "--remote", spec, "--count", "8"]) == 0
    out = capsys.readouterr().out
    assert f"validate on {spec}" in out and "OK" in out
    assert main(["bench", str(tmp_path / "builder.py"), "-t", "rpi4", "-b", "1,4", "--repeat", "3",
                 "--remote", spec]) == 0
    out = capsys.readouterr().out
    assert "cortex-a72" in out and "time_evaluator on the board" in out


def test_tuning_measures_on_the_emulated_board(board, mlp, tmp_path, monkeypatch):
    """``net.compile("rpi4", tune={..., "remote": board})``: MetaSchedule's RPCRunner times AArch64
    candidates (linked with the cross compiler here) on the board; the kernel choice is timed and
    checked there too; the tuned batch-4 executable is in ``exe.tuned``, runs on the board for
    4-row calls (validate, profile) and is exported with the library (``mlp.batch4.so``, AArch64)."""
    net, _exe_x86, _exe_a64 = mlp
    monkeypatch.setitem(measure.KERNEL_TIMING, "repeat", 2)
    monkeypatch.setitem(measure.KERNEL_TIMING, "min_repeat_ms", 2)
    target = tuning.tuning_target("rpi4")
    exe = net.compile("rpi4", tune={"batch": 4, "trials": 2, "work_dir": str(tmp_path), "progress": False,
                                    "min_share": 0.0}, remote=board)
    assert not exe.runnable and sorted(exe.tuned) == [4]
    key = tuning.tuning_key(tuning.specialize_batch(net.mod, 4), target, 4, KEY)  # keyed by the board too
    records = [json.loads(line) for line in (tmp_path / key / "database_tuning_record.json").read_text().splitlines()]
    assert records  # candidates measured on the board (their run times are in the records)
    meta = json.loads((tmp_path / key / "pyro2pfp_tuning.json").read_text())
    assert meta["board"] == KEY and meta["trials"] == 2
    assert meta["choices"] and all(c["times_us"] for c in meta["choices"].values())  # timed on the board
    x = fixed_inputs(net.input_shape, 4, seed=5)
    board_run = upload(exe, board)
    assert board_run.vm_for_batch(4) is not board_run.vm  # the tuned executable, uploaded with the library
    mean, ref_mean = board_run(x)[0], net.reference(x)[0]
    del board_run  # closes its session: the board serves one at a time
    assert np.abs(mean - ref_mean).max() < 1e-4 * np.abs(ref_mean).max()
    report = validate(net, exe, board, count=4)  # the batch-4 executable, on the board
    assert report.ok, str(report)
    timing = exe.profile(x, remote=board, repeats=2)
    assert timing.executable == "batch-4" and timing.batch == 4
    assert exe.profile(x[:3], remote=board, repeats=2).executable == "any-batch"
    path = exe.export_library(tmp_path / "mlp_rpi4.so")
    sidecar = json.loads((tmp_path / "mlp_rpi4.so.json").read_text())
    assert sidecar["batch_executables"]["4"]["library"] == "mlp_rpi4.batch4.so"
    assert (tmp_path / "mlp_rpi4.batch4.so").read_bytes()[:4] == b"\x7fELF" and path == str(tmp_path / "mlp_rpi4.so")
    assert (tmp_path / "mlp_rpi4.batch4.so").read_bytes()[18] == 183  # e_machine EM_AARCH64
    # tuning a cross target without a board stays refused, clearly
    with pytest.raises(PFPError, match=r"cannot tune for aarch64.*remote="):
        net.compile("rpi4", tune={"batch": 4, "trials": 1})


def _qemu_sessions(emulated) -> list:
    """The AArch64 session processes (qemu-aarch64) under the board's server process."""
    import psutil

    found = []
    for proc in psutil.Process(emulated.proc.pid).children(recursive=True):
        try:
            if "qemu-aarch64" in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.Error:  # exited meanwhile
            pass
    return found


def test_a_session_over_its_timeout_is_ended_and_the_board_serves_on(board, emulated, mlp):
    net, _x86, exe_a64 = mlp
    short = Remote(board.host, board.port, KEY, session_timeout=3, connect_timeout=10)
    pred = upload(exe_a64, short)
    assert len(_qemu_sessions(emulated)) == 1  # this session's AArch64 process
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match="timing on the board"):
        pred.time(fixed_inputs(net.input_shape, 10), repeats=1, min_repeat_ms=120_000)  # a 2-minute measurement
    assert time.monotonic() - t0 < 30
    # the board ends the session at its 3 s timeout, AArch64 process included, not after the measurement
    deadline = time.monotonic() + 30
    while _qemu_sessions(emulated) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _qemu_sessions(emulated), "the session's qemu process outlived its session timeout"
    del pred
    assert validate(net, exe_a64, board, count=4).ok  # and the board serves the next session


PARENT = """\
import time
from pyro2pfp_experiments.emulated_board import EmulatedBoard

board = EmulatedBoard(start_timeout=120)
board.start()
print(board.proc.pid, flush=True)
time.sleep(600)
"""


def test_the_board_stops_when_the_process_that_started_it_dies(tmp_path):
    """A killed test run (or script) leaves no board listening: the server watches its parent."""
    import psutil

    from pyro2pfp_experiments.emulated_board import _read_line

    (tmp_path / "parent.py").write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(tmp_path / "parent.py")], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL)
    server = None
    try:
        line = _read_line(parent, START_TIMEOUT)
        assert line.isdigit(), f"the parent script did not start a board: {line!r}"
        server = psutil.Process(int(line))
        assert server.is_running()
        parent.kill()  # SIGKILL: EmulatedBoard.stop() never runs
        parent.wait(timeout=10)
        server.wait(timeout=15)  # raises psutil.TimeoutExpired if the board outlives its parent
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=10)
        if server is not None and server.is_running():
            os.killpg(server.pid, 9)
        if parent.stdout is not None:
            parent.stdout.close()
