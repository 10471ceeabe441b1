"""Models written with ``pyro.random_module`` (the older tutorials' style).

``pyro.random_module(name, net, priors)()`` deep-copies the ``nn.Module`` ``net`` and lifts each of its
parameters to a sample site named ``f"{name}$$${parameter}"`` (``module$$$fc1.weight``); the model
and the hand-written guide are functions.  To trace such a model, :func:`lifted_modules` runs it once
recording every ``random_module`` call, and :func:`replaced_random_modules` makes ``random_module``
return a deterministic copy of the net (its parameters: the posterior means) while the model is
exported, so the graph reads those parameters and each one maps back to its site.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterator
from typing import Any

import pyro
import pyro.primitives
import torch
from pyro import poutine

SEPARATOR = "$$$"  # pyro.params.param_store._MODULE_NAMESPACE_DIVIDER


@contextlib.contextmanager
def _patched(replacement: Any) -> Iterator[None]:
    originals = (pyro.random_module, pyro.primitives.random_module)
    pyro.random_module = pyro.primitives.random_module = replacement
    try:
        yield
    finally:
        pyro.random_module, pyro.primitives.random_module = originals


def lifted_modules(model: Any, run: Any) -> dict[str, torch.nn.Module]:
    """``{name: nn.Module}`` of every ``pyro.random_module(name, module, prior)`` call the model makes
    when ``run(model)`` runs it once (nothing is recorded in the param store)."""
    found: dict[str, torch.nn.Module] = {}

    def record(name: str, nn_module: torch.nn.Module, prior: Any, *args: Any, **kwargs: Any) -> Any:
        found[name] = nn_module
        return lambda: nn_module

    with _patched(record), poutine.block(), torch.no_grad():
        run(model)
    return found


def deterministic_copy(name: str, module: torch.nn.Module, means: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A copy of ``module`` whose parameter ``p`` holds ``means[f"{name}$$${p}"]`` where given."""
    det = copy.deepcopy(module).eval()
    for path, param in list(det.named_parameters()):
        owner_path, _, attr = path.rpartition(".")
        owner = det.get_submodule(owner_path) if owner_path else det
        value = means.get(f"{name}{SEPARATOR}{path}", param.detach())
        owner._parameters[attr] = torch.nn.Parameter(value.detach().clone().to(param.dtype), requires_grad=False)
    return det


@contextlib.contextmanager
def replaced_random_modules(replacements: dict[str, torch.nn.Module]) -> Iterator[None]:
    """While active, ``pyro.random_module(name, …)()`` returns ``replacements[name]``."""

    def replace(name: str, nn_module: torch.nn.Module, prior: Any, *args: Any, **kwargs: Any) -> Any:
        return lambda: replacements[name]

    with _patched(replace):
        yield



def lifted_submodule(model: torch.nn.Module, sites: list[str]) -> tuple[str, str, set[str]] | None:
    """``(random_module name, path of the submodule, the lifted parameters' paths in it)`` when the guide's
    latent ``sites`` all lift parameters of one submodule of ``model`` (the model itself: path ``""``) under
    one name, as ``pyro.random_module(name, submodule, …)`` names them (``module$$$fc1.weight``); else None."""
    if not sites or not all(SEPARATOR in site for site in sites):
        return None
    names = {site.split(SEPARATOR)[0] for site in sites}
    if len(names) != 1:
        return None
    lifted = {site.split(SEPARATOR, 1)[1] for site in sites}
    for path, sub in model.named_modules():
        if lifted <= {p for p, _ in sub.named_parameters()}:
            return names.pop(), path, lifted
    return None


def lifting_model(name: str, model: torch.nn.Module, path: str, lifted_paths: set[str]) -> Any:
    """A model function that runs ``model`` with its submodule at ``path`` lifted by
    ``pyro.random_module(name, submodule, priors)``, with priors for the parameters ``lifted_paths`` (the
    others stay parameters, read from the param store): what a guide written for a random_module model
    samples, when the user passes the network (or the module holding it) to ``convert``.  Further arguments
    (the labels) are passed on where ``forward`` takes them; the priors are never sampled (the posterior is
    read from the guide)."""
    net = model.get_submodule(path) if path else model
    owner_path, _, attr = path.rpartition(".")
    owner = model.get_submodule(owner_path) if owner_path else model
    takes = _positional_count(model)

    def lifting(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        priors = {p: pyro.distributions.Normal(torch.zeros_like(v), 1.0).to_event(v.dim())
                  for p, v in net.named_parameters() if p in lifted_paths}
        lifted = pyro.random_module(name, net, priors)()
        if not path:
            return lifted(x)
        original = owner._modules[attr]
        owner._modules[attr] = lifted
        try:
            return model(x, *args[:max(takes - 1, 0)])
        finally:
            owner._modules[attr] = original

    lifting.__name__ = lifting.__qualname__ = type(model).__name__
    return lifting


def _positional_count(model: torch.nn.Module) -> int:
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return 1
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return 1 << 10
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)
