"""Plan stage: give every max pool fed by a conv its in-window covariances (mean-field plans).

A max pool's window holds strongly correlated Gaussians -- one conv channel's outputs at neighbouring
positions share the channel's weights and overlapping input patches -- and Clark's max of *independent*
Gaussians then over-states the mean of the max and under-states its variance.  This rewrite of the
layer graph lets the pool fold Clark's *correlated* max instead (:mod:`pyro2pfp.ops.window_covariance`):

1. **Activation after the pool.**  For a non-decreasing activation ``f`` (ReLU, LeakyReLU with a
   slope ≥ 0, Hardtanh/ReLU6, Sigmoid, Tanh, Softplus, ELU with α ≥ 0,
   scaling by c ≥ 0; not GELU or SiLU)
   ``max_pool(f(a)) = f(max_pool(a))`` exactly, so ``conv → f → max_pool`` becomes
   ``conv → max_pool → f``: the max sees the conv's Gaussian outputs, whose covariances are known in
   closed form, and ``f``'s moments are computed once per pooled output instead of once per tap.  The
   activation layer takes the pool's name (it computes what the torch pool computed); the max pool
   is renamed ``<pool>_pre_<op>``.
2. **Window covariances.**  A ``window_cov`` layer (``<pool>_window_cov``), reading the conv's input and
   weights, becomes the pool's second input.

Applied where the pool's input is a conv with ``groups = 1`` and no dilation (directly or through
such an activation that feeds only the pool); every other max pool keeps the independent fold.
``convert(..., max_pool="independent")`` skips the rewrite (the paper's rule).  Shared-factor plans
keep the independent fold (their factor rules do not know ``window_cov``).
"""
from __future__ import annotations

from .graph import INPUT, Layer, LayerGraph
from .options import MaxPool, values
from .registry import OPS

MAX_POOL_RULES = values(MaxPool)


def _non_decreasing(layer: Layer) -> bool:
    rule = OPS[layer.op].activation if layer.op in OPS else None
    return rule is not None and rule.non_decreasing is not None and bool(rule.non_decreasing(layer.attrs))


def _window_source(conv: Layer) -> bool:
    a = conv.attrs
    return conv.op == "conv2d" and int(a.get("groups", 1)) == 1 and list(a.get("dilation", [1, 1])) == [1, 1]


def correlate_max_pools(graph: LayerGraph) -> LayerGraph:
    """``graph`` with the rewrite of the module docstring applied to every eligible max pool (the same
    object when there is none; the input graph is never modified)."""
    by_name = {layer.name: layer for layer in graph.layers}
    users: dict[str, int] = {}
    for layer in graph.layers:
        for name in layer.inputs:
            users[name] = users.get(name, 0) + 1
    if graph.output in users:
        users[graph.output] += 1
    else:
        users[graph.output] = 1
    dropped: set[str] = set()
    replaced: dict[str, list[Layer]] = {}
    for pool in graph.layers:
        if pool.op != "max_pool2d" or len(pool.inputs) != 1:
            continue
        act = by_name.get(pool.inputs[0])
        if act is not None and _non_decreasing(act) and users.get(act.name) == 1:
            conv = by_name.get(act.inputs[0])
        else:
            act, conv = None, act
        if conv is None or not _window_source(conv) or pool.attrs["kernel"][0] * pool.attrs["kernel"][1] < 2:
            continue
        c, oh, ow = pool.out_shape
        kernel = pool.attrs["kernel"]
        pairs = kernel[0] * kernel[1] * (kernel[0] * kernel[1] - 1) // 2
        conv_attrs = {key: conv.attrs[key] for key in ("stride", "padding")}
        pool_attrs = {key: pool.attrs[key] for key in ("kernel", "stride", "padding", "ceil_mode")}
        cov = Layer(name=f"{pool.name}_window_cov", op="window_cov", inputs=[conv.inputs[0]],
                    out_shape=(c, pairs, oh, ow), source=f"{pool.source}: in-window covariances of {conv.name}",
                    attrs={"conv": conv_attrs, "pool": pool_attrs, "conv_out_hw": list(conv.out_shape[1:])},
                    params={k: v for k, v in conv.params.items() if k in ("weight", "bias")})
        if act is None:
            new_pool = Layer(name=pool.name, op="max_pool2d", inputs=[conv.name, cov.name], out_shape=pool.out_shape,
                             source=pool.source, attrs=dict(pool.attrs), params=dict(pool.params),
                             note=f"correlated Clark max (covariances: {cov.name})")
            replaced[pool.name] = [cov, new_pool]
            continue
        new_pool = Layer(name=f"{pool.name}_pre_{act.op}", op="max_pool2d", inputs=[conv.name, cov.name],
                         out_shape=pool.out_shape, source=pool.source, attrs=dict(pool.attrs),
                         params=dict(pool.params),
                         note=f"correlated Clark max (covariances: {cov.name}); {act.op} moved after it")
        new_act = Layer(name=pool.name, op=act.op, inputs=[new_pool.name], out_shape=pool.out_shape,
                        source=act.source, attrs=dict(act.attrs), params=dict(act.params),
                        note=f"{act.name} applied after the max pool (exact: {act.op} is non-decreasing)")
        dropped.add(act.name)
        replaced[pool.name] = [cov, new_pool, new_act]
    if not replaced:
        return graph
    layers: list[Layer] = []
    for layer in graph.layers:
        if layer.name in dropped:
            continue
        layers.extend(replaced.get(layer.name, [layer]))
    origins = {name: node for name, node in graph.origins.items() if name not in dropped}
    return LayerGraph(input_shape=graph.input_shape, layers=layers, output=graph.output,
                      input_variance=graph.input_variance, origins=origins, guide_factors=graph.guide_factors)


def _passes_through(layer: Layer) -> bool:
    """Elementwise layers between a conv and the next one (activations, per-channel affine maps)."""
    return layer.op == "affine" or (layer.op in OPS and OPS[layer.op].activation is not None)


def pool_caveats(graph: LayerGraph) -> list[str]:
    """What a user should know about the max pools of a mean-field plan after :func:`correlate_max_pools`:
    pools that keep the independent fold (their input is not a conv, or passes an activation that is not
    non-decreasing or that feeds other layers too), and correlated pools whose conv reads another conv's
    output with no pooling between -- neighbouring inputs then share most of their noise, which
    mean-field PFP does not carry, so the in-window correlation is under-stated."""
    by_name = {layer.name: layer for layer in graph.layers}
    notes = []
    for layer in graph.layers:
        if layer.op != "max_pool2d":
            continue
        if len(layer.inputs) == 1:
            src = by_name.get(layer.inputs[0])
            what = "the network input" if src is None else f"{src.name} ({src.op})"
            notes.append(f"{layer.source}: max pool '{layer.name}' reads {what}, not a conv (or through an "
                         "activation that is not non-decreasing or has other consumers), so it folds its window "
                         "as independent Gaussians: its variance is under-stated where the window is correlated")
            continue
        cov = by_name[layer.inputs[1]]
        name = cov.inputs[0]
        while name != INPUT and _passes_through(by_name[name]):
            name = by_name[name].inputs[0]
        if name != INPUT and by_name[name].op == "conv2d":
            notes.append(f"{layer.source}: max pool '{layer.name}' follows a conv whose input is another conv's "
                         f"output ({name}) with no pooling between; mean-field PFP drops the correlation of "
                         "neighbouring inputs, so the in-window correlation and the pool's moments are approximate")
    return notes
