"""Code people write in ``forward`` that ``torch.export`` does not take as it is, and what to say.

* **Device moves** (``self.to(device)``, ``x.to(device)``, ``.cpu()``, a ``.cuda()`` guarded by
  ``torch.cuda.is_available()``): the network is traced on the CPU in float32, where each of them is
  the identity.  While the model is exported, a module ``.to``/``.cpu`` that changes nothing returns the
  module (torch's own ``_apply`` fails on the exported copy's parameters), and
  :func:`fold_device_moves` removes the tensor moves that keep the dtype and the device from the
  graph.  An unguarded ``.cuda()`` on a machine without CUDA is named with its line
  (:func:`cuda_message`).
* **A batch size turned into a Python int** (``len(x)`` for the plate, ``int(x.shape[0])``, a
  NumPy array sized by the batch, ``x.shape[0] == 100``): torch reports only "Constraints violated
  (batch)", and :func:`batch_specialisations` records the user's line where the batch size stopped
  being symbolic.  Most often the int only sizes the likelihood's plate, which PFP strips: the model is
  then traced at two fixed batch sizes, and :func:`batch_reaches_network` proves that the network the
  output depends on is the same at both, op by op, with the batch only as the first dimension of its
  activations -- so the program traced at one of them is the network for every batch size.  Where the
  batch size does reach the network, the message names the line that fixed it and the op it reached.
"""
from __future__ import annotations

import contextlib
import inspect
import linecache
import sys
import sysconfig
import threading
import traceback
import types
from collections.abc import Iterator
from typing import Any

import torch

from .trace_passes import tensor_ops, user_source

_NOT_USER = ("/torch/", "/pyro/", "/pyro2pfp/", "/sympy/", "/tyxe/", "<frozen ", "<string>")
_STDLIB = sysconfig.get_paths()["stdlib"]


def _is_user_file(filename: str) -> bool:
    return not any(part in filename for part in _NOT_USER) and not filename.startswith(_STDLIB)


def _describe(filename: str, lineno: int, name: str) -> str:
    code = linecache.getline(filename, lineno).strip()
    return f"{filename}:{lineno} in {name}" + (f" (`{code}`)" if code else "")


def user_frame_of(exc: BaseException) -> str | None:
    """``file:line in function (`code`)`` of the innermost frame of the user's code in the traceback of
    ``exc`` (or of the exceptions it was raised from), or None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_user_file(f.filename)]
        if frames:
            f = frames[-1]
            return _describe(f.filename, f.lineno or 0, f.name)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return None


def _user_frame_here() -> str | None:
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None:
        if _is_user_file(frame.f_code.co_filename):
            return _describe(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back
    return None


# ------------------------------------------------------------------------------------ source lines
def named_forward(model: Any) -> Any:
    """``model`` itself, or -- for a model function or method (``model(x, y)``, ``bnn.model``) -- the same
    function under the code name ``forward``.

    torch.export records, for every node, the stack frames of ``forward`` functions only (besides its own), so
    the lines of a model function or a ``model()`` method would be missing from the messages that name the
    user's line (:func:`pyro2pfp.frontend.trace_passes.user_source`); the copy runs the same code."""
    fn = getattr(model, "__func__", model)
    if not isinstance(fn, types.FunctionType) or fn.__code__.co_name == "forward":
        return model
    code = fn.__code__.replace(co_name="forward")
    copy = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__dict__ = fn.__kwdefaults__, dict(fn.__dict__)
    copy.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
    owner = getattr(model, "__self__", None)
    return types.MethodType(copy, owner) if owner is not None else copy


# ------------------------------------------------------------------------------------ device moves
def _moves_nothing(module: torch.nn.Module, device: Any, dtype: Any) -> bool:
    if device is not None and torch.device(device).type != "cpu":
        return False
    if dtype is None:
        return True
    return all(t.dtype == dtype for t in [*module.parameters(), *module.buffers()] if t.is_floating_point())


