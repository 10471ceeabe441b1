"""The loadings of the compact factor plan (:mod:`.compact`) and the layer step its back ends share.

:class:`Loadings` is the representation of one edge: ``L[b, e, f] = Cov(a[b, e], ζ_f)`` on independent
standard normal factors ``ζ_f``, by the layer (or other source) that created the factors --

* ``glob[key]`` (B, E, k): global columns, a factor may load every element of the edge;
* ``block[key]`` (B, C, P, r): block columns, factor ``(c, j)`` loads only channel ``c``'s ``P`` positions
  (``E = C·P``; stored as such, no zeros) --

with the static widths beside them (``glob_width[key] = k``, ``block_shape[key] = (C, P, r)``), which the
rules need to reshape symbolic tensors.  The entries are the back end's tensors: float64 arrays in the NumPy
reference, ONNX symbols in the export (the rules in ``ops/<family>.py`` are written once for both, as
formulas over a back end ``bk``: :func:`pyro2pfp.ops._formula.compact_formula`), Relax tensors in the TVM
back end.  Keyed by creator so that branches carrying the same factors add their loadings (a residual
add) instead of stacking them; factors shared by several layers (a low-rank guide's) fit as one global key.

The tensor algebra of ``bk`` (:class:`TensorAlgebra`: ``backends.reference.NumpyBackend``,
``backends.onnx.builder.OnnxContext``, ``backends.tvm.compact_factor.TeBackend``): ``einsum``,
``rows(t, shape)`` (reshape to ``(-1, *shape)``), ``reshape(t, shape)`` (``(batch, *shape)``), ``permute``,
``rsum(t, axis)``, ``slice``, ``taps`` (strided window views), ``concat``, ``tensor`` (a constant),
``dense``, ``conv2d``, ``zeros_like``, ``variance``, ``ops`` (:mod:`pyro2pfp.moments`' namespace) and ``lowest``.
The plan the rules read is a :class:`CompactPlan` (made by :func:`.compact.plan_compact`).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np

from ..backends.reference import NUMPY_BACKEND
from ..errors import PFPError
from ..planning.plan import PlannedLayer
from ..planning.registry import OPS
from .stein import stein_slope


class TensorAlgebra(Protocol):
    """The back end ``bk`` of the compact factor rules (module docstring).  Tensors are the back end's own
    (float64 arrays, ONNX symbols, Relax expressions) and support ``+ - * /`` and comparisons; every shape is
    per sample, the batch axis first."""

    #: the :mod:`pyro2pfp.moments` namespace of this back end (``where``, ``sqrt``, ``maximum``, ``const``, ...)
    ops: Any
    #: the identity of a max fold's mean (padded window taps)
    lowest: float

    def variance(self, x: Any) -> Any:
        """The variance of input activation ``x`` (None for a deterministic one)."""
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

    def rows(self, t: Any, shape: tuple[int, ...]) -> Any:
        """``t`` reshaped to ``(-1, *shape)``."""
        ...

    def concat(self, ts: list[Any], axis: int) -> Any:
        """``ts`` joined along per-sample axis ``axis``."""
        ...

    def einsum(self, equation: str, *ts: Any) -> Any: ...

    def permute(self, t: Any, perm: tuple[int, ...]) -> Any: ...

    def rsum(self, t: Any, axis: int) -> Any:
        """The sum over ``axis`` (the batch axis is 0)."""
        ...

    def slice(self, t: Any, axis: int, start: int, stop: int) -> Any: ...

    def taps(self, t: Any, kernel: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int],
             begin: tuple[int, int], end: tuple[int, int], out_hw: tuple[int, int], fill: float) -> list[Any]:
        """The strided view of ``t`` (B, C, H, W) at every kernel offset, padded by ``begin``/``end`` of ``fill``."""
        ...

    def unfold(self, t: Any, channels: int, kernel: tuple[int, int], stride: tuple[int, int],
               dilation: tuple[int, int], begin: tuple[int, int], end: tuple[int, int], out_hw: tuple[int, int],
               fill: float) -> Any:
        """``(B, C·KH·KW, OH·OW)``: the views of :meth:`taps` as rows, channel-major (row ``c·KH·KW + tap``)."""
        ...

    def zeros_like(self, t: Any) -> Any:
        """Exact zeros of ``t``'s shape."""
        ...


