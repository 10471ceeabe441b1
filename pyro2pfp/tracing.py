"""Stage 1: trace a Pyro model into a ``torch.export`` program over a deterministic copy.

Outside a model run, a ``PyroSample`` attribute returns a fresh prior sample on every access, so
the model itself cannot be traced.  Instead we build a *deterministic copy*:

* every ``PyroModule`` in the copy gets plain ``nn.Module`` attribute semantics back;
* every ``PyroSample`` attribute becomes an ``nn.Parameter`` holding the posterior mean, and every
  ``PyroParam`` an ``nn.Parameter`` holding its current (constrained) value from the param store;
* the copy is exported with ``torch.export.export(strict=False)`` and a dynamic batch dimension,
  under a messenger that turns the remaining sample statements (the likelihood) into no-ops.

The parameters of the exported program are named like the Pyro sample sites, so the posterior of
each one is looked up by the site the parameter came from (recorded while building the copy).
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyro
import torch
from pyro.nn import PyroModule
from pyro.nn.module import _make_name
from pyro.poutine.messenger import Messenger
from pyro.poutine.subsample_messenger import _Subsample

from .errors import InputShapeError, PosteriorError, TracingError
from .graph import GaussianParam
from .posterior import read_posterior

_WRAPPER_PREFIX = "model."


@dataclass
class TracedModel:
    """Output of the tracing stage: the exported program and the Gaussian of every parameter.

    ``params`` is keyed by the parameter's path in the model (``fc1.weight``), float64 arrays.
    """

    program: torch.export.ExportedProgram
    params: dict[str, GaussianParam]
    input_shape: tuple[int, ...]
    model_name: str = ""


class _LikelihoodAsNoOp(Messenger):
    """Makes every non-plate ``pyro.sample`` a no-op returning its observed value (or a placeholder)."""

    def _pyro_sample(self, msg: dict) -> None:
        if isinstance(msg["fn"], _Subsample):  # plates must keep working
            return
        if msg["value"] is None:
            msg["value"] = torch.zeros(())
        msg["done"] = True
        msg["stop"] = True


def _module_call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    # Looked up at call time: torch.export patches nn.Module.__call__ to record module paths.
    return torch.nn.Module.__call__(self, *args, **kwargs)


@functools.cache
def _plain_module_class(cls: type) -> type:
    """A subclass of ``cls`` whose attribute access and call are plain ``nn.Module`` ones."""
    namespace = {
        "__getattr__": torch.nn.Module.__getattr__,
        "__setattr__": torch.nn.Module.__setattr__,
        "__delattr__": torch.nn.Module.__delattr__,
        "__call__": _module_call,
        "__module__": cls.__module__,
    }
    return type(f"Deterministic{cls.__name__}", (cls,), namespace)


def _site_name(module: PyroModule, attr: str) -> str:
    # PyroModule._pyro_get_fullname asserts that the model has run once; the name itself is known.
    return _make_name(module.__dict__["_pyro_name"], attr)


def sample_sites(model: torch.nn.Module) -> dict[str, str]:
    """``{parameter path: sample site name}`` for every ``PyroSample`` attribute of the model."""
    sites = {}
    for path, module in model.named_modules():
        if isinstance(module, PyroModule):
            for attr in module._pyro_samples:
                sites[f"{path}.{attr}" if path else attr] = _site_name(module, attr)
    return sites


def _prior_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """``{parameter path: shape}`` of every ``PyroSample`` whose prior is a distribution object."""
    shapes = {}
    for path, module in model.named_modules():
        if isinstance(module, PyroModule):
            for attr, sample in module._pyro_samples.items():
                prior = getattr(sample, "prior", sample)
                if isinstance(prior, torch.distributions.Distribution):
                    shapes[f"{path}.{attr}" if path else attr] = tuple(prior.shape())
    return shapes


def _pyro_param_value(module: PyroModule, attr: str) -> torch.Tensor:
    store = pyro.get_param_store()
    fullname = _site_name(module, attr)
    if fullname in store:
        return store[fullname].detach()
    return getattr(module, attr).detach()


def _deterministic_copy(model: torch.nn.Module, means: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Copy of ``model`` with every sample site replaced by an ``nn.Parameter`` (its mean)."""
    det = copy.deepcopy(model)
    originals = dict(model.named_modules())
    for path, module in det.named_modules():
        if not isinstance(module, PyroModule):
            continue
        original = originals[path]
        samples = list(module._pyro_samples)
        pyro_params = {attr: _pyro_param_value(original, attr) for attr in module._pyro_params}
        module.__class__ = _plain_module_class(type(module))
        for attr in samples:
            full = f"{path}.{attr}" if path else attr
            setattr(module, attr, torch.nn.Parameter(means[full].clone(), requires_grad=False))
        for attr, value in pyro_params.items():
            module._parameters.pop(attr + "_unconstrained", None)
            setattr(module, attr, torch.nn.Parameter(value.clone(), requires_grad=False))
        module.__dict__["_pyro_samples"] = {}
        module.__dict__["_pyro_params"] = {}
    return det.eval()


