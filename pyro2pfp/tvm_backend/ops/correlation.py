"""TE kernels of shared-factor PFP (:mod:`pyro2pfp.correlation`) and their default CPU schedule.

A plan with factors (``graph.factors``) is emitted as the mean-field kernels of every layer plus,
after each, the kernels of its shared-factor rule (:class:`SharedStep`, called by
``_core.emit_module``), which carry the profile ``s`` (B, *edge shape) and the loadings ``g``
(B, rows, K) beside ``(μ, v)`` and replace ``v`` where the rule corrects it (dense, add, average
pooling) -- except a ReLU with a shared input, whose one kernel ``sf_relu`` computes its mean-field
outputs too (``SharedStep.emits_mean_field``: the emitter emits no ``relu`` kernel for it).  The
rules and their sources are those of :mod:`pyro2pfp.correlation.rules`; here they
are float32 TE expressions of the same formulas:

* every loading ``ℓ`` is normalised (``‖ℓ‖`` and ``g = ℓ/‖ℓ‖``, 0 where ``ℓ = 0``:
  :func:`_normalised`) inside the kernel that computes it, and every profile is clipped to ``±sd`` of
  its edge, as in the reference executor;
* conv2d: ``sf_conv_load`` -- the pooled views ``m̄μ_k``, ``m̄s_k`` (separable, no padded copy),
  ``w̄``, ``ℓ = A·g_in ⊕ w̄`` (``A = W·m̄s``) normalised to ``g``, ``β = ⟨g_in[c], g[o]⟩`` and the
  injection's ``coef = g[o, offset + o]/w̄`` --;
  ``sf_conv_weights`` (per-input weights ``W·β + coef·V·m̄s`` and ``coef·V·m̄μ``; it does not read
  ``g``, so it does not depend on ``K``: layers that differ only in ``K`` share it) and
  ``sf_conv_profile``: the propagated and the regression profile as one convolution of ``[s_in, μ]``
  with those weights, laid out like the mean-field conv kernel and scheduled by its schedule
  (``compute.schedule_conv2d``: register tiles, vectorised).  ``β`` is emitted as ``βᵀ`` (B, C, O),
  unit-stride in ``o`` like the weights kernel reads it.
  Layers of :func:`~.winograd.winograd_shape` (3x3, stride 1, ≥ 16 channels: the ResNet block convs)
  use Winograd F(2x2, 3x3) instead, as the mean-field conv does: ``sf_conv_weights`` emits the
  weights' transforms ``G·A·Gᵀ``, ``G·M·Gᵀ`` (B, 4, 4, C, O) -- per input, at run time
  (:func:`~.winograd.weight_transform`) -- and ``sf_conv_profile`` is :func:`winograd_profile`
  (input transforms of ``s_in`` and ``μ``, one batched GEMM per input and transform position summing
  both terms, output transform, ``+ shift``, clip; scheduled by :func:`~.winograd.schedule_winograd`).
  Measured (``benchmarks/kernel_profile.py --net resnet20 --batch 10 --threads 1 --static --kernels``,
  AVX-512, best of 3-4 runs): the ``sf_conv_profile`` rows 13.5 -> 5.8 ms (per call: 16->16 32x32
  0.89 -> 0.39 ms, 32->32 16x16 0.77 -> 0.26, 64->64 8x8 0.66 -> 0.23), ``sf_conv_weights`` (now
  with the transforms, reading every operand unit-stride in ``o``) 1.4 -> 1.3 ms, the whole exe(x)
  37.1 -> 30.9 ms; at ``--batch 1`` 1.36 -> 0.54, 0.15 -> 0.12 and 4.1 -> 3.0 ms.  Compile time
  (``benchmarks/compile_time.py --repeats 1``) ResNet-20 14.7 -> 15.7 CPU s.  Off under
  :func:`~.winograd.direct_convolutions`;
* relu/leaky_relu: ``sf_relu`` -- the layer's mean-field ``(μ, v)`` (the registry rule's expressions,
  :func:`~.activation.activation_moments`, bitwise the mean-field kernel's outputs), Stein's ``lin``,
  the Hermite ``h``, their channel means, the loading, ``g`` and the profile, with ``σ``, ``α``,
  ``Φ(α)`` and ``φ(α)`` bound once per element for the moments and Stein's terms
  (:func:`~pyro2pfp.moments.gaussian_terms` under ``te_shared(reuse=True)``: one ``erf`` and one
  ``exp`` in the let chain; each output's block carries its own copy of that identical chain).  It
  replaced the mean-field ``relu`` kernel followed by ``sf_relu``, which recomputed ``σ``, ``α``,
  ``Φ`` and ``φ`` and read the ``relu`` kernel's variance.  ``kernel_profile.py --net resnet20
  --batch {10,1} --static --threads 1``, three runs each, alternated on a loaded 2-core machine:
  batch 10 relu + sf_relu 3.68, 9.87 (a disturbed run), 3.61 ms -> sf_relu 2.52, 2.44, 2.52 ms, the
  call 25.1, 48.6, 25.7 -> 25.0, 23.6, 24.2 ms; batch 1 0.65, 0.36, 0.35 -> 0.23, 0.25, 0.25 ms, the
  call 2.95, 3.20, 2.88 -> 2.60, 2.47, 2.86 ms (19 kernel calls fewer, 162 -> 143).  Compile time:
  ``compile_time.py --repeats 1`` ResNet-20 15.8, 14.9 -> 16.5, 15.7 CPU s (two runs each);
  ``compile_time.py --per-op resnet20`` relu + sf_relu 0.11 + 0.61 -> sf_relu 0.79 CPU s of LLVM;
* affine/scale: ``sf_scale``; add: ``sf_add`` (the branch covariance, the loading, ``g``, the
  corrected variance and the profile); average pooling: ``sf_avgpool``; max
  pooling: ``sf_maxpool`` (Clark's fold with the profile's linear response, a sequential TE
  reduction); dense: ``sf_dense_load`` (the loading, ``g``, the corrected variance and the clipped
  profile); reshape/convert: views.  The elementwise rules (relu, add, scale) index the
  ``(B, C, H, W)`` edges directly (rows = channels), so no reshape is emitted around them.

One kernel per rule (three per conv layer, two of them the weights and the profile convolution; a
ReLU's rule and its mean-field moments are one kernel): ResNet-20 (static batch) calls 143 kernels
per input (162 with a separate mean-field ReLU kernel, 299 before the rules' kernels were fused; and
146 ``call_tir`` instead of 165 and 445 with the reshapes).  With the Winograd profile convolution,
one run each of ``kernel_profile.py --net resnet20 --batch {10,1} --threads 1 --static --kernels``
against the previous kernels: batch
10 30.6 → 25.2 ms per call, batch 1 4.21 → 3.07 ms (``(vm overhead)`` 1.44 → 0.72 ms);
``compile_time.py --repeats 1`` ResNet-20 16.3 → 15.5 CPU s.  Before it was merged, with
``PYTHONPATH=. .venv/bin/python benchmarks/kernel_profile.py --net resnet20 --batch {10,1}
--threads 1 --static --kernels`` (two runs each, alternated with the
previous kernels -- sf_conv_pool/load/beta, sf_norm, sf_relu_terms/load/profile, sf_add_load/profile,
sf_clip -- on a loaded 2-core machine): batch 10 38.6 → 33.0-34.1 ms per call (pooling + loading +
β of the conv rule 5.8-6.0 → 2.0 ms, sf_gram 1.1 → 0.48 ms; the ReLU rule 2.1 → 2.2-2.3 ms, erf-bound and
unchanged within the noise), batch 1 4.30-4.38 → 3.70-3.71 ms (``(vm overhead)`` 0.75-0.78 → 0.63-0.64
ms; conv rule 0.59-0.60 → 0.20 ms, sf_gram 0.105 → 0.046 ms).  Compile time hardly moves:
``benchmarks/compile_time.py`` ResNet-20 15.0 → 14.3 CPU s (117 → 71 distinct PrimFuncs), and
``compile_time.py --per-op resnet20`` (each kernel compiled alone) 8.1 → 7.6 CPU s of LLVM: it
scales with the code compiled, which fusing kernels does not reduce (the gain is ``te_shared`` in
the ReLU's terms, 8 kernels 1.22 → 0.65 s; ``sf_conv_load`` is 13 x ~170 ms).

**Static K, compaction by Cholesky**: every edge carries the factor columns of
:func:`~pyro2pfp.correlation.factors.fixed_k_plan` (``compaction=True``: the reference's compaction
points, ``K`` rounded up to whole SIMD vectors with zero columns).  Where the reference replaces ``g``
by ``Rᵀ`` of its QR factorisation, the kernels compute the Gram matrix ``g·gᵀ`` (``sf_gram``) and its
Cholesky factor ``L`` (``sf_cholesky``, :func:`cholesky_factor`, hand-written TIR in float64) -- the
same ``g·gᵀ``, which is all that is used downstream, so the results are the reference's up to float32
rounding and ``K`` stays bounded (ResNet-20: ≤ 320 columns instead of 1,488 without compaction).

**Kernels generic in K**: ``sf_conv_load``, ``sf_relu`` and ``sf_add`` take the factor widths (in units
of ``FACTOR_ALIGN``) and the layer's factor offset as scalar arguments (:func:`_emit_width_generic`),
so layers that differ only in them share one kernel (:mod:`..sharing`): ResNet-20 63 → 51 distinct
PrimFuncs, ~1.5 of ~12 CPU s of compile.  Their per-row loadings are expressions, not buffers
(:func:`_widened_column`, ``_normalised`` of a function): a row buffer of symbolic size is a workspace
allocation per row, and a lane-wise clamp of a symbolic index is a gather.  A static-batch build binds
the scalars per call site (:func:`~pyro2pfp.tuning.specialize.bind_scalar_arguments`), so its kernels
are the constant-``K`` ones, scheduled and tuned as before.
Any other elementwise activation (an ``ActivationRule``: SiLU, GELU, tanh, ...): ``sf_stein``, Stein's
``clip(E[f'(a)]·s)`` with the exact slope of the rule's own float32 mean formula by forward-mode AD
(:func:`stein_kernel`, :mod:`pyro2pfp.correlation.stein`).  Not compiled (an ``ArgumentError`` naming
the layer): the raw-moment plan and ``injection='rescaled'``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm
from tvm import relax, s_tir, te, tirx
from tvm.sym.analyzer import Analyzer

from ... import moments
from ...correlation.backend import FixedKStep
from ...correlation.factors import FACTOR_ALIGN, ComputeFactors, aligned
from ...correlation.stein import stein_slope
from ...plan import PlannedLayer
from ...reference.arrays import average_divisor
from ...registry import OPS
from .._core import (
    F32,
    LAYER_ATTR,
    OP_ATTR,
    SCHEME_STEPS,
    EmitContext,
    RelaxActivation,
    te_shared,
    variance_of,
)
from ..schedules import (
    divisor_at_most,
    extent,
    pow2_divisor,
    register_budget,
    schedule,
    simd_lanes,
    static_extent,
    vector_width,
    vectorizable,
    vectorize_inner,
)
from .activation import activation_moments
from .compute import _pad, schedule_conv2d
from .pooling import Windows
from .winograd import schedule_weight_transforms, weight_transform, winograd_correlation, winograd_shape

PARTS = ("scale", "conv_load", "conv_weights", "relu", "add", "avgpool", "maxpool", "dense_load", "gram", "stein")
_LOWEST = float(np.finfo(np.float32).min)


def _c(value: float) -> tirx.PrimExpr:
    return tirx.const(value, F32)


def _max_step(a: Any, b: Any, ops: Any) -> list[Any]:
    """One step of the max-pool fold with the profile: Clark's ``(μ, v)`` of ``max(A, B)`` and
    ``Cov(max(A, B), η) = Φ(α)·s_A + Φ(−α)·s_B``, ``α = (μ_A − μ_B)/√(v_A + v_B)``."""
    theta = ops.sqrt(a[1] + b[1])
    alpha = te.min(te.max((a[0] - b[0]) / te.max(theta, _c(1e-30)), _c(-40.0)), _c(40.0))
    cdf = tirx.Select(theta > _c(0.0), ops.normal_cdfs(alpha)[0],
                      tirx.Select(a[0] >= b[0], _c(1.0), _c(0.0)))
    mean, var = moments.max_moments(a[0], a[1], b[0], b[1], ops)
    return [mean, var, cdf * a[2] + (_c(1.0) - cdf) * b[2]]


# The fold as a sequential TE reduction in row-major window order (as tvm_backend/ops/pooling.py; one
# expression would blow up in LLVM); identity (−FLT_MAX, 0, 0) is exact: Φ(α) = 0 there.
shared_max = te.comm_reducer(
    lambda a, b: tuple(te_shared(lambda ops: _max_step(a, b, ops))),
    lambda t0, t1, t2: (tirx.const(_LOWEST, t0), tirx.const(0.0, t1), tirx.const(0.0, t2)),
    name="shared_max",
)


@dataclass
class SharedRelax:
    """The shared part of one edge in the Relax graph: ``s`` (B, *edge shape), ``g`` (B, rows, k)."""

    s: relax.Expr
    g: relax.Expr
    k: int


def _emit(ctx: EmitContext, fn: Any, args: list[relax.Expr], layer: PlannedLayer, part: str) -> list[relax.Expr]:
    """One TE function as the PrimFunc ``pfp_sf_<part>_<layer>`` (op attribute ``sf_<part>``)."""
    return ctx.emit_kernel(fn, args, f"pfp_sf_{part}_{layer.name}", {OP_ATTR: f"sf_{part}", LAYER_ATTR: layer.name})


@dataclass(frozen=True)
class FactorWidths:
    """The factor widths and offset one shared-factor kernel is specialised to at its call site, passed
    as scalar arguments (:func:`_emit_width_generic`) so that layers that differ only in them share the
    kernel: ``k_in16s`` -- each factor input's ``K`` in units of
    :data:`~pyro2pfp.correlation.factors.FACTOR_ALIGN` --, ``k16`` -- the output's -- and ``offset``,
    the layer's first factor column."""

    k_in16s: tuple[Any, ...]
    k16: Any
    offset: Any

    @property
    def k(self) -> Any:
        """The output's ``K``."""
        return self.k16 * FACTOR_ALIGN

    @property
    def scalars(self) -> list[Any]:
        """The scalar parameters in the order the call passes them."""
        return [*self.k_in16s, self.k16, self.offset]


