"""The TVM side of shared-factor PFP (:mod:`pyro2pfp.correlation`): the step that emits each layer's
rule kernels, the TE helpers the rules are written with, and the compaction kernels.

A plan with factors (``graph.factors``) is emitted as the mean-field kernels of every layer plus,
after each, the kernels of its shared-factor rule (:class:`SharedStep`, called by
``emit.emit_module``; the rules: :data:`~pyro2pfp.planning.registry.SHARED_KERNELS`, registered with each op
in ``backends/tvm/ops/<family>.py``), which carry the profile ``s`` (B, *edge shape) and the loadings
``g`` (B, rows, K) beside ``(μ, v)`` and replace ``v`` where the rule corrects it (dense, add, average
pooling) -- except where a rule computes the layer's mean-field outputs too (ReLU's ``sf_relu``,
:meth:`SharedStep.emits_mean_field`: the emitter then emits no mean-field kernel for the layer).
The rules are those of the float64 reference, as float32 TE expressions of the same formulas:

* every loading ``ℓ`` is normalised (``‖ℓ‖`` and ``g = ℓ/‖ℓ‖``, 0 where ``ℓ = 0``:
  :func:`normalised`) inside the kernel that computes it, and every profile is clipped to ``±sd`` of
  its edge, as in the reference executor;
* each PrimFunc has the op attribute ``sf_<part>`` (:func:`emit_part`) and the default schedule
  :func:`~pyro2pfp.backends.tvm.shared_factor_schedule.schedule_shared`; the elementwise rules (relu,
  add, scale) index the ``(B, C, H, W)`` edges directly (rows = channels), so no reshape is emitted
  around them.

One kernel per rule (three per conv layer, two of them the weights and the profile convolution; a
ReLU's rule and its mean-field moments are one kernel): ResNet-20 (static batch) calls 143 kernels
per input (146 ``call_tir``).

**Static K, compaction by Cholesky**: every edge carries the factor columns of
:func:`~pyro2pfp.correlation.factors.fixed_k_plan` (``compaction=True``: the reference's compaction
points, ``K`` rounded up to whole SIMD vectors with zero columns).  Where the reference replaces ``g``
by ``Rᵀ`` of its QR factorisation, the kernels compute the Gram matrix ``g·gᵀ`` (``sf_gram``) and its
Cholesky factor ``L`` (``sf_cholesky``, :func:`cholesky_factor`, hand-written TIR in float64) -- the
same ``g·gᵀ``, which is all that is used downstream, so the results are the reference's up to float32
rounding and ``K`` stays bounded by a few times the channel count instead of growing with depth.

**Kernels generic in K**: ``sf_conv_load``, ``sf_relu`` and ``sf_add`` take the factor widths (in units
of ``FACTOR_ALIGN``) and the layer's factor offset as scalar arguments (:func:`emit_width_generic`),
so layers that differ only in them share one kernel (:mod:`.sharing`): fewer distinct PrimFuncs,
so less compile time.  Their per-row loadings are expressions, not buffers
(:func:`widened_column`, ``normalised`` of a function): a row buffer of symbolic size is a workspace
allocation per row, and a lane-wise clamp of a symbolic index is a gather.  A static-batch build binds
the scalars per call site (:func:`~pyro2pfp.backends.tvm.tuning.specialize.bind_scalar_arguments`), so its kernels
are the constant-``K`` ones, scheduled and tuned as before.  Not compiled (an ``ArgumentError`` naming
the layer): the raw-moment plan.

**``injection='rescaled'``**: a noisy conv layer's mean-field kernel also returns its weight-noise term
``Σ V·E[x²] + v_bias`` (:meth:`SharedStep.needs_weight_noise`, ``ops/compute.py``: the variance's two
sums kept apart, the same multiply-adds), and its rule scales that term's root to the injection's
spatial mean instead of convolving the input mean with the regression weights: ``sf_conv_load``
computes the scale, ``sf_conv_profile`` adds ``scale·√term`` in its epilogue -- a layer without a
shared input has no weights or profile kernel at all (its load kernel writes the profile).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
from tvm import relax, te, tirx
from tvm.sym.analyzer import Analyzer

from ...correlation.backend import FixedKStep
from ...correlation.factors import FACTOR_ALIGN, aligned
from ...planning.plan import PlannedLayer
from ...planning.registry import OPS, SHARED_KERNELS
from . import kernel_memo
from .emit import LAYER_ATTR, OP_ATTR, SCHEME_STEPS, EmitContext
from .fast_math import F32
from .kernel_memo import check_same
from .schedules import schedule
from .shared_factor_schedule import schedule_shared


def f32(value: float) -> tirx.PrimExpr:
    return tirx.const(value, F32)



@dataclass
class SharedRelax:
    """The shared part of one edge in the Relax graph: ``s`` (B, *edge shape), ``g`` (B, rows, k)."""

    s: relax.Expr
    g: relax.Expr
    k: int


def emit_part(ctx: EmitContext, fn: Any, args: list[relax.Expr], layer: PlannedLayer, part: str) -> list[relax.Expr]:
    """One TE function as the PrimFunc ``pfp_sf_<part>_<layer>`` (op attribute ``sf_<part>``)."""
    return ctx.emit_kernel(fn, args, f"pfp_sf_{part}_{layer.name}", {OP_ATTR: f"sf_{part}", LAYER_ATTR: layer.name})


@dataclass(frozen=True)
class FactorWidths:
    """The factor widths and offset one shared-factor kernel is specialised to at its call site, passed
    as scalar arguments (:func:`emit_width_generic`) so that layers that differ only in them share the
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


