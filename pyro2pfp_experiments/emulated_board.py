"""An emulated AArch64 board for TVM RPC: a cortex-a72 under ``qemu-aarch64`` serving RPC sessions.

No Raspberry Pi at hand?  This starts a TVM RPC server whose sessions run in an **AArch64 process**
(the AArch64 TVM runtime under ``qemu-aarch64 -cpu cortex-a72``), so a network cross-compiled with
``net.compile("rpi4")`` is uploaded, loaded, run, timed and validated over RPC exactly as on a Pi
(``pyro2pfp.runtime.remote``: ``upload``, ``validate``, ``exe.profile(x, remote=...)``, ``pyro2pfp bench
--remote``, ``pyro2pfp validate --remote``).  Latency measured here is **emulation**, not a hardware
figure: qemu translates every AArch64 instruction.

How it is put together (the structure of TVM's own Python server, ``tvm.rpc.server``): the listening
process is TVM's Python server on this (x86) machine -- it binds the port, registers with a tracker
under a key, does the handshake and bounds each session with the client's ``session_timeout`` -- and
each accepted session is served by a child process.  TVM's child runs ``rpc.ServerLoop`` in Python;
here the child runs ``qemu-aarch64`` on a ~40-line C++ program (:data:`SESSION_SOURCE`) built
with ``aarch64-linux-gnu-g++`` against the AArch64 ``libtvm_runtime.so`` / ``libtvm_ffi.so`` /
``libtvm_runtime_extra.so`` of the installed TVM version (fetched once from the manylinux aarch64
wheels with ``pip download``, as ``tests/deploy/test_deploy.py`` does).  That program registers the server
environment (``tvm.rpc.server.workpath`` / ``load_module``) and runs the runtime's ``rpc.ServerLoop``
on the inherited socket: uploads, module loading, tensors, the Relax VM and ``time_evaluator`` all run
in the AArch64 runtime.

Needs (Debian/Ubuntu): ``apt-get install -y gcc-aarch64-linux-gnu g++-aarch64-linux-gnu qemu-user``.

Command line (stop with Ctrl-C)::

    python -m pyro2pfp_experiments.emulated_board --port 9090                      # direct: "127.0.0.1:9090"
    python -m pyro2pfp_experiments.emulated_board --tracker 127.0.0.1:9190 --key qemu-a72

From Python (the server is a subprocess, killed with its sessions on exit)::

    with EmulatedBoard() as board:                     # or EmulatedBoard(tracker=("127.0.0.1", 9190))
        print(validate(net, net.compile("rpi4"), board.remote))
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

__all__ = ["EmulatedBoard", "EmulatedBoardError", "RUNTIME_LIBS", "SESSION_SOURCE", "aarch64_runtime",
           "build_session_server", "main", "serve"]

#: The AArch64 TVM runtime libraries taken from the manylinux aarch64 wheels (``libtvm_runtime_extra``
#: holds ``tvm.contrib.random.random_fill_for_measure``, which MetaSchedule's ``RPCRunner`` calls).
RUNTIME_LIBS = ("libtvm_runtime.so", "libtvm_ffi.so", "libtvm_runtime_extra.so")
QEMU = "qemu-aarch64"
CROSS_GXX = "aarch64-linux-gnu-g++"
#: Debian's AArch64 sysroot of the cross toolchain (libc, libstdc++): qemu's ``-L``.
SYSROOT = "/usr/aarch64-linux-gnu"
APT_LINE = "apt-get install -y gcc-aarch64-linux-gnu g++-aarch64-linux-gnu qemu-user"
READY = "emulated-board listening on"


class EmulatedBoardError(RuntimeError):
    """The emulated board cannot be set up or started (missing tool, runtime, build failure, timeout)."""


# ----------------------------------------------------------------------------------- the AArch64 side
SESSION_SOURCE = r"""
// pyro2pfp emulated board: serve ONE TVM RPC session on an accepted socket, in an AArch64 process.
// usage: pfp_rpc_session SOCKET_FD WORKDIR
// The x86 parent (TVM's Python server) has accepted the connection and done the handshake; this
// registers the server environment (file names relative to WORKDIR) and runs the runtime's
// rpc.ServerLoop until the client closes the session.
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

