"""pyro2pfp: Pyro Bayesian neural networks → compiled Probabilistic Forward Pass networks (TVM).

>>> net = pyro2pfp.convert(model, guide, input_shape=(1, 28, 28), calibration=1.0)
>>> mean, var = net.reference(x)      # float64 NumPy
>>> exe = net.compile("native"); mean32, var32 = exe(x)
>>> exe = net.compile("native", tune=10)   # + MetaSchedule-tuned executable for batch 10 (cached)
>>> print(exe.profile(x))                  # time per kernel
"""
from . import correlation as correlation  # shared-factor PFP: registers its executor with the reference
from . import ops as ops  # the op registry: every op family registers its converter, reference, ONNX export
from ._version import __version__ as __version__
from .deploy import load
from .diagnose import Diagnosis, diagnose
from .errors import (
    ArgumentError,
    FidelityWarning,
    InputShapeError,
    InternalError,
    LibraryNotFoundError,
    LoadError,
    NumericalError,
    PFPError,
    PFPWarning,
    PosteriorError,
    RemoteError,
    TracingError,
    TuningError,
    UnsupportedLayerError,
)
from .graph import Repr
from .network import PFPNetwork, convert
from .uncertainty import auroc, calibrate, predictive_uncertainty, uncertainty, uncertainty_from_logit_samples


def set_num_threads(n: int) -> int:
    """Threads of the compiled networks' CPU kernels (process-wide; see
    :func:`pyro2pfp.tvm_backend.runtime.set_num_threads`)."""
    from .tvm_backend.runtime import set_num_threads as _set

    return _set(n)


__all__ = ["convert", "load", "PFPNetwork", "Repr", "PFPError", "UnsupportedLayerError", "PosteriorError",
           "InputShapeError", "TracingError", "NumericalError", "LoadError", "LibraryNotFoundError",
           "ArgumentError", "RemoteError", "TuningError", "InternalError", "uncertainty",
           "uncertainty_from_logit_samples", "predictive_uncertainty", "auroc", "calibrate", "set_num_threads",
           "diagnose", "Diagnosis", "PFPWarning", "FidelityWarning"]
