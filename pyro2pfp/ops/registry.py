"""The op registry: one :class:`OpDef` per PFP op, the single list every back end is checked against.

An op definition is NumPy-only metadata (importing it never imports TVM or ONNX): the PFP op name
(``Layer.op``), the torch ops its converter handles, the torch modules it covers, its moment rule
and assumptions (the README's layer table is rendered from these), and flags.  The implementations
register themselves against the same name with the per-stage decorators:

* converter:  :func:`pyro2pfp.converters.register` (``torch op name -> Layer``),
* reference:  :func:`pyro2pfp.reference.reference` (float64 NumPy executor),
* ONNX:       :func:`pyro2pfp.onnx_export.exporter`,
* TVM:        :func:`pyro2pfp.tvm_backend.kernel` and :func:`pyro2pfp.tvm_backend.schedule`
  (or ``tvm_backend.schedules``' defaults).

``tests/test_registry.py`` checks that every registered op has all of them, and a Monte Carlo
and a compiled-vs-reference test (``@pytest.mark.pfp_op(op, kind)``).  Modelled on onnx2torch's
``node_converters/registry.py`` (decorator registration, duplicates rejected).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ..errors import PFPError


class OpRegistryError(PFPError):
    """An op was registered twice, or looked up but never registered."""


@dataclass(frozen=True)
class OpDef:
    """One PFP op.

    ``torch_ops``: the ``str(node.target)`` names its converters handle; ``modules``: the torch
    modules/expressions they come from, as the README table shows them (``modules_short``: the
    names listed in the unsupported-op message); ``moments``/``assumptions``: the moment rule's
    exactness and what it assumes (see docs/pfp-math.md); ``compute_layer``: has Gaussian weights
    (dense, conv); ``fusable``: may be fused into the epilogue of a preceding compute kernel;
    ``internal``: inserted by the planner, never converted from torch (no table row, no converter);
    ``table_op``: the op column of the table when it is not just ``name``; ``view``: emitted as a
    Relax view (no PrimFunc, so no schedule); ``required_tests``: the test kinds the completeness
    test demands (an op with no moments to sample, e.g. ``reshape``, omits ``"monte_carlo"``).
    """

    name: str
    torch_ops: tuple[str, ...] = ()
    modules: str = ""
    modules_short: tuple[str, ...] = ()
    moments: str = ""
    assumptions: str = ""
    compute_layer: bool = False
    fusable: bool = False
    internal: bool = False
    table_op: str = ""
    view: bool = False
    # test kinds every op needs (``@pytest.mark.pfp_op(name, kind)``)
    required_tests: tuple[str, ...] = field(default=("monte_carlo", "compiled"))


OPS: dict[str, OpDef] = {}
"""``{op name: OpDef}`` in registration order."""

# Torch ops that convert to no PFP layer of their own (the identity on an activation, or stripped).
PASS_THROUGH_TORCH_OPS = (
    "aten.dropout.default", "aten.feature_dropout.default", "aten.alpha_dropout.default",
    "aten.clone.default", "aten.contiguous.default", "aten.detach.default", "aten.alias.default",
    "aten.identity.default",
    "aten.softmax.int", "aten._softmax.default", "aten.log_softmax.int", "aten._log_softmax.default",
)
PASS_THROUGH_MODULES = ("Dropout", "Identity", "a final softmax/log_softmax (stripped)")
EXTRA_TABLE_ROWS = (
    ("final `softmax` / `log_softmax`", "stripped, with a warning", "—",
     "the network outputs the logits' (mean, variance)"),
)


def register_op(op: OpDef) -> OpDef:
    """Add ``op`` to :data:`OPS`; a second op of the same name or claiming the same torch op raises."""
    if op.name in OPS:
        raise OpRegistryError(f"PFP op {op.name!r} is registered twice")
    for other in OPS.values():
        shared = set(op.torch_ops) & set(other.torch_ops)
        if shared:
            raise OpRegistryError(f"torch op(s) {sorted(shared)} claimed by both {other.name!r} and {op.name!r}")
    OPS[op.name] = op
    return op


def get_op(name: str) -> OpDef:
    """The registered op ``name``; :class:`OpRegistryError` naming the known ops otherwise."""
    try:
        return OPS[name]
    except KeyError:
        raise OpRegistryError(f"unknown PFP op {name!r}; registered: {', '.join(OPS)}") from None


def supported_modules() -> list[str]:
    """The torch modules/expressions PFP converts, for messages."""
    names: list[str] = []
    for op in OPS.values():
        names.extend(n for n in op.modules_short if n not in names)
    return names + list(PASS_THROUGH_MODULES)


def render_layer_table(ops: Iterable[OpDef] | None = None) -> str:
    """The README's "supported layers" markdown table, one row per (non-internal) op."""
    rows = ["| layer (torch) | PFP op | moments | assumptions |", "|---|---|---|---|"]
    for op in (OPS.values() if ops is None else ops):
        if op.internal:
            continue
        rows.append(f"| {op.modules} | {op.table_op or op.name} | {op.moments} | {op.assumptions} |")
    rows.extend(f"| {' | '.join(row)} |" for row in EXTRA_TABLE_ROWS)
    return "\n".join(rows)
