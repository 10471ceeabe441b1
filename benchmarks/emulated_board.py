"""Networks cross-compiled for the Raspberry Pi 4, run over TVM RPC on the emulated AArch64 board
(prints a table; no assertions).

    .venv/bin/python benchmarks/emulated_board.py [--repeats 10] [--tune 4]
                                                  [--markdown docs/generated/emulated-board.md]

Starts :class:`pyro2pfp_experiments.emulated_board.EmulatedBoard` (the AArch64 TVM runtime under
``qemu-aarch64 -cpu cortex-a72``) and, for comparison, an x86 ``python -m tvm.exec.rpc_server`` on
127.0.0.1.  For each network: ``validate`` on the board (32 fixed inputs against the float64
reference: max relative error of mean and var) and the whole-call latency timed on each server with
``time_evaluator`` (``exe.profile(x, remote=...)``) at batch 1 and 10.  With ``--tune N``: a
MetaSchedule run of N trials for the 16-8-4 MLP at batch 10 measured on the emulated board.

**The AArch64 latency is emulation, not a Raspberry Pi figure**: qemu translates every AArch64
instruction to x86 on the fly (timed on this machine's x86 cores), so it says nothing about how fast
a Pi is; what the run shows is that the cross-compiled library uploads, runs and agrees with the
reference through the same RPC path as a real board.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from markdown_report import add_markdown_argument, table, write_markdown  # noqa: E402

from pyro2pfp.backends.tvm import tuning  # noqa: E402
from pyro2pfp.errors import RemoteError  # noqa: E402
from pyro2pfp.network import PFPNetwork  # noqa: E402
from pyro2pfp.planning.plan import plan  # noqa: E402
from pyro2pfp.runtime.remote import Remote, fixed_inputs, validate  # noqa: E402
from pyro2pfp_experiments.emulated_board import EmulatedBoard  # noqa: E402
from tests.support.builders import lenet_graph, mlp_graph  # noqa: E402


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _x86_server() -> tuple[subprocess.Popen[bytes], Remote]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_server", "--host", "127.0.0.1", "--port",
                             str(port), "--port-end", str(port + 1), "--silent"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    remote = Remote("127.0.0.1", port, None, session_timeout=120, connect_timeout=10)
    deadline = time.monotonic() + 120
    while True:  # the server answers once it has imported TVM and bound the port
        try:
            remote.connect()  # a real handshake (a bare TCP probe would stop TVM's listener)
            break
        except RemoteError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("the x86 RPC server did not start") from None
            time.sleep(0.5)
    return proc, remote


def networks() -> dict[str, PFPNetwork]:
    rng = np.random.default_rng(0)
    nets = {}
    for name, graph in (("MLP 16-8-4 (test net)", mlp_graph(rng, [16, 8, 4])),
                        ("MLP 784-100-10", mlp_graph(rng, [784, 100, 10])),
                        ("LeNet-5 28x28", lenet_graph(rng))):
        nets[name] = PFPNetwork(graph, plan(graph))
    return nets


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--tune", type=int, default=0, metavar="TRIALS", help="also tune the 16-8-4 MLP on the board")
    add_markdown_argument(p)
    args = p.parse_args()
    rows: list[list[str]] = []
    notes: list[str] = []
    t0 = time.perf_counter()
    board = EmulatedBoard(session_timeout=300)
    board.start()
    started = time.perf_counter() - t0
    x86, x86_remote = _x86_server()
    try:
        print(f"emulated board (qemu-aarch64 -cpu cortex-a72) started in {started:.1f} s "
              f"(runtime fetch/build cached); TVM_NUM_THREADS={os.environ.get('TVM_NUM_THREADS', 'unset')}")
        columns = ["network", "validate on the board: max rel. error mean / var (wall time)", "batch",
                   "qemu AArch64 mean (min) ms", "x86 mean (min) ms", "emulation factor"]
        print(table(columns, []))
        for name, net in networks().items():
            exe_a64, exe_x86 = net.compile("rpi4"), net.compile("llvm")
            t = time.perf_counter()
            report = validate(net, exe_a64, board.remote)
            seconds = time.perf_counter() - t
            assert report.ok, str(report)
            for batch in (1, 10):
                x = fixed_inputs(net.input_shape, batch, seed=1)
                a64 = exe_a64.profile(x, remote=board.remote, repeats=args.repeats)
                ref = exe_x86.profile(x, remote=x86_remote, repeats=args.repeats)
                err = (f"{report.max_rel_error_mean:.1e} / {report.max_rel_error_var:.1e} ({seconds:.1f} s)"
                       if batch == 1 else "")
                rows.append([name if batch == 1 else "", err, str(batch), f"{a64.mean_ms:.3f} ({a64.min_ms:.3f})",
                             f"{ref.mean_ms:.3f} ({ref.min_ms:.3f})", f"{a64.mean_ms / ref.mean_ms:.1f}x"])
                print(table(columns, rows[-1:]).splitlines()[-1], flush=True)
        if args.tune:
            net = next(iter(networks().values()))
            with tempfile.TemporaryDirectory() as work:
                t = time.perf_counter()
                result = tuning.tune(net.mod, "rpi4", batch=10,
                                     trials=args.tune, work_dir=work, plan=net.plan, progress=False,
                                     remote=board.remote)
                notes.append(f"Tuning the 16-8-4 MLP at batch 10 on the emulated board: {args.tune} trials in "
                             f"{time.perf_counter() - t:.0f} s; kernel choices (times on the board, µs):")
                for k in result.kernels:
                    times = ", ".join(f"{c} {us:.1f}" for c, us in k.times_us.items())
                    notes.append(f"* `{k.name}`: {k.choice} ({times})")
                print("\n" + "\n".join(notes))
        write_markdown(args.markdown, [table(columns, rows),
                                       f"x86: the same network compiled for `llvm` on an x86 `rpc_server` on the same "
                                       f"machine; {args.repeats} repeats of `time_evaluator`. The AArch64 column is "
                                       "emulation, not a Raspberry Pi figure.", "\n".join(notes)])
    finally:
        board.stop()
        x86.kill()
        x86.wait(timeout=10)


if __name__ == "__main__":
    main()
