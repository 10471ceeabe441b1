"""Load what training left behind: the builder function that makes the model and guide, and the Pyro
param store, read safely (``torch.load(weights_only=True)``: tensors and constraints, no pickled code).

>>> from pyro2pfp.frontend.loading import build_model_and_guide, load_param_store
>>> model, guide = build_model_and_guide("builder.py:build")
>>> load_param_store("params.pt")          # into pyro.get_param_store()
>>> net = pyro2pfp.convert(model, guide, input_shape=(1, 28, 28))

This is what the ``pyro2pfp`` command line uses; every failure is a :class:`~pyro2pfp.errors.LoadError`
naming the file and what to do.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect as pyinspect
import os
import pickle
import sys
from pathlib import Path
from typing import Any

from ..errors import LoadError

__all__ = ["DEFAULT_FUNCTION", "build_model_and_guide", "load_builder", "load_param_store"]

DEFAULT_FUNCTION = "build"
"""The builder function looked up when a spec names only the file (``builder.py``)."""


def _split_spec(spec: str) -> tuple[str, str | None]:
    if ":" in spec:
        where, _, func = spec.rpartition(":")
        if where and func and os.sep not in func and "." not in func:
            return where, func
    return spec, None


def load_builder(spec: str) -> Any:
    """The builder function named by ``FILE.py[:FUNCTION]`` or ``MODULE:FUNCTION`` (``FUNCTION`` defaults
    to :data:`DEFAULT_FUNCTION`); a file is imported with its directory on ``sys.path``."""
    where, func = _split_spec(spec)
    name = func or DEFAULT_FUNCTION
    if where.endswith(".py") or os.sep in where or os.path.exists(where):
        path = Path(where)
        if not path.is_file():
            raise LoadError(f"builder file '{where}' not found (expected FILE.py:FUNCTION, e.g. builder.py:build)")
        mod_name = f"_pyro2pfp_builder_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        if module_spec is None or module_spec.loader is None:
            raise LoadError(f"builder file '{where}' cannot be imported as Python")
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, str(path.resolve().parent))  # let the builder import its neighbours
        try:
            sys.modules[mod_name] = module
            module_spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(mod_name, None)
            raise LoadError(f"running builder file '{where}' failed: {type(exc).__name__}: {exc}") from exc
        finally:
            sys.path.remove(str(path.resolve().parent))
    else:
        if func is None:
            raise LoadError(f"'{spec}': give the builder as FILE.py:FUNCTION or MODULE:FUNCTION")
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise LoadError(f"cannot import module '{where}' for the builder '{spec}': {exc}") from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        functions = sorted(n for n, obj in vars(module).items()
                           if pyinspect.isfunction(obj) and obj.__module__ == module.__name__
                           and not n.startswith("_"))
        hint = f"; functions defined there: {', '.join(functions)}" if functions else ""
        raise LoadError(f"'{where}' has no function '{name}'{hint}. Name it as {where}:FUNCTION.")
    return fn


def build_model_and_guide(spec: str) -> tuple[Any, Any]:
    """Call the builder named by ``spec`` (:func:`load_builder`) without arguments: ``(model, guide)``."""
    fn = load_builder(spec)
    try:
        result = fn()
    except Exception as exc:
        raise LoadError(f"the builder {spec} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise LoadError(f"the builder {spec} must return (model, guide), got {type(result).__name__}"
                       + (f" of length {len(result)}" if isinstance(result, (tuple, list)) else ""))
    return result[0], result[1]


def _constraint_classes() -> list[type]:
    """Every Constraint class of torch and Pyro: the only non-tensor objects a param store holds."""
    import pyro.distributions.constraints as pyro_constraints
    import torch.distributions.constraints as torch_constraints

    classes = set()
    for module in (torch_constraints, pyro_constraints):
        for obj in vars(module).values():
            if pyinspect.isclass(obj) and issubclass(obj, torch_constraints.Constraint):
                classes.add(obj)
    return sorted(classes, key=lambda c: (c.__module__, c.__name__))


def load_param_store(path: str) -> set[str]:
    """Load ``pyro.get_param_store().save(path)`` output into Pyro's param store
    (``pyro.get_param_store()``) with ``torch.load(weights_only=True)``.

    Only tensors and Pyro/torch constraint objects are accepted (no arbitrary pickled code).
    Returns the names of the loaded parameters.
    """
    import pyro
    import torch

    if not os.path.isfile(path):
        raise LoadError(f"parameter file '{path}' not found (save it after training with "
                       "pyro.get_param_store().save(path))")
    try:
        with torch.serialization.safe_globals(list[Any](_constraint_classes())):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        boilerplate = ("Weights only load failed", "Check the documentation", "Please file an issue")
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        detail = " ".join(line.replace("WeightsUnpickler error:", "").strip() for line in lines
                          if not line.startswith(boilerplate)).strip() or "unreadable"
        if "global" in detail.lower():
            raise LoadError(f"'{path}' holds objects other than tensors and Pyro constraints, so it is not "
                           f"loaded (torch.load with weights_only=True: {detail})") from None
        raise LoadError(f"'{path}' is not a file written by pyro.get_param_store().save() "
                       f"(torch.load with weights_only=True: {detail})") from None
    except Exception as exc:
        raise LoadError(f"'{path}' is not a file written by pyro.get_param_store().save(): "
                       f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    if not isinstance(state, dict) or set(state) != {"params", "constraints"}:
        keys = sorted(state)[:5] if isinstance(state, dict) else type(state).__name__
        raise LoadError(f"'{path}' is not a Pyro param store (expected what pyro.get_param_store().save() "
                       f"writes: a dict with 'params' and 'constraints'; got {keys})")
    bad = [k for k, v in state["params"].items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise LoadError(f"'{path}': parameters {bad[:3]} are not tensors")
    pyro.get_param_store().set_state(state)  # type: ignore[arg-type]  # checked above: params and constraints
    return set(state["params"])
