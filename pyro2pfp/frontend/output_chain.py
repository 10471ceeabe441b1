"""The network's output, found by meaning: the logits under a trailing normalisation.

Models end in many spellings of the same thing -- the logits ``z`` of a classifier turned into what
the likelihood takes or what the user likes to return: ``softmax(z)``, ``log_softmax(z)``,
``log_softmax(z).exp()``, ``softmax(z).log()``, ``sigmoid(z)``, ``logsigmoid(z)``, a torch
distribution's own normalisation (``Categorical(logits=z)`` stores ``z - logsumexp(z)``,
``Categorical(probs=p)`` stores ``p / p.sum(-1)``), scalings by a constant after any of these, and
reshapes in between.  PFP propagates the logits' Gaussian moments; the normalisation has no Gaussian
moment rule and is not needed (``pyro2pfp.uncertainty`` or ``convert(..., head="probs")`` give the
probabilities).  :func:`strip_output_normalisation` walks back from the graph's output through such a
chain and makes the output the logits (reshapes kept, so the output keeps its shape).

A scaling *inside* the normalisation stays: ``softmax(z / T)`` has the logits ``z / T`` (a temperature
is part of the logits).  ``exp`` is a normalisation only over a log-normalisation (``exp∘log_softmax``:
probabilities), ``log`` only over a normalisation (``log∘softmax``).  Nothing is stripped when the
output is the mean of a Normal likelihood (a regression: a final sigmoid is then the mean's activation).

Where the chain starts: what the model returns, or -- when it returns ``None`` or its likelihood's
sample -- the tensor the likelihood is built from (:func:`network_output_of`: ``logits`` or ``probs``
as given, or ``loc``).  :func:`check_output` refuses, with the remedy, an output that is missing, not one
tensor, or not computed from the input.
"""
from __future__ import annotations

import numbers
import operator
from typing import Any

import torch
import torch.fx
from pyro.distributions.torch_distribution import ExpandedDistribution, MaskedDistribution

from ..errors import TracingError
from .trace_passes import user_line

_RESHAPES = {"view", "reshape", "_unsafe_view", "squeeze", "unsqueeze", "flatten", "clone", "contiguous",
             "alias", "detach", "expand"}
_NORMALISATIONS = {"softmax": "softmax", "_softmax": "softmax", "log_softmax": "log_softmax",
                   "_log_softmax": "log_softmax", "sigmoid": "sigmoid", "log_sigmoid": "log_sigmoid"}
_CLASSIFIER_ONLY = {"sigmoid", "log_sigmoid"}  # kept for a regression's mean
_RENORMALISED = ("probs / probs.sum(-1)", "logits - logsumexp")  # what torch distributions store
_LOG_NORMALISED = {"log_softmax", "log_sigmoid", "logits - logsumexp"}


def _op(node: Any) -> str:
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target is operator.getitem:
        return ""
    return str(node.target).removeprefix("aten.").split(".")[0]


