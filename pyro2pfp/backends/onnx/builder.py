"""Build the ONNX model of a planned PFP network, in standard operators (``net.to_onnx`` writes it).

The ONNX graph computes exactly what the NumPy reference (:mod:`pyro2pfp.backends.reference`) computes, in
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
Reshape, Concat, Shape, ConstantOfShape, Identity — nothing custom, default domain, opset 17 or newer.

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

from ... import moments
from ..._version import __version__
from ...errors import ArgumentError, PFPError, UnsupportedLayerError
from ...planning.graph import INPUT, Repr
from ...planning.plan import PlannedGraph, PlannedLayer
from ...planning.protocols import ConvertedNetwork, SchemeStep
from ...planning.registry import add_to

D, V, S = Repr.DETERMINISTIC, Repr.VARIANCE, Repr.SECOND_MOMENT
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
LOWEST32 = float(np.finfo(np.float32).min)  # the max-pool fold's identity mean (as the TVM kernels)

DEFAULT_OPSET = 17
MIN_OPSET = 17
# IR version 8 is the one that introduced opset 17: the oldest runtimes that can run the model load it.
_IR_VERSION_FOR_OPSET = {17: 8, 18: 8, 19: 9, 20: 9, 21: 10, 22: 10, 23: 11}

__all__ = ["to_onnx", "onnx_ops_used", "DEFAULT_OPSET", "exporter", "EXPORTERS", "Sym", "OnnxActivation",
           "OnnxContext"]


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


class Sym:
    """A symbolic float32 ONNX tensor (or a folded scalar constant) with Python operators."""

    __array_priority__ = 1000  # make numpy scalars defer to our reflected operators

    def __init__(self, b: _Builder, name: str | None = None, value: float | None = None) -> None:
        self.b = b
        self._name = name
        self.value = value  # set for scalar constants (folded until used by a node)

    @property
    def name(self) -> str:
        if self._name is None:
            assert self.value is not None  # a Sym is a named tensor or a constant
            self._name = self.b.scalar(self.value)
        return self._name

    # -- helpers
    def _wrap(self, other: Any) -> Sym:
        if isinstance(other, Sym):
            return other
        if isinstance(other, (int, float, np.floating, np.integer)):
            return Sym(self.b, value=float(other))
        raise TypeError(f"cannot combine an ONNX tensor with {type(other).__name__}")

    def _binary(self, op: str, other: Any, fold: Callable[[float, float], float], swap: bool = False) -> Sym:
        a, c = self, self._wrap(other)
        if swap:
            a, c = c, a
        if a.value is not None and c.value is not None:
            return Sym(self.b, value=float(fold(float(np.float32(a.value)), float(np.float32(c.value)))))
        return Sym(self.b, self.b.node(op, [a.name, c.name]))

    def __add__(self, o: Any) -> Sym:
        return self._binary("Add", o, lambda a, c: a + c)

    def __radd__(self, o: Any) -> Sym:
        return self._binary("Add", o, lambda a, c: a + c, swap=True)

    def __sub__(self, o: Any) -> Sym:
        return self._binary("Sub", o, lambda a, c: a - c)

    def __rsub__(self, o: Any) -> Sym:
        return self._binary("Sub", o, lambda a, c: a - c, swap=True)

    def __mul__(self, o: Any) -> Sym:
        return self._binary("Mul", o, lambda a, c: a * c)

    def __rmul__(self, o: Any) -> Sym:
        return self._binary("Mul", o, lambda a, c: a * c, swap=True)

    def __truediv__(self, o: Any) -> Sym:
        return self._binary("Div", o, lambda a, c: a / c)

    def __rtruediv__(self, o: Any) -> Sym:
        return self._binary("Div", o, lambda a, c: a / c, swap=True)

    def __neg__(self) -> Sym:
        if self.value is not None:
            return Sym(self.b, value=-self.value)
        return Sym(self.b, self.b.node("Neg", [self.name]))

    def __gt__(self, o: Any) -> Sym:
        return Sym(self.b, self.b.node("Greater", [self.name, self._wrap(o).name]))

    def __lt__(self, o: Any) -> Sym:
        return Sym(self.b, self.b.node("Less", [self.name, self._wrap(o).name]))

    def __le__(self, o: Any) -> Sym:
        return Sym(self.b, self.b.node("LessOrEqual", [self.name, self._wrap(o).name]))

    def __pow__(self, p: int) -> Sym:
        if p != 2:
            raise ValueError("only squares are needed")
        return self * self

    # -- named ops
    def unary(self, op: str) -> Sym:
        return Sym(self.b, self.b.node(op, [self.name]))

    def nary(self, op: str, *others: Any, **attrs: Any) -> Sym:
        names = [self.name] + [o if isinstance(o, str) else self._wrap(o).name for o in others]
        return Sym(self.b, self.b.node(op, names, **attrs))


def _onnx_ops(b: _Builder) -> SimpleNamespace:
    """The ``ops`` namespace of :mod:`pyro2pfp.moments` on symbolic ONNX tensors."""

    def where(cond: Sym, a: Any, c: Any) -> Sym:
        return cond.nary("Where", a, c)

    def elementwise(op: str, x: Any, y: Any) -> Sym:
        x = x if isinstance(x, Sym) else Sym(b, value=float(x))
        return x.nary(op, y)

    def normal_cdfs(alpha: Sym) -> tuple[Sym, Sym]:
        """(Φ(α), Φ(−α)) from one Erf, as the TVM kernels compute them."""
        half_erf = Sym(b, value=0.5) * (alpha * Sym(b, value=_INV_SQRT2)).unary("Erf")
        return Sym(b, value=0.5) + half_erf, Sym(b, value=0.5) - half_erf

    ns = SimpleNamespace(
        where=where,
        normal_cdfs=normal_cdfs,
        erf=lambda x: x.unary("Erf"),
        erfc=lambda x: Sym(b, value=1.0) - x.unary("Erf"),  # as the TVM kernels: 1 − erf
        exp=lambda x: x.unary("Exp"),
        sqrt=lambda x: x.unary("Sqrt"),
        maximum=lambda x, y: elementwise("Max", x, y),
        minimum=lambda x, y: elementwise("Min", x, y),
        const=lambda v: Sym(b, value=float(v)),
    )
    ns.erfcx = lambda x: moments.erfcx_rational(x, ns)  # e^{x²}·erfc(x), x ≥ 0, as the TVM kernels
    return ns


# ---------------------------------------------------------------------------------------------
# Activations, the ONNX back end of the shared formulas, and the exporter table
# ---------------------------------------------------------------------------------------------


@dataclass
class OnnxActivation:
    """A batch of independent Gaussians in the ONNX graph (``second`` is None when deterministic)."""

    mean: Sym
    second: Sym | None
    repr: Repr


@dataclass
class OnnxContext:
    b: _Builder
    ops: SimpleNamespace
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # edge name -> shape (no batch)

    def variance(self, x: OnnxActivation) -> Sym | None:
        if x.repr is D:
            return None
        if x.repr is V:
            return x.second
        return moments.second_to_variance(x.mean, x.second, self.ops)

    def random_variance(self, x: OnnxActivation) -> Sym:
        """The variance of an activation the plan marks as random (not deterministic)."""
        var = self.variance(x)
        if var is None:
            raise PFPError("internal: a deterministic activation where the plan expects a random one")
        return var

    def second_moment(self, x: OnnxActivation) -> Sym:
        if x.repr is S:
            assert x.second is not None
            return x.second
        var = self.variance(x)
        return x.mean * x.mean if var is None else moments.variance_to_second(x.mean, var, self.ops)

    def emit(self, mean: Sym, var: Sym, layer: PlannedLayer) -> OnnxActivation:
        """The layer's (mean, variance) in the representation the plan asks it to emit."""
        if layer.out_repr is V:
            return OnnxActivation(mean, var, V)
        if layer.out_repr is S:
            return OnnxActivation(mean, moments.variance_to_second(mean, var, self.ops), S)
        return OnnxActivation(mean, None, D)

    # -- the back end of the formulas shared with the NumPy reference (reference.NumpyBackend)
    @staticmethod
    def deterministic(mean: Sym) -> OnnxActivation:
        return OnnxActivation(mean, None, D)

    def tensor(self, array: np.ndarray, hint: str) -> Sym:
        """A float32 initializer."""
        return Sym(self.b, self.b.initializer(array, hint))

    def dense(self, x: Sym, weight: np.ndarray, hint: str) -> Sym:
        """``x @ weight.T`` (weight in torch layout (out, in), stored transposed)."""
        return x.nary("MatMul", self.b.initializer(weight.T, hint + "_t"))

    def conv2d(self, x: Sym, weight: np.ndarray, attrs: dict, hint: str) -> Sym:
        (ph, pw), (kh, kw) = attrs["padding"], weight.shape[2:]
        return x.nary("Conv", self.b.initializer(weight, hint), kernel_shape=[int(kh), int(kw)],
                      strides=list(attrs["stride"]), pads=[ph, pw, ph, pw], dilations=list(attrs["dilation"]),
                      group=int(attrs["groups"]))

    def reshape(self, t: Sym, shape: tuple[int, ...]) -> Sym:
        """``t`` reshaped to ``(batch, *shape)``."""
        return t.nary("Reshape", self.b.ints([-1, *shape], "shape"))

    @staticmethod
    def concat(ts: list[Sym], axis: int) -> Sym:
        """``ts`` joined along per-sample axis ``axis`` (the batch axis kept first)."""
        return ts[0] if len(ts) == 1 else ts[0].nary("Concat", *ts[1:], axis=axis + 1)

    # -- tensor algebra of the compact factor rules (reference.NumpyBackend has the same members)
    lowest = LOWEST32  # the identity of a max fold's mean (padded window taps)

    @staticmethod
    def einsum(equation: str, *ts: Sym) -> Sym:
        return ts[0].nary("Einsum", *ts[1:], equation=equation)

    def rows(self, t: Sym, shape: tuple[int, ...]) -> Sym:
        """``t`` reshaped to ``(-1, *shape)``."""
        return t.nary("Reshape", self.b.ints([-1, *shape], "shape"))

    @staticmethod
    def permute(t: Sym, perm: tuple[int, ...]) -> Sym:
        return t.nary("Transpose", perm=list(perm))

    def rsum(self, t: Sym, axis: int) -> Sym:
        """The sum over ``axis`` (dropped)."""
        return t.nary("ReduceSum", self.b.ints([axis], "axes"), keepdims=0)

    def slice(self, t: Sym, axis: int, start: int, stop: int) -> Sym:
        return t.nary("Slice", self.b.ints([start], "starts"), self.b.ints([stop], "ends"), self.b.ints([axis], "axes"))

    def taps(self, t: Sym, kernel: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int],
             begin: tuple[int, int], end: tuple[int, int], out_hw: tuple[int, int], fill: float) -> list[Sym]:
        """The strided (B, C, OH, OW) view of ``t`` (B, C, H, W) at every kernel offset (row-major): a Pad by
        ``begin``/``end`` with ``fill``, then a strided Slice per offset."""
        if any(begin) or any(end):
            t = t.nary("Pad", self.b.ints([0, 0, begin[0], begin[1], 0, 0, end[0], end[1]], "pads"),
                       Sym(self.b, value=float(fill)))
        out = []
        for i in range(kernel[0]):
            for j in range(kernel[1]):
                r0, c0 = i * dilation[0], j * dilation[1]
                ends = [r0 + stride[0] * (out_hw[0] - 1) + 1, c0 + stride[1] * (out_hw[1] - 1) + 1]
                out.append(t.nary("Slice", self.b.ints([r0, c0], "starts"), self.b.ints(ends, "ends"),
                                  self.b.ints([2, 3], "axes"), self.b.ints(list(stride), "steps")))
        return out

    def unfold(self, t: Sym, channels: int, kernel: tuple[int, int], stride: tuple[int, int],
               dilation: tuple[int, int], begin: tuple[int, int], end: tuple[int, int], out_hw: tuple[int, int],
               fill: float) -> Sym:
        """``(B, C·KH·KW, OH·OW)``: the views of :meth:`taps` as rows, channel-major (row ``c·KH·KW + tap``)."""
        p = out_hw[0] * out_hw[1]
        views = self.taps(t, kernel, stride, dilation, begin, end, out_hw, fill)
        return self.rows(self.concat([self.rows(v, (channels, 1, p)) for v in views], 1),
                         (channels * len(views), p))

    def zeros_like(self, t: Sym) -> Sym:
        """Exact zeros of ``t``'s (dynamic) shape (not ``0·t``, which is NaN where ``t`` is infinite)."""
        from onnx import TensorProto, helper

        zero = helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])
        return Sym(self.b, self.b.node("ConstantOfShape", [self.b.node("Shape", [t.name])], value=zero))

    # -- of the shared-factor rules (``correlation/shared_algebra.py``; reference.NumpyBackend has the same members)
    @staticmethod
    def matmul(a: Sym, b: Sym) -> Sym:
        """Batched matrix product over the last two axes (the leading ones broadcast)."""
        return a.nary("MatMul", b)

    def widened(self, g: Sym, k_in: int, k: int) -> Sym:
        """``g`` (B, R, k_in) with zero columns appended up to ``k``."""
        return g if k_in >= k else g.nary("Pad", self.b.ints([0, 0, 0, 0, 0, k - k_in], "pads"))

    def pad2d(self, t: Sym, begin: tuple[int, int], end: tuple[int, int]) -> Sym:
        """``t`` (B, C, H, W) with ``begin``/``end`` rows and columns of zeros."""
        if not any(begin) and not any(end):
            return t
        return t.nary("Pad", self.b.ints([0, 0, begin[0], begin[1], 0, 0, end[0], end[1]], "pads"),
                      Sym(self.b, value=0.0), mode="constant")

    def window(self, t: Sym, start: tuple[int, int], stride: tuple[int, int], out_hw: tuple[int, ...]) -> Sym:
        """The strided (B, C, OH, OW) view of ``t`` (B, C, H, W) from ``start`` (a Slice)."""
        ends = [start[k] + stride[k] * (out_hw[k] - 1) + 1 for k in (0, 1)]
        return t.nary("Slice", self.b.ints(list(start), "starts"), self.b.ints(ends, "ends"),
                      self.b.ints([2, 3], "axes"), self.b.ints(list(stride), "steps"))

    def edge_shape(self, x: OnnxActivation, name: str) -> tuple[int, ...]:
        """The per-sample shape of input activation ``x`` (edge ``name``)."""
        return tuple(self.shapes[name])

    @staticmethod
    def all_zero(t: Sym) -> bool:
        """False: the values are not known when exporting."""
        return False


