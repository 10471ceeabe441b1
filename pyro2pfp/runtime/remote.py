"""Remote boards through TVM's RPC: connect, upload a compiled network, run, time and validate it.

TVM's own machinery does the work: a tracker (``python -m tvm.exec.rpc_tracker``) that boards
register with (``python -m tvm.exec.rpc_server --tracker host:9190 --key rpi4``), sessions
requested from it by key, ``time_evaluator`` run on the board, and MetaSchedule's ``RPCRunner``
for tuning (:mod:`pyro2pfp.backends.tvm.tuning` with ``remote=``).  This module only adds what pyro2pfp needs
around it:

* :class:`Remote`: where the boards are -- ``"tracker-host:9190/rpi4"`` (a tracker and a key) or
  ``"host:9090"`` (one server, no tracker) -- with the session timeout and how many boards may
  measure in parallel;
* **every wait bounded**: connecting to the tracker, asking it for a board and opening a session
  run in a helper thread joined with ``connect_timeout``; a key with no server registered is
  refused at once (TVM's tracker would queue the request forever).  All failures are
  :class:`pyro2pfp.errors.RemoteError` naming the address and key;
* :func:`upload`: export the compiled network (``exe.export_library``: the any-batch executable
  and its batch-specialised ones, ``exe.tuned``), upload it, load it on the board as Relax VMs
  (:class:`RemotePredictor`: ``(mean, var)`` as NumPy, ``time()`` with ``time_evaluator`` on the
  board; a call with a batch size that has a specialised executable runs that one, as
  ``exe(x)`` does here);
* :func:`validate`: a fixed input set run on the board against the float64 NumPy reference.
"""
from __future__ import annotations

import dataclasses
import os
import re
import tempfile
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import numpy as np

from ..errors import RemoteError
from .inputs import checked_inputs, compiled_outputs
from .library_files import batch_library_path, export_library
from .targets import target_arch

__all__ = [
    "Remote",
    "RemotePredictor",
    "RemoteTiming",
    "ValidationReport",
    "as_remote",
    "benchmark",
    "upload",
    "validate",
]

T = TypeVar("T")

_SPEC = re.compile(r"^(?P<host>[^:/\s]+):(?P<port>\d+)(?:/(?P<key>[^/\s]+))?$")


