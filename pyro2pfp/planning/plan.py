"""Stage 3: plan the representation of every edge and the stored form of every weight.

Two plans (``moment_form``):

``"raw"`` — the paper's plan (section 5, ``docs/math.md`` "Representation planning"):

* compute layers (dense, conv2d) take the **second raw moment** (or a deterministic input) and
  give the **variance**, ``v = Σ sw·sx − (μw·μx)²`` with ``E[w²]`` precomputed;
* ReLU takes the **variance** and gives the **second raw moment**;
* max pooling takes and gives the **variance** (so do LeakyReLU's neighbours: average pooling,
  batch norm and residual additions); reshape-like layers pass on what they get;
* the network output is (mean, **variance**).

``"variance"`` (the default) — every edge carries the variance; compute layers use the
variance-input form ``v = Σ vw·(μx² + vx) + μw²·vx`` of ``docs/math.md`` "Compute layers".  Its terms are all
non-negative, so it has no cancellation: the raw moment ``s = μ² + v`` cannot hold a variance
below ``~1e-7·μ²`` in float32 (SVI posteriors are often that narrow), and ``Σ sw·sx − (μw·μx)²``
subtracts nearly equal sums.  It costs the same per term (two weight tensors, four operations).

Every op can also *emit* the other representation through a cheap epilogue in its own kernel
(``s = μ² + v`` or ``v = s − μ²``), so a producer emits what its consumers want; only when its
consumers disagree (or the producer is the network input) is an explicit ``convert`` layer inserted.

Deterministic edges: the network input is deterministic unless an input variance is given, and
stays so through ReLU/pooling/reshape until the first compute layer, which then uses the
deterministic-input form ``v = Σ vw·x²`` and keeps its weight *variances*; every later compute layer
stores ``E[w²] = μw² + vw`` instead.  All weight and bias variances are multiplied by the
calibration factor first.

Deterministic weights: a variance below float32's smallest normal number (``1.2e-38``: a posterior
scale of 0, a ``Delta``, a scale of ``1e-30``) is stored as 0 — the float32 network cannot hold it
(it would flush to 0 or lose its precision as a subnormal), and storing 0 keeps the reference in
step.  A dense/conv layer whose weight and bias variances are then all 0 and whose input is
deterministic gives a deterministic output, as sampling the posterior does: a collapsed posterior
converts to a deterministic network with a variance of exactly 0, not the rounding residue of
``E[w²] − μ²``.
"""
from __future__ import annotations

import numbers
from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import numpy as np

from ..errors import PFPError
from ..options import MomentForm, checked, values
from .graph import INPUT, GuideFactorInfo, Layer, LayerGraph, Repr
from .registry import COMPUTE_INPUT, OPS

D, V, S = Repr.DETERMINISTIC, Repr.VARIANCE, Repr.SECOND_MOMENT
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)


def is_compute_layer(op: str) -> bool:
    """``op`` has Gaussian weights (``OpDef.compute_layer``: dense, conv2d)."""
    return op in OPS and OPS[op].compute_layer


def stored_variance(var: np.ndarray, calibration: float) -> np.ndarray:
    """``calibration · var`` with the values float32 cannot hold as normal numbers set to 0."""
    scaled = calibration * np.asarray(var, dtype=np.float64)
    return np.where(scaled < _FLOAT32_TINY, 0.0, scaled)


def has_deterministic_weights(layer: Layer, calibration: float) -> bool:
    """Whether a dense/conv layer's stored weight and bias variances are all 0."""
    return is_compute_layer(layer.op) and all(
        not np.any(stored_variance(p.var, calibration)) for p in layer.params.values())


@dataclass(frozen=True)
class OpSpec:
    """Representation contract of a PFP op under one plan (its :class:`~pyro2pfp.planning.registry.Contract`
    with :data:`~pyro2pfp.planning.registry.COMPUTE_INPUT` resolved)."""

    takes: Repr | None  # the non-deterministic input it wants; None = passes its input through
    natural: Repr | None  # what its formula gives; None = passes through
    keeps_deterministic: bool  # deterministic inputs give a deterministic output (no parameters)


