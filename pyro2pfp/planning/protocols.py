"""The contracts between the stages, as :class:`typing.Protocol`\\ s (checked by mypy, structurally).

The planner's output is read by back ends and analyses that live above it, and some of the objects they
read are built above them too (the converted network, the factor plans of :mod:`pyro2pfp.correlation`):
the back ends and analyses name these Protocols instead of the classes, so no module needs to import
(even for its annotations) one above its own wing.

* :class:`FactorScheme` (defined with ``PlannedGraph`` in :mod:`.plan`) -- ``PlannedGraph.factors``: a
  factor plan (``correlation.FactorPlan``, ``correlation.compact.CompactPlan``) with the ``scheme`` its
  executors are registered under;
* :class:`ConvertedNetwork` -- what ``pyro2pfp.convert`` returns (``PFPNetwork``), as the back ends and
  analyses read it;
* :class:`FormulaBackend` -- the back end ``bk`` an op's shared formula is written against
  (``ops._formula.formula``: ``backends.reference.NumpyBackend`` and ``backends.onnx.builder.OnnxContext``);
* :class:`SchemeStep` -- a correlation scheme's step in a back end that emits a program (the ONNX
  exporter's and the TVM emitter's ``SCHEME_STEPS``; the float64 reference runs a whole scheme at once,
  ``backends.reference.SCHEME_EXECUTORS``).

The tensors the back ends compute with differ (float64 arrays, ONNX symbols, Relax expressions), so the
Protocols type them ``Any``; what they fix is which members a back end offers and what they take.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import numpy as np

from .graph import LayerGraph
from .plan import FactorScheme, PlannedGraph, PlannedLayer

__all__ = ["ConvertedNetwork", "FactorScheme", "FormulaBackend", "SchemeStep"]


class FormulaBackend(Protocol):
    """The back end ``bk`` of an op's shared formula ``fn(bk, layer, inputs)`` (``ops._formula.formula``): the
    members the NumPy reference (float64 arrays) and the ONNX exporter (symbols) both offer."""

    #: the :mod:`pyro2pfp.moments` namespace of this back end (``where``, ``exp``, ``sqrt``, ``const``, ...)
    ops: Any

    def variance(self, x: Any) -> Any:
        """The variance of input activation ``x`` (None for a deterministic one)."""
        ...

    def second_moment(self, x: Any) -> Any:
        """The second raw moment ``E[x²]`` of input activation ``x``."""
        ...

    def emit(self, mean: Any, var: Any, layer: PlannedLayer) -> Any:
        """The output activation of ``layer`` in the representation the plan gives it."""
        ...

    def deterministic(self, mean: Any) -> Any:
        """An exact output (no variance)."""
        ...

    def tensor(self, array: np.ndarray, hint: str) -> Any:
        """The constant ``array``."""
        ...

    def dense(self, x: Any, weight: np.ndarray, hint: str) -> Any:
        """``x @ weight.T``."""
        ...

    def conv2d(self, x: Any, weight: np.ndarray, attrs: dict, hint: str) -> Any:
        """The 2-D convolution of ``x`` with ``weight`` (``attrs``: stride, padding, dilation, groups)."""
        ...

    def reshape(self, t: Any, shape: tuple[int, ...]) -> Any:
        """``t`` reshaped to ``(batch, *shape)``."""
        ...

    def concat(self, ts: list[Any], axis: int) -> Any:
        """``ts`` joined along per-sample axis ``axis``."""
        ...

    def zeros_like(self, t: Any) -> Any:
        """Exact zeros of ``t``'s shape."""
        ...


class ConvertedNetwork(Protocol):
    """A converted network (``pyro2pfp.PFPNetwork``) as the back ends and analyses read it."""

    #: the planned graph every back end runs
    plan: PlannedGraph
    #: the layer graph the plan was made from (re-planned by calibration and the fidelity figures)
    layer_graph: LayerGraph
    #: ``convert(..., check=x)``'s ``FidelityCheck`` (None without a check)
    fidelity: Any

    @property
    def input_shape(self) -> tuple[int, ...]: ...

    @property
    def input_variance(self) -> bool: ...

    @property
    def head(self) -> str | None:
        """``"probs"`` if the plan ends in the uncertainty head, else None (outputs: the logits)."""
        ...

    @property
    def mod(self) -> Any:
        """The Relax IRModule (built on first access)."""
        ...

    def module(self, on_kernel: Callable[[str, Any], None] | None = None) -> Any:
        """:attr:`mod`, built now if it is not, announcing each kernel to ``on_kernel(name, prim_func)``."""
        ...

    def reference(self, x: Any, x_var: Any = None) -> Any:
        """The float64 NumPy execution of :attr:`plan`."""
        ...


Ctx = TypeVar("Ctx", contravariant=True)
Act = TypeVar("Act")


class SchemeStep(Protocol[Ctx, Act]):
    """A correlation scheme's step in a back end that emits a program layer by layer (``factory(graph, ...)``
    in the back end's ``SCHEME_STEPS`` makes one per network): after each layer's mean-field output it emits
    the scheme's part and returns the layer's (possibly corrected) output."""

    def emits_mean_field(self, layer: PlannedLayer) -> bool:
        """Whether the step's output for ``layer`` includes its mean-field moments (then the back end emits
        no mean-field kernel or node for it and passes ``out=None``)."""
        ...

    def __call__(self, ctx: Ctx, layer: PlannedLayer, inputs: list[Act], out: Act | None) -> Act:
        ...