@dataclasses.dataclass(frozen=True)
class Remote:
    """Where the boards are.

    ``key`` set: ``host:port`` is a TVM RPC tracker and sessions are requested for boards registered
    under ``key`` (``rpc_server --key``).  ``key=None``: ``host:port`` is one RPC server, used
    directly.  ``session_timeout``: seconds a session (and one measurement) may last;
    ``connect_timeout``: seconds to wait for the tracker/server to answer; ``parallel``: boards
    measuring tuning candidates at the same time (MetaSchedule ``RPCRunner`` workers).
    """

    host: str
    port: int
    key: str | None = None
    session_timeout: float = 60.0
    connect_timeout: float = 10.0
    parallel: int = 1

    def __post_init__(self) -> None:
        if not (0 < int(self.port) < 65536):
            raise RemoteError(f"remote port must be in 1..65535, got {self.port}")
        if self.session_timeout <= 0 or self.connect_timeout <= 0:
            raise RemoteError("remote timeouts must be positive (every wait is bounded)")
        if int(self.parallel) < 1:
            raise RemoteError(f"remote parallel must be >= 1, got {self.parallel}")

    @classmethod
    def parse(cls, spec: str, **options: Any) -> Remote:
        """``"host:port/key"`` (tracker) or ``"host:port"`` (direct server)."""
        m = _SPEC.match(str(spec).strip())
        if m is None:
            raise RemoteError(f"remote {spec!r}: expected 'tracker-host:port/key' or 'server-host:port'")
        return cls(m["host"], int(m["port"]), m["key"], **options)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}" + (f"/{self.key}" if self.key else "")

    @property
    def tag(self) -> str:
        """The board name in tuning-database keys: the tracker key, or ``host_port`` of a server."""
        return self.key or f"{self.host}_{self.port}"

    def _bounded(self, what: str, fn: Callable[[], T], timeout: float | None = None) -> T:
        """``fn()`` in a helper thread, at most ``timeout`` (default ``connect_timeout``) seconds."""
        timeout = self.connect_timeout if timeout is None else timeout
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as err:  # noqa: BLE001 -- re-raised in the caller
                box["error"] = err

        thread = threading.Thread(target=run, daemon=True, name=f"pyro2pfp-rpc-{what}")
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            raise RemoteError(f"{what} at {self.address}: no answer within {timeout:g} s (timeout)")
        if "error" in box:
            err = box.pop("error")  # the box is in the traceback's frames: no cycle keeping a session open
            raise RemoteError(f"{what} at {self.address} failed: {type(err).__name__}: "
                              f"{str(err).strip().splitlines()[-1] if str(err).strip() else ''}") from err
        return box["value"]

    def servers(self) -> int:
        """Number of servers the tracker has under ``key`` (free or busy); raises if none."""
        from tvm import rpc

        if self.key is None:
            return 1
        summary = self._bounded("connecting to the RPC tracker",
                                lambda: rpc.connect_tracker(self.host, self.port).summary())
        keys = [str(item["key"]).split(":", 1)[-1] for item in summary.get("server_info", [])]
        count = sum(k == self.key for k in keys)
        if count == 0:
            known = sorted(set(keys))
            raise RemoteError(f"the RPC tracker at {self.host}:{self.port} has no server with key {self.key!r}"
                              f" (registered keys: {known or 'none'}); start one with: python -m "
                              f"tvm.exec.rpc_server --tracker {self.host}:{self.port} --key {self.key}")
        return count

    def connect(self) -> Any:
        """An ``RPCSession`` on one board (bounded waits; :class:`RemoteError` otherwise)."""
        from tvm import rpc

        timeout = int(np.ceil(self.session_timeout))
        if self.key is None:
            return self._bounded("connecting to the RPC server",
                                 lambda: rpc.connect(self.host, self.port, session_timeout=timeout))
        self.servers()
        return self._bounded(
            f"requesting a board with key {self.key!r} from the tracker",
            lambda: rpc.connect_tracker(self.host, self.port).request(
                self.key, session_timeout=timeout, max_retry=1),
            timeout=self.connect_timeout + self.session_timeout)

    def rpc_config(self) -> Any:
        """MetaSchedule's ``RPCConfig`` for this remote (a direct server is passed as the
        "tracker" address; :func:`create_session` then connects to it directly)."""
        from tvm.s_tir.meta_schedule.runner import RPCConfig

        return RPCConfig(tracker_host=self.host, tracker_port=int(self.port), tracker_key=self.key or "direct",
                         session_timeout_sec=int(np.ceil(self.session_timeout)))


def create_session(rpc_config: Any) -> Any:
    """MetaSchedule ``RPCRunner`` session factory for a direct server (no tracker)."""
    from tvm import rpc

    return rpc.connect(rpc_config.tracker_host, int(rpc_config.tracker_port),
                       session_timeout=rpc_config.session_timeout_sec)


def as_remote(remote: Any) -> Remote:
    """A :class:`Remote` from a spec string or a :class:`Remote`."""
    if isinstance(remote, Remote):
        return remote
    if isinstance(remote, str):
        return Remote.parse(remote)
    raise RemoteError(f"remote must be 'host:port/key', 'host:port' or a pyro2pfp.runtime.remote.Remote, "
                      f"got {remote!r}")


# ----------------------------------------------------------------------------------- run on a board
@dataclasses.dataclass
class RemoteTiming:
    """Whole-network latency of one call measured on the board with ``time_evaluator``."""

    remote: str
    batch: int
    mean_ms: float
    median_ms: float
    min_ms: float
    repeats: int
    executable: str = "any-batch"   # or "batch-<B>": the batch-specialised executable timed

    def __str__(self) -> str:
        return (f"remote {self.remote}: batch {self.batch}: mean {self.mean_ms:.4f} ms, median "
                f"{self.median_ms:.4f} ms, min {self.min_ms:.4f} ms ({self.repeats} repeats, "
                f"{self.executable} executable, time_evaluator on the board)")