def _emit_width_generic(ctx: EmitContext, fn: Any, args: list[relax.Expr], layer: PlannedLayer, part: str,
                        g_args: dict[int, int], k: int, offset: int) -> list[relax.Expr]:
    """:func:`_emit`, but the PrimFunc does not depend on the factor widths or the offset: ``fn(*ts,
    widths=...)`` gets placeholders whose ``args[i]`` for ``i`` in ``g_args`` (a factor input, its
    ``K`` the value) have the symbolic last dimension ``widths.k_in16s[n]·FACTOR_ALIGN`` (``n``: its
    place in ``g_args``), and a :class:`FactorWidths` of symbolic scalars, which the call passes (the
    inputs' widths, ``k`` and ``offset``; every width a multiple of ``FACTOR_ALIGN``)."""
    widths_in = list(g_args.values())
    if any(w % FACTOR_ALIGN for w in (*widths_in, k)):
        raise ValueError(f"{layer.name}: factor widths {widths_in}, {k} are not multiples of {FACTOR_ALIGN}")
    widths = FactorWidths(tuple(tirx.Var(f"k_in16_{n}", "int64") for n in range(len(g_args))),
                          tirx.Var("k16", "int64"), tirx.Var("offset", "int64"))
    slot = {i: n for n, i in enumerate(g_args)}
    tensors = []
    for i, arg in enumerate(args):
        shape = list(arg.ty.shape.values)
        if i in slot:
            shape[-1] = widths.k_in16s[slot[i]] * FACTOR_ALIGN
        tensors.append(te.placeholder(shape, "float32", name=f"arg{i}"))
    outs = fn(*tensors, widths=widths)
    func = te.create_prim_func([*tensors, *widths.scalars, *outs], index_dtype_override="int64")
    if func.attrs is not None and "global_symbol" in func.attrs:
        func = func.without_attr("global_symbol")
    func = func.with_attrs({OP_ATTR: f"sf_{part}", LAYER_ATTR: layer.name})
    gv = ctx.bb.add_func(func, f"pfp_sf_{part}_{layer.name}")
    ctx.announce(gv)
    values = dict(zip(widths.scalars, (*(w // FACTOR_ALIGN for w in widths_in), k // FACTOR_ALIGN, offset),
                      strict=True))
    analyzer = Analyzer()  # the outputs' shapes at this call: the scalars bound, the batch kept
    for var, value in values.items():
        analyzer.bind(var, tirx.IntImm("int64", value))
    out_ty = [relax.TensorType([analyzer.simplify(d) for d in out.shape], "float32") for out in outs]
    call = relax.call_tir(gv, [*args, *(relax.prim_value(tirx.IntImm("int64", int(v))) for v in values.values())],
                          out_ty if len(out_ty) > 1 else out_ty[0])
    return ctx.emit_outputs(call)


def _view(ctx: EmitContext, t: relax.Expr, *shape: int) -> relax.Expr:
    """``t`` (B, ...) as (B, *shape): a reshape, or ``t`` itself when it has that shape already."""
    current = getattr(getattr(t, "ty", None), "shape", None)
    dims = getattr(current, "values", None)
    if dims is not None and len(dims) == len(shape) + 1 and all(
            isinstance(d, tirx.IntImm) and int(d) == n for d, n in zip(dims[1:], shape)):
        return t
    return ctx.bb.emit(relax.op.reshape(t, relax.ShapeExpr([ctx.batch, *shape])))


def _safe_div(num: Any, den: Any) -> Any:
    return tirx.Select(den > _c(0.0), num / te.max(den, _c(1e-30)), _c(0.0))


def _clip(s: Any, var: Any) -> Any:
    sd = te.sqrt(te.max(var, _c(0.0)))
    return te.min(te.max(s, -sd), sd)


def _row_mean(t: te.Tensor, name: str) -> te.Tensor:
    """``mean_q t[b, r, q...]`` (B, R) of a (B, R, *group axes) tensor: the mean over a row's
    positions (its value when the row has no group axes)."""
    group = [int(d) for d in t.shape[2:]]
    if not group:
        return te.compute(t.shape[:2], lambda b, r: t[b, r], name=name)
    axes = [te.reduce_axis((0, d), name=f"{name}_q{i}") for i, d in enumerate(group)]
    inv = _c(1.0 / int(np.prod(group)))
    return te.compute(t.shape[:2], lambda b, r: te.sum(t[(b, r, *axes)] * inv, axis=axes), name=name)


def _widened(g: te.Tensor, k: Any) -> te.Tensor:
    """``g`` (B, R, k_in) with zero columns up to ``k`` (either may be symbolic)."""
    k_in = g.shape[2]
    if isinstance(k_in, tirx.IntImm) and isinstance(k, int) and int(k_in) == k:
        return g
    return te.compute((g.shape[0], g.shape[1], k), _widened_column(g), name="widened")


def _widened_column(g: te.Tensor) -> Any:
    """``(b, r, f) ↦ g[b, r, f]`` for ``f < k_in``, else 0 (an expression, for any ``f ≥ 0``).  For a
    symbolic ``k_in`` (a multiple of FACTOR_ALIGN, as every width is) the test and the clamp are on
    the vector's index ``f // FACTOR_ALIGN``, the same for all its lanes, so a vectorised copy stays
    vector loads (a lane-wise ``min(f, k_in - 1)`` is a gather)."""
    k_in = g.shape[2]
    if isinstance(k_in, tirx.IntImm):
        return lambda b, r, f: tirx.Select(f < k_in, g[b, r, te.min(f, k_in - 1)], _c(0.0))
    chunks = tirx.floordiv(k_in, FACTOR_ALIGN)

    def column(b: Any, r: Any, f: Any) -> Any:
        chunk = tirx.floordiv(f, FACTOR_ALIGN)
        safe = te.min(chunk, chunks - 1) * FACTOR_ALIGN + tirx.floormod(f, FACTOR_ALIGN)
        return tirx.Select(chunk < chunks, g[b, r, safe], _c(0.0))

    return column


def _row_products(a: te.Tensor, b: te.Tensor, k: Any) -> te.Tensor:
    """``out[n, r, c] = Σ_{f<k} a[n, c, f]·b[n, r, f]`` (B, rows of ``b``, rows of ``a``): the inner
    products of every row of ``b`` with every row of ``a`` -- ``β = ⟨g_in[c], g[o]⟩`` of the conv rule,
    the Gram matrix ``g·gᵀ`` of a compaction.  ``a`` is transposed first so ``c`` is unit-stride (block
    ``beta``, a :data:`MATMUL_BLOCKS` product of the schedule)."""
    a_t = te.compute((a.shape[0], k, a.shape[1]), lambda n, f, c: a[n, c, f], name="g_t")
    f = te.reduce_axis((0, k), name="f")
    return te.compute((a.shape[0], b.shape[1], a.shape[1]), lambda n, r, c: te.sum(a_t[n, f, c] * b[n, r, f], axis=f),
                      name="beta")


#: a row of a loading whose largest entry is at most this counts as zero (``g = 0``, ``‖ℓ‖ = 0``):
#: its reciprocal would overflow float32
NORM_FLOOR = 1e-30


def _normalised(loading: Any, shape: Any = None) -> tuple[te.Tensor, te.Tensor]:
    """``(g, ‖ℓ‖)`` of a loading ``ℓ`` (B, R, K) as TE stages of the kernel that computes ``ℓ``
    (no kernel of its own): ``p = max_f |ℓ_f|``, ``‖ℓ‖ = p·√(Σ_f (ℓ_f/p)²)`` and ``g = ℓ/‖ℓ‖``
    (as ``ℓ·(1/p)/√Σ``), 0 where ``p ≤`` :data:`NORM_FLOOR` -- the reference's
    ``correlation.rules._normalised`` in float32, finite up to ``|ℓ| ≈ FLT_MAX`` (the square of an
    entry above ~1.8e19 would overflow without the scale ``p``).  ``loading``: a tensor, or a function
    ``(b, r, f) ↦ ℓ`` of shape ``shape`` (no buffer: it is evaluated where each stage reads it)."""
    if isinstance(loading, te.Tensor):
        shape, tensor = loading.shape, loading
        loading = lambda b, r, f: tensor[b, r, f]  # noqa: E731
    rows, k = shape[:2], shape[2]
    f = te.reduce_axis((0, k), name="f_peak")
    peak = te.compute(rows, lambda b, r: te.max(te.abs(loading(b, r, f)), axis=f), name="peak")
    inv = te.compute(rows, lambda b, r: tirx.Select(peak[b, r] > _c(NORM_FLOOR), _c(1.0) / te.max(
        peak[b, r], _c(NORM_FLOOR)), _c(0.0)), name="inv_peak")
    f2 = te.reduce_axis((0, k), name="f_sq")
    sq = te.compute(rows, lambda b, r: te.sum(loading(b, r, f2) * inv[b, r] * loading(b, r, f2) * inv[b, r],
                                              axis=f2), name="sq")
    # sq = 0 exactly where inv = 0 (else the largest term is ~1): then norm = 0 and g = 0
    norm = te.compute(rows, lambda b, r: peak[b, r] * te.sqrt(sq[b, r]), name="norm")
    scale = te.compute(rows, lambda b, r: tirx.Select(sq[b, r] > _c(0.0), inv[b, r] / te.sqrt(
        te.max(sq[b, r], _c(NORM_FLOOR))), _c(0.0)), name="g_scale")
    g = te.compute(shape, lambda b, r, j: loading(b, r, j) * scale[b, r], name="g")
    return g, norm


def _scaled(ctx: EmitContext, s: relax.Expr, var: relax.Expr, factor: relax.Expr, layer: PlannedLayer
            ) -> relax.Expr:
    """``clip(factor[r]·s[r, ...])`` on (B, R, *group axes) tensors (``factor`` (R,) or (1,))."""
    def fn(st: te.Tensor, vt: te.Tensor, a: te.Tensor) -> te.Tensor:
        per_row = int(a.shape[0]) > 1
        return te.compute(st.shape, lambda b, r, *q: _clip(a[r if per_row else 0] * st[(b, r, *q)], vt[(b, r, *q)]),
                          name="scaled")

    return _emit(ctx, fn, [s, var, factor], layer, "scale")[0]


def stein_kernel(layer: PlannedLayer, x_repr: Any) -> Any:
    """``fn(m, second, s, var_out)``: the TE stage of the generic activation rule ``sf_stein`` (one
    elementwise block ``stein``) -- ``clip(E[f'(a)]·s, ±√var_out)`` per element, ``E[f'(a)]`` the exact
    ``μ``-derivative of the layer's ``ActivationRule`` mean at the input's ``(μ, v)`` (``second`` in
    ``x_repr``): :func:`~pyro2pfp.correlation.stein.stein_slope` on ``TE_OPS`` (forward-mode AD of
    the very float32 formula the mean-field kernel evaluates; shared sub-expressions let-bound once,
    :func:`~pyro2pfp.tvm_backend._core.te_shared`)."""
    rule, attrs = OPS[layer.op].activation, layer.layer.attrs

    def fn(m: te.Tensor, second: te.Tensor, s: te.Tensor, var: te.Tensor) -> te.Tensor:
        def element(*i: Any) -> Any:
            def build(ops: Any) -> list[Any]:
                slope = stein_slope(rule, m[i], variance_of(m[i], second[i], x_repr), attrs, ops)
                return [_clip(slope * s[i], var[i])]

            return te_shared(build)[0]

        return te.compute(m.shape, element, name="stein")

    return fn


def winograd_profile(pairs: list[tuple[te.Tensor, te.Tensor]], shift: te.Tensor, var: te.Tensor) -> te.Tensor:
    """The profile convolution of a :func:`~.winograd.winograd_shape` layer by Winograd F(2x2, 3x3):
    ``s[b, o, y, x] = clip(Σ_k conv3x3(x_k, w_k)[b, o, y, x] + shift[b, o], ±√var[b, o, y, x])`` for
    ``pairs = [(x_k (B, C, H, W), U_k (B, 4, 4, C, O))]`` (``U_k = G·w_k·Gᵀ`` per input, emitted by
    ``sf_conv_weights``; :func:`~.winograd.winograd_correlation`), NCHW out; block ``epilogue``."""
    y = winograd_correlation(pairs)
    return te.compute(var.shape, lambda b, o, i, j: _clip(y[b, i, j, o] + shift[b, o], var[b, o, i, j]),
                      name="epilogue")


class SharedStep(FixedKStep):
    """The shared-factor kernels of one plan, emitted after each layer's mean-field kernel (instead
    of it for the ReLUs: :meth:`relu_with_moments`)."""

    what = "the TVM back end"
    compaction = True
    fused_relu = True

    def view(self, ctx: EmitContext, layer: PlannedLayer, sh: SharedRelax) -> SharedRelax:
        return SharedRelax(_view(ctx, sh.s, *layer.layer.out_shape), sh.g, sh.k)

    # ------------------------------------------------------------------ helpers
    def _natural(self, ctx: EmitContext, name: str) -> bool:
        """Whether the rows of edge ``name`` are its first axis (every edge but a flattened one)."""
        return ctx.shapes[name][0] == self.fp.rows[name]

    def _rows(self, ctx: EmitContext, t: relax.Expr, name: str) -> relax.Expr:
        """``t`` (B, *shape of edge ``name``) as (B, rows, *group axes): ``t`` itself when the rows
        are its first axis (the kernels index it directly, no reshape), else a (B, rows, group)
        view."""
        if self._natural(ctx, name):
            return t
        rows = self.fp.rows[name]
        return _view(ctx, t, rows, int(np.prod(ctx.shapes[name])) // rows)

    def _edge(self, ctx: EmitContext, t: relax.Expr, name: str) -> relax.Expr:
        """The inverse of :meth:`_rows`: ``t`` back in the shape of edge ``name``."""
        return t if self._natural(ctx, name) else _view(ctx, t, *ctx.shapes[name])

    # ------------------------------------------------------------------ rules
    def linear(self, ctx: EmitContext, layer: PlannedLayer, sh: SharedRelax, out: RelaxActivation) -> SharedRelax:
        factor = layer.tensors["scale"] if layer.op == "affine" else np.array([layer.layer.attrs["factor"]])
        name = layer.name
        s = _scaled(ctx, self._rows(ctx, sh.s, name), self._rows(ctx, out.second, name), ctx.const(factor), layer)
        return SharedRelax(self._edge(ctx, s, name), sh.g, sh.k)

    def activation(self, ctx: EmitContext, layer: PlannedLayer, x: RelaxActivation, sh: SharedRelax,
                   out: RelaxActivation) -> SharedRelax:
        """The generic activation rule, one elementwise kernel ``sf_stein`` (:func:`stein_kernel`)."""
        assert x.second is not None and out.second is not None
        s = _emit(ctx, stein_kernel(layer, x.repr), [x.mean, x.second, sh.s, out.second], layer, "stein")[0]
        return SharedRelax(s, sh.g, sh.k)

    def relu_with_moments(self, ctx: EmitContext, layer: PlannedLayer, x: RelaxActivation, sh: SharedRelax
                          ) -> tuple[SharedRelax, RelaxActivation]:
        """One kernel ``sf_relu`` for a relu/leaky_relu layer with a shared input: the layer's
        mean-field outputs (the registry rule's expressions, :func:`~.activation.activation_moments`:
        what the mean-field kernel would compute) and the rule -- Stein's ``lin``, the Hermite ``h``,
        their channel means, the loading ``lbar·g_in ⊕ hbar`` normalised and the profile
        ``clip(lbar/‖ℓ‖·lin + hbar/‖ℓ‖·h)`` (every step per row).  ``σ``, ``α``, ``Φ(α)`` and ``φ(α)``
        are those of the moments (:func:`~pyro2pfp.moments.gaussian_terms`, bound once per element:
        ``te_shared(reuse=True)``); where ``σ = 0`` Stein's terms take the reference's limits
        (``Φ → [μ > 0]``, ``h = 0``)."""
        slope = float(layer.layer.attrs["slope"]) if layer.op == "leaky_relu" else 0.0
        name, src = layer.name, layer.inputs[0]
        offset = self.fp.offsets.get(name)
        k = self.fp.width[name]
        assert x.second is not None  # a random input (emits_mean_field)
        views = [self._rows(ctx, t, src) for t in (x.mean, x.second, sh.s)]
        mean_field = activation_moments(layer, x.repr)

        def terms(m: te.Tensor, v: te.Tensor, s: te.Tensor) -> list[te.Tensor]:
            """``[mean, second]`` of the output (the mean-field moments) and Stein's ``[lin, h]``."""
            def element(*i: Any) -> list[Any]:
                def build(ops: Any) -> list[Any]:
                    outs = mean_field(m[i], v[i], ops)
                    # the same bound σ, α, Φ(α), φ(α) as the moments (reuse): one erf and one exp
                    sd, _, cdf, _, pdf = moments.gaussian_terms(m[i], variance_of(m[i], v[i], x.repr), ops)
                    cdf = tirx.Select(sd > _c(0.0), cdf, tirx.Select(m[i] > _c(0.0), _c(1.0), _c(0.0)))
                    lin = (cdf + _c(slope) * (_c(1.0) - cdf)) * s[i]
                    h = _safe_div(_c(1.0 - slope) * pdf, sd) * s[i] * s[i] * _c(1 / math.sqrt(2))
                    return [*outs, lin] if offset is None else [*outs, lin, h]

                return te_shared(build, reuse=True)

            return list(te.compute(m.shape, element, name="relu"))

        def rule(*ts: te.Tensor, widths: FactorWidths | None = None) -> list[te.Tensor]:
            m, v, s = ts[:3]
            mean, second, lin, *h = terms(m, v, s)

            def var(*i: Any) -> Any:  # the output's variance, the profile's clip
                return variance_of(mean[i], second[i], layer.out_repr)

            if offset is None:  # hermite='none': the linear response only
                return [mean, second, te.compute(lin.shape, lambda *i: _clip(lin[i], var(*i)), name="s")]
            assert widths is not None  # the factor widths and offset: symbolic (_emit_width_generic)
            lbar, hbar = _row_mean(lin, "lbar"), _row_mean(h[0], "hbar")
            column = _widened_column(ts[3])
            g, norm = _normalised(lambda b, r, f: lbar[b, r] * column(b, r, f) + tirx.Select(
                f == r + widths.offset, hbar[b, r], _c(0.0)), (lbar.shape[0], lbar.shape[1], widths.k))
            s_out = te.compute(lin.shape, lambda b, r, *q: _clip(
                _safe_div(lbar[b, r], norm[b, r]) * lin[(b, r, *q)]
                + _safe_div(hbar[b, r], norm[b, r]) * h[0][(b, r, *q)], var(b, r, *q)), name="profile")
            return [mean, second, s_out, g]

        if offset is None:
            outs = _emit(ctx, rule, views, layer, "relu")
        else:  # layers that differ only in the factor widths and offset share the kernel
            outs = _emit_width_generic(ctx, rule, [*views, sh.g], layer, "relu", g_args={3: sh.k}, k=k,
                                       offset=offset)
        out = RelaxActivation(self._edge(ctx, outs[0], name), self._edge(ctx, outs[1], name), layer.out_repr)
        if offset is None:
            return SharedRelax(self._edge(ctx, outs[2], name), sh.g, sh.k), out
        return SharedRelax(self._edge(ctx, outs[2], name), outs[3], k), out

    def add(self, ctx: EmitContext, layer: PlannedLayer, sa: SharedRelax, sb: SharedRelax, out: RelaxActivation
            ) -> tuple[SharedRelax, RelaxActivation]:
        name = layer.name
        k = self.fp.width[name]
        a_s, b_s, var = (self._rows(ctx, t, name) for t in (sa.s, sb.s, out.second))

        def rule(at: te.Tensor, bt: te.Tensor, v: te.Tensor, ga: te.Tensor, gb: te.Tensor, widths: FactorWidths
                 ) -> list[te.Tensor]:
            """The loading ``ā·g_a + b̄·g_b`` normalised, the branch covariance ``⟨g_a, g_b⟩``, the
            corrected variance and the profile, in one kernel (every step is per row; the factor
            widths are the symbolic ``widths``, so adds that differ only in them share the kernel)."""
            k = widths.k
            gaw, gbw = _widened_column(ga), _widened_column(gb)  # expressions: no (B, R, K) buffers
            abar, bbar = _row_mean(at, "abar"), _row_mean(bt, "bbar")
            f = te.reduce_axis((0, k), name="f")
            dot = te.compute(at.shape[:2], lambda b, r: te.sum(gaw(b, r, f) * gbw(b, r, f), axis=f), name="dot")
            gt, _ = _normalised(lambda b, r, j: abar[b, r] * gaw(b, r, j) + bbar[b, r] * gbw(b, r, j),
                                (at.shape[0], at.shape[1], k))
            f1 = te.reduce_axis((0, k), name="f1")
            pa = te.compute(at.shape[:2], lambda b, r: te.sum(gaw(b, r, f1) * gt[b, r, f1], axis=f1), name="pa")
            f2 = te.reduce_axis((0, k), name="f2")
            pb = te.compute(at.shape[:2], lambda b, r: te.sum(gbw(b, r, f2) * gt[b, r, f2], axis=f2), name="pb")
            var_new = te.compute(at.shape, lambda b, r, *q: te.max(
                v[(b, r, *q)] + _c(2.0) * at[(b, r, *q)] * bt[(b, r, *q)] * dot[b, r], _c(0.0)), name="var")
            s = te.compute(at.shape, lambda b, r, *q: _clip(at[(b, r, *q)] * pa[b, r] + bt[(b, r, *q)] * pb[b, r],
                                                            var_new[(b, r, *q)]), name="s")
            return [s, var_new, gt]

        s, var_new, g = _emit_width_generic(ctx, rule, [a_s, b_s, var, sa.g, sb.g], layer, "add",
                                            g_args={3: sa.k, 4: sb.k}, k=k, offset=0)
        out = RelaxActivation(out.mean, self._edge(ctx, var_new, name), out.repr)
        return SharedRelax(self._edge(ctx, s, name), g, k), out

    def avg_pool(self, ctx: EmitContext, layer: PlannedLayer, x: RelaxActivation, sh: SharedRelax,
                  out: RelaxActivation) -> tuple[SharedRelax, RelaxActivation]:
        a = dict(layer.layer.attrs)
        a.setdefault("divisor", None)
        a.setdefault("count_include_pad", False)
        in_hw, out_hw = ctx.shapes[layer.inputs[0]][1:], layer.layer.out_shape[1:]
        div = average_divisor(a, in_hw, out_hw)
        (kh, kw), (sy, sx), (py, px) = a["kernel"], a["stride"], a["padding"]
        h, w = in_hw

        def fn(s: te.Tensor, v: te.Tensor, d: te.Tensor) -> list[te.Tensor]:
            def window(t: Any, b: Any, c: Any, y: Any, x_: Any, i: Any, j: Any) -> Any:
                yy, xx = y * sy + i - py, x_ * sx + j - px
                inside = tirx.all(yy >= 0, yy < h, xx >= 0, xx < w)
                return tirx.Select(inside, t(b, c, te.min(te.max(yy, 0), h - 1), te.min(te.max(xx, 0), w - 1)),
                                   _c(0.0))

            shape = (s.shape[0], s.shape[1], *out_hw)
            i, j = te.reduce_axis((0, kh), name="i"), te.reduce_axis((0, kw), name="j")
            s_out = te.compute(shape, lambda b, c, y, x_: te.sum(
                window(lambda *t: s[t], b, c, y, x_, i, j) / d[y, x_], axis=[i, j]), name="s")
            i2, j2 = te.reduce_axis((0, kh), name="i2"), te.reduce_axis((0, kw), name="j2")

            def indep(*t: Any) -> Any:
                return te.max(v[t] - s[t] * s[t], _c(0.0))

            rest = te.compute(shape, lambda b, c, y, x_: te.sum(
                window(indep, b, c, y, x_, i2, j2) / (d[y, x_] * d[y, x_]), axis=[i2, j2]), name="rest")
            var = te.compute(shape, lambda b, c, y, x_: rest[b, c, y, x_] + s_out[b, c, y, x_] * s_out[b, c, y, x_],
                             name="var")
            return [s_out, var]

        s, var = _emit(ctx, fn, [sh.s, x.second, ctx.const(div)], layer, "avgpool")
        return SharedRelax(s, sh.g, sh.k), RelaxActivation(out.mean, var, out.repr)

    def max_pool(self, ctx: EmitContext, layer: PlannedLayer, x: RelaxActivation, sh: SharedRelax,
                  out: RelaxActivation) -> SharedRelax:
        win = Windows(layer, ctx.shapes[layer.inputs[0]])
        out_hw = layer.layer.out_shape[1:]

        def fn(m: te.Tensor, v: te.Tensor, s: te.Tensor, var: te.Tensor) -> te.Tensor:
            i, j = win.axes()
            taps = win.padded([m, v, s], [_LOWEST, 0.0, 0.0])  # plain loads in the combiner (see Windows.padded)
            shape = (m.shape[0], m.shape[1], *out_hw)
            acc = te.compute(shape, lambda b, c, y, x_: shared_max(
                tuple(win.load_padded(t, b, c, y, x_, i, j) for t in taps), axis=[i, j]), name="fold")
            return te.compute(shape, lambda b, c, y, x_: _clip(acc[2][b, c, y, x_], var[b, c, y, x_]), name="s")

        s = _emit(ctx, fn, [x.mean, x.second, sh.s, out.second], layer, "maxpool")[0]
        return SharedRelax(s, sh.g, sh.k)

    def conv2d(self, ctx: EmitContext, layer: PlannedLayer, x: RelaxActivation, sh: SharedRelax | None,
               out: RelaxActivation) -> SharedRelax | None:
        cf = ComputeFactors.of(layer, self.fp)
        offset, k, wm, wv = cf.offset, cf.k, cf.weight_mean, cf.weight_var
        t, a = layer.tensors, layer.layer.attrs
        o, c, kh, kw = wm.shape
        (sy, sx), (py, px), (dy, dx) = a["stride"], a["padding"], a["dilation"]
        h, w = ctx.shapes[layer.inputs[0]][1:]
        oh, ow = layer.layer.out_shape[1:]
        has_s = sh is not None
        wino = winograd_shape(layer)  # the profile convolution by Winograd F(2x2, 3x3) (winograd.py)
        bias_var = ctx.const(t["bias_var"] if "bias_var" in t else np.zeros(o))

        # the output columns ``ox*sx + j*dx - px`` of kernel column ``j`` that fall inside the
        # input, weighted 1/(oh*ow): the column half of the pooling as a (KW, W) product
        col_weights = np.zeros((kw, w))
        for j in range(kw):
            for ox in range(ow):
                xx = ox * sx + j * dx - px
                if 0 <= xx < w:
                    col_weights[j, xx] += 1.0 / (oh * ow)

        def pooled(src: te.Tensor, n: int, cw: te.Tensor) -> te.Tensor:
            """``m̄[b, c, i, j]`` = mean over the output positions of the input at kernel offset
            ``(i, j)`` (0 where that tap falls in the padding), separable and without a padded copy:
            ``cols[b, c, i, x]`` = sum over the output rows of input row ``oy*sy + i*dy - py`` (a
            vector over the unit-stride ``x``), then ``m̄[.., i, j] = Σ_x cols[.., i, x]·P[j, x]``
            with ``P`` the constant column weights above (``KH·OH·W + KH·KW·W`` per channel)."""
            y = te.reduce_axis((0, oh), name=f"y{n}")

            def row_tap(b: Any, ch: Any, i: Any, xx: Any) -> Any:
                yy = y * sy + i * dy - py
                return tirx.Select(tirx.all(yy >= 0, yy < h), src[b, ch, te.min(te.max(yy, 0), h - 1), xx], _c(0.0))

            cols = te.compute((src.shape[0], c, kh, w), lambda b, ch, i, xx: te.sum(row_tap(b, ch, i, xx), axis=y),
                              name=f"cols{n}")
            xr = te.reduce_axis((0, w), name=f"x{n}")
            return te.compute((src.shape[0], c, kh, kw), lambda b, ch, i, j: te.sum(cols[b, ch, i, xr] * cw[j, xr],
                                                                                    axis=xr), name=f"bar{n}")

        def load(*ts: te.Tensor, widths: FactorWidths) -> list[te.Tensor]:
            """The pooled views ``m̄μ``, ``m̄s``; ``w̄ = √(Σ V·(m̄μ² + m̄s²) + v_bias)``; the loading
            ``ℓ = A·g_in ⊕ w̄`` (``A = W·m̄s``) normalised to ``g``; ``β = ⟨g_in[c], g[o]⟩``; the
            injection's coefficient ``coef = g[o, offset + o]/w̄`` (0 where ``w̄ = 0``, or without an
            injection) -- one kernel (the weights are read in ``(C, KH, KW, O)`` layout: ``A`` and
            the weight-variance sum are vectors over output channels).  ``coef`` is computed here,
            where ``g`` is, so the weights kernel does not read ``g``: it then does not depend on
            ``K``, and layers that differ only in ``K`` share it (:mod:`..sharing`).  The factor widths
            and the offset are the symbolic ``widths`` (:func:`_emit_width_generic`): layers that
            differ only in them share this kernel too."""
            k, off = widths.k, widths.offset
            it = iter(ts)
            mu = next(it)
            s_in, g_in = (next(it), next(it)) if has_s else (None, None)
            cw, wmt, wvt, bvt = (next(it) for _ in range(4))
            batch = mu.shape[0]
            mb = pooled(mu, 0, cw)
            sb = pooled(s_in, 1, cw) if s_in is not None else None
            cc, i, j = (te.reduce_axis((0, n), name=name) for n, name in ((c, "c"), (kh, "i"), (kw, "j")))

            def second(b: Any, ch: Any, ii: Any, jj: Any) -> Any:
                mm = mb[b, ch, ii, jj] * mb[b, ch, ii, jj]
                return mm if sb is None else mm + sb[b, ch, ii, jj] * sb[b, ch, ii, jj]

            wsum = te.compute((batch, o), lambda b, oo: te.sum(wvt[cc, i, j, oo] * second(b, cc, i, j),
                                                                axis=[cc, i, j]), name="wsum")
            wbar = te.compute((batch, o), lambda b, oo: te.sqrt(te.max(wsum[b, oo] + bvt[oo], _c(0.0))), name="wbar")

            def coefficient(g: te.Tensor) -> te.Tensor:
                """``coef[b, o] = g[b, o, offset + o]/w̄[b, o]`` (0 where ``w̄ = 0`` or without an injection)."""
                if offset is None:
                    return te.compute((batch, o), lambda b, oo: _c(0.0), name="coef")
                return te.compute((batch, o), lambda b, oo: _safe_div(g[b, oo, oo + off], wbar[b, oo]),
                                  name="coef")

            if sb is None or g_in is None:
                loading = te.compute((batch, o, k), lambda b, oo, f: tirx.Select(
                    f == oo + off, wbar[b, oo], _c(0.0)), name="loading")
                g = _normalised(loading)[0]
                return [mb, g, coefficient(g)]
            i2, j2 = te.reduce_axis((0, kh), name="i2"), te.reduce_axis((0, kw), name="j2")
            amap = te.compute((batch, c, o), lambda b, ch, oo: te.sum(wmt[ch, i2, j2, oo] * sb[b, ch, i2, j2],
                                                                       axis=[i2, j2]), name="amap")
            gw = _widened(g_in, k)
            c2 = te.reduce_axis((0, c), name="c2")
            prop = te.compute((batch, o, k), lambda b, oo, f: te.sum(amap[b, c2, oo] * gw[b, c2, f], axis=c2),
                              name="prop")
            loading = prop if offset is None else te.compute(prop.shape, lambda b, oo, f: prop[b, oo, f] + tirx.Select(
                f == oo + off, wbar[b, oo], _c(0.0)), name="loading")
            g = _normalised(loading)[0]
            # βᵀ[b, c, o] = ⟨g_in[c], g[o]⟩ (B, C, O): unit-stride in o, as the weights kernel reads it
            return [mb, sb, g, coefficient(g), _row_products(g, g_in, g_in.shape[2])]

        w_cons = [ctx.const(np.transpose(t_, (1, 2, 3, 0))) for t_ in (wm, wv)]  # (C, KH, KW, O), both kernels
        args = [x.mean] + ([sh.s, sh.g] if sh is not None else []) + [ctx.const(col_weights), *w_cons, bias_var]
        outs = _emit_width_generic(ctx, load, args, layer, "conv_load", g_args={2: sh.k} if sh is not None else {},
                                   k=k, offset=offset or 0)
        if sh is not None:
            mbar, sbar, g, coef_t, beta = outs
        else:
            (mbar, g, coef_t), sbar, beta = outs, None, None

        def weights(*ts: te.Tensor) -> list[te.Tensor]:
            """Per-input weights (B, C, KH, KW, O) of the profile convolution: ``A = W·β + coef·V·m̄s``
            on the input's profile, ``M = coef·V·m̄μ`` on its mean -- or, for a Winograd profile
            convolution, their transforms ``G·A·Gᵀ``, ``G·M·Gᵀ`` (B, 4, 4, C, O) -- and ``coef·v_bias``
            (B, O).  ``W``, ``V`` come as (C, KH, KW, O), ``β`` as (B, C, O) and ``coef`` (B, O) from
            ``sf_conv_load``: every read unit-stride in ``o``, the vectorised axis, and none depends
            on ``K``."""
            it = iter(ts)
            mb = next(it)
            sb, bt = (next(it), next(it)) if has_s else (None, None)
            coef, wmt, wvt, bvt = (next(it) for _ in range(4))
            batch = mb.shape[0]
            wshape = (batch, c, kh, kw, o)
            outs = []
            if sb is not None and bt is not None:
                def on_s(b: Any, ch: Any, i: Any, j: Any, oo: Any) -> Any:
                    value = wmt[ch, i, j, oo] * bt[b, ch, oo]
                    if offset is not None:
                        value = value + coef[b, oo] * wvt[ch, i, j, oo] * sb[b, ch, i, j]
                    return value

                outs.append(te.compute(wshape, on_s, name="w_s"))
            if offset is not None:
                outs.append(te.compute(wshape, lambda b, ch, i, j, oo: coef[b, oo] * wvt[ch, i, j, oo]
                                       * mb[b, ch, i, j], name="w_mu"))
            if wino:  # their Winograd transforms G·w·Gᵀ (B, 4, 4, C, O) instead
                outs = [weight_transform(wt, f"wino_w{n}") for n, wt in enumerate(outs)]
            outs.append(te.compute((batch, o), lambda b, oo: coef[b, oo] * bvt[oo]
                                   if offset is not None else _c(0.0), name="shift"))
            return outs

        w_args = [mbar] + ([sbar, beta] if sbar is not None and beta is not None else [])
        w_outs = _emit(ctx, weights, w_args + [coef_t, *w_cons, bias_var], layer, "conv_weights")

        def profile(*ts: te.Tensor) -> list[te.Tensor]:
            """``s[b, o] = Σ_{c,i,j} A·tap(s_in) + M·tap(μ) + shift``, clipped: a convolution with
            per-input weights, in the layout of the mean-field conv kernel (its schedule)."""
            it = iter(ts)
            srcs = [(next(it), next(it)) for _ in range(n_terms)]  # (input, weights)
            shift, var = next(it), next(it)
            if wino:
                return [winograd_profile(srcs, shift, var)]
            padded = [(_pad(src, [py, px]), wt) for src, wt in srcs]
            rc, rp, rq = (te.reduce_axis((0, n), name=name) for n, name in ((c, "rc"), (kh, "rp"), (kw, "rq")))

            def body(b: Any, oo: Any, y: Any, x_: Any) -> Any:
                pos = (b, rc, y * sy + rp * dy, x_ * sx + rq * dx)
                total = padded[0][0][pos] * padded[0][1][b, rc, rp, rq, oo]
                for src, wt in padded[1:]:
                    total = total + src[pos] * wt[b, rc, rp, rq, oo]
                return te.sum(total, axis=[rc, rp, rq])

            acc = te.compute((srcs[0][0].shape[0], o, oh, ow), body, name="conv2d")
            return te.compute(acc.shape, lambda b, oo, y, x_: _clip(acc[b, oo, y, x_] + shift[b, oo],
                                                                     var[b, oo, y, x_]), name="epilogue")

        terms = ([sh.s] if sh is not None else []) + ([x.mean] if offset is not None else [])
        n_terms = len(terms)
        args = [t for pair in zip(terms, w_outs[:n_terms]) for t in pair] + [w_outs[-1], out.second]
        s = _emit(ctx, profile, args, layer, "conv_profile")[0]
        return SharedRelax(s, g, k)

    def dense(self, ctx: EmitContext, layer: PlannedLayer, x: RelaxActivation, sh: SharedRelax | None,
               out: RelaxActivation) -> tuple[SharedRelax | None, RelaxActivation]:
        cf = ComputeFactors.of(layer, self.fp)
        offset, k, wm, wv = cf.offset, cf.k, cf.weight_mean, cf.weight_var
        t = layer.tensors
        o, n = wm.shape
        src = layer.inputs[0]
        rows = self.fp.rows[src] if sh is not None else 0
        group = n // rows if rows else 1
        bias_var = ctx.const(t["bias_var"] if "bias_var" in t else np.zeros(o))
        x_mean = _view(ctx, x.mean, n)
        x_second = _view(ctx, x.second, n) if x.second is not None else None

        def load(*ts: Any) -> list[te.Tensor]:
            it = iter(ts)
            mu = next(it)
            v = next(it) if x_second is not None else None
            s, g_in = (next(it), next(it)) if sh is not None else (None, None)
            var, wmt, wvt, bvt = (next(it) for _ in range(4))
            batch = mu.shape[0]
            parts: list[Any] = []
            if offset is not None:
                i = te.reduce_axis((0, n), name="i")
                inj = te.compute((batch, o), lambda b, oo: te.sum(wvt[oo, i] * (
                    mu[b, i] * mu[b, i] + (v[b, i] if v is not None else _c(0.0))), axis=i), name="inj")
            if s is not None and g_in is not None:
                q = te.reduce_axis((0, group), name="q")
                coef = te.compute((batch, o, rows), lambda b, oo, r: te.sum(
                    wmt[oo, r * group + q] * s[b, r * group + q], axis=q), name="coef")
                i2 = te.reduce_axis((0, n), name="i2")
                ws2 = te.compute((batch, o), lambda b, oo: te.sum(
                    wmt[oo, i2] * wmt[oo, i2] * s[b, i2] * s[b, i2], axis=i2), name="ws2")
                gw = _widened(g_in, k)
                r2 = te.reduce_axis((0, rows), name="r2")
                prop = te.compute((batch, o, k), lambda b, oo, f: te.sum(coef[b, oo, r2] * gw[b, r2, f], axis=r2),
                                  name="prop")
                f2 = te.reduce_axis((0, k), name="f2")
                pn = te.compute((batch, o), lambda b, oo: te.sum(prop[b, oo, f2] * prop[b, oo, f2], axis=f2), name="pn")
                var_new = te.compute((batch, o), lambda b, oo: te.max(var[b, oo] + pn[b, oo] - ws2[b, oo], _c(0.0)),
                                     name="var")
                parts = [prop, var_new]
            else:
                parts = [None, te.compute((batch, o), lambda b, oo: var[b, oo], name="var")]

            def entry(b: Any, oo: Any, f: Any) -> Any:
                value = parts[0][b, oo, f] if parts[0] is not None else _c(0.0)
                if offset is not None:
                    value = value + tirx.Select(f == oo + offset, te.sqrt(te.max(inj[b, oo] + bvt[oo], _c(0.0))),
                                                _c(0.0))
                return value

            loading = te.compute((batch, o, k), entry, name="loading")
            g, norm = _normalised(loading)
            var_new = parts[1]
            s_out = te.compute((batch, o), lambda b, oo: _clip(norm[b, oo], var_new[b, oo]), name="s")
            return [g, s_out, var_new]

        args = [x_mean] + ([x_second] if x_second is not None else []) + (
            [_view(ctx, sh.s, n), sh.g] if sh is not None else []) + [out.second, ctx.const(wm), ctx.const(wv),
                                                                      bias_var]
        g, s, var_new = _emit(ctx, load, args, layer, "dense_load")
        return SharedRelax(s, g, k), RelaxActivation(out.mean, var_new, out.repr)


    # ------------------------------------------------------------------ compaction
    def compact(self, ctx: EmitContext, layer: PlannedLayer, sh: SharedRelax) -> SharedRelax:
        """``g`` (B, R, K) → ``L`` (B, R, aligned(R)), the Cholesky factor of ``g·gᵀ`` (zero columns
        beyond ``R``): the same ``g·gᵀ``, which is all that is used downstream (exact, as the
        reference's QR compaction ``Rᵀ``, which equals ``L`` up to the signs of its columns)."""
        rows, k = self.fp.rows[layer.name], sh.k

        gram = _emit(ctx, lambda gt: _row_products(gt, gt, k), [sh.g], layer, "gram")[0]
        width = aligned(rows)
        func = cholesky_factor(rows, width).with_attrs({OP_ATTR: "sf_cholesky", LAYER_ATTR: layer.name})
        gv = ctx.bb.add_func(func, f"pfp_sf_cholesky_{layer.name}")
        ctx.announce(gv)
        g = ctx.bb.emit(relax.call_tir(gv, [gram], out_ty=relax.TensorType((ctx.batch, rows, width), "float32")))
        return SharedRelax(sh.s, g, width)


#: a pivot ``d`` of the Cholesky factorisation below this fraction of its diagonal entry counts as
#: zero (a row in the span of the previous ones, e.g. a dead channel or a duplicate): its column of
#: ``L`` is set to zero, which changes ``g·gᵀ`` by at most ``d`` on the diagonal
CHOLESKY_PIVOT_TOL = 1e-6


@functools.cache
def cholesky_factor(rows: int, width: int) -> tirx.PrimFunc:
    """PrimFunc ``(gram (n, R, R) float32) -> L (n, R, width) float32``: per input, the lower-
    triangular ``L`` with ``L·Lᵀ = gram`` (columns ``R … width-1`` zero), by the left-looking
    Cholesky–Banachiewicz recurrence in float64 (Golub & Van Loan, *Matrix Computations*, 4th ed.,
    Alg. 4.2.1): ``d_j = G[j, j] − Σ_{k<j} L[j, k]²``, ``L[j, j] = √d_j``, ``L[i, j] = (G[i, j] −
    Σ_{k<j} L[i, k]·L[j, k]) / L[j, j]``.  ``gram`` is positive *semi*-definite (the Gram matrix of
    unit or zero rows): a pivot ``d_j ≤`` :data:`CHOLESKY_PIVOT_TOL`·``G[j, j]`` gives a zero column
    (the row is in the span of the previous ones; rounding may have made ``d_j`` slightly negative),
    so the result stays finite.  Sequential per input (``O(R³/6)``), parallel over the batch; hand-
    written TIR, marked scheduled: :func:`_cholesky_template` specialised to ``(rows, width)``."""
    gram, out = _cholesky_template().params
    n, r, w = tirx.Var("n", "int64"), tirx.IntImm("int64", rows), tirx.IntImm("int64", width)
    return _cholesky_template().specialize({gram: tirx.decl_buffer((n, r, r), "float32", name="gram"),
                                            out: tirx.decl_buffer((n, r, w), "float32", name="out")})


@functools.cache
def _cholesky_template() -> tirx.PrimFunc:
    """:func:`cholesky_factor` with symbolic ``R`` and ``width``, parsed once per process: parsing
    TVMScript costs ~0.1-0.2 s (the decorator's ``inspect.stack()`` reads the source of every frame
    of the caller's stack), specialising ~1 ms; a ResNet-20 compacts 9 times with 3 distinct shapes."""
    from tvm.script import tirx as T

    tol = CHOLESKY_PIVOT_TOL

    @T.prim_func(private=True, s_tir=True)
    def cholesky(gram_h: T.handle, out_h: T.handle) -> None:
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        # int64 dims like the TE kernels' (int32 ones break relax.transform.SpecializePrimFuncBasedOnCallSite,
        # which static-batch builds and tuning run)
        n = T.int64()
        r_ = T.int64()
        width = T.int64()
        gram = T.match_buffer(gram_h, (n, r_, r_), "float32")
        out = T.match_buffer(out_h, (n, r_, width), "float32")
        with T.sblock("root"):  # Relax's passes expect a root block
            for b in T.parallel(n):
                lower = T.decl_buffer((r_ * r_,), "float64")
                acc = T.decl_buffer((1,), "float64")
                for j in range(r_):
                    acc[0] = T.Cast("float64", gram[b, j, j])
                    for k in range(j):
                        acc[0] = acc[0] - lower[j * r_ + k] * lower[j * r_ + k]
                    if acc[0] > T.float64(tol) * T.Cast("float64", gram[b, j, j]) and acc[0] > T.float64(0):
                        lower[j * r_ + j] = T.sqrt(acc[0])
                    else:
                        lower[j * r_ + j] = T.float64(0)
                    for i in range(j + 1, r_):
                        acc[0] = T.Cast("float64", gram[b, i, j])
                        for k in range(j):
                            acc[0] = acc[0] - lower[i * r_ + k] * lower[j * r_ + k]
                        if lower[j * r_ + j] > T.float64(0):
                            lower[i * r_ + j] = acc[0] / lower[j * r_ + j]
                        else:
                            lower[i * r_ + j] = T.float64(0)
                for i, f in T.grid(r_, width):
                    if f <= i:
                        out[b, i, f] = T.Cast("float32", lower[i * r_ + f])
                    else:
                        out[b, i, f] = T.float32(0)

    return cholesky


SCHEME_STEPS["shared-factor"] = SharedStep


MATMUL_BLOCKS = ("beta", "prop")
"""Blocks ``out[b, o, n] = Σ_r x[b, o|r, r]·y[b, r, n]`` whose last axis ``n`` is unit-stride in the
operand that depends on it (``β`` reads ``g_in`` transposed; the loadings' ``prop`` reads ``g_in``):
register tiles, :func:`_tiled_product`."""

ROW_LOCAL_OPS = ("sf_relu", "sf_add", "sf_scale")
"""Kernels whose every block is indexed ``(batch, row, ...)`` and reads only its own row of the
other blocks' results: all their loop nests are merged into one parallel loop over (batch x row)
(``Schedule.merge``), so a row's intermediates (Stein's terms, the loading) stay in a thread-private
tile instead of a (B, R, ...) buffer written and re-read by the next nest."""

ROW_GROUPS = {
    "sf_conv_load": (("cols0", "bar0", "cols1", "bar1", "amap", "widened"),),
    "sf_dense_load": (("inj", "loading", "peak", "inv_peak", "sq", "g_scale", "g", "norm", "pn", "ws2", "var", "s"),),
}
"""Per op, groups of blocks whose consecutive loop nests are each indexed ``(batch, row, ...)`` over the
same rows and read only their own row of each other's results: each group's nests are merged into one
parallel loop over (batch x row), like the nests of a :data:`ROW_LOCAL_OPS` kernel: one parallel loop
(an LLVM function, its closure and its launch) instead of several.  ``sf_conv_load``: the pooled views
of ``μ`` and ``s_in``, ``A = W·m̄s`` and ``g_in`` widened (a row per input channel); ``sf_dense_load``:
its loading, normalisation, variance and profile (a row per output).  ``sf_conv_load``'s loading and
normalisation (:func:`_normalised`) are not merged: per row they are one chain of dependent
reductions (``max |ℓ|``, then ``Σ (ℓ/p)²``, each ending in a sum of 16 lanes), which a loop over the
rows of each stage overlaps and one loop over rows does not -- measured, each kernel alone at batch
10: ``layers.6.shortcut.0`` (K = 320) 117 -> 134 us merged (118 us with tiles of 4 rows, whose
unrolled copies then cost as much code as the separate loops)."""

VECTOR_ROW_BLOCKS = ("wsum", "amap")
"""Blocks ``out[.., o] = Σ_{c,i,j} x[.., c, i, j]·W[c, i, j, o]`` whose last (output-channel) axis is
unit-stride in the ``(C, KH, KW, O)`` weights: a vector over ``o``, :func:`_vector_rows`."""


@dataclass
class _Merge:
    """Loop nests to be merged into one parallel loop (:func:`schedule_shared`): the leading (batch x
    row) loop of each, and the reduction blocks whose init is split off after the merge, each with
    the position of its loop from the innermost (``decompose_reduction`` at ``get_loops(block)[-depth]``)."""

    leads: list[Any]
    deferred: list[tuple[Any, int]]

    def finish(self, sch: s_tir.Schedule) -> None:
        """Merge the leads, parallelise the merged loop, then split off the deferred inits (parallel
        first: a loop over an init block and its update block, which write the same buffer, does
        not pass parallel's dataflow check)."""
        if not self.leads:
            return
        sch.parallel(sch.merge(*self.leads) if len(self.leads) > 1 else self.leads[0])
        for block, depth in self.deferred:
            sch.decompose_reduction(block, sch.get_loops(block)[-depth])


def _depth(sch: s_tir.Schedule, block: Any, loop: Any) -> int:
    """Position of ``loop`` among the loops of ``block``, counted from the innermost (1)."""
    refs = [sch.get_sref(lp) for lp in sch.get_loops(block)]
    target = sch.get_sref(loop)
    return len(refs) - next(k for k, ref in enumerate(refs) if ref.same_as(target))


def schedule_shared(sch: s_tir.Schedule, layer: Any, target: tvm.target.Target) -> None:
    """Every loop nest of a shared-factor kernel.  The pooling blocks (``cols*``/``bar*`` of
    ``sf_conv_load``) get :func:`_schedule_pooling`, the products of :data:`MATMUL_BLOCKS`
    :func:`_tiled_product`, those of :data:`VECTOR_ROW_BLOCKS` :func:`_vector_rows`, row sums
    :func:`_vector_reduction`; any other nest has its first two data-parallel loops (the batch and
    the channel/row axis) fused into one parallel loop and, if elementwise, its last axis vectorised
    (split by the largest power of two dividing it, up to the SIMD width).  The nests of a
    :data:`ROW_LOCAL_OPS` kernel, and those of each :data:`ROW_GROUPS` group, are then merged into
    one parallel loop.  The Winograd weight transforms of ``sf_conv_weights`` (and the weights they
    transform) get :func:`~.winograd.schedule_weight_transforms` instead."""
    lanes = simd_lanes(target)
    done = schedule_weight_transforms(sch, lanes)  # Winograd-transformed conv weights (sf_conv_weights)
    attrs = sch.mod["main"].attrs
    op = str(attrs.get(OP_ATTR, "")) if attrs is not None else ""
    everything = _Merge([], []) if op in ROW_LOCAL_OPS else None  # a row-local kernel: all its nests
    groups: dict[str, _Merge] = {}  # block name -> its group's merge
    for names in ROW_GROUPS.get(op, ()):
        shared = _Merge([], [])
        groups.update({name: shared for name in names})

    def merge_of(name: str) -> _Merge | None:
        return everything if everything is not None else groups.get(name)

    root = sch.get_sblock("root")
    for block in list(sch.get_child_blocks(root)):
        name = sch.get(block).name_hint
        if name.startswith("bar"):
            _schedule_pooling(sch, block, lanes, merge_of(name))
    nests: dict[Any, Any] = {}
    for block in sch.get_child_blocks(root):
        name = sch.get(block).name_hint
        if name.startswith(("bar", "cols")) or name in done:
            continue
        nests.setdefault(sch.get_sref(sch.get_loops(block)[0]), block)
    for block in nests.values():
        loops = sch.get_loops(block)  # now: an rfactor of an earlier nest renews the loops of the others
        name = sch.get(block).name_hint
        merge = merge_of(name)
        if name in MATMUL_BLOCKS and len(loops) == 4:
            _tiled_product(sch, block, lanes)
            continue
        if name in VECTOR_ROW_BLOCKS:
            _vector_rows(sch, block, lanes, merge)
            continue
        if _vector_reduction(sch, block, loops, lanes, merge=merge):
            continue
        spatial = sum(1 for iv in sch.get(block).iter_vars if int(iv.iter_type) == 0)
        lead = loops[:max(1, min(2, spatial))]
        fused = sch.fuse(*lead) if len(lead) > 1 else lead[0]
        if merge is not None:
            merge.leads.append(fused)
        else:
            sch.parallel(fused)
        if spatial == len(loops) > 2 and vectorizable(sch, [block]):  # elementwise: vectorise the last axis
            last = loops[-1]
            if len(loops) == 4 and pow2_divisor(static_extent(sch, loops[2]) * static_extent(sch, last), lanes
                                                ) > pow2_divisor(static_extent(sch, last), lanes):
                last = sch.fuse(loops[2], last)  # a row's 8 x 8 positions: vectors of 16, not 8
            vec = vector_width(sch, last, lanes)  # the factor axis may be symbolic (k16 * 16)
            if vec > 1:
                sch.vectorize(sch.split(last, [None, vec])[1])
    merges = [everything] if everything is not None else list({id(m): m for m in groups.values()}.values())
    for group in merges:
        group.finish(sch)


def _schedule_pooling(sch: s_tir.Schedule, bar: Any, lanes: int, merge: _Merge | None = None) -> None:
    """One pooled view of ``sf_conv_load`` (``cols`` → ``bar``): one parallel loop over (batch x
    channel) computing that channel's ``cols`` (``KH x W``, a thread-private stack tile: the
    output-row sum with the rows outer and the unit-stride ``x`` vectorised, no horizontal sums)
    and its ``KH x KW`` means (the ``x`` reduction with vector partial sums,
    :func:`_vector_reduction`).  Reads each input once, memory-bound.  ``merge``: the (batch x
    channel) loop is left serial and added to it (as are the inits to split off)."""
    cols = sch.get_producers(bar)[0]
    if not _vector_reduction(sch, bar, sch.get_loops(bar), lanes, merge=merge):
        b, ch, *_ = sch.get_loops(bar)
        fused = sch.fuse(b, ch)
        if merge is None:
            sch.parallel(fused)
        else:
            merge.leads.append(fused)
    fused = sch.get_loops(bar)[0]
    sch.compute_at(cols, fused)
    xx, y = sch.get_loops(cols)[-2:]  # (kernel row,) x, output row (a kernel row of 1 has no loop)
    sch.reorder(y, xx)
    if vectorizable(sch, [cols]):
        vec = pow2_divisor(static_extent(sch, xx), lanes)
        if vec > 1:
            sch.vectorize(sch.split(xx, [None, vec])[1])
    if merge is None:
        sch.decompose_reduction(cols, y)
    else:
        merge.deferred.append((cols, _depth(sch, cols, y)))


def _vector_rows(sch: s_tir.Schedule, block: Any, lanes: int, merge: _Merge | None = None) -> None:
    """A :data:`VECTOR_ROW_BLOCKS` block ``(lead..., o | reductions)``: the reductions moved outside
    ``o``, which is vectorised (and its vectors unrolled), the accumulators a thread-private tile of
    one row of ``o`` (``cache_write``), the leading loops fused into the parallel loop (``merge``:
    into a serial loop added to it, the init split off after the merge)."""
    loops = sch.get_loops(block)
    n_spatial = sum(1 for iv in sch.get(block).iter_vars if int(iv.iter_type) == 0)
    *lead, last = loops[:n_spatial]
    reductions = loops[n_spatial:]
    n = static_extent(sch, last)
    vec = pow2_divisor(n, lanes) if vectorizable(sch, [block]) else 1
    tile = sch.cache_write(block, 0, "global")
    sch.reorder(*lead, *reductions, last)
    par = sch.fuse(*lead) if len(lead) > 1 else lead[0]
    if merge is None:
        sch.parallel(par)
    else:
        merge.leads.append(par)
    sch.reverse_compute_at(tile, par)
    vectorize_inner(sch, tile, lanes, below=par)
    if vec > 1:
        outer, inner = sch.split(last, [None, vec])
        if n // vec <= register_budget(lanes):
            sch.unroll(outer)
        sch.vectorize(inner)
    if merge is None:
        sch.decompose_reduction(block, reductions[0])
    else:
        merge.deferred.append((block, _depth(sch, block, reductions[0])))


def _tiled_product(sch: s_tir.Schedule, block: Any, lanes: int) -> None:
    """A :data:`MATMUL_BLOCKS` product ``out[b, o, n] = Σ_r x[b, o, r]·y[b, r, n]`` as register
    tiles: ``om`` rows x ``jm`` vectors of the unit-stride ``n`` accumulated over the whole ``r``
    in a thread-private tile (``cache_write``, written back after the reduction), rows and vectors
    unrolled; the parallel loop runs over (batch x row tiles x column tiles), so batch 1 has
    ``O/om · N/(jm·vec)`` tasks.  Per ``r``: ``jm`` vector loads of ``y``, ``om`` broadcasts of
    ``x``, ``om·jm`` FMAs -- instead of a load and a store of the accumulator per FMA when a whole
    row of ``n`` is the accumulator.  ResNet-20's ``sf_gram`` of add_6 (64 rows x 320 factors),
    each kernel timed alone, one thread: 322 -> 146 us at batch 10, 31 -> 13 us at batch 1 (~40
    GFMA/s, compute-bound)."""
    b, o, n, r = sch.get_loops(block)
    n_ext, o_ext = extent(sch, n), static_extent(sch, o)  # n: a factor axis may be symbolic (k16 * 16)
    vec = vector_width(sch, n, lanes) if vectorizable(sch, [block]) else 1
    jm = divisor_at_most(n_ext // vec, 2) if n_ext is not None else 1
    om = divisor_at_most(o_ext, max(1, register_budget(lanes) // jm))
    tile = sch.cache_write(block, 0, "global")
    oo, oi = sch.split(o, [None, om])
    no, nm, nv = sch.split(n, [None, jm, vec])
    sch.reorder(b, oo, no, r, oi, nm, nv)
    par = sch.fuse(b, oo, no)
    sch.parallel(par)
    sch.reverse_compute_at(tile, par)
    vectorize_inner(sch, tile, lanes, below=par)
    sch.unroll(oi)
    sch.unroll(nm)
    if vec > 1:
        sch.vectorize(nv)
    sch.decompose_reduction(block, r)


def _vector_reduction(sch: s_tir.Schedule, block: Any, loops: list[Any], lanes: int,
                      merge: _Merge | None = None) -> bool:
    """Schedule a block whose reductions are its innermost loops (a row sum: the positions' mean of
    Stein's terms, ``‖ℓ‖²`` over the factors, a branch's mean profile, the weight-variance sum over
    channels and kernel offsets; several reduction loops are fused into one) with ``vec`` partial sums:
    the reduction split into ``(r_o, r_i)`` with ``r_i`` the largest power of two dividing it (up to
    the SIMD width), ``rfactor`` over ``r_i`` so the partial sums are a vector (``r_i`` vectorised,
    ``r_o`` serial), then the ``vec`` partial sums added per row under the same parallel loop.  A
    serial float32 sum is one dependent add per element (the adder's latency, ~4 cycles); this is
    ``vec`` independent ones per vector (measured 143 → 5 µs for a (10, 16, 1024) row mean, one
    thread).  Changes the summation order only.  False (nothing done) for any other block.

    ``merge``: the loop is neither parallelised nor the partial sums' init split off; the loop and
    the partial-sum block are added to ``merge``, which does both after merging its loop nests."""
    kinds = [int(iv.iter_type) for iv in sch.get(block).iter_vars]
    n_spatial = kinds.index(2) if 2 in kinds else len(kinds)
    if (len(kinds) != len(loops) or n_spatial == 0 or n_spatial == len(kinds)
            or any(k != 0 for k in kinds[:n_spatial]) or any(k != 2 for k in kinds[n_spatial:])):
        return False
    sizes = [extent(sch, loop) for loop in loops[n_spatial:]]
    if None in sizes:  # a symbolic factor axis (k16 * 16): vectors if it is the only reduction
        if len(sizes) > 1:
            return False
        vec = vector_width(sch, loops[n_spatial], lanes)
        length = 2 * vec  # at least one vector (the widths are >= FACTOR_ALIGN)
    else:
        length = math.prod(s for s in sizes if s is not None)
        vec = pow2_divisor(length, lanes)
    if vec < 4 or length < 2 * vec or not vectorizable(sch, [block]):
        return False
    # several trailing reductions (e.g. over channel and kernel offsets) are one row-major sum
    reduction = sch.fuse(*loops[n_spatial:]) if len(loops) - n_spatial > 1 else loops[-1]
    inner = sch.split(reduction, [None, vec])[1]
    partial = sch.rfactor(inner, factor_axis=n_spatial)  # loops: spatial..., r_o, r_i (new handles)
    lead = sch.get_loops(partial)[:min(2, n_spatial)]
    fused = sch.fuse(*lead) if len(lead) > 1 else lead[0]
    if merge is None:
        sch.parallel(fused)
    sch.vectorize(sch.get_loops(partial)[-1])
    if merge is None:
        sch.decompose_reduction(partial, sch.get_loops(partial)[-2])
    else:
        merge.leads.append(fused)
        merge.deferred.append((partial, 2))
    sch.reverse_compute_at(block, fused)
    # the sum of the partial sums: lanes innermost, so each output sums one contiguous vector (with
    # the lanes outer, LLVM turns the loop over several outputs, e.g. the 3 x 3 of a pooled view,
    # into gathers: more code, and ResNet-20's layers.0 sf_conv_load 36 -> 26 us at batch 10)
    loops = sch.get_loops(block)
    inner = loops[len(loops) - _depth(sch, block, fused) + 1:]  # (lane, spatial...)
    if len(inner) > 1:
        sch.reorder(*inner[1:], inner[0])
    return True


schedule(*(f"sf_{part}" for part in PARTS))(schedule_shared)
# the profile convolution has the mean-field conv kernel's blocks (pad, conv2d, epilogue) and layout
schedule("sf_conv_profile")(schedule_conv2d)
