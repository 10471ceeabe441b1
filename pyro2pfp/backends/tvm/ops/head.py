"""TE kernel of the uncertainty head ``softmax_head`` (a fixed quadrature over the logits; the rule, its
sources and the NumPy reference / ONNX export: ``pyro2pfp/ops/head.py``) and its CPU schedule.

One PrimFunc, a fixed loop over the ``S + 1`` quadrature points ``j`` and the ``K`` logits ``c`` per
input: the points' logits ``z[j, c] = μ_c + √v_c·ε[j, c]`` (``ε`` the constant offset table of the
layer) are never stored; the stages are the per-point max ``m_j``, ``e^{z − m_j}`` (one exponential
per point and logit), the per-point sums ``Σ e^{z−m}`` and ``Σ e^{z−m}(z − m)`` (one tuple
reduction), the points' softmax ``P[j, c]`` (stored once, so the centre row and the moved rows are
computed by the same code: at ``v = 0`` they are bitwise equal and the mutual information is exactly
0), ``p̄``, the points' entropies, and the three statistics.  ``exp`` is ``fast_exp``; the logs are
libm calls (``S + 1`` + ``2K`` per input).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import tvm
from tvm import s_tir, te, tirx

from ....ops.head import HEAD_OP, VAR_CLAMP, point_weight, softmax_head_shared
from ....planning.graph import Repr
from ....planning.plan import PlannedLayer
from ....planning.registry import shared_kernel
from ..emit import EmitContext, RelaxActivation, kernel, pair_sum
from ..fast_math import F32, fast_exp
from ..schedules import schedule


def _c(value: float) -> tirx.PrimExpr:
    return tirx.const(value, F32)


@kernel(HEAD_OP)
def softmax_head(ctx: EmitContext, layer: PlannedLayer, inputs: list[RelaxActivation]) -> RelaxActivation:
    """Logits' (mean, variance) (batch, K) → (probs (batch, K), stats (batch, 3))."""
    x = inputs[0]
    deterministic = x.repr is Repr.DETERMINISTIC
    assert deterministic or x.repr is Repr.VARIANCE, x.repr  # the plan delivers variances
    k_out = int(layer.layer.out_shape[0])
    binary = k_out == 1
    k = 2 if binary else k_out  # one logit z: the pair (0, z)
    offsets = layer.layer.attrs["offsets"]
    points = int(offsets.shape[0])
    w = point_weight(offsets)
    tiny = float(np.finfo(np.float32).tiny)

    def fn(m: te.Tensor, *rest: te.Tensor) -> list[te.Tensor]:
        batch = m.shape[0]
        eps = rest[0]  # (S + 1, K) offsets
        v = rest[1] if len(rest) > 1 else None

        def logit(b: Any, c: Any) -> Any:
            return tirx.Select(c == 0, _c(0.0), m[b, 0]) if binary else m[b, c]

        def sd_of(b: Any, c: Any) -> Any:
            if v is None:
                return _c(0.0)
            sd = te.sqrt(te.min(v[b, 0 if binary else c], _c(VAR_CLAMP)))
            return tirx.Select(c == 0, _c(0.0), sd) if binary else sd

        sd = te.compute((batch, k), sd_of, name="sd")

        def z(b: Any, j: Any, c: Any) -> Any:
            return logit(b, c) + sd[b, c] * eps[j, c]

        rl = te.reduce_axis((0, k), name="rl")
        shift = te.compute((batch, points), lambda b, j: te.max(z(b, j, rl), axis=rl), name="shift")
        # e^{z − c} once per point and logit; the sums and the probabilities read it
        e = te.compute((batch, points, k), lambda b, j, c: fast_exp(z(b, j, c) - shift[b, j]), name="point_exp")
        rl2 = te.reduce_axis((0, k), name="rl2")

        def sums(b: Any, j: Any) -> Any:
            return pair_sum((e[b, j, rl2], e[b, j, rl2] * (z(b, j, rl2) - shift[b, j])), axis=rl2)

        s_t = te.compute((batch, points), sums, name="sums")
        s, t = s_t[0], s_t[1]
        p = te.compute((batch, points, k), lambda b, j, c: e[b, j, c] / s[b, j], name="point_probs")
        h = te.compute((batch, points), lambda b, j: te.log(s[b, j]) - t[b, j] / s[b, j], name="point_entropy")
        # exact copies of the centre's row (a reduction reading both p[b, j, c] and p[b, 0, c] defeats
        # the region analysis of reverse_compute_at)
        p0 = te.compute((batch, k), lambda b, c: p[b, 0, c], name="centre_probs")
        h0 = te.compute((batch,), lambda b: h[b, 0], name="centre_entropy")
        rj = te.reduce_axis((0, points), name="rj")  # the centre (j = 0) adds an exact 0
        dev = te.compute((batch, k), lambda b, c: te.sum(p[b, rj, c] - p0[b, c], axis=rj), name="deviation")
        pbar = te.compute((batch, k), lambda b, c: te.max(p0[b, c] + _c(w) * dev[b, c], _c(0.0)), name="pbar")
        rj2 = te.reduce_axis((0, points), name="rj2")
        d_eh = te.compute((batch,), lambda b: te.sum(h[b, rj2] - h0[b], axis=rj2), name="entropy_deviation")
        rl3 = te.reduce_axis((0, k), name="rl3")

        def plogp(q: Any) -> Any:
            return q * te.log(te.max(q, _c(tiny)))

        neg_h = te.compute((batch,), lambda b: pair_sum((plogp(pbar[b, rl3]), plogp(p0[b, rl3])), axis=rl3),
                           name="neg_entropies")

        def stat(b: Any, i: Any) -> Any:
            expected = h0[b] + _c(w) * d_eh[b]
            mi = te.max((neg_h[1][b] - neg_h[0][b]) - _c(w) * d_eh[b], _c(0.0))
            return tirx.Select(i == 0, -neg_h[0][b], tirx.Select(i == 1, expected, mi))

        stats = te.compute((batch, 3), stat, name="stats")
        probs = te.compute((batch, 1), lambda b, _i: pbar[b, 1], name="probs") if binary else pbar
        return [probs, stats]

    table = ctx.const(offsets)
    args = [x.mean, table] if deterministic or x.second is None else [x.mean, table, x.second]
    outs = ctx.emit_te(fn, args, layer)
    return RelaxActivation(outs[0], outs[1], Repr.VARIANCE)


@schedule(HEAD_OP)
def schedule_head(sch: s_tir.Schedule, layer: PlannedLayer | None, target: tvm.target.Target) -> None:
    """Every stage under one parallel loop over the batch: the first stage's batch loop is made
    parallel and each later stage is moved under it (``reverse_compute_at``), so one input's
    intermediates (a few hundred floats) live in a thread-private tile and batch 1 starts one
    parallel region, not ten."""
    blocks = list(sch.get_child_blocks(sch.get_sblock("root")))
    outer = sch.get_loops(blocks[0])[0]
    for block in blocks[1:]:
        sch.reverse_compute_at(block, outer)
    sch.parallel(outer)


# the shared-factor rule: the head's shared part is dropped (the same rule in every back end)
shared_kernel(HEAD_OP)(softmax_head_shared)
