"""The compact factor plan: explicit factor loadings, few of them, only where a net's head sums them.

Why
---
Mean-field PFP with correlated max pools gets a CNN's per-element variances right up to its dense head,
and then loses variance *inside* the head: every unit of a dense layer reads the same input elements,
so the units of a dense layer are correlated through their inputs' noise, and the next dense layer sums
them.  On the main job's LeNet-5 (``benchmarks/head_covariance.py``, Monte Carlo only) making fc3's inputs
independent costs the logits most of their lost variance, fc2's inputs the next share, and fc1's
inputs -- the flattened conv output -- the least; mean-field makes all three independent.  The
shared-factor scheme (:mod:`.shared`) carries these correlations but pays for a factor per channel of
every conv (×9 the multiply-adds on LeNet-5).  This plan carries only what the head sums.

Representation (per edge, per input ``b``)
------------------------------------------
The mean-field ``(μ, v)`` plus loadings ``L[e, f] = Cov(a[e], ζ_f)`` of every element ``e`` on
independent standard normal factors ``ζ_f``, the rest of ``v`` (``v − Σ_f L²``, the residual) independent
across elements, as in mean-field.  Two kinds of columns (:class:`Loadings`):

* **global** ``(B, E, K)``: a factor may load every element;
* **block** ``(B, C, P, R)``: factor ``(c, r)`` loads only channel ``c``'s ``P`` positions (stored as
  such, no zeros): a conv's own weight noise, per output channel.

Columns are keyed by the layer (or any other source) that created them (:class:`Loadings`), so that
edges carrying the same factors add them where branches meet.  Factors shared by several layers -- the
low-rank part of a guide, ``W = M + U·z`` with one ``z`` for the whole net -- fit as global columns under
one key that every compute layer adds to (its loading ``U``'s part times the layer's input mean) and the
rules above carry like any other.

Which layer creates which factors (:func:`plan_compact`, plain data: :class:`CompactPlan`)
------------------------------------------------------------------------------------------
* **A dense layer whose input is another dense layer's output** (through elementwise ops) and whose
  output is summed again by a later dense layer: its input's residual becomes one global factor per
  input element, ``ℓ[j, i] = W[j, i]·√r_i`` (exact: an input element's independent noise is shared by
  every unit that reads it).  The last dense layer needs none: its output's variance is exact from
  ``Σ W²·r`` and its input loadings.
* **The last convs before the head** (a noisy conv whose output reaches a dense layer through pools,
  activations, affine maps, adds and reshapes only): their weight and bias noise as ``R`` block factors
  per output channel, while the plan's multiply-adds stay within :data:`COST_BUDGET` times the
  mean-field plan's.  The directions are the range finder of the channel's noise covariance over
  positions with the uniform test vector (exact for the channel's spatial sum, bias included) and
  linear ramps for ``R > 1``: ``conv_block_factors`` in ``ops/compute.py`` derives them.

The rules live with their ops (``@compact_reference(op)`` in ``ops/<family>.py``; every activation
with an :class:`~pyro2pfp.planning.registry.ActivationRule` takes the generic Stein rule here).  A dense layer's
output variance is the coherent sum of its inputs' loadings in place of their independent sum:
``v_out = v_mf + ‖W·L‖² − W²·‖L‖²``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..backends.reference import NUMPY_BACKEND, REFERENCES, SCHEME_EXECUTORS, Activation, emit_output
from ..errors import PFPError
from ..planning.graph import INPUT, Repr
from ..planning.plan import PlannedGraph, PlannedLayer, is_compute_layer
from ..planning.registry import COMPACT_REFERENCES, OPS
from .factors import CorrelationError, is_noisy, weight_var
from .loadings import CompactPlan, Loadings, compact_layer

#: a dense layer turns its input's residual into factors only if these cost at most this many multiply-adds
#: per input in the layers after it (the columns times the dense layers that carry them)
RESIDUAL_BUDGET = 2_000_000
#: the plan's multiply-adds may be at most this multiple of the mean-field plan's (with its correlated pools):
#: :func:`plan_compact` keeps the last convs' weight directions only within it
COST_BUDGET = 1.3


def flat(t: np.ndarray) -> np.ndarray:
    """``t`` (B, ...) as (B, E)."""
    return t.reshape(t.shape[0], -1)


def _sums_elements(op: str) -> bool:
    """``op`` sums every input element into every output unit (a dense layer, ``OpDef.sums_elements``)."""
    return op in OPS and OPS[op].sums_elements


def _passes_on(op: str) -> bool:
    """``op`` carries loadings on without creating or summing factors of its own: an op with a compact rule
    that is not a compute layer (pools, affine maps, adds, reshapes), or an activation."""
    return (op in COMPACT_REFERENCES and not is_compute_layer(op)) or (op in OPS and OPS[op].activation is not None)


def _feeds_head(graph: PlannedGraph, name: str, users: dict[str, list[PlannedLayer]]) -> bool:
    """A dense layer is reached from ``name`` through ops that pass loadings on (:func:`_passes_on`) only."""
    todo, seen = [name], set()
    while todo:
        for user in users.get(todo.pop(), []):
            if user.name in seen:
                continue
            seen.add(user.name)
            if _sums_elements(user.op):
                return True
            if _passes_on(user.op):
                todo.append(user.name)
    return False


def _dense_source(graph: PlannedGraph, name: str) -> bool:
    """``name`` is a dense layer's output, possibly through elementwise ops, LayerNorms and reshapes."""
    while name != INPUT:
        layer = graph.layer(name)
        if _sums_elements(layer.op):
            return True
        if not (layer.op in OPS and (OPS[layer.op].compact_spec.keeps_units or OPS[layer.op].activation is not None)):
            return False
        name = layer.inputs[0]
    return False


