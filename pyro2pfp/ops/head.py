"""The uncertainty head: ``softmax_head``, appended to the logits by ``convert(..., head="probs")``.

It turns the logits' mean-field Gaussian ``z ~ N(μ, diag(v))`` (one row of ``K`` logits per input)
into the class probabilities and the uncertainty decomposition, without sampling, inside the same
compiled module (and the NumPy reference and the ONNX export, the same plan).

**The rule: a fixed symmetric sigma-point set** (the unscented transform of Julier & Uhlmann,
"A new extension of the Kalman filter to nonlinear systems", 1997, with ``κ = 0``).  The ``2K + 1``
points are the mean and ``μ ± √(K v_k)·e_k`` for each logit ``k`` (one logit moved at a time: the
logits are independent under PFP's mean-field assumption).  With weights ``1/(2K)`` on the ``2K``
moved points (and ``0`` on the centre) they reproduce the mean and the variances of ``z`` exactly;
the moved points lie at whitened distance ``√K``, the typical distance of a ``K``-dimensional
Gaussian draw from its mean, so they act as ``2K`` deterministic "samples" of the logits.  Every
quantity is computed from the same weighted points -- as :func:`pyro2pfp.uncertainty` computes them
from logit samples::

    p_j      = softmax(z_j)                            j = 0 … 2K  (z_0 = μ)
    probs    = p̄ = p_0 + w Σ_j (p_j − p_0)             w = 1/(2(K + κ)), here 1/(2K)
    H_j      = logsumexp(z_j) − Σ_k p_jk z_jk          (softmax entropy of point j)
    predictive_entropy  = H[p̄] = −Σ_k p̄_k log p̄_k
    expected_entropy    = E[H[softmax(z)]] ≈ H_0 + w Σ_j (H_j − H_0)
    mutual_information  = H[p̄] − E[H]  (computed as (H[p̄] − H[p_0]) − w Σ_j (H_j − H_0), ≥ 0)

The weights are non-negative (``κ ≥ 0``), so ``p̄`` is a probability vector and the mutual
information is ``≥ 0`` by Jensen (concavity of the entropy), exactly as for samples.  At ``v = 0``
every point is ``μ``: ``probs = softmax(μ)`` and the mutual information is exactly 0 (both brackets
are differences of identical terms).  The deviation form ``p_0 + w Σ (p_j − p_0)`` is what makes
that exact in float32.  Cost per input: ``(2K + 1)·K`` exponentials (K = 10: 210), a fixed loop.

Why sigma points rather than the probit/Laplace-bridge formulas for the probabilities: the mutual
information is a small difference of two entropies, and it ranks inputs like logit sampling only
when ``p̄`` and ``E[H]`` come from the *same* approximation of the logit distribution (probit
``softmax(μ_k/√(1 + π v_k/8))`` for ``p̄`` with sigma points for ``E[H]`` lost 0.06 AUROC on the MNIST
MLP).  ``benchmarks/uncertainty_head.py`` prints the probit, Laplace-bridge and sigma-point
probabilities' error against logit sampling, and the AUROCs.

**One logit** (a Bernoulli/sigmoid output, ``K = 1``): the logit ``z`` is treated as the pair
``(0, z)`` of a two-class softmax (``σ(z) = softmax(0, z)₁``); ``probs`` is ``P(y = 1)`` (shape
``(batch, 1)``), the entropies are binary entropies.

Representation: the head takes the logits' (mean, **variance**) and gives ``probs`` (batch, K) as
its "mean" and ``(predictive_entropy, expected_entropy, mutual_information)`` (batch, 3) as its
second component (the planner's variance slot; every predictor unpacks it into a
:class:`HeadOutput`).  The TVM kernel is in ``tvm_backend/ops/head.py``.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from ..errors import ArgumentError
from ..graph import Layer, LayerGraph, Repr
from ..onnx_export import OnnxActivation, Sym, exporter
from ..plan import PlannedLayer
from ..reference import Activation, reference
from ..registry import Contract, OpDef, register_op

HEAD_OP = "softmax_head"
HEADS = ("probs",)
"""The values of ``convert(..., head=...)`` (``None``: the network outputs the logits' (mean, var))."""
STATS = ("predictive_entropy", "expected_entropy", "mutual_information")
"""The columns of the head's second output, in order."""
OUTPUT_NAMES = ("probs", "uncertainty")
"""The names of the module's two outputs with the head (ONNX output names, the library sidecar)."""
VAR_CLAMP = 1e30
"""Logit variances are clamped here (σ = 1e15: effectively infinite against any logit) so that
``√(K v)`` stays finite in float32."""

SOFTMAX_HEAD = register_op(OpDef(
    HEAD_OP, modules="(appended by `convert(..., head=\"probs\")`: class probabilities and uncertainty)",
    moments="sigma points (unscented, κ = 0)",
    assumptions="independent logits (mean field); a fixed 2K-point quadrature of E[softmax] and E[entropy]",
    contract=Contract(Repr.VARIANCE, Repr.VARIANCE, keeps_deterministic=False), internal=True))


class HeadOutput(NamedTuple):
    """The outputs of a network converted with ``head="probs"`` (float32 from a compiled predictor,
    float64 from ``net.reference``): ``probs`` (batch, K) -- ``P(y = 1)`` (batch, 1) for one logit --
    and per input the predictive (total) entropy ``H[p̄]``, the expected softmax entropy ``E[H]``
    (aleatoric) and the mutual information ``H[p̄] − E[H]`` (epistemic), in nats, each (batch,)."""

    probs: np.ndarray
    predictive_entropy: np.ndarray
    expected_entropy: np.ndarray
    mutual_information: np.ndarray

    def as_dict(self) -> dict[str, np.ndarray]:
        """The same quantities under the keys of :func:`pyro2pfp.uncertainty`: ``probs``,
        ``total``, ``aleatoric``, ``epistemic``."""
        return {"probs": self.probs, "total": self.predictive_entropy, "aleatoric": self.expected_entropy,
                "epistemic": self.mutual_information}


def head_output(probs: Any, stats: Any) -> HeadOutput:
    """Unpack the module's two outputs ``(probs, stats)`` (stats: (batch, 3), columns :data:`STATS`)."""
    return HeadOutput(probs, stats[:, 0], stats[:, 1], stats[:, 2])


def check_head(head: Any) -> str | None:
    """``head`` validated: None or one of :data:`HEADS`."""
    if head is None or head in HEADS:
        return head
    raise ArgumentError(f"head must be None (the logits' mean and variance) or one of {HEADS}, got {head!r}")


def append_head(graph: LayerGraph, head: str, *, kappa: float = 0.0) -> LayerGraph:
    """A copy of ``graph`` with the ``softmax_head`` layer after its output (the logits).

    The output must be one row of logits per input, ``(K,)``; ``kappa ≥ 0`` is the sigma-point
    parameter (``w = 1/(2(K + κ))``, points at ``√((K + κ) v)``; ``κ = 0`` by default)."""
    check_head(head)
    shape = graph.shape_of(graph.output)
    if len(shape) != 1:
        raise ArgumentError(f"head={head!r} needs a network whose output is a vector of logits (batch, classes); "
                            f"the output of layer '{graph.output}' has shape (batch, {', '.join(map(str, shape))})")
    if not (isinstance(kappa, int | float) and math.isfinite(kappa) and kappa >= 0):
        raise ArgumentError(f"the sigma-point parameter kappa must be a finite number >= 0, got {kappa!r}")
    layer = Layer(name="head", op=HEAD_OP, inputs=[graph.output], out_shape=shape,
                  source=f"convert(head={head!r}) on the logits of '{graph.output}'",
                  attrs={"kappa": float(kappa), "second_shape": (len(STATS),), "output_names": OUTPUT_NAMES})
    names = {existing.name for existing in graph.layers}
    while layer.name in names:
        layer.name += "_"
    return LayerGraph(graph.input_shape, [*graph.layers, layer], layer.name, input_variance=graph.input_variance,
                      origins=dict(graph.origins))


def is_head(layer: PlannedLayer | Layer | None) -> bool:
    """Whether ``layer`` is the uncertainty head."""
    return layer is not None and getattr(layer, "op", None) == HEAD_OP


def sigma_offsets(k: int) -> np.ndarray:
    """The ``(2K + 1, K)`` unit offsets of the sigma points: row 0 the centre, rows ``1 … K`` ``+e_k``,
    rows ``K + 1 … 2K`` ``−e_k``."""
    eye = np.eye(k)
    return np.concatenate([np.zeros((1, k)), eye, -eye])


def point_weight(k: int, kappa: float) -> float:
    """``w = 1/(2(K + κ))``, the weight of each moved sigma point."""
    return 1.0 / (2.0 * (k + kappa))


def head_numpy(mean: np.ndarray, var: np.ndarray, kappa: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
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
    w = point_weight(k, kappa)
    radius = math.sqrt(k + kappa) * np.sqrt(var)  # (B, K)
    z = mean[:, None, :] + radius[:, None, :] * sigma_offsets(k)[None]  # (B, 2K+1, K)
    shift = z.max(-1, keepdims=True)
    e = np.exp(z - shift)
    s = e.sum(-1)
    p = e / s[..., None]
    h = np.log(s) - (e * (z - shift)).sum(-1) / s  # (B, 2K+1) softmax entropies
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
    probs, stats = head_numpy(x.mean, x.variance(), layer.layer.attrs.get("kappa", 0.0))
    return Activation(probs, stats, Repr.VARIANCE)


# ------------------------------------------------------------------------------------ ONNX
@exporter(HEAD_OP)
def softmax_head_onnx(ctx: Any, layer: PlannedLayer, inputs: list[OnnxActivation]) -> OnnxActivation:
    """The same rule in standard ONNX operators (Softmax/LogSoftmax over the sigma points' logits,
    ReduceSum, Log, Max, Concat)."""
    b = ctx.b
    x = inputs[0]
    kappa = float(layer.layer.attrs.get("kappa", 0.0))
    mean = x.mean
    var = ctx.variance(x)
    var = mean * Sym(b, value=0.0) if var is None else ctx.ops.minimum(var, VAR_CLAMP)
    k = int(layer.layer.out_shape[0])
    binary = k == 1
    if binary:
        zero = mean * Sym(b, value=0.0)
        mean = zero.nary("Concat", mean, axis=1)
        var = zero.nary("Concat", var, axis=1)
        k = 2
    w = point_weight(k, kappa)

    def axes(*values: int) -> str:
        return b.ints(list(values), "axes")

    def sum_over(t: Sym, axis: int) -> Sym:
        return t.nary("ReduceSum", axes(axis), keepdims=0)

    def unsqueeze(t: Sym, axis: int) -> Sym:
        return t.nary("Unsqueeze", axes(axis))

    radius = var.unary("Sqrt") * Sym(b, value=math.sqrt(k + kappa))
    offsets = Sym(b, b.initializer(sigma_offsets(k), "sigma_offsets"))
    z = unsqueeze(mean, 1) + unsqueeze(radius, 1) * offsets  # (B, 2K+1, K)
    p = z.nary("Softmax", axis=-1)
    logp = z.nary("LogSoftmax", axis=-1)
    h = Sym(b, value=0.0) - sum_over(p * logp, -1)  # (B, 2K+1)

    def first(t: Sym) -> Sym:  # [:, 0] of a (B, 2K+1, ...) tensor
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