@dataclass(frozen=True)
class CompactPlan:
    """The compact factor plan (static: fixed before any input; :func:`plan_compact`).

    ``directions[conv]``: the factors per output channel a conv creates for its weight and bias noise
    (block columns); ``residual[dense]``: the dense layers
    whose input residual becomes one global factor per input element; ``terminal``: layers whose
    output's loadings nothing reads (variance corrected, loadings dropped)."""

    directions: dict[str, int] = field(default_factory=dict)
    residual: frozenset[str] = frozenset()
    terminal: frozenset[str] = frozenset()
    #: why the plan left something out (the cost model's verdict), for the printout
    note: str = ""
    #: the per-sample shape of every edge (the rules reshape the back ends' tensors by it)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    scheme: ClassVar[str] = "compact-factor"

    @property
    def max_factors(self) -> int:
        """Not static for block factors (per channel); the number of layers that create factors."""
        return len(self.directions) + len(self.residual)

    def describe(self) -> str:
        """One line for the plan printout: which factors the plan carries and why."""
        parts = []
        if self.directions:
            parts.append("block factors of " + ", ".join(f"{n} ({r} per channel)" for n, r in self.directions.items())
                         + ": the last convs' weight noise, shared by the positions the dense head sums")
        if self.residual:
            parts.append("one factor per input element of " + ", ".join(sorted(self.residual))
                         + ": an input's noise is shared by every unit of the dense layer that reads it")
        return "; ".join(parts + ([self.note] if self.note else [])) or \
            "no factors (nothing in this net sums correlated elements)"


