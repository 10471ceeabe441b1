"""A :class:`~pyro2pfp.runtime.scoring.Scorer` that reports on its worker, for the Ray tests: which of torch, Pyro
and TVM's compiler the worker process has imported, its process id, and (``die_once=PATH``) a worker
that kills itself in the middle of the run, once.  Imports NumPy and the runtime layer only, so a worker
unpickling it imports nothing the scorer would not."""
from __future__ import annotations

import os
import signal
import sys
from typing import Any

import numpy as np

from pyro2pfp.runtime.scoring import Scorer

HEAVY = ("torch", "pyro", "tvm", "scipy")


class ProbeScorer(Scorer):
    """``Scorer`` + columns ``heavy`` (the :data:`HEAVY` modules imported, comma-separated) and ``pid``.
    ``die_once``: a path; the first worker to score its ``die_after``-th batch creates it and kills
    itself with SIGKILL (Ray restarts the worker and runs the batch again)."""

    def __init__(self, model: Any, *, die_once: str | None = None, die_after: int = 3, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.die_once, self.die_after, self.calls = die_once, die_after, 0

    def __call__(self, batch: Any) -> dict[str, np.ndarray]:
        self.calls += 1
        if self.die_once and self.calls >= self.die_after:
            try:
                fd = os.open(self.die_once, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.write(fd, str(os.getpid()).encode())
                os.close(fd)
                os.kill(os.getpid(), signal.SIGKILL)
        out = super().__call__(batch)
        rows = len(next(iter(out.values())))
        heavy = ",".join(sorted({m.partition(".")[0] for m in sys.modules} & set(HEAVY)))
        out["heavy"] = np.array([heavy] * rows)
        out["pid"] = np.full(rows, os.getpid(), dtype=np.int64)
        return out
