"""Pooling: ``max_pool2d`` (Clark's pairwise Gaussian max over each window) and ``avg_pool2d`` (linear;
also global/adaptive average pooling and ``mean`` over (H, W)).  1-D pools are these pools on a
``(C, 1, L)`` input (:mod:`pyro2pfp.planning.onedim`); an adaptive pool is the regular pool with torch's windows
(:func:`adaptive_window`).

* Max pooling folds Clark's max of two Gaussians over each window in row-major order (``docs/math.md``
  "Max pooling").  With a second input -- the in-window covariances of a ``window_cov`` layer, which
  the planner inserts where a conv feeds the pool (:mod:`pyro2pfp.planning.correlated_pools`) -- the fold is
  Clark's *correlated* max, carrying the running maximum's covariance with the remaining taps
  (:func:`pyro2pfp.moments.correlated_window_max`); without it, the taps are taken as independent
  (:func:`pyro2pfp.moments.max_moments`, the paper's rule).  Positions outside the input (padding,
  ceil-mode overhang) hold the fold's exact identity ``(−MAX, 0)`` (``max_moments(−MAX, 0, μ, v) =
  (μ, v)``) and covariance 0.
* Average pooling: ``μ ↦ Σμ/d``, ``v ↦ Σv/d²`` with torch's divisor ``d`` per output position
  (``divisor``, ``count_include_pad``); padded positions are zeros.

The reference and the ONNX export are written separately here (ONNX has ``MaxPool``/``AveragePool``
and strided ``Slice``; NumPy folds strided views).  The TVM kernels and schedules are in
``backends/tvm/ops/pooling.py``.  Shared-factor PFP (:mod:`pyro2pfp.correlation`): the rules of
both ops (a formula each for the float64 reference and the ONNX export) are at the end of this file, their
TE kernels in ``backends/tvm/ops/pooling.py``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import moments
from ..backends.onnx.builder import LOWEST32, OnnxActivation, OnnxContext, Sym, exporter
from ..backends.reference import NUMPY_BACKEND, Activation, emit_output, reference
from ..backends.reference.arrays import LOWEST, average_divisor, padded, window_views
from ..correlation.backend import fuses_mean_field
from ..correlation.factors import FactorPlan
from ..correlation.loadings import CompactPlan, Loadings, TensorAlgebra
from ..correlation.onnx_step import OnnxSharedStep
from ..correlation.shared import Shared
from ..correlation.shared_algebra import SharedAlgebra, clip, total
from ..errors import UnsupportedLayerError
from ..planning.converters import register
from ..planning.graph import Layer, Repr
from ..planning.onedim import as_2d, out_shape
from ..planning.plan import PlannedLayer
from ..planning.registry import FactorSpec, OpDef, register_op, shared_exporter, shared_reference
from ._formula import compact_formula, shared_formula
from .compute import _pair

D = Repr.DETERMINISTIC

MAX_POOL2D = register_op(OpDef(
    "max_pool2d", ("aten.max_pool2d.default", "aten.max_pool2d_with_indices.default", "aten.max_pool1d.default",
                   "aten.max_pool1d_with_indices.default", "aten.adaptive_max_pool2d.default",
                   "aten.adaptive_max_pool1d.default", "aten.amax.default", "aten.max.dim"),
    modules="`MaxPool2d`, `MaxPool1d` (any kernel, stride, padding, `ceil_mode`), `AdaptiveMaxPool1d/2d` "
            "(windows of a regular pool, e.g. an output dividing the input), `x.amax(-1)`/`x.max(-1)` (global)",
    modules_short=("MaxPool1d/2d", "AdaptiveMaxPool1d/2d"),
    moments="Clark's max, exact for two inputs; in-window covariances from the conv that feeds it",
    assumptions="pairwise fold over the window in row-major order, the running max treated as Gaussian; "
                "a non-decreasing activation between conv and pool is applied after the pool (exact)",
    window_max=True))

AVG_POOL2D = register_op(OpDef(
    "avg_pool2d", ("aten.avg_pool2d.default", "aten.adaptive_avg_pool2d.default", "aten.mean.dim",
                   "aten.avg_pool1d.default", "aten.adaptive_avg_pool1d.default"),
    modules="`AvgPool2d`, `AvgPool1d`, `AdaptiveAvgPool1d/2d` (windows of a regular pool, e.g. an output "
            "dividing the input), `x.mean(-1)` of `(N, C, L)`, `x.mean((2, 3))`",
    modules_short=("AvgPool1d/2d", "AdaptiveAvgPool1d/2d"),
    moments="exact (linear)", assumptions="independent inputs",
    factor_spec=FactorSpec(mean_field_wrong=lambda layer, graph, conv_noise: _averages_conv_noise(layer, conv_noise))))


def _averages_conv_noise(layer: PlannedLayer, conv_noise: dict[str, bool]) -> str | None:
    """Why mean-field PFP is wrong for an average pool (None: it is fine): it averages positions of a conv
    output whose weight noise every position of a channel shares (divided by the window size as if
    independent)."""
    return f"{layer.layer.source} averages positions of a conv output" if conv_noise[layer.inputs[0]] else None


# ------------------------------------------------------------------------------------ reference
@reference("max_pool2d")
def max_pool2d(layer: PlannedLayer, inputs: list[Activation]) -> Activation:
    a, x = layer.layer.attrs, inputs[0]
    out_hw = layer.layer.out_shape[1:]
    means = window_views(padded(x.mean, a, out_hw, -np.inf if x.repr is D else LOWEST),
                         a["kernel"], a["stride"], out_hw)
    if x.repr is D:
        mean = next(means)
        for m in means:
            mean = np.maximum(mean, m)
        return Activation(mean, None, D)
    vars_ = window_views(padded(x.variance(), a, out_hw, 0.0), a["kernel"], a["stride"], out_hw)
    if len(inputs) == 2:  # in-window covariances (window_cov): Clark's correlated fold
        cov = inputs[1].mean
        pairs = moments.window_pairs(a["kernel"][0] * a["kernel"][1])
        mean, var = moments.correlated_window_max(
            list(zip(means, vars_)), {pair: cov[:, :, k] for k, pair in enumerate(pairs)})
        return emit_output(mean, var, layer)
    mean, var = next(means), next(vars_)
    for m, v in zip(means, vars_):
        mean, var = moments.max_moments(mean, var, m, v)
    return emit_output(mean, var, layer)


@reference("avg_pool2d")
def avg_pool2d(layer: PlannedLayer, inputs: list[Activation]) -> Activation:
    a, x = layer.layer.attrs, inputs[0]
    out_hw = layer.layer.out_shape[1:]
    divisor = average_divisor(a, x.mean.shape[2:], out_hw)
    mean = sum(window_views(padded(x.mean, a, out_hw, 0.0), a["kernel"], a["stride"], out_hw)) / divisor
    if x.repr is D:
        return Activation(mean, None, D)
    var = sum(window_views(padded(x.variance(), a, out_hw, 0.0), a["kernel"], a["stride"], out_hw)) / divisor**2
    return emit_output(mean, var, layer)


# ------------------------------------------------------------------------------------ ONNX
def _window_views(ctx: OnnxContext, x: Sym, kernel: list[int], stride: list[int], out_hw: tuple[int, ...]):
    """``window_views``: the strided slice of each window offset, row-major."""
    oh, ow = out_hw
    axes = ctx.b.ints([2, 3], "axes")
    steps = ctx.b.ints(list(stride), "steps")
    for p in range(kernel[0]):
        for q in range(kernel[1]):
            starts = ctx.b.ints([p, q], "starts")
            ends = ctx.b.ints([p + stride[0] * (oh - 1) + 1, q + stride[1] * (ow - 1) + 1], "ends")
            yield x.nary("Slice", starts, ends, axes, steps)


def _window_pads(layer: PlannedLayer, in_hw: tuple[int, ...]) -> list[int] | None:
    """ONNX ``Pad`` amounts (N, C, H, W begins, then ends) that put every window inside the input
    (begin padding + ceil-mode overhang, as ``padded``); None if none needed."""
    a, out_hw = layer.layer.attrs, layer.layer.out_shape[1:]
    begins, ends = [], []
    for n, k, s, p, o in zip(in_hw, a["kernel"], a["stride"], a.get("padding", [0, 0]), out_hw):
        begins.append(int(p))
        ends.append(max(0, (o - 1) * s + k - n - p))
    if not any(begins) and not any(ends):
        return None
    return [0, 0, *begins, 0, 0, *ends]


def _pad(ctx: OnnxContext, x: Sym, pads: list[int] | None, value: float) -> Sym:
    if pads is None:
        return x
    return x.nary("Pad", ctx.b.ints(pads, "pads"), Sym(ctx.b, value=value), mode="constant")


def _pair_slice(ctx: OnnxContext, cov: Sym, k: int) -> Sym:
    """Pair ``k`` of a ``window_cov`` tensor ``(batch, C, P, OH, OW)`` as ``(batch, C, OH, OW)``."""
    one = cov.nary("Slice", ctx.b.ints([k], "starts"), ctx.b.ints([k + 1], "ends"), ctx.b.ints([2], "axes"))
    return one.nary("Squeeze", ctx.b.ints([2], "axes"))


@exporter("max_pool2d")
def max_pool2d_onnx(ctx: OnnxContext, layer: PlannedLayer, inputs: list[OnnxActivation]) -> OnnxActivation:
    """``max_pool2d``: positions outside the input hold the fold's identity."""
    a, x = layer.layer.attrs, inputs[0]
    kernel, stride = list(a["kernel"]), list(a["stride"])
    out_hw = tuple(layer.layer.out_shape[1:])
    if list(a.get("dilation", [1, 1])) != [1, 1]:
        raise UnsupportedLayerError(f"{layer.layer.source}: max pooling with dilation {a['dilation']}")
    pads = _window_pads(layer, ctx.shapes[layer.inputs[0]][1:])
    if x.repr is D:  # max over the (−inf padded) window views == MaxPool on the padded input
        mean = _pad(ctx, x.mean, pads, float("-inf")).nary("MaxPool", kernel_shape=kernel, strides=stride)
        return OnnxActivation(mean, None, D)
    means = _window_views(ctx, _pad(ctx, x.mean, pads, LOWEST32), kernel, stride, out_hw)
    vars_ = _window_views(ctx, _pad(ctx, ctx.random_variance(x), pads, 0.0), kernel, stride, out_hw)
    if len(inputs) == 2:  # in-window covariances (window_cov): Clark's correlated fold
        cov = inputs[1].mean
        pairs = moments.window_pairs(kernel[0] * kernel[1])
        covs = {pair: _pair_slice(ctx, cov, k) for k, pair in enumerate(pairs)}
        mean, var = moments.correlated_window_max(list(zip(means, vars_)), covs, ctx.ops)
        return ctx.emit(mean, var, layer)
    mean, var = next(means), next(vars_)
    for m, v in zip(means, vars_):
        mean, var = moments.max_moments(mean, var, m, v, ctx.ops)
    return ctx.emit(mean, var, layer)


