"""The tensor algebra the shared-factor rules are written in, once for the float64 reference and the ONNX export.

A rule ``fn(bk, layer, inputs, shared, fp, var) -> (shared, var)`` (registered with
:func:`pyro2pfp.ops._formula.shared_formula` in its op family file) is written against a back end ``bk``:
:data:`pyro2pfp.backends.reference.NUMPY_BACKEND` (float64 arrays) or the exporter's
:class:`pyro2pfp.backends.onnx.builder.OnnxContext` (ONNX symbols).  Their common members: ``ops`` (the
:mod:`pyro2pfp.moments` namespace: ``where``, ``sqrt``, ``exp``, ``maximum``, ``minimum``, ``normal_cdfs``,
``const``; Python operators work on the values), ``variance(x)``/``second_moment(x)`` of an input activation,
``tensor(array, hint)`` (a constant), ``reshape(t, shape)`` (to ``(batch, *shape)``), ``rsum(t, axis)`` (axis
dropped), ``einsum``, ``matmul`` (batched, broadcasting), ``dense(x, w, hint)`` (``x @ w.T``), ``conv2d``,
``taps`` (strided window views), ``slice``, ``concat``, ``widened(g, k_in, k)`` (zero columns up to ``k``) and
``all_zero(t)`` (the reference drops a shared part of zeros; the export cannot see values).

``inputs`` are the back end's activations, ``shared`` the inputs' :class:`~.shared.Shared` parts (None: none),
``fp`` the factor plan (the reference's, or the export's :func:`~.factors.fixed_k_plan`) and ``var`` the
layer's mean-field output variance.  A rule returns the output's shared part -- its profile clipped to ``±sd``
(:func:`clip`) -- and the output variance, corrected where it sums positions or branches.  The helpers below are
formulas over ``bk`` too.
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ..planning.plan import PlannedLayer
from .loadings import TensorAlgebra


class SharedAlgebra(TensorAlgebra, Protocol):
    """The back end ``bk`` of the shared-factor rules (module docstring): the compact rules' tensor algebra
    (:class:`~.loadings.TensorAlgebra`) and what the shared rules use beyond it.  ``NumpyBackend`` and
    ``OnnxContext`` implement it (mypy checks them where :func:`pyro2pfp.ops._formula.shared_formula` calls a
    rule with them)."""

    def second_moment(self, x: Any) -> Any:
        """``E[x²]`` of input activation ``x``."""
        ...

    def deterministic(self, mean: Any) -> Any:
        """An exact output activation (a covariance op's)."""
        ...

    def emit(self, mean: Any, var: Any, layer: PlannedLayer) -> Any:
        """The output activation of ``layer`` in the representation the plan gives it."""
        ...

    def matmul(self, a: Any, b: Any) -> Any:
        """Batched matrix product over the last two axes (the leading ones broadcast)."""
        ...

    def widened(self, g: Any, k_in: int, k: int) -> Any:
        """``g`` (..., k_in) with zero columns up to ``k``."""
        ...

    def pad2d(self, t: Any, begin: tuple[int, int], end: tuple[int, int]) -> Any:
        """``t`` (B, C, H, W) with ``begin``/``end`` rows and columns of zeros."""
        ...

    def window(self, t: Any, start: tuple[int, int], stride: tuple[int, int], out_hw: tuple[int, ...]) -> Any:
        """The strided (B, C, OH, OW) view of ``t`` from ``start``."""
        ...

    def edge_shape(self, x: Any, name: str) -> tuple[int, ...]:
        """The per-sample shape of input activation ``x`` (edge ``name``)."""
        ...

    def all_zero(self, t: Any) -> bool:
        """Whether every entry of ``t`` is known to be zero (False where the values are not known)."""
        ...


def zero(bk: Any) -> Any:
    return bk.ops.const(0.0)


def batch_zeros(bk: Any, t: Any, ones: int) -> Any:
    """Zeros (B, 1, …, 1) (``ones`` unit axes) of the batch of a (B, n) tensor ``t``: added to a constant, it
    gets the batch axis."""
    return bk.reshape(bk.zeros_like(bk.rsum(t, 1)), (1,) * ones)


def safe_div(bk: Any, num: Any, den: Any) -> Any:
    """``num/den``, 0 where ``den ≤ 0``."""
    ops = bk.ops
    positive = den > zero(bk)
    return ops.where(positive, num / ops.where(positive, den, ops.const(1.0)), zero(bk))


def clip(bk: Any, s: Any, var: Any) -> Any:
    """``s`` clipped to ``±√max(var, 0)`` (a covariance with a unit normal is at most the standard deviation)."""
    ops = bk.ops
    sd = ops.sqrt(ops.maximum(var, zero(bk)))
    return ops.minimum(ops.maximum(s, -sd), sd)


def normalised(bk: Any, loading: Any, rows: int) -> tuple[Any, Any]:
    """``(ℓ/‖ℓ‖, ‖ℓ‖)`` of a loading ``ℓ`` (B, R, K): the unit rows (0 where ``‖ℓ‖ = 0``) and the norms (B, R)."""
    norm = bk.ops.sqrt(bk.rsum(loading * loading, 2))
    return safe_div(bk, loading, bk.reshape(norm, (rows, 1))), norm


def own_columns(bk: Any, rows: int, k: int, offset: int) -> Any:
    """The constant (R, K) with a 1 at ``(r, offset + r)``: row ``r``'s own factor column."""
    e = np.zeros((rows, k))
    e[np.arange(rows), offset + np.arange(rows)] = 1.0
    return bk.tensor(e, "own_factors")


def own_loading(bk: Any, values: Any, rows: int, k: int, offset: int) -> Any:
    """``values`` (B, R) placed in each row's own factor column of a (B, R, K) loading."""
    return bk.einsum("br,rf->brf", values, own_columns(bk, rows, k, offset))


def total(terms: list[Any]) -> Any:
    """The sum of ``terms``."""
    out = terms[0]
    for t in terms[1:]:
        out = out + t
    return out


def grouped(bk: Any, t: Any, rows: int, elements: int) -> Any:
    """``t`` (B, *edge) as (B, rows, elements/rows): each row's (channel's) elements."""
    return bk.reshape(t, (rows, elements // rows))


def row_mean(bk: Any, t: Any, rows: int, group: int) -> Any:
    """The mean over the last axis of a (B, R, group) tensor, kept as (B, R, 1)."""
    return bk.reshape(bk.rsum(t, 2), (rows, 1)) * bk.ops.const(1.0 / group)


def conv_taps(bk: Any, t: Any, layer: PlannedLayer, kernel: tuple[int, int]) -> list[Any]:
    """The strided (B, C, OH, OW) views of ``t`` (B, C, H, W) at every kernel offset of a conv ``layer``
    (row-major), zero in the padding."""
    a = layer.layer.attrs
    pad = tuple(a["padding"])
    return bk.taps(t, kernel, tuple(a["stride"]), tuple(a["dilation"]), pad, pad, tuple(layer.layer.out_shape[1:]),
                   0.0)


def mix(bk: Any, weight: Any, view: Any, shape: tuple[int, int, int, int]) -> Any:
    """``Σ_c weight[b, o, c]·view[b, c, h, w]`` (B, O, H, W): ``weight`` (B, O, C) or a constant (O, C), ``view``
    (B, C, H, W), ``shape`` = (O, C, H, W) -- one batched matrix product."""
    o, c, h, w = shape
    return bk.reshape(bk.matmul(weight, bk.reshape(view, (c, h * w))), (o, h, w))
