"""One formula for the NumPy reference and the ONNX export of an op.

A shared formula ``fn(bk, layer, inputs) -> activation`` is written against a *back end* ``bk``:
:data:`pyro2pfp.backends.reference.NUMPY_BACKEND` (float64 arrays) or the exporter's
:class:`pyro2pfp.backends.onnx.builder.OnnxContext` (ONNX symbols).  Both offer the same members:

* ``bk.ops`` -- the :mod:`pyro2pfp.moments` namespace (``where``, ``normal_cdfs``, ``exp``, ``sqrt``,
  ``maximum``, ``minimum``, ``const``; Python operators work on its values);
* ``bk.variance(x)``, ``bk.second_moment(x)`` of a non-deterministic input activation ``x``
  (``x.mean``, ``x.repr`` are plain attributes);
* ``bk.emit(mean, var, layer)`` -- the output in the representation the plan asks for;
  ``bk.deterministic(mean)`` -- an exact output;
* ``bk.tensor(array, hint)`` -- a constant; ``bk.dense(x, w, hint)`` (``x @ w.T``),
  ``bk.conv2d(x, w, attrs, hint)``, ``bk.reshape(t, shape)`` -- the linear maps;
  ``bk.concat(ts, axis)`` (along a per-sample axis), ``bk.zeros_like(t)``.

:func:`formula` registers such a function as both the reference and the ONNX exporter of its ops;
:func:`shared_formula` a shared-factor rule ``fn(bk, layer, inputs, shared, fp, var) -> (shared, var)``
(:mod:`pyro2pfp.correlation.shared_algebra` lists what those use) as the float64 rule and the ONNX export's;
:func:`compact_formula` a rule of the compact factor plan ``fn(bk, layer, inputs, loadings, plan, mean, var)``
(:mod:`pyro2pfp.correlation.loadings` lists the tensor algebra those use) in both back ends' tables.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..backends.onnx.builder import OnnxActivation, OnnxContext, exporter
from ..backends.reference import NUMPY_BACKEND, Activation, reference
from ..correlation.guide import mean_shift
from ..correlation.loadings import CompactRule
from ..correlation.shared_algebra import SharedAlgebra
from ..planning.plan import PlannedLayer
from ..planning.protocols import FormulaBackend
from ..planning.registry import compact_exporter, compact_reference, shared_exporter, shared_reference

Formula = Callable[[FormulaBackend, PlannedLayer, list[Any]], Any]


def formula(*ops: str) -> Callable[[Formula], Formula]:
    """Register ``fn(bk, layer, inputs)`` as the NumPy reference and the ONNX export of ``ops``."""

    def deco(fn: Formula) -> Formula:
        def on_numpy(layer: PlannedLayer, inputs: list[Activation]) -> Activation:
            return fn(NUMPY_BACKEND, layer, inputs)

        def on_onnx(ctx: OnnxContext, layer: PlannedLayer, inputs: list[OnnxActivation]) -> OnnxActivation:
            return fn(ctx, layer, inputs)

        on_numpy.__name__ = on_onnx.__name__ = fn.__name__
        on_numpy.__doc__ = on_onnx.__doc__ = fn.__doc__
        reference(*ops)(on_numpy)
        exporter(*ops)(on_onnx)
        return fn

    return deco


def compact_formula(*ops: str) -> Callable[[CompactRule], CompactRule]:
    """Register ``fn(bk, layer, inputs, loadings, plan, mean, var) -> (loadings, mean, var)`` as the compact factor
    rule of ``ops`` in the float64 reference and the ONNX export (``registry.COMPACT_REFERENCES``,
    ``COMPACT_EXPORTERS``)."""

    def deco(fn: CompactRule) -> CompactRule:
        compact_reference(*ops)(fn)
        compact_exporter(*ops)(fn)
        return fn

    return deco


SharedFormula = Callable[[SharedAlgebra, PlannedLayer, list[Any], list[Any], Any, Any], tuple[Any, Any]]


def shared_formula(*ops: str) -> Callable[[SharedFormula], SharedFormula]:
    """Register ``fn(bk, layer, inputs, shared, fp, var) -> (shared, var)`` as the shared-factor rule of ``ops`` in
    the float64 reference (``registry.SHARED_REFERENCES``) and the ONNX export (``SHARED_EXPORTERS``;
    :mod:`pyro2pfp.correlation.shared_algebra`).  In the export ``var`` is the layer's exported variance and a
    corrected one replaces it in the layer's output."""

    def deco(fn: SharedFormula) -> SharedFormula:
        def on_numpy(layer: PlannedLayer, inputs: list[Any], shared: list[Any], fp: Any, var: Any
                     ) -> tuple[Any, Any]:
            return fn(NUMPY_BACKEND, layer, inputs, shared, fp, var)

        def on_onnx(step: Any, ctx: OnnxContext, layer: PlannedLayer, inputs: list[Any], shared: list[Any],
                    out: Any) -> tuple[Any, Any]:
            start = len(ctx.b.nodes)
            sh, var = fn(ctx, layer, inputs, shared, step.fp, None if out is None else out.second)
            if isinstance(var, OnnxActivation):  # a covariance op's whole (deterministic) output
                return sh, var
            # a correlated guide's weight noise times its input's (as the reference's executor adds it)
            shift = mean_shift(ctx, layer, shared[0], step.fp) if step.fp.guide and shared else None
            if shift is not None or var is not out.second:
                out = OnnxActivation(out.mean if shift is None else out.mean + shift, var, out.repr)
            # drop what the outputs do not need (e.g. the parts of a moment rule a Stein slope does not read)
            step.prune(start, [t.name for t in (out.mean, out.second, *((sh.s, sh.g) if sh is not None else ()))
                               if t is not None])
            return sh, out

        on_numpy.__name__, on_onnx.__name__ = fn.__name__, f"{fn.__name__}_onnx"
        on_numpy.__doc__ = on_onnx.__doc__ = fn.__doc__
        on_numpy.formula = on_onnx.formula = fn  # type: ignore[attr-defined]
        shared_reference(*ops)(on_numpy)
        shared_exporter(*ops)(on_onnx)
        return fn

    return deco
