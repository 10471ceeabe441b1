"""Export a planned PFP network as an ONNX model of standard operators.

The ONNX graph computes exactly what the NumPy reference (:mod:`pyro2pfp.reference`) computes, in
float32: every planned layer is emitted from its ``in_reprs`` / ``out_repr`` and its stored
``tensors``, and the Gaussian moment formulas are the *same code* as the reference's —
:func:`pyro2pfp.moments.relu_moments` and :func:`~pyro2pfp.moments.max_moments` are evaluated on
symbolic ONNX tensors through an ``ops`` namespace (like ``TE_OPS`` of the TVM back end), so the
α clamping and the σ = 0 limits come out as ``Where``/``Min``/``Max`` nodes.

Graph interface::

    inputs   x      float32 (batch, *input_shape)
             x_var  float32 (batch, *input_shape)   only if the network takes an input variance
    outputs  mean   float32 (batch, *output_shape)
             var    float32 (batch, *output_shape)

``batch`` is a symbolic dimension (dynamic batch).  Operators used: MatMul, Conv, Mul, Add, Sub,
Div, Neg, Erf, Exp, Sqrt, Max, Min, Greater, Less, Where, Slice, Pad, MaxPool, AveragePool, Relu,
Reshape, Shape, ConstantOfShape, Identity — nothing custom, default domain, opset 17 or newer.

``Φ(α), Φ(−α)`` are ``½ ± ½·Erf(α/√2)`` (one Erf), as in the TVM kernels.  Max pooling folds
Clark's max over strided ``Slice`` views of each window offset in row-major order (the reference's
``window_views``); padded / ceil-mode positions hold the fold's identity ``(lowest float32, 0)``.
"""
from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from . import moments
from .errors import PFPError, UnsupportedLayerError
from .graph import INPUT, Repr
from .plan import PlannedGraph, PlannedLayer
from .registry import add_to

D, V, S = Repr.DETERMINISTIC, Repr.VARIANCE, Repr.SECOND_MOMENT
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_LOWEST32 = float(np.finfo(np.float32).min)  # the max-pool fold's identity mean (as the TVM kernels)

DEFAULT_OPSET = 17
MIN_OPSET = 17
# IR version 8 is the one that introduced opset 17: the oldest runtimes that can run the model load it.
_IR_VERSION_FOR_OPSET = {17: 8, 18: 8, 19: 9, 20: 9, 21: 10, 22: 10, 23: 11}

__all__ = ["to_onnx", "onnx_ops_used", "DEFAULT_OPSET"]


# ---------------------------------------------------------------------------------------------
# A tiny symbolic-tensor graph builder
# ---------------------------------------------------------------------------------------------


class _Builder:
    """Collects ONNX nodes and float32 initializers with unique, readable names."""

    def __init__(self) -> None:
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self._used: Counter[str] = Counter()
        self._scalars: dict[tuple[str, bytes], str] = {}
        self.scope = ""

    def unique(self, hint: str) -> str:
        base = f"{self.scope}/{hint}" if self.scope else hint
        self._used[base] += 1
        n = self._used[base]
        return base if n == 1 else f"{base}_{n - 1}"

    def node(self, op: str, inputs: list[str], **attrs: Any) -> str:
        from onnx import helper

        out = self.unique(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def initializer(self, array: np.ndarray, hint: str, dtype: Any = np.float32) -> str:
        from onnx import numpy_helper

        name = self.unique(hint)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array, dtype=dtype), name))
        return name

    def scalar(self, value: float) -> str:
        """A shared float32 scalar initializer (one per distinct value in the whole graph)."""
        from onnx import numpy_helper

        v = np.float32(value)
        key = ("f", v.tobytes())
        if key not in self._scalars:
            text = repr(float(v)).replace("-", "m").replace(".", "p").replace("+", "")
            name = f"const/{text}"
            while name in self._used:
                name += "_"
            self._used[name] += 1
            self.initializers.append(numpy_helper.from_array(np.array(v, dtype=np.float32), name))
            self._scalars[key] = name
        return self._scalars[key]

    def ints(self, values: list[int], hint: str) -> str:
        return self.initializer(np.asarray(values, dtype=np.int64), hint, dtype=np.int64)


