"""TVM back end: emit a :class:`~pyro2pfp.plan.PlannedGraph` as a Relax IRModule of joint PFP TE
kernels, schedule them, compile and run.

Each PFP op has one emitter registered with :func:`kernel` (it calls ``bb.emit_te`` with a TE
function computing mean and second component together) and may register a default CPU
schedule with :func:`schedule`.
"""
from . import compute, elementwise, pooling, shape  # noqa: F401  (registration)
from ._core import KERNELS, SCHEDULES, RelaxActivation, emit_module, kernel, schedule

__all__ = ["KERNELS", "SCHEDULES", "RelaxActivation", "emit_module", "kernel", "schedule"]
