"""ONNX export of shared-factor PFP: the step that emits, after each layer's mean-field export
(``backends.onnx.builder.SCHEME_STEPS``), the ONNX form of the layer's rule
(:data:`~pyro2pfp.planning.registry.SHARED_EXPORTERS`, registered with each op in ``ops/<family>.py``: most
as the same formula as the float64 reference's, :func:`pyro2pfp.ops._formula.shared_formula`), and a few
helpers of the rules written for ONNX alone.

Float32, dynamic batch; the factor plan without compaction (ONNX has no Cholesky/QR operator; exact:
only ``g·gᵀ`` is used downstream, ``K`` grows with depth instead -- the compiled path compacts, see
``backends/tvm/shared_factor.py``).  Every tensor op is Einsum, MatMul, Pad, Slice (strided kernel
taps), ReduceSum (axes as an input: opset ≥ 13), Reshape, Where and elementwise arithmetic; the
per-input weights of the conv profile are MatMuls over the kernel taps (``Σ_k tap_k(s)·W_k·β``), not
a grouped Conv (whose group count cannot follow a dynamic batch).  Any other elementwise activation
gets Stein's rule with the exact slope of its own mean formula (forward-mode AD on the exporter's
ops, :mod:`pyro2pfp.correlation.stein`).  The raw-moment plan raises an ``ArgumentError``.
"""
from __future__ import annotations

from ..backends.onnx.builder import SCHEME_STEPS, OnnxActivation, OnnxContext, Sym
from ..planning.graph import Repr
from ..planning.plan import PlannedGraph
from ..planning.registry import SHARED_EXPORTERS
from .backend import FixedKStep


class OnnxSharedStep(FixedKStep):
    """Emits the shared-factor rules of one plan after each layer's mean-field export."""

    what = "ONNX export"
    rules = SHARED_EXPORTERS

    def __init__(self, graph: PlannedGraph, ctx: OnnxContext) -> None:
        super().__init__(graph)
        self.ctx = ctx
        self.b = ctx.b

    # ------------------------------------------------------------------ small helpers
    @staticmethod
    def var(a: OnnxActivation) -> Sym:
        """The variance of a random edge (the variance plan: ``second`` is the variance)."""
        assert a.second is not None and a.repr is Repr.VARIANCE, a.repr
        return a.second

    def c(self, value: float) -> Sym:
        return Sym(self.b, value=float(value))

    def einsum(self, eq: str, *xs: Sym) -> Sym:
        return xs[0].nary("Einsum", *xs[1:], equation=eq)

    def rsum(self, x: Sym, axes: list[int]) -> Sym:
        """Sum over ``axes``, kept as size-1 axes."""
        return x.nary("ReduceSum", self.b.ints(axes, "axes"), keepdims=1)

    def view_as(self, x: Sym, *shape: int) -> Sym:
        return self.ctx.reshape(x, shape)

    def prune(self, start: int, outputs: list[str]) -> None:
        """Drop the nodes added since ``start`` that none of ``outputs`` depends on."""
        nodes = self.ctx.b.nodes
        needed, kept = set(outputs), []
        for node in reversed(nodes[start:]):
            if any(o in needed for o in node.output):
                needed.update(node.input)
                kept.append(node)
        nodes[start:] = kept[::-1]


SCHEME_STEPS["shared-factor"] = OnnxSharedStep