@contextlib.contextmanager
def device_moves_kept() -> Iterator[None]:
    """While active, ``module.to(...)`` / ``module.cpu()`` that would leave every parameter where and
    as it is return the module untouched (others, and ``.cuda()``, run as usual)."""
    original_to, original_cpu = torch.nn.Module.to, torch.nn.Module.cpu
    thread = threading.get_ident()

    def to(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == thread:
            device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
            if _moves_nothing(self, device, dtype):
                return self
        return original_to(self, *args, **kwargs)

    def cpu(self: torch.nn.Module) -> Any:
        return self if threading.get_ident() == thread else original_cpu(self)

    torch.nn.Module.to, torch.nn.Module.cpu = to, cpu  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.to, torch.nn.Module.cpu = original_to, original_cpu  # type: ignore[method-assign]


_MOVES = {"aten.to.dtype_layout", "aten.to.device", "aten.to.dtype", "aten.to.prim_Device", "aten.to.other",
          "aten._to_copy.default", "aten._to_copy", "aten.to", "aten.cpu.default"}


def fold_device_moves(program: torch.export.ExportedProgram) -> None:
    """Replace each tensor move (``x.to(device)``, ``x.cpu()``, ``x.float()`` of a float32 tensor) that
    keeps the dtype and the device by its input."""
    for node in list(program.graph_module.graph.nodes):
        if node.op != "call_function" or str(node.target) not in _MOVES or not node.args:
            continue
        src, out = node.args[0], node.meta.get("val")
        val = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
        if isinstance(val, torch.Tensor) and isinstance(out, torch.Tensor) and val.dtype == out.dtype \
                and val.device == out.device and val.shape == out.shape:
            node.replace_all_uses_with(src)
    program.graph_module.graph.eliminate_dead_code()
    program.graph_module.recompile()


def cuda_message(exc: BaseException) -> str | None:
    """The remedy for a model that moves itself or a tensor to CUDA on a machine without it, or None."""
    text = f"{exc}"
    cause = exc.__cause__ or exc.__context__
    text += f" {cause}" if cause is not None else ""
    if "CUDA" not in text and "NVIDIA" not in text and "cuda" not in text:
        return None
    where = user_frame_of(exc)
    return (f"forward() moves the model or a tensor to CUDA{f' at {where}' if where else ''}, and this machine has "
            "no CUDA device; PFP traces the network on the CPU. Move to a device chosen by availability, e.g. "
            "`device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')` and `x.to(device)`, or guard "
            "the move with `if torch.cuda.is_available():`.")


# ------------------------------------------------------------------------------------ batch size
def _symbols(node: Any) -> set[Any]:
    expr = getattr(node, "expr", None)
    return set(getattr(expr, "free_symbols", ()))


def _constants(node: Any, symbols: set[Any]) -> bool:
    """Whether the shape environment of the SymNode ``node`` now replaces every one of ``symbols``
    by a constant."""
    import sympy

    env = getattr(node, "shape_env", None)
    return env is not None and bool(symbols) and all(
        isinstance(env.replacements.get(s), sympy.Integer) for s in symbols)


@contextlib.contextmanager
def batch_specialisations(found: list[str]) -> Iterator[None]:
    """While active, append to ``found`` the user's line (``file:line in fn (`code`)``) where a
    symbolic size (the batch) is first turned into a constant: a Python int (``len(x)``,
    ``int(x.shape[0])``, NumPy) or a test that fixes it (``x.shape[0] == 100``)."""
    thread = threading.get_ident()
    patched: list[tuple[type, str, Any]] = []

    def watch(cls: type, name: str) -> None:
        original = vars(cls)[name]

        def method(self: Any, *args: Any) -> Any:
            if threading.get_ident() != thread or found:
                return original(self, *args)
            symbols = _symbols(self.node)
            result = original(self, *args)
            if symbols and _constants(self.node, symbols):
                where = _user_frame_here()
                if where is not None:
                    found.append(where)
            return result

        patched.append((cls, name, original))
        setattr(cls, name, method)

    for cls, names in ((torch.SymInt, ("__int__", "__index__")), (torch.SymBool, ("__bool__",))):
        for name in names:
            if name in vars(cls):
                watch(cls, name)
    try:
        yield
    finally:
        for owner, attr, original in patched:
            setattr(owner, attr, original)


def specialisation_message(model_name: str, where: str | None, reached: str | None = None) -> str:
    """What to say when the batch dimension was fixed while the model was traced (``reached``: where the fixed
    size reaches the network, if known)."""
    at = f" at {where}" if where else ""
    reaches = f", and {reached}" if reached else ""
    return (f"the model {model_name} fixes the batch size while it is traced{at}{reaches}: it turns the batch "
            "dimension "
            "into a Python int (len(x), int(x.shape[0]), a NumPy array sized by the batch, a test such as "
            "x.shape[0] == 100, a plate's subsample_size, …). PFP needs one network for every batch size (a fixed "
            "size that only sizes the likelihood's plate is fine): write x.shape[0] (or x.size(0)), which torch "
            "keeps symbolic, "
            "e.g. pyro.plate('data', x.shape[0]) instead of pyro.plate('data', len(x)).")


_BATCH_FIRST_SHAPES = {"view", "reshape", "_unsafe_view", "expand"}  # a shape argument: the batch may lead it


def _plain_args(node: torch.fx.Node) -> list[Any]:
    """The node's arguments with every node replaced by a placeholder, nested lists kept."""
    return list(torch.fx.node.map_arg((node.args, node.kwargs), lambda _: "<node>"))


def _same_but_batch(op: str, a: Any, b: Any, batches: tuple[int, int], top: bool = True) -> bool:
    """``a`` (traced at ``batches[0]``) and ``b`` (at ``batches[1]``) are equal, but for a shape argument of a
    view/reshape/expand that starts with the batch size."""
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        if op in _BATCH_FIRST_SHAPES and a and all(isinstance(v, int) for v in (*a, *b)) and a[0] == batches[0] \
                and b[0] == batches[1] and list(a[1:]) == list(b[1:]):
            return True
        return all(_same_but_batch(op, x, y, batches, False) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_but_batch(op, a[k], b[k], batches, False) for k in a)
    return type(a) is type(b) and a == b


def batch_reaches_network(first: torch.export.ExportedProgram, second: torch.export.ExportedProgram,
                          batches: tuple[int, int], reached: Any) -> str | None:
    """None if the two programs, traced at the fixed batch sizes ``batches``, compute the same network: the
    same tensor ops the output depends on, in the same order, with the same arguments (a view/reshape/expand
    may start its shape with the batch size) and the batch only as the first dimension of every activation
    (``reached(program)``: the nodes that depend on the input); else where the batch size reaches an op."""
    ops = [tensor_ops(first), tensor_ops(second)]
    if [str(n.target) for n in ops[0]] != [str(n.target) for n in ops[1]]:
        return "the network computes other ops at another batch size"
    activations = reached(first)
    for a, b in zip(*ops, strict=True):
        op = str(a.target).removeprefix("aten.").split(".")[0]
        where = f"{op} at {user_source(a)}"
        va, vb = a.meta.get("val"), b.meta.get("val")
        if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
            sa, sb = tuple(va.shape), tuple(vb.shape)
            if a in activations:
                if not sa or sa[0] != batches[0] or sb[0] != batches[1] or sa[1:] != sb[1:]:
                    return f"the batch size changes the shape of {where} other than in its first dimension"
            elif sa != sb:
                return f"the batch size changes the shape of the weight {where}"
        if not _same_but_batch(op, _plain_args(a), _plain_args(b), batches):
            return f"the batch size reaches the arguments of {where}"
    return None
