"""Passes over the traced ``torch.export`` program and queries of it, run by the tracing stage
(:mod:`pyro2pfp.frontend.tracing`): repairing ``users`` lists, folding identity broadcasts, the parameters and
tensor ops the output depends on, and the user's module and source line of a node."""
from __future__ import annotations

import linecache
import operator
import re
from typing import Any

import torch


def repair_users(program: torch.export.ExportedProgram) -> None:
    """Make every node's ``users`` list the nodes that read it.

    A model that assigns sampled tensors to the layers of a ``PyroModule`` container
    (``layer.weight = pyro.sample(...)`` on a ``PyroModule[nn.Sequential]`` of ``PyroModule[nn.Linear]``)
    comes out of ``torch.export(strict=False)`` with the nodes that read the container's output (the
    likelihood normalising the logits) missing from that output's ``users``; removing a dead node then
    fails inside torch.fx (``KeyError`` in ``erase_node``).  The arguments are the graph and ``users``
    is derived from them, so it is rebuilt from them.
    """
    for node in program.graph_module.graph.nodes:
        for source in node.all_input_nodes:
            source.users.setdefault(node, None)


def fold_identity_broadcasts(program: torch.export.ExportedProgram) -> None:
    """Replace ``broadcast_tensors(xs)[i]`` by ``xs[i]`` and ``expand(x)`` by ``x`` where they leave
    the tensor unchanged.

    Building the likelihood (``Normal(mean, sigma)``) broadcasts the network's output with the noise
    scale; the model's returned ``mean`` is then traced as that broadcast.  For an operand that
    already has the broadcast shape it is the identity (exact), and the noise scale no longer looks
    like an input of the network.
    """
    graph = program.graph_module.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not operator.getitem:
            continue
        src, index = node.args
        if not (isinstance(src, torch.fx.Node) and src.target is torch.ops.aten.broadcast_tensors.default):
            continue
        operands = src.args[0]
        if isinstance(operands, list | tuple) and isinstance(index, int):
            _replace_if_same_shape(node, operands[index])
    for node in list(graph.nodes):  # expand to its own shape (a plate over the likelihood)
        if node.op == "call_function" and node.target is torch.ops.aten.expand.default:
            _replace_if_same_shape(node, node.args[0])
    graph.eliminate_dead_code()
    program.graph_module.recompile()


def fold_output_broadcast(program: torch.export.ExportedProgram) -> None:
    """Make an output that is an ``expand`` adding leading dimensions to a batch-first tensor that tensor.

    A likelihood sampled inside the data plate with its event dimensions declared
    (``Categorical(logits=z).to_event(1)`` in ``pyro.plate("data", n)``) is broadcast by the plate to the
    batch shape ``(n, n)``: the tensor it was built from, the network's output, is then traced as
    ``z.expand(n, n, k)`` -- copies of ``z``, one per plate entry, not a layer.  The output is ``z``."""
    out_node = next(n for n in program.graph.nodes if n.op == "output")
    outs = out_node.args[0]
    node = outs[0] if isinstance(outs, tuple | list) and len(outs) >= 1 else outs
    if not isinstance(node, torch.fx.Node) or node.target is not torch.ops.aten.expand.default:
        return
    source = node.args[0]
    val, src = node.meta.get("val"), source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or not isinstance(src, torch.Tensor) or val.dim() <= src.dim() \
            or src.dim() == 0 or not isinstance(src.shape[0], torch.SymInt):
        return
    if [str(d) for d in val.shape[val.dim() - src.dim():]] != [str(d) for d in src.shape]:
        return
    node.replace_all_uses_with(source)
    program.graph_module.graph.eliminate_dead_code()
    program.graph_module.recompile()


def _replace_if_same_shape(node: torch.fx.Node, operand: Any) -> None:
    same = isinstance(operand, torch.fx.Node) and isinstance(operand.meta.get("val"), torch.Tensor) \
        and isinstance(node.meta.get("val"), torch.Tensor) and operand.meta["val"].shape == node.meta["val"].shape
    if same:
        node.replace_all_uses_with(operand)


