"""Registry, activation type, the NumPy back end and the executor loop of the NumPy reference.

The references of the ops are registered from the op family files (``pyro2pfp/ops/<family>.py``);
``import pyro2pfp`` loads them before anything can call :func:`execute`."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ... import moments
from ...errors import PFPError
from ...planning.graph import INPUT, Repr
from ...planning.plan import PlannedGraph, PlannedLayer
from ...planning.registry import add_to
from .arrays import LOWEST, conv2d_nchw


@dataclass
class Activation:
    """A batch of independent Gaussians: ``mean`` and ``second`` (None when deterministic)."""

    mean: np.ndarray
    second: np.ndarray | None
    repr: Repr

    def variance(self) -> np.ndarray:
        if self.repr is Repr.DETERMINISTIC:
            return np.zeros_like(self.mean)
        assert self.second is not None  # carried by every non-deterministic activation
        if self.repr is Repr.VARIANCE:
            return self.second
        return moments.second_to_variance(self.mean, self.second)

    def second_moment(self) -> np.ndarray:
        if self.repr is Repr.SECOND_MOMENT:
            assert self.second is not None
            return self.second
        return moments.variance_to_second(self.mean, self.variance())


def emit_output(mean: np.ndarray, var: np.ndarray, layer: PlannedLayer) -> Activation:
    """Package a layer's (mean, variance) in the representation the plan asks it to emit."""
    if layer.out_repr is Repr.VARIANCE:
        return Activation(mean, var, Repr.VARIANCE)
    if layer.out_repr is Repr.SECOND_MOMENT:
        return Activation(mean, moments.variance_to_second(mean, var), Repr.SECOND_MOMENT)
    return Activation(mean, None, Repr.DETERMINISTIC)