namespace ffi = tvm::ffi;

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s SOCKET_FD WORKDIR\n", argv[0]);
    return 2;
  }
  const int64_t fd = std::atoll(argv[1]);
  const std::string workdir = argv[2];
  auto path = [workdir](const std::string& name) {
    return !name.empty() && name[0] == '/' ? name : workdir + "/" + name;
  };
  ffi::Function::SetGlobal("tvm.rpc.server.workpath",
                           ffi::Function::FromTyped([path](std::string name) { return path(name); }));
  ffi::Function::SetGlobal("tvm.rpc.server.load_module", ffi::Function::FromTyped([path](std::string name) {
                             return ffi::Module::LoadFromFile(path(name));
                           }));
  auto loop = ffi::Function::GetGlobal("rpc.ServerLoop");
  if (!loop.has_value()) {
    std::fprintf(stderr, "pfp_rpc_session: rpc.ServerLoop is not in this TVM runtime\n");
    return 1;
  }
  try {
    (*loop)(fd);
  } catch (const std::exception& err) {  // a broken session must not take the board down
    std::fprintf(stderr, "pfp_rpc_session: session ended with an error: %s\n", err.what());
  }
  return 0;
}
"""


def require_tool(tool: str) -> str:
    """The path of ``tool`` on PATH, or :class:`EmulatedBoardError` with the apt line."""
    path = shutil.which(tool)
    if path is None:
        raise EmulatedBoardError(f"'{tool}' is not installed; the emulated AArch64 board needs it. "
                                 f"Install with: {APT_LINE}")
    return path


def _versions() -> tuple[str, str]:
    import tvm

    return str(tvm.__version__), importlib.metadata.version("apache-tvm-ffi")


def runtime_dir() -> Path:
    """Where the AArch64 runtime is cached: ``$PYRO2PFP_AARCH64_RUNTIME`` or
    ``~/.cache/pyro2pfp/aarch64-tvm-<tvm>-ffi-<ffi>`` (the directory ``tests/deploy/test_deploy.py`` uses)."""
    tvm_version, ffi_version = _versions()
    env = os.environ.get("PYRO2PFP_AARCH64_RUNTIME")
    return Path(env) if env else Path.home() / ".cache" / "pyro2pfp" / f"aarch64-tvm-{tvm_version}-ffi-{ffi_version}"


def aarch64_runtime(libs: tuple[str, ...] = RUNTIME_LIBS, timeout: float = 600.0) -> Path:
    """A directory holding the AArch64 ``libs`` of the installed apache-tvm / apache-tvm-ffi versions.

    Taken from :func:`runtime_dir` when present; otherwise fetched once with ``pip download --platform
    manylinux_2_28_aarch64`` (the wheels of the same versions) and unpacked there.
    """
    root = runtime_dir()
    if all((root / lib).is_file() for lib in libs):
        return root
    tvm_version, ffi_version = _versions()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pyro2pfp-a64-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--platform", "manylinux_2_28_aarch64",
               "--python-version", f"{sys.version_info.major}.{sys.version_info.minor}",
               "-d", tmp, f"apache-tvm=={tvm_version}", f"apache-tvm-ffi=={ffi_version}"]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as err:
            raise EmulatedBoardError(f"fetching the AArch64 TVM wheels took over {timeout:g} s: "
                                     + " ".join(cmd)) from err
        if result.returncode != 0:
            raise EmulatedBoardError("could not fetch the AArch64 TVM runtime wheels (" + " ".join(cmd) + "):\n"
                                     + result.stderr[-1500:] + "\nSet PYRO2PFP_AARCH64_RUNTIME to a directory "
                                     "holding " + ", ".join(libs) + " for aarch64.")
        for wheel in Path(tmp).glob("*.whl"):
            with zipfile.ZipFile(wheel) as zf:
                for name in zf.namelist():
                    if Path(name).name in libs and "/lib/" in name:
                        part = root / (Path(name).name + f".part{os.getpid()}")
                        part.write_bytes(zf.read(name))
                        os.replace(part, root / Path(name).name)  # atomic: concurrent fetches are safe
    missing = [lib for lib in libs if not (root / lib).is_file()]
    if missing:
        raise EmulatedBoardError(f"{', '.join(missing)} not found in the AArch64 wheels (unpacked to {root})")
    return root


def build_session_server(runtime: Path | None = None, timeout: float = 300.0) -> Path:
    """The AArch64 session program (:data:`SESSION_SOURCE`), built once with ``aarch64-linux-gnu-g++``
    against the runtime in ``runtime`` (default :func:`aarch64_runtime`) and cached beside it."""
    import tvm_ffi

    runtime = aarch64_runtime() if runtime is None else Path(runtime)
    ffi_root = Path(tvm_ffi.__file__).parent
    digest = hashlib.sha256((SESSION_SOURCE + str(runtime.resolve())).encode()).hexdigest()[:12]
    exe = runtime / f"pfp_rpc_session-{digest}"
    if exe.is_file():
        return exe
    gxx = require_tool(CROSS_GXX)
    with tempfile.TemporaryDirectory(prefix="pyro2pfp-a64-") as tmp:
        source = Path(tmp) / "pfp_rpc_session.cc"
        source.write_text(SESSION_SOURCE)
        out = Path(tmp) / "pfp_rpc_session"
        cmd = [gxx, "-std=c++17", "-O1", str(source), "-o", str(out),
               f"-I{ffi_root / 'include'}", f"-I{ffi_root / '3rdparty' / 'dlpack' / 'include'}",
               f"-L{runtime}", "-Wl,--no-as-needed", "-ltvm_runtime_extra", "-ltvm_runtime", "-ltvm_ffi",
               f"-Wl,-rpath,{runtime.resolve()}"]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as err:
            raise EmulatedBoardError(f"building the AArch64 session program took over {timeout:g} s") from err
        if result.returncode != 0:
            raise EmulatedBoardError("building the AArch64 session program failed (" + " ".join(cmd) + "):\n"
                                     + result.stderr[-3000:])
        part = runtime / f"{exe.name}.part{os.getpid()}"
        shutil.copy2(out, part)
        os.replace(part, exe)
    return exe


# ----------------------------------------------------------------------------------- the x86 side
def serve(host: str = "127.0.0.1", port: int = 9090, port_end: int | None = None,
          tracker: tuple[str, int] | None = None, key: str = "qemu-a72", cpu: str = "cortex-a72",
          session_program: Path | None = None, ready: Any = None) -> None:
    """Run the board's listening loop in this process (blocks): TVM's Python server, whose per-session
    child process runs ``qemu-aarch64 -cpu <cpu>`` on the session program (socket passed down).  ``ready(port)``
    is called once the port is bound."""
    qemu = require_tool(QEMU)
    program = build_session_server() if session_program is None else Path(session_program)
    import tvm.rpc.server as tvm_server

    if not callable(getattr(tvm_server, "_serve_loop", None)) or not hasattr(tvm_server, "PopenRPCServerState"):
        raise EmulatedBoardError("this TVM's tvm.rpc.server has no _serve_loop / PopenRPCServerState "
                                 "(written for TVM 0.27): the emulated board cannot hook its sessions")

    def session_in_qemu(sock: socket.socket, load_library: Any, work_path: Any) -> None:
        # Runs in TVM's forked per-session child, which TVM terminates (SIGTERM) when the client's
        # session_timeout expires: the AArch64 process goes with it.  (Not exec: TVM's join(timeout)
        # on the child would then block until the session ends.)
        fd = sock.fileno()
        proc = subprocess.Popen([qemu, "-cpu", cpu, "-L", SYSROOT, str(program), str(fd), str(work_path.path)],
                                pass_fds=(fd,))

        def stop(_signum: int, _frame: Any) -> None:
            proc.kill()
            os._exit(0)

        signal.signal(signal.SIGTERM, stop)
        code = proc.wait()
        if code != 0:  # a crashed session must not stop the board: TVM's server quits on a failed child
            print(f"emulated board: the AArch64 session process exited with status {code}", file=sys.stderr)

    tvm_server._serve_loop = session_in_qemu  # TVM's _serving() starts it as the session process
    state = tvm_server.PopenRPCServerState(host, int(port), int(port_end or int(port) + 1),
                                           tracker_addr=tracker, key=key if tracker else "", silent=False)
    if ready is not None:
        ready(state.port)
    state.thread.join()


class EmulatedBoard:
    """The emulated AArch64 board as a subprocess (context manager): ``.remote`` is the
    :class:`pyro2pfp.runtime.remote.Remote` to use (the tracker and ``key`` when ``tracker`` is given,
    otherwise the server directly).  Every wait is bounded; on exit the server and any session it
    is serving are killed (one process group), and if this process dies without exiting cleanly the
    server notices within a second and kills its group itself (``--exit-with-parent``).  Server
    logs go to ``log`` (default: discarded)."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, *, tracker: tuple[str, int] | None = None,
                 key: str = "qemu-a72", cpu: str = "cortex-a72", log: str | Path | None = None,
                 start_timeout: float = 120.0, session_timeout: float = 120.0, connect_timeout: float = 10.0) -> None:
        self.host, self.port, self.tracker, self.key, self.cpu = host, port, tracker, key, cpu
        self.log, self.start_timeout = log, float(start_timeout)
        self.session_timeout, self.connect_timeout = float(session_timeout), float(connect_timeout)
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> EmulatedBoard:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def remote(self) -> Any:
        from pyro2pfp.runtime.remote import Remote

        if self.tracker is not None:
            return Remote(self.tracker[0], int(self.tracker[1]), self.key, session_timeout=self.session_timeout,
                          connect_timeout=self.connect_timeout)
        assert self.port is not None, "start() the board first"
        return Remote(self.host, int(self.port), None, session_timeout=self.session_timeout,
                      connect_timeout=self.connect_timeout)

    def start(self) -> None:
        require_tool(QEMU)
        program = build_session_server()  # fetch and build here, before the clock of the start starts
        port = self.port or _free_port(self.host)
        cmd = [sys.executable, "-m", "pyro2pfp_experiments.emulated_board", "--host", self.host,
               "--port", str(port), "--cpu", self.cpu, "--session-program", str(program), "--exit-with-parent"]
        if self.tracker is not None:
            cmd += ["--tracker", f"{self.tracker[0]}:{self.tracker[1]}", "--key", self.key]
        log = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115 -- closed below
        try:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, start_new_session=True)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()  # type: ignore[union-attr]
        line = _read_line(self.proc, self.start_timeout)
        if not line.startswith(READY):
            self.stop()
            raise EmulatedBoardError(f"the emulated board did not start within {self.start_timeout:g} s "
                                     f"(got {line!r}; server log: {self.log or 'discarded'})")
        self.port = int(line.rsplit(":", 1)[1])
        if self.tracker is not None:
            self._wait_registered()

    def _wait_registered(self) -> None:
        from pyro2pfp.errors import RemoteError

        deadline = time.monotonic() + self.start_timeout
        while True:
            try:
                self.remote.servers()
                return
            except RemoteError as err:
                if time.monotonic() > deadline:
                    self.stop()
                    raise EmulatedBoardError(f"the emulated board did not register with the tracker "
                                             f"{self.tracker} within {self.start_timeout:g} s: {err}") from err
            time.sleep(0.3)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the server and its qemu session children
            except ProcessLookupError:  # pragma: no cover -- exited meanwhile
                pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass
        if proc.stdout is not None:
            proc.stdout.close()


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _read_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """The first stdout line of ``proc`` within ``timeout`` seconds ('' on timeout or exit)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    buf = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                return ""
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                return ""
            buf += chunk
    return buf.split(b"\n", 1)[0].decode(errors="replace").strip()


def _exit_with_parent(period: float = 1.0) -> None:
    """A watchdog thread: when the parent process is gone (this one re-parented), kill this process's
    group -- the server and its qemu sessions (:class:`EmulatedBoard` starts it as a group leader)
    -- so that a killed test run leaves no board listening behind."""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period)
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="emulated-board-watchdog").start()


def main(argv: list[str] | None = None) -> int:
    """``python -m pyro2pfp_experiments.emulated_board``: run the board until killed."""
    p = argparse.ArgumentParser(prog="python -m pyro2pfp_experiments.emulated_board",
                                description="A TVM RPC server whose sessions run in the AArch64 TVM runtime "
                                            "under qemu-aarch64 (an emulated cortex-a72 board).")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=9090)
    p.add_argument("--port-end", type=int, default=None, help="try ports up to this one (exclusive)")
    p.add_argument("--tracker", default=None, metavar="HOST:PORT", help="register with this RPC tracker")
    p.add_argument("--key", default="qemu-a72", help="the key to register under (default qemu-a72)")
    p.add_argument("--cpu", default="cortex-a72", help="qemu -cpu (default cortex-a72, the Raspberry Pi 4's core)")
    p.add_argument("--session-program", default=None, help="the built session program (default: build/cache it)")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="stop (with the sessions being served) when the process that started this one exits")
    args = p.parse_args(argv)
    if args.exit_with_parent:
        _exit_with_parent()
    tracker = None
    if args.tracker:
        thost, _, tport = args.tracker.rpartition(":")
        tracker = (thost, int(tport))

    def ready(port: int) -> None:
        print(f"{READY} {args.host}:{port}", flush=True)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # nobody reads stdout after this line: never block on a full pipe
        os.close(devnull)

    try:
        serve(args.host, args.port, args.port_end, tracker, args.key, args.cpu,
              Path(args.session_program) if args.session_program else None, ready)
    except EmulatedBoardError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
