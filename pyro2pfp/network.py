"""The public entry point: :func:`convert` and the :class:`PFPNetwork` it returns."""
from __future__ import annotations

from typing import Any

import numpy as np

from .converters import build_layer_graph
from .errors import InputShapeError, PosteriorError
from .graph import LayerGraph, Repr
from .plan import PlannedGraph, plan
from .reference import execute
from .tracing import trace_model


def as_input_array(x: Any, input_shape: tuple[int, ...], name: str = "x",
                   dtype: Any = np.float32) -> np.ndarray:
    """A contiguous array of shape (batch, *input_shape) from a NumPy array or torch tensor."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    x = np.asarray(x)
    if x.ndim == len(input_shape):  # a single example
        raise InputShapeError(
            f"{name} has shape {x.shape}; the network takes a batch (batch, {', '.join(map(str, input_shape))}). "
            f"Use {name}[None] for a single example.")
    if x.ndim != len(input_shape) + 1 or tuple(x.shape[1:]) != tuple(input_shape) or x.shape[0] < 1:
        raise InputShapeError(
            f"{name} has shape {tuple(x.shape)}, expected (batch, {', '.join(map(str, input_shape))})")
    if x.dtype != dtype and (not np.issubdtype(x.dtype, np.number) or np.iscomplexobj(x)):
        raise InputShapeError(f"{name} must be real numbers, got dtype {x.dtype}")
    x = np.ascontiguousarray(x, dtype=dtype)
    if not np.isfinite(x).all():
        raise InputShapeError(f"{name} contains NaN or infinite values")
    return x


class PFPNetwork:
    """A converted network: the planned layer graph, its Relax IRModule and a NumPy reference.

    ``net.mod``: ``tvm.IRModule`` whose ``main(x)`` maps ``x: (batch, *input_shape) float32`` to
    ``(mean, var)`` of the logits.  ``net.reference(x)``: the same network in float64 NumPy.
    ``net.compile(target)``: a compiled predictor.  ``print(net)`` shows the layer plan.
    """

    def __init__(self, layer_graph: LayerGraph, planned: PlannedGraph, *, fuse: bool = True) -> None:
        self.layer_graph = layer_graph
        self.plan = planned
        self.fuse = fuse  # ReLUs after dense layers computed in the dense kernel (tvm_backend.fused_activations)
        self._mod = None

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.plan.input_shape

    @property
    def input_variance(self) -> bool:
        return self.plan.input_repr is not Repr.DETERMINISTIC

    @property
    def calibration(self) -> float:
        return self.plan.calibration

    @property
    def mod(self):
        """The Relax IRModule (built on first access; importing TVM takes a few seconds)."""
        if self._mod is None:
            from .tvm_backend import emit_module

            self._mod = emit_module(self.plan, fuse=self.fuse)
        return self._mod

    def reference(self, x: Any, x_var: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """Float64 NumPy execution: ``(mean, var)`` of the logits, each (batch, classes)."""
        xs = as_input_array(x, self.input_shape, dtype=np.float64)
        if self.input_variance:
            if x_var is None:
                raise InputShapeError("this network was converted with input_variance=True: pass x_var")
            x_var = as_input_array(x_var, self.input_shape, "x_var", dtype=np.float64)
            if np.any(x_var < 0):
                raise InputShapeError("x_var must be non-negative")
        return execute(self.plan, xs, x_var)

    def compile(self, target: Any = "native", *, tune: Any = None, schedule: bool = True,
                num_threads: int | None = None, remote: Any = None):
        """Compile ``mod`` for ``target``: ``"native"`` (default: this machine's CPU and its full
        instruction set, e.g. AVX-512), ``"llvm"`` (generic x86-64: SSE2 only, portable, slower),
        a board preset (``"aarch64"``, ``"rpi3"``, ``"rpi4"``, ``"rpi5"``), a TVM tag, a dict or a
        ``tvm.target.Target``.

        Returns a :class:`~pyro2pfp.tvm_backend.runtime.CompiledPFP`: ``exe(x) -> (mean, var)``
        as float32 NumPy arrays, any batch size, every kernel with its default CPU schedule;
        ``exe.profile(x)`` times each kernel; ``exe.export_library("net.so")`` writes it for
        ``pyro2pfp.load``.  For another CPU architecture the predictor only exports.

        ``tune``: also auto-tune with MetaSchedule for the batch sizes named -- ``tune=10``,
        ``tune=[1, 10]`` or ``tune={"batch": 10, "trials": 64, "work_dir": ...}`` (see
        :func:`pyro2pfp.tuning.tune`).  Tuning results are cached on disk (keyed by network
        structure, target and batch: the second compile reuses them); calls with a tuned batch
        size run the tuned executable, each kernel the fastest correct of its tuned and default
        schedules.  ``num_threads``: TVM threads (process-wide, default: the physical cores).
        ``schedule=False`` skips the default CPU schedules (naive loops; for debugging).
        ``remote``: with ``tune``, measure the candidates on boards through TVM RPC --
        ``"tracker-host:9190/rpi4"``, ``"server-host:9090"`` or a :class:`pyro2pfp.remote.Remote`
        (the tuning database is then keyed by the board key as well as the target).
        """
        from .deploy import compile_network

        if remote is not None:
            from .tuning import with_remote

            tune = with_remote(tune, remote)
        return compile_network(self, target, schedule=schedule, tune=tune, num_threads=num_threads)

    def to_onnx(self, path: Any = None, *, opset: int = 17):
        """Write the network as an ONNX model (standard operators; inputs ``x`` [, ``x_var``],
        outputs ``mean``, ``var``; dynamic batch), checked with ``onnx.checker``; returns the
        ``onnx.ModelProto``."""
        from .onnx_export import to_onnx

        return to_onnx(self, path, opset=opset)

    def summary(self) -> str:
        """The layer plan as a table."""
        return self.plan.summary()

    def __repr__(self) -> str:
        return f"PFPNetwork(input_shape={self.input_shape}, layers={len(self.plan.layers)})\n{self.summary()}"


def convert(model: Any, guide: Any = None, *, input_shape: tuple[int, ...] | None = None,
            calibration: float = 1.0, moment_form: str = "variance",
            input_variance: bool = False) -> PFPNetwork:
    """Convert a Pyro BNN (``model``, trained ``guide``) into a PFP network.

    Traces ``model`` (a ``PyroModule``) over a deterministic copy holding the posterior means, reads
    the posterior variances from ``guide`` through its own API, maps the traced torch ops to PFP
    layers, plans the (variance / raw moment) representation of every edge and multiplies every
    weight and bias variance by ``calibration``.

    ``input_shape`` is the shape of one input without the batch dimension; it may be omitted when
    the first layer is a Linear layer.

    ``moment_form="variance"`` (default) carries variances on every edge (cancellation-free in
    float32); ``"raw"`` is the paper's plan (compute layers take raw second moments, ``E[w²]``
    precomputed), which loses variances smaller than ~1e-7·mean² in float32.

    A TyXe ``VariationalBNN`` may be passed alone (``convert(bnn)``); its ``net`` and
    ``net_guide`` are used.

    ``input_variance=True`` gives a network whose ``main`` takes ``(x, x_var)``: input (sensor)
    noise is propagated through the whole network, and the first layer uses the full form.
    """
    if guide is None and hasattr(model, "net") and hasattr(model, "net_guide"):  # TyXe VariationalBNN
        model, guide = model.net, model.net_guide
    if guide is None and hasattr(model, "named_modules"):
        raise PosteriorError("convert(model, guide) needs the trained guide that holds the posterior")
    traced = trace_model(model, guide, input_shape)
    layer_graph = build_layer_graph(traced)
    layer_graph.input_variance = bool(input_variance)
    return PFPNetwork(layer_graph, plan(layer_graph, calibration, moment_form))
