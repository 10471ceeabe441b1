"""Checks that the traced network is the user's model with the param store's values.

The tracer computes with copies of the user's modules (:mod:`pyro2pfp.frontend.tracing`); a copy holding other
values than the param store (a module object that is stale in a fresh process, a lifted net read from
the wrong place) converts and predicts without complaint -- a silent wrong answer.  Two checks, both in
the tracing stage:

* :func:`check_store_values`: every parameter of the traced network that the param store holds
  (:func:`store_names` says which: ``pyro.module`` / ``random_module`` registrations, a ``PyroModule``'s
  own parameters and ``PyroParam`` s) has exactly the store's values.  Costs one comparison per parameter.
* :func:`check_against_model`: at the posterior means and on two inputs, the traced network's output
  equals what the user's own model computes (the model run eagerly with its latent sites at the means, the
  likelihood inert, its modules in eval mode and holding the store's values): one model run and one run of
  the traced program.  It covers what the first check cannot name (constants of a model function,
  anything the tracer might compute otherwise).

A failure raises :class:`~pyro2pfp.errors.FidelityError`: it is a bug of the tracer, or a model whose
output depends on something besides its parameters, sample sites and input.
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np
import pyro
import torch
from pyro import poutine
from pyro.nn import PyroModule

from ..errors import FidelityError, TracingError
from .model_output import LikelihoodSites, network_output
from .posterior import ModelArgs, call_failure, call_with_model_args
from .posterior.registrations import Registration
from .posterior.store import full_name
from .preserve import module_changes_undone, reachable_modules

# Output agreement of the traced program and the eager model in float32: relative to the outputs' scale.
_RTOL = 1e-3


def store_names(model: Any, registrations: list[Registration], lifted: dict[str, torch.nn.Module],
                paths: list[str]) -> dict[str, Registration]:
    """``{path of a traced parameter: its registration}`` for the traced network's parameters ``paths``
    (``fc1.weight`` of the deterministic copy of ``model``, ``lifted.m<i>.fc1.weight`` of the ``i``-th
    ``random_module`` net in ``lifted``) that the param store holds."""
    by_owner = {(id(r.module), r.attr): r for r in registrations}
    store = pyro.get_param_store()
    nets = list(lifted.values())
    out: dict[str, Registration] = {}
    for path in paths:
        if path.startswith("functional."):
            continue
        root: Any = model
        rest = path
        if path.startswith("lifted.m"):
            index, _, rest = path.removeprefix("lifted.m").partition(".")
            root = nets[int(index)]
        if not isinstance(root, torch.nn.Module):
            continue
        owner_path, _, attr = rest.rpartition(".")
        try:
            owner = root.get_submodule(owner_path) if owner_path else root
        except AttributeError:
            continue
        reg = by_owner.get((id(owner), attr))
        if reg is None and isinstance(owner, PyroModule) and owner.__dict__.get("_pyro_name") is not None:
            name = full_name(owner, attr)
            if attr in owner._pyro_params or name in store and owner._parameters.get(attr) is not None:
                reg = Registration(name, owner, attr)  # a PyroParam or a PyroModule's own parameter
        if reg is not None and reg.name in store:
            out[path] = reg
    return out


def check_store_values(values: dict[str, np.ndarray], names: dict[str, Registration]) -> None:
    """Raise :class:`FidelityError` unless every traced parameter ``values[path]`` (float64) that the param
    store holds (``names``) equals the store's tensor."""
    store = pyro.get_param_store()
    for path, reg in names.items():
        stored = store[reg.name].detach().to(torch.float64).cpu().numpy()
        value = values.get(path)
        if value is None:
            continue
        if value.shape != stored.shape or not np.array_equal(value, stored):
            diff = float(np.max(np.abs(value - stored))) if value.shape == stored.shape else float("nan")
            shown = re.sub(r"^lifted\.m\d+\.", "", path)  # a random_module net's copy: the net's own path
            raise FidelityError(
                f"the traced network's parameter {shown} differs from the param store's '{reg.name}' "
                f"(max |difference| {diff:.3g}): the network would compute with other weights than the trained "
                "model. This is a bug in pyro2pfp's reading of the parameters; please report it with the model's "
                "code.")


def check_against_model(program: torch.export.ExportedProgram, model: Any, args: ModelArgs,
                        inputs: tuple[torch.Tensor, tuple], latent: dict[str, torch.Tensor], model_name: str) -> None:
    """Raise :class:`FidelityError` unless the traced ``program`` (run at ``inputs``; its sample-site
    parameters hold the posterior means) computes the output of ``model`` run eagerly with the model
    arguments ``args`` of the same inputs and its latent sites at those means (``latent``: ``{site: mean}``)."""
    with torch.no_grad(), poutine.block(), pyro.validation_enabled(False), module_changes_undone():
        for module in reachable_modules(model):
            module.eval()  # as the network is traced; undone on leaving the block
        run = LikelihoodSites(lambda msg: latent.get(msg["name"]))
        try:
            with run:
                expected = network_output(call_with_model_args(model, args), run)
        except Exception as exc:  # the model's own error
            raise TracingError(f"running the model {model_name!r} at the posterior means failed: "
                               f"{call_failure(model, args, exc)}") from exc
        x, batched = inputs
        got = program.module()(*((x, batched) if batched else (x,)))
    if isinstance(got, tuple | list):
        got = got[0]
    if not isinstance(expected, torch.Tensor) or not isinstance(got, torch.Tensor) or expected.shape != got.shape:
        return  # not one tensor: the output checks name that
    a, b = expected.detach().double(), got.detach().double()
    scale = float(torch.max(torch.abs(a)).item() + torch.max(torch.abs(b)).item())
    diff = float(torch.max(torch.abs(a - b)).item()) if a.numel() else 0.0
    if not np.isfinite(diff) or diff > _RTOL * scale + 1e-6:
        raise FidelityError(
            f"the traced network does not compute what the model {model_name!r} computes: at the posterior means "
            f"and on two inputs, their outputs differ by up to {diff:.3g} (outputs of size up to {scale / 2:.3g}). "
            "The model was run with the param store's values, as the network was traced. Either the model's "
            "output depends on something besides its parameters, sample sites and input (a global, a random "
            "number drawn in forward()), or this is a bug in pyro2pfp: please report it with the model's code.")
