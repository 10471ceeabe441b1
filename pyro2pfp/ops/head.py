"""The uncertainty head: ``softmax_head``, appended to the logits by ``convert(..., head="probs")``.

It turns the logits' mean-field Gaussian ``z ~ N(μ, diag(v))`` (one row of ``K`` logits per input)
into the class probabilities and the uncertainty decomposition, without sampling, inside the same
compiled module (and the NumPy reference and the ONNX export, the same plan).

**The rule: a fixed, moment-matched quadrature of the logits.**  In whitened coordinates
``z = μ + √v ⊙ ε``, ``ε ~ N(0, I_K)``, the head evaluates everything at ``S`` fixed points ``ε_j``
with equal weights, chosen once when the head is appended and stored in the layer (the NumPy
reference, the TVM kernel and the ONNX export use the same points):

* ``n = max(32, 2^⌈log₂ 2K⌉)`` points of a scrambled Sobol' sequence (Owen scrambling,
  ``scipy.stats.qmc.Sobol(K, scramble=True, seed=0)``) mapped through ``Φ⁻¹``: randomised
  quasi-Monte Carlo with the randomisation frozen;
* made antithetic (``±ε``, so ``S = 2n``; K = 10: 64 points) and whitened by the Cholesky factor of
  their second moment, so that their mean is exactly 0 and their covariance exactly ``I``: the
  quadrature reproduces the logits' mean and variance exactly, as the sigma points of the unscented
  transform do (moment matching: Glasserman, *Monte Carlo Methods in Financial Engineering*, 2003,
  sec. 4.5); every point moves every logit by about one standard deviation, as a logit sample does.

Why not the 2K axis-aligned sigma points of the unscented transform, ``ε = ±√K·e_k`` (Julier &
Uhlmann 1997, κ = 0): each moves one logit by ``√K`` standard deviations, far from where logit samples
lie, which makes the probabilities' tail errors larger and moves the OOD ranking by the mutual
information; and random rotations of them (Genz & Monahan's stochastic spherical-radial rules, 1998)
depend on the seed more than these points do (``benchmarks/uncertainty_head.py`` compares them).  So
the head is ``S`` deterministic, moment-matched "samples" of the logits, and every
quantity is computed from them as :func:`pyro2pfp.uncertainty` computes it from logit samples::

    z_j      = μ + √v ⊙ ε_j,  p_j = softmax(z_j)       j = 0 … S  (ε_0 = 0: the centre, weight 0)
    probs    = p̄ = p_0 + w Σ_j (p_j − p_0)             w = 1/S
    H_j      = logsumexp(z_j) − Σ_k p_jk z_jk          (softmax entropy of point j)
    predictive_entropy  = H[p̄] = −Σ_k p̄_k log p̄_k
    expected_entropy    = E[H[softmax(z)]] ≈ H_0 + w Σ_j (H_j − H_0)
    mutual_information  = H[p̄] − E[H]  (computed as (H[p̄] − H[p_0]) − w Σ_j (H_j − H_0), ≥ 0)

The weights are positive, so ``p̄`` is a probability vector and the mutual information is ``≥ 0`` by
Jensen (concavity of the entropy), exactly as for samples.  At ``v = 0`` every point is ``μ``:
``probs = softmax(μ)`` and the mutual information is exactly 0 (both brackets are differences of
identical terms; the deviation form ``p_0 + w Σ (p_j − p_0)`` makes that exact in float32 too).  Cost
per input: ``(S + 1)·K`` exponentials (K = 10: 650), a fixed loop over a constant ``(S + 1, K)``
offset table.  The points depend on scipy's Sobol' generator only when the head is appended.

Why not the probit or Laplace-bridge formula for the probabilities: the mutual information is a
small difference of two entropies, and it ranks inputs like logit sampling only when ``p̄`` and
``E[H]`` come from the *same* approximation of the logit distribution (probit ``softmax(μ_k/√(1 +
π v_k/8))`` for ``p̄`` beside a quadrature for ``E[H]`` mixes two approximations, and their errors
do not cancel in the difference); and the quadrature's ``p̄`` is also closer to sampling than either
(``benchmarks/uncertainty_head.py`` prints all three; ``docs/uncertainty.md`` holds its table).

**One logit** (a Bernoulli/sigmoid output, ``K = 1``): the logit ``z`` is treated as the pair
``(0, z)`` of a two-class softmax (``σ(z) = softmax(0, z)₁``); ``probs`` is ``P(y = 1)`` (shape
``(batch, 1)``), the entropies are binary entropies.

Representation: the head takes the logits' (mean, **variance**) and gives ``probs`` (batch, K) as
its "mean" and ``(predictive_entropy, expected_entropy, mutual_information)`` (batch, 3) as its
second component (the planner's variance slot; every predictor unpacks it into a
:class:`HeadOutput`).  The TVM kernel is in ``backends/tvm/ops/head.py``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backends.onnx.builder import OnnxActivation, Sym, exporter
from ..backends.reference import Activation, reference
from ..errors import ArgumentError
from ..options import Head, checked, checked_or_none, values
from ..planning.graph import Layer, LayerGraph, Repr
from ..planning.plan import PlannedLayer
from ..planning.registry import Contract, FactorSpec, OpDef, register_op, shared_exporter, shared_reference
from ..runtime.outputs import OUTPUT_NAMES, STATS
from ..runtime.outputs import HeadOutput as HeadOutput  # the head's outputs, defined beside the predictor (NumPy only)
from ..runtime.outputs import head_output as head_output

HEAD_OP = "softmax_head"
HEADS = values(Head)
"""The values of ``convert(..., head=...)`` (``None``: the network outputs the logits' (mean, var))."""
VAR_CLAMP = 1e30
"""Logit variances are clamped here (σ = 1e15: effectively infinite against any logit) so that
``√(K v)`` stays finite in float32."""

SOFTMAX_HEAD = register_op(OpDef(
    HEAD_OP, modules="(appended by `convert(..., head=\"probs\")`: class probabilities and uncertainty)",
    moments="fixed quadrature: 2n antithetic Sobol' points, n = max(32, 2^⌈log₂ 2K⌉), moment-matched",
    assumptions="independent logits (mean field); a fixed quadrature of E[softmax] and E[entropy]",
    contract=Contract(Repr.VARIANCE, Repr.VARIANCE, keeps_deterministic=False), internal=True,
    factor_spec=FactorSpec(terminal=True)))


# ------------------------------------------------------------------------------------ shared-factor rule
@shared_reference(HEAD_OP)
@shared_exporter(HEAD_OP)
def softmax_head_shared(*args: Any) -> tuple[None, Any]:
    """The head's shared-factor rule, in every back end (``rule(layer, inputs, shared, fp, var)``,
    ``rule(step, ctx, layer, inputs, shared, out)``): the head is the network's output and reads only
    its input's ``(μ, v)`` -- which the rules before it have already corrected where positions or
    branches were summed --, so its shared part is dropped (exact: nothing after it sums anything);
    the output unchanged."""
    return None, args[-1]


def check_head(head: Any) -> str | None:
    """``head`` validated, as a plain string: None or one of :data:`HEADS` (a :class:`~pyro2pfp.options.Head`
    member or its string)."""
    return checked_or_none(Head, head, "the logits' mean and variance")


SEED = 0
"""The seed of the Sobol' scrambling (the points are drawn once, when the head is appended)."""


def append_head(graph: LayerGraph, head: Head | str, *, points: int | None = None, seed: int = SEED) -> LayerGraph:
    """A copy of ``graph`` with the ``softmax_head`` layer after its output (the logits).

    The output must be one row of logits per input, ``(K,)``.  The layer's ``offsets`` attribute holds
    the quadrature points (:func:`sigma_offsets` of ``points`` and ``seed``): ``S + 1`` rows of ``K``,
    ``S = 2·max(32, 2^⌈log₂ 2K⌉)``, so the cost per input grows as ``4K²`` exponentials beyond
    K = 16 (K = 1000: 4·10⁶ -- meant for tens of classes, not thousands)."""
    head = checked(Head, head)
    shape = graph.shape_of(graph.output)
    if len(shape) != 1:
        raise ArgumentError(f"head={head!r} needs a network whose output is a vector of logits (batch, classes); "
                            f"the output of layer '{graph.output}' has shape (batch, {', '.join(map(str, shape))})")
    k = 2 if shape[0] == 1 else shape[0]
    if points is not None and (isinstance(points, bool) or not isinstance(points, int) or points < k
                               or points & (points - 1)):
        raise ArgumentError(f"the number of Sobol' points must be a power of two >= the {k} logits, got {points!r}")
    offsets = sigma_offsets(k, points, seed)
    layer = Layer(name="head", op=HEAD_OP, inputs=[graph.output], out_shape=shape,
                  source=f"convert(head={head!r}) on the logits of '{graph.output}'",
                  attrs={"points": len(offsets) - 1, "seed": seed, "offsets": offsets,
                         "second_shape": (len(STATS),), "output_names": OUTPUT_NAMES})
    names = {existing.name for existing in graph.layers}
    while layer.name in names:
        layer.name += "_"
    return LayerGraph(graph.input_shape, [*graph.layers, layer], layer.name, input_variance=graph.input_variance,
                      origins=dict(graph.origins), guide_factors=graph.guide_factors)


def is_head(layer: PlannedLayer | Layer | None) -> bool:
    """Whether ``layer`` is the uncertainty head."""
    return layer is not None and getattr(layer, "op", None) == HEAD_OP


def default_points(k: int) -> int:
    """``n = max(32, 2^⌈log₂ 2K⌉)`` Sobol' points for ``K`` logits (``2n`` with their antipodes)."""
    return max(32, 1 << (2 * k - 1).bit_length())


def sigma_offsets(k: int, points: int | None = None, seed: int = SEED) -> np.ndarray:
    """The whitened quadrature points ``ε_j``, ``(2n + 1, K)``: row 0 the centre (zeros), then ``n``
    scrambled Sobol' points mapped through ``Φ⁻¹`` and their antipodes, whitened so that their mean
    is 0 and their covariance (weights ``1/(2n)``) is exactly ``I``."""
    from scipy.stats import norm, qmc

    n = default_points(k) if points is None else points
    eps = norm.ppf(qmc.Sobol(k, scramble=True, seed=seed).random(n))
    eps = np.concatenate([eps, -eps])
    chol = np.linalg.cholesky(eps.T @ eps / len(eps))
    eps = np.linalg.solve(chol, eps.T).T  # covariance exactly I
    return np.concatenate([np.zeros((1, k)), eps])


def point_weight(offsets: np.ndarray) -> float:
    """``w = 1/S``, the weight of each quadrature point (the centre's is 0)."""
    return 1.0 / (offsets.shape[0] - 1)


def head_numpy(mean: np.ndarray, var: np.ndarray, offsets: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """The head in float64 NumPy: logits' ``(mean, var)`` (batch, K) → ``(probs, stats)``.

    ``probs``: (batch, K) (``P(y = 1)``, (batch, 1), when K = 1); ``stats``: (batch, 3) with columns
    :data:`STATS`.  See the module docstring for the rule."""
    mean = np.asarray(mean, dtype=np.float64)
    var = np.minimum(np.asarray(var, dtype=np.float64), VAR_CLAMP)
    binary = mean.shape[1] == 1
    if binary:  # σ(z) = softmax(0, z)₁
        mean = np.concatenate([np.zeros_like(mean), mean], axis=1)
        var = np.concatenate([np.zeros_like(var), var], axis=1)
    k = mean.shape[1]
    offsets = sigma_offsets(k) if offsets is None else offsets
    if offsets.shape[1] != k:
        raise ArgumentError(f"quadrature offsets of shape {offsets.shape} for {k} logits")
    w = point_weight(offsets)
    z = mean[:, None, :] + np.sqrt(var)[:, None, :] * offsets[None]  # (B, S+1, K)
    shift = z.max(-1, keepdims=True)
    e = np.exp(z - shift)
    s = e.sum(-1)
    p = e / s[..., None]
    h = np.log(s) - (e * (z - shift)).sum(-1) / s  # (B, S+1) softmax entropies
    p0, h0 = p[:, 0], h[:, 0]
    pbar = np.maximum(p0 + w * (p - p0[:, None]).sum(1), 0.0)
    d_eh = w * (h - h0[:, None]).sum(1)
    tiny = np.finfo(np.float64).tiny
    hp_bar = -(pbar * np.log(np.maximum(pbar, tiny))).sum(-1)
    hp_0 = -(p0 * np.log(np.maximum(p0, tiny))).sum(-1)
    mi = np.maximum((hp_bar - hp_0) - d_eh, 0.0)
    stats = np.stack([hp_bar, h0 + d_eh, mi], axis=1)
    return (pbar[:, 1:] if binary else pbar), stats


# ------------------------------------------------------------------------------------ reference
@reference(HEAD_OP)
def softmax_head_reference(layer: PlannedLayer, inputs: list[Activation]) -> Activation:
    """:func:`head_numpy` on the logits' (mean, variance); the output's second slot holds the stats."""
    x = inputs[0]
    probs, stats = head_numpy(x.mean, x.variance(), layer.layer.attrs["offsets"])
    return Activation(probs, stats, Repr.VARIANCE)


# ------------------------------------------------------------------------------------ ONNX
@exporter(HEAD_OP)
def softmax_head_onnx(ctx: Any, layer: PlannedLayer, inputs: list[OnnxActivation]) -> OnnxActivation:
    """The same rule in standard ONNX operators (Softmax/LogSoftmax over the quadrature points' logits,
    ReduceSum, Log, Max, Concat)."""
    b = ctx.b
    x = inputs[0]
    offsets = layer.layer.attrs["offsets"]
    mean = x.mean
    var = ctx.variance(x)
    var = mean * Sym(b, value=0.0) if var is None else ctx.ops.minimum(var, VAR_CLAMP)
    k = int(layer.layer.out_shape[0])
    binary = k == 1
    if binary:
        zero = mean * Sym(b, value=0.0)
        mean = zero.nary("Concat", mean, axis=1)
        var = zero.nary("Concat", var, axis=1)
    w = point_weight(offsets)

    def axes(*values: int) -> str:
        return b.ints(list(values), "axes")

    def sum_over(t: Sym, axis: int) -> Sym:
        return t.nary("ReduceSum", axes(axis), keepdims=0)

    def unsqueeze(t: Sym, axis: int) -> Sym:
        return t.nary("Unsqueeze", axes(axis))

    table = Sym(b, b.initializer(offsets, "sigma_offsets"))
    z = unsqueeze(mean, 1) + unsqueeze(var.unary("Sqrt"), 1) * table  # (B, S+1, K)
    p = z.nary("Softmax", axis=-1)
    logp = z.nary("LogSoftmax", axis=-1)
    h = Sym(b, value=0.0) - sum_over(p * logp, -1)  # (B, S+1)

    def first(t: Sym) -> Sym:  # [:, 0] of a (B, S+1, ...) tensor
        return t.nary("Gather", b.ints([0], "index"), axis=1).nary("Squeeze", axes(1))

    p0, h0 = first(p), first(h)
    pbar = ctx.ops.maximum(p0 + sum_over(p - unsqueeze(p0, 1), 1) * Sym(b, value=w), 0.0)
    d_eh = sum_over(h - unsqueeze(h0, 1), 1) * Sym(b, value=w)
    tiny = float(np.finfo(np.float32).tiny)

    def entropy(q: Sym) -> Sym:
        return Sym(b, value=0.0) - sum_over(q * ctx.ops.maximum(q, tiny).unary("Log"), -1)

    hp_bar, hp_0 = entropy(pbar), entropy(p0)
    mi = ctx.ops.maximum((hp_bar - hp_0) - d_eh, 0.0)
    stats = unsqueeze(hp_bar, 1).nary("Concat", unsqueeze(h0 + d_eh, 1), unsqueeze(mi, 1), axis=1)
    if binary:
        pbar = pbar.nary("Slice", b.ints([1], "starts"), b.ints([2], "ends"), axes(1))
    return OnnxActivation(pbar, stats, Repr.VARIANCE)
