"""Boards over TVM RPC, for real on loopback: a tracker and two RPC servers (subprocesses, registered
under one key) run tuning (few trials), benchmarking and validation; the results agree with local
execution; a dead server, a wrong key and a silent peer give clear pyro2pfp errors within bounded time.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from pyro2pfp.backends.tvm import tuning
from pyro2pfp.backends.tvm.tuning import measure
from pyro2pfp.errors import PFPError, RemoteError
from pyro2pfp.network import PFPNetwork
from pyro2pfp.planning.plan import plan
from pyro2pfp.runtime.remote import Remote, fixed_inputs, upload, validate
from tests.support.builders import mlp_graph

KEY = "loopback"
START_TIMEOUT = 90.0  # python -m tvm.exec.* imports TVM: slow on a loaded 2-core machine


def free_port() -> int:
    """A TCP port on loopback that is free now (shared with test_remote_aarch64)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(cmd: list[str]) -> subprocess.Popen:
    """A TVM RPC service process in a session (process group) of its own: ``tvm.exec.rpc_tracker`` /
    ``rpc_server`` run the service in a child process (a ``PopenWorker``), which killing the parent
    alone would leave behind, listening."""
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _kill(procs: list[subprocess.Popen]) -> None:
    """Kill each service's process group (the process and the worker serving for it)."""
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass


@pytest.fixture(scope="module")
def boards():
    """A TVM tracker and two RPC servers on 127.0.0.1 under key ``loopback``: the tracker's Remote."""
    py = sys.executable
    port = free_port()
    procs = [spawn([py, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(port),
                    "--port-end", str(port + 1), "--silent"])]
    try:
        remote = Remote("127.0.0.1", port, KEY, session_timeout=60, connect_timeout=5, parallel=2)
        deadline = time.monotonic() + START_TIMEOUT
        for _ in range(2):
            server_port = free_port()
            procs.append(spawn(
                [py, "-m", "tvm.exec.rpc_server", "--host", "127.0.0.1", "--port", str(server_port),
                 "--port-end", str(server_port + 1), "--tracker", f"127.0.0.1:{port}", "--key", KEY, "--silent"]))
        while True:  # both servers registered
            try:
                if remote.servers() == 2:
                    break
            except RemoteError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("the TVM RPC tracker did not start or the two servers did not register "
                            "(the tracker needs tornado)")
            time.sleep(0.3)
        yield remote
    finally:
        _kill(procs)


@pytest.fixture(scope="module")
def net_and_exe():
    graph = mlp_graph(np.random.default_rng(0), [16, 8, 4])
    net = PFPNetwork(graph, plan(graph), fuse=False)
    return net, net.compile("llvm")


def test_remote_spec_parsing():
    assert Remote.parse("tracker:9190/rpi4") == Remote("tracker", 9190, "rpi4")
    direct = Remote.parse("10.0.0.5:9090", session_timeout=5)
    assert (direct.key, direct.tag, direct.session_timeout) == (None, "10.0.0.5_9090", 5)
    for bad in ("tracker", "tracker:port/rpi4", "host:70000/k", "a:1/b/c"):
        with pytest.raises(RemoteError):
            Remote.parse(bad)


@pytest.mark.board
def test_run_bench_validate_on_the_boards_agree_with_local(boards, net_and_exe):
    net, exe = net_and_exe
    x = fixed_inputs(net.input_shape, 10, seed=3)
    local = exe(x)
    board = upload(exe, boards)
    for got, want in zip(board(x), local):  # the same library, the same CPU: the same numbers
        np.testing.assert_array_equal(got, want)
    timing = exe.profile(x, remote=boards, repeats=3)
    assert timing.batch == 10 and timing.repeats == 3 and 0 < timing.min_ms <= timing.median_ms
    report = validate(net, exe, boards, count=16)
    assert report.ok and report.inputs == 16
    ref = net.reference(fixed_inputs(net.input_shape, 16))
    assert report.max_abs_error_mean < 1e-4 * np.abs(ref[0]).max()


@pytest.mark.board
def test_tuning_measures_on_the_boards(boards, net_and_exe, tmp_path, monkeypatch):
    net, exe = net_and_exe
    monkeypatch.setitem(measure.KERNEL_TIMING, "repeat", 2)
    monkeypatch.setitem(measure.KERNEL_TIMING, "min_repeat_ms", 2)
    lines: list[str] = []
    target = tuning.tuning_target("llvm")
    result = tuning.tune(net.mod, target, batch=4, trials=2, work_dir=tmp_path, plan=net.plan,
                         progress=lines.append, remote=boards, min_share=0.0)
    assert not result.reused and any("trials" in line for line in lines)
    # the database is keyed by the board as well as the target
    static = tuning.specialize_batch(net.mod, 4)
    assert result.key == tuning.tuning_key(static, target, 4, KEY) != tuning.tuning_key(static, target, 4)
    assert (result.work_dir / "database_tuning_record.json").is_file()
    # MetaSchedule's RPCRunner measured candidates (their run times are in the database)
    records = (result.work_dir / "database_tuning_record.json").read_text().splitlines()
    assert records
    import tvm

    vm = tvm.relax.VirtualMachine(result.build(), tvm.cpu())
    x = fixed_inputs(net.input_shape, 4, seed=5)
    got = vm["main"](tvm.runtime.tensor(x))
    for g, want in zip(got, exe(x)):
        np.testing.assert_allclose(g.numpy(), want, rtol=0, atol=1e-5 * np.abs(want).max())
    again = tuning.tune(net.mod, target, batch=4, trials=2, work_dir=tmp_path, plan=net.plan,
                        progress=False, remote=boards, min_share=0.0)
    assert again.reused and again.work_dir == result.work_dir


