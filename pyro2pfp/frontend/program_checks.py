"""Checks of the exported program before it is converted: every op the output depends on has a PFP
converter (:func:`check_supported_ops`), and the program computes the same network at batch 1
(:func:`check_batch_independent`).  Both name the user's line."""
from __future__ import annotations

import difflib

import torch

from .. import ops as _ops  # noqa: F401  (registers the converters that check_supported_ops consults)
from ..errors import TracingError, UnsupportedLayerError
from ..planning.converters import CONVERTERS, unsupported_message
from .output_chain import trailing_chain_nodes
from .param_expressions import input_dependent
from .trace_passes import compute_ops, tensor_ops, torch_module, user_line, user_source


def check_supported_ops(program: torch.export.ExportedProgram, model_name: str, prefix: str) -> None:
    """Raise :class:`UnsupportedLayerError` for the first op the output depends on that has no PFP
    converter, naming the built-in torch module it is computed in (``attn`` (nn.MultiheadAttention);
    ``prefix`` the path of the user's model in the traced wrapper), or else the user's line, before anything
    else compares or converts the graph."""
    chain = trailing_chain_nodes(program)  # a final normalisation: stripped later (pyro2pfp.frontend.output_chain)
    reached = input_dependent(program.graph, set(program.graph_signature.user_inputs))
    for node in tensor_ops(program):
        target = str(node.target)
        if target in CONVERTERS or target.startswith("aten.sym_") or node in chain or node not in reached:
            continue  # (not reached from the input: a weight computed from parameters, param_expressions)
        op = target.removesuffix(".default")
        module = torch_module(node, prefix)
        if module is None:
            raise UnsupportedLayerError(unsupported_message(f"{model_name} ({op}) at {user_source(node)}"))
        path, cls = module
        raise UnsupportedLayerError(unsupported_message(f"`{path}` ({cls})", f": {path} ({op}) has no PFP rule"))


def check_batch_independent(program: torch.export.ExportedProgram, single: torch.export.ExportedProgram) -> None:
    """Raise :class:`TracingError` if ``forward`` computes something else at batch 1 (``single``, the model
    traced at batch 1, its identity broadcasts folded) than in ``program``.

    The program is traced with a symbolic batch, which torch assumes to be ≥ 2 (sizes 0 and 1 are
    specialised), so ``if x.shape[0] > 1:`` is baked in without a guard.  A second trace at batch 1
    must run the same computing ops in the same order, or the converted network would be wrong there.
    Compared are the tensor ops the output depends on (arithmetic on the symbolic batch size exists
    at batch ≥ 2 only); a difference inside a built-in torch module is torch lowering the same
    module differently at batch 1, not a branch in the model, and is passed over.
    """
    ops, ops1 = compute_ops(program), compute_ops(single)
    keys, keys1 = ([(str(n.target), str(torch_module(n))) for n in nodes] for nodes in (ops, ops1))
    matcher = difflib.SequenceMatcher(a=keys, b=keys1, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        differing = [n for n in [*ops[i1:i2], *ops1[j1:j2]] if torch_module(n) is None]
        if not differing:
            continue
        a = ops[i1] if i1 < i2 else None
        b = ops1[j1] if j1 < j2 else None
        where = user_line(differing[0])
        first, second = (n.target if n is not None else "nothing" for n in (a, b))
        raise TracingError(
            f"the model computes differently at batch 1 than at batch ≥ 2 ({first} vs {second} at {where}): "
            "forward() branches on the batch "
            "size (e.g. `if x.shape[0] > 1:`). PFP needs one network for every batch size: remove the branch.")
