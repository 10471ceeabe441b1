"""Run an exported ONNX model (``net.to_onnx(path)``, ``pyro2pfp convert -o net.onnx``) with onnxruntime,
with the same input checks as the compiled predictor.

>>> exe = pyro2pfp.load("net.onnx")        # an OnnxPredictor
>>> mean, var = exe(x)                     # float32 NumPy arrays (probs etc. with the uncertainty head)

Needs ``onnx`` and ``onnxruntime`` only (no torch, Pyro or TVM), imported when a model is loaded.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..errors import LoadError, brief
from .inputs import checked_inputs, compiled_outputs

__all__ = ["OnnxPredictor"]


class OnnxPredictor:
    """An onnxruntime session over a pyro2pfp ONNX model: ``exe(x[, x_var]) -> (mean, var)``.

    The input shape comes from the model's ``pyro2pfp.input_shape`` metadata (else from the static
    dimensions of its input ``x``); it takes an input variance when the model has the input ``x_var``.
    Inputs are checked as :class:`~pyro2pfp.runtime.predictor.CompiledPFP` checks them (shape, real, finite,
    within float32 range); a model converted with ``head="probs"`` returns a
    :class:`~pyro2pfp.ops.head.HeadOutput`.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        path = os.fspath(path)
        try:
            import onnx
            import onnxruntime as ort
        except ModuleNotFoundError as exc:
            raise LoadError(f"loading {path} needs {exc.name}, which is not installed: "
                            "pip install onnx onnxruntime") from None
        try:
            model = onnx.load(path)
        except Exception as exc:  # noqa: BLE001 -- onnx raises its parser's errors
            raise LoadError(f"{path} is not an ONNX model ({brief(exc)})") from None
        props = {p.key: p.value for p in model.metadata_props}
        names = [i.name for i in model.graph.input]
        if "x" not in names:
            raise LoadError(f"{path} has inputs {names}; a pyro2pfp ONNX model has input 'x'")
        if "pyro2pfp.input_shape" in props:
            self.input_shape = tuple(int(d) for d in props["pyro2pfp.input_shape"].split(","))
        else:
            dims = model.graph.input[0].type.tensor_type.shape.dim[1:]
            self.input_shape = tuple(int(d.dim_value) for d in dims)
        self.input_variance = "x_var" in names
        self.path = path
        try:
            self.session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 -- onnxruntime's own errors
            raise LoadError(f"onnxruntime cannot load {path}: {brief(exc)}") from None
        self.output_names = [o.name for o in self.session.get_outputs()]
        # "probs": converted with the uncertainty head (pyro2pfp.ops.head): outputs (probs, uncertainty)
        self.head: str | None = "probs" if self.output_names == ["probs", "uncertainty"] else None

    def __call__(self, x: Any, x_var: Any = None) -> Any:
        """``(mean, var)`` of the logits; with the uncertainty head (``self.head == "probs"``) a
        :class:`~pyro2pfp.ops.head.HeadOutput`."""
        arrays = checked_inputs(x, x_var, self.input_shape, self.input_variance, np.float32)
        mean, var = self.session.run(self.output_names if self.head else ["mean", "var"],
                                     dict(zip(("x", "x_var"), arrays, strict=False)))
        return compiled_outputs(mean, var, self.head)
