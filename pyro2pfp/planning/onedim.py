"""1-D layers as 2-D ones with H = 1.

A 1-D layer on ``(batch, C, L)`` -- ``Conv1d``, ``MaxPool1d``, ``AvgPool1d``, the adaptive 1-D pools --
is the 2-D layer on ``(batch, C, 1, L)`` with a 1×k window: its converter emits a reshape to
``(C, 1, L)``, the 2-D layer, and a reshape back to ``(C, L)`` (:func:`as_2d`).  Between two such
layers the reshapes would keep the 2-D layers apart (a batch norm, an activation and the reshapes
between a conv and its max pool hide the conv from the batch-norm fold and from the correlated
max-pool rule), so :func:`lift_1d` rewrites the layer graph:

* an elementwise layer (an activation, a per-channel ``affine`` such as ``BatchNorm1d``, the ``add``
  of a residual connection) whose inputs are all ``(C, 1, L) → (C, L)`` reshapes runs on the
  ``(C, 1, L)`` tensors instead, followed by the reshape -- exact: an elementwise map commutes with
  a reshape, and the channel axis stays axis 1;
* a reshape of a reshape reads the tensor before both (one reshape), and is dropped where it gives that
  tensor its own shape back (the ``(C, L) → (C, 1, L)`` of the next 1-D layer).

The result is one chain of 2-D layers that every back end, :func:`pyro2pfp.planning.folding.fold_batch_norm`,
:mod:`pyro2pfp.planning.correlated_pools` and the shared-factor rules treat as any 2-D network.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from .graph import INPUT, GaussianParam, Layer, LayerGraph
from .registry import OPS


def as_2d(node: Any, ctx: Any, x: Any, op: str, attrs: dict[str, Any], params: dict[str, GaussianParam],
          prefer_module: bool) -> list[Layer]:
    """The layers of a 1-D torch node computed by the 2-D layer ``op``: ``(C, L) → (C, 1, L)``, ``op``
    (its 1-D output ``(O, L')`` as ``(O, 1, L')``), ``→ (O, L')`` (named as the node)."""
    c, length = ctx.shape(x)
    o, out_len = out_shape(node, ctx)
    name, source = ctx.new_name(node, prefer_module=prefer_module), ctx.source(node)
    return [
        Layer(name=f"{name}_to_2d", op="reshape", inputs=[ctx.activation(x, node)], out_shape=(c, 1, length),
              source=source),
        Layer(name=f"{name}_2d", op=op, inputs=[f"{name}_to_2d"], out_shape=(o, 1, out_len), source=source,
              attrs=attrs, params=params),
        Layer(name=name, op="reshape", inputs=[f"{name}_2d"], out_shape=(o, out_len), source=source),
    ]


def out_shape(node: Any, ctx: Any) -> tuple[int, ...]:
    """The shape (without the batch) of a node's output, or of the first output of an op returning
    ``(values, indices)`` (``max_pool1d_with_indices``, ``adaptive_max_pool1d``)."""
    val = node.meta.get("val")
    if isinstance(val, tuple | list):
        return tuple(int(d) for d in val[0].shape[1:])
    return ctx.shape(node)


def _elementwise(layer: Layer) -> bool:
    """Layers whose result on ``(C, 1, L)`` is their result on ``(C, L)`` reshaped (channel axis 1)."""
    return layer.op in OPS and (OPS[layer.op].elementwise or OPS[layer.op].activation is not None)


def _squeezed(name: str, by_name: dict[str, Layer]) -> str | None:
    """The ``(C, 1, L)`` layer that the reshape ``name`` turns into ``(C, L)`` (None if it is not one)."""
    layer = by_name.get(name)
    if layer is None or layer.op != "reshape":
        return None
    src = by_name.get(layer.inputs[0])
    if src is None or len(src.out_shape) != 3 or src.out_shape[1] != 1:
        return None
    return src.name if tuple(layer.out_shape) == (src.out_shape[0], src.out_shape[2]) else None


def _unique(base: str, used: set[str]) -> str:
    name, i = base, 1
    while name in used:
        i += 1
        name = f"{base}_{i}"
    used.add(name)
    return name


def _sink_once(layers: list[Layer], used: set[str]) -> bool:
    """Move one ``(C, 1, L) → (C, L)`` reshape past the elementwise layer that reads it (in place)."""
    by_name = {layer.name: layer for layer in layers}
    for i, layer in enumerate(layers):
        if not _elementwise(layer):
            continue
        found = [_squeezed(name, by_name) for name in layer.inputs]
        sources = [s for s in found if s is not None]
        if len(sources) != len(found) or len({by_name[s].out_shape for s in sources}) != 1:
            continue
        shape = by_name[sources[0]].out_shape
        lifted = replace(layer, name=_unique(f"{layer.name}_2d", used), inputs=sources, out_shape=shape,
                         attrs=dict(layer.attrs), params=dict(layer.params))
        back = Layer(name=layer.name, op="reshape", inputs=[lifted.name], out_shape=layer.out_shape,
                     source=layer.source)
        layers[i:i + 1] = [lifted, back]
        return True
    return False


def lift_1d(graph: LayerGraph) -> LayerGraph:
    """``graph`` with the rewrite of the module docstring (the same object when there is nothing to
    rewrite; ``graph`` is not modified).  A dropped reshape's origin (the torch node it computes, for
    the per-layer diagnostics, which compare values whatever their shape) passes to the layer it
    reshaped."""
    layers = list(graph.layers)
    used = {layer.name for layer in layers}
    changed = False
    while _sink_once(layers, used):
        changed = True
    by_name = {layer.name: layer for layer in layers}
    alias: dict[str, str] = {}
    for i, layer in enumerate(layers):
        inputs = [alias.get(name, name) for name in layer.inputs]
        if inputs != layer.inputs:
            layer = layers[i] = replace(layer, inputs=inputs)
            by_name[layer.name] = layer
            changed = True
        prev = by_name.get(layer.inputs[0]) if layer.op == "reshape" else None
        if prev is None or prev.op != "reshape":
            continue
        src = prev.inputs[0]  # a reshape of a reshape: one reshape
        changed = True
        src_shape = graph.input_shape if src == INPUT else by_name[src].out_shape
        if tuple(layer.out_shape) == tuple(src_shape) and layer.name != graph.output:
            alias[layer.name] = src
        else:
            layers[i] = by_name[layer.name] = replace(layer, inputs=[src])
    if not changed:
        return graph
    needed = {graph.output}
    for layer in reversed(layers):
        if layer.name in needed and layer.name not in alias:
            needed.update(layer.inputs)
    kept = [layer for layer in layers if layer.name in needed and layer.name not in alias]
    origins = {name: node for name, node in graph.origins.items() if name in needed}
    every = {layer.name: layer for layer in layers}
    for name, node in graph.origins.items():
        target: str | None = name
        while target is not None and target not in needed:  # a dropped reshape: the layer it reshaped
            target = alias.get(target) or (every[target].inputs[0] if target in every else None)
        if target is not None and target != INPUT and target not in origins:
            origins[target] = node
    return replace(graph, layers=kept, origins=origins)