def used_parameters(program: torch.export.ExportedProgram) -> set[str]:
    """Fully qualified names of the parameters the graph's output depends on."""
    seen = _reachable_from_output(program)
    by_placeholder = program.graph_signature.inputs_to_parameters
    return {by_placeholder[n.name] for n in seen if n.op == "placeholder" and n.name in by_placeholder}


# Ops that only move or view data: a graph traced at batch 1 may use other ones than at batch ≥ 2.
_LAYOUT_OPS = {"view", "reshape", "_unsafe_view", "flatten", "unflatten", "expand", "squeeze", "unsqueeze",
               "clone", "contiguous", "alias", "detach", "detach_", "lift_fresh_copy", "dropout", "t",
               "permute", "transpose", "broadcast_tensors", "identity"}


def _reachable_from_output(program: torch.export.ExportedProgram) -> set[torch.fx.Node]:
    output = next(n for n in program.graph.nodes if n.op == "output")
    seen: set[torch.fx.Node] = set()
    stack = [output]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def tensor_ops(program: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    """The ``call_function`` nodes the output depends on that compute tensors, in graph order: not
    the arithmetic on symbolic sizes (``batch * heads``, present only where the batch is symbolic)
    nor indexing."""
    needed = _reachable_from_output(program)
    return [node for node in program.graph.nodes
            if node in needed and node.op == "call_function" and node.target is not operator.getitem
            and isinstance(node.meta.get("val"), torch.Tensor | tuple | list)]


def compute_ops(program: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    """The computing nodes the output depends on, in order (not shape queries or arithmetic,
    indexing or layout-only ops)."""
    out = []
    for node in tensor_ops(program):
        name = str(node.target).removeprefix("aten.").split(".")[0]
        if name.startswith("sym_") or name in _LAYOUT_OPS:
            continue
        out.append(node)
    return out


# torch.nn classes that only hold other modules: never the module an op is attributed to.
_CONTAINERS = {"Sequential", "ModuleList", "ModuleDict", "ParameterList", "ParameterDict"}


def _type_name(module_type: Any) -> str:
    return module_type if isinstance(module_type, str) else f"{module_type.__module__}.{module_type.__qualname__}"


def torch_module(node: torch.fx.Node, wrapper_prefix: str = "model.") -> tuple[str, str] | None:
    """``(path, "nn.ClassName")`` of the outermost built-in torch module (``torch.nn``, containers
    aside) that ``node`` is computed in, or None when it is computed in the model's own code."""
    for path, module_type in (node.meta.get("nn_module_stack") or {}).values():
        name = _type_name(module_type)
        cls = name.rsplit(".", 1)[-1]
        if name.startswith("torch.nn.") and cls not in _CONTAINERS:
            return path.removeprefix("L['self'].").removeprefix(wrapper_prefix), f"nn.{cls}"
    return None


def user_source(node: torch.fx.Node) -> str:
    """``file:line (`source text`)`` of the innermost frame of the model's code (not torch's,
    Pyro's or pyro2pfp's) in ``node``'s recorded stack trace, or "a line of the model that torch did not
    record"."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', trace)
    user = [f for f in frames if not any(part in f[0] for part in ("/torch/", "/pyro/", "/pyro2pfp/", "<"))]
    if not user:
        return "a line of the model that torch did not record"
    file, line, _ = user[-1]  # (a model function is traced under the name forward: trace_forms.named_forward)
    code = linecache.getline(file, int(line)).strip()
    return f"{file}:{line}" + (f" (`{code}`)" if code else "")


def user_line(node: torch.fx.Node) -> str:
    """``file:line`` of the model code that produced ``node`` (from its recorded stack trace)."""
    trace = node.meta.get("stack_trace") or ""
    frames = [line.strip() for line in trace.splitlines() if line.strip().startswith("File ")]
    user = [f for f in frames if "/torch/" not in f and "/pyro/" not in f and "/pyro2pfp/" not in f]
    frame = (user or frames or ["(unknown location)"])[-1]
    return frame.replace("File ", "").replace('"', "")
