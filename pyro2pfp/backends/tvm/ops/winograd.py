"""Winograd F(2x2, 3x3) kernels of the mean-field PFP conv2d (3x3, stride 1, padding 1), chosen by
:func:`use_winograd` for the layers where it is faster than the direct kernel of
``compute.conv2d`` (``benchmarks/conv_throughput.py`` compares them), and of the shared-factor profile
convolution of the same layers (``compute_shared.py``, see the end of this docstring).

The PFP conv with a variance input computes three convolutions of the same input window
(``docs/math.md`` "Compute layers", variance form)::

    μ = conv(μw, μx) + μb,     v = conv(μw², vx) + conv(vw, μx² + vx) + vb

Each is a linear convolution, so each can use Winograd's minimal filtering algorithm (Lavin & Gray,
"Fast Algorithms for Convolutional Neural Networks", CVPR 2016, F(2x2, 3x3)): a 2x2 output tile is
``Aᵀ [Σ_c (G g_c Gᵀ) ⊙ (Bᵀ d_c B)] A`` with ``d_c`` the 4x4 input tile of channel ``c`` and ``g_c``
its 3x3 filter -- 16 multiplies per tile and channel pair instead of 36.  The three filter
transforms ``G·W·Gᵀ`` of ``μw``, ``μw²`` and ``vw`` are constants, computed in float64 at emit time
(:func:`filter_transform`); the two variance products accumulate into one transform-domain sum
(the output transform is linear), so per layer: three input transforms (``μx``, ``vx``,
``μx² + vx``), one tuple-reduction batched GEMM (mean, variance) over the 16 transform positions,
two output transforms.

Numerics: with these F(2, 3) matrices every rounding of an output involves only the values of its
own 3x3 window (the tile column/row an output does not see enters only transform positions its
``Aᵀ`` row weights by an exact 0), so the float32 bound of the direct kernel holds per output and
an output whose window has zero variance gets exactly 0 (tests/ops/compute/test_winograd.py).  The transformed
``μw²`` and ``vw`` filters have negative entries, so a variance that is ~0 could round slightly
negative; the epilogue clamps it at 0 like the direct kernel's.

Stages of the one TE function (block names, scheduled by :func:`schedule_winograd`):

* ``wino_pad_m``, ``wino_pad_v`` -- the zero-padded ``μx``, ``vx``, transposed to NHWC;
* ``wino_in_m``, ``wino_in_v``, ``wino_in_s`` -- ``D[n, th, e, u, tw, c] = (Bᵀ d B)[e, u]`` of
  tile ``(th, tw)`` of ``μx``, ``vx`` and ``μx² + vx``;
* ``wino_gemm`` -- ``M[n, th, e, u, tw, o] = Σ_c D·U`` (tuple reduction: mean and variance);
* ``wino_out_m``, ``wino_out_v`` -- ``Y[n, y, x, o] = (Aᵀ M A)`` of the tile holding ``(y, x)``;
* ``epilogue`` -- bias, variance clamp, representation conversion, back to NCHW.

Its speed against the direct kernel: ``benchmarks/conv_throughput.py`` (about half of the Winograd
kernel's time is the GEMM; the rest is mostly the NCHW <-> NHWC transposes of pad and epilogue,
which TVM emits as per-lane gathers).

**Shared-factor profile convolution** (``sf_conv_profile`` of ``compute_shared.py``, on the layers of
:func:`winograd_shape`): ``s = clip(Σ_c conv(A_c, s_in) + conv(M_c, μ) + shift, ±sd)`` with weights
``A``, ``M`` (B, C, 3, 3, O) that differ per input, so their transforms ``U = G·w·Gᵀ`` are computed
at run time, per input, by the kernel that builds them (``sf_conv_weights``,
:func:`weight_transform`: two separable stages of ≤ 3 terms, per (input, input channel) in
thread-private buffers, :func:`schedule_weight_transforms`) -- ``O·C·28`` multiply-adds per input
and term against the GEMM's ``O·C·16·tiles``.  :func:`winograd_correlation` is the conv: blocks
``wino_pad_k``, ``wino_in_k`` per input tensor (``s_in``, ``μ``), one ``wino_gemm`` summing both
terms, ``wino_out_s``; the caller's ``epilogue`` adds the shift and clips.  Same schedule
(:func:`schedule_winograd`); the weight operand has a batch index, and the parallel loop runs over
the batch, so every chunk of tiles reads its own input's ``U`` (``16·C·O`` floats per term).  The
profile is signed and not clamped (only the ±sd clip of the epilogue); the per-output rounding
property above holds as well (it depends on ``Bᵀ`` and ``Aᵀ`` only), so a zero profile with zero
mean weights gives exactly 0 (tests/ops/compute/test_winograd_profile.py).  Its speed per call:
``benchmarks/kernel_profile.py --net resnet20 --kernels``.
"""
from __future__ import annotations