class _Wrapper(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> Any:
        with _LikelihoodAsNoOp():
            return self.model(x)


def _example_input(input_shape: tuple[int, ...], batch: int = 2) -> torch.Tensor:
    return torch.zeros((batch, *input_shape), dtype=torch.float32)


def infer_input_shape(model: torch.nn.Module) -> tuple[int, ...]:
    """The input shape fixed by the model's first layer, if that is a Linear layer."""
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            return (int(module.in_features),)
        if isinstance(module, torch.nn.modules.conv._ConvNd):
            kind = next(c.__name__ for c in type(module).__mro__ if c.__module__.startswith("torch.nn"))
            raise InputShapeError(
                f"the first layer '{path}' is a convolution ({kind}); its input size is not fixed "
                "by its weights. Pass input_shape=(channels, height, width) to convert()."
            )
    raise InputShapeError(
        "cannot infer the input shape from the model (no Linear first layer found). "
        "Pass input_shape=(...) without the batch dimension to convert()."
    )


def trace_model(model: Any, guide: Any, input_shape: tuple[int, ...] | None, *,
                check_posterior: bool = True) -> TracedModel:
    """Trace ``model`` with the posterior of ``guide`` (as the param store holds it now) into a
    :class:`TracedModel`; ``check_posterior``: see :func:`pyro2pfp.posterior.read_posterior`."""
    if not isinstance(model, torch.nn.Module):
        raise TracingError(
            f"convert() needs the model as a torch.nn.Module (e.g. a PyroModule), got "
            f"{type(model).__name__}. Write the BNN as a PyroModule with PyroSample weights."
        )
    if input_shape is None:
        input_shape = infer_input_shape(model)
    input_shape = tuple(int(d) for d in input_shape)
    if not input_shape or any(d <= 0 for d in input_shape):
        raise InputShapeError(f"input_shape must be positive sizes without the batch, got {input_shape}")
    example = _example_input(input_shape)

    sites = sample_sites(model)
    prior_shapes = _prior_shapes(model)
    posterior = read_posterior(model, guide, sites.values(), (example,), check=check_posterior)
    means, params = {}, {}
    for path, site in sites.items():
        if site not in posterior:
            raise PosteriorError(
                f"sample site '{site}' of the model (parameter {path}) has no posterior in the "
                f"guide {type(guide).__name__}."
            )
        loc, var = posterior[site]
        expected = prior_shapes.get(path)
        if expected is not None and tuple(loc.shape) != expected:
            raise PosteriorError(f"site '{site}': the guide's posterior has shape {tuple(loc.shape)} but the "
                                 f"model's prior (parameter {path}) has shape {expected}")
        means[path] = torch.as_tensor(loc, dtype=torch.float32)
        params[path] = GaussianParam(loc, var, site=site)

    det = _deterministic_copy(model, means)

    batch = torch.export.Dim("batch", min=1, max=2**20)
    try:
        with pyro.validation_enabled(False), torch.no_grad():
            program = torch.export.export(
                _Wrapper(det), (example,), dynamic_shapes={"x": {0: batch}}, strict=False
            )
    except Exception as exc:
        raise TracingError(
            f"torch.export could not trace the model for input shape (batch, {', '.join(map(str, input_shape))}): "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}. "
            "Check input_shape and that forward() works on a batch of that shape."
        ) from exc

    for name, value in program.named_parameters():
        path = name.removeprefix(_WRAPPER_PREFIX)
        if path not in params:
            arr = value.detach().to(torch.float64).numpy().copy()
            params[path] = GaussianParam(arr, np.zeros_like(arr))
    for name, value in program.named_buffers():
        path = name.removeprefix(_WRAPPER_PREFIX)
        arr = value.detach().to(torch.float64).numpy().copy()
        params[path] = GaussianParam(arr, np.zeros_like(arr))
    return TracedModel(program=program, params=params, input_shape=input_shape,
                       model_name=type(model).__name__)
