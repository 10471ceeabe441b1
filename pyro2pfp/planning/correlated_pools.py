"""Plan stage: give every max pool its in-window covariances.

A max pool's window holds strongly correlated Gaussians -- one conv channel's outputs at neighbouring
positions share the channel's weights and overlapping input patches -- and Clark's max of *independent*
Gaussians then over-states the mean of the max and under-states its variance.  This rewrite of the
layer graph lets the pool fold Clark's *correlated* max instead (:mod:`pyro2pfp.ops.window_covariance`):

1. **Activations after the pool.**  For a non-decreasing elementwise map ``f`` (ReLU, LeakyReLU with a
   slope ≥ 0, Hardtanh/ReLU6, Sigmoid, Tanh, Softplus, ELU with α ≥ 0, scaling by c ≥ 0, an eval-mode
   BatchNorm whose scales are all ≥ 0; not GELU or SiLU) ``max_pool(f(a)) = f(max_pool(a))`` exactly, so
   ``… → f → max_pool`` becomes ``… → max_pool → f`` (a chain of such maps moves as a whole): the max sees
   the Gaussian pre-activations, whose covariances are known, and ``f``'s moments are computed once per
   pooled output instead of once per tap.  The last moved map takes the pool's name (it computes what the
   torch pool computed); the max pool is renamed ``<pool>_pre_<op>``.  A moved map that other layers also
   read stays for them.
2. **Window covariances**, a deterministic ``(C, pairs, OH, OW)`` tensor that becomes the pool's second
   input, built from what produces the pool's input ``a`` (layers named ``<pool>_window_cov…``):

   * a conv (``groups = 1``, no dilation): ``window_cov`` of the conv's input and weights -- exact for a
     mean-field input; in a shared-factor plan its rule adds the factors' part (its docstring);
   * ``a = b + c`` (a residual add): the sum of ``b``'s and ``c``'s window covariances (``add`` layers);
     in a shared-factor plan also the branches' covariance through their shared factors
     (``window_closure`` of ``b`` and ``c``: ``s_b,P·s_c,Q + s_c,P·s_b,Q`` times ``⟨g_b, g_c⟩``);
   * an eval-mode BatchNorm ``γ·b + β`` or a scaling ``c·b``: ``γ²`` (``c²``) times ``b``'s (``affine`` /
     ``scale`` layers; exact);
   * a concatenation along the channels: the concatenation of the parts' (``concat``);
   * any other activation ``f(b)`` (GELU, SiLU, a map with other readers): ``window_activation`` of ``b``
     and ``b``'s covariances (Mehler's expansion to second order, its docstring);
   * anything else (the network input, a dense layer reshaped, another pool): in a shared-factor plan
     the edge's own factors (``window_closure``: ``s_P·s_Q·‖g_c‖²``, the scheme's covariance of two
     elements of a channel); in a mean-field plan nothing (the scheme takes such elements as independent),
     and a summand without covariances adds none.

Every max pool whose input is random gets covariances this way in a shared-factor plan; in mean-field
plans every pool whose input reaches a conv through the ops above (:func:`pool_caveats` names the rest).
``convert(..., max_pool="independent")`` skips the rewrite (the paper's rule).
"""
from __future__ import annotations

from ..options import MaxPool, values
from .graph import INPUT, GaussianParam, Layer, LayerGraph
from .registry import OPS

MAX_POOL_RULES = values(MaxPool)


def _activation(layer: Layer) -> bool:
    return layer.op in OPS and OPS[layer.op].activation is not None


def _non_decreasing(layer: Layer) -> bool:
    """``layer`` is an elementwise map that is non-decreasing in its input (so it commutes with a max):
    ``OpDef.non_decreasing``, or an activation's ``ActivationRule.non_decreasing``."""
    op = OPS.get(layer.op)
    if op is not None and op.non_decreasing is not None:
        return bool(op.non_decreasing(layer))
    rule = op.activation if op is not None else None
    return rule is not None and rule.non_decreasing is not None and bool(rule.non_decreasing(layer.attrs))


def _window_max(layer: Layer) -> bool:
    """``layer`` is a max pool (``OpDef.window_max``)."""
    return layer.op in OPS and OPS[layer.op].window_max


