"""Exceptions raised by pyro2pfp.

Every error a user can trigger derives from :class:`PFPError`, so ``except pyro2pfp.PFPError``
catches them all.  Messages name the offending module path, sample site or shape.
"""
from __future__ import annotations


class PFPError(Exception):
    """Base class of all pyro2pfp errors."""


class UnsupportedLayerError(PFPError):
    """The traced model contains an operation PFP cannot represent (names module path and op)."""


class PosteriorError(PFPError):
    """The guide's posterior cannot be used by PFP (not mean-field Gaussian, missing site, bad shape)."""


class InputShapeError(PFPError):
    """The input shape is missing, or an input does not have the shape the network was built for."""


class TracingError(PFPError):
    """The model could not be traced into a graph of torch operations."""


class NumericalError(PFPError):
    """A computation left its number format: e.g. the compiled network's float32 outputs overflowed."""


class LoadError(PFPError):
    """A file cannot be loaded: an exported library or its metadata, an ONNX model, a builder or a param
    store (names the path and what is wrong)."""


class LibraryNotFoundError(LoadError, FileNotFoundError):
    """The library file to load does not exist."""


class TuningError(PFPError, RuntimeError):
    """Tuning cannot run (environment, another CPU architecture, a module without a batch axis)."""


class ArgumentError(PFPError, ValueError):
    """An argument of a public function has the wrong type or value (the message says what is
    expected).  Also a ``ValueError``, for callers that catch that."""


class RemoteError(PFPError, RuntimeError):
    """A remote board (TVM RPC tracker or server) cannot be reached, has no server under the key
    asked for, or did not answer within the session timeout."""


class FidelityError(PFPError):
    """The converted network is grossly unlike what the trained model computes: its parameters differ from
    the param store's, or its output moments are further from sampling the guide than the spot check's
    sample count can explain (``convert(..., check=False)`` skips the spot check; the message names the first
    layer that departs and the figures)."""


class PFPWarning(UserWarning):
    """Base class of the warnings pyro2pfp issues about a converted network (filter them with
    ``warnings.simplefilter(..., pyro2pfp.PFPWarning)``)."""


class FidelityWarning(PFPWarning):
    """``convert(..., check=x)``: the network's output moments differ from sampling the guide by more
    than the sample count explains (the message names the first layer outside the bounds and the figures)."""


def converter_not_installed(what: str, exc: ModuleNotFoundError) -> PFPError:
    """The error for ``what`` (``"pyro2pfp.convert"``) needing a module that this installation lacks
    (``exc``): a runtime-only installation (a board, a scoring worker) runs exported libraries only."""
    return PFPError(f"{what} needs {exc.name}, which is not installed: converting a Pyro model "
                    "needs pyro2pfp's dependencies (torch, Pyro, SciPy, ...: pip install pyro2pfp); this "
                    "installation runs exported libraries only (pyro2pfp.load)")


def brief(exc: BaseException, limit: int = 300) -> str:
    """``"TypeName: first line of the message"`` of a foreign exception, to quote in a PFPError.

    torch and Pyro put tensor values and trace-shape tables on the lines after the first (e.g. a
    failed constraint check prints the offending tensor); a PFPError names the site, the shape and a
    count instead, so only the first line is quoted, at most ``limit`` characters long.
    """
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    first = lines[0] if lines else ""
    first = first.split(", but found invalid values")[0]
    if len(first) > limit:
        first = first[:limit - 1] + "…"
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


class InternalError(PFPError):
    """pyro2pfp failed in a way it does not anticipate -- a bug, not the user's mistake.  The message names
    the layer or stage it happened in and asks for a report; the original exception is chained."""