class _Sym:
    """A symbolic float32 ONNX tensor (or a folded scalar constant) with Python operators."""

    __array_priority__ = 1000  # make numpy scalars defer to our reflected operators

    def __init__(self, b: _Builder, name: str | None = None, value: float | None = None) -> None:
        self.b = b
        self._name = name
        self.value = value  # set for scalar constants (folded until used by a node)

    @property
    def name(self) -> str:
        if self._name is None:
            assert self.value is not None  # a _Sym is a named tensor or a constant
            self._name = self.b.scalar(self.value)
        return self._name

    # -- helpers
    def _wrap(self, other: Any) -> _Sym:
        if isinstance(other, _Sym):
            return other
        if isinstance(other, (int, float, np.floating, np.integer)):
            return _Sym(self.b, value=float(other))
        raise TypeError(f"cannot combine an ONNX tensor with {type(other).__name__}")

    def _binary(self, op: str, other: Any, fold: Callable[[float, float], float], swap: bool = False) -> _Sym:
        a, c = self, self._wrap(other)
        if swap:
            a, c = c, a
        if a.value is not None and c.value is not None:
            return _Sym(self.b, value=float(fold(float(np.float32(a.value)), float(np.float32(c.value)))))
        return _Sym(self.b, self.b.node(op, [a.name, c.name]))

    def __add__(self, o: Any) -> _Sym:
        return self._binary("Add", o, lambda a, c: a + c)

    def __radd__(self, o: Any) -> _Sym:
        return self._binary("Add", o, lambda a, c: a + c, swap=True)

    def __sub__(self, o: Any) -> _Sym:
        return self._binary("Sub", o, lambda a, c: a - c)

    def __rsub__(self, o: Any) -> _Sym:
        return self._binary("Sub", o, lambda a, c: a - c, swap=True)

    def __mul__(self, o: Any) -> _Sym:
        return self._binary("Mul", o, lambda a, c: a * c)

    def __rmul__(self, o: Any) -> _Sym:
        return self._binary("Mul", o, lambda a, c: a * c, swap=True)

    def __truediv__(self, o: Any) -> _Sym:
        return self._binary("Div", o, lambda a, c: a / c)

    def __rtruediv__(self, o: Any) -> _Sym:
        return self._binary("Div", o, lambda a, c: a / c, swap=True)

    def __neg__(self) -> _Sym:
        if self.value is not None:
            return _Sym(self.b, value=-self.value)
        return _Sym(self.b, self.b.node("Neg", [self.name]))

    def __gt__(self, o: Any) -> _Sym:
        return _Sym(self.b, self.b.node("Greater", [self.name, self._wrap(o).name]))

    def __lt__(self, o: Any) -> _Sym:
        return _Sym(self.b, self.b.node("Less", [self.name, self._wrap(o).name]))

    def __pow__(self, p: int) -> _Sym:
        if p != 2:
            raise ValueError("only squares are needed")
        return self * self

    # -- named ops
    def unary(self, op: str) -> _Sym:
        return _Sym(self.b, self.b.node(op, [self.name]))

    def nary(self, op: str, *others: Any, **attrs: Any) -> _Sym:
        names = [self.name] + [o if isinstance(o, str) else self._wrap(o).name for o in others]
        return _Sym(self.b, self.b.node(op, names, **attrs))


def _onnx_ops(b: _Builder) -> SimpleNamespace:
    """The ``ops`` namespace of :mod:`pyro2pfp.moments` on symbolic ONNX tensors."""

    def where(cond: _Sym, a: Any, c: Any) -> _Sym:
        return cond.nary("Where", a, c)

    def elementwise(op: str, x: Any, y: Any) -> _Sym:
        x = x if isinstance(x, _Sym) else _Sym(b, value=float(x))
        return x.nary(op, y)

    def normal_cdfs(alpha: _Sym) -> tuple[_Sym, _Sym]:
        """(Φ(α), Φ(−α)) from one Erf, as the TVM kernels compute them."""
        half_erf = _Sym(b, value=0.5) * (alpha * _Sym(b, value=_INV_SQRT2)).unary("Erf")
        return _Sym(b, value=0.5) + half_erf, _Sym(b, value=0.5) - half_erf

    ns = SimpleNamespace(
        where=where,
        normal_cdfs=normal_cdfs,
        erf=lambda x: x.unary("Erf"),
        erfc=lambda x: _Sym(b, value=1.0) - x.unary("Erf"),  # as the TVM kernels: 1 − erf
        exp=lambda x: x.unary("Exp"),
        sqrt=lambda x: x.unary("Sqrt"),
        maximum=lambda x, y: elementwise("Max", x, y),
        minimum=lambda x, y: elementwise("Min", x, y),
        const=lambda v: _Sym(b, value=float(v)),
    )
    ns.erfcx = lambda x: moments.erfcx_rational(x, ns)  # e^{x²}·erfc(x), x ≥ 0, as the TVM kernels
    return ns


