"""Bring a model's and a guide's parameters in line with Pyro's param store before reading them.

The param store is the source of truth of a trained Pyro model: ``pyro.get_param_store().save(path)``
writes it, ``.load(path)`` / ``.set_state(state)`` restore it, ``store[name] = value`` edits it.
A ``PyroModule``'s parameters are only a cache of it (``pyro/nn/module.py``,
``PyroModule.__getattr__``):

* a ``PyroParam`` attribute (an autoguide's ``locs``/``scales``/``scale``) re-reads the store when it
  is accessed *while the module's Pyro context is active* (while the module runs); read outside one,
  ``guide._get_loc_and_scale(site)`` returns whatever tensor the module held before the store changed,
  e.g. the initial values of a guide built in a fresh process before ``load``;
* a plain ``nn.Parameter`` of a ``PyroModule`` (``AutoDiagonalNormal.loc``, untouched
  ``PyroModule[nn.Linear]`` weights) only *registers* itself with ``pyro.param(name, value)``: the module
  keeps its own tensor even while it runs, so after ``load`` it stays stale for good (Pyro's own
  ``Predictive`` then samples from it);
* a plain ``nn.Module`` child of a ``PyroModule`` is registered with ``pyro.module(name, child)``,
  which by default does not take the store's values either.

:func:`sync_with_param_store` uses Pyro's own mechanisms to make every such parameter *the* store's
tensor: the PyroParam access inside the module's context (Pyro's store → module update),
``pyro.module(..., update_module_params=True)`` for plain children, and the same object replacement
for plain parameters.  With ``pyro.settings.set(module_local_params=True)`` modules keep their
parameters locally (the global store is not used) and nothing is synchronised.

:func:`setup_guide_prototype` builds the parameters of an autoguide that has never run (a guide built
in a fresh process, then ``load``) so that they exist and can take the store's values.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pyro
import torch
from pyro import poutine
from pyro.infer import autoguide
from pyro.infer.autoguide.initialization import InitMessenger
from pyro.nn import PyroModule
from pyro.nn.module import _is_module_local_param_enabled, _make_name

from ...errors import PosteriorError
from .readers import call_failure, call_with_model_args


def module_local_params() -> bool:
    """True under ``pyro.settings.set(module_local_params=True)`` (modules own their parameters)."""
    return bool(_is_module_local_param_enabled())


def full_name(module: PyroModule, attr: str) -> str:
    return _make_name(module.__dict__["_pyro_name"], attr)


def named_pyro_modules(module: torch.nn.Module) -> list[PyroModule]:
    """The PyroModules under ``module`` (itself included) whose parameters have param-store names
    (a sub-PyroModule gets its name when it is attached to a named parent)."""
    return [m for m in module.modules()
            if isinstance(m, PyroModule) and (m is module or m.__dict__.get("_pyro_name"))]


def _pyro_children(module: torch.nn.Module) -> Iterator[tuple[PyroModule, str, torch.nn.Module]]:
    """``(pyro_parent, attr, child)`` for every direct child of every PyroModule under ``module``."""
    for parent in module.modules():
        if isinstance(parent, PyroModule):
            for attr, child in parent._modules.items():
                if child is not None:
                    yield parent, attr, child


def _check_shape(name: str, stored: torch.Tensor, current: torch.Tensor, owner: str) -> None:
    if tuple(stored.shape) != tuple(current.shape):
        raise PosteriorError(
            f"the param store holds '{name}' with shape {tuple(stored.shape)}, but {owner}'s parameter has "
            f"shape {tuple(current.shape)}: was the store saved from a model/guide of other sizes?")


def _take_plain_parameter(module: PyroModule, attr: str, owner: str) -> None:
    """Make the plain ``nn.Parameter`` ``module.attr`` the param store's tensor of the same name."""
    store = pyro.get_param_store()
    name = full_name(module, attr)
    if name not in store:
        return
    stored = store._params[name]
    current = module._parameters[attr]
    if stored is current or current is None:
        return
    _check_shape(name, stored, current, owner)
    if not isinstance(stored, torch.nn.Parameter):  # as PyroModule.__getattr__ does for PyroParams
        stored = torch.nn.Parameter(stored.detach().clone(), requires_grad=current.requires_grad)
        store._params[name] = stored
        store._param_to_name[stored] = name
    module._parameters[attr] = stored


def sync_with_param_store(module: Any, owner: str = "the module") -> None:
    """Make every parameter of ``module`` (a model or guide) the param store's tensor of its name.

    No-op for anything that is not a ``PyroModule`` (hand-written guides call ``pyro.param`` and read
    the store whenever they run) and under ``module_local_params``.  Raises :class:`PosteriorError`
    when the store holds a parameter of the module's name with another shape.
    """
    if not isinstance(module, PyroModule) or module_local_params():
        return
    pyro_modules = named_pyro_modules(module)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(poutine.block())
        for context in {id(m._pyro_context): m._pyro_context for m in pyro_modules}.values():
            stack.enter_context(context)  # an active context: PyroParam access syncs with the store
        for sub in pyro_modules:
            store = pyro.get_param_store()
            for attr in list(sub._pyro_params):
                name = full_name(sub, attr)
                current = sub._parameters.get(attr + "_unconstrained")
                if name in store and current is not None:
                    _check_shape(name, store._params[name], current, owner)
                getattr(sub, attr)  # Pyro's own update: PyroModule <- ParamStore
            for attr, param in list(sub._parameters.items()):
                if param is not None and not attr.endswith("_unconstrained"):
                    _take_plain_parameter(sub, attr, owner)
        for parent, attr, child in _pyro_children(module):
            if not isinstance(child, PyroModule) and any(True for _ in child.parameters()):
                pyro.module(full_name(parent, attr), child, update_module_params=True)


