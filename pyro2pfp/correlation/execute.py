"""The float64 executor of shared-factor PFP: the mean-field reference of every layer
(:data:`pyro2pfp.backends.reference.REFERENCES`) plus the layer's shared-factor rule
(:data:`pyro2pfp.planning.registry.SHARED_REFERENCES`, registered in the op's family file), which also
corrects the variance where positions or branches are summed (average pooling, dense, residual
add).  :func:`pyro2pfp.backends.reference.execute_all` runs it for a plan that carries a
:class:`~pyro2pfp.correlation.factors.FactorPlan`."""
from __future__ import annotations

import numpy as np

from ..backends.reference import NUMPY_BACKEND, REFERENCES, SCHEME_EXECUTORS, Activation, emit_output
from ..errors import PFPError
from ..planning.graph import INPUT, Repr
from ..planning.plan import PlannedGraph
from ..planning.registry import SHARED_REFERENCES
from .factors import FactorPlan, is_noisy, shared_plan
from .guide import mean_shift
from .shared import Shared, compacted


def execute_shared_all(graph: PlannedGraph, x: np.ndarray, factors: FactorPlan | None = None, *,
                       keep: dict[str, Shared | None] | None = None) -> dict[str, Activation]:
    """Run ``graph`` in float64 with shared factors; every layer's activation by name (in the
    plan's representation; ``(μ, v)`` are the mean-field ones except where a rule corrects ``v``).

    ``factors``: the factor plan (default ``graph.factors``); deterministic network input only.
    ``keep``: names whose :class:`~pyro2pfp.correlation.shared.Shared` part is written into it (for
    diagnostics and tests)."""
    fp = shared_plan(graph, factors)
    if graph.input_repr is not Repr.DETERMINISTIC:
        raise PFPError("shared-factor PFP: networks with an input variance are not supported")
    values = {INPUT: Activation(np.asarray(x, dtype=np.float64), None, Repr.DETERMINISTIC)}
    shared: dict[str, Shared | None] = {INPUT: None}
    remaining: dict[str, int] = {}
    for layer in graph.layers:
        for n in layer.inputs:
            remaining[n] = remaining.get(n, 0) + 1
    for layer in graph.layers:
        ins = [values[n] for n in layer.inputs]
        shs = [shared[n] for n in layer.inputs]
        op = layer.op
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            out = REFERENCES[op](layer, ins)
            mean = out.mean
            var: np.ndarray | None = out.variance()
            sh: Shared | None = None
            if any(s is not None for s in shs) or is_noisy(layer):  # else nothing shared in or created
                rule = SHARED_REFERENCES.get(op)
                if rule is None:  # plan_factors rejects such plans
                    raise PFPError(f"{layer.layer.source}: op '{op}' has no shared-factor rule")
                sh, var = rule(layer, ins, shs, fp, var)
                if isinstance(var, Activation):  # a FactorSpec.covariance op: its whole (deterministic) output
                    out, var = var, None
                    mean = out.mean
                else:
                    shift = mean_shift(NUMPY_BACKEND, layer, shs[0], fp) if fp.guide else None
                    if shift is not None:  # a correlated guide's weight noise times its input's (guide.py)
                        mean = mean + shift
            if sh is not None:
                assert var is not None  # an op with shared factors out has a variance
                sd = np.sqrt(np.maximum(var, 0.0)).reshape(sh.s.shape)
                sh = Shared(np.clip(sh.s, -sd, sd), sh.g)
                if layer.name in fp.compact_at:
                    sh = compacted(sh)
        values[layer.name] = out if var is None else emit_output(mean, var, layer)
        shared[layer.name] = sh
        if keep is not None and layer.name in keep:
            keep[layer.name] = sh
        for n in layer.inputs:
            remaining[n] -= 1
            if remaining[n] == 0:
                shared[n] = None
    return values


def execute_shared(graph: PlannedGraph, x: np.ndarray, factors: FactorPlan | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Output ``(mean, variance)`` of :func:`execute_shared_all`."""
    out = execute_shared_all(graph, x, factors)[graph.output]
    return out.mean, out.variance()


SCHEME_EXECUTORS["shared-factor"] = execute_shared_all
