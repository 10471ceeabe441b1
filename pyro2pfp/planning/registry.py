"""The op registry: one :class:`OpDef` per PFP op, and the per-stage tables filled against its name.

An op is defined once, NumPy-only, in its family file ``pyro2pfp/ops/<family>.py``: the
:class:`OpDef` (torch ops it converts from, torch modules it covers, its representation contract,
its moment rule and assumptions for the README's layer table, flags), its converter, its float64
reference and its ONNX export.  Its TVM kernel and default CPU schedule live in
``pyro2pfp/backends/tvm/ops/<family>.py``.  Each stage keeps a table keyed by the op name, filled by
the decorators made with :func:`add_to` (a second registration of a key is an error):

=================  ====================================================  =================================
table              decorator                                             module
=================  ====================================================  =================================
converters         ``converters.register("aten.x.default", produces=)``  :mod:`pyro2pfp.planning.converters`
references         ``reference.reference(op)``                           :mod:`pyro2pfp.backends.reference`
ONNX exporters     ``backends.onnx.builder.exporter(op)``                          :mod:`pyro2pfp.backends.onnx.builder`
TVM kernels        ``backends.tvm.kernel(op)``                            :mod:`pyro2pfp.backends.tvm`
CPU schedules      ``backends.tvm.schedule(op)``                          :mod:`pyro2pfp.backends.tvm.schedules`
=================  ====================================================  =================================

The rules of shared-factor PFP (:mod:`pyro2pfp.correlation`) have three tables of their own, here
(:data:`SHARED_REFERENCES`, :data:`SHARED_EXPORTERS`, :data:`SHARED_KERNELS`), filled by
``@shared_reference(op)`` / ``@shared_exporter(op)`` in ``ops/<family>.py`` and ``@shared_kernel(op)``
in ``backends/tvm/ops/<family>.py``, beside the op's mean-field parts.

Elementwise activations need less: an :class:`ActivationRule` (the exact activation and its
Gaussian moments, written against an ``ops`` namespace, see :mod:`pyro2pfp.moments`) in the OpDef
gives the reference, the ONNX export and (through ``backends/tvm/ops/activation.py``) the TE kernel
and its schedule.  ``tests/ops/test_op_completeness.py`` names anything an op still lacks.  Modelled on
onnx2torch's ``node_converters/registry.py`` (decorator registration, duplicates rejected).

Importing this module imports neither TVM nor ONNX nor the op families (``pyro2pfp.ops`` loads
those; ``import pyro2pfp`` does so first).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import PFPError
from .graph import Repr

F = TypeVar("F", bound=Callable[..., Any])


def add_to(table: dict[str, Any], what: str) -> Callable[..., Callable[[F], F]]:
    """A decorator factory: ``@deco(key, ...)`` puts the function into ``table`` under each key."""

    def register(*keys: str) -> Callable[[F], F]:
        def deco(fn: F) -> F:
            for key in keys:
                if key in table:
                    raise ValueError(f"{what} {key!r} is registered twice ({table[key].__name__} and {fn.__name__})")
                table[key] = fn
            return fn

        return deco

    return register


class OpRegistryError(PFPError):
    """An op was registered twice, or looked up but never registered."""


COMPUTE_INPUT = "compute input"
"""In a :class:`Contract`: the representation compute layers take under the plan's moment form
(the second raw moment in the paper's ``"raw"`` plan, the variance in the default plan)."""


@dataclass(frozen=True)
class Contract:
    """The representation contract of an op (read by :mod:`pyro2pfp.planning.plan`).

    ``takes``: the representation it wants for a non-deterministic input (None: it passes its input
    through, e.g. reshape); ``natural``: what its formula gives (None: passes through);
    ``keeps_deterministic``: deterministic inputs give a deterministic output (no parameters).
    ``takes``/``natural`` may be :data:`COMPUTE_INPUT`.
    """

    takes: Repr | str | None
    natural: Repr | str | None
    keeps_deterministic: bool


VARIANCE_IN_OUT = Contract(Repr.VARIANCE, Repr.VARIANCE, keeps_deterministic=True)
"""Elementwise/pooling ops: variance in, variance out, no parameters."""
ACTIVATION = Contract(Repr.VARIANCE, COMPUTE_INPUT, keeps_deterministic=True)
"""Activations: variance in, out in what the next compute layer takes (an epilogue converts)."""


@dataclass(frozen=True)
class ActivationRule:
    """An elementwise activation ``y = f(x)``, written once for every back end.

    ``exact(x, attrs, ops)``: ``f`` on a deterministic input; ``moments(mean, var, attrs, ops)``:
    ``(E[f(a)], Var[f(a)])`` for ``a ~ N(mean, var)``.  Both use only the ``ops`` namespace of
    :mod:`pyro2pfp.moments` and Python operators, so the same function runs on float64 arrays
    (reference), TE expressions (TVM kernel) and ONNX symbols (export).  ``attrs``: the layer's
    attributes (e.g. ``{"slope": 0.01}``).
    """

    exact: Callable[[Any, dict[str, Any], Any], Any]
    moments: Callable[[Any, Any, dict[str, Any], Any], tuple[Any, Any]]
    non_decreasing: Callable[[dict[str, Any]], bool] | None = None
    """Whether ``f`` is non-decreasing for these attrs (None: not known to be).  Then
    ``max_pool(f(a)) = f(max_pool(a))`` exactly, and the planner may apply ``f`` after a max pool."""
    stein: bool = True
    """The op's shared-factor rule is the generic one, Stein's linear response with the slope of
    ``moments``' mean (registered for every back end with the op); False where the op's family
    file registers a rule of its own (ReLU's Hermite factors, scale's linear rule)."""


@dataclass(frozen=True)
class FactorSpec:
    """What the shared-factor factor plan (:func:`pyro2pfp.correlation.factors.plan_factors`) needs
    to know of an op beyond its rule.

    ``terminal``: the op may only be the network's output and reads only its input's corrected
    ``(μ, v)``: its shared part is dropped (exact: nothing after it sums anything);
    ``hermite_block``: with a shared input (and ``hermite='factor'``) the op creates a factor block
    of its channels (ReLU's second Hermite term); ``refuse(layer)``: why the rule cannot run this
    layer (None: it can), e.g. a grouped convolution; ``joins_rows``: the op stacks its inputs' rows
    (a concatenation along the channel axis), so every input with a shared part must have its rows as
    its first axis (not a flattened conv output, whose rows are groups of positions); ``covariance``: the op's
    output is a deterministic tensor computed from its input's moments *and shared part* (the in-window
    covariances of a max pool, ``window_cov``): its rule runs whenever the input has a shared part and
    replaces the output, which carries no shared part itself."""

    terminal: bool = False
    hermite_block: bool = False
    refuse: Callable[[Any], str | None] | None = None
    joins_rows: bool = False
    covariance: bool = False
    reshapes: bool = False
    """The op reshapes its input: its shared part keeps the input's rows (the channel axis kept, or
    flattened: rows of groups of positions)."""
    mean_field_wrong: Callable[[Any, Any, dict[str, bool]], str | None] | None = None
    """``(layer, graph, conv_noise) -> why``: why mean-field PFP is wrong at this layer (None: it is
    fine), a reason for ``correlation='auto'`` to plan shared factors (``conv_noise[edge]``: the edge
    depends on the noise of weights shared by positions, :attr:`OpDef.positions_share_weights`), e.g. an
    average pool of a conv's noise, a residual add of two noisy branches."""
    guide_factors: bool = False
    """The float32 back ends' rules of the op carry a correlated guide's global factors."""
    rescales_weight_noise: bool = False
    """With ``injection='rescaled'`` the rule of a noisy layer rescales its mean-field kernel's
    weight-noise term (``RelaxActivation.weight_noise``) instead of computing the regression profile."""
    cost: Callable[[Any, Any, int], tuple[int, int]] | None = None
    """A compute layer's ``(layer, factor plan, K of its input) -> (multiply-adds of one product of its
    linear map, multiply-adds the shared-factor rule adds)`` per input, for
    :func:`~pyro2pfp.correlation.cost.cost_model` (other ops count their elements)."""


@dataclass(frozen=True)
class CompactSpec:
    """What the compact factor plan (:func:`pyro2pfp.correlation.compact.plan_compact`) needs to know of an
    op beyond its rule (``@compact_reference``).

    ``keeps_units``: the op keeps a dense layer's output units apart (an elementwise map, a LayerNorm, a
    reshape; activations always do), so its output still counts as the dense layer's;
    ``mean_field_products``: ``(deterministic input, random input)``: the products of its weight tensor's
    size per output element in the mean-field plan (0: no linear map); ``macs(layer, plan, global columns
    in, (channels, block columns) in) -> (multiply-adds, global columns out, block columns out)``: its part
    of :func:`~pyro2pfp.correlation.compact.compact_macs` (None: pools count their windows, other ops
    their elements, columns passed on)."""

    keeps_units: bool = False
    mean_field_products: tuple[int, int] = (0, 0)
    macs: Callable[[Any, Any, int, tuple[int, int]], tuple[int, int, tuple[int, int]]] | None = None


@dataclass(frozen=True)
class OpDef:
    """One PFP op.

    ``torch_ops``: the ``str(node.target)`` names its converters handle; ``modules``: the torch
    modules/expressions they come from, as the README table shows them (``modules_short``: the
    names listed in the unsupported-op message); ``moments``/``assumptions``: the moment rule's
    exactness and what it assumes (see docs/math.md); ``contract``: its representation contract;
    ``activation``: the rule of an elementwise activation (then the reference, ONNX export and TVM
    kernel are the generic ones); ``compute_layer``: has Gaussian weights (dense, conv);
    ``internal``: inserted by the planner, never converted from torch (no table row, no converter);
    ``table_op``: the op column of the table when it is not just ``name``; ``view``: emitted as a
    Relax view (no PrimFunc, so no schedule); ``required_tests``: the test kinds the completeness
    test demands (an op with no moments to sample, e.g. ``reshape``, omits ``"monte_carlo"``);
    ``example_attrs``: the attrs of a representative layer of an op that has any (e.g. a LeakyReLU
    slope), so generic tests can build one layer of every registered activation;
    ``factor_spec``: the op's part of the shared-factor plan; ``no_shared_rule``: why the op has no
    shared-factor rule (empty: it has one in every back end, which ``tests/ops/test_op_completeness.py``
    checks; a plan with factors is refused for a network with such an op, ``correlation='auto'``
    falls back to mean-field); ``stored_tensors``: ``fn(layer, input_repr, calibration) -> {name:
    array}``, the layer's parameters as every back end reads them (``PlannedLayer.tensors``, variances
    calibrated); None: none, or the compute layers' weights and biases (``compute_layer``);
    ``positions_share_weights``: a compute layer whose output positions all use the same weights (a
    convolution), so its weights' noise is shared by the positions of a channel -- mean-field PFP drops
    that correlation where a later layer sums positions; ``elementwise``: an op other than an activation
    that maps each element alone, or per channel (a per-channel affine map, a residual add): its result on
    ``(C, 1, L)`` is its result on ``(C, L)`` reshaped (:func:`pyro2pfp.planning.onedim.lift_1d`);
    ``sums_elements``: every output unit is a weighted sum of every input element (a dense layer): its
    units share their inputs' noise (with deterministic weights, a reason for shared factors; the compact
    factor plan's loadings end in such layers, and their input residual may become factors), and it sums
    the positions of a flattened conv output;
    ``non_decreasing(layer)``: an elementwise op other than an activation (whose rule says it:
    ``ActivationRule.non_decreasing``) is non-decreasing in its input for this layer, so it commutes with a
    max pool (a BatchNorm with non-negative scales); ``window_max``: the op is a max pool, whose window the
    planner gives its in-window covariances (:mod:`pyro2pfp.planning.correlated_pools`);
    ``window_covariances(covs, layer) -> name | None``: how the in-window covariances of a max pool's input
    pass through a layer of the op (a conv's own, the sum of an add's branches, a scaled map's squared scale,
    …), built with ``covs`` (a :class:`~pyro2pfp.planning.correlated_pools.WindowCovariances`; an activation
    without it gets Mehler's ``window_activation``, any other op its edge's shared factors' part);
    ``compact_spec``: the op's part of the compact factor plan.
    """

    name: str
    torch_ops: tuple[str, ...] = ()
    modules: str = ""
    modules_short: tuple[str, ...] = ()
    moments: str = ""
    assumptions: str = ""
    contract: Contract = VARIANCE_IN_OUT
    activation: ActivationRule | None = None
    compute_layer: bool = False
    internal: bool = False
    table_op: str = ""
    view: bool = False
    required_tests: tuple[str, ...] = field(default=("monte_carlo", "compiled"))
    example_attrs: dict[str, Any] = field(default_factory=dict)
    factor_spec: FactorSpec = FactorSpec()
    no_shared_rule: str = ""
    stored_tensors: Callable[..., dict[str, Any]] | None = None
    positions_share_weights: bool = False
    elementwise: bool = False
    sums_elements: bool = False
    non_decreasing: Callable[[Any], bool] | None = None
    window_max: bool = False
    window_covariances: Callable[[Any, Any], str | None] | None = None
    compact_spec: CompactSpec = CompactSpec()


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


SHARED_REFERENCES: dict[str, Callable[..., Any]] = {}
"""``{op: rule(layer, inputs, shared, fp, var) -> (shared part, var)}``: the float64 shared-factor
rules (:func:`pyro2pfp.correlation.execute.execute_shared_all` runs them after each layer's
reference; ``inputs``: the inputs' mean-field activations, ``shared``: their
:class:`~pyro2pfp.correlation.shared.Shared` parts (None: none), ``var``: the layer's output
variance, returned corrected where the rule corrects it; the rule of a ``FactorSpec.covariance`` op
returns its whole output, an ``Activation``, in its place)."""
SHARED_EXPORTERS: dict[str, Callable[..., Any]] = {}
"""``{op: rule(step, ctx, layer, inputs, shared, out) -> (shared part, out)}``: the ONNX export of the
rules (``step``: the :class:`~pyro2pfp.correlation.onnx_step.OnnxSharedStep` and its helpers)."""
SHARED_KERNELS: dict[str, Callable[..., Any]] = {}
"""``{op: rule(step, ctx, layer, inputs, shared, out) -> (shared part, out)}``: the TE kernels of the
rules (``step``: the ``backends.tvm.shared_factor.SharedStep``; filled when ``backends/tvm`` is imported)."""
COMPACT_REFERENCES: dict[str, Callable[..., Any]] = {}
"""``{op: rule(bk, layer, inputs, loadings, plan, mean, var) -> (loadings, mean, var)}``: the rules of the compact
factor plan (:mod:`pyro2pfp.correlation.compact`: explicit loadings, global and per-channel block columns,
:class:`~pyro2pfp.correlation.loadings.Loadings`), each a formula over a back end ``bk`` registered by
``ops._formula.compact_formula`` in this table (the float64 reference runs it with ``reference.NUMPY_BACKEND``:
:func:`~pyro2pfp.correlation.compact.execute_compact_all`) and in :data:`COMPACT_EXPORTERS` (the ONNX export
runs it with its ``OnnxContext``).  An activation without a rule takes the generic Stein rule."""
COMPACT_EXPORTERS: dict[str, Callable[..., Any]] = {}
"""The table of the compact factor rules the float32 back ends run (the same formulas as :data:`COMPACT_REFERENCES`):
the ONNX export with its ``OnnxContext`` and the TVM back end with Relax operators
(``backends/tvm/compact_factor.py``)."""
shared_reference = add_to(SHARED_REFERENCES, "shared-factor rule of op")
compact_reference = add_to(COMPACT_REFERENCES, "compact factor rule of op")
compact_exporter = add_to(COMPACT_EXPORTERS, "compact factor ONNX export of op")
shared_exporter = add_to(SHARED_EXPORTERS, "shared-factor ONNX export of op")
shared_kernel = add_to(SHARED_KERNELS, "shared-factor TVM kernel of op")


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