Exporter = Callable[[OnnxContext, PlannedLayer, list[OnnxActivation]], OnnxActivation]
EXPORTERS: dict[str, Exporter] = {}


#: ``@exporter(op)`` registers the ONNX emitter of PFP op ``op`` (once).
exporter = add_to(EXPORTERS, "ONNX export of op")

SCHEME_STEPS: dict[str, Callable[[PlannedGraph, OnnxContext], SchemeStep[OnnxContext, OnnxActivation]]] = {}
"""``{correlation scheme: factory(graph, ctx) -> step(ctx, layer, inputs, out) -> out}`` for plans that
are not mean-field (``"shared-factor"``: :mod:`pyro2pfp.correlation.onnx_step`, which builds on this
module): the step emits the scheme's nodes after each layer's export."""


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


def _planned(net: ConvertedNetwork | PlannedGraph) -> PlannedGraph:
    if isinstance(net, PlannedGraph):
        return net
    planned = getattr(net, "plan", None)
    if isinstance(planned, PlannedGraph):
        return planned
    raise TypeError(f"to_onnx needs a PFPNetwork or a PlannedGraph, got {type(net).__name__}")


def build_model(net: ConvertedNetwork | PlannedGraph, *, opset: int = DEFAULT_OPSET, graph_name: str | None = None):
    """The PFP network as an ``onnx.ModelProto`` (checked with ``onnx.checker``, full check)."""
    import onnx
    from onnx import TensorProto, helper

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
    ctx = OnnxContext(b, _onnx_ops(b), {INPUT: tuple(graph.input_shape)})
    ctx.shapes.update({layer.name: tuple(layer.layer.out_shape) for layer in graph.layers})
    in_dims: list[str | int] = ["batch", *graph.input_shape]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, in_dims)]
    b._used["x"] += 1
    if graph.input_repr is D:
        values = {INPUT: OnnxActivation(Sym(b, "x"), None, D)}
    else:
        inputs.append(helper.make_tensor_value_info("x_var", TensorProto.FLOAT, in_dims))
        b._used["x_var"] += 1
        values = {INPUT: OnnxActivation(Sym(b, "x"), Sym(b, "x_var"), V)}

    # shared-factor PFP: its rules after each layer's export (pyro2pfp/correlation/onnx_step.py)
    if graph.factors is not None and graph.factors.scheme not in SCHEME_STEPS:
        raise ArgumentError(f"ONNX export has no rules for correlation={graph.factors.scheme!r} yet; "
                            "net.reference runs it, or convert with correlation='shared-factor' or 'mean-field'")
    step = SCHEME_STEPS[graph.factors.scheme](graph, ctx) if graph.factors is not None else None
    for layer in graph.layers:
        b.scope = layer.name
        layer_inputs = [values[name] for name in layer.inputs]
        if step is not None and step.emits_mean_field(layer):  # the rule exports the layer's whole output
            values[layer.name] = step(ctx, layer, layer_inputs, None)
        else:
            values[layer.name] = EXPORTERS[layer.op](ctx, layer, layer_inputs)
            if step is not None:
                values[layer.name] = step(ctx, layer, layer_inputs, values[layer.name])
        if values[layer.name].repr is not layer.out_repr:
            raise PFPError(f"ONNX exporter bug: {layer.name} gave {values[layer.name].repr}, "
                           f"the plan says {layer.out_repr}")
    b.scope = "output"
    result = values[graph.output]
    var = ctx.variance(result)
    if var is None:  # a deterministic output: exact zeros of the mean's shape
        zero = helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])
        var = Sym(b, b.node("ConstantOfShape", [b.node("Shape", [result.mean.name])], value=zero))
    # an output layer may name its outputs and give its second one its own shape (the uncertainty head)
    out_attrs = graph.layer(graph.output).layer.attrs if graph.output != INPUT else {}
    names = tuple(out_attrs.get("output_names", ("mean", "var")))
    out_dims: list[str | int] = ["batch", *graph.shape_of(graph.output)]
    second_dims: list[str | int] = ["batch", *out_attrs.get("second_shape", graph.shape_of(graph.output))]
    b.nodes.append(helper.make_node("Identity", [result.mean.name], [names[0]], name=f"output/{names[0]}"))
    b.nodes.append(helper.make_node("Identity", [var.name], [names[1]], name=f"output/{names[1]}"))
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, dims)
               for n, dims in zip(names, (out_dims, second_dims), strict=True)]

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
        "pyro2pfp.correlation": graph.correlation,
    })
    onnx.checker.check_model(model, full_check=True)
    return model


def to_onnx(net: ConvertedNetwork | PlannedGraph, path: str | os.PathLike | None = None, *, opset: int = DEFAULT_OPSET):
    """Write the PFP network ``net`` (a ``PFPNetwork`` or ``PlannedGraph``) as an ONNX model.

    Inputs ``x`` (and ``x_var`` if the network takes an input variance), outputs ``mean`` and
    ``var``, float32, dynamic batch dimension ``batch``; standard ONNX operators only (default
    domain, ``opset`` ≥ 17).  The model is validated with ``onnx.checker`` before it is written.
    Returns the ``onnx.ModelProto`` (and writes it to ``path`` if given).

    >>> pyro2pfp.backends.onnx.builder.to_onnx(net, "net.onnx")
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