def plan_compact(graph: PlannedGraph, directions: int | None = None) -> CompactPlan:
    """The compact factor plan of ``graph`` (module docstring): the last convs create ``directions`` block
    factors per channel (None: one if the plan's multiply-adds then stay within :data:`COST_BUDGET` times
    the mean-field plan's, else none -- the cost model of :func:`compact_macs`); dense layers reading another
    dense layer's output, with a dense layer after them, turn their input residual into factors while that
    costs at most :data:`RESIDUAL_BUDGET` multiply-adds per input.  :class:`CorrelationError` names a layer
    the loadings reach whose op has no rule."""
    if directions is None:
        base = mean_field_macs(graph)
        with_one = _plan(graph, 1)
        ratio = (base + compact_macs(graph, with_one)) / max(base, 1)
        if ratio <= COST_BUDGET or not with_one.directions:
            return with_one
        without = _plan(graph, 0)
        note = (f"no conv weight directions ({', '.join(with_one.directions)}: one per channel would cost "
                f"x{ratio:.2f} the mean-field multiply-adds, over the budget x{COST_BUDGET})")
        return dataclasses.replace(without, note=note)
    return _plan(graph, directions)


def mean_field_macs(graph: PlannedGraph) -> int:
    """The multiply-adds per input of the linear maps of a mean-field plan: a dense/conv layer 3 products
    of its size (2 for a deterministic input), a ``window_cov`` layer 2 (1) -- the ops'
    ``CompactSpec.mean_field_products``."""
    total = 0
    for layer in graph.layers:
        products = OPS[layer.op].compact_spec.mean_field_products if layer.op in OPS else (0, 0)
        if products == (0, 0):
            continue
        det = layer.in_reprs[0] is Repr.DETERMINISTIC
        size = int(layer.tensors["weight_mean"][0].size) * int(np.prod(layer.layer.out_shape))
        total += size * products[0 if det else 1]
    return total


def _plan(graph: PlannedGraph, directions: int) -> CompactPlan:
    if graph.input_repr is not Repr.DETERMINISTIC:
        raise CorrelationError("the compact factor plan needs a deterministic network input "
                               "(input_variance=True is mean-field only)")
    users: dict[str, list[PlannedLayer]] = {}
    for layer in graph.layers:
        for n in layer.inputs:
            users.setdefault(n, []).append(layer)
    dense = [layer for layer in graph.layers if _sums_elements(layer.op)]
    dirs = {layer.name: directions for layer in graph.layers
            if layer.op in OPS and OPS[layer.op].positions_share_weights and is_noisy(layer)
            and int(layer.layer.attrs.get("groups", 1)) == 1
            and directions > 0 and _feeds_head(graph, layer.name, users)}
    residual = set()
    for i, layer in enumerate(dense):
        later = dense[i + 1:]
        if not later or not _dense_source(graph, layer.inputs[0]):
            continue
        columns = int(np.prod(graph.shape_of(layer.inputs[0])))
        width = layer.layer.out_shape[0]
        cost = columns * width
        for nxt in later[:-1]:  # the last dense layer reads the loadings once: in_features × out_features
            cost += columns * int(np.prod(nxt.layer.out_shape)) * int(np.prod(graph.shape_of(nxt.inputs[0])))
        last = later[-1]
        cost += columns * int(np.prod(last.layer.out_shape)) * int(np.prod(graph.shape_of(last.inputs[0])))
        if cost <= RESIDUAL_BUDGET:
            residual.add(layer.name)
    carried = set(dirs) | residual
    terminal = set()
    for layer in graph.layers:
        if not any(n in carried for n in layer.inputs) and layer.name not in carried:
            continue
        op = layer.op
        if op in OPS and OPS[op].factor_spec.terminal or layer.name == graph.output:
            terminal.add(layer.name)
            continue
        if op not in COMPACT_REFERENCES and not (op in OPS and OPS[op].activation is not None):
            raise CorrelationError(f"{layer.layer.source}: op '{op}' has no rule in the compact factor plan; "
                                   "use correlation='mean-field' or 'shared-factor'")
        carried.add(layer.name)
    return CompactPlan(dirs, frozenset(residual), frozenset(terminal), shapes=edge_shapes(graph))


