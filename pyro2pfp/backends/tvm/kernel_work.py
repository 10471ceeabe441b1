"""Multiply-adds per kernel of a compiled PFP network, for :func:`pyro2pfp.runtime.profiling.profile`'s
``work`` (G multiply-adds/s per kernel).

A mean-field compute layer's (``conv2d``/``dense``) kernel's work is counted as the products of the direct algorithm --
per tap and output one for the mean and two for the variance (``Σ vw·(μx² + vx)``, ``Σ μw²·vx``), one
each for a deterministic input -- the count of :func:`pyro2pfp.correlation.cost_model`, whatever
algorithm runs (a Winograd kernel's rate is "effective": it does fewer multiplications); any other
kernel's as the multiplications of its definition (the TIR before scheduling, at that batch size).
"""
from __future__ import annotations

import numpy as np
import tvm

from ...planning.graph import Repr
from ...planning.plan import is_compute_layer
from ...planning.protocols import ConvertedNetwork
from .emit import kernel_info
from .schedules.work import kernel_multiplies
from .tuning.specialize import specialize_batch

__all__ = ["kernel_multiply_adds"]


def kernel_multiply_adds(net: ConvertedNetwork, batch: int) -> dict[str, float]:
    """``{kernel symbol: multiply-adds of one call}`` of ``net``'s compiled module at ``batch``
    inputs (the counting rule is in the module docstring)."""
    layers = {layer.name: layer for layer in net.plan.layers}
    mod = specialize_batch(net.mod, batch)
    out: dict[str, float] = {}
    for gv, func in mod.functions_items():
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        op, name = kernel_info(func)
        layer = layers.get(name) if name is not None else None
        if layer is not None and layer.op == op and is_compute_layer(op):
            # the taps of one output element (a conv's C·KH·KW, a dense layer's inputs) times its outputs
            size = int(layer.tensors["weight_mean"][0].size) * int(np.prod(layer.layer.out_shape))
            products = 2 if layer.in_reprs[0] is Repr.DETERMINISTIC else 3
            out[gv.name_hint] = float(batch * size * products)
            continue
        count = kernel_multiplies(func)
        if count is not None:
            out[gv.name_hint] = count
    return out
