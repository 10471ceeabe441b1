"""The table of default CPU schedules, one per PFP op, and the decorator that fills it."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tvm
from tvm import s_tir

from ....planning.registry import add_to

ScheduleFn = Callable[[s_tir.Schedule, Any, tvm.target.Target], None]

SCHEDULES: dict[str, ScheduleFn] = {}
"""``{op: fn(sch, planned_layer, target)}``: the default CPU schedule of each PFP op, registered
next to its kernel (``backends/tvm/ops/<family>.py``) with :func:`schedule`."""


def _schedule_fn(op: str | None) -> ScheduleFn | None:
    return None if op is None else SCHEDULES.get(op)


#: ``@schedule(op, ...)`` registers the default CPU schedule of PFP ops (once each).
schedule = add_to(SCHEDULES, "CPU schedule of op")
