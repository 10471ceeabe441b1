"""Shared-factor PFP: correlation-aware moments for nets that sum positions or branches.

Mean-field PFP treats every activation element as independent.  A conv weight is shared by all
positions of its channel and a residual add sums two functions of the same input, so global
average pooling and residual blocks lose most of the output variance under mean-field (ResNet-20:
PFP/MC logit variance ratio 0.17).  Shared-factor PFP carries beside each edge's mean-field
``(μ, v)`` per-channel factor loadings ``g`` (B, C, K) and signed profiles ``s`` (B, C, P) and
uses them where positions and branches are summed; still one forward pass, no sampling.

* :mod:`.factors`: the factor plan (plain data in the plan: ``PlannedGraph.factors``, set by
  :func:`with_correlation`) and the choice ``convert(..., correlation="auto" | "shared-factor" |
  "mean-field")``;
* :mod:`.shared`: the representation (NumPy float64) and its compaction;
* the per-op rules live with their ops (``ops/<family>.py``: float64 and ONNX,
  ``tvm_backend/ops/<family>.py``: TE kernels), in the tables ``registry.SHARED_REFERENCES``,
  ``SHARED_EXPORTERS`` and ``SHARED_KERNELS``; an op with an ``ActivationRule`` gets the generic
  one (Stein's lemma, :mod:`.stein`);
* :mod:`.execute`: the executor (registered in ``reference.SCHEME_EXECUTORS``: what
  ``net.reference`` and ``reference.execute_all`` run for a plan with factors);
* :mod:`.backend`: the per-layer dispatch of the float32 back ends, :mod:`.onnx_step` the ONNX one
  (registered in ``onnx_builder.SCHEME_STEPS``); the TVM one is ``pyro2pfp/tvm_backend/shared_factor.py``;
* :mod:`.cost`: the cost model.

Cost (per input; :func:`~pyro2pfp.correlation.cost.cost_model`, ``benchmarks/fidelity.py --cost``)
----------------------------------------------------------------------------------------------------
Per conv layer: one convolution with ``2C`` input channels and per-input weights for the profile (``[s_in,
μ_in]``, weights ``[W·⟨g_in[c], g[o]⟩ + coef·V·m̄s_k, coef·V·m̄μ_k]``: the propagated profile and the weight-
noise regression profile, whose ``s_in`` terms share one weight) and ``O·C·(K_in + K_out)`` for the loadings
(mean-field: 3 convolutions; deterministic: 1); memory ``+ C·P + C·K`` floats per edge.  The figures per
net (multiply-adds against mean-field and the deterministic net, with and without compaction):
``benchmarks/fidelity.py --cost`` and ``benchmarks/latency.py``.

Back ends
---------
* NumPy float64 (:mod:`.execute`, ``net.reference``): the rules with QR compaction of ``g`` where a
  layer's output is the only live edge and ``K ≥ 4·C`` (exact; bounds ``K`` by ~5·C).
* TVM (``tvm_backend/shared_factor.py``) and ONNX (:mod:`.onnx_step`), both through the dispatch
  of :mod:`.backend`: the same rules in float32 with a static ``K`` per edge.  TVM compacts where the
  reference does, by the Cholesky factor of ``g·gᵀ`` (exact; ResNet-20 ``K ≤ 320``); ONNX has no
  Cholesky operator and skips compaction (exact, ``K`` grows with depth: ResNet-20 up to 1482, ×2.5
  multiply-adds instead of ×2.2).  TVM: per conv
  layer the pooled views ``m̄μ_k, m̄s_k`` (a reduction over the output positions of each kernel
  offset), the loadings (``A = W·m̄s``, ``ℓ = A·g_in ⊕ w̄``), ``β = g_in·gᵀ`` and one reduction
  over ``(c, kh, kw)`` for the propagated and the regression profile; ONNX: the kernel taps as
  strided Slices and Einsums with per-input weights (``W·β``), no grouped Conv (its group count
  cannot follow a dynamic batch).

Measured
--------
``PYTHONPATH=. python benchmarks/fidelity.py --cost`` (300 MC samples over the guide, 32 inputs),
median (p10–p90) of the PFP/MC logit-variance ratio, mean-field → shared factors: MLP 0.992
(0.89–1.11) → the same (the scheme reduces to mean-field); LeNet-5 0.991 (0.87–1.14) → 1.014
(0.89–1.11); ResNet-8 0.283 (0.20–0.39) → 0.968 (0.85–1.03); ResNet-20 0.171 (0.12–0.23) → 0.953
(0.81–1.19); mean error 0.04–0.06 MC sd, argmax agreement 100 % on both ResNets.  Against a
1000/2000-sample plan-based Monte Carlo on 8 inputs (less MC noise): ResNet-20 0.97 (0.83–1.04),
ResNet-8 1.00 (0.93–1.03), LeNet-5 1.01 (0.97–1.05).  The previous rank-1 prototype (positive
rescaled profiles, channels independent) gave ResNet-20 0.92 (0.63–1.12) on the same truth.

Not modelled (measured with single-layer-noise Monte Carlo and a statistically linearised reverse
pass): the part of early layers' noise that reaches the pooled output through spatially rough
sensitivity paths (the backward field of the pooled logits at stage 1 has only ~8 % of its energy in
the per-channel uniform profile): stage-1 layers' noise is captured at ~0.4–0.55 of its MC
variance, stage-3 at ~0.9; most of the remaining deficit is one direction, the pooled features'
mean direction (a global scale mode of the homogeneous ReLU/BN-without-shift network), and
interactions between layers' noises (the MC variance with all layers noisy is ~1.5× the sum of the
single-layer variances in ResNet-20) are only partly covered.
"""
from . import onnx_step as onnx_step  # registers the ONNX step of the scheme
from .cost import Cost, cost_model
from .execute import execute_shared, execute_shared_all
from .factors import (
    CORRELATIONS,
    CorrelationError,
    FactorPlan,
    choose,
    needs_shared_factors,
    plan_factors,
    with_correlation,
)
from .shared import Shared

__all__ = ["CORRELATIONS", "Cost", "CorrelationError", "FactorPlan", "Shared", "choose", "cost_model",
           "execute_shared", "execute_shared_all", "needs_shared_factors", "plan_factors", "with_correlation"]
