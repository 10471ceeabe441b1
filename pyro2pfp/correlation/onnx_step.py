"""ONNX export of shared-factor PFP: the step that emits, after each layer's mean-field export
(``backends.onnx.builder.SCHEME_STEPS``), the ONNX form of the layer's rule
(:data:`~pyro2pfp.planning.registry.SHARED_EXPORTERS`, registered with each op in ``ops/<family>.py``), and
the helpers those rules are written with.

Float32, dynamic batch; the factor plan without compaction (ONNX has no Cholesky/QR operator; exact:
only ``g·gᵀ`` is used downstream, ``K`` grows with depth instead -- the compiled path compacts, see
``backends/tvm/shared_factor.py``).  Every tensor op is Einsum, MatMul, Pad, Slice (strided kernel
taps), ReduceSum (axes as an input: opset ≥ 13), Reshape, Where and elementwise arithmetic; the
per-input weights of the conv profile are Einsums over the kernel taps (``Σ_k tap_k(s)·W_k·β``), not
a grouped Conv (whose group count cannot follow a dynamic batch).  Any other elementwise activation
gets Stein's rule with the exact slope of its own mean formula (forward-mode AD on the exporter's
ops, :mod:`pyro2pfp.correlation.stein`).  The raw-moment plan raises an ``ArgumentError``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backends.onnx.builder import SCHEME_STEPS, OnnxActivation, OnnxContext, Sym
from ..planning.graph import Repr
from ..planning.plan import PlannedGraph
from ..planning.registry import SHARED_EXPORTERS
from .backend import FixedKStep
from .shared import Shared

_TINY = 1e-30


#: the shared part of one edge in the export: ``s`` (B, *edge shape), ``g`` (B, rows, k) as ONNX symbols
OnnxShared = Shared


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

    def t(self, array: np.ndarray, hint: str) -> Sym:
        return self.ctx.tensor(np.asarray(array, dtype=np.float64), hint)

    def einsum(self, eq: str, *xs: Sym) -> Sym:
        return xs[0].nary("Einsum", *xs[1:], equation=eq)

    def rsum(self, x: Sym, axes: list[int]) -> Sym:
        """Sum over ``axes``, kept as size-1 axes."""
        return x.nary("ReduceSum", self.b.ints(axes, "axes"), keepdims=1)

    def where(self, cond: Sym, a: Any, b: Any) -> Sym:
        return cond.nary("Where", a, b)

    def safe_div(self, num: Sym, den: Sym) -> Sym:
        return self.where(den > 0.0, num / den.nary("Max", self.c(_TINY)), 0.0)

    def clip(self, s: Sym, var: Sym) -> Sym:
        sd = var.nary("Max", self.c(0.0)).unary("Sqrt")
        return s.nary("Max", -sd).nary("Min", sd)

    def view_as(self, x: Sym, *shape: int) -> Sym:
        return self.ctx.reshape(x, shape)

    def grouped(self, x: Sym, name: str) -> Sym:
        rows = self.fp.rows[name]
        return self.view_as(x, rows, int(np.prod(self.ctx.shapes[name])) // rows)

    def widened(self, g: Sym, k_in: int, k: int) -> Sym:
        if k_in == k:
            return g
        return g.nary("Pad", self.b.ints([0, 0, 0, 0, 0, k - k_in], "pads"))

    def onehot(self, rows: int, k: int, offset: int) -> Sym:
        e = np.zeros((rows, k))
        e[np.arange(rows), offset + np.arange(rows)] = 1.0
        return self.t(e, "own_factors")

    def normalise(self, loading: Sym) -> tuple[Sym, Sym]:
        """``(g, ‖ℓ‖)`` with ``‖ℓ‖`` kept as (B, R, 1)."""
        norm = self.rsum(loading * loading, [2]).unary("Sqrt")
        return self.safe_div(loading, norm), norm

    def taps(self, x: Sym, shape: tuple[int, ...], kernel: tuple[int, int], stride: list[int], pad: list[int],
             dilation: list[int], out_hw: tuple[int, ...], fill: float = 0.0) -> list[Sym]:
        """The strided (B, C, OH, OW) view of ``x`` (B, C, H, W) for each kernel offset (row-major),
        zero (``fill``) outside (padding, overhang)."""
        h, w = shape[1:]
        end = [max(0, (o - 1) * s + (k - 1) * d + 1 - n - p)
               for o, s, k, d, n, p in zip(out_hw, stride, kernel, dilation, (h, w), pad)]
        if any(pad) or any(end):
            x = x.nary("Pad", self.b.ints([0, 0, pad[0], pad[1], 0, 0, end[0], end[1]], "pads"), self.c(fill))
        out = []
        for i in range(kernel[0]):
            for j in range(kernel[1]):
                r0, c0 = i * dilation[0], j * dilation[1]
                ends = [r0 + stride[0] * (out_hw[0] - 1) + 1, c0 + stride[1] * (out_hw[1] - 1) + 1]
                out.append(x.nary("Slice", self.b.ints([r0, c0], "starts"), self.b.ints(ends, "ends"),
                                  self.b.ints([2, 3], "axes"), self.b.ints(list(stride), "steps")))
        return out

    def total(self, terms: list[Sym]) -> Sym:
        """The sum of ``terms`` (one ``Sum`` node)."""
        return terms[0] if len(terms) == 1 else terms[0].nary("Sum", *terms[1:])

    def prune(self, start: int, output: str) -> None:
        """Drop the nodes added since ``start`` that ``output`` does not depend on."""
        nodes = self.ctx.b.nodes
        needed, kept = {output}, []
        for node in reversed(nodes[start:]):
            if any(o in needed for o in node.output):
                needed.update(node.input)
                kept.append(node)
        nodes[start:] = kept[::-1]


SCHEME_STEPS["shared-factor"] = OnnxSharedStep
