"""Stage 3: walk the exported torch graph and build the :class:`~pyro2pfp.planning.graph.LayerGraph`.

One walk over the nodes the output depends on, in graph order; each ``call_function`` node is
dispatched by its op name (``"aten.linear.default"``) to the converter registered for it
(:mod:`pyro2pfp.planning.converters`; the converters live in the op family files, ``pyro2pfp/ops/``).  A
converter returns a :class:`~pyro2pfp.planning.graph.Layer` (or a list), or :class:`Alias` when the node is
the identity on one of its inputs (dropout at inference, ``contiguous``, …).
"""
from __future__ import annotations

import operator
import re
import warnings
from typing import Any

import torch
import torch.fx

from .. import ops  # noqa: F401  (registers the converters)
from .._version import __version__
from ..errors import InternalError, PFPError, TracingError, UnsupportedLayerError
from ..planning.converters import CONVERTERS, Alias, unsupported_message
from ..planning.graph import INPUT, GaussianParam, Layer, LayerGraph
from ..planning.onedim import lift_1d
from .output_chain import extra_input_error, strip_output_normalisation
from .param_expressions import ParamExpressions, input_dependent
from .trace_passes import user_source
from .tracing import WRAPPER_PREFIX, TracedModel

# Ops that only compute shapes (SymInts) or are bookkeeping; never activations.
_SHAPE_OPS = {"aten.sym_size.int", "aten.sym_numel.default"}


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    path = path.removeprefix("L['self'].")
    if path == "model":
        return ""
    # A pyro.random_module net's deterministic copy (tracing._Wrapper.lifted): the net's own paths.
    return re.sub(r"^lifted\.m\d+(\.|$)", "", path.removeprefix(WRAPPER_PREFIX))


class ConversionContext:
    """What a converter may ask about the graph while converting one node."""

    def __init__(self, traced: TracedModel) -> None:
        self.traced = traced
        sig = traced.program.graph_signature
        self._param_of = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
        values = {name: traced.params[path.removeprefix(WRAPPER_PREFIX)] for name, path in self._param_of.items()
                  if path.removeprefix(WRAPPER_PREFIX) in traced.params}
        for name, fqn in sig.inputs_to_lifted_tensor_constants.items():  # e.g. a model function's module tensors
            if fqn in traced.constants:
                values[name] = traced.constants[fqn]
        reached = input_dependent(traced.program.graph, set(sig.user_inputs))
        # Weights computed from parameters in forward (w.T, b.expand(batch, -1)): param_expressions.
        self.weights = ParamExpressions(values, reached, self.source)
        self._names: dict[torch.fx.Node, str] = {}
        self._used: set[str] = {INPUT}
        self.layers: list[Layer] = []
        self.output_node: torch.fx.Node | None = None
        self.origins: dict[str, str] = {}  # layer name → the fx node whose value it computes

    # -- questions converters ask ------------------------------------------------------------
    def source(self, node: torch.fx.Node) -> str:
        """Module path and torch op of a node, for summaries and errors: ``fc1 (aten.linear)``."""
        op = str(node.target).removesuffix(".default")
        path = _module_path(node)
        where = self.traced.forward_name or f"{self.traced.model_name or 'model'}.forward"
        return f"{path} ({op})" if path else f"{where} ({op})"

    def module_path(self, node: torch.fx.Node) -> str:
        return _module_path(node)

    def param(self, arg: Any, node: torch.fx.Node, role: str) -> GaussianParam | None:
        """The Gaussian parameter behind a placeholder argument (None for an absent optional arg)."""
        if arg is None:
            return None
        if self.weights.is_weight(arg):
            return self.weights.value(arg)
        raise UnsupportedLayerError(
            f"{self.source(node)}: the {role} is computed in forward() rather than being a "
            "parameter/sample site; PFP needs weights that are model parameters."
        )

    def is_parameter(self, arg: Any) -> bool:
        """Whether an argument is a model parameter/buffer (a weight or sample site), or computed from them alone
        (:mod:`pyro2pfp.frontend.param_expressions`), not an activation."""
        return self.weights.is_weight(arg)

    def producer(self, arg: Any) -> Layer | None:
        """The layer whose output an activation argument is (None for the network input)."""
        name = self._names.get(arg) if isinstance(arg, torch.fx.Node) else None
        return next((layer for layer in self.layers if layer.name == name), None)

    def activation(self, arg: Any, node: torch.fx.Node) -> str:
        """The layer name that produces an activation argument."""
        if isinstance(arg, torch.fx.Node) and arg in self._names:
            return self._names[arg]
        if self.weights.is_weight(arg):
            path = self._param_of.get(arg.name, "").removeprefix(WRAPPER_PREFIX)
            param = self.traced.params.get(path)
            what = f"the weight of sample site '{param.site}'" if param is not None and param.site else \
                f"parameter {path}" if path else f"a value computed from parameters ({user_source(arg)})"
            raise UnsupportedLayerError(
                f"{self.source(node)}: computes with {what} as if it were an activation (PFP reads weights only "
                "where a Linear/Conv/matmul/normalisation layer uses them directly). Use the weight as it is: "
                "make the weight itself the sample site (e.g. scale its prior rather than the sample), or "
                "fold the computation into the layer's input."
            )
        raise UnsupportedLayerError(f"{self.source(node)}: unsupported argument {arg!r}")

    def shape(self, arg: Any) -> tuple[int, ...]:
        """Static shape of a tensor node without its (symbolic) batch dimension."""
        val = arg.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() == 0:
            raise UnsupportedLayerError(f"{arg.name}: expected a batched tensor, got {val!r}")
        dims = list(val.shape)
        static = self.traced.static_batch  # a model that fixed its batch size: traced at that size
        if not isinstance(dims[0], torch.SymInt) and (static is None or dims[0] != static):
            raise UnsupportedLayerError(
                f"{self.source(arg) if arg.op == 'call_function' else arg.name}: the batch dimension "
                f"is not the first axis of shape {tuple(dims)}; PFP layers keep the batch first."
            )
        rest = []
        for d in dims[1:]:
            if not isinstance(d, int):
                raise UnsupportedLayerError(f"{self.source(arg)}: dimension {d} is data-dependent")
            rest.append(int(d))
        return tuple(rest)

    def is_output(self, node: torch.fx.Node) -> bool:
        """Whether ``node`` is the value the model returns."""
        return node is self.output_node

    def unsupported(self, node: torch.fx.Node, why: str) -> UnsupportedLayerError:
        return UnsupportedLayerError(f"{self.source(node)}: {why}")

    def new_name(self, node: torch.fx.Node, prefer_module: bool) -> str:
        path = _module_path(node)
        base = path if (prefer_module and path) else node.name
        name, i = base, 1
        while name in self._used:
            i += 1
            name = f"{base}_{i}"
        self._used.add(name)
        return name


