"""Weights written as expressions of parameters and sample sites: ``x @ w.T``, ``w.view(out, in)``,
``h + b.expand(x.shape[0], -1)``, ``F.softplus(self.raw_scale) * x``.

In the traced graph such an expression is a chain of ops that no path from the network input reaches:
not a layer, but the way the model attaches a weight.  The layer that uses it asks for its value
(:meth:`ParamExpressions.value`), which is evaluated here, in float64:

* on deterministic operands (parameters, buffers, tensor constants) any op: the result is deterministic
  and exact;
* on a sample site's Gaussian (independent entries ``N(μ, v)``), the ops that only move entries --
  transpose, permute, view/reshape, squeeze/unsqueeze, select/slice, clone -- move mean and variance alike,
  and a scaling by a constant ``c`` gives ``N(cμ, c²v)``: the entries stay independent Gaussians, exactly.
  An ``expand`` that copies entries would make copies that share one random value (perfectly
  correlated), which independent weights cannot represent, so it is refused with the user's line --
  except an expand over the batch dimension (``b.expand(x.shape[0], -1)``): every input of a batch uses
  the same weights anyway, so the weight is the unexpanded one;
* anything else applied to a sample site (``exp(w)``, ``w1 * w2``) is refused, naming the op, the site and
  the line that computes it.
"""
from __future__ import annotations

import numbers
from typing import Any

import numpy as np
import torch
import torch.fx

from ..errors import UnsupportedLayerError
from ..planning.graph import GaussianParam
from .trace_passes import user_source

# Ops that only move entries: a Gaussian's mean and variance move alike.
_MOVES = {"t", "numpy_T", "permute", "transpose", "view", "reshape", "_unsafe_view", "squeeze", "unsqueeze",
          "clone", "contiguous", "alias", "detach", "lift_fresh_copy", "flatten", "unflatten", "select", "slice",
          "_to_copy", "to", "expand"}
_SCALINGS = {"mul", "div"}


def input_dependent(graph: torch.fx.Graph, inputs: set[str]) -> set[torch.fx.Node]:
    """The nodes a path of tensors from the placeholders named ``inputs`` (the user's inputs) reaches."""
    reached: set[torch.fx.Node] = set()
    for node in graph.nodes:  # through tensors only: b.expand(x.shape[0], -1) reads the input's size, not values
        if (node.op == "placeholder" and node.name in inputs) or any(
                a in reached and not isinstance(a.meta.get("val"), torch.SymInt | int) for a in node.all_input_nodes):
            reached.add(node)
    return reached


def _op(node: torch.fx.Node) -> str:
    return str(node.target).removeprefix("aten.").split(".")[0]


def _symbolic(arg: Any) -> bool:
    val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg
    return isinstance(val, torch.SymInt)


class ParamExpressions:
    """The weight-valued nodes of a traced program and their values (module docstring).

    ``params``: ``{placeholder name: GaussianParam}`` of the parameters, buffers and tensor constants;
    ``reached``: the nodes that depend on the network input (:func:`input_dependent`); ``where(node)``: how
    to name a node in messages."""

    def __init__(self, params: dict[str, GaussianParam], reached: set[torch.fx.Node], where: Any) -> None:
        self.params = params
        self.reached = reached
        self.where = where
        self._values: dict[torch.fx.Node, GaussianParam] = {}

    def is_weight(self, arg: Any) -> bool:
        """Whether ``arg`` is a parameter, buffer or constant, or computed from them alone."""
        if not isinstance(arg, torch.fx.Node) or arg in self.reached:
            return False
        if arg.op == "placeholder":
            return arg.name in self.params
        return arg.op == "call_function" and isinstance(arg.meta.get("val"), torch.Tensor)

    def value(self, node: torch.fx.Node) -> GaussianParam:
        """The Gaussian of a weight-valued node (:meth:`is_weight`)."""
        if node not in self._values:
            self._values[node] = self.params[node.name] if node.op == "placeholder" else self._evaluate(node)
        return self._values[node]

    def _evaluate(self, node: torch.fx.Node) -> GaussianParam:
        op = _op(node)
        operands = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        values = {a: self.value(a) for a in operands}
        random = [a for a in operands if not values[a].is_deterministic]

        def run(which: str) -> np.ndarray:
            def arg(a: Any) -> Any:
                if isinstance(a, torch.fx.Node):
                    if a in values:
                        return torch.as_tensor(getattr(values[a], which), dtype=torch.float64)
                    return int(a.meta["val"]) if not _symbolic(a) else -1
                return a
            args = torch.fx.node.map_aggregate(node.args, arg)
            kwargs = {k: v for k, v in torch.fx.node.map_aggregate(node.kwargs, arg).items() if k != "dtype"}
            target: Any = node.target
            return np.asarray(target(*args, **kwargs).detach().numpy(), dtype=np.float64).copy()

        if not random:
            mean = run("mean")
            return GaussianParam(mean, np.zeros_like(mean))
        source = values[random[0]]
        site = f"sample site '{source.site}'" if source.site else "a random weight"
        if op == "expand":
            return self._expand(node, source, site)
        if op in _MOVES and len(random) == 1 and node.args[0] is random[0]:
            return GaussianParam(run("mean"), run("var"), site=source.site)
        if op in _SCALINGS and len(node.args) == 2 and isinstance(node.args[1], numbers.Real) \
                and node.args[0] is random[0]:
            c = float(node.args[1]) if op == "mul" else 1.0 / float(node.args[1])
            return GaussianParam(source.mean * c, source.var * c * c, site=source.site)
        raise UnsupportedLayerError(
            f"{self.where(node)}: a weight is computed from {site} by {op} ({user_source(node)}). PFP takes a "
            "sample site's entries as independent Gaussian weights, so a layer can use a sample as it is, moved "
            "(transpose, reshape, select) or scaled by a constant, but not a function of it: make the weight the "
            "layer uses the sample site itself.")

    def _expand(self, node: torch.fx.Node, source: GaussianParam, site: str) -> GaussianParam:
        sizes: list[Any] = list(node.args[1])  # type: ignore[arg-type]
        shape = list(source.shape)
        extra = len(sizes) - len(shape)
        own = [s if not isinstance(s, int) or s != -1 else shape[i] for i, s in enumerate(sizes[extra:])]
        keeps_own = all(not _symbolic(s) and int(s) == shape[i] for i, s in enumerate(own))
        if extra == 1 and _symbolic(sizes[0]) and keeps_own:
            return source  # over the batch: the weight every input of the batch uses
        shown = [("batch" if _symbolic(s) else int(s)) for s in sizes]
        raise UnsupportedLayerError(
            f"{self.where(node)}: {site} (shape {tuple(shape)}) is expanded to {tuple(shown)} "
            f"({user_source(node)}): its copies share one random value (perfectly correlated weights), which PFP's "
            "independent Gaussian weights cannot represent. Sample the weight at the shape the layer uses "
            "(e.g. dist.Normal(0, 1).expand([out, in]).to_event(2)), so that every entry has its own posterior.")