# ---------------------------------------------------------------------------------------------
# Activations and the per-op emitters (mirror pyro2pfp/reference/*.py)
# ---------------------------------------------------------------------------------------------


@dataclass
class _Act:
    """A batch of independent Gaussians in the ONNX graph (``second`` is None when deterministic)."""

    mean: _Sym
    second: _Sym | None
    repr: Repr


@dataclass
class _Ctx:
    b: _Builder
    ops: SimpleNamespace
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # edge name -> shape (no batch)

    def variance(self, x: _Act) -> _Sym | None:
        if x.repr is D:
            return None
        if x.repr is V:
            return x.second
        return moments.second_to_variance(x.mean, x.second, self.ops)

    def random_variance(self, x: _Act) -> _Sym:
        """The variance of an activation the plan marks as random (not deterministic)."""
        var = self.variance(x)
        if var is None:
            raise PFPError("internal: a deterministic activation where the plan expects a random one")
        return var

    def second_moment(self, x: _Act) -> _Sym:
        if x.repr is S:
            assert x.second is not None
            return x.second
        var = self.variance(x)
        return x.mean * x.mean if var is None else moments.variance_to_second(x.mean, var, self.ops)

    def emit_output(self, mean: _Sym, var: _Sym, layer: PlannedLayer) -> _Act:
        if layer.out_repr is V:
            return _Act(mean, var, V)
        if layer.out_repr is S:
            return _Act(mean, moments.variance_to_second(mean, var, self.ops), S)
        return _Act(mean, None, D)


Exporter = Callable[[_Ctx, PlannedLayer, list[_Act]], _Act]
EXPORTERS: dict[str, Exporter] = {}


#: ``@exporter(op)`` registers the ONNX emitter of PFP op ``op`` (once).
exporter = add_to(EXPORTERS, "ONNX export of op")


def _compute_layer(ctx: _Ctx, layer: PlannedLayer, x: _Act,
                   apply: Callable[[_Sym, np.ndarray, str], _Sym], bias_shape: tuple[int, ...]) -> _Act:
    """``reference.compute._compute_layer`` on ONNX tensors (same formulas, same order)."""
    t = layer.tensors
    mean = apply(x.mean, t["weight_mean"], "weight_mean")
    if x.repr is D:
        var = apply(x.mean * x.mean, t["weight_var"], "weight_var")
    elif x.repr is V:
        var = (apply(ctx.second_moment(x), t["weight_var"], "weight_var")
               + apply(ctx.random_variance(x), t["weight_mean"] ** 2, "weight_mean_sq"))
    else:
        var = (apply(ctx.second_moment(x), t["weight_second_moment"], "weight_second_moment")
               - apply(x.mean * x.mean, t["weight_mean"] ** 2, "weight_mean_sq"))
    if "bias_mean" in t:
        mean = mean + _Sym(ctx.b, ctx.b.initializer(t["bias_mean"].reshape(bias_shape), "bias_mean"))
    if "bias_var" in t:
        var = var + _Sym(ctx.b, ctx.b.initializer(t["bias_var"].reshape(bias_shape), "bias_var"))
    return ctx.emit_output(mean, ctx.ops.maximum(var, ctx.ops.const(0.0)), layer)


@exporter("dense")
def _dense(ctx: _Ctx, layer: PlannedLayer, inputs: list[_Act]) -> _Act:
    def apply(x: _Sym, w: np.ndarray, hint: str) -> _Sym:
        return x.nary("MatMul", ctx.b.initializer(w.T, hint + "_t"))  # x @ w.T, weights stored (K, M)

    return _compute_layer(ctx, layer, inputs[0], apply, (-1,))


