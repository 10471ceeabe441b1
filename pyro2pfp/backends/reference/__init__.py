"""NumPy float64 reference executor of a :class:`~pyro2pfp.planning.plan.PlannedGraph`.

Each PFP op has one reference function registered with :func:`reference` (in its op family file,
``pyro2pfp/ops/<family>.py``); it receives the planned layer and the :class:`Activation` of each
input and returns the layer's output activation in the representation the plan asks for
(``layer.out_repr``).  The executor is the ground truth the compiled TVM module is tested against.
"""
from ._core import (
    NUMPY_BACKEND,
    REFERENCES,
    SCHEME_EXECUTORS,
    Activation,
    NumpyBackend,
    emit_output,
    execute,
    execute_all,
    reference,
)

__all__ = ["NUMPY_BACKEND", "REFERENCES", "SCHEME_EXECUTORS", "Activation", "NumpyBackend", "emit_output", "execute",
           "execute_all", "reference"]
