"""The TVM side of the PFP ops, one file per op family (matching ``pyro2pfp/ops/<family>.py``): each
registers its ops' TE kernels (:func:`~pyro2pfp.backends.tvm.kernel`) and default CPU schedules
(:func:`~pyro2pfp.backends.tvm.schedule`), and the TE kernels of their shared-factor rules
(``registry.shared_kernel``; ``compute_shared.py``, ``pooling_shared.py``: those of the compute layers and
of pooling)."""
from . import (  # noqa: F401  (registers the kernels)
    activation,
    arithmetic,
    compute,
    compute_shared,
    concat,
    head,
    normalization,
    pooling,
    pooling_shared,
    shape,
    window_covariance,
)
