"""NumPy float64 reference executor of a :class:`~pyro2pfp.plan.PlannedGraph`.

Each PFP op has one reference function registered with :func:`reference`; it receives the planned
layer and the :class:`Activation` of each input and returns the layer's output activation in the
representation the plan asks for (``layer.out_repr``).  The executor is the ground truth the
compiled TVM module is tested against.
"""
from . import compute, elementwise, pooling, shape  # noqa: F401  (registration)
from ._core import REFERENCES, Activation, emit_output, execute, reference

__all__ = ["REFERENCES", "Activation", "emit_output", "execute", "reference"]