class RemotePredictor:
    """A compiled network uploaded to a board: ``pred(x[, x_var]) -> (mean, var)`` NumPy arrays, as
    ``exe(x)`` gives them here: non-finite outputs raise :class:`~pyro2pfp.errors.NumericalError`, and a
    network with the uncertainty head (``exe.head == "probs"``) returns a
    :class:`~pyro2pfp.ops.head.HeadOutput`.

    ``specialised``: ``{batch: library}`` of batch-specialised executables loaded on the board; a
    call with one of those batch sizes runs that one (as :class:`~pyro2pfp.backends.tvm.runtime.
    CompiledPFP` does), other sizes the any-batch ``library``."""

    def __init__(self, session: Any, library: Any, exe: Any, remote: Remote,
                 specialised: dict[int, Any] | None = None) -> None:
        from tvm import relax

        self.session, self.remote = session, remote
        self.input_shape, self.input_variance = tuple(exe.input_shape), bool(exe.input_variance)
        self.device = session.cpu()
        self.vm = relax.VirtualMachine(library, self.device)
        self.head = getattr(exe, "head", None)
        self.tuned_vms = {int(b): relax.VirtualMachine(lib, self.device) for b, lib in (specialised or {}).items()}

    def vm_for_batch(self, batch: int) -> Any:
        """The VM on the board that a call with ``batch`` rows runs (a batch-specialised one if uploaded)."""
        return self.tuned_vms.get(int(batch), self.vm)

    def _set_input(self, x: Any, x_var: Any) -> tuple[Any, int]:
        """The inputs checked and set on the VM for their batch size: (that VM, the batch size)."""
        import tvm

        arrays = checked_inputs(x, x_var, self.input_shape, self.input_variance, np.float32)
        batch = int(arrays[0].shape[0])
        vm = self.vm_for_batch(batch)
        vm.set_input("main", *[tvm.runtime.tensor(a, self.device) for a in arrays])
        return vm, batch

    def __call__(self, x: Any, x_var: Any = None) -> Any:
        """The network's outputs for ``x`` computed on the board (see the class docstring)."""
        return compiled_outputs(*self.outputs(x, x_var), self.head)

    def outputs(self, x: Any, x_var: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """The compiled module's two outputs as they come from the board, unchecked: ``(mean, var)``
        of the logits, or ``(probs, stats)`` for a network with the uncertainty head."""
        vm, _ = self._set_input(x, x_var)
        vm.invoke_stateful("main")
        # not vm.get_outputs(): its recursive closure is a reference cycle holding the VM, and so the
        # RPC session, open until the next garbage collection -- a one-session board (a direct
        # rpc_server) would refuse the next connection until then
        get_output = vm.module["get_output"]
        mean, var = get_output("main", 0), get_output("main", 1)
        return mean.numpy(), var.numpy()

    def time(self, x: Any, x_var: Any = None, *, repeats: int = 10, number: int = 0,
             min_repeat_ms: int = 50) -> RemoteTiming:
        """Latency of one call on ``x`` timed on the board (``time_evaluator`` runs the loop there,
        so the network round trip is not in the figure), with the executable a call of that batch
        size runs (:meth:`vm_for_batch`)."""
        vm, batch = self._set_input(x, x_var)
        timer = vm.time_evaluator("invoke_stateful", self.device, number=max(1, number) if number else 1,
                                  repeat=int(repeats), min_repeat_ms=int(min_repeat_ms))
        results = np.asarray(self.remote._bounded("timing on the board", lambda: timer("main").results,
                                                  timeout=self.remote.session_timeout)) * 1e3
        which = f"batch-{batch}" if batch in self.tuned_vms else "any-batch"
        return RemoteTiming(self.remote.address, batch, float(results.mean()), float(np.median(results)),
                            float(results.min()), int(repeats), which)


def upload(exe: Any, remote: Any, batches: Any = None) -> RemotePredictor:
    """Export ``exe`` (a :class:`~pyro2pfp.backends.tvm.runtime.CompiledPFP`, host or cross
    target), upload the library to a board and load it there.  ``batches``: the batch-specialised
    executables of ``exe.tuned`` to upload as well (default: all of them; sizes without one are
    ignored); calls with those batch sizes run them."""
    remote = as_remote(remote)
    have = {int(b) for b in (getattr(exe, "tuned", None) or {})}
    wanted = sorted(have if batches is None else have & {int(b) for b in batches})
    session = remote.connect()
    try:
        with tempfile.TemporaryDirectory(prefix="pyro2pfp-rpc-") as tmp:
            path = os.path.join(tmp, "pyro2pfp_net.so")
            export_library(exe, path, batches=wanted)
            name = f"pyro2pfp_net_{os.getpid()}_{id(exe):x}.so"
            files = {None: (path, name)} | {b: (batch_library_path(path, b), batch_library_path(name, b))
                                            for b in wanted}
            for local, remote_name in files.values():
                remote._bounded("uploading the library", lambda a=local, b=remote_name: session.upload(a, b),
                                timeout=remote.session_timeout)
        try:
            loaded = {b: remote._bounded("loading the library on the board",
                                         lambda name=remote_name: session.load_module(name),
                                         timeout=remote.session_timeout)
                      for b, (_, remote_name) in files.items()}
        except RemoteError as err:
            raise RemoteError(f"{err} (the library is compiled for {target_arch(exe.target)}: is the board "
                              "of that architecture?)") from err
    except BaseException:
        session = None  # close the session now: the error's traceback keeps this frame (and so it) alive
        raise
    library = loaded.pop(None)
    return RemotePredictor(session, library, exe, remote, {b: lib for b, lib in loaded.items() if b is not None})


def benchmark(exe: Any, x: Any, remote: Any, x_var: Any = None, *, repeats: int = 10) -> RemoteTiming:
    """Upload ``exe`` and time one call on ``x`` on the board (with the executable a call of that
    batch size runs: a batch-specialised one of ``exe.tuned`` if there is one; only that one is
    uploaded besides the any-batch library)."""
    return upload(exe, remote, batches=[_rows(x)]).time(x, x_var, repeats=repeats)


def _rows(x: Any) -> int:
    """The batch size of ``x`` (its first dimension; 0 for a scalar, which the input check refuses)."""
    shape = getattr(x, "shape", None)
    if shape is None:
        shape = np.shape(x)
    return int(shape[0]) if len(shape) else 0


@dataclasses.dataclass
class ValidationReport:
    """The board's outputs against the float64 NumPy reference on a fixed input set (for a network
    with the uncertainty head, "mean" is the probabilities and "var" the three entropies)."""

    remote: str
    inputs: int
    max_abs_error_mean: float
    max_abs_error_var: float
    max_rel_error_mean: float   # relative to the largest reference magnitude
    max_rel_error_var: float
    rtol: float

    @property
    def ok(self) -> bool:
        return max(self.max_rel_error_mean, self.max_rel_error_var) <= self.rtol

    def __str__(self) -> str:
        return (f"validate on {self.remote}: {self.inputs} inputs; max |error| mean {self.max_abs_error_mean:.3g}, "
                f"var {self.max_abs_error_var:.3g}; relative to the largest reference value: mean "
                f"{self.max_rel_error_mean:.3g}, var {self.max_rel_error_var:.3g} -> "
                f"{'OK' if self.ok else 'FAILED'} (rtol {self.rtol:g})")


def fixed_inputs(input_shape: tuple[int, ...], count: int = 32, seed: int = 0) -> np.ndarray:
    """The fixed validation input set: ``count`` rows uniform in [-1, 1) from ``seed``."""
    return np.random.default_rng(seed).uniform(-1.0, 1.0, (int(count), *input_shape)).astype(np.float32)


class ReferenceNetwork(Protocol):
    """What :func:`validate` reads of a converted network (``pyro2pfp.PFPNetwork``)."""

    @property
    def input_shape(self) -> tuple[int, ...]: ...

    @property
    def input_variance(self) -> bool: ...

    @property
    def head(self) -> str | None: ...

    def reference(self, x: Any, x_var: Any = None) -> Any: ...


def validate(net: ReferenceNetwork, exe: Any, remote: Any, *, x: Any = None, count: int = 32, seed: int = 0,
             rtol: float = 1e-4) -> ValidationReport:
    """Run ``exe`` on the board on a fixed input set (``x`` or :func:`fixed_inputs`) and compare
    with ``net.reference`` (float64 NumPy): the max absolute and relative error of mean and var.
    The set is run in one call, so with the executable ``exe`` runs for that batch size (a
    batch-specialised one of ``exe.tuned`` if there is one, else the any-batch one)."""
    remote = as_remote(remote)
    xs = fixed_inputs(net.input_shape, count, seed) if x is None else np.asarray(x, dtype=np.float32)
    x_var = np.full_like(xs, 1e-2) if net.input_variance else None
    got = upload(exe, remote, batches=[_rows(xs)])(xs, x_var)
    want = net.reference(xs, x_var)
    if net.head is not None:  # HeadOutputs: probabilities, and the three entropies
        got, want = got.module_outputs(), want.module_outputs()
    abs_err = [float(np.max(np.abs(g.astype(np.float64) - w))) for g, w in zip(got, want)]
    rel_err = [e / max(float(np.max(np.abs(w))), 1e-30) for e, w in zip(abs_err, want)]
    return ValidationReport(remote.address, int(xs.shape[0]), abs_err[0], abs_err[1], rel_err[0], rel_err[1],
                            float(rtol))