import functools
import operator
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import tvm
from tvm import s_tir, te, tirx

from ....planning.graph import Repr
from ....planning.plan import PlannedLayer
from ..emit import EmitContext, RelaxActivation, pair_sum, triple_sum
from ..fast_math import F32
from ..schedules import divisor_at_most, pow2_divisor, register_budget, simd_lanes, static_extent, vectorize_inner

TILE = 2  # output tile m of F(m x m, 3 x 3)
ALPHA = TILE + 2  # input tile (transform size)

# Lavin & Gray (2016), F(2, 3): y = Aᵀ[(G g) ⊙ (Bᵀ d)]
WINO_BT = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], dtype=np.float64)
WINO_G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], dtype=np.float64)
WINO_AT = np.array([[1, 1, 1, 0], [0, 1, -1, -1]], dtype=np.float64)

MIN_CHANNELS = 16
"""Winograd only with at least this many input and output channels: the transforms cost
``O((C + O)·α²)`` per tile against the GEMM's ``O(C·O·α²)``, so its advantage shrinks with the
channel count; 16 channels is the smallest count at which it still beats the direct kernel
(``benchmarks/conv_throughput.py``)."""


_enabled = [True]


@contextmanager
def direct_convolutions() -> Iterator[None]:
    """Within this context :func:`winograd_shape` (so :func:`use_winograd`) is False: modules emitted
    meanwhile use the direct conv kernels everywhere -- the mean-field conv and the shared-factor
    profile convolution (for benchmarks and tests comparing the two)."""
    _enabled.append(False)
    try:
        yield
    finally:
        _enabled.pop()


def winograd_shape(layer: PlannedLayer) -> bool:
    """Whether the conv ``layer`` has the shape Winograd F(2x2, 3x3) is used for (and
    :func:`direct_convolutions` is not in force): a 3x3 stride-1 padding-1 undilated ungrouped conv
    with at least :data:`MIN_CHANNELS` input and output channels, a multiple of 16 output channels
    (whole AVX-512 vectors) and an even output height and width (whole 2x2 tiles)."""
    if not _enabled[-1] or layer.op != "conv2d":
        return False
    a = layer.layer.attrs
    o, c, kh, kw = layer.tensors["weight_mean"].shape
    _, h, wd = layer.layer.out_shape
    return (kh == kw == 3 and list(a["stride"]) == [1, 1] and list(a["padding"]) == [1, 1]
            and list(a["dilation"]) == [1, 1] and a["groups"] == 1 and c >= MIN_CHANNELS
            and o >= MIN_CHANNELS and o % 16 == 0 and h % TILE == 0 and wd % TILE == 0)


def use_winograd(layer: PlannedLayer, x_repr: Repr) -> bool:
    """Whether the mean-field conv ``layer`` (input in ``x_repr``) gets the Winograd kernel: a
    :func:`winograd_shape` conv of a variance input (variance plan: ``vw`` stored)."""
    return x_repr is Repr.VARIANCE and "weight_var" in layer.tensors and winograd_shape(layer)


def filter_transform(w: np.ndarray) -> np.ndarray:
    """``G·w·Gᵀ`` of OIHW 3x3 filters ``w`` (float64), as ``(α, α, C, O)`` float32."""
    u = np.einsum("ek,ockl,ul->euco", WINO_G, w.astype(np.float64), WINO_G)
    return np.ascontiguousarray(u, dtype=np.float32)


def _select(e: Any, u: Any, exprs: dict[tuple[int, int], Any]) -> Any:
    """The expression of position ``(e, u)`` (constant after the schedule unrolls ``e`` and ``u``,
    so the ``Select`` chain folds away)."""
    def chain(var: Any, values: list) -> Any:
        out = values[-1]
        for k in range(len(values) - 2, -1, -1):
            out = tirx.Select(var == k, values[k], out)
        return out

    n_e = 1 + max(k[0] for k in exprs)
    n_u = 1 + max(k[1] for k in exprs)
    return chain(e, [chain(u, [exprs[(i, j)] for j in range(n_u)]) for i in range(n_e)])