@exporter("conv2d")
def _conv2d(ctx: _Ctx, layer: PlannedLayer, inputs: list[_Act]) -> _Act:
    a = layer.layer.attrs
    (ph, pw), (kh, kw) = a["padding"], layer.tensors["weight_mean"].shape[2:]

    def apply(x: _Sym, w: np.ndarray, hint: str) -> _Sym:
        return x.nary("Conv", ctx.b.initializer(w, hint), kernel_shape=[int(kh), int(kw)],
                      strides=list(a["stride"]), pads=[ph, pw, ph, pw], dilations=list(a["dilation"]),
                      group=int(a["groups"]))

    return _compute_layer(ctx, layer, inputs[0], apply, (-1, 1, 1))


@exporter("relu")
def _relu(ctx: _Ctx, layer: PlannedLayer, inputs: list[_Act]) -> _Act:
    x = inputs[0]
    if x.repr is D:
        return _Act(x.mean.unary("Relu"), None, D)
    mean, var = moments.relu_moments(x.mean, ctx.variance(x), ctx.ops)
    return ctx.emit_output(mean, var, layer)


@exporter("convert")
def _convert(ctx: _Ctx, layer: PlannedLayer, inputs: list[_Act]) -> _Act:
    x = inputs[0]
    return ctx.emit_output(x.mean, ctx.random_variance(x), layer)


@exporter("reshape")
def _reshape(ctx: _Ctx, layer: PlannedLayer, inputs: list[_Act]) -> _Act:
    x = inputs[0]
    shape = ctx.b.ints([-1, *layer.layer.out_shape], "shape")
    second = None if x.second is None else x.second.nary("Reshape", shape)
    return _Act(x.mean.nary("Reshape", shape), second, x.repr)


def _window_views(ctx: _Ctx, x: _Sym, kernel: list[int], stride: list[int], out_hw: tuple[int, ...]):
    """``reference.pooling.window_views``: the strided slice of each window offset, row-major."""
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
    (begin padding + ceil-mode overhang, as ``reference.pooling.padded``); None if none needed."""
    a, out_hw = layer.layer.attrs, layer.layer.out_shape[1:]
    begins, ends = [], []
    for n, k, s, p, o in zip(in_hw, a["kernel"], a["stride"], a.get("padding", [0, 0]), out_hw):
        begins.append(int(p))
        ends.append(max(0, (o - 1) * s + k - n - p))
    if not any(begins) and not any(ends):
        return None
    return [0, 0, *begins, 0, 0, *ends]


def _pad(ctx: _Ctx, x: _Sym, pads: list[int] | None, value: float) -> _Sym:
    if pads is None:
        return x
    return x.nary("Pad", ctx.b.ints(pads, "pads"), _Sym(ctx.b, value=value), mode="constant")


@exporter("max_pool2d")
def _max_pool2d(ctx: _Ctx, layer: PlannedLayer, inputs: list[_Act]) -> _Act:
    """``reference.pooling.max_pool2d``: positions outside the input hold the fold's identity."""
    a, x = layer.layer.attrs, inputs[0]
    kernel, stride = list(a["kernel"]), list(a["stride"])
    out_hw = tuple(layer.layer.out_shape[1:])
    if list(a.get("dilation", [1, 1])) != [1, 1]:
        raise UnsupportedLayerError(f"{layer.layer.source}: max pooling with dilation {a['dilation']}")
    pads = _window_pads(layer, ctx.shapes[layer.inputs[0]][1:])
    if x.repr is D:  # max over the (−inf padded) window views == MaxPool on the padded input
        mean = _pad(ctx, x.mean, pads, float("-inf")).nary("MaxPool", kernel_shape=kernel, strides=stride)
        return _Act(mean, None, D)
    means = _window_views(ctx, _pad(ctx, x.mean, pads, _LOWEST32), kernel, stride, out_hw)
    vars_ = _window_views(ctx, _pad(ctx, ctx.random_variance(x), pads, 0.0), kernel, stride, out_hw)
    mean, var = next(means), next(vars_)
    for m, v in zip(means, vars_):
        mean, var = moments.max_moments(mean, var, m, v, ctx.ops)
    return ctx.emit_output(mean, var, layer)


