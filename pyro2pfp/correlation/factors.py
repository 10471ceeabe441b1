"""The factor plan of shared-factor PFP: which layer creates which block of factor columns, how many
columns every edge carries, and where they are compacted -- plain data, fixed before any input
(:func:`plan_factors`); and the choice between shared factors and mean-field (:func:`choose`).

The representation the plan describes is in :mod:`pyro2pfp.correlation.shared`; the per-op rules are
registered with each op (:data:`~pyro2pfp.planning.registry.SHARED_REFERENCES`, ``SHARED_EXPORTERS``,
``SHARED_KERNELS``), and what the plan needs to know of an op is its
:class:`~pyro2pfp.planning.registry.FactorSpec`.
"""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from ..errors import ArgumentError, InternalError, PFPError
from ..options import Correlation, Hermite, Injection, checked, values
from ..planning.graph import INPUT, Repr
from ..planning.plan import FactorScheme, PlannedGraph, PlannedLayer, is_compute_layer
from ..planning.registry import OPS, SHARED_EXPORTERS, SHARED_REFERENCES

CORRELATIONS = values(Correlation)
HERMITE_MODES = values(Hermite)
INJECTIONS = values(Injection)
#: compact an edge's ``g`` when its factor count reaches this multiple of its rows (cost 2·C²·K)
COMPACT_RATIO = 4


class CorrelationError(ArgumentError):
    """Shared-factor PFP was asked for a network it has no rule for (the message names the layer)."""


@dataclass(frozen=True)
class FactorPlan:
    """What the planner stores for shared-factor PFP (static; nothing new per weight).

    ``offsets[layer]``: first factor column of the block a layer creates (size = its channels);
    ``width[edge]``: the number of factor columns ``K`` the edge's rule produces (0: no shared part;
    after a compaction the edge carries ``rows[edge]`` columns); ``rows[edge]``: rows of ``g``
    (channels; units of a dense edge); ``group[edge]``: elements per channel of a flat edge;
    ``compact_at``: layers after which ``g`` is compacted to ``rows`` columns (``None``-free: a
    plan without compaction has an empty set); ``hermite``/``injection``: the rule variants
    (the rules' docstrings); ``guide``: the number of a correlated guide's global factors, the first
    columns of every edge (no compaction then: it would mix them); ``own_blocks``: whether noisy compute
    layers create blocks of their own."""

    offsets: dict[str, int] = field(default_factory=dict)
    width: dict[str, int] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    group: dict[str, int] = field(default_factory=dict)
    compact_at: frozenset[str] = frozenset()
    hermite: str = "factor"
    injection: str = "regression"
    #: a correlated guide's global factors: columns ``0 … guide − 1`` of every edge (:mod:`.guide`)
    guide: int = 0
    #: whether every noisy compute layer creates its own block (False: their independent noise stays mean-field)
    own_blocks: bool = True
    #: the executor's key (``reference.SCHEME_EXECUTORS``), beside the compact factor plan's
    scheme: ClassVar[str] = "shared-factor"

    @property
    def max_factors(self) -> int:
        """The largest ``K`` of any edge."""
        return max(self.width.values(), default=0)

    def describe(self) -> str:
        """One line for the plan printout: how many factors the edges carry."""
        return (f"up to {self.max_factors} factors per edge, {len(self.offsets)} layers create factors, "
                f"{len(self.compact_at)} compaction points")


def shared_plan(graph: PlannedGraph, factors: FactorPlan | None = None) -> FactorPlan:
    """``factors`` (default ``graph.factors``) as the shared-factor plan: a :class:`FactorPlan`, else a
    :class:`~pyro2pfp.errors.PFPError` naming the plan ``graph`` carries."""
    fp = graph.factors if factors is None else factors
    if not isinstance(fp, FactorPlan):
        raise PFPError(f"this plan has no shared-factor plan (correlation={graph.correlation!r})")
    return fp


def is_noisy(layer: PlannedLayer) -> bool:
    """A compute layer (``OpDef.compute_layer``: dense, conv2d) with weight or bias variance (it creates a
    factor block)."""
    t = layer.tensors
    return is_compute_layer(layer.op) and any(k in t for k in ("weight_var", "weight_second_moment", "bias_var"))


def has_rule(op: str) -> bool:
    """Shared-factor PFP has a (float64) rule for ``op``."""
    return op in SHARED_REFERENCES


def is_terminal(op: str) -> bool:
    """``op`` may only be the network's output; its shared part is dropped (``FactorSpec.terminal``)."""
    return op in OPS and OPS[op].factor_spec.terminal


