"""The files the commands read and write: input arrays, example arguments, models to run, output
paths; and :class:`CLIError`, a user error the command line reports in one line."""
from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import PFPError
from ..runtime import deploy

LIBRARY_EXTS = (".so", ".tar")


class CLIError(PFPError):
    """A user error reported by the command line (message only, no traceback)."""


def _open_arrays(path: str, what: str) -> Any:
    """``np.load(path)`` (no pickles) of the ``what`` file: an array or an ``NpzFile``."""
    if not os.path.isfile(path):
        raise CLIError(f"{what} file '{path}' not found")
    try:
        return np.load(path, allow_pickle=False)
    except Exception as exc:
        raise CLIError(f"cannot read {what} '{path}' as a NumPy .npy/.npz file: {exc}") from None


def load_array(path: str, what: str) -> np.ndarray:
    """The array of a ``.npy`` file, or of a ``.npz`` file's ``x`` (``x_var`` for the input variance, or
    its only array)."""
    data = _open_arrays(path, what)
    if isinstance(data, np.lib.npyio.NpzFile):
        with data:
            keys = list(data.keys())
            key = "x_var" if what == "input variance" and "x_var" in keys else "x" if "x" in keys else None
            if key is None and len(keys) == 1:
                key = keys[0]
            if key is None:
                raise CLIError(f"{path} holds arrays {keys}; name the input 'x' (np.savez(path, x=...))")
            data = data[key]
    return data


def load_example(path: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``--example FILE``: the arguments of one call of the model and guide, for ``convert(...,
    example_args=..., example_kwargs=...)``: a ``.npy`` (the input batch) or a ``.npz`` whose unnamed
    arrays (``np.savez(path, x, y)``: ``arr_0``, ``arr_1``, …) are the positional arguments in order and
    named ones the keyword arguments."""
    data = _open_arrays(path, "example")
    if not isinstance(data, np.lib.npyio.NpzFile):
        return (data,), {}
    with data:
        arrays = {key: data[key] for key in data.keys()}
    positional = sorted((k for k in arrays if k.startswith("arr_") and k[4:].isdigit()), key=lambda k: int(k[4:]))
    args = tuple(arrays[k] for k in positional)
    kwargs = {k: v for k, v in arrays.items() if k not in positional}
    if not args and "x" in kwargs:
        args = (kwargs.pop("x"),)
    if not args:
        raise CLIError(f"{path} holds arrays {sorted(arrays)}: save the input batch first, e.g. "
                       "np.savez(path, x, y) (positional arguments) or np.savez(path, x=x, y=y)")
    return args, kwargs


def _batched(x: np.ndarray, input_shape: tuple[int, ...], name: str) -> np.ndarray:
    if x.ndim == len(input_shape) and tuple(x.shape) == tuple(input_shape):
        print(f"note: {name} has the shape of one input {x.shape}; treating it as a batch of 1", file=sys.stderr)
        return x[None]
    return x


def load_predictor(path: str) -> Any:
    """A compiled library (.so/.tar) or an ONNX model (onnxruntime), both via :func:`pyro2pfp.load`."""
    if not os.path.isfile(path):
        raise CLIError(f"model file '{path}' not found")
    ext = os.path.splitext(path)[1].lower()
    if ext in (*LIBRARY_EXTS, ".onnx"):
        return deploy.load(path)
    raise CLIError(f"'{path}': expected a .so / .tar library (pyro2pfp convert -o net.so) or a .onnx model")


def _check_output_path(path: str, exts: Sequence[str], what: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in exts:
        raise CLIError(f"output '{path}': {what} must end in {' or '.join(exts)}")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise CLIError(f"output directory '{directory}' does not exist")
    return ext