@exporter("avg_pool2d")
def _avg_pool2d(ctx: _Ctx, layer: PlannedLayer, inputs: list[_Act]) -> _Act:
    """``reference.pooling.avg_pool2d``: ``μ ↦ Σμ/d``, ``v ↦ Σv/d²`` with torch's divisors ``d``.

    ``AveragePool`` on the zero-padded input gives ``Σ/(kh·kw)``; a constant per output position
    rescales it to ``Σ/d`` (and ``Σ/d²``)."""
    from .reference.pooling import average_divisor

    a, x = layer.layer.attrs, inputs[0]
    kernel, stride = list(a["kernel"]), list(a["stride"])
    in_hw = tuple(ctx.shapes[layer.inputs[0]][1:])
    out_hw = tuple(layer.layer.out_shape[1:])
    pads = _window_pads(layer, in_hw)
    divisor = average_divisor(a, in_hw, out_hw)
    window = float(kernel[0] * kernel[1])

    def window_sum_over(t: _Sym, scale: np.ndarray, hint: str) -> _Sym:
        pooled = _pad(ctx, t, pads, 0.0).nary("AveragePool", kernel_shape=kernel, strides=stride)
        return pooled * _Sym(ctx.b, ctx.b.initializer(scale, hint))

    mean = window_sum_over(x.mean, window / divisor, "mean_scale")
    if x.repr is D:
        return _Act(mean, None, D)
    var = window_sum_over(ctx.random_variance(x), window / divisor**2, "var_scale")
    return ctx.emit_output(mean, var, layer)


@exporter("leaky_relu")
def _leaky_relu(ctx: _Ctx, layer: PlannedLayer, inputs: list[_Act]) -> _Act:
    x, slope = inputs[0], float(layer.layer.attrs["slope"])
    if x.repr is D:
        mean = ctx.ops.where(x.mean > ctx.ops.const(0.0), x.mean, ctx.ops.const(slope) * x.mean)
        return _Act(mean, None, D)
    mean, var = moments.leaky_relu_moments(x.mean, ctx.variance(x), slope, ctx.ops)
    return ctx.emit_output(mean, var, layer)


@exporter("affine")
def _affine(ctx: _Ctx, layer: PlannedLayer, inputs: list[_Act]) -> _Act:
    """Per-channel ``μ ↦ a·μ + c``, ``v ↦ a²·v`` (channel axis 1)."""
    x = inputs[0]
    shape = (-1,) + (1,) * (len(layer.layer.out_shape) - 1)
    scale = layer.tensors["scale"].reshape(shape)
    mean = x.mean * _Sym(ctx.b, ctx.b.initializer(scale, "scale")) + _Sym(
        ctx.b, ctx.b.initializer(layer.tensors["shift"].reshape(shape), "shift"))
    if x.repr is D:
        return _Act(mean, None, D)
    var = ctx.variance(x) * _Sym(ctx.b, ctx.b.initializer(scale**2, "scale_sq"))
    return ctx.emit_output(mean, var, layer)


@exporter("add")
def _add(ctx: _Ctx, layer: PlannedLayer, inputs: list[_Act]) -> _Act:
    """Sum of two independent Gaussians: means and variances add."""
    a, c = inputs
    mean = a.mean + c.mean
    if a.repr is D and c.repr is D:
        return _Act(mean, None, D)
    va, vc = ctx.variance(a), ctx.variance(c)
    var = va if vc is None else vc if va is None else va + vc
    assert var is not None  # both deterministic returned above
    return ctx.emit_output(mean, var, layer)


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


def _planned(net: Any) -> PlannedGraph:
    if isinstance(net, PlannedGraph):
        return net
    planned = getattr(net, "plan", None)
    if isinstance(planned, PlannedGraph):
        return planned
    raise TypeError(f"to_onnx needs a PFPNetwork or a PlannedGraph, got {type(net).__name__}")


