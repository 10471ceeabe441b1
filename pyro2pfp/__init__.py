"""pyro2pfp: Pyro Bayesian neural networks → compiled Probabilistic Forward Pass networks (TVM).

>>> net = pyro2pfp.convert(model, guide, input_shape=(1, 28, 28), calibration=1.0)
>>> mean, var = net.reference(x)      # float64 NumPy
>>> exe = net.compile("native"); mean32, var32 = exe(x)
>>> exe = net.compile("native", tune=10)   # + MetaSchedule-tuned executable for batch 10 (cached)
>>> print(exe.profile(x))                  # time per kernel

Importing the package is cheap: the converter (``convert``, ``PFPNetwork``, ``diagnose``, which need
torch and Pyro) is imported when first used, and with it the op registry (``pyro2pfp.ops``).
:func:`load` (an exported library, or an ONNX model run with onnxruntime), the uncertainty metrics,
the errors and the option Enums (:mod:`pyro2pfp.options`) need only NumPy (and the TVM runtime to run
a library), so a board runs exported networks without torch, Pyro or the TVM compiler installed.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__
from .deploy import load
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
)
from .graph import Repr
from .options import Correlation, Head, Hermite, Injection, MaxPool, MomentForm, SharedFactor
from .uncertainty import auroc, calibrate, predictive_uncertainty, uncertainty, uncertainty_from_logit_samples

if TYPE_CHECKING:
    from . import correlation as correlation
    from . import ops as ops
    from .diagnose import Diagnosis, diagnose
    from .network import PFPNetwork, convert

#: Attributes imported on first use (PEP 562): the converter and what needs torch and Pyro.
_LAZY = {"convert": "network", "PFPNetwork": "network", "diagnose": "diagnose", "Diagnosis": "diagnose"}


def __getattr__(name: str) -> Any:
    """``pyro2pfp.convert`` etc. (imported when first used) and any submodule (``pyro2pfp.network``)."""
    if name in _LAZY:
        try:
            module = importlib.import_module(f".{_LAZY[name]}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.partition(".")[0] == __name__:
                raise
            raise PFPError(f"pyro2pfp.{name} needs {exc.name}, which is not installed: converting a Pyro model "
                           "needs pyro2pfp's dependencies (torch, Pyro, SciPy, ...: pip install pyro2pfp); this "
                           "installation runs exported libraries only (pyro2pfp.load)") from None
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


class _Package(types.ModuleType):
    """``pyro2pfp.diagnose`` stays the function when its module, ``pyro2pfp.diagnose``, is imported
    (the import system sets a package's attribute to each submodule it loads)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if (_LAZY.get(name) == name and isinstance(value, types.ModuleType)
                and value.__name__ == f"{__name__}.{name}"):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def set_num_threads(n: int) -> int:
    """Threads of the compiled networks' CPU kernels (process-wide; see
    :func:`pyro2pfp.predictor.set_num_threads`)."""
    from .predictor import set_num_threads as _set

    return _set(n)


__all__ = ["convert", "load", "PFPNetwork", "Repr", "PFPError", "UnsupportedLayerError", "PosteriorError",
           "InputShapeError", "TracingError", "NumericalError", "LoadError", "LibraryNotFoundError",
           "ArgumentError", "RemoteError", "TuningError", "InternalError", "uncertainty",
           "uncertainty_from_logit_samples", "predictive_uncertainty", "auroc", "calibrate", "set_num_threads",
           "diagnose", "Diagnosis", "PFPWarning", "FidelityError", "FidelityWarning", "Correlation", "SharedFactor",
           "MomentForm", "MaxPool", "Head", "Hermite", "Injection"]