def _reachable(output: torch.fx.Node) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = [output]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def _unsupported_message(ctx: ConversionContext, node: torch.fx.Node) -> str:
    return unsupported_message(ctx.source(node))


def build_layer_graph(traced: TracedModel) -> LayerGraph:
    """Convert the traced program into a :class:`LayerGraph` (float64 parameters, torch layouts)."""
    stripped, where = strip_output_normalisation(traced.program, regression=traced.regression())
    if stripped:
        warnings.warn(f"the final {stripped} is stripped{f' ({where})' if where else ''}: it normalises the "
                      "logits, and the PFP network outputs "
                      "the (mean, variance) of the logits. Use pyro2pfp.uncertainty() or convert(..., head='probs') "
                      "for the probabilities.", stacklevel=3)
    graph = traced.program.graph_module.graph
    ctx = ConversionContext(traced)
    user_inputs = traced.program.graph_signature.user_inputs
    out_node = next(n for n in graph.nodes if n.op == "output")
    outs = [a for a in torch.fx.node.map_arg(out_node.args[0], lambda n: n) if a is not None] \
        if isinstance(out_node.args[0], tuple | list) else [out_node.args[0]]
    if len(outs) != 1 or not isinstance(outs[0], torch.fx.Node):
        raise TracingError(
            f"the model's forward must return one tensor (the logits); it returned {len(outs)} values"
        )
    result = outs[0]
    ctx.output_node = result
    needed = _reachable(result)
    input_node = next(n for n in graph.nodes if n.op == "placeholder" and n.name in user_inputs)
    for node in graph.nodes:
        if node not in needed:
            continue
        if node.op == "placeholder":
            if node is input_node:
                ctx._names[node] = INPUT
            elif node.name in user_inputs:
                names = traced.extra_inputs
                index = user_inputs.index(node.name) - 1
                which = names[index] if 0 <= index < len(names) else "an example argument besides the input"
                raise extra_input_error(which)
            continue
        if node.op != "call_function" or ctx.weights.is_weight(node):  # a weight: read by the layer using it
            continue
        target = str(node.target)
        if target in _SHAPE_OPS or not isinstance(node.meta.get("val"), torch.Tensor | tuple | list):
            continue
        if node.target is operator.getitem:
            src, index = node.args
            if src in ctx._names and index == 0:  # (values, indices) of max_pool2d_with_indices
                ctx._names[node] = ctx._names[src]
                continue
            raise ctx.unsupported(node, f"indexing output {index} of {src.name} is not supported")
        converter = CONVERTERS.get(target)
        if converter is None:
            raise UnsupportedLayerError(_unsupported_message(ctx, node))
        try:
            out = converter(node, ctx)
        except (PFPError, Warning):  # a Warning: raised by the user's warnings filter
            raise
        except Exception as exc:  # a converter's own failure: a bug, reported as such
            raise InternalError(
                f"internal error converting layer {ctx.source(node)} ({type(exc).__name__}: {exc}) -- please "
                f"report it with the model's code (pyro2pfp {__version__}); the original exception is "
                "chained") from exc
        if isinstance(out, Alias):
            name = ctx.activation(out.node, node)
            ctx._names[node] = name
            if ctx.origins.get(name) == getattr(out.node, "name", None):
                ctx.origins[name] = node.name  # the layer's value is now this node's (a bias add folded into it)
        else:
            layers = out if isinstance(out, list) else [out]
            ctx.layers.extend(layers)
            ctx._names[node] = layers[-1].name
            ctx.origins[layers[-1].name] = node.name
    if result not in ctx._names:
        raise TracingError("the model's output does not depend on its input (it returns a constant, or a value "
                           "computed from the weights alone): return the logits computed from the input x, or "
                           "build the likelihood from them")
    return lift_1d(LayerGraph(input_shape=ctx.shape(input_node), layers=ctx.layers, output=ctx._names[result],
                              origins=ctx.origins, guide_factors=traced.guide_factors))
