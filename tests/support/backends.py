"""Running a PFP network in the other back ends and comparing with the float64 reference."""
from __future__ import annotations

import numpy as np

#: compiled (float32 TVM) against the float64 reference: ``|got - ref| <= RTOL * max|ref|`` per output
RTOL = 2e-5
#: onnxruntime's Erf/Exp (ReLU and Clark-max moments) are less exact than the TVM kernels'
ONNX_RTOL = 1e-4


def assert_matches(got: tuple[np.ndarray, np.ndarray], want: tuple[np.ndarray, np.ndarray],
                   rtol: float = RTOL) -> None:
    """Mean and variance of ``got`` within ``rtol`` times the largest magnitude of ``want``'s."""
    for g, w, what in zip(got, want, ("mean", "var")):
        scale, err = np.abs(w).max(), np.abs(g - w).max()
        assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol} x {scale:.3g}"


def onnx_run(net, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``net.to_onnx()`` run by onnxruntime on ``x``: ``(mean, var)``."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(net.to_onnx().SerializeToString(), opts, providers=["CPUExecutionProvider"])
    mean, var = sess.run(None, {"x": x})
    return mean, var