MOMENT_FORMS = values(MomentForm)


def op_specs(moment_form: str = "variance") -> dict[str, OpSpec]:
    """The representation contract of every registered op (:data:`pyro2pfp.planning.registry.OPS`) under the
    given plan: compute layers take the second raw moment in the ``"raw"`` plan, the variance otherwise."""
    compute_takes = S if moment_form == "raw" else V

    def resolve(r: Repr | str | None) -> Repr | None:
        if r == COMPUTE_INPUT:
            return compute_takes
        assert r is None or isinstance(r, Repr), r
        return r

    return {name: OpSpec(resolve(op.contract.takes), resolve(op.contract.natural), op.contract.keeps_deterministic)
            for name, op in OPS.items()}


@dataclass
class PlannedLayer:
    """A layer with its representation plan and its stored (calibrated) tensors.

    ``in_reprs[i]`` is the representation of input ``i``; ``out_repr`` the one this layer emits.
    ``tensors`` holds float64 arrays in torch layout: ``weight_mean`` and either ``weight_var``
    (deterministic input) or ``weight_second_moment`` (``μw² + vw``); ``bias_mean`` and, for a
    probabilistic bias, ``bias_var``.
    """

    layer: Layer
    in_reprs: list[Repr]
    out_repr: Repr
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    natural_out: Repr | None = None  # what the op's formula gives before any epilogue conversion

    @property
    def name(self) -> str:
        return self.layer.name

    @property
    def op(self) -> str:
        return self.layer.op

    @property
    def inputs(self) -> list[str]:
        return self.layer.inputs


class FactorScheme(Protocol):
    """A factor plan in ``PlannedGraph.factors`` (``pyro2pfp.correlation.FactorPlan``,
    ``pyro2pfp.correlation.compact.CompactPlan``; None there: mean-field PFP).  The back ends below the
    correlation package dispatch on :attr:`scheme`; the correlation package's own code narrows to its
    classes (``isinstance``) before it reads anything else."""

    #: the key the back ends' executors and steps are registered under (``"shared-factor"``, ``"compact-factor"``)
    scheme: ClassVar[str]

    @property
    def max_factors(self) -> int:
        """The largest number of factor columns of any edge (a plan without static widths: its factor count)."""
        ...

    def describe(self) -> str:
        """One line for the plan printout: which factors the plan carries."""
        ...