def _int_type(var: Any) -> str:
    """The integer type of a TE index variable (int64 for the Relax-emitted shapes)."""
    return str(var.ty)


def _row_terms(mat: np.ndarray, row: Any) -> list[tuple[Any, Any]]:
    """The nonzero entries of row ``row`` (a loop variable) of ``mat`` as ``[(column, coefficient)]``
    TIR expressions: the k-th nonzero of each row, chosen by a scalar ``Select`` chain over ``row``
    (rows with fewer nonzeros get coefficient 0).  Evaluated once per row in the loop, they let
    the transform loop stay rolled (one generic body instead of one unrolled copy per position,
    which would make LLVM's compile of each kernel much slower) at the price of a broadcast multiply per term."""
    nonzero = [[(j, float(mat[i, j])) for j in range(mat.shape[1]) if mat[i, j] != 0] for i in range(mat.shape[0])]
    width = max(len(r) for r in nonzero)
    terms = []
    for k in range(width):
        entries = [r[k] if k < len(r) else (0, 0.0) for r in nonzero]
        col: Any = tirx.const(entries[-1][0], _int_type(row))
        coef: Any = tirx.const(entries[-1][1], F32)
        for i in range(len(entries) - 2, -1, -1):
            col = tirx.Select(row == i, tirx.const(entries[i][0], _int_type(row)), col)
            coef = tirx.Select(row == i, tirx.const(entries[i][1], F32), coef)
        terms.append((col, coef))
    return terms


def _sum(terms: Iterable[Any]) -> Any:
    """``((t0 + t1) + t2) + …`` of a non-empty sequence of TIR expressions (left to right)."""
    return functools.reduce(operator.add, terms)


def _bilinear(mat_l: np.ndarray, mat_r: np.ndarray, load: Any) -> dict[tuple[int, int], Any]:
    """``{(e, u): Σ_ab mat_l[e, a]·mat_r[u, b]·load(a, b)}`` with the zero terms left out and unit
    coefficients not multiplied."""
    out = {}
    for e in range(mat_l.shape[0]):
        for u in range(mat_r.shape[0]):
            acc = None
            for a in range(mat_l.shape[1]):
                for b in range(mat_r.shape[1]):
                    coef = float(mat_l[e, a] * mat_r[u, b])
                    if coef == 0.0:
                        continue
                    term = load(a, b)
                    if coef == -1.0:
                        acc = -term if acc is None else acc - term
                        continue
                    if coef != 1.0:
                        term = term * tirx.const(coef, F32)
                    acc = term if acc is None else acc + term
            out[(e, u)] = acc if acc is not None else tirx.const(0.0, F32)
    return out


def pad_nhwc(x: te.Tensor, name: str, value: Any = None) -> te.Tensor:
    """``x`` (B, C, H, W) zero-padded by 1 and transposed to NHWC (B, H + 2, W + 2, C);
    ``value(b, c, y, x)`` (default: ``x[b, c, y, x]``) is what is padded."""
    batch, chans, h, w = x.shape
    load = value if value is not None else (lambda *i: x[i])

    def f(n, y, xx, c):
        inside = tirx.all(y >= 1, y <= h, xx >= 1, xx <= w)
        return tirx.if_then_else(inside, load(n, c, y - 1, xx - 1), tirx.const(0.0, F32))

    return te.compute((batch, h + 2, w + 2, chans), f, name=name)