@pytest.mark.board
def test_wrong_key_is_refused_at_once(boards, net_and_exe):
    net, exe = net_and_exe
    wrong = Remote(boards.host, boards.port, "no-such-board", connect_timeout=5)
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match="no server with key 'no-such-board'.*loopback"):
        upload(exe, wrong)
    with pytest.raises(PFPError, match="no-such-board"):
        net.compile("llvm", tune={"batch": 2, "trials": 1}, remote=wrong)
    assert time.monotonic() - t0 < 30


@pytest.mark.board
def test_dead_server_and_silent_peer_give_bounded_errors(net_and_exe):
    _net, exe = net_and_exe
    dead = Remote("127.0.0.1", free_port(), None, connect_timeout=5)  # nothing listens there
    with pytest.raises(RemoteError, match="connecting to the RPC server"):
        upload(exe, dead)
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(RemoteError, match="timeout"):
            Remote("127.0.0.1", port, "rpi4", connect_timeout=1).servers()
        with pytest.raises(RemoteError, match="timeout"):
            upload(exe, Remote("127.0.0.1", port, None, connect_timeout=1))
        assert time.monotonic() - t0 < 20


BUILDER = textwrap.dedent("""\
    from pyro2pfp_experiments.zoo import BayesianMLP, make_guide

    def build():
        import torch

        model = BayesianMLP(6, (5,), 3)
        guide = make_guide(model, init_scale=0.02)
        # initialise the posterior (an untrained guide holds none)
        guide(torch.zeros(2, 6), torch.zeros(2, dtype=torch.long))
        return model, guide
    """)


@pytest.mark.board
def test_cli_bench_and_validate_remote(boards, tmp_path, capsys):
    from pyro2pfp.cli import main

    (tmp_path / "builder.py").write_text(BUILDER)
    spec = f"{boards.host}:{boards.port}/{KEY}"
    assert main(["validate", str(tmp_path / "builder.py"), "--remote", spec, "--count", "8"]) == 0
    out = capsys.readouterr().out
    assert "validate on" in out and "OK" in out
    assert main(["bench", str(tmp_path / "builder.py"), "-t", "llvm", "-b", "1,4", "--repeat", "3",
                 "--remote", spec]) == 0
    out = capsys.readouterr().out
    assert "time_evaluator on the board" in out and out.count("\n") >= 4
    assert main(["validate", str(tmp_path / "builder.py"), "--remote", f"{boards.host}:{boards.port}/nope"]) == 1
    assert "no server with key 'nope'" in capsys.readouterr().err


@pytest.mark.board
def test_a_finished_prediction_releases_its_session(boards, net_and_exe):
    """No reference cycle keeps the VM (and so the RPC session, and the board) after use: a board
    that serves one session at a time (a direct rpc_server, the emulated board) is free again at once."""
    import gc
    import weakref

    net, exe = net_and_exe
    gc.disable()
    try:
        pred = upload(exe, boards)
        pred(fixed_inputs(net.input_shape, 2))
        vm = weakref.ref(pred.vm)
        del pred
        assert vm() is None
    finally:
        gc.enable()


@pytest.mark.board
def test_board_outputs_are_checked_and_unpacked_as_here(boards):
    """On a board, a network with the uncertainty head returns a HeadOutput and non-finite outputs
    raise NumericalError -- as ``exe(x)`` here; ``validate`` compares the head's quantities with the
    reference's."""
    from pyro2pfp.errors import NumericalError
    from pyro2pfp.ops.head import HeadOutput, append_head

    graph = mlp_graph(np.random.default_rng(4), [6, 5, 3])
    net = PFPNetwork(graph, plan(append_head(graph, "probs")))
    exe = net.compile("llvm")
    x = fixed_inputs(net.input_shape, 5, seed=1)
    board, local = upload(exe, boards)(x), exe(x)
    assert isinstance(board, HeadOutput)
    for got, want in zip(board, local):
        np.testing.assert_array_equal(got, want)
    report = validate(net, exe, boards, count=8)
    assert report.ok, str(report)
    plain_exe = PFPNetwork(graph, plan(graph)).compile("llvm")
    with pytest.raises(NumericalError, match="not finite"):
        upload(plain_exe, boards)(np.full((2, 6), 3e38, np.float32))  # squares overflow float32
