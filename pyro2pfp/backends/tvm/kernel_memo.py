"""Make each distinct kernel of a network once while it is emitted: a layer whose kernel would equal an
earlier layer's calls that layer's PrimFunc.

A ResNet repeats its blocks: ResNet-20's shared-factor module has 143 kernels but only 51 distinct ones.
Making a PrimFunc from a TE function (``te.compute`` in Python, then ``te.create_prim_func``) is most of
the emitter's time, and the emitter is most of a compile whose kernels the kernel cache holds.
:mod:`.sharing` finds equal kernels only after they are made; :class:`KernelMemo` recognises them
before, from what a kernel function can read:

* its code and, recursively, the values it closes over (and its defaults): numbers, strings, enums,
  tuples, lists, dicts, NumPy arrays (by content), functions, dataclasses (by their fields), the
  emitter's context (by the ReLU fused into the kernel and whether the weight-noise term is asked for);
* a :class:`~pyro2pfp.planning.plan.PlannedLayer` by its architecture: op, attributes, output shape,
  representations, and the names, shapes and dtypes of its tensors -- not its name, source or weight
  values: a kernel reads weights as arguments (``ctx.const``), never as values baked into its code;
* a Relax expression by its shape and dtype; TVM scalar constants by value;
* the shapes and dtypes of the argument tensors and the kernel's attributes but the layer's name.

Anything else a function closes over (a TE tensor, an object of another class) makes the kernel its
own: it is made as before, never shared by mistake.  The memo lives for one emission, whose global state
(context managers such as ``winograd.direct_convolutions``) does not change meanwhile.
:data:`VERIFY` (``$PYRO2PFP_VERIFY_KERNEL_REUSE=1``; the test suite sets it) makes every reused kernel
again and checks it equals the one reused, so a kernel function that does read something its key leaves
out fails loudly.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import os
import types
from typing import Any

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from ...planning.plan import PlannedLayer

#: make every reused kernel again and check it equals the reused one: ``$PYRO2PFP_VERIFY_KERNEL_REUSE=1``
#: (the test suite sets it)
VERIFY = os.environ.get("PYRO2PFP_VERIFY_KERNEL_REUSE", "").strip() not in ("", "0")

_MAX_DEPTH = 40
_NAME_ATTR = "pfp.layer"


class Unkeyable(Exception):
    """A kernel function reads a value :func:`key_of` cannot describe: the kernel is made anew."""


def key_of(obj: Any, depth: int = 0) -> Any:
    """A hashable description of ``obj`` as a kernel function reads it (module docstring); raises
    :class:`Unkeyable` for anything else."""
    if depth > _MAX_DEPTH:
        raise Unkeyable("nested too deeply")
    t = type(obj)
    if obj is None or t in (bool, int, float, str, bytes, complex):
        return (t.__name__, obj)
    nested = functools.partial(key_of, depth=depth + 1)
    if isinstance(obj, enum.Enum):
        return ("enum", t.__module__, t.__qualname__, obj.name)
    if t in (tuple, list):
        return (t.__name__, tuple(map(nested, obj)))
    if t is dict:
        return ("dict", tuple(sorted(((nested(k), nested(v)) for k, v in obj.items()), key=repr)))
    if isinstance(obj, np.ndarray):
        data = np.ascontiguousarray(obj)
        return ("ndarray", data.dtype.str, data.shape, hashlib.sha256(data.tobytes()).hexdigest())
    if isinstance(obj, np.generic):
        return ("np", obj.dtype.str, obj.item())
    if isinstance(obj, types.FunctionType):
        cells = tuple("self" if c.cell_contents is obj else nested(c.cell_contents) for c in obj.__closure__ or ())
        return ("function", obj.__code__, id(obj.__globals__), nested(obj.__defaults__), nested(obj.__kwdefaults__),
                cells)
    if isinstance(obj, functools.partial):
        return ("partial", nested(obj.func), nested(obj.args), nested(obj.keywords))
    if isinstance(obj, types.MethodType):
        return ("method", nested(obj.__func__), nested(obj.__self__))
    if isinstance(obj, (types.BuiltinFunctionType, types.ModuleType, type)):
        return ("global", obj)  # fixed for the process
    if isinstance(obj, (tvm.tirx.IntImm, tvm.tirx.FloatImm)):
        return ("imm", obj.dtype, obj.value)
    if isinstance(obj, relax.Expr):
        return ("relax", _type_key(obj.ty))
    if isinstance(obj, PlannedLayer):
        layer = obj.layer
        return ("layer", layer.op, nested(layer.attrs), tuple(layer.out_shape), nested(obj.in_reprs),
                nested(obj.out_repr), nested(obj.natural_out),
                tuple(sorted((k, np.shape(v), np.asarray(v).dtype.str) for k, v in obj.tensors.items())))
    kernel_key = getattr(obj, "kernel_key", None)
    if callable(kernel_key) and not isinstance(obj, type):
        return ("kernel_key", t.__qualname__, nested(kernel_key()))
    if dataclasses.is_dataclass(obj):
        return ("dataclass", t.__module__, t.__qualname__,
                tuple((f.name, nested(getattr(obj, f.name))) for f in dataclasses.fields(obj)))
    raise Unkeyable(f"{t.__module__}.{t.__qualname__}")


def _type_key(ty: Any) -> Any:
    """A Relax type by its shape (static dims as ints, symbolic ones by name) and dtype."""
    if isinstance(ty, relax.TupleType):
        return ("tuple", tuple(_type_key(f) for f in ty.fields))
    shape = getattr(ty, "shape", None)
    values = getattr(shape, "values", None)
    dims = None if values is None else tuple(int(d) if isinstance(d, tvm.tirx.IntImm) else str(d) for d in values)
    return (type(ty).__name__, dims, str(getattr(ty, "dtype", "")))


def _attrs_key(attrs: dict[str, Any]) -> Any:
    return tuple(sorted((k, str(v)) for k, v in attrs.items() if k != _NAME_ATTR))


class KernelMemo:
    """The kernels made so far in one emission, by key (module docstring)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled  # False: every kernel is made anew (get finds nothing)
        self._made: dict[Any, Any] = {}
        self.hits = 0
        self.misses = 0

    def key(self, fn: Any, args: list[Any], attrs: dict[str, Any], extra: Any = None,
            generic_last: Any = ()) -> Any:
        """The key of kernel function ``fn`` called on Relax ``args`` with PrimFunc ``attrs`` (``extra``:
        anything else the kernel's making depends on; ``generic_last``: the arguments whose last
        dimension the kernel takes as a parameter, left out), or None when it cannot be described."""
        try:
            types_ = [_type_key(a.ty) for a in args]
            for i in generic_last:
                kind, dims, dtype = types_[i]
                types_[i] = (kind, None if dims is None else (*dims[:-1], "generic"), dtype)
            return (key_of(fn), tuple(types_), _attrs_key(attrs), key_of(extra))
        except Unkeyable:
            return None

    def get(self, key: Any) -> Any:
        """What :meth:`put` stored under ``key`` (None for ``key`` None or not made yet)."""
        if key is None or not self.enabled:
            return None
        made = self._made.get(key)
        if made is None:
            self.misses += 1
        else:
            self.hits += 1
        return made

    def put(self, key: Any, value: Any) -> None:
        if key is not None:
            self._made[key] = value


def check_same(reused: tvm.tirx.PrimFunc, fresh: tvm.tirx.PrimFunc, name: str) -> None:
    """:data:`VERIFY`: the kernel ``name`` made again (``fresh``) equals the one reused for it."""
    def bare(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
        for attr in (_NAME_ATTR, "global_symbol"):
            if func.attrs is not None and attr in func.attrs:
                func = func.without_attr(attr)
        return func

    if not tvm_ffi.structural_equal(bare(reused), bare(fresh), map_free_vars=True):
        raise AssertionError(f"kernel {name}: reusing an earlier layer's PrimFunc, but this layer's kernel "
                             "function makes a different one -- it reads something its key "
                             "(backends/tvm/kernel_memo.py) leaves out")
