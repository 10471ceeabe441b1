"""Registry, TE math namespace and the Relax emitter loop."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import tvm
from tvm import relax, te, tirx

from .. import moments
from ..errors import PFPError
from ..graph import INPUT, Repr
from ..plan import PlannedGraph, PlannedLayer

F32 = "float32"


def _const(value: float) -> tirx.PrimExpr:
    return tirx.const(value, F32)


# Eigen's rational float32 erf on [-4, 4] (|error| of a few ulp; erf(±4) = ±1 in float32).  Unlike a
# libm ``erff`` call it vectorises, which makes ReLU and max pooling several times faster.
_ERF_NUM = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
            -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_ERF_DEN = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
            -1.42647390514189e-02)


def fast_erf(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """erf(x) in float32 as ``x·P(x²)/Q(x²)`` (vectorisable, no libm call)."""
    x = te.min(te.max(x, _const(-4.0)), _const(4.0))
    x2 = x * x
    num = _const(_ERF_NUM[0])
    for c in _ERF_NUM[1:]:
        num = num * x2 + _const(c)
    den = _const(_ERF_DEN[0])
    for c in _ERF_DEN[1:]:
        den = den * x2 + _const(c)
    return x * num / den


def _normal_cdfs(alpha: tirx.PrimExpr) -> tuple[tirx.PrimExpr, tirx.PrimExpr]:
    """(Φ(α), Φ(−α)) from one erf evaluation."""
    half_erf = _const(0.5) * fast_erf(alpha * _const(moments.INV_SQRT2))
    return _const(0.5) + half_erf, _const(0.5) - half_erf


TE_OPS = SimpleNamespace(
    where=tirx.Select,
    normal_cdfs=_normal_cdfs,
    exp=te.exp,
    sqrt=te.sqrt,
    maximum=te.max,
    minimum=te.min,
    const=_const,
)
"""The :mod:`pyro2pfp.moments` formulas evaluated on TE expressions (float32)."""

# A sum over pairs: one reduction computing mean and second component together.
pair_sum = te.comm_reducer(
    lambda a, b: (a[0] + b[0], a[1] + b[1]),
    lambda t0, t1: (tirx.const(0, t0), tirx.const(0, t1)),
    name="pair_sum",
)


@dataclass
class RelaxActivation:
    """A batch of independent Gaussians in the Relax graph: ``second`` is None when deterministic."""

    mean: relax.Expr
    second: relax.Expr | None
    repr: Repr

    def tensors(self) -> list[relax.Expr]:
        return [self.mean] if self.second is None else [self.mean, self.second]


@dataclass
class EmitContext:
    """What a kernel emitter gets besides its inputs."""

    bb: relax.BlockBuilder
    batch: tirx.Var
    shapes: dict[str, tuple[int, ...]]  # per-sample shape of every edge (input and layer outputs)

    def const(self, array: np.ndarray) -> relax.Constant:
        return relax.const(np.ascontiguousarray(array, dtype=np.float32))

    def emit_te(self, fn: Callable[..., Any], args: list[relax.Expr], layer: PlannedLayer) -> list[relax.Expr]:
        """Emit one TE function as one PrimFunc named after the layer; returns its output tensors."""
        out = self.bb.emit_te(fn, *args, primfunc_name_hint=f"pfp_{layer.op}_{layer.name}")
        if isinstance(out.ty, relax.TupleType):
            return [self.bb.emit(relax.TupleGetItem(out, i)) for i in range(len(out.ty.fields))]
        return [out]


def activation_out(outs: list[relax.Expr], layer: PlannedLayer) -> RelaxActivation:
    if layer.out_repr is Repr.DETERMINISTIC:
        return RelaxActivation(outs[0], None, layer.out_repr)
    return RelaxActivation(outs[0], outs[1], layer.out_repr)


def epilogue(mean: Any, var: Any, layer: PlannedLayer) -> list[Any]:
    """TE expressions of the layer's output pair in the representation it must emit."""
    if layer.out_repr is Repr.SECOND_MOMENT:
        return [mean, moments.variance_to_second(mean, var, TE_OPS)]
    return [mean, var]


KernelFn = Callable[[EmitContext, PlannedLayer, list[RelaxActivation]], RelaxActivation]
KERNELS: dict[str, KernelFn] = {}
ScheduleFn = Callable[..., Any]
SCHEDULES: dict[str, ScheduleFn] = {}


def kernel(op: str) -> Callable[[KernelFn], KernelFn]:
    """Register the Relax/TE emitter of PFP op ``op``."""

    def deco(fn: KernelFn) -> KernelFn:
        KERNELS[op] = fn
        return fn

    return deco


def schedule(op: str) -> Callable[[ScheduleFn], ScheduleFn]:
    """Register the default CPU schedule of PFP op ``op``: ``fn(sch, layer, target) -> None``."""

    def deco(fn: ScheduleFn) -> ScheduleFn:
        SCHEDULES[op] = fn
        return fn

    return deco


def emit_module(graph: PlannedGraph) -> tvm.IRModule:
    """The planned network as a Relax IRModule.

    ``main(x: (batch, *input_shape) float32[, x_var]) -> (mean, var)`` of the output; weights are
    bound as float32 constants; ``batch`` is symbolic.
    """
    batch = tirx.Var("batch", "int64")
    bb = relax.BlockBuilder()
    shapes = {INPUT: graph.input_shape, **{p.name: p.layer.out_shape for p in graph.layers}}
    ctx = EmitContext(bb=bb, batch=batch, shapes=shapes)
    in_type = relax.TensorType((batch, *graph.input_shape), F32)
    params = [relax.Var("x", in_type)]
    if graph.input_repr is not Repr.DETERMINISTIC:
        params.append(relax.Var("x_var", in_type))
    with bb.function("main", params):
        with bb.dataflow():
            values = {INPUT: RelaxActivation(params[0], params[1] if len(params) > 1 else None,
                                             graph.input_repr)}
            for layer in graph.layers:
                fn = KERNELS.get(layer.op)
                if fn is None:
                    raise PFPError(f"{layer.layer.source}: no TVM kernel for PFP op '{layer.op}'")
                values[layer.name] = fn(ctx, layer, [values[name] for name in layer.inputs])
            result = values[graph.output]
            if result.repr is Repr.DETERMINISTIC:
                zeros = bb.emit(relax.op.zeros_like(result.mean))
                result = RelaxActivation(result.mean, zeros, Repr.VARIANCE)
            assert result.repr is Repr.VARIANCE, result.repr
            out = bb.emit_output(relax.Tuple([result.mean, result.second]))
        bb.emit_func_output(out)
    return bb.get()