@exporter("avg_pool2d")
def avg_pool2d_onnx(ctx: OnnxContext, layer: PlannedLayer, inputs: list[OnnxActivation]) -> OnnxActivation:
    """``avg_pool2d``: ``μ ↦ Σμ/d``, ``v ↦ Σv/d²`` with torch's divisors ``d``.

    ``AveragePool`` on the zero-padded input gives ``Σ/(kh·kw)``; a constant per output position
    rescales it to ``Σ/d`` (and ``Σ/d²``)."""
    a, x = layer.layer.attrs, inputs[0]
    kernel, stride = list(a["kernel"]), list(a["stride"])
    in_hw = tuple(ctx.shapes[layer.inputs[0]][1:])
    out_hw = tuple(layer.layer.out_shape[1:])
    pads = _window_pads(layer, in_hw)
    divisor = average_divisor(a, in_hw, out_hw)
    window = float(kernel[0] * kernel[1])

    def window_sum_over(t: Sym, scale: np.ndarray, hint: str) -> Sym:
        pooled = _pad(ctx, t, pads, 0.0).nary("AveragePool", kernel_shape=kernel, strides=stride)
        return pooled * Sym(ctx.b, ctx.b.initializer(scale, hint))

    mean = window_sum_over(x.mean, window / divisor, "mean_scale")
    if x.repr is D:
        return OnnxActivation(mean, None, D)
    var = window_sum_over(ctx.random_variance(x), window / divisor**2, "var_scale")
    return ctx.emit(mean, var, layer)


