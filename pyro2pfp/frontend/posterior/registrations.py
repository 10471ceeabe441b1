"""The param store holds every parameter of a trained Pyro model, the deterministic ones too.

Pyro code registers a module's deterministic parameters in the param store in several ways, each under
its own name:

* ``pyro.module(name, net)`` (in the model, the guide or both): ``f"{name}$$${path}"``
  (``net$$$fc1.weight``);
* ``pyro.random_module(name, net, priors)``: the parameters without a prior stay parameters, also
  ``f"{name}$$${path}"`` (``module$$$fc1.weight``), read back into the lifted copy of ``net``;
* a plain ``nn.Parameter`` or ``nn.Module`` child of a ``PyroModule``: the module's full Pyro name.

Training updates the store's tensors.  The user's module objects hold the same tensors in the training
process, but not in a fresh one: after ``pyro.get_param_store().load(path)`` a rebuilt ``net`` holds its
initial values, and Pyro itself only copies the store's into it where the code asks for it
(``random_module``'s lifted copy, ``pyro.module(..., update_module_params=True)``, a ``PyroModule`` run).
So the store, not the module object, is the source of truth for every parameter it holds.

:func:`registered_parameters` finds, by running the model (with a guide sample replayed, the likelihood
inert) and the guide once under ``poutine.trace``, every ``param`` site whose initial tensor is a
parameter of one of the user's modules -- the module and attribute the store entry belongs to -- plus
the parameters of every ``pyro.random_module`` net that are not lifted.  :func:`take_store_values` makes
each such module attribute the store's tensor (as ``update_module_params=True`` does), so that whatever
runs the module next -- the tracer, a deterministic copy, the fidelity check's sampler -- computes with
the store's values; ``convert`` restores the objects afterwards (:mod:`pyro2pfp.frontend.preserve`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pyro
import torch
from pyro import poutine

from ...errors import PosteriorError
from ..model_output import LikelihoodSites
from .readers import call_with_model_args

SEPARATOR = "$$$"  # pyro.params.param_store._MODULE_NAMESPACE_DIVIDER


@dataclass
class Registration:
    """One parameter of a user's module that the param store holds under ``name``."""

    name: str
    module: torch.nn.Module
    attr: str
    stale: bool = False  # the module held other values than the store when it was found

    @property
    def tensor(self) -> torch.Tensor:
        return self.module._parameters[self.attr]  # type: ignore[return-value]


def _owners(modules: Iterable[torch.nn.Module]) -> dict[int, tuple[torch.nn.Module, str]]:
    """``{id(parameter): (module, attribute)}`` over the direct parameters of ``modules``."""
    owners: dict[int, tuple[torch.nn.Module, str]] = {}
    for module in modules:
        for attr, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), (module, attr))
    return owners


def _differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape != b.shape or not torch.equal(a.detach(), b.detach())


def param_sites(fn: Callable[..., Any], args: tuple, replay: Any = None) -> list[tuple[str, Any]]:
    """``[(store name, the tensor the caller passed)]`` of every ``pyro.param`` call of one run of ``fn``
    (with ``replay``: a guide trace whose sample sites the run takes; the other sample sites are inert)."""
    run = poutine.replay(fn, trace=replay) if replay is not None else fn
    with torch.no_grad(), poutine.block(), pyro.validation_enabled(False), LikelihoodSites():
        trace = poutine.trace(lambda: call_with_model_args(run, args)).get_trace()
    return [(str(site["name"]), site["args"][1] if len(site["args"]) > 1 else None)
            for site in trace.nodes.values() if site["type"] == "param"]


def module_tensors(modules: Iterable[torch.nn.Module]) -> dict[tuple[int, str], torch.Tensor]:
    """``{(id(module), attribute): parameter}`` of ``modules`` as they are now (before anything makes them the
    store's tensors): what :func:`registered_parameters` compares the store with to tell a stale module."""
    return {(id(m), attr): p for m in modules for attr, p in m._parameters.items() if p is not None}


def registered_parameters(model: Any, guide: Any, args: tuple, modules: Iterable[torch.nn.Module],
                          random_modules: dict[str, torch.nn.Module], lifted_sites: Iterable[str],
                          originals: dict[tuple[int, str], torch.Tensor] | None = None) -> list[Registration]:
    """The parameters of ``modules`` (the user's, reachable from the model and guide) that the param store
    holds, found by running the guide and the model once (module docstring), and the parameters of the
    ``pyro.random_module`` nets ``random_modules`` (``{name: net}``) that are not the ``lifted_sites``.
    ``originals``: the modules' tensors as the user left them (:func:`module_tensors`; default: as they are)."""
    store = pyro.get_param_store()
    modules = list(modules)
    owners = _owners(modules)
    originals = originals or {}
    found: dict[tuple[int, str], Registration] = {}

    def add(name: str, module: torch.nn.Module, attr: str) -> None:
        key = (id(module), attr)
        if name in store and key not in found:
            param = module._parameters[attr]
            assert param is not None
            if tuple(param.shape) != tuple(store[name].shape):
                raise PosteriorError(
                    f"the param store holds '{name}' with shape {tuple(store[name].shape)}, but the module "
                    f"{type(module).__name__}'s parameter {attr} it belongs to has shape {tuple(param.shape)}: was "
                    "the store saved from a model of other sizes?")
            original = originals.get(key, param)
            found[key] = Registration(name, module, attr, stale=original is not store[name]
                                      and _differs(original, store[name]))

    sites: list[tuple[str, Any]] = []
    try:
        with torch.no_grad(), poutine.block(), pyro.validation_enabled(False):
            guide_trace = poutine.trace(lambda: call_with_model_args(guide, args)).get_trace()
        sites += [(str(site["name"]), site["args"][1] if len(site["args"]) > 1 else None)
                  for site in guide_trace.nodes.values() if site["type"] == "param"]
        sites += param_sites(model, args, replay=guide_trace)
    except Exception:  # noqa: S110  the model or guide fails on these arguments: tracing it names why
        pass
    for name, tensor in sites:
        owner = owners.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
        if owner is not None:
            add(name, *owner)
    lifted = set(lifted_sites)
    for prefix, net in random_modules.items():
        for path, _ in net.named_parameters():
            name = f"{prefix}{SEPARATOR}{path}"
            if name not in lifted:
                owner_path, _, attr = path.rpartition(".")
                add(name, net.get_submodule(owner_path) if owner_path else net, attr)
    return list(found.values())


def take_store_values(registrations: Iterable[Registration]) -> None:
    """Make each registered module attribute the param store's tensor (what Pyro's
    ``pyro.module(name, net, update_module_params=True)`` does); the caller restores the modules."""
    store = pyro.get_param_store()
    for reg in registrations:
        parameters: dict[str, Any] = reg.module._parameters
        parameters[reg.attr] = store[reg.name]