def plan_factors(graph: PlannedGraph, hermite: Hermite | str = Hermite.FACTOR, compact: bool = True,
                 injection: Injection | str = Injection.REGRESSION, guide: int = 0,
                 own_blocks: bool = True) -> FactorPlan:
    """Allocate the factor blocks and compaction points of ``graph`` (static: no input needed).
    ``guide``: the number of a correlated guide's global factors (columns ``0 … guide − 1``, loaded by
    every compute layer with ``weight_factors``; :mod:`.guide`); ``own_blocks``: whether noisy compute
    layers create factor blocks of their own.

    Raises :class:`CorrelationError` naming the first layer the scheme has no rule for."""
    hermite, injection = checked(Hermite, hermite), checked(Injection, injection)
    if graph.input_repr is not Repr.DETERMINISTIC:
        raise CorrelationError("correlation='shared-factor' needs a deterministic network input "
                               "(input_variance=True is mean-field only)")
    remaining: dict[str, int] = {}
    for layer in graph.layers:
        for n in layer.inputs:
            remaining[n] = remaining.get(n, 0) + 1
    offsets: dict[str, int] = {}
    width: dict[str, int] = {INPUT: 0}
    rows: dict[str, int] = {INPUT: 0}
    group: dict[str, int] = {INPUT: 1}
    compact_at: set[str] = set()
    live: set[str] = set()
    k = guide
    compact = compact and not guide
    for layer in graph.layers:
        name, op, ins = layer.name, layer.op, layer.inputs
        if not has_rule(op):
            supported = sorted(SHARED_REFERENCES)
            raise CorrelationError(f"{layer.layer.source}: op '{op}' has no shared-factor rule "
                                   f"(supported: {', '.join(supported)}); use correlation='mean-field'")
        spec = OPS[op].factor_spec
        refused = spec.refuse(layer) if spec.refuse is not None else None
        if refused:
            raise CorrelationError(f"{layer.layer.source}: {refused} have no shared-factor rule; "
                                   "use correlation='mean-field'")
        if spec.terminal and name != graph.output:
            raise CorrelationError(f"{layer.layer.source}: op '{op}' has a shared-factor rule only as the "
                                   "network's output")
        has_in = any(width[n] > 0 for n in ins) and not spec.terminal and not spec.covariance
        flat = [n for n in ins if spec.joins_rows and width[n] > 0 and rows[n] != graph.shape_of(n)[0]]
        if flat:
            raise CorrelationError(f"{layer.layer.source}: shared-factor PFP joins rows of unflattened edges only, "
                                   f"not the flattened {flat[0]} {graph.shape_of(flat[0])} (rows of "
                                   f"{group[flat[0]]} positions); concatenate before flattening")
        shape = layer.layer.out_shape
        if spec.reshapes and has_in:
            src = ins[0]
            if len(shape) > 1 and shape[0] != rows[src]:
                raise CorrelationError(f"{layer.layer.source}: shared-factor PFP supports reshapes that keep the "
                                       f"channel axis or flatten it, not {graph.shape_of(src)} -> {shape}")
            rows[name] = rows[src]
            group[name] = int(np.prod(shape)) // max(rows[src], 1) if len(shape) <= 1 else group[src]
        else:
            rows[name], group[name] = (shape[0] if shape else 1), 1
        if (is_noisy(layer) and own_blocks) or (spec.hermite_block and has_in and hermite == "factor"):
            offsets[name] = k
            k += shape[0]
        width[name] = k if (has_in or name in offsets or (guide and loads_guide(layer))) else 0
        for n in ins:
            remaining[n] -= 1
            if remaining[n] == 0:
                live.discard(n)
        if width[name] and remaining.get(name, 0) > 0:
            live.add(name)
            if compact and live == {name} and k >= COMPACT_RATIO * rows[name]:
                compact_at.add(name)
                k = rows[name]
    return FactorPlan(offsets, width, rows, group, frozenset(compact_at), hermite, injection, guide, own_blocks)


def loads_guide(layer: PlannedLayer) -> bool:
    """A compute layer whose weights or bias load on a correlated guide's global factors."""
    return "weight_factors" in layer.tensors or "bias_factors" in layer.tensors


def ops_carrying_guide() -> frozenset[str]:
    """The compute ops whose float32 rules (ONNX, TVM) carry a correlated guide's global factors
    (``FactorSpec.guide_factors``)."""
    return frozenset(name for name, op in OPS.items() if op.factor_spec.guide_factors)