class NumpyBackend:
    """The float64 NumPy back end of the formulas shared with the ONNX exporter (``pyro2pfp.ops``):
    ``ops`` is :data:`pyro2pfp.moments.NUMPY`, constants are the arrays themselves, linear maps are
    NumPy matmuls and convolutions.  (The ONNX twin is ``backends.onnx.builder.OnnxContext``.)"""

    ops = moments.NUMPY
    #: the identity of a max fold's mean (padded window taps)
    lowest = LOWEST

    @staticmethod
    def variance(x: Activation) -> np.ndarray:
        return x.variance()

    @staticmethod
    def second_moment(x: Activation) -> np.ndarray:
        return x.second_moment()

    @staticmethod
    def emit(mean: np.ndarray, var: np.ndarray, layer: PlannedLayer) -> Activation:
        return emit_output(mean, var, layer)

    @staticmethod
    def deterministic(mean: np.ndarray) -> Activation:
        return Activation(mean, None, Repr.DETERMINISTIC)

    @staticmethod
    def tensor(array: np.ndarray, hint: str) -> np.ndarray:
        return np.asarray(array, dtype=np.float64)

    @staticmethod
    def dense(x: np.ndarray, weight: np.ndarray, hint: str) -> np.ndarray:
        """``x @ weight.T`` (weight in torch layout (out, in))."""
        return x @ weight.T

    @staticmethod
    def conv2d(x: np.ndarray, weight: np.ndarray, attrs: dict, hint: str) -> np.ndarray:
        return conv2d_nchw(x, weight, attrs["stride"], attrs["padding"], attrs["dilation"], attrs["groups"])

    @staticmethod
    def reshape(t: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """``t`` reshaped to ``(batch, *shape)``."""
        return t.reshape((t.shape[0], *shape))

    @staticmethod
    def concat(ts: list[np.ndarray], axis: int) -> np.ndarray:
        """``ts`` joined along per-sample axis ``axis`` (the batch axis kept first)."""
        return np.concatenate(ts, axis=axis + 1)

    @staticmethod
    def zeros_like(t: np.ndarray) -> np.ndarray:
        return np.zeros_like(t)

    # -- tensor algebra of the compact factor rules (``correlation/loadings.py``): every axis counted with the batch
    @staticmethod
    def einsum(equation: str, *ts: np.ndarray) -> np.ndarray:
        return np.einsum(equation, *ts, optimize=len(ts) > 2)

    @staticmethod
    def rows(t: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """``t`` reshaped to ``(-1, *shape)`` (the leading axis takes what is left: the batch, or the batch
        times some axes)."""
        return t.reshape((-1, *shape))

    @staticmethod
    def permute(t: np.ndarray, perm: tuple[int, ...]) -> np.ndarray:
        return np.transpose(t, perm)

    @staticmethod
    def rsum(t: np.ndarray, axis: int) -> np.ndarray:
        """The sum over ``axis`` (dropped)."""
        return t.sum(axis=axis)

    @staticmethod
    def slice(t: np.ndarray, axis: int, start: int, stop: int) -> np.ndarray:
        index = [slice(None)] * t.ndim
        index[axis] = slice(start, stop)
        return t[tuple(index)]

    @staticmethod
    def taps(t: np.ndarray, kernel: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int],
             begin: tuple[int, int], end: tuple[int, int], out_hw: tuple[int, int], fill: float) -> list[np.ndarray]:
        """The strided (B, C, OH, OW) view of ``t`` (B, C, H, W) at every kernel offset (row-major), ``t``
        padded by ``begin``/``end`` rows and columns of ``fill`` first."""
        tp = np.pad(t, ((0, 0), (0, 0), (begin[0], end[0]), (begin[1], end[1])), constant_values=fill)
        oh, ow = out_hw
        return [tp[:, :, i * dilation[0]:i * dilation[0] + stride[0] * (oh - 1) + 1:stride[0],
                   j * dilation[1]:j * dilation[1] + stride[1] * (ow - 1) + 1:stride[1]]
                for i in range(kernel[0]) for j in range(kernel[1])]

    @staticmethod
    def unfold(t: np.ndarray, channels: int, kernel: tuple[int, int], stride: tuple[int, int],
               dilation: tuple[int, int], begin: tuple[int, int], end: tuple[int, int], out_hw: tuple[int, int],
               fill: float) -> np.ndarray:
        """``(B, C·KH·KW, OH·OW)``: the views of :meth:`taps` as rows, channel-major (row ``c·KH·KW + tap``)."""
        views = NumpyBackend.taps(t, kernel, stride, dilation, begin, end, out_hw, fill)
        return np.stack(views, axis=2).reshape(t.shape[0], channels * len(views), out_hw[0] * out_hw[1])


    # -- of the shared-factor rules (``correlation/shared_algebra.py``)
    @staticmethod
    def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Batched matrix product over the last two axes (the leading ones broadcast)."""
        return np.matmul(a, b)

    @staticmethod
    def widened(g: np.ndarray, k_in: int, k: int) -> np.ndarray:
        """``g`` (..., k_in) with zero columns appended up to ``k``."""
        extra = k - g.shape[-1]
        return g if extra <= 0 else np.concatenate([g, np.zeros((*g.shape[:-1], extra))], axis=-1)

    @staticmethod
    def pad2d(t: np.ndarray, begin: tuple[int, int], end: tuple[int, int]) -> np.ndarray:
        """``t`` (B, C, H, W) with ``begin``/``end`` rows and columns of zeros."""
        return np.pad(t, ((0, 0), (0, 0), (begin[0], end[0]), (begin[1], end[1])))

    @staticmethod
    def window(t: np.ndarray, start: tuple[int, int], stride: tuple[int, int], out_hw: tuple[int, ...]) -> np.ndarray:
        """The strided (B, C, OH, OW) view of ``t`` (B, C, H, W) from ``start``."""
        (r0, c0), (sr, sc), (oh, ow) = start, stride, out_hw
        return t[:, :, r0:r0 + sr * (oh - 1) + 1:sr, c0:c0 + sc * (ow - 1) + 1:sc]

    @staticmethod
    def edge_shape(x: Activation, name: str) -> tuple[int, ...]:
        """The per-sample shape of input activation ``x`` (edge ``name``)."""
        return tuple(x.mean.shape[1:])

    @staticmethod
    def all_zero(t: np.ndarray) -> bool:
        """Whether every entry of ``t`` is zero (the values are known here: a shared part of zeros is dropped)."""
        return not t.any()


NUMPY_BACKEND = NumpyBackend()

RefFn = Callable[[PlannedLayer, list[Activation]], Activation]
REFERENCES: dict[str, RefFn] = {}


#: ``@reference(op)`` registers the NumPy reference function of PFP op ``op`` (once).
reference = add_to(REFERENCES, "reference of op")

SCHEME_EXECUTORS: dict[str, Callable[[PlannedGraph, np.ndarray], dict[str, Activation]]] = {}
"""Executors of the plans that are not mean-field, by correlation scheme (``"shared-factor"``,
``"compact-factor"``: registered by :mod:`pyro2pfp.correlation`, which builds on this module)."""


def execute(graph: PlannedGraph, x: np.ndarray, x_var: np.ndarray | None = None
            ) -> tuple[np.ndarray, np.ndarray]:
    """Run the planned network in float64; returns the output (mean, variance)."""
    result = execute_all(graph, x, x_var)[graph.output]
    return result.mean, result.variance()


def execute_all(graph: PlannedGraph, x: np.ndarray, x_var: np.ndarray | None = None
                ) -> dict[str, Activation]:
    """Run the planned network in float64; returns every layer's :class:`Activation` by name.

    A plan with a factor plan (``graph.factors``: ``correlation="shared-factor"`` or the compact factor
    plan) runs the executor registered in :data:`SCHEME_EXECUTORS` under the plan's ``scheme``
    (:func:`pyro2pfp.correlation.execute_shared_all`, :func:`pyro2pfp.correlation.compact.execute_compact_all`)."""
    x = np.asarray(x, dtype=np.float64)
    if graph.factors is not None:
        name = graph.factors.scheme
        scheme = SCHEME_EXECUTORS.get(name)
        if scheme is None:
            raise PFPError(f"no executor for correlation={name!r} is registered (import pyro2pfp)")
        return scheme(graph, x)
    if graph.input_repr is Repr.DETERMINISTIC:
        values = {INPUT: Activation(x, None, Repr.DETERMINISTIC)}
    else:
        if x_var is None:
            raise PFPError("this network takes (x_mean, x_var): pass the input variance too")
        values = {INPUT: Activation(x, np.asarray(x_var, dtype=np.float64), Repr.VARIANCE)}
    for layer in graph.layers:
        fn = REFERENCES.get(layer.op)
        if fn is None:
            raise PFPError(f"{layer.layer.source}: no NumPy reference for PFP op '{layer.op}'")
        with np.errstate(over="ignore"):  # α = μ/σ may overflow to ±inf; it is clamped
            out = fn(layer, [values[name] for name in layer.inputs])
        assert out.repr is layer.out_repr, (layer.name, out.repr, layer.out_repr)
        values[layer.name] = out
    return values
