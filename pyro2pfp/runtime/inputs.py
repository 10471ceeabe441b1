"""Input and output checks shared by the NumPy reference and the compiled predictor (one place)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import InputShapeError, NumericalError
from .outputs import head_output

FLOAT32_MAX = float(np.finfo(np.float32).max)


def sum_of_squares_finite(a: np.ndarray) -> bool:
    """``True`` only if every value of the contiguous float array ``a`` is finite: one BLAS dot
    ``Σ a²`` (IEEE: a NaN term or sum stays NaN, ``±inf² = +inf``, and with no negative term nothing
    cancels).  ``False`` also when finite values overflow the sum (|a| ≳ 1.8e19 in float32): callers
    then check element-wise.  Cheaper than a float64 sum or ``np.isfinite(a).all()`` (no temporary
    array) -- it is on every call of the compiled predictor."""
    flat = a.reshape(-1)
    return math.isfinite(np.dot(flat, flat))


def _to_numpy(x: Any, name: str) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor; half-precision types convert to float32 exactly
        import torch

        if x.dtype in (torch.bfloat16, torch.float16):
            x = x.float()
        elif x.is_complex():
            raise InputShapeError(f"{name} must be real numbers, got a torch tensor of dtype {x.dtype}")
        x = x.detach().cpu().numpy()
    try:
        return np.asarray(x)
    except Exception as exc:  # ragged lists, objects
        raise InputShapeError(f"{name} cannot be read as a numeric array: {type(exc).__name__}: {exc}") from None


def as_input_array(x: Any, input_shape: tuple[int, ...], name: str = "x", dtype: Any = np.float32) -> np.ndarray:
    """A contiguous array of shape (batch, *input_shape) and ``dtype`` from a NumPy array, a nested
    list or a torch tensor (bfloat16/float16 converted exactly), with clear errors for anything else:
    wrong shape, non-real dtype, NaN/inf, and (for float32) finite values beyond float32's range."""
    if (type(x) is np.ndarray and x.dtype == dtype and x.dtype.kind == "f" and x.shape[1:] == input_shape
            and x.ndim == len(input_shape) + 1 and x.shape[0] >= 1 and x.flags.c_contiguous
            and sum_of_squares_finite(x)):
        return x  # the common call: a batch already of the network's dtype, every value finite
    x = _to_numpy(x, name)
    if x.ndim == len(input_shape) and tuple(x.shape) == tuple(input_shape):  # a single example
        raise InputShapeError(
            f"{name} has shape {x.shape}; the network takes a batch (batch, {', '.join(map(str, input_shape))}). "
            f"Use {name}[None] for a single example.")
    if x.ndim != len(input_shape) + 1 or tuple(x.shape[1:]) != tuple(input_shape) or x.shape[0] < 1:
        raise InputShapeError(
            f"{name} has shape {tuple(x.shape)}, expected (batch, {', '.join(map(str, input_shape))})")
    if not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_) or np.iscomplexobj(x):
        raise InputShapeError(f"{name} must be real numbers, got dtype {x.dtype}")
    if x.dtype.kind == "f":  # integers and booleans are always finite and within float32's range
        if not np.isfinite(x).all():
            bad = int(x.size - np.count_nonzero(np.isfinite(x)))
            raise InputShapeError(f"{name} contains {bad} NaN or infinite value(s)")
        if np.dtype(dtype) == np.float32 and x.dtype.itemsize > 4 and x.size:
            largest = float(np.abs(x).max())
            if largest > FLOAT32_MAX:
                raise InputShapeError(
                    f"{name} has finite values up to {largest:.3g}, beyond float32's range ({FLOAT32_MAX:.3g}); "
                    "the compiled network computes in float32. net.reference(x) computes in float64.")
    return np.ascontiguousarray(x, dtype=dtype)


def checked_inputs(x: Any, x_var: Any, input_shape: tuple[int, ...], input_variance: bool,
                   dtype: Any) -> tuple[np.ndarray, ...]:
    """``(x,)`` or ``(x, x_var)`` as arrays of ``dtype``, checked against the network's signature."""
    arrays = [as_input_array(x, input_shape, dtype=dtype)]
    if not input_variance:
        if x_var is not None:
            raise InputShapeError(
                "x_var was given, but this network was converted without input variance, so it would be "
                "ignored; convert(..., input_variance=True) propagates input (sensor) noise")
        return tuple(arrays)
    if x_var is None:
        raise InputShapeError("this network was converted with input_variance=True: pass x_var too")
    var = as_input_array(x_var, input_shape, "x_var", dtype=dtype)
    if var.shape != arrays[0].shape:
        raise InputShapeError(f"x_var has shape {var.shape}, x has {arrays[0].shape}: they must match")
    if np.any(var < 0):
        raise InputShapeError("x_var must be non-negative")
    return (*arrays, var)


def compiled_outputs(first: np.ndarray, second: np.ndarray, head: str | None) -> Any:
    """What a compiled predictor (here or on a board) returns for its module's two float32 outputs:
    checked finite (:func:`check_finite_outputs`), ``(mean, var)`` of the logits, or for a network
    with the uncertainty head (``head == "probs"``) a :class:`~pyro2pfp.ops.head.HeadOutput`."""
    check_finite_outputs(first, second)
    if head is None:
        return first, second

    return head_output(first, second)


def check_finite_outputs(mean: np.ndarray, var: np.ndarray) -> None:
    """Raise :class:`NumericalError` if the compiled network's float32 outputs are not all finite."""
    if sum_of_squares_finite(mean) and sum_of_squares_finite(var):
        return
    if np.isfinite(mean).all() and np.isfinite(var).all():  # finite values beyond 1.8e19
        return
    parts = []
    for name, out in (("mean", mean), ("var", var)):
        bad = ~np.isfinite(out)
        if bad.any():
            rows = np.unique(np.nonzero(bad)[0])[:5].tolist()
            parts.append(f"{int(bad.sum())} of {out.size} {name} entries (rows {rows})")
    raise NumericalError(
        f"the compiled network's outputs are not finite: {', '.join(parts)}. Its float32 intermediates "
        "overflowed (inputs or posterior scales too large for float32, max 3.4e38); net.reference(x) "
        "computes the same network in float64.")
