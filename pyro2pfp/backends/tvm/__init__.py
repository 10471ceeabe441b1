"""TVM back end: emit a :class:`~pyro2pfp.planning.plan.PlannedGraph` as a Relax IRModule of joint PFP TE
kernels, schedule them, compile and run.

Each PFP op has one emitter registered with :func:`kernel` (it calls ``bb.emit_te`` with a TE
function computing mean and second component together) and a default CPU schedule registered with
:func:`schedule`, both in ``backends/tvm/ops/<family>.py``.
"""
from ... import ops as _registry  # noqa: F401  (the op registry first: every activation op gets a kernel below)
from . import compact_factor as compact_factor  # noqa: F401  (registers the compact factor plan's step)
from . import ops  # noqa: F401  (registers the kernels and schedules)
from .emit import KERNELS, RelaxActivation, emit_module, kernel
from .schedules import SCHEDULES, schedule

__all__ = ["KERNELS", "SCHEDULES", "RelaxActivation", "emit_module", "kernel", "schedule"]