#: the float32 back ends' factor counts are multiples of this (16 fp32 = one AVX-512 register)
FACTOR_ALIGN = 16


def in_backends(op: str, ops: Collection[str] | None = None) -> bool:
    """The float32 back ends implement ``op``'s shared-factor rule: ``op`` is in ``ops`` (a back end's
    table of rules), by default in :data:`~pyro2pfp.planning.registry.SHARED_EXPORTERS` -- the compiled back
    end's table (``SHARED_KERNELS``, filled when TVM is imported) covers the same ops
    (``tests/ops/test_op_completeness.py``), so the choice of ``auto`` does not depend on whether TVM is
    loaded."""
    return op in (SHARED_EXPORTERS if ops is None else ops)


def fixed_k_plan(graph: PlannedGraph, what: str, ops: Collection[str] | None = None,
                 compaction: bool = False, guide_ops: Collection[str] | None = None) -> FactorPlan:
    """The factor plan the float32 back ends (``what``: "the TVM back end", "ONNX export") run for a
    shared-factor ``graph``: ``graph.factors``' variants with a static ``K`` per edge.
    ``compaction``: keep the reference's compaction points (``compact_at``; the back end then
    replaces ``g`` by a ``C × C`` factor of ``g·gᵀ`` there, e.g. its Cholesky factor -- exact, only
    ``g·gᵀ`` is used downstream), else none (``K`` grows with depth).  Both injections are kept
    (``'regression'``, ``'rescaled'``).  :class:`ArgumentError` for what they do not implement: the
    raw-moment plan, ops outside ``ops`` (the back end's table of rules, :func:`in_backends`; naming
    the layer).
    Every ``K`` is rounded up to a multiple of
    :data:`FACTOR_ALIGN` (zero columns) so the kernels' factor axis is whole SIMD vectors; a
    compacted edge carries ``aligned(rows)`` columns (:func:`aligned`).  A correlated guide's global factors
    are carried where the layers loading them are of ``guide_ops`` (the back end's rules that add the guide's
    terms; None: :func:`ops_carrying_guide`), else refused naming the layer."""
    fp = shared_plan(graph)
    guide_ops = ops_carrying_guide() if guide_ops is None else guide_ops
    if fp.guide:
        for layer in graph.layers:
            if loads_guide(layer) and layer.op not in guide_ops:
                raise ArgumentError(f"{layer.layer.source}: {what} does not carry a correlated guide's global "
                                    f"factors ({_guide_text(graph)}) through op '{layer.op}'; net.reference "
                                    "runs them, or convert with correlation='mean-field' (marginal variances only)")
    if graph.moment_form != "variance":
        raise ArgumentError(f"{what} of correlation='shared-factor' needs moment_form='variance', not "
                            f"{graph.moment_form!r}")
    for layer in graph.layers:
        if not in_backends(layer.op, ops):
            implemented = ", ".join(sorted(SHARED_EXPORTERS if ops is None else ops))
            raise ArgumentError(f"{layer.layer.source}: {what} has no shared-factor rule for op '{layer.op}' "
                                f"(implemented: {implemented}); net.reference runs it, or "
                                "convert with correlation='mean-field'")
    return with_aligned_widths(plan_factors(graph, fp.hermite, compact=compaction, injection=fp.injection,
                                            guide=fp.guide, own_blocks=fp.own_blocks))


def with_aligned_widths(fp: FactorPlan) -> FactorPlan:
    """``fp`` with every edge's ``K`` rounded up to whole SIMD vectors of factor columns (:func:`aligned`;
    zero columns change nothing: only ``g·gᵀ`` is used) -- the widths the float32 back ends carry."""
    return dataclasses.replace(fp, width={name: aligned(k) for name, k in fp.width.items()})