class WindowCovariances:
    """Builds the layers that compute the in-window covariances of one pool's input (module docstring).

    An op's ``OpDef.window_covariances(covs, layer)`` says how they pass through a layer of it, with
    :meth:`build` (an input edge's), :meth:`new` (a layer of the same ``out_shape``), :meth:`from_conv`
    (a conv's own) and :meth:`closure` (the edges' shared factors' part, in a shared-factor plan); it
    returns the layer holding them (None: none known) and sets :attr:`partial` where a summand has none."""

    def __init__(self, graph: LayerGraph, pool: Layer, shared: bool) -> None:
        self.by_name = {layer.name: layer for layer in graph.layers}
        self.pool, self.shared = pool, shared
        kernel = pool.attrs["kernel"]
        c, oh, ow = pool.out_shape
        self.out_shape = (c, kernel[0] * kernel[1] * (kernel[0] * kernel[1] - 1) // 2, oh, ow)
        self.pool_attrs = {key: pool.attrs[key] for key in ("kernel", "stride", "padding", "ceil_mode")}
        self.layers: list[Layer] = []
        self.partial = False  # a summand without covariances (mean-field)

    def new(self, op: str, inputs: list[str], what: str, attrs: dict | None = None,
            params: dict[str, GaussianParam] | None = None) -> str:
        """A new layer of ``op`` (of the covariances' shape); its name."""
        name = f"{self.pool.name}_window_cov" + (f"_{len(self.layers)}" if self.layers else "")
        self.layers.append(Layer(name=name, op=op, inputs=inputs, out_shape=self.out_shape,
                                 source=f"{self.pool.source}: {what}", attrs=attrs or {}, params=params or {}))
        return name

    def closure(self, edges: list[str], what: str) -> str | None:
        """The covariance of ``edges`` through their shared factors (``window_closure``; None in a
        mean-field plan)."""
        if not self.shared:
            return None
        in_hw = list(self.shape(edges[0])[1:])
        return self.new("window_closure", edges, what, {"pool": self.pool_attrs, "in_hw": in_hw})

    def from_conv(self, conv: Layer, what: str) -> str:
        """A conv's in-window covariances from its input and weights (``window_cov``)."""
        conv_attrs = {key: conv.attrs[key] for key in ("stride", "padding")}
        return self.new("window_cov", [conv.inputs[0]], what,
                        {"conv": conv_attrs, "pool": self.pool_attrs, "conv_out_hw": list(conv.out_shape[1:])},
                        {k: v for k, v in conv.params.items() if k in ("weight", "bias")})

    def shape(self, edge: str) -> tuple[int, ...]:
        return self.by_name[edge].out_shape

    def build(self, edge: str) -> str | None:
        """The name of the layer holding ``edge``'s in-window covariances (None: none known)."""
        if edge == INPUT:
            return None
        layer = self.by_name[edge]
        op, source = layer.op, self.what(edge)
        hook = OPS[op].window_covariances if op in OPS else None
        if hook is not None:
            return hook(self, layer)
        if _activation(layer):
            inner = self.build(layer.inputs[0])
            if inner is None:
                return self.closure([edge], source)
            return self.new("window_activation", [layer.inputs[0], inner], source,
                            {"activation": op, "attrs": dict(layer.attrs), "pool": self.pool_attrs,
                             "in_hw": list(self.shape(edge)[1:])})
        return self.closure([edge], source)

    @staticmethod
    def what(edge: str) -> str:
        """The source text of the layers holding ``edge``'s covariances."""
        return f"in-window covariances of {edge}"


def correlate_max_pools(graph: LayerGraph, shared: bool = False) -> LayerGraph:
    """``graph`` with the rewrite of the module docstring applied to every max pool it covers (the same
    object when there is none; the input graph is never modified).  ``shared``: the plan carries shared
    factors (every random pool input then has covariances: the scheme's own where nothing better is known)."""
    by_name = {layer.name: layer for layer in graph.layers}
    users: dict[str, int] = {graph.output: 1}
    for layer in graph.layers:
        for name in layer.inputs:
            users[name] = users.get(name, 0) + 1
    replaced: dict[str, list[Layer]] = {}
    moved: set[str] = set()
    for pool in graph.layers:
        if not _window_max(pool) or len(pool.inputs) != 1 or pool.attrs["kernel"][0] * pool.attrs["kernel"][1] < 2:
            continue
        chain: list[Layer] = []  # the non-decreasing maps between the pool and its covariance source, top first
        base = pool.inputs[0]
        while base != INPUT and _non_decreasing(by_name[base]):
            chain.append(by_name[base])
            base = by_name[base].inputs[0]
        covs = WindowCovariances(graph, pool, shared)
        cov = covs.build(base)
        if cov is None:
            continue
        pool_name = f"{pool.name}_pre_{chain[0].op}" if chain else pool.name
        note = f"correlated Clark max (covariances: {cov})"
        if chain:
            note += "; " + ", ".join(layer.op for layer in reversed(chain)) + " moved after it"
        new = [*covs.layers, Layer(name=pool_name, op=pool.op, inputs=[base, cov], out_shape=pool.out_shape,
                                   source=pool.source, attrs=dict(pool.attrs), params=dict(pool.params), note=note)]
        prev = pool_name
        for k, act in enumerate(reversed(chain)):
            name = pool.name if k == len(chain) - 1 else f"{pool.name}_post_{act.name}"
            new.append(Layer(name=name, op=act.op, inputs=[prev], out_shape=pool.out_shape, source=act.source,
                             attrs=dict(act.attrs), params=dict(act.params),
                             note=f"{act.name} applied after the max pool (exact: {act.op} is non-decreasing)"))
            prev = name
        replaced[pool.name] = new
        moved.update(layer.name for layer in chain)
    if not replaced:
        return graph
    layers: list[Layer] = []
    for layer in graph.layers:
        layers.extend(replaced.get(layer.name, [layer]))
    dropped = _unread(layers, graph.output, moved)
    layers = [layer for layer in layers if layer.name not in dropped]
    origins = {name: node for name, node in graph.origins.items() if name not in dropped}
    return LayerGraph(input_shape=graph.input_shape, layers=layers, output=graph.output,
                      input_variance=graph.input_variance, origins=origins, guide_factors=graph.guide_factors)


def _unread(layers: list[Layer], output: str, candidates: set[str]) -> set[str]:
    """The ``candidates`` (moved maps) that no layer reads any more, after those dropped before them."""
    dropped: set[str] = set()
    for layer in reversed(layers):
        if layer.name not in candidates or layer.name == output:
            continue
        if not any(layer.name in other.inputs for other in layers if other.name not in dropped):
            dropped.add(layer.name)
    return dropped


def _passes_through(layer: Layer) -> bool:
    """Elementwise layers of one input between a conv and the next one (activations, per-channel affine
    maps)."""
    return _activation(layer) or (len(layer.inputs) == 1 and layer.op in OPS and OPS[layer.op].elementwise)


def pool_caveats(graph: LayerGraph, shared: bool = False) -> list[str]:
    """What a user should know about the max pools of a plan after :func:`correlate_max_pools`: pools that
    keep the independent fold (their input reaches no conv through the ops the rewrite covers: mean-field
    plans), and correlated pools whose conv reads another conv's output with no pooling between --
    neighbouring inputs then share most of their noise, which mean-field PFP does not carry (``shared``: a
    shared-factor plan carries it through its factors, one normal per channel), so the in-window
    correlation is under-stated."""
    by_name = {layer.name: layer for layer in graph.layers}
    notes = []
    for layer in graph.layers:
        if not _window_max(layer):
            continue
        if len(layer.inputs) == 1:
            src = by_name.get(layer.inputs[0])
            what = "the network input" if src is None else f"{src.name} ({src.op})"
            notes.append(f"{layer.source}: max pool '{layer.name}' reads {what}, which reaches no conv through "
                         "activations, adds, BatchNorms or concatenations, so it folds its window as independent "
                         "Gaussians: its variance is under-stated where the window is correlated")
            continue
        for cov in _window_covs(by_name, layer.inputs[1]):
            name = cov.inputs[0]
            while name != INPUT and _passes_through(by_name[name]):
                name = by_name[name].inputs[0]
            if name != INPUT and by_name[name].op in OPS and OPS[by_name[name].op].positions_share_weights:
                carried = ("the plan carries the correlation of neighbouring inputs only through its shared "
                           "factors (one normal per channel)" if shared else
                           "mean-field PFP drops the correlation of neighbouring inputs")
                notes.append(f"{layer.source}: max pool '{layer.name}' follows a conv whose input is another conv's "
                             f"output ({name}) with no pooling between; {carried}, so the in-window correlation "
                             "and the pool's moments are approximate")
                break
    return notes


def _window_covs(by_name: dict[str, Layer], name: str) -> list[Layer]:
    """The ``window_cov`` layers a pool's covariance input is built from."""
    layer = by_name[name]
    if layer.op == "window_cov":
        return [layer]
    return [cov for n in layer.inputs if n in by_name for cov in _window_covs(by_name, n)]