def input_transform(value: Any, like: te.Tensor, name: str) -> te.Tensor:
    """``D[n, th, e, u, tw, c] = (Bᵀ d B)[e, u]`` of the 4x4 tile ``d`` at tile ``(th, tw)`` of the
    padded NHWC input ``value(n, y, x, c)`` (shape of ``like``, a :func:`pad_nhwc` tensor)."""
    batch, hp, wp, chans = like.shape

    def f(n, th, e, u, tw, c):
        return _sum(value((n, th * TILE + a, tw * TILE + b, c)) * (coef_a * coef_b)
                    for a, coef_a in _row_terms(WINO_BT, e) for b, coef_b in _row_terms(WINO_BT, u))

    return te.compute((batch, (hp - 2) // TILE, ALPHA, ALPHA, (wp - 2) // TILE, chans), f, name=name)


def output_transform(s: te.Tensor, name: str) -> te.Tensor:
    """``Y[n, y, x, o] = (Aᵀ S A)[y % 2, x % 2]`` of the transform-domain sums ``S`` (n, th, e, u, tw, o)
    of the tile holding ``(y, x)``: the NHWC output."""
    batch, n_h, _, _, n_w, out_c = s.shape

    def f(n, y, xx, o):
        th, i, tw, j = y // TILE, y % TILE, xx // TILE, xx % TILE
        return _select(i, j, _bilinear(WINO_AT, WINO_AT, lambda e, u: s[n, th, e, u, tw, o]))

    return te.compute((batch, n_h * TILE, n_w * TILE, out_c), f, name=name)


def winograd_conv(ctx: EmitContext, layer: PlannedLayer, x: RelaxActivation, epilogue_stage: Any,
                  weight_noise: bool = False) -> list:
    """Emit the Winograd PFP conv of ``layer`` (see the module docstring); returns its output
    tensors (mean, second) for ``activation_out``.  ``epilogue_stage``: the direct conv kernel's
    epilogue (``compute._epilogue_stage``: bias, variance clamp, representation), passed in so this
    module does not import ``compute`` (which imports it).  ``weight_noise``: the two variance
    products accumulate into two sums (a three-sum GEMM, the same multiply-adds, and a third output
    transform ``wino_out_n``), and the weight-noise term ``conv(vw, μx² + vx) + vb`` is a third
    output (``compute``'s module docstring)."""
    t = layer.tensors
    out_c, out_h, out_w = layer.layer.out_shape
    w_mean, w_var = t["weight_mean"], t["weight_var"]
    weights = [ctx.const(filter_transform(w)) for w in (w_mean, w_mean**2, w_var)]
    bias_args = [ctx.const(t[k]) for k in ("bias_mean", "bias_var") if k in t]

    def fn(xm: te.Tensor, xv: te.Tensor, um: te.Tensor, um2: te.Tensor, uv: te.Tensor,
           *bias: te.Tensor) -> list[te.Tensor]:
        batch, chans = xm.shape[:2]
        pm, pv = pad_nhwc(xm, "wino_pad_m"), pad_nhwc(xv, "wino_pad_v")
        d = [input_transform(value, pm, f"wino_in_{k}")
             for value, k in ((lambda i: pm[i], "m"), (lambda i: pv[i], "v"),
                              (lambda i: pm[i] * pm[i] + pv[i], "s"))]
        rc = te.reduce_axis((0, int(chans)), name="rc")

        def gemm(n, th, e, u, tw, o):
            dm, dv, ds = (p[n, th, e, u, tw, rc] for p in d)
            if weight_noise:  # (mean, Σ μw²·vx, Σ vw·(μx² + vx)) apart
                return triple_sum((dm * um[e, u, rc, o], dv * um2[e, u, rc, o], ds * uv[e, u, rc, o]), axis=rc)
            return pair_sum((dm * um[e, u, rc, o], ds * uv[e, u, rc, o] + dv * um2[e, u, rc, o]), axis=rc)

        acc = te.compute((*d[0].shape[:5], out_c), gemm, name="wino_gemm")
        y = [output_transform(s, f"wino_out_{k}") for s, k in zip(acc, "mvn")]
        return epilogue_stage(y[0], y[1], list(bias), 1, layer, shape=(batch, out_c, out_h, out_w),
                              activation=ctx.activation, index=lambda n, o, i, j: (n, i, j, o),
                              acc_noise=y[2] if weight_noise else None)

    return ctx.emit_te(fn, x.tensors() + weights + bias_args, layer)


# ------------------------------------------------------------------------------------ per-input weights
def weight_transform(w: te.Tensor, name: str) -> te.Tensor:
    """``U[b, e, u, c, o] = (G·w[b, c, :, :, o]·Gᵀ)[e, u]`` of per-input 3x3 filters ``w``
    (B, C, 3, 3, O) -- the run-time filter transform of a convolution whose weights differ per input
    (the shared-factor profile convolution, ``compute_shared.py``): two separable stages, ``G`` over
    the kernel rows (``{name}_rows``, (B, α, 3, C, O)) then over the columns, each output a sum of
    at most 3 terms chosen per row by :func:`_row_terms` (``O·C·(12 + 16)·3`` multiply-adds per
    input, against ``O·C·16·P/4`` for the GEMM over ``P`` output positions)."""
    batch, chans, kh, kw, out_c = w.shape

    h = te.compute((batch, ALPHA, kw, chans, out_c), lambda b, e, j, c, o: _sum(
        w[b, c, i, j, o] * coef for i, coef in _row_terms(WINO_G, e)), name=f"{name}_rows")
    return te.compute((batch, ALPHA, ALPHA, chans, out_c), lambda b, e, u, c, o: _sum(
        h[b, e, j, c, o] * coef for j, coef in _row_terms(WINO_G, u)), name=name)


def winograd_correlation(pairs: list[tuple[te.Tensor, te.Tensor]]) -> te.Tensor:
    """``Y[b, y, x, o] = Σ_k Σ_{c,i,j} w_k[b, c, i, j, o]·x_k[b, c, y + i − 1, x + j − 1]`` (3x3,
    padding 1, stride 1; NHWC) of inputs ``x_k`` (B, C, H, W) with per-input filters given by their
    transforms ``U_k`` (B, α, α, C, O) (:func:`weight_transform`), for ``pairs = [(x_k, U_k)]``:
    blocks ``wino_pad_k``, ``wino_in_k``, one GEMM ``wino_gemm`` summing every pair over ``c``,
    ``wino_out_s`` (scheduled by :func:`schedule_winograd`; the caller adds the ``epilogue``)."""
    padded = [pad_nhwc(x, f"wino_pad_{k}") for k, (x, _) in enumerate(pairs)]
    d = [input_transform(lambda i, p=p: p[i], p, f"wino_in_{k}") for k, p in enumerate(padded)]
    weights = [u for _, u in pairs]
    rc = te.reduce_axis((0, int(pairs[0][0].shape[1])), name="rc")

    def gemm(n, th, e, u, tw, o):
        return te.sum(_sum(dk[n, th, e, u, tw, rc] * uk[n, e, u, rc, o] for dk, uk in zip(d, weights)), axis=rc)

    acc = te.compute((*d[0].shape[:5], weights[0].shape[4]), gemm, name="wino_gemm")
    return output_transform(acc, "wino_out_s")


def _loops_below(sch: s_tir.Schedule, block: Any, loop: Any) -> list:
    """The loops of ``block`` nested inside ``loop``."""
    loops = list(sch.get_loops(block))
    srefs = [sch.get_sref(x) for x in loops]
    depth = next(k for k, ref in enumerate(srefs) if ref.same_as(sch.get_sref(loop)))
    return loops[depth + 1:]


WINO_MIN_TILES = 32
"""Tiles per parallel iteration at least (whole tile rows): the transformed weights of one
position ``(e, u)`` (``3·C·O`` floats) are reused by every tile of the chunk."""


def _blocks(sch: s_tir.Schedule, prefix: str) -> list:
    """The blocks of the function whose names start with ``prefix``, in order."""
    return [b for b in sch.get_child_blocks(sch.get_sblock("root")) if sch.get(b).name_hint.startswith(prefix)]


def schedule_winograd(sch: s_tir.Schedule, target: tvm.target.Target) -> None:
    """Schedule of a Winograd PrimFunc -- :func:`winograd_conv`'s or the shared-factor profile
    convolution's (:func:`winograd_correlation`; called by ``compute.schedule_conv2d``): blocks
    ``wino_pad_*``, ``wino_in_*``, ``wino_gemm`` (one or two sums), ``wino_out_*``, ``epilogue*``.

    The parallel loop runs over batch x chunks of whole tile rows (at least
    :data:`WINO_MIN_TILES` tiles); per chunk, in thread-private buffers: the padded NHWC input
    rows (``wino_pad_*``, vectorised over channels: per-lane gathers from NCHW), their transforms
    (``wino_in_*``, vectorised over input channels; the position loops stay rolled, each position
    a sum of 4 loads at offsets and with coefficients chosen per position, see
    :func:`_row_terms`), the GEMM -- for each
    position, a register tile of tiles x output-channel vectors (one accumulator per sum of the
    block) over ``rc`` -- the output transforms (vectorised over output channels, the 2x2 output
    positions unrolled) and the NCHW epilogue.  (The per-input weights of the profile convolution
    have a batch index: the parallel loop runs over it, so each chunk reads its input's weights.)
    """
    lanes = simd_lanes(target)
    budget = register_budget(lanes)
    gemm = sch.get_sblock("wino_gemm")
    n_acc = len(sch.get(gemm).writes)
    _, th, _, _, tw, o, _ = sch.get_loops(gemm)
    n_h, n_w, n_o = static_extent(sch, th), static_extent(sch, tw), static_extent(sch, o)
    rows = next(g for g in range(1, n_h + 1) if n_h % g == 0 and (g * n_w >= WINO_MIN_TILES or g == n_h))
    # the parallel loop: batch x chunks of output rows of the epilogue (the function's outputs);
    # every other stage is computed at it (their consumers' reads are not simple enough for
    # reverse_compute_at: the output transform reads the GEMM at constant positions)
    epilogue = _blocks(sch, "epilogue")
    n, eo, ey, ex = sch.get_loops(epilogue[0])
    yo, yi = sch.split(ey, [None, rows * TILE])
    sch.reorder(n, yo, eo, yi, ex)
    par = sch.fuse(n, yo)
    sch.parallel(par)
    for blk in epilogue:
        vectorize_inner(sch, blk, lanes, below=par)
    outs = _blocks(sch, "wino_out_")
    for blk in outs:
        sch.compute_at(blk, par)
    sch.compute_at(gemm, par)
    ins = _blocks(sch, "wino_in_")
    for blk in ins:
        sch.compute_at(blk, par)
    for pad in _blocks(sch, "wino_pad_"):
        sch.compute_at(pad, par)
        *_, lc = sch.get_loops(pad)
        c_vec = pow2_divisor(static_extent(sch, lc), lanes)
        if c_vec > 1:
            _, cv = sch.split(lc, [None, c_vec])
            sch.vectorize(cv)
    # GEMM: per position (e, u) and output-channel block, a register tile (tiles x channel
    # vectors, n_acc accumulators each) over rc
    *_, e, u, tw, o, rc = sch.get_loops(gemm)
    vec = pow2_divisor(n_o, lanes)
    om = divisor_at_most(n_o // vec, 2)
    oo, omm, ov = sch.split(o, [None, om, vec])
    twi = divisor_at_most(n_w, max(1, budget // (n_acc * om)))
    two, twii = sch.split(tw, [None, twi])
    inner = _loops_below(sch, gemm, par)
    thi = inner[0] if len(inner) == 10 else None  # a chunk of one tile row has no row loop
    sch.reorder(*[loop for loop in (e, u, oo, thi, two, rc, twii, omm, ov) if loop is not None])
    sch.unroll(twii)
    sch.unroll(omm)
    if vec > 1:
        sch.vectorize(ov)
    # input transforms: vectorised over channels (positions rolled: see _row_terms)
    for blk in ins:
        *_, lc = sch.get_loops(blk)
        c_vec = pow2_divisor(static_extent(sch, lc), lanes)
        if c_vec > 1:
            _, cv = sch.split(lc, [None, c_vec])
            sch.vectorize(cv)
    # output transforms: the 2x2 output positions unrolled, vectorised over output channels
    for blk in outs:
        *_, ly, lx, lo = sch.get_loops(blk)
        y_o, y_i = sch.split(ly, [None, TILE])
        x_o, x_i = sch.split(lx, [None, TILE])
        o_vec = pow2_divisor(static_extent(sch, lo), lanes)
        o_o, o_v = sch.split(lo, [None, o_vec])
        sch.reorder(y_o, x_o, y_i, x_i, o_o, o_v)
        sch.unroll(y_i)
        sch.unroll(x_i)
        if o_vec > 1:
            sch.vectorize(o_v)
    sch.decompose_reduction(gemm, rc)


def schedule_weight_transforms(sch: s_tir.Schedule, lanes: int) -> list[str]:
    """Schedule the :func:`weight_transform` blocks of a function (the shared-factor
    ``sf_conv_weights`` kernel; called by ``shared_factor_schedule.schedule_shared``): per transform, one
    parallel loop over (input, input channel), under which the per-input weights of that channel
    (the transform's producer, (KH, KW, O)), their row transforms (α, KW, O) and the transforms
    (α, α, O) are computed in thread-private buffers, each vectorised over ``o``.  Returns the
    names of the blocks scheduled (every block of those nests)."""
    done: list[str] = []
    for blk in _blocks(sch, "wino_w"):
        name = sch.get(blk).name_hint
        if name.endswith("_rows"):
            continue
        rows = sch.get_sblock(f"{name}_rows")
        sources = list(sch.get_producers(rows))  # none if the weights are an input
        b, e, u, c, o = sch.get_loops(blk)
        sch.reorder(b, c, e, u, o)
        par = sch.fuse(b, c)
        sch.parallel(par)
        vectorize_inner(sch, blk, lanes, below=par)
        sch.compute_at(rows, par)
        vectorize_inner(sch, rows, lanes, below=par)
        for source in sources:
            sch.compute_at(source, par)
            vectorize_inner(sch, source, lanes, below=par)
        done += [name, f"{name}_rows", *(sch.get(source).name_hint for source in sources)]
    return done