def with_compact(graph: PlannedGraph, correlation: str) -> PlannedGraph:
    """``graph`` with the compact factor plan in ``graph.factors`` when ``correlation`` asks for it (after
    the max pools were correlated: the plan reads the rewritten graph); returns ``graph``."""
    if correlation == "compact-factor":
        graph.factors = plan_compact(graph)
    return graph


def auto_compact(graph: PlannedGraph) -> tuple[CompactPlan | None, str]:
    """What ``correlation="auto"`` does for a network whose dense layers sum the positions of conv channels that
    share their weights' noise (conv → pool → flatten → dense; mean-field drops that correlation and the
    shared-factor plan carries hundreds of dense factors through the head): the compact factor plan
    (:func:`plan_compact`) when it carries factors and its multiply-adds stay within :data:`COST_BUDGET` times
    the mean-field plan's (:func:`compact_macs`), with the reason in its ``note`` (the plan printout); else
    ``(None, why not)``."""
    try:
        cp = plan_compact(graph)
    except CorrelationError as exc:
        return None, f"the compact factor plan has no rule for a layer here ({exc})"
    if not cp.directions and not cp.residual:
        return None, "the compact factor plan would carry no factors here" + (f" ({cp.note})" if cp.note else "")
    base = mean_field_macs(graph)
    ratio = (base + compact_macs(graph, cp)) / max(base, 1)
    if ratio > COST_BUDGET:
        return None, (f"the compact factor plan would cost x{ratio:.2f} the mean-field multiply-adds, over the "
                      f"budget x{COST_BUDGET}")
    why = (f"chosen by correlation='auto': dense layers sum positions of conv channels that share their weights' "
           f"noise; x{ratio:.2f} the mean-field multiply-adds (budget x{COST_BUDGET})")
    return dataclasses.replace(cp, note="; ".join(n for n in (cp.note, why) if n)), why


def execute_compact_all(graph: PlannedGraph, x: np.ndarray, plan: CompactPlan | None = None, *,
                        keep: dict[str, Loadings | None] | None = None) -> dict[str, Activation]:
    """Run ``graph`` in float64 with the compact factor plan; every layer's activation by name.

    Each layer runs its mean-field reference, then -- where an input carries loadings or the layer
    creates factors -- its rule (:data:`~pyro2pfp.planning.registry.COMPACT_REFERENCES`, or the generic Stein rule
    of an activation) through :func:`~.loadings.compact_layer`, which every back end shares.  ``keep``:
    names whose :class:`Loadings` are written into it (diagnostics, tests)."""
    cp = compact_plan(graph, plan)
    values = {INPUT: Activation(np.asarray(x, dtype=np.float64), None, Repr.DETERMINISTIC)}
    loads: dict[str, Loadings | None] = {INPUT: None}
    for layer in graph.layers:
        ins = [values[n] for n in layer.inputs]
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            out = REFERENCES[layer.op](layer, ins)
            ld, mean, var = compact_layer(NUMPY_BACKEND, COMPACT_REFERENCES, layer, ins,
                                          [loads[n] for n in layer.inputs], cp, out.mean, out.variance())
        values[layer.name] = emit_output(mean, var, layer) if layer.out_repr is not Repr.DETERMINISTIC \
            else Activation(mean, None, Repr.DETERMINISTIC)
        loads[layer.name] = ld
        if keep is not None and layer.name in keep:
            keep[layer.name] = ld
    return values


