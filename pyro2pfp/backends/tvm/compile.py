"""The one compile path: ``net.compile(target, tune=...)`` → a predictor.

Host targets give a runnable :class:`~pyro2pfp.backends.tvm.runtime.CompiledPFP` (default CPU
schedules, optionally static-shape or MetaSchedule-tuned executables per batch size); targets for
another architecture give one that only exports (and uploads to a board), with the same
batch-specialised executables -- tuned only on a board (``tune={..., "remote": ...}``).
"""
from __future__ import annotations

from typing import Any

from ...errors import ArgumentError, PFPError
from ...planning.protocols import ConvertedNetwork
from ...runtime.targets import host_arch, is_cross_target, resolve_target, target_arch
from . import runtime
from .emit import kernel_table
from .tuning import parse_tune_spec, tune_network


def compile_network(net: ConvertedNetwork, target: Any = "native", *, schedule: bool = True, tune: Any = None,
                    num_threads: int | None = None, batch_sizes: Any = ()):
    """``net.compile(target)`` with presets and cross-compilation.

    Host targets give a runnable :class:`~pyro2pfp.backends.tvm.runtime.CompiledPFP`; targets for
    another architecture give one that only exports (``exe.export_library(path)``: every
    batch-specialised executable is written too).  ``batch_sizes``: batch sizes that also get a
    static-shape executable with the default schedules (a tuned executable of the same batch size
    takes precedence).  ``tune``: MetaSchedule-tuned executables per batch size
    (:func:`pyro2pfp.backends.tvm.tuning.tune_network`); for another architecture only with ``"remote"`` in the
    spec (candidates built here, measured on the board): MetaSchedule measures every candidate where
    it runs, so tuning a cross target without a board is refused.
    """
    tgt = resolve_target(target)
    static = _batch_sizes(batch_sizes)
    tuning = tune is not None and tune is not False
    cross = is_cross_target(tgt)
    if tuning:
        _check_tune_spec(tune)  # before the (slow) build
        if cross and not _tunes_on_a_board(tune):
            raise PFPError(f"cannot tune for {target_arch(tgt)} on this {host_arch()} machine: MetaSchedule "
                           "measures every candidate where it runs; compile without tune=, or tune on a board "
                           f"of that architecture: net.compile({target!r}, tune=..., remote='tracker:9190/key')")
    if num_threads is not None and not cross:
        runtime.set_num_threads(num_threads)
    executable = runtime.build_network(net, tgt, schedule)
    tuned = {b: runtime.build_network(net, tgt, schedule, batch=b) for b in static}
    if tuning:
        tuned.update(tune_network(net, tgt, tune))
    if cross:
        exe = runtime.CompiledPFP.for_cross_target(executable, net.input_shape, net.input_variance, tgt,
                                                   tuned=tuned)
    else:
        exe = runtime.CompiledPFP(executable, net.input_shape, net.input_variance, tgt, tuned=tuned)
    exe.kernels = kernel_table(net.mod)
    exe.head = net.head  # "probs": outputs unpacked into a HeadOutput
    return exe


def _tunes_on_a_board(tune: Any) -> bool:
    """Whether a (valid) ``tune=`` spec measures on boards through TVM RPC (``"remote"`` given)."""
    return isinstance(tune, dict) and tune.get("remote") is not None


def _check_tune_spec(tune: Any) -> None:
    """A malformed ``tune=`` is an :class:`ArgumentError` (what :func:`pyro2pfp.backends.tvm.tuning.parse_tune_spec`
    expects is in its message)."""
    try:
        parse_tune_spec(tune)
    except (TypeError, ValueError) as exc:
        raise ArgumentError(f"net.compile(tune={tune!r}): {exc}") from None


def _batch_sizes(batch_sizes: Any) -> list[int]:
    """``batch_sizes`` (an int or an iterable of ints ≥ 1) as a sorted list without repeats; anything
    else is an :class:`ArgumentError`."""
    values = [batch_sizes] if isinstance(batch_sizes, int) and not isinstance(batch_sizes, bool) else batch_sizes
    try:
        out = sorted(set(values))
    except TypeError:
        raise ArgumentError(f"batch_sizes must be an int or a list of ints >= 1, got {batch_sizes!r}") from None
    for b in out:
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise ArgumentError(f"batch_sizes must be ints >= 1, got {b!r} in {batch_sizes!r}")
    return out