def _guides(guide: Any) -> list[autoguide.AutoGuide]:
    return [m for m in guide.modules() if isinstance(m, autoguide.AutoGuide)] if isinstance(
        guide, torch.nn.Module) else []


def _guide_parameter_names(guide: Any) -> set[str]:
    """Param-store names of the parameters a PyroModule guide owns (known only after it has run)."""
    names: set[str] = set()
    for sub in named_pyro_modules(guide):
        names.update(full_name(sub, attr) for attr in sub._pyro_params)
        names.update(full_name(sub, attr) for attr, p in sub._parameters.items()
                     if p is not None and not attr.endswith("_unconstrained"))
    return names


def _hide_likelihood(weight_sites: set[str], batch: int) -> Callable[[Any], bool]:
    """Hide the sample sites that are neither weights nor anything an autoguide can represent
    without the data: sites inside a plate over the example batch (the likelihood) and discrete ones."""

    def hide(msg: Any) -> bool:
        if msg.get("type") != "sample" or msg["name"] in weight_sites:
            return False
        in_data_plate = any(frame.size == batch for frame in msg.get("cond_indep_stack", ()))
        discrete = bool(getattr(msg["fn"], "has_enumerate_support", False))
        return in_data_plate or discrete

    return hide


def _split_init(model: Any) -> tuple[Any, Any]:
    """``(InitMessenger, inner model)`` of a model an autoguide wrapped with ``InitMessenger(init)(model)``
    (``Messenger.__call__`` returns a partial of ``(messenger, fn)``), else ``(None, model)``."""
    args: tuple[Any, ...] = tuple(getattr(model, "args", ()))
    if len(args) == 2 and isinstance(args[0], InitMessenger) and callable(args[1]):
        return args[0], args[1]
    return None, model


def setup_guide_prototype(model: Any, guide: Any, example_args: tuple, weight_sites: set[str]) -> None:
    """Build the parameters of autoguides that have never run, then take them from the param store.

    An autoguide learns its latent sites by running the model once; with no observations the
    likelihood would become a latent site (``obs`` without ``y``), so it is hidden (see
    :func:`_hide_likelihood`).  Raises :class:`PosteriorError` if the store holds none or only some of
    the parameters the guide needs (it was never trained, or the store belongs to another model).
    """
    if isinstance(guide, autoguide.AutoDelta):
        return  # rejected by the reader with its own message
    fresh = [g for g in _guides(guide) if g.prototype_trace is None]
    if not fresh:
        return
    if module_local_params():
        raise PosteriorError(
            f"the {type(guide).__name__} guide has never been run, and with module_local_params=True its "
            "parameters live in the guide itself, not in the param store. Run the guide once and load "
            "its state_dict, or train it, before converting.")
    store = pyro.get_param_store()
    before = set(store.keys())
    batch = int(example_args[0].shape[0]) if example_args and hasattr(example_args[0], "shape") else -1
    hide = _hide_likelihood(weight_sites, batch)
    originals = [(g, g._model) for g in fresh if getattr(g, "_model", None) is not None]
    try:
        for g, original in originals:
            init, inner = _split_init(original[0])
            # The block must sit inside the autoguide's InitMessenger(init_loc_fn), or the init
            # strategy meets the (discrete, unobserved) likelihood site first and fails.
            blocked = poutine.block(inner, hide_fn=hide)
            g._model = (init(blocked) if init is not None else blocked,)
        with torch.no_grad(), poutine.block(), pyro.validation_enabled(False):  # scales of 0 are valid
            call_with_model_args(guide, example_args)
    except PosteriorError:
        raise
    except Exception as exc:
        raise PosteriorError(
            f"the {type(guide).__name__} guide has never been run; running it once (so that it takes its "
            f"trained parameters from the param store) failed: {call_failure(guide, example_args, exc)}") from exc
    finally:
        for g, original in originals:
            g._model = original
    created = sorted(_guide_parameter_names(guide) - before)
    if created:
        have = sorted(before)
        what = ("the param store is empty: load the trained parameters first "
                "(pyro.get_param_store().load(path)), or train the guide" if not have else
                f"the param store holds {have[:4]}{' …' if len(have) > 4 else ''}: was it saved from the "
                "same model and guide (same classes, same sizes)?")
        for name in created:  # leave the store as it was: these are initial values, not a posterior
            del store[name]
        raise PosteriorError(
            f"the {type(guide).__name__} guide has never been run and the param store has no values for the guide's "
            f"parameters {created[:4]}{' …' if len(created) > 4 else ''}; {what}")
    sync_with_param_store(guide, f"the {type(guide).__name__} guide")