# ------------------------------------------------------------------------------------ converters
def _window_attrs(node, ctx, kernel, stride, padding, ceil_mode) -> dict:
    kernel = _pair(kernel)
    attrs = {
        "kernel": kernel,
        "stride": _pair(stride) if stride not in (None, [], ()) else list(kernel),
        "padding": _pair(padding if padding is not None else 0),
        "ceil_mode": bool(ceil_mode),
    }
    if any(p > k // 2 for p, k in zip(attrs["padding"], kernel)):
        raise ctx.unsupported(node, f"padding {attrs['padding']} larger than half the kernel {kernel}")
    return attrs


def _spatial_dims(node, ctx, x) -> int:
    """1 for a ``(batch, C, L)`` input of a 1-D pool, 2 for ``(batch, C, H, W)`` of a 2-D one."""
    one_d = "1d" in str(node.target)
    rank = len(ctx.shape(x))
    if rank != (2 if one_d else 3):
        what = "(batch, C, L)" if one_d else "(batch, C, H, W)"
        raise ctx.unsupported(node, f"expects {what} input, got (batch, {', '.join(map(str, ctx.shape(x)))})")
    return rank - 1


def _as_2d_window(spatial: int, value, fill: int):
    """A 1-D pool's kernel/stride/padding as the 2-D one of a ``(C, 1, L)`` input (``fill`` for H)."""
    if spatial == 2 or value in (None, [], ()):
        return value
    return [fill, _pair(value, 1)[0]]


def _pool(node, ctx, x, op: str, attrs: dict, spatial: int) -> list[Layer]:
    if spatial == 1:
        return as_2d(node, ctx, x, op, attrs, {}, prefer_module=False)
    return [Layer(name=ctx.new_name(node, prefer_module=False), op=op, inputs=[ctx.activation(x, node)],
                  out_shape=out_shape(node, ctx), source=ctx.source(node), attrs=attrs)]


@register("aten.max_pool2d.default", "aten.max_pool2d_with_indices.default", "aten.max_pool1d.default",
          "aten.max_pool1d_with_indices.default", produces=("max_pool2d", "reshape"))
def convert_max_pool(node, ctx) -> list[Layer]:
    """``MaxPool2d``, and ``MaxPool1d`` as the 2-D pool of a ``(C, 1, L)`` input (:mod:`pyro2pfp.planning.onedim`)."""
    args = list(node.args) + [None] * 6
    x, kernel, stride, padding, dilation, ceil_mode = args[:6]
    spatial = _spatial_dims(node, ctx, x)
    attrs = _window_attrs(node, ctx, _as_2d_window(spatial, kernel, 1), _as_2d_window(spatial, stride, 1),
                          _as_2d_window(spatial, padding if padding is not None else 0, 0), ceil_mode)
    attrs["dilation"] = _pair(_as_2d_window(spatial, dilation if dilation is not None else 1, 1))
    if attrs["dilation"] != [1, 1]:
        raise ctx.unsupported(node, f"max pooling with dilation {dilation} is not supported")
    return _pool(node, ctx, x, "max_pool2d", attrs, spatial)


@register("aten.avg_pool2d.default", "aten.avg_pool1d.default", produces=("avg_pool2d", "reshape"))
def convert_avg_pool(node, ctx) -> list[Layer]:
    """``AvgPool2d``, and ``AvgPool1d`` as the 2-D pool of a ``(C, 1, L)`` input."""
    args = list(node.args) + [None] * 7
    x, kernel, stride, padding, ceil_mode, count_include_pad, divisor = args[:7]
    spatial = _spatial_dims(node, ctx, x)
    attrs = _window_attrs(node, ctx, _as_2d_window(spatial, kernel, 1), _as_2d_window(spatial, stride, 1),
                          _as_2d_window(spatial, padding if padding is not None else 0, 0), ceil_mode)
    attrs["count_include_pad"] = True if count_include_pad is None else bool(count_include_pad)
    attrs["divisor"] = int(divisor) if divisor is not None else None
    if attrs["ceil_mode"] and attrs["padding"] != [0, 0]:
        raise ctx.unsupported(node, "average pooling with both padding and ceil_mode is not supported")
    return _pool(node, ctx, x, "avg_pool2d", attrs, spatial)


def _global_average(node, ctx, x, keep_shape: bool) -> list[Layer]:
    c, h, w = ctx.shape(x)
    attrs = {"kernel": [h, w], "stride": [h, w], "padding": [0, 0], "ceil_mode": False,
             "count_include_pad": True, "divisor": None}
    pool = Layer(name=ctx.new_name(node, prefer_module=False), op="avg_pool2d",
                 inputs=[ctx.activation(x, node)], out_shape=(c, 1, 1), source=ctx.source(node), attrs=attrs)
    if keep_shape:
        return [pool]
    flat = Layer(name=ctx.new_name(node, prefer_module=False), op="reshape", inputs=[pool.name],
                 out_shape=ctx.shape(node), source=ctx.source(node))
    return [pool, flat]


def adaptive_window(size: int, out: int) -> tuple[int, int] | None:
    """``(kernel, stride)`` of the regular pool that computes torch's adaptive pooling of ``size``
    elements to ``out`` (window ``i`` is ``[⌊i·size/out⌋, ⌈(i+1)·size/out⌉)``), or None when its
    windows differ in size or spacing (e.g. 10 → 4: sizes 3, 4, 4, 3)."""
    starts = [i * size // out for i in range(out)]
    ends = [-(-(i + 1) * size // out) for i in range(out)]
    sizes = {e - s for s, e in zip(starts, ends)}
    stride = starts[1] - starts[0] if out > 1 else size
    if len(sizes) != 1 or stride < 1 or any(s != i * stride for i, s in enumerate(starts)):
        return None
    return sizes.pop(), stride


@register("aten.adaptive_avg_pool2d.default", "aten.adaptive_avg_pool1d.default", "aten.adaptive_max_pool2d.default",
          "aten.adaptive_max_pool1d.default", produces=("avg_pool2d", "max_pool2d", "reshape"))
def convert_adaptive_pool(node, ctx) -> list[Layer]:
    """``AdaptiveAvgPool1d/2d``, ``AdaptiveMaxPool1d/2d`` where torch's windows are those of a regular
    pool (:func:`adaptive_window`; e.g. an output size dividing the input): that pool."""
    x = node.args[0]
    spatial = _spatial_dims(node, ctx, x)
    in_sizes, out_sizes = ctx.shape(x)[1:], out_shape(node, ctx)[1:]
    windows = [adaptive_window(n, o) for n, o in zip(in_sizes, out_sizes)]
    kind = "Max" if "max" in str(node.target) else "Avg"
    if any(w is None for w in windows):
        sizes = " x ".join(map(str, in_sizes))
        dims = [(n, o) for (n, o), w in zip(zip(in_sizes, out_sizes), windows) if w is None]
        fits = "; ".join(f"for {n}: {', '.join(str(d) for d in range(1, n + 1) if n % d == 0)}" for n, _ in dims)
        raise ctx.unsupported(node, f"Adaptive{kind}Pool{spatial}d from {sizes} to {' x '.join(map(str, out_sizes))}: "
                                    "torch's adaptive windows then differ in size or spacing, which PFP's regular "
                                    "pools do not compute. Choose an output size that divides the input (" + fits +
                                    f") or use {kind}Pool{spatial}d with a fixed kernel and stride")
    kernel, stride = [w[0] for w in windows if w], [w[1] for w in windows if w]
    if spatial == 1:
        kernel, stride = [1, *kernel], [1, *stride]
    attrs: dict = {"kernel": kernel, "stride": stride, "padding": [0, 0], "ceil_mode": False}
    if kind == "Max":
        attrs["dilation"] = [1, 1]
        return _pool(node, ctx, x, "max_pool2d", attrs, spatial)
    attrs.update(count_include_pad=True, divisor=None)
    return _pool(node, ctx, x, "avg_pool2d", attrs, spatial)


def _global_pool(node, ctx, x, op: str) -> list[Layer]:
    """``op`` (``max_pool2d``/``avg_pool2d``) over the whole ``L`` of ``(batch, C, L)`` (as ``(C, 1, L)``)
    or ``H×W`` of ``(batch, C, H, W)``, then the node's own shape (keepdim or not)."""
    shape = ctx.shape(x)
    if len(shape) == 3 and op == "avg_pool2d":
        return _global_average(node, ctx, x, keep_shape=out_shape(node, ctx) == (shape[0], 1, 1))
    name, source = ctx.new_name(node, prefer_module=False), ctx.source(node)
    layers, src = [], ctx.activation(x, node)
    if len(shape) == 2:
        layers.append(Layer(name=f"{name}_to_2d", op="reshape", inputs=[src], out_shape=(shape[0], 1, shape[1]),
                            source=source))
        src, shape = layers[-1].name, (shape[0], 1, shape[1])
    attrs: dict = {"kernel": list(shape[1:]), "stride": list(shape[1:]), "padding": [0, 0], "ceil_mode": False}
    attrs.update({"dilation": [1, 1]} if op == "max_pool2d" else {"count_include_pad": True, "divisor": None})
    final = out_shape(node, ctx)
    pool_name = name if final == (shape[0], 1, 1) else f"{name}_2d"
    layers.append(Layer(name=pool_name, op=op, inputs=[src], out_shape=(shape[0], 1, 1), source=source, attrs=attrs))
    if pool_name != name:
        layers.append(Layer(name=name, op="reshape", inputs=[pool_name], out_shape=final, source=source))
    return layers


@register("aten.mean.dim", "aten.amax.default", "aten.max.dim", produces=("avg_pool2d", "max_pool2d", "reshape"))
def convert_global_pool(node, ctx) -> list[Layer]:
    """``x.mean(-1)``, ``x.amax(-1)``, ``x.max(-1)[0]`` over the ``L`` of ``(batch, C, L)``, and
    ``x.mean((2, 3))``/``x.amax((2, 3))`` over ``H×W``: global average/max pooling."""
    x, dims = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", [])
    dims = [dims] if isinstance(dims, int) else list(dims)
    rank = len(ctx.shape(x)) + 1
    op = "avg_pool2d" if str(node.target) == "aten.mean.dim" else "max_pool2d"
    if rank not in (3, 4) or sorted(d % rank for d in dims) != list(range(2, rank)):
        what = "mean" if op == "avg_pool2d" else "max"
        raise ctx.unsupported(node, f"{what} over dims {dims} of (batch, {', '.join(map(str, ctx.shape(x)))}); only "
                                    "the spatial reduction of (batch, C, L) or (batch, C, H, W) (global pooling) is "
                                    "supported")
    return _global_pool(node, ctx, x, op)


# ------------------------------------------------------------------------------------ shared-factor rules
def average_attrs(layer: PlannedLayer) -> dict[str, Any]:
    """An avg_pool2d layer's attrs with the divisor defaults (torch's: none, padding not counted)."""
    a = dict(layer.layer.attrs)
    a.setdefault("divisor", None)
    a.setdefault("count_include_pad", False)
    return a


@shared_formula("avg_pool2d")
def avg_pool2d_shared(bk: SharedAlgebra, layer: PlannedLayer, inputs: list[Any], shared: list[Shared | None],
                      fp: FactorPlan, var: Any) -> tuple[Shared | None, Any]:
    """The average pooling rule (global average pooling too; divisor ``n``): ``s ↦`` window mean of
    ``s`` (exact); ``v = Σ(v − s²)/n² + s_out²`` (the shared part summed coherently, the remainder as
    independent: an approximation -- directly after a conv with a deterministic input the remainder
    sums to zero and this over-states the pooled variance; after ReLUs it stands in for what the
    closure misses, which dropping it would lose).  Returns ``(shared part, output variance)``."""
    x, sh = inputs[0], shared[0]
    if sh is None:
        return None, var
    ops = bk.ops
    a = average_attrs(layer)
    in_hw, out_hw = tuple(bk.edge_shape(x, layer.inputs[0])[1:]), tuple(layer.layer.out_shape[1:])
    div = average_divisor(a, in_hw, out_hw)
    indep = ops.maximum(bk.variance(x) - sh.s * sh.s, ops.const(0.0))
    s = total(_window_taps(bk, sh.s, a, in_hw, out_hw, 0.0)) * bk.tensor(1.0 / div, "inv_divisor")
    rest = total(_window_taps(bk, indep, a, in_hw, out_hw, 0.0)) * bk.tensor(1.0 / div**2, "inv_divisor2")
    return Shared(s, sh.g, sh.k), rest + s * s


def max_pool2d_fold(bk: Any, layer: PlannedLayer, inputs: list[Any], sh: Shared) -> tuple[Any, Any, Any]:
    """``(μ, v, s)`` of a max pool with a shared input part ``sh`` (:func:`max_pool2d_shared`): Clark's fold over
    the window taps, correlated with the in-window covariances of a ``window_cov`` input (else independent),
    carrying the profile with the same weights; a formula over ``bk`` for the reference and the export."""
    x = inputs[0]
    a = layer.layer.attrs
    c, *in_hw = bk.edge_shape(x, layer.inputs[0])
    out_hw = tuple(layer.layer.out_shape[1:])
    ms = _window_taps(bk, x.mean, a, tuple(in_hw), out_hw, bk.lowest)
    vs = _window_taps(bk, bk.variance(x), a, tuple(in_hw), out_hw, 0.0)
    ss = _window_taps(bk, sh.s, a, tuple(in_hw), out_hw, 0.0)
    pairs = moments.window_pairs(len(ms))
    cov = {pair: bk.reshape(bk.slice(inputs[1].mean, 2, k, k + 1), (c, *out_hw)) if len(inputs) == 2
           else bk.ops.const(0.0) for k, pair in enumerate(pairs)}
    mean, var, s = ms[0], vs[0], ss[0]
    carried = {j: cov[(0, j)] for j in range(1, len(ms))}
    for t in range(1, len(ms)):
        mean, var, cdf, cdf_neg = moments.correlated_max_moments(mean, var, ms[t], vs[t], carried.pop(t), bk.ops)
        carried = {j: cv * cdf + cov[(t, j)] * cdf_neg for j, cv in carried.items()}
        s = cdf * s + cdf_neg * ss[t]
    return mean, var, s


@shared_reference("max_pool2d")
def max_pool2d_shared(layer: PlannedLayer, inputs: list[Activation], shared: list[Shared | None], fp: FactorPlan,
                      var: np.ndarray) -> tuple[Shared | None, np.ndarray]:
    """The max pooling rule: Clark's fold for ``(μ, v)`` (the reference's: correlated, with the in-window
    covariances of the pool's ``window_cov`` input, whose shared-factor rule gives the scheme's covariances;
    else independent) and ``s`` by the linear response of the pairwise maximum with the same weights,
    ``Cov(max(A, B), η) = Φ(α)·Cov(A, η) + Φ(−α)·Cov(B, η)`` (exact for jointly Gaussian ``A, B, η``; ``α``
    from ``θ = √(v_A + v_B − 2·Cov(A, B))``, the covariance 0 without a ``window_cov`` input)
    (:func:`max_pool2d_fold`).  The variance is the reference's."""
    sh = shared[0]
    if sh is None:
        return None, var
    return Shared(max_pool2d_fold(NUMPY_BACKEND, layer, inputs, sh)[2], sh.g), var


@fuses_mean_field
@shared_exporter("max_pool2d")
def max_pool2d_shared_onnx(step: OnnxSharedStep, ctx: OnnxContext, layer: PlannedLayer, inputs: list[OnnxActivation],
                           shared: list[Shared | None], out: OnnxActivation | None
                           ) -> tuple[Shared | None, OnnxActivation]:
    """:func:`max_pool2d_shared` in ONNX: the fold (:func:`max_pool2d_fold`) gives the output's ``(μ, v)`` too
    (no mean-field export of the layer)."""
    sh = shared[0]
    assert sh is not None
    mean, var, s = max_pool2d_fold(ctx, layer, inputs, sh)
    result = ctx.emit(mean, var, layer)
    return Shared(clip(ctx, s, ctx.variance(result)), sh.g, sh.k), result


max_pool2d_shared.formula = max_pool2d_shared_onnx.formula = max_pool2d_fold  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------ compact factor rules
def _window_taps(bk: Any, t: Any, attrs: dict[str, Any], in_hw: tuple[int, ...], out_hw: tuple[int, ...],
                 fill: float) -> list[Any]:
    """The window views of ``t`` (B, C', H, W) at every offset (row-major): padded as the reference's
    ``padded`` (begin padding + overhang, ``fill``)."""
    end = tuple(max(0, (o - 1) * s + k - n - p)
                for n, k, s, p, o in zip(in_hw, attrs["kernel"], attrs["stride"], attrs["padding"], out_hw))
    return bk.taps(t, tuple(attrs["kernel"]), tuple(attrs["stride"]), (1, 1), tuple(attrs["padding"]), end,
                   tuple(out_hw), fill)


@compact_formula("max_pool2d")
def max_pool2d_compact(bk: TensorAlgebra, layer: PlannedLayer, inputs: list[Any], loads: list[Loadings | None],
                       plan: CompactPlan, mean: Any, var: Any) -> tuple[Any, Any, Any]:
    """The max pooling rule of the compact factor plan: Clark's correlated fold (``docs/math.md`` "Max
    pooling") with the in-window covariances of the ``window_cov`` input where the planner gave one (the
    conv's weight noise and mean-field input, exact under those assumptions), else the factors' part
    ``Cov(a_p, a_q) = Σ_f L_p,f·L_q,f`` (the residual independent); the running max's loadings by the same
    Clark weights, ``L_max = Φ(α)·L_M + Φ(−α)·L_t`` (exact for jointly Gaussian taps: section 4's
    covariance rule).  Without ``window_cov`` the fold's mean and variance replace the reference's."""
    x, ld = inputs[0], loads[0]
    if ld is None:
        return None, mean, var
    a = layer.layer.attrs
    c, h, w = plan.shapes[layer.inputs[0]]
    out_hw = tuple(layer.layer.out_shape[1:])
    cols, layout = ld.as_channels(bk, (c, h, w))
    f = sum(k for _, _, k in layout)
    ms = _window_taps(bk, x.mean, a, (h, w), out_hw, bk.lowest)
    vs = _window_taps(bk, bk.variance(x), a, (h, w), out_hw, 0.0)
    ls = [bk.reshape(v, (c, f, *out_hw)) for v in _window_taps(bk, bk.reshape(cols, (c * f, h, w)), a, (h, w),
                                                               out_hw, 0.0)]
    pairs = moments.window_pairs(len(ms))
    if len(inputs) == 2:
        cov = {pair: bk.reshape(bk.slice(inputs[1].mean, 2, k, k + 1), (c, *out_hw)) for k, pair in enumerate(pairs)}
    else:
        cov = {(i, j): bk.rsum(ls[i] * ls[j], 2) for i, j in pairs}
    m, v, lo = ms[0], vs[0], ls[0]
    carried = {j: cov[(0, j)] for j in range(1, len(ms))}
    for t in range(1, len(ms)):
        m, v, cdf, cdf_neg = moments.correlated_max_moments(m, v, ms[t], vs[t], carried.pop(t), bk.ops)
        carried = {j: cv * cdf + cov[(t, j)] * cdf_neg for j, cv in carried.items()}
        lo = lo * bk.reshape(cdf, (c, 1, *out_hw)) + ls[t] * bk.reshape(cdf_neg, (c, 1, *out_hw))
    if len(inputs) == 1:
        mean, var = m, v
    return Loadings.from_channels(bk, lo, layout, (c, *out_hw)), mean, var


@compact_formula("avg_pool2d")
def avg_pool2d_compact(bk: TensorAlgebra, layer: PlannedLayer, inputs: list[Any], loads: list[Loadings | None],
                       plan: CompactPlan, mean: Any, var: Any) -> tuple[Any, Any, Any]:
    """The average pooling rule of the compact factor plan: loadings averaged over the window (exact);
    ``v = Σ(v − ‖L‖²)/n² + ‖L_out‖²`` (the factors summed coherently, the residual independently)."""
    x, ld = inputs[0], loads[0]
    if ld is None:
        return None, mean, var
    a = average_attrs(layer)
    c, h, w = plan.shapes[layer.inputs[0]]
    out_hw = tuple(layer.layer.out_shape[1:])
    cols, layout = ld.as_channels(bk, (c, h, w))
    f = sum(k for _, _, k in layout)
    inv = 1.0 / average_divisor(a, (h, w), out_hw)
    lo = total(_window_taps(bk, bk.reshape(cols, (c * f, h, w)), a, (h, w), out_hw, 0.0)) * bk.tensor(inv, "inv_div")
    lo = bk.reshape(lo, (c, f, *out_hw))
    resid = bk.ops.maximum(bk.variance(x) - bk.reshape(ld.explained(bk, c * h * w), (c, h, w)), bk.ops.const(0.0))
    var = total(_window_taps(bk, resid, a, (h, w), out_hw, 0.0)) * bk.tensor(inv**2, "inv_div2") \
        + bk.rsum(lo * lo, 2)
    return Loadings.from_channels(bk, lo, layout, (c, *out_hw)), mean, var