def build_model(net: Any, *, opset: int = DEFAULT_OPSET, graph_name: str | None = None):
    """The PFP network as an ``onnx.ModelProto`` (checked with ``onnx.checker``, full check)."""
    import onnx
    from onnx import TensorProto, helper

    from ._version import __version__

    graph = _planned(net)
    if int(opset) < MIN_OPSET:
        raise PFPError(f"opset must be >= {MIN_OPSET} (Erf, Where and Slice with steps), got {opset}")
    missing = sorted({layer.op for layer in graph.layers if layer.op not in EXPORTERS})
    if missing:
        source = next(layer.layer.source for layer in graph.layers if layer.op in missing)
        raise UnsupportedLayerError(
            f"{source}: the ONNX exporter has no emitter for PFP op(s) {missing}; "
            f"supported: {sorted(EXPORTERS)}")

    b = _Builder()
    ctx = _Ctx(b, _onnx_ops(b), {INPUT: tuple(graph.input_shape)})
    ctx.shapes.update({layer.name: tuple(layer.layer.out_shape) for layer in graph.layers})
    in_dims: list[str | int] = ["batch", *graph.input_shape]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, in_dims)]
    b._used["x"] += 1
    if graph.input_repr is D:
        values = {INPUT: _Act(_Sym(b, "x"), None, D)}
    else:
        inputs.append(helper.make_tensor_value_info("x_var", TensorProto.FLOAT, in_dims))
        b._used["x_var"] += 1
        values = {INPUT: _Act(_Sym(b, "x"), _Sym(b, "x_var"), V)}

    for layer in graph.layers:
        b.scope = layer.name
        values[layer.name] = EXPORTERS[layer.op](ctx, layer, [values[name] for name in layer.inputs])
        if values[layer.name].repr is not layer.out_repr:
            raise PFPError(f"ONNX exporter bug: {layer.name} gave {values[layer.name].repr}, "
                           f"the plan says {layer.out_repr}")
    b.scope = "output"
    result = values[graph.output]
    var = ctx.variance(result)
    if var is None:  # a deterministic output: exact zeros of the mean's shape
        zero = helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])
        var = _Sym(b, b.node("ConstantOfShape", [b.node("Shape", [result.mean.name])], value=zero))
    b.nodes.append(helper.make_node("Identity", [result.mean.name], ["mean"], name="output/mean"))
    b.nodes.append(helper.make_node("Identity", [var.name], ["var"], name="output/var"))
    out_dims: list[str | int] = ["batch", *graph.shape_of(graph.output)]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, out_dims) for n in ("mean", "var")]

    name = graph_name or "pfp_network"
    g = helper.make_graph(b.nodes, name, inputs, outputs, initializer=b.initializers,
                          doc_string="Probabilistic Forward Pass network (pyro2pfp): "
                                     "outputs the mean and variance of every output unit")
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", int(opset))],
                              producer_name="pyro2pfp", producer_version=__version__)
    model.ir_version = _IR_VERSION_FOR_OPSET.get(int(opset), onnx.IR_VERSION)
    helper.set_model_props(model, {
        "pyro2pfp.input_shape": ",".join(map(str, graph.input_shape)),
        "pyro2pfp.input_variance": str(graph.input_repr is not D).lower(),
        "pyro2pfp.moment_form": graph.moment_form,
        "pyro2pfp.calibration": repr(graph.calibration),
    })
    onnx.checker.check_model(model, full_check=True)
    return model


def to_onnx(net: Any, path: str | os.PathLike | None = None, *, opset: int = DEFAULT_OPSET):
    """Write the PFP network ``net`` (a ``PFPNetwork`` or ``PlannedGraph``) as an ONNX model.

    Inputs ``x`` (and ``x_var`` if the network takes an input variance), outputs ``mean`` and
    ``var``, float32, dynamic batch dimension ``batch``; standard ONNX operators only (default
    domain, ``opset`` ≥ 17).  The model is validated with ``onnx.checker`` before it is written.
    Returns the ``onnx.ModelProto`` (and writes it to ``path`` if given).

    >>> pyro2pfp.onnx_export.to_onnx(net, "net.onnx")
    >>> sess = onnxruntime.InferenceSession("net.onnx"); mean, var = sess.run(None, {"x": x})
    """
    import onnx

    model = build_model(net, opset=opset)
    if path is not None:
        path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"cannot write {path}: directory {directory} does not exist")
        onnx.save_model(model, path)
    return model


def onnx_ops_used(model: Any) -> Counter[str]:
    """How often each ONNX operator occurs in ``model`` (a ModelProto or a path)."""
    import onnx

    if not hasattr(model, "graph"):
        model = onnx.load(os.fspath(model))
    return Counter(node.op_type for node in model.graph.node)