def emit_width_generic(ctx: EmitContext, fn: Any, args: list[relax.Expr], layer: PlannedLayer, part: str,
                        g_args: dict[int, int], k: int, offset: int) -> list[relax.Expr]:
    """:func:`emit`, but the PrimFunc does not depend on the factor widths or the offset: ``fn(*ts,
    widths=...)`` gets placeholders whose ``args[i]`` for ``i`` in ``g_args`` (a factor input, its
    ``K`` the value) have the symbolic last dimension ``widths.k_in16s[n]·FACTOR_ALIGN`` (``n``: its
    place in ``g_args``), and a :class:`FactorWidths` of symbolic scalars, which the call passes (the
    inputs' widths, ``k`` and ``offset``; every width a multiple of ``FACTOR_ALIGN``)."""
    widths_in = list(g_args.values())
    if any(w % FACTOR_ALIGN for w in (*widths_in, k)):
        raise ValueError(f"{layer.name}: factor widths {widths_in}, {k} are not multiples of {FACTOR_ALIGN}")
    attrs = {OP_ATTR: f"sf_{part}", LAYER_ATTR: layer.name}
    name = f"pfp_sf_{part}_{layer.name}"
    key = ctx.memo.key(fn, args, attrs, extra=("width-generic", tuple(g_args)), generic_last=tuple(g_args))
    made = ctx.memo.get(key)
    if made is None or kernel_memo.VERIFY:
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
        func = func.with_attrs(attrs)
        if made is not None:  # kernel_memo.VERIFY
            check_same(ctx.bb.get()[made[0]], func, name)
    if made is None:
        gv = ctx.bb.add_func(func, name)
        ctx.announce(gv)
        made = (gv, widths, [list(out.shape) for out in outs])
        ctx.memo.put(key, made)
    gv, widths, out_shapes = made
    values = dict(zip(widths.scalars, (*(w // FACTOR_ALIGN for w in widths_in), k // FACTOR_ALIGN, offset),
                      strict=True))
    analyzer = Analyzer()  # the outputs' shapes at this call: the scalars bound, the batch kept
    for var, value in values.items():
        analyzer.bind(var, tirx.IntImm("int64", value))
    out_ty = [relax.TensorType([analyzer.simplify(d) for d in shape], "float32") for shape in out_shapes]
    call = relax.call_tir(gv, [*args, *(relax.prim_value(tirx.IntImm("int64", int(v))) for v in values.values())],
                          out_ty if len(out_ty) > 1 else out_ty[0])
    return ctx.emit_outputs(call)


def view_as(ctx: EmitContext, t: relax.Expr, *shape: int) -> relax.Expr:
    """``t`` (B, ...) as (B, *shape): a reshape, or ``t`` itself when it has that shape already."""
    current = getattr(getattr(t, "ty", None), "shape", None)
    dims = getattr(current, "values", None)
    if dims is not None and len(dims) == len(shape) + 1 and all(
            isinstance(d, tirx.IntImm) and int(d) == n for d, n in zip(dims[1:], shape)):
        return t
    return ctx.bb.emit(relax.op.reshape(t, relax.ShapeExpr([ctx.batch, *shape])))


def safe_div(num: Any, den: Any) -> Any:
    return tirx.Select(den > f32(0.0), num / te.max(den, f32(1e-30)), f32(0.0))


def clip(s: Any, var: Any) -> Any:
    sd = te.sqrt(te.max(var, f32(0.0)))
    return te.min(te.max(s, -sd), sd)


def row_mean(t: te.Tensor, name: str) -> te.Tensor:
    """``mean_q t[b, r, q...]`` (B, R) of a (B, R, *group axes) tensor: the mean over a row's
    positions (its value when the row has no group axes)."""
    group = [int(d) for d in t.shape[2:]]
    if not group:
        return te.compute(t.shape[:2], lambda b, r: t[b, r], name=name)
    axes = [te.reduce_axis((0, d), name=f"{name}_q{i}") for i, d in enumerate(group)]
    inv = f32(1.0 / int(np.prod(group)))
    return te.compute(t.shape[:2], lambda b, r: te.sum(t[(b, r, *axes)] * inv, axis=axes), name=name)


def widened(g: te.Tensor, k: Any) -> te.Tensor:
    """``g`` (B, R, k_in) with zero columns up to ``k`` (either may be symbolic)."""
    k_in = g.shape[2]
    if isinstance(k_in, tirx.IntImm) and isinstance(k, int) and int(k_in) == k:
        return g
    return te.compute((g.shape[0], g.shape[1], k), widened_column(g), name="widened")


def widened_column(g: te.Tensor) -> Any:
    """``(b, r, f) ↦ g[b, r, f]`` for ``f < k_in``, else 0 (an expression, for any ``f ≥ 0``).  For a
    symbolic ``k_in`` (a multiple of FACTOR_ALIGN, as every width is) the test and the clamp are on
    the vector's index ``f // FACTOR_ALIGN``, the same for all its lanes, so a vectorised copy stays
    vector loads (a lane-wise ``min(f, k_in - 1)`` is a gather)."""
    k_in = g.shape[2]
    if isinstance(k_in, tirx.IntImm):
        return lambda b, r, f: tirx.Select(f < k_in, g[b, r, te.min(f, k_in - 1)], f32(0.0))
    chunks = tirx.floordiv(k_in, FACTOR_ALIGN)

    def column(b: Any, r: Any, f: Any) -> Any:
        chunk = tirx.floordiv(f, FACTOR_ALIGN)
        safe = te.min(chunk, chunks - 1) * FACTOR_ALIGN + tirx.floormod(f, FACTOR_ALIGN)
        return tirx.Select(chunk < chunks, g[b, r, safe], f32(0.0))

    return column


def row_products(a: te.Tensor, b: te.Tensor, k: Any) -> te.Tensor:
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


def normalised(loading: Any, shape: Any = None) -> tuple[te.Tensor, te.Tensor]:
    """``(g, ‖ℓ‖)`` of a loading ``ℓ`` (B, R, K) as TE stages of the kernel that computes ``ℓ``
    (no kernel of its own): ``p = max_f |ℓ_f|``, ``‖ℓ‖ = p·√(Σ_f (ℓ_f/p)²)`` and ``g = ℓ/‖ℓ‖``
    (as ``ℓ·(1/p)/√Σ``), 0 where ``p ≤`` :data:`NORM_FLOOR` -- the reference's
    ``correlation.shared_algebra.normalised`` in float32, finite up to ``|ℓ| ≈ FLT_MAX`` (the square of an
    entry above ~1.8e19 would overflow without the scale ``p``).  ``loading``: a tensor, or a function
    ``(b, r, f) ↦ ℓ`` of shape ``shape`` (no buffer: it is evaluated where each stage reads it)."""
    if isinstance(loading, te.Tensor):
        shape, tensor = loading.shape, loading
        loading = lambda b, r, f: tensor[b, r, f]  # noqa: E731
    rows, k = shape[:2], shape[2]
    f = te.reduce_axis((0, k), name="f_peak")
    peak = te.compute(rows, lambda b, r: te.max(te.abs(loading(b, r, f)), axis=f), name="peak")
    inv = te.compute(rows, lambda b, r: tirx.Select(peak[b, r] > f32(NORM_FLOOR), f32(1.0) / te.max(
        peak[b, r], f32(NORM_FLOOR)), f32(0.0)), name="inv_peak")
    f2 = te.reduce_axis((0, k), name="f_sq")
    sq = te.compute(rows, lambda b, r: te.sum(loading(b, r, f2) * inv[b, r] * loading(b, r, f2) * inv[b, r],
                                              axis=f2), name="sq")
    # sq = 0 exactly where inv = 0 (else the largest term is ~1): then norm = 0 and g = 0
    norm = te.compute(rows, lambda b, r: peak[b, r] * te.sqrt(sq[b, r]), name="norm")
    scale = te.compute(rows, lambda b, r: tirx.Select(sq[b, r] > f32(0.0), inv[b, r] / te.sqrt(
        te.max(sq[b, r], f32(NORM_FLOOR))), f32(0.0)), name="g_scale")
    g = te.compute(shape, lambda b, r, j: loading(b, r, j) * scale[b, r], name="g")
    return g, norm



class SharedStep(FixedKStep):
    """The shared-factor kernels of one plan, emitted after each layer's mean-field kernel (instead
    of it where :meth:`emits_mean_field`), each op's by its rule in
    :data:`~pyro2pfp.planning.registry.SHARED_KERNELS` (``backends/tvm/ops/<family>.py``)."""

    what = "the TVM back end"
    compaction = True
    rules = SHARED_KERNELS

    def needs_weight_noise(self, layer: PlannedLayer) -> bool:
        """Whether ``layer``'s rule reads its mean-field kernel's weight-noise term
        (``RelaxActivation.weight_noise``): a noisy conv layer of an ``injection='rescaled'`` plan,
        whose rule rescales that term's root instead of computing the regression profile."""
        return (self.fp.injection == "rescaled" and layer.op in OPS and OPS[layer.op].factor_spec.rescales_weight_noise
                and layer.name in self.fp.offsets)

    # ------------------------------------------------------------------ helpers
    def natural(self, ctx: EmitContext, name: str) -> bool:
        """Whether the rows of edge ``name`` are its first axis (every edge but a flattened one)."""
        return ctx.shapes[name][0] == self.fp.rows[name]

    def by_rows(self, ctx: EmitContext, t: relax.Expr, name: str) -> relax.Expr:
        """``t`` (B, *shape of edge ``name``) as (B, rows, *group axes): ``t`` itself when the rows
        are its first axis (the kernels index it directly, no reshape), else a (B, rows, group)
        view."""
        if self.natural(ctx, name):
            return t
        rows = self.fp.rows[name]
        return view_as(ctx, t, rows, int(np.prod(ctx.shapes[name])) // rows)

    def as_edge(self, ctx: EmitContext, t: relax.Expr, name: str) -> relax.Expr:
        """The inverse of :meth:`by_rows`: ``t`` back in the shape of edge ``name``."""
        return t if self.natural(ctx, name) else view_as(ctx, t, *ctx.shapes[name])


    # ------------------------------------------------------------------ compaction
    def compact(self, ctx: EmitContext, layer: PlannedLayer, sh: SharedRelax) -> SharedRelax:
        """``g`` (B, R, K) → ``L`` (B, R, aligned(R)), the Cholesky factor of ``g·gᵀ`` (zero columns
        beyond ``R``): the same ``g·gᵀ``, which is all that is used downstream (exact, as the
        reference's QR compaction ``Rᵀ``, which equals ``L`` up to the signs of its columns)."""
        rows, k = self.fp.rows[layer.name], sh.k

        gram = emit_part(ctx, lambda gt: row_products(gt, gt, k), [sh.g], layer, "gram")[0]
        width = aligned(rows)
        key = ("sf_cholesky", rows, width)
        gv = ctx.memo.get(key)  # one kernel per shape
        if gv is None:
            func = cholesky_factor(rows, width).with_attrs({OP_ATTR: "sf_cholesky", LAYER_ATTR: layer.name})
            gv = ctx.bb.add_func(func, f"pfp_sf_cholesky_{layer.name}")
            ctx.announce(gv)
            ctx.memo.put(key, gv)
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
    written TIR, marked scheduled: :func:`cholesky_template` specialised to ``(rows, width)``."""
    gram, out = _cholesky_template().params
    n, r, w = tirx.Var("n", "int64"), tirx.IntImm("int64", rows), tirx.IntImm("int64", width)
    return _cholesky_template().specialize({gram: tirx.decl_buffer((n, r, r), "float32", name="gram"),
                                            out: tirx.decl_buffer((n, r, w), "float32", name="out")})


@functools.cache
def _cholesky_template() -> tirx.PrimFunc:
    """:func:`cholesky_factor` with symbolic ``R`` and ``width``, parsed once per process: parsing
    TVMScript is slow (the decorator's ``inspect.stack()`` reads the source of every frame of the
    caller's stack) and specialising is cheap, while a deep residual net compacts at every block
    boundary with only a few distinct shapes."""
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

# the Gram matrix of a compaction; sf_cholesky is hand-written TIR, marked scheduled
schedule("sf_gram")(schedule_shared)
