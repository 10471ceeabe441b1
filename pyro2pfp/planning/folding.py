"""Exact rewrites of the layer graph before planning: eval-mode batch norm folded into the layer before it.

An eval-mode batch norm is the per-channel affine map ``y = a·z + c`` (``ops/arithmetic.py``).  When it
follows a ``dense``/``conv2d`` layer whose output feeds nothing else, ``z = Σ w·x + b`` gives

    a·z + c = Σ (a·w)·x + (a·b + c),

and for independent Gaussian weights ``w ~ N(μw, vw)``, ``b ~ N(μb, vb)`` the folded parameters are
Gaussian with ``a·w ~ N(a·μw, a²·vw)`` and ``a·b + c ~ N(a·μb + c, a²·vb)`` (``a``, ``c`` deterministic).
The folded layer's output (mean, variance) is exactly the affine of the unfolded layer's output
(``docs/math.md`` "Linear layers": ``μ ↦ aμ + c``, ``v ↦ a²v``), in every input
representation, so the fold changes no result (up to float rounding) and saves a kernel, a tensor pair
and a memory pass per batch norm.  The calibration factor, applied later by the planner to every
weight variance, commutes with the fold (``c·a²·vw = a²·(c·vw)``).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .graph import GaussianParam, Layer, LayerGraph
from .plan import is_compute_layer


def _scaled(param: GaussianParam, scale: np.ndarray, shift: np.ndarray | None = None) -> GaussianParam:
    """``a·p + c`` per output channel (axis 0) of a Gaussian parameter."""
    a = scale.reshape((-1,) + (1,) * (param.mean.ndim - 1))
    scaled = param.mapped(lambda t: t, scale=np.broadcast_to(a, param.mean.shape))
    if shift is None:
        return scaled
    return GaussianParam(scaled.mean + shift.reshape(a.shape), scaled.var, site=param.site, factors=scaled.factors)


def fold_batch_norm(graph: LayerGraph) -> LayerGraph:
    """The graph with every ``affine`` layer that follows a ``dense``/``conv2d`` layer feeding only it
    folded into that layer (see the module docstring).  The folded layer keeps the compute layer's name
    (its consumers are rewired to it) and now computes what the batch norm computed (its origin, for
    the per-layer diagnostics, is the batch norm's).  Other affine layers (after a pooling, an add, the
    input, …) stay.  ``graph`` is not modified."""
    by_name = {layer.name: layer for layer in graph.layers}
    uses: dict[str, int] = {}
    for layer in graph.layers:
        for name in layer.inputs:
            uses[name] = uses.get(name, 0) + 1
    folded: dict[str, Layer] = {}  # compute layer name -> the folded compute layer
    renamed: dict[str, str] = {}  # folded affine layer name -> compute layer name
    for layer in graph.layers:
        producer = by_name.get(layer.inputs[0]) if layer.op == "affine" else None
        if (producer is None or not is_compute_layer(producer.op) or uses.get(producer.name) != 1
                or producer.name == graph.output):
            continue
        scale, shift = layer.params["scale"].mean, layer.params["shift"].mean
        params = dict(producer.params)
        params["weight"] = _scaled(producer.params["weight"], scale)
        bias = producer.params.get("bias")
        params["bias"] = (_scaled(bias, scale, shift) if bias is not None
                          else GaussianParam(np.asarray(shift, dtype=np.float64).copy(), np.zeros_like(shift)))
        folded[producer.name] = replace(producer, out_shape=layer.out_shape,
                                        source=f"{producer.source} + {layer.source} (folded)", params=params)
        renamed[layer.name] = producer.name
    if not folded:
        return graph
    layers = [replace(folded.get(layer.name, layer), inputs=[renamed.get(i, i) for i in layer.inputs])
              for layer in graph.layers if layer.name not in renamed]
    origins = {name: node for name, node in graph.origins.items() if name not in renamed}
    origins.update({compute: graph.origins[affine] for affine, compute in renamed.items() if affine in graph.origins})
    return replace(graph, layers=layers, origins=origins, output=renamed.get(graph.output, graph.output))