def aligned(k: int) -> int:
    """``k`` rounded up to a multiple of :data:`FACTOR_ALIGN`."""
    return -(-k // FACTOR_ALIGN) * FACTOR_ALIGN


@dataclass(frozen=True)
class ComputeFactors:
    """What a conv2d/dense rule needs of its layer: its factor block ``offset`` (None: no weight
    noise), the width ``k`` of its output's ``g``, the weight mean and variance."""

    offset: int | None
    k: int
    weight_mean: np.ndarray
    weight_var: np.ndarray

    @classmethod
    def of(cls, layer: PlannedLayer, fp: FactorPlan) -> ComputeFactors:
        t = layer.tensors
        return cls(fp.offsets.get(layer.name), fp.width[layer.name], t["weight_mean"], weight_var(t))


def weight_var(t: dict[str, np.ndarray]) -> np.ndarray:
    """The weight variance of a compute layer's stored tensors (either plan form)."""
    if "weight_var" in t:
        return t["weight_var"]
    if "weight_second_moment" in t:
        return np.maximum(t["weight_second_moment"] - t["weight_mean"] ** 2, 0.0)
    return np.zeros_like(t["weight_mean"])


def _noisy_ancestry(graph: PlannedGraph) -> dict[str, bool]:
    """``{edge: it depends on the noise of a layer whose weights are shared by positions (a conv,
    ``OpDef.positions_share_weights``)}``."""
    conv_noise = {INPUT: False}
    for layer in graph.layers:
        shares = layer.op in OPS and OPS[layer.op].positions_share_weights
        conv_noise[layer.name] = (shares and is_noisy(layer)) or any(conv_noise[n] for n in layer.inputs)
    return conv_noise


def needs_shared_factors(graph: PlannedGraph) -> str | None:
    """Why mean-field would be wrong for ``graph`` (None: it is fine): an average pooling of a
    conv output's noise (shared by every position of the channel, divided by the window size as
    if independent), a residual add of two noisy branches (which share their input), or a dense layer
    with deterministic weights that mixes random units for a later layer (:func:`_deterministic_mixer`).

    Flatten → dense after a conv (LeNet-5) is not on the list: the dense weights differ per position,
    so the shared noise adds only partly coherently -- negligibly for narrow posteriors, by about a
    fifth of the logit variance for a trained LeNet-5 -- while the scheme costs several times the
    mean-field multiply-adds there; ``convert`` warns instead
    (:func:`~pyro2pfp.correlation.cost.dense_head_caveat`)."""
    noisy = _noisy_ancestry(graph)
    mixer = _deterministic_mixer(graph, noisy)
    if mixer is not None:
        return mixer
    for layer in graph.layers:
        wrong = OPS[layer.op].factor_spec.mean_field_wrong if layer.op in OPS else None
        reason = wrong(layer, graph, noisy) if wrong is not None else None
        if reason is not None:
            return reason
    return None


def _deterministic_mixer(graph: PlannedGraph, conv_noise: dict[str, bool]) -> str | None:
    """Why mean-field is wrong for a partially Bayesian network: a dense layer with deterministic weights
    reads random units, so its outputs are linear maps of the same random inputs -- correlated, with
    covariance ``W Σ_in Wᵀ`` -- and a later compute layer sums them as if independent (with
    ``Σ_in = diag(v)``, ``Var(Σ_j a_j y_j) = Σ_i v_i (Σ_j a_j W_ji)²``, whereas mean-field gives
    ``Σ_j a_j² Σ_i W_ji² v_i``; the shared-factor plan carries the input's noise as factors and keeps the
    cross terms).  A Bayesian dense layer's own weight noise is independent per output and usually
    dominates; a deterministic one has only the shared part.  None when no such layer feeds another, and for a
    dense layer downstream of a conv's noise (``conv_noise``): there ``auto`` weighs the compact factor plan,
    which carries a dense layer's input noise for the dense layer after it at a fraction of the cost."""
    reaches_compute: dict[str, bool] = {}
    for layer in reversed(graph.layers):
        reaches_compute[layer.name] = any(
            is_compute_layer(c.op) or reaches_compute.get(c.name, False)
            for c in graph.layers if layer.name in c.inputs)
    for layer in graph.layers:
        if (layer.op in OPS and OPS[layer.op].sums_elements and "weight_mean" in layer.tensors
                and weight_var(layer.tensors).max(initial=0.0) == 0
                and graph.repr_of(layer.inputs[0]) is not Repr.DETERMINISTIC and reaches_compute[layer.name]
                and not conv_noise[layer.inputs[0]]):
            return (f"{layer.layer.source}: {layer.op} layer '{layer.name}' has deterministic weights and reads random "
                    "units, so its outputs share their inputs' noise, which a later layer sums")
    return None


def guide_count(graph: PlannedGraph) -> int:
    """The number of a correlated guide's global factors the plan's compute layers load on (0: none)."""
    return max((layer.tensors[name].shape[-1] for layer in graph.layers for name in ("weight_factors", "bias_factors")
                if name in layer.tensors), default=0)


def choose(graph: PlannedGraph, correlation: Correlation | str, hermite: Hermite | str = Hermite.FACTOR,
           injection: Injection | str = Injection.REGRESSION) -> FactorPlan | None:
    """The factor plan for ``correlation`` (None: mean-field); ``hermite`` and ``injection`` are the
    variants :func:`plan_factors` uses when the scheme is chosen.

    ``"shared-factor"``: the scheme (with a correlated guide's global factors, :mod:`.guide`; for a network
    :func:`needs_shared_factors` finds no reason in, the guide's factors alone: measured better and far
    cheaper on MLPs than adding every layer's own blocks, ``benchmarks/correlated_guides.py``), or
    :class:`CorrelationError` naming the layer it has no rule for; ``"mean-field"``: None (a correlated
    guide's correlations dropped, with a warning); ``"auto"``: the scheme when :func:`needs_shared_factors`
    finds a reason, else, for a correlated guide, its global factors alone (the weights' independent
    noise stays mean-field; every back end carries them through the ops of :func:`ops_carrying_guide`), else
    mean-field -- and mean-field with a warning when the scheme has no rule for a layer, or one that only
    the NumPy reference implements (the plan must compile and export)."""
    correlation = checked(Correlation, correlation)
    guide = guide_count(graph)
    if correlation in ("mean-field", "compact-factor"):  # compact: planned after the pool rewrite (with_compact)
        if guide:
            warnings.warn(f"correlation={str(correlation)!r}: the guide's correlations between weights are dropped "
                          f"({_guide_text(graph)}); only the marginal variances are used", stacklevel=4)
        return None
    reason = needs_shared_factors(graph)
    if correlation == "shared-factor":
        if guide and reason is None:  # the guide's factors; the weights' independent noise stays mean-field
            return plan_factors(graph, Hermite.NONE, injection=injection, guide=guide, own_blocks=False)
        return plan_factors(graph, hermite, injection=injection, guide=guide)
    if reason is None and not guide:
        return None
    try:
        if reason is None:  # a correlated guide: its factors, the weights' independent noise mean-field
            fp = plan_factors(graph, Hermite.NONE, injection=injection, guide=guide, own_blocks=False)
        else:
            fp = plan_factors(graph, hermite, injection=injection, guide=guide)
        reference_only = next((layer for layer in graph.layers if not in_backends(layer.op)), None)
        if reference_only is not None:
            raise CorrelationError(f"{reference_only.layer.source}: op '{reference_only.op}' has a shared-factor rule "
                                   "in the NumPy reference only, not in the compiled or ONNX back ends")
        carried = ops_carrying_guide()
        no_guide = next((layer for layer in graph.layers if loads_guide(layer) and layer.op not in carried), None)
        if no_guide is not None:
            raise CorrelationError(f"{no_guide.layer.source}: the compiled and ONNX back ends do not carry a "
                                   f"correlated guide's factors through op '{no_guide.op}'")
        return fp
    except CorrelationError as exc:
        if reason is None:
            warnings.warn(f"correlation='auto': the guide's correlations between weights ({_guide_text(graph)}) "
                          f"cannot be carried, so they are dropped and only the marginal variances are used: {exc}",
                          stacklevel=4)
        else:
            warnings.warn(f"correlation='auto': {reason}, so mean-field PFP will under-state the output variance, "
                          f"but shared-factor PFP is not available: {exc}", stacklevel=4)
        return None


def _guide_text(graph: PlannedGraph) -> str:
    info = graph.guide_factors
    return "a correlated guide" if info is None else info.describe()


def with_correlation(graph: PlannedGraph, correlation: Correlation | str, hermite: Hermite | str = Hermite.FACTOR,
                     injection: Injection | str = Injection.REGRESSION) -> PlannedGraph:
    """``graph`` (a plan of :func:`pyro2pfp.planning.plan.plan`) with the factor plan :func:`choose` gives for
    ``correlation`` (and the variants) stored in ``graph.factors`` (None: mean-field); returns ``graph``."""
    graph.factors = choose(graph, correlation, hermite, injection)
    return graph


def replanned(graph: PlannedGraph, factors: FactorScheme | None) -> PlannedGraph:
    """``graph`` (a plan rewritten after :func:`with_correlation` chose ``factors`` for the graph before the
    rewrite, e.g. with correlated max pools) with the same scheme and variants planned anew on it (None:
    mean-field); returns ``graph``."""
    if factors is not None and not isinstance(factors, FactorPlan):  # with_correlation plans shared factors only
        raise InternalError(f"a rewritten plan cannot re-plan the {factors.scheme!r} factor plan")
    graph.factors = None if factors is None else plan_factors(graph, factors.hermite, injection=factors.injection,
                                                              guide=factors.guide, own_blocks=factors.own_blocks)
    return graph
