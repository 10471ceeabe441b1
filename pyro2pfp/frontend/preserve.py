"""``convert`` leaves what the user owns as it found it.

Converting runs the user's model and guide several times (to read the posterior, to sample the guide
for the consistency check, to trace the network, to find the likelihood's noise), and Pyro code
mutates the objects it runs on: a model that assigns ``pyro.sample(...)`` values to
``layer.weight`` registers them on the user's layers (while the network is traced those values are
our tracer's parameters), an autoguide that has never run creates its parameters, reading a
``PyroParam`` outside a run syncs it with the param store, a sample moves the global random state.
None of that may outlive the call, on success or failure.

:func:`preserved` snapshots, before anything runs, the state of every ``nn.Module`` reachable from the
model and guide (their submodules; for model/guide functions, the modules their code refers to
through globals, closures or a bound ``self``): attributes, parameters and buffers (objects *and*
values), train/eval mode, hooks, class; the param store; torch's, NumPy's and Python's global
random state; and restores all of it on exit.  Modules reached by no such route are covered by an
undo log: while a :func:`module_changes_undone` block is active, the first attribute assignment,
deletion, registration or mode change on *any* module (by the block's thread) snapshots that
module's attributes, and the block's exit restores them (the tracer wraps each run of the user's
code in one, so a model that assigns to a global network finds its layers as they were before the
next run).
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import random
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyro
import torch
from pyro.nn import PyroModule

_MUTATORS = ("__setattr__", "__delattr__", "register_parameter", "register_buffer", "add_module",
             "register_module", "train")
_CREATORS = ("__init__", "__setstate__")  # a module made inside an undo block is not restored


class _ModuleState:
    """One module's attributes: the ``__dict__`` entries (dicts copied one level: parameters, buffers,
    submodules, hooks, Pyro's samples/params) and its class.

    The entries are restored into the ``__dict__`` object they were read from: an object that takes
    another one's ``__dict__`` later (torch.fx's attribute proxies of the modules being exported do
    ``proxy.__dict__ = module.__dict__``) must not empty the dict it now shares."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.cls = type(module)
        self.state = vars(module)
        self.entries = {key: (value, copy.copy(value) if isinstance(value, dict) else None)
                        for key, value in self.state.items()}

    def restore(self) -> None:
        state = self.state
        if state is not vars(self.module):  # the object's __dict__ was replaced: its old one is not in use
            return
        for key in [k for k in state if k not in self.entries]:
            del state[key]
        for key, (value, contents) in self.entries.items():
            if contents is not None:
                value.clear()
                value.update(contents)
            state[key] = value
        if type(self.module) is not self.cls:
            self.module.__class__ = self.cls


class _UndoLog:
    def __init__(self) -> None:
        self.thread = threading.get_ident()  # only this thread's changes (another may be training)
        self.states: dict[int, _ModuleState] = {}
        self.created: dict[int, Any] = {}  # modules made inside the block (kept alive: ids stay unique)

    def touch(self, module: Any) -> None:
        if isinstance(module, torch.nn.Module) and id(module) not in self.states and id(module) not in self.created:
            self.states[id(module)] = _ModuleState(module)

    def create(self, module: Any) -> None:
        if id(module) not in self.states:
            self.created[id(module)] = module

    def restore(self) -> None:
        for state in reversed(list(self.states.values())):
            state.restore()


_ACTIVE: list[_UndoLog] = []
_ORIGINALS: list[tuple[type, str, Any]] = []


def _recording(original: Callable[..., Any], creates: bool) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        for log in _ACTIVE:
            if log.thread == threading.get_ident():
                log.create(self) if creates else log.touch(self)
        return original(self, *args, **kwargs)

    method.__name__ = getattr(original, "__name__", "method")
    method.__wrapped__ = original  # type: ignore[attr-defined]
    return method


def _patch() -> None:
    for cls in (torch.nn.Module, PyroModule):
        for name in (*_MUTATORS, *_CREATORS):
            if name in vars(cls):
                original = vars(cls)[name]
                _ORIGINALS.append((cls, name, original))
                setattr(cls, name, _recording(original, creates=name in _CREATORS))


def _unpatch() -> None:
    while _ORIGINALS:
        cls, name, original = _ORIGINALS.pop()
        setattr(cls, name, original)