def _last_dim(dims: Any, node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    rank = val.dim() if isinstance(val, torch.Tensor) else None
    dims = list(dims) if isinstance(dims, list | tuple) else [dims]
    return len(dims) == 1 and (dims[0] == -1 or (rank is not None and dims[0] == rank - 1))


def _constant(arg: Any) -> bool:
    return isinstance(arg, numbers.Real) and not isinstance(arg, bool)


def _step(node: torch.fx.Node, regression: bool) -> tuple[str, torch.fx.Node] | None:
    """``(what, input)`` if ``node`` is one link of an output chain: a normalisation's name, ``"reshape"``,
    ``"scale"`` (by a constant), ``"exp"`` or ``"log"`` (normalisations only next to one); else None."""
    op = _op(node)
    args: Any = node.args
    source = args[0] if args and isinstance(args[0], torch.fx.Node) else None
    if source is None:
        return None
    if op in _RESHAPES:
        return "reshape", source
    if op in _NORMALISATIONS:
        name = _NORMALISATIONS[op]
        if regression and name in _CLASSIFIER_ONLY:
            return None
        if name in ("softmax", "log_softmax") and not _last_dim(args[1], node):
            return None  # over another dimension than the classes: not a normalisation of the logits
        return name, source
    if op in ("exp", "log"):
        return op, source
    if op in ("mul", "div") and len(args) == 2:
        if _constant(args[1]):  # torch puts the tensor first (3 * z is mul(z, 3))
            return "scale", source
        if op == "div" and _op(args[1]) == "sum" and args[1].args[0] is source \
                and _last_dim(args[1].args[1], source) and (args[1].args[2:3] or [False])[0]:
            return "probs / probs.sum(-1)", source  # Categorical(probs=...) renormalises
    if op == "sub" and len(args) == 2 and _op(args[1]) == "logsumexp" and args[1].args[0] is source \
            and _last_dim(args[1].args[1], source) and (args[1].args[2:3] or [False])[0]:
        return "logits - logsumexp", source  # Categorical(logits=...) normalises
    return None


def trailing_chain_nodes(program: torch.export.ExportedProgram) -> set[torch.fx.Node]:
    """The nodes that may form the output's trailing chain (the links :func:`strip_output_normalisation`
    considers, and the sums / logsumexps a renormalisation divides by): ops that need no PFP rule of their
    own when they end the network, for checks that run before the chain is stripped."""
    out_node = next(n for n in program.graph.nodes if n.op == "output")
    outs: Any = out_node.args[0]
    if not isinstance(outs, tuple | list) or len(outs) != 1 or not isinstance(outs[0], torch.fx.Node):
        return set()
    nodes: set[torch.fx.Node] = set()
    node = outs[0]
    while (step := _step(node, regression=False)) is not None:
        nodes.add(node)
        if step[0] in _RENORMALISED and isinstance(node.args[1], torch.fx.Node):
            nodes.add(node.args[1])
        node = step[1]
    return nodes


def _below(chain: list[tuple[str, torch.fx.Node, torch.fx.Node]], i: int) -> str:
    """The first link below chain[i] that is not a reshape ('' if none)."""
    for what, _, _ in chain[i + 1:]:
        if what != "reshape":
            return what
    return ""


def strip_output_normalisation(program: torch.export.ExportedProgram, *, regression: bool) -> tuple[str, str]:
    """Make the graph's (single) output the logits under its trailing normalisation, if it has one.

    Returns what was stripped and where, for the user (``("log_softmax → exp", "model.py, line 12")``),
    ``("", "")`` when nothing or only a distribution's own normalisation was.
    """
    graph = program.graph_module.graph
    out_node = next(n for n in graph.nodes if n.op == "output")
    outs: Any = out_node.args[0]
    if not isinstance(outs, tuple | list) or len(outs) != 1 or not isinstance(outs[0], torch.fx.Node):
        return "", ""
    chain: list[tuple[str, torch.fx.Node, torch.fx.Node]] = []
    node, allowed = outs[0], {out_node}
    while set(node.users) <= allowed:  # used by the chain alone
        step = _step(node, regression)
        if step is None:
            break
        chain.append((step[0], node, step[1]))
        allowed = {node}
        if step[0] in _RENORMALISED and isinstance(node.args[1], torch.fx.Node):
            allowed.add(node.args[1])  # the logsumexp / sum it is normalised by
        node = step[1]
    # Which links are normalisations: exp over a log-normalisation, log over a normalisation.
    deepest = -1
    for i, (what, _, _) in enumerate(chain):
        below = _below(chain, i)
        if what in _NORMALISATIONS.values() or what in _RENORMALISED \
                or (what == "exp" and below in _LOG_NORMALISED) \
                or (what == "log" and below in ("softmax", "sigmoid", "probs / probs.sum(-1)")):
            deepest = i
        elif what in ("exp", "log"):
            break
    if deepest < 0:
        return "", ""
    stripped = [(what, node, source) for what, node, source in chain[:deepest + 1] if what != "reshape"]
    for _, node, source in stripped:
        node.replace_all_uses_with(source)
    graph.eliminate_dead_code()
    _rename_outputs(program, out_node)
    program.graph_module.recompile()
    # What the user wrote, innermost first (a distribution's own normalisation is not news to them).
    written = [(what, node) for what, node, _ in reversed(stripped) if what not in _RENORMALISED]
    if not written:
        return "", ""
    shown = ["× constant" if what == "scale" else what for what, _ in written]
    where = user_line(written[0][1])
    where = "" if "/pyro2pfp/" in where or "unknown" in where else where  # a model function: no frame
    return " → ".join(shown), where


def _rename_outputs(program: torch.export.ExportedProgram, out_node: torch.fx.Node) -> None:
    """Keep the program's output signature naming the (new) output node."""
    from torch.export.graph_signature import TensorArgument

    args: Any = out_node.args[0]
    for spec, arg in zip(program.graph_signature.output_specs, args, strict=False):
        if isinstance(arg, torch.fx.Node) and isinstance(spec.arg, TensorArgument):
            spec.arg = TensorArgument(name=arg.name)


def network_output_of(fn: Any) -> torch.Tensor | None:
    """The tensor a likelihood's distribution was built from -- its ``logits`` or ``probs`` as given, or
    its ``loc`` -- i.e. the network's output when the model returns nothing useful (None, or the sample)."""
    while isinstance(fn, torch.distributions.Independent | MaskedDistribution | ExpandedDistribution):
        fn = fn.base_dist
    given = vars(fn)
    for name in ("logits", "probs", "loc"):  # lazy properties: only the one the distribution was built from
        if isinstance(given.get(name), torch.Tensor):
            return given[name]
    return None


def extra_input_error(which: str) -> TracingError:
    """The error for a network output that depends on an example argument besides the input batch."""
    return TracingError(
        f"the network's output depends on {which}: the example arguments besides the input "
        "batch (labels, …) are only there to run the model and guide, and never enter the network. "
        "Compute the output from the input alone; pass the labels only to the likelihood.")


def check_output(program: torch.export.ExportedProgram, model: Any, extra_names: list[str] | None = None) -> None:
    """Raise :class:`TracingError` unless the traced model returns one tensor computed from its input (and
    from no other example argument: ``extra_names`` name the user inputs after the first)."""
    out_node = next(n for n in program.graph.nodes if n.op == "output")
    outs = out_node.args[0]
    outs = list(outs) if isinstance(outs, tuple | list) else [outs]
    name = getattr(model, "__name__", type(model).__name__)
    if len(outs) == 1 and outs[0] is None:
        raise TracingError(
            f"the model {name} returned None, and no likelihood site is built from the network's output "
            "(Categorical(logits=...), Bernoulli(probs=...), Normal(loc, ...)): return the logits from the "
            "model, or sample a likelihood built from them.")
    if len(outs) != 1 or not isinstance(outs[0], torch.fx.Node):
        raise TracingError(f"the model {name} returned {len(outs)} values; PFP converts a network with one output: "
                           "return the logits alone (one tensor).")
    user_inputs = set(program.graph_signature.user_inputs)
    seen, stack = set(), [outs[0]]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    user_order = list(program.graph_signature.user_inputs)
    for n in seen:
        if n.op == "placeholder" and n.name in user_inputs and user_order.index(n.name) > 0:
            index = user_order.index(n.name) - 1
            names = extra_names or []
            raise extra_input_error(names[index] if index < len(names) else "an example argument besides the input")
    if not any(n.op == "placeholder" and n.name in user_inputs for n in seen):
        raise TracingError(
            f"the model {name}'s output does not depend on its input (it returns a constant, or a value computed "
            "from the weights alone): return the logits computed from the input x, or build the likelihood from "
            "them.")