@dataclass
class PlannedGraph:
    """The planned network both back ends execute."""

    input_shape: tuple[int, ...]
    input_repr: Repr
    layers: list[PlannedLayer]
    output: str
    calibration: float
    moment_form: str = "variance"
    # A factor plan: pyro2pfp.correlation.FactorPlan (shared-factor PFP, set by
    # pyro2pfp.correlation.with_correlation) or pyro2pfp.correlation.compact.CompactPlan; None for mean-field
    # PFP.  Each has a ``scheme`` (its executor's key).  (A Protocol: the correlation package builds on this module.)
    factors: FactorScheme | None = None
    # A correlated guide's global factors (their loadings: the compute layers' weight_factors/bias_factors).
    guide_factors: GuideFactorInfo | None = None

    @property
    def correlation(self) -> str:
        """``"shared-factor"``, ``"compact-factor"`` or ``"mean-field"``: the scheme this plan is executed with."""
        return "mean-field" if self.factors is None else str(self.factors.scheme)

    def repr_of(self, name: str) -> Repr:
        if name == INPUT:
            return self.input_repr
        return self.layer(name).out_repr

    def layer(self, name: str) -> PlannedLayer:
        for planned in self.layers:
            if planned.name == name:
                return planned
        raise KeyError(name)

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self.input_shape if name == INPUT else self.layer(name).layer.out_shape

    def summary(self) -> str:
        """A table of the layer plan: op, source, shapes, representations in/out, conversions."""
        rows = [("layer", "op", "source", "out shape", "takes", "gives", "notes")]
        rows.append(("input", "", "", str(self.input_shape), "", str(self.input_repr), ""))
        for p in self.layers:
            notes = []
            if is_compute_layer(p.op):
                t = p.tensors
                weight_var = t["weight_var"] if "weight_var" in t else t["weight_second_moment"] - t["weight_mean"] ** 2
                if not np.any(weight_var):  # buffers, plain parameters, a collapsed posterior
                    w = "deterministic weights"
                else:
                    w = "weight variances" if "weight_var" in p.tensors else "E[w²] precomputed"
                w += {D: "", V: ", variance-input form", S: ", raw-moment form"}[p.in_reprs[0]]
                b = ("no bias" if "bias_mean" not in p.tensors
                     else "probabilistic bias" if "bias_var" in p.tensors else "deterministic bias")
                notes.append(f"{w}, {b}")
                if p.in_reprs[0] is D:
                    notes.append("deterministic-input form")
            if p.natural_out is not None and p.out_repr not in (D, p.natural_out):
                notes.append(f"conversion in epilogue: {p.natural_out} → {p.out_repr}")
            if p.op == "convert":
                notes.append("inserted conversion")
            if p.layer.note:
                notes.append(p.layer.note)
            stale = [f"{role} = param store's '{param.store}'" for role, param in p.layer.params.items() if param.stale]
            if stale:
                notes.append(f"{', '.join(stale)} (the module object holds other values)")
            rows.append((p.name, p.op, p.layer.source, str(p.layer.out_shape),
                         ", ".join(map(str, p.in_reprs)), str(p.out_repr), "; ".join(notes)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        lines.append(f"output: {self.output} → (mean, variance); calibration factor {self.calibration:g}; "
                     f"moment form '{self.moment_form}'")
        if self.factors is None:
            lines.append("correlation: mean-field (every element independent)")
        else:
            lines.append(f"correlation: {self.factors.scheme}: {self.factors.describe()}")
        if self.guide_factors is not None:
            carried = self.factors is not None and getattr(self.factors, "guide", 0) > 0
            lines.append(f"guide correlations: {self.guide_factors.describe()}"
                         + ("" if carried else "; not carried by this mean-field plan (marginal variances only)"))
        return "\n".join(lines)


def _stored_tensors(layer: Layer, input_repr: Repr, calibration: float) -> dict[str, np.ndarray]:
    """The layer's parameters as the back ends read them: the op's own ``OpDef.stored_tensors``, else a
    compute layer's weights and biases, else none."""
    op = OPS.get(layer.op)
    if op is not None and op.stored_tensors is not None:
        return op.stored_tensors(layer, input_repr, calibration)
    if not is_compute_layer(layer.op):
        return {}
    return compute_tensors(layer, input_repr, calibration)


def compute_tensors(layer: Layer, input_repr: Repr, calibration: float) -> dict[str, np.ndarray]:
    """A compute layer's stored weight and bias: means, calibrated variances (or, for a second-moment
    input, ``E[w²]``) and a correlated guide's loadings, calibrated as standard deviations."""
    weight = layer.params["weight"]
    tensors = {"weight_mean": weight.mean}
    root = np.sqrt(max(float(calibration), 0.0))
    if weight.factors is not None:  # a correlated guide's loadings on its global factors (calibrated as sd)
        tensors["weight_factors"] = root * weight.factors
    weight_var = stored_variance(weight.var, calibration)
    if input_repr is S:
        tensors["weight_second_moment"] = weight.mean**2 + weight_var
    else:
        tensors["weight_var"] = weight_var
    bias = layer.params.get("bias")
    if bias is not None:
        tensors["bias_mean"] = bias.mean
        if bias.factors is not None:
            tensors["bias_factors"] = root * bias.factors
        bias_var = stored_variance(bias.var, calibration)
        if np.any(bias_var):
            tensors["bias_var"] = bias_var
    return tensors


def plan(graph: LayerGraph, calibration: float = 1.0,
         moment_form: MomentForm | str = MomentForm.VARIANCE) -> PlannedGraph:
    """Assign representations, insert conversions and compute the stored weights (a mean-field plan:
    :func:`pyro2pfp.correlation.with_correlation` adds the factor plan of shared-factor PFP)."""
    if isinstance(calibration, bool) or not isinstance(calibration, numbers.Real):
        raise PFPError(f"calibration must be a number (the factor on every weight variance, e.g. 1.0), "
                       f"got {calibration!r} of type {type(calibration).__name__}")
    if not np.isfinite(calibration) or calibration < 0:
        raise PFPError(f"calibration must be a finite non-negative factor, got {calibration}")
    moment_form = checked(MomentForm, moment_form)
    specs = op_specs(moment_form)
    for layer in graph.layers:
        if layer.op not in specs:
            raise PFPError(f"{layer.source}: no representation rule for PFP op '{layer.op}'")
    input_repr = V if graph.input_variance else D

    # 1. Forward: which edges are deterministic.
    deterministic = {INPUT: input_repr is D}
    for layer in graph.layers:
        spec = specs[layer.op]  # natural D: a plain tensor whatever the input (window_cov's covariances)
        keeps = spec.keeps_deterministic or has_deterministic_weights(layer, calibration)
        deterministic[layer.name] = spec.natural is D or (keeps and all(deterministic[i] for i in layer.inputs))

    # 2. Backward: what each edge's consumers want (pass-through layers forward their consumers' wants).
    wants: dict[str, list[Repr]] = {INPUT: [], **{layer.name: [] for layer in graph.layers}}
    wants[graph.output].append(V)
    for layer in reversed(graph.layers):
        spec = specs[layer.op]
        for name in layer.inputs:
            wants[name].extend(wants[layer.name] if spec.takes is None else [spec.takes])

    # 3. Each real producer emits what most of its consumers want (ties: its natural form).
    def choose(name: str, natural: Repr) -> Repr:
        if deterministic[name]:
            return D
        counts = Counter(wants[name])
        if not counts:
            return natural
        best = max(counts.values())
        return natural if counts[natural] == best else max(counts, key=lambda r: (counts[r], r is V))

    planned: list[PlannedLayer] = []
    edge_repr = {INPUT: input_repr}
    conversions: dict[tuple[str, Repr], str] = {}

    def deliver(name: str, wanted: Repr | None) -> str:
        """Name of the edge carrying ``name`` in the ``wanted`` representation (inserting a convert)."""
        have = edge_repr[name]
        if wanted is None or have is D or have is wanted:
            return name
        key = (name, wanted)
        if key not in conversions:
            conv_name = f"{name}_to_{'var' if wanted is V else 'second'}"
            source = f"conversion {have} → {wanted}"
            layer = Layer(name=conv_name, op="convert", inputs=[name], out_shape=graph.shape_of(name),
                          source=source, attrs={"to": wanted.name})
            planned.append(PlannedLayer(layer=layer, in_reprs=[have], out_repr=wanted))
            edge_repr[conv_name] = wanted
            conversions[key] = conv_name
        return conversions[key]

    for layer in graph.layers:
        spec = specs[layer.op]
        inputs = [deliver(name, spec.takes) for name in layer.inputs]
        in_reprs = [edge_repr[name] for name in inputs]
        if spec.natural is None:
            out = in_reprs[0]
        else:
            out = choose(layer.name, spec.natural)
        new_layer = Layer(name=layer.name, op=layer.op, inputs=inputs, out_shape=layer.out_shape,
                          source=layer.source, attrs=dict(layer.attrs), params=layer.params, note=layer.note)
        natural = None if spec.natural is None or out is D else spec.natural
        planned.append(PlannedLayer(layer=new_layer, in_reprs=in_reprs, out_repr=out, natural_out=natural,
                                    tensors=_stored_tensors(layer, in_reprs[0], calibration)))
        edge_repr[layer.name] = out
    output = deliver(graph.output, V)
    return PlannedGraph(input_shape=graph.input_shape, input_repr=input_repr, layers=planned,
                        output=output, calibration=float(calibration), moment_form=moment_form,
                        guide_factors=graph.guide_factors)
