"""The one compile path: ``net.compile(target, tune=...)`` → a predictor.

Host targets give a runnable :class:`~pyro2pfp.tvm_backend.runtime.CompiledPFP` (default CPU
schedules, optionally MetaSchedule-tuned executables per batch size); targets for another
architecture give one that only exports.
"""
from __future__ import annotations

from typing import Any

from .errors import ArgumentError, PFPError
from .targets import host_arch, is_cross_target, resolve_target, target_arch


def compile_network(net: Any, target: Any = "native", *, schedule: bool = True, tune: Any = None,
                    num_threads: int | None = None, batch_sizes: Any = ()):
    """``net.compile(target)`` with presets and cross-compilation.

    Host targets give a runnable :class:`~pyro2pfp.tvm_backend.runtime.CompiledPFP`; targets for
    another architecture give one that only exports (``exe.export_library(path)``); those cannot
    be tuned here (MetaSchedule measures candidates on the machine it runs on).  ``batch_sizes``:
    batch sizes that also get a static-shape executable with the default schedules (a tuned
    executable of the same batch size takes precedence).
    """
    from .tvm_backend import runtime
    from .tvm_backend._core import kernel_table

    tgt = resolve_target(target)
    static = _batch_sizes(batch_sizes)
    if not is_cross_target(tgt):
        if tune is not None and tune is not False:
            _check_tune_spec(tune)  # before the (slow) build
        if num_threads is not None:
            runtime.set_num_threads(num_threads)
        executable = runtime.build_network(net, tgt, schedule)
        tuned = {b: runtime.build_network(net, tgt, schedule, batch=b) for b in static}
        if tune is not None and tune is not False:
            from .tuning import tune_network

            tuned.update(tune_network(net, tgt, tune))
        exe = runtime.CompiledPFP(executable, net.input_shape, net.input_variance, tgt, tuned=tuned)
        exe.kernels = kernel_table(net.mod)
        exe.head = getattr(net, "head", None)  # "probs": outputs unpacked into a HeadOutput
        return exe
    if isinstance(tune, dict) and tune.get("remote") is not None:
        raise PFPError(f"net.compile({target!r}, tune=..., remote=...) is not supported yet: a network "
                       f"cross-compiled for {target_arch(tgt)} exports only its any-batch executable, so "
                       "executables tuned on the board would not reach it. Tune the kernels on the board with "
                       f"pyro2pfp.tuning.tune(net.mod, {target!r}, batch=..., plan=net.plan, remote=...) (its "
                       ".build() is the batch-specialised executable), or compile without tune=")
    if static:
        raise PFPError(f"batch_sizes={static}: a network cross-compiled for {target_arch(tgt)} exports only its "
                       "any-batch executable; compile without batch_sizes=")
    if tune is not None and tune is not False:
        raise PFPError(f"cannot tune for {target_arch(tgt)} on this {host_arch()} machine: MetaSchedule "
                       "measures every candidate where it runs; compile without tune= or tune on the device")
    executable = runtime.build_network(net, tgt, schedule)
    exe = runtime.CompiledPFP.for_cross_target(executable, net.input_shape, net.input_variance, tgt)
    exe.head = getattr(net, "head", None)
    return exe


def _check_tune_spec(tune: Any) -> None:
    """A malformed ``tune=`` is an :class:`ArgumentError` (what :func:`pyro2pfp.tuning.parse_tune_spec`
    expects is in its message)."""
    from .tuning import parse_tune_spec

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