@dataclass
class Loadings:
    """``L[b, e, f] = Cov(a[b, e], ζ_f)`` of one edge, by creator (module docstring): ``glob[key]`` (B, E, k),
    ``block[key]`` (B, C, P, r); ``glob_width[key] = k`` and ``block_shape[key] = (C, P, r)`` (filled from the
    arrays' shapes when not given)."""

    glob: dict[str, Any] = field(default_factory=dict)
    block: dict[str, Any] = field(default_factory=dict)
    glob_width: dict[str, int] = field(default_factory=dict)
    block_shape: dict[str, tuple[int, int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key, g in self.glob.items():
            if key not in self.glob_width:
                self.glob_width[key] = int(g.shape[-1])
        for key, b in self.block.items():
            if key not in self.block_shape:
                self.block_shape[key] = tuple(int(n) for n in b.shape[1:])  # type: ignore[assignment]

    def empty(self) -> bool:
        return not self.glob and not self.block

    def columns(self) -> int:
        """The number of factors the edge carries (global and block)."""
        return sum(self.glob_width.values()) + sum(c * r for c, _, r in self.block_shape.values())

    # -- any back end
    def explained(self, bk: TensorAlgebra, elements: int) -> Any:
        """``Σ_f L[e, f]²`` (B, E): the variance the factors explain (None without loadings)."""
        total = None
        for g in self.glob.values():
            part = bk.rsum(g * g, 2)
            total = part if total is None else total + part
        for b in self.block.values():
            part = bk.reshape(bk.rsum(b * b, 3), (elements,))
            total = part if total is None else total + part
        return total

    def times(self, bk: TensorAlgebra, factor: Any, elements: int) -> Loadings:
        """Every loading of element ``e`` times ``factor[b, e]`` (a (B, E) tensor) or ``factor[e]`` (an (E,)
        array: a constant)."""
        def col(shape: tuple[int, ...]) -> Any:
            if isinstance(factor, np.ndarray) and factor.ndim == 1:
                return bk.tensor(factor.reshape(shape), "scale")
            return bk.reshape(factor, shape)

        glob = {k: g * col((elements, 1)) for k, g in self.glob.items()}
        block = {k: b * col((self.block_shape[k][0], self.block_shape[k][1], 1)) for k, b in self.block.items()}
        return Loadings(glob, block, dict(self.glob_width), dict(self.block_shape))

    def merged(self, other: Loadings) -> Loadings:
        """The loadings of the sum of two edges of the same shape (same creator: added)."""
        out = Loadings(dict(self.glob), dict(self.block), dict(self.glob_width), dict(self.block_shape))
        for k, g in other.glob.items():
            out.glob[k] = out.glob[k] + g if k in out.glob else g
            out.glob_width[k] = other.glob_width[k]
        for k, b in other.block.items():
            out.block[k] = out.block[k] + b if k in out.block else b
            out.block_shape[k] = other.block_shape[k]
        return out

    def blocks_as_global(self, bk: TensorAlgebra) -> dict[str, tuple[Any, int]]:
        """Every block entry (B, C, P, r) as global columns (B, C·P, C·r): channel ``c``'s loadings in
        columns ``c·r … c·r + r − 1``, zeros elsewhere (where an op mixes channels)."""
        out = {}
        for key, b in self.block.items():
            c, p, r = self.block_shape[key]
            dense = bk.einsum("bcpr,cd->bcpdr", b, bk.tensor(np.eye(c), "eye"))
            out[key] = (bk.rows(dense, (c * p, c * r)), c * r)
        return out

    def as_channels(self, bk: TensorAlgebra, shape: tuple[int, ...]) -> tuple[Any, list[tuple[str, str, int]]]:
        """All loadings of an edge of per-sample ``shape`` (C, H, W) as one (B, C, F, H, W) tensor (global and
        block columns side by side: an op that never leaves a channel, a pooling window) and the layout
        :meth:`from_channels` splits it back by."""
        c, h, w = shape
        parts, layout = [], []
        for key, g in self.glob.items():
            k = self.glob_width[key]
            parts.append(bk.permute(bk.reshape(g, (c, h, w, k)), (0, 1, 4, 2, 3)))
            layout.append(("glob", key, k))
        for key, b in self.block.items():
            r = self.block_shape[key][2]
            parts.append(bk.permute(bk.reshape(b, (c, h, w, r)), (0, 1, 4, 2, 3)))
            layout.append(("block", key, r))
        return (parts[0] if len(parts) == 1 else bk.concat(parts, 1)), layout

    @staticmethod
    def from_channels(bk: TensorAlgebra, cols: Any, layout: list[tuple[str, str, int]],
                      shape: tuple[int, ...]) -> Loadings:
        """The :class:`Loadings` of a (B, C, F, H, W) tensor of :meth:`as_channels` (``shape``: (C, H, W))."""
        c, h, w = shape
        out, start = Loadings(), 0
        for kind, key, k in layout:
            part = cols if len(layout) == 1 else bk.slice(cols, 2, start, start + k)
            part = bk.permute(part, (0, 1, 3, 4, 2))                                  # (B, C, H, W, k)
            if kind == "glob":
                out.glob[key], out.glob_width[key] = bk.reshape(part, (c * h * w, k)), k
            else:
                out.block[key], out.block_shape[key] = bk.reshape(part, (c, h * w, k)), (c, h * w, k)
            start += k
        return out

    # -- NumPy conveniences (float64 arrays)
    def squared(self, batch: int, elements: int) -> np.ndarray:
        """``Σ_f L[e, f]²`` (B, E) of NumPy loadings (zeros without any)."""
        total = self.explained(NUMPY_BACKEND, elements)
        return np.zeros((batch, elements)) if total is None else total

    def scaled(self, factor: np.ndarray) -> Loadings:
        """NumPy loadings times ``factor[b, e]`` (B, E)."""
        return self.times(NUMPY_BACKEND, factor, factor.shape[-1])


def elements_of(layer: PlannedLayer) -> int:
    return int(np.prod(layer.layer.out_shape))


def full(bk: TensorAlgebra, value: Any, like: Any) -> Any:
    """``value`` as a tensor of ``like``'s shape (a scalar constant broadcast; a tensor as it is)."""
    if isinstance(value, (int, float, np.number)) or (isinstance(value, np.ndarray) and value.ndim == 0):
        return bk.ops.const(float(value)) + bk.zeros_like(like)
    if getattr(value, "value", None) is not None:  # a folded ONNX scalar constant
        return value + bk.zeros_like(like)
    return value


def stein(bk: TensorAlgebra, layer: PlannedLayer, x: Any, ld: Loadings) -> Loadings:
    """The generic activation rule: ``L ↦ E[f'(a)]·L`` (Stein's lemma, exact for a Gaussian ``a`` jointly
    Gaussian with the factors; the slope is the derivative of the rule's own mean, :mod:`.stein`)."""
    rule = OPS[layer.op].activation
    assert rule is not None
    slope = full(bk, stein_slope(rule, x.mean, bk.variance(x), layer.layer.attrs, bk.ops), x.mean)
    e = elements_of(layer)
    return ld.times(bk, bk.reshape(slope, (e,)), e)


class CompactRule(Protocol):
    """An op's rule of the compact factor plan (``registry.COMPACT_REFERENCES``, ``COMPACT_EXPORTERS``; written
    once over the back end ``bk``, ``ops._formula.compact_formula``): given the layer's inputs, their loadings
    (None: none) and the layer's mean-field ``(mean, var)``, the output's loadings and corrected moments."""

    def __call__(self, bk: TensorAlgebra, layer: PlannedLayer, inputs: list[Any], loads: list[Loadings | None],
                 plan: CompactPlan, mean: Any, var: Any) -> tuple[Loadings | None, Any, Any]: ...



def compact_layer(bk: TensorAlgebra, rules: Mapping[str, CompactRule], layer: PlannedLayer, inputs: list[Any],
                  loads: list[Loadings | None], plan: CompactPlan, mean: Any,
                  var: Any) -> tuple[Loadings | None, Any, Any]:
    """One layer of the compact factor plan in back end ``bk`` (after its mean-field ``(mean, var)``): where an
    input carries loadings or the layer creates factors, its rule (``rules[op]``, else the generic Stein rule of
    an activation) gives the output's loadings and corrected moments; the loadings are then shrunk to explain at
    most each element's variance (Cauchy-Schwarz: ``L ↦ L·√min(1, v/‖L‖²)``) and dropped where nothing reads
    them (``plan.terminal``).  Returns ``(loadings, mean, var)``."""
    creates = layer.name in plan.directions or layer.name in plan.residual
    if all(ld is None for ld in loads) and not creates:
        return None, mean, var
    ld: Loadings | None = None
    rule = rules.get(layer.op)
    if rule is not None:
        ld, mean, var = rule(bk, layer, inputs, loads, plan, mean, var)
    elif layer.op in OPS and OPS[layer.op].activation is not None:
        first = loads[0]
        assert first is not None
        ld = stein(bk, layer, inputs[0], first)
    elif layer.name not in plan.terminal:
        raise PFPError(f"{layer.layer.source}: op '{layer.op}' has no compact factor rule")
    if ld is None or layer.name in plan.terminal or ld.empty():
        return None, mean, var
    e = elements_of(layer)
    ops = bk.ops
    sd2 = bk.reshape(ops.maximum(var, ops.const(0.0)), (e,))
    explained = ld.explained(bk, e)
    room = ops.where(explained > sd2, sd2 / ops.where(explained > ops.const(0.0), explained, ops.const(1.0)),
                     ops.const(1.0))
    return ld.times(bk, ops.sqrt(room), e), mean, var
