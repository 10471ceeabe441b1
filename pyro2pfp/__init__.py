"""pyro2pfp: Pyro Bayesian neural networks → compiled Probabilistic Forward Pass networks (TVM).

>>> net = pyro2pfp.convert(model, guide, input_shape=(1, 28, 28), calibration=1.0)
>>> mean, var = net.reference(x)      # float64 NumPy
>>> exe = net.compile("native"); mean32, var32 = exe(x)
>>> exe = net.compile("native", tune=10)   # + MetaSchedule-tuned executable for batch 10 (cached)
>>> print(exe.profile(x))                  # time per kernel

Importing the package is cheap: the converter (``convert``, ``PFPNetwork``, and what ``diagnose`` calls,
which need torch and Pyro) is imported when first used, and with it the op registry (``pyro2pfp.ops``).
The package is a plain module object (PEP 562 ``__getattr__`` for the lazy names), so it and its objects
pickle by reference with the standard pickle and cloudpickle (Ray ships them to workers that way).
:func:`load` (an exported library, or an ONNX model run with onnxruntime), the uncertainty metrics,
the errors and the option Enums (:mod:`pyro2pfp.options`) need only NumPy (and the TVM runtime to run
a library), so a board runs exported networks without torch, Pyro or the TVM compiler installed.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__
from .calibration import calibrate, predictive_uncertainty
from .diagnosis import diagnose
from .errors import (
    ArgumentError,
    FidelityError,
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
    converter_not_installed,
)
from .options import Correlation, Head, Hermite, Injection, MaxPool, MomentForm, SharedFactor
from .planning.graph import Repr
from .runtime.deploy import load
from .runtime.predictor import set_num_threads as _set
from .runtime.uncertainty import auroc, uncertainty, uncertainty_from_logit_samples

if TYPE_CHECKING:
    from . import correlation as correlation
    from . import ops as ops
    from .analysis.mc_compare import Diagnosis
    from .network import PFPNetwork, convert

#: Attributes imported on first use (PEP 562): the converter and what needs torch and Pyro.  None of them
#: is named like a submodule: importing ``pyro2pfp.<name>`` binds the package's attribute ``<name>`` to the
#: submodule, so no public function shares its name with a module of the package's top level.
_LAZY = {"convert": "network", "PFPNetwork": "network", "Diagnosis": "analysis.mc_compare"}


def __getattr__(name: str) -> Any:
    """``pyro2pfp.convert`` etc. (imported when first used) and any submodule (``pyro2pfp.network``)."""
    if name in _LAZY:
        try:
            module = importlib.import_module(f".{_LAZY[name]}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.partition(".")[0] == __name__:
                raise
            raise converter_not_installed(f"pyro2pfp.{name}", exc) from None
        value = getattr(module, name)
    elif name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    else:
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def set_num_threads(n: int) -> int:
    """Set the threads of the compiled networks' CPU kernels (process-wide;
    :func:`pyro2pfp.runtime.predictor.set_num_threads`).

    Parameters
    ----------
    n
        Threads for every later call: at most the size of TVM's thread pool, which is fixed when it
        starts (set ``TVM_NUM_THREADS`` before the first run for more; a warning says so).

    Returns
    -------
    int
        The number of threads now in use.

    Raises
    ------
    ArgumentError
        When ``n`` is not a positive int.
    """
    return _set(n)


__all__ = ["convert", "load", "PFPNetwork", "Repr", "PFPError", "UnsupportedLayerError", "PosteriorError",
           "InputShapeError", "TracingError", "NumericalError", "LoadError", "LibraryNotFoundError",
           "ArgumentError", "RemoteError", "TuningError", "InternalError", "uncertainty",
           "uncertainty_from_logit_samples", "predictive_uncertainty", "auroc", "calibrate", "set_num_threads",
           "diagnose", "Diagnosis", "PFPWarning", "FidelityError", "FidelityWarning", "Correlation", "SharedFactor",
           "MomentForm", "MaxPool", "Head", "Hermite", "Injection"]