def compact_plan(graph: PlannedGraph, plan: CompactPlan | None = None) -> CompactPlan:
    """``plan`` (default ``graph.factors``: a :class:`CompactPlan`, else a :class:`PFPError`) with the per-sample
    shape of every edge filled in (``shapes``: the rules reshape the back ends' tensors by it)."""
    cp = graph.factors if plan is None else plan
    if not isinstance(cp, CompactPlan):
        raise PFPError(f"this plan has no compact factor plan (correlation={graph.correlation!r})")
    return cp if cp.shapes else dataclasses.replace(cp, shapes=edge_shapes(graph))


def edge_shapes(graph: PlannedGraph) -> dict[str, tuple[int, ...]]:
    """The per-sample shape of every edge of ``graph`` (its input and every layer's output)."""
    return {INPUT: tuple(graph.input_shape), **{p.name: tuple(p.layer.out_shape) for p in graph.layers}}


def weight_moments(layer: PlannedLayer) -> tuple[np.ndarray, np.ndarray]:
    """A compute layer's weight mean and variance (either plan form)."""
    assert is_compute_layer(layer.op)
    return layer.tensors["weight_mean"], weight_var(layer.tensors)


def bias_var(layer: PlannedLayer) -> np.ndarray | None:
    """A compute layer's bias variance, None if it has none."""
    return layer.tensors.get("bias_var")


SCHEME_EXECUTORS[CompactPlan.scheme] = execute_compact_all


def compact_macs(graph: PlannedGraph, plan: CompactPlan | None = None) -> int:
    """The multiply-adds per input the compact factor plan adds to the mean-field plan's (static: follows
    the column counts edge by edge as :func:`execute_compact_all` does).  Per layer: a conv's own directions
    ``R·O·P·C·k²`` (one convolution of the input mean per direction); a global column through a conv
    ``O·P·C·k²``, a block column (one input channel) ``O·P·k²``; through a dense layer ``J·I`` per global
    column and ``J·P`` per block column (its channel's ``P`` elements); the input residual as factors
    ``J·I``; through pools ``k²·E`` per column; through activations, affine maps and ``‖L‖²`` ``E`` per
    column.  The coherent-sum correction ``v += ‖W·L‖² − W²·‖L‖²`` costs no product of the layer's size of
    its own: a kernel evaluates the mean-field term ``W²·v`` on the residual ``r = v − ‖L‖²`` instead of
    ``v`` (the same count) and adds ``‖W·L‖²`` (``J`` per column)."""
    return _column_walk(graph, plan)[0]


def edge_columns(graph: PlannedGraph, plan: CompactPlan | None = None) -> dict[str, tuple[int, int]]:
    """Per edge that carries loadings under the compact factor plan: ``(factors, loadings per element)`` --
    the global columns plus every channel's block columns, and the global columns plus one channel's
    (what an element stores)."""
    _, glob, block = _column_walk(graph, plan)
    out = {}
    for name, g in glob.items():
        c, r = block[name]
        if g or r:
            out[name] = (g + c * r, g + r)
    return out


def _column_walk(graph: PlannedGraph, plan: CompactPlan | None
                 ) -> tuple[int, dict[str, int], dict[str, tuple[int, int]]]:
    """:func:`compact_macs`' count, and the global and block columns (channels, columns per channel) of
    every edge."""
    cp = graph.factors if plan is None else plan
    assert isinstance(cp, CompactPlan)
    glob: dict[str, int] = {}
    block: dict[str, tuple[int, int]] = {}  # edge -> (channels, block columns per channel)
    total = 0
    for layer in graph.layers:
        name, op = layer.name, layer.op
        out_shape = layer.layer.out_shape
        elements = int(np.prod(out_shape))
        gin = sum(glob.get(n, 0) for n in layer.inputs)
        bin_ = block.get(layer.inputs[0], (0, 0)) if layer.inputs else (0, 0)
        g, b = gin, bin_
        macs = OPS[op].compact_spec.macs if op in OPS else None
        if macs is not None:  # a compute layer, a window_cov layer
            more, g, b = macs(layer, cp, gin, bin_)
            total += more
        elif "kernel" in layer.layer.attrs:  # a pooling window
            kernel = layer.layer.attrs["kernel"]
            total += kernel[0] * kernel[1] * elements * (gin + bin_[1])
        else:
            total += elements * (gin + bin_[1])
        if name in cp.terminal:
            g, b = 0, (0, 0)
        glob[name], block[name] = g, b
    return total, glob, block


__all__: list[Any] = ["CompactPlan", "Loadings", "auto_compact", "compact_macs", "execute_compact_all", "plan_compact",
                        "with_compact"]