@contextlib.contextmanager
def module_changes_undone() -> Iterator[None]:
    """Undo, on exit, every attribute assignment/deletion/registration and mode change made to any
    ``nn.Module`` inside the block (the module's attributes as they were before its first change)."""
    log = _UndoLog()
    if not _ACTIVE:
        _patch()
    _ACTIVE.append(log)
    try:
        yield
    finally:
        _ACTIVE.remove(log)
        if not _ACTIVE:
            _unpatch()
        log.restore()


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _referenced(obj: Any) -> list[Any]:
    """Objects a model/guide function refers to: its closure cells, the globals its code names (nested
    functions included), a bound method's ``self``, a partial's function and arguments."""
    if isinstance(obj, torch.nn.Module):
        return []
    out: list[Any] = []
    if inspect.ismethod(obj):
        out += [obj.__self__, obj.__func__]
    if hasattr(obj, "func") and hasattr(obj, "args"):  # functools.partial
        out += [obj.func, *obj.args, *getattr(obj, "keywords", {}).values()]
    fn = obj if inspect.isfunction(obj) else None
    if fn is not None:
        out += [cell.cell_contents for cell in fn.__closure__ or () if _cell_filled(cell)]
        out += [fn.__globals__[name] for name in _code_names(fn.__code__) if name in fn.__globals__]
    elif not isinstance(obj, type) and not inspect.ismodule(obj) and hasattr(obj, "__dict__") \
            and not inspect.isroutine(obj):
        out += list(vars(obj).values())  # an object holding the net (bnn.net) or a callable instance
        call = vars(type(obj)).get("__call__")
        if inspect.isfunction(call):
            out.append(call)
    return out


def _cell_filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def reachable_modules(*objects: Any, depth: int = 3) -> list[torch.nn.Module]:
    """Every ``nn.Module`` (with its submodules) reachable from ``objects`` (see the module docstring)."""
    found: dict[int, torch.nn.Module] = {}
    seen: set[int] = set()
    frontier = list(objects)
    for _ in range(depth + 1):
        following = []
        for obj in frontier:
            if id(obj) in seen or obj is None or isinstance(obj, str | bytes | int | float | torch.Tensor):
                continue
            seen.add(id(obj))
            if isinstance(obj, torch.nn.Module):
                for module in obj.modules():
                    found.setdefault(id(module), module)
            elif isinstance(obj, list | tuple | set | frozenset):
                following += list(obj)
            elif isinstance(obj, dict):
                following += list(obj.values())
            else:
                following += _referenced(obj)
        frontier = following
    return list(found.values())


def _tensor_values(tensors: Iterator[Any]) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    out = []
    seen: set[int] = set()
    for t in tensors:
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            out.append((t, t.detach().clone(), t.requires_grad))
    return out


def _restore_values(values: list[tuple[torch.Tensor, torch.Tensor, bool]]) -> None:
    with torch.no_grad():
        for tensor, saved, requires_grad in values:
            if tensor.shape != saved.shape or tensor.dtype != saved.dtype:
                tensor.data = saved
            elif not torch.equal(tensor.detach(), saved):
                tensor.detach().copy_(saved)
            if tensor.is_leaf and tensor.requires_grad != requires_grad:
                tensor.requires_grad_(requires_grad)


class _StoreState:
    def __init__(self) -> None:
        store = pyro.get_param_store()
        self.dicts: list[tuple[dict[Any, Any], dict[Any, Any]]] = [
            (d, dict(d)) for d in (store._params, store._param_to_name, store._constraints)]
        self.values = _tensor_values(iter(store._params.values()))

    def restore(self) -> None:
        for d, contents in self.dicts:
            d.clear()
            d.update(contents)
        _restore_values(self.values)


def _random_states() -> Callable[[], None]:
    torch_state, py_state, np_state = torch.get_rng_state(), random.getstate(), np.random.get_state()

    def restore() -> None:
        torch.set_rng_state(torch_state)
        random.setstate(py_state)
        np.random.set_state(np_state)

    return restore


@contextlib.contextmanager
def preserved(*objects: Any) -> Iterator[None]:
    """Restore, on exit (normal or not), the modules reachable from ``objects``, the param store and the
    global random states to what they were on entry; undo changes to any other module made inside."""
    modules = reachable_modules(*objects)
    states = [_ModuleState(m) for m in modules]
    values = _tensor_values(t for m in modules for t in [*vars(m).get("_parameters", {}).values(),
                                                          *vars(m).get("_buffers", {}).values()])
    store = _StoreState()
    restore_random = _random_states()
    try:
        with module_changes_undone():
            yield
    finally:
        for state in states:
            state.restore()
        _restore_values(values)
        store.restore()
        restore_random()
