"""Tuning: the result types -- :class:`TuneResult` (the tuned module, its database, the choices)
and one :class:`KernelChoice` per kernel."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import tvm

from ..build import build


@dataclasses.dataclass
class KernelChoice:
    """Which schedule one kernel of the tuned module uses, and the measured times (us)."""

    name: str
    choice: str                     # "tuned", "default", "any-batch" or "naive"
    times_us: dict[str, float]      # per candidate schedule
    rejected: list[str] = dataclasses.field(default_factory=list)  # failed the output check


@dataclasses.dataclass
class TuneResult:
    """Outcome of :func:`~pyro2pfp.backends.tvm.tuning.api.tune`.

    ``mod``: the batch-specialised IRModule with the chosen schedules (``tvm.compile`` it with
    ``target``); ``batch``; ``work_dir`` (this run's keyed directory); ``database``
    (MetaSchedule ``JSONDatabase``); ``trials`` done in total; ``seconds`` spent in this call;
    ``reused`` (True when nothing was tuned in this call); ``kernels``: one
    :class:`KernelChoice` per PrimFunc.
    """

    mod: tvm.IRModule
    target: tvm.target.Target
    batch: int
    key: str
    work_dir: Path
    database: Any
    trials: int
    seconds: float
    reused: bool
    kernels: list[KernelChoice]

    def build(self) -> Any:
        """``tvm.compile(self.mod, target=self.target)`` (through
        :func:`pyro2pfp.backends.tvm.build.build`: every kernel compiled with ``noalias``)."""
        return build(self.mod, self.target)

    def summary(self) -> str:
        lines = [f"tuned for batch {self.batch}: {self.trials} trials, work dir {self.work_dir}"
                 f"{' (reused)' if self.reused else ''}",
                 f"{'kernel':<30s} {'choice':>9s} {'tuned us':>9s} {'default us':>11s} {'any-batch us':>13s}"
                 f" {'naive us':>9s}"]
        for k in self.kernels:
            c = [f"{k.times_us[n]:.1f}" if n in k.times_us else "-" for n in ("tuned", "default", "any-batch", "naive")]
            bad = f"  (rejected: {', '.join(k.rejected)} -- wrong results)" if k.rejected else ""
            lines.append(f"{k.name:<30s} {k.choice:>9s} {c[0]:>9s} {c[1]:>11s} {c[2]:>13s} {c[3]:>9s}{bad}")
        return "\n".join(lines)
