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
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyro
import torch
import torch.fx
from pyro.infer.autoguide import AutoGuide
from pyro.nn import PyroModule
from pyro.nn.module import _make_name

from ..errors import PosteriorError, TracingError, UnsupportedLayerError
from ..planning.graph import GaussianParam, GuideFactorInfo
from . import random_module, trace_forms
from .model_args import TracedArgs
from .model_checks import check_has_forward, checked_input_shape, first_linear, modules_of_function, warn_train_mode
from .model_output import LikelihoodSites, network_output
from .noise import HeteroscedasticNoise, NoiseModel, NoNoiseModel, find_noise, read_head, scale_depends_on_input
from .output_chain import check_output
from .param_expressions import input_dependent
from .posterior import (
    ModelArgs,
    SiteReading,
    call_failure,
    call_with_model_args,
    guide_factors,
    read_posterior,
    unwrap_independent,
)
from .posterior.readers import padded_parameters
from .posterior.registrations import Registration, module_tensors, registered_parameters, take_store_values
from .preserve import module_changes_undone, reachable_modules
from .program_checks import check_batch_independent, check_supported_ops
from .site_matching import check_all_matched, guide_name, require_weight_posterior
from .trace_passes import fold_identity_broadcasts, fold_output_broadcast, repair_users, used_parameters
from .tracing_guard import check_against_model, check_store_values, store_names

#: the prefix of the traced program's parameter names: the model is traced inside a wrapper module
#: whose attribute ``model`` it is (a site ``fc1.weight`` is the program's ``model.fc1.weight``)
WRAPPER_PREFIX = "model."


@dataclass
class TracedModel:
    """Output of the tracing stage: the exported program and the Gaussian of every parameter.

    ``params`` is keyed by the parameter's path in the model (``fc1.weight``), float64 arrays.
    """

    program: torch.export.ExportedProgram
    params: dict[str, GaussianParam]
    input_shape: tuple[int, ...]
    model_name: str = ""
    forward_name: str = ""  # how messages name the code computing the network: Net.forward, model(), Bnn.model()
    # Latent sites the model samples that do not flow into the output (e.g. a noise scale).
    nonweight_sites: dict[str, SiteReading] = field(default_factory=dict)
    # The regression likelihood's noise (pyro2pfp.frontend.noise), or why there is none.
    noise: NoiseModel | HeteroscedasticNoise | NoNoiseModel | None = None
    # Whether the output feeds a Normal likelihood (a regression): set for a TyXe Gaussian likelihood,
    # which lives outside the traced net; see :meth:`regression`.
    tyxe_gaussian_likelihood: bool = False
    # The graph's inputs after the network input (batched example arguments), named for messages.
    extra_inputs: list[str] = field(default_factory=list)
    # How the program calls the model: its inputs for another input batch (TracedArgs.inputs_at).
    traced_args: TracedArgs | None = None
    # The program's floating-point tensor constants (a model function's modules' parameters and buffers), by
    # constant name, deterministic (with the param store's name where the store holds them).
    constants: dict[str, GaussianParam] = field(default_factory=dict)
    # A model that fixes the batch size while traced (len(x) for its plate) is traced at this fixed batch size;
    # the network is proven the same at every batch size, but the program runs at this one only. None: any.
    static_batch: int | None = None
    # A correlated guide's global factors (their loadings are in params[...].factors).
    guide_factors: GuideFactorInfo | None = None

    def regression(self) -> bool:
        """Whether the network's output is the mean (and scale) of a Normal likelihood (a regression),
        so that e.g. a final sigmoid is the mean's activation, not Bernoulli probabilities."""
        return self.tyxe_gaussian_likelihood or isinstance(self.noise, NoiseModel | HeteroscedasticNoise)


def _module_call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    # Looked up at call time: torch.export patches nn.Module.__call__ to record module paths.
    return torch.nn.Module.__call__(self, *args, **kwargs)


def _module_setattr(self: torch.nn.Module, name: str, value: Any) -> None:
    torch.nn.Module.__setattr__(self, name, value)  # looked up at call time (pyro2pfp.frontend.preserve wraps it)


def _module_delattr(self: torch.nn.Module, name: str) -> None:
    torch.nn.Module.__delattr__(self, name)


@functools.cache
def _plain_module_class(cls: type) -> type:
    """A subclass of ``cls`` whose attribute access and call are plain ``nn.Module`` ones."""
    namespace = {
        "__getattr__": torch.nn.Module.__getattr__,
        "__setattr__": _module_setattr,
        "__delattr__": _module_delattr,
        "__call__": _module_call,
        "__module__": cls.__module__,
    }
    namespace["_pfp_original"] = cls
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
                    shapes[f"{path}.{attr}" if path else attr] = tuple(prior.batch_shape + prior.event_shape)
    return shapes


def _pyro_param_value(module: PyroModule, attr: str) -> torch.Tensor:
    store = pyro.get_param_store()
    fullname = _site_name(module, attr)
    if fullname in store:
        return store[fullname].detach()
    return getattr(module, attr).detach()


def _deterministic_copy(model: torch.nn.Module, means: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Copy of ``model`` with every sample site replaced by an ``nn.Parameter`` (its mean)."""
    # Not copied: guides the model holds (model.guide = AutoNormal(model): not part of the network; their traces
    # hold tensors of the graph that computed them, which cannot be copied) and tensors computed with gradients.
    memo: dict[int, Any] = {id(m): torch.nn.Module() for m in model.modules() if isinstance(m, AutoGuide)}
    memo.update({id(t): t.detach() for m in model.modules() for t in vars(m).values()
                 if isinstance(t, torch.Tensor) and not t.is_leaf})
    try:
        det = copy.deepcopy(model, memo)
    except Exception as exc:
        raise TracingError(f"the model {type(model).__name__} cannot be copied ({type(exc).__name__}: {exc}): PFP "
                           "traces a copy of it that holds the posterior means. Make the model deep-copyable "
                           "(no open files, locks or generators among its attributes).") from exc
    originals = dict(model.named_modules())
    for path, module in det.named_modules():
        if not isinstance(module, PyroModule) or path not in originals:
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
    """The exported module: the deterministic copy of the model (``model``, or a model function) and
    one parameter per latent site sampled in ``forward`` (``functional.site<i>``: its posterior mean)."""

    def __init__(self, model: Any, functional_means: dict[str, torch.Tensor]) -> None:
        super().__init__()
        if isinstance(model, torch.nn.Module):
            self.model = model
        else:
            self.__dict__["model"] = model  # a model function (pyro.random_module style)
        self.__dict__["traced"] = trace_forms.named_forward(model)  # what forward() calls (the model itself)
        self.site_keys = {site: f"site{i}" for i, site in enumerate(functional_means)}
        self.functional = torch.nn.ParameterDict(
            {self.site_keys[site]: torch.nn.Parameter(mean, requires_grad=False)
             for site, mean in functional_means.items()})
        self.seen_sites: set[str] = set()
        self.lifted = torch.nn.ModuleDict()  # deterministic copies of pyro.random_module nets
        self.lifted_names: list[str] = []
        # Heteroscedastic head: also return the Normal likelihood's loc and scale, so the graph shows
        # where they are read from (pyro2pfp.frontend.noise.read_head).
        self.probe_head = False
        # The Normal likelihood's site: a set, mutated in place (export restores assigned attributes and lists).
        self.head_site: set[str] = set()
        self.traced_args: TracedArgs | None = None  # the model's further arguments (convert's example_args)

    def _latent(self, msg: dict) -> torch.Tensor | None:
        """A latent site the guide has a posterior for returns the parameter holding its posterior mean (so
        the graph names it, and whether it flows into the output shows)."""
        key = self.site_keys.get(msg["name"])
        if key is None:
            return None
        self.seen_sites.add(msg["name"])
        return self.functional[key]

    def forward(self, x: torch.Tensor, batched: tuple = ()) -> Any:
        args = self.traced_args.call(x, batched) if self.traced_args is not None else (x,)
        sites = LikelihoodSites(self._latent)
        with sites:
            traced: Any = self.__dict__["traced"]
            out = network_output(call_with_model_args(traced, args), sites)
        if not self.probe_head:
            return out
        normals = [(name, unwrap_independent(fn)) for name, fn in sites.likelihoods]
        normals = [(name, fn) for name, fn in normals if isinstance(fn, torch.distributions.Normal)]
        if len(normals) != 1:
            raise TracingError(f"the likelihood's scale depends on the input, but the model has {len(normals)} "
                               "Normal likelihood sites (one is supported)")
        self.head_site.clear()
        self.head_site.add(normals[0][0])
        return out, normals[0][1].loc, normals[0][1].scale


def _example_input(input_shape: tuple[int, ...], batch: int = 2) -> torch.Tensor:
    return torch.zeros((batch, *input_shape), dtype=torch.float32)


def _functional_means(readings: dict[str, SiteReading], pyro_sample_sites: set[str]) -> dict[str, torch.Tensor]:
    """Posterior means of the latent sites not held by a PyroSample attribute (zeros of the site's
    shape where the posterior has no mean: an error later, if the site turns out to be a weight)."""
    return {site: torch.as_tensor(r.mean, dtype=torch.float32) if r.mean is not None else torch.zeros(r.shape)
            for site, r in readings.items() if site not in pyro_sample_sites}


def _user_model_name(model: Any) -> str:
    """The name the user knows the model by (not the class of its deterministic copy)."""
    original = getattr(type(model), "_pfp_original", None)
    if isinstance(model, torch.nn.Module) and original is not None:
        return str(original.__name__)
    owner = getattr(model, "__self__", None)
    name = getattr(model, "__name__", None) or type(model).__name__
    return f"{type(owner).__name__}.{name}" if owner is not None else name


class _BatchFixed(TracingError):
    """The model fixed the batch size while it was traced with a symbolic one (see :func:`_static_program`)."""

    def __init__(self, name: str, where: str | None) -> None:
        super().__init__(trace_forms.specialisation_message(name, where))
        self.name, self.where = name, where


STATIC_BATCHES = (2, 3)  # the fixed batch sizes a model that fixes its batch size is traced at


def _static_program(wrapper: _Wrapper, input_shape: tuple[int, ...],
                    fixed: _BatchFixed) -> torch.export.ExportedProgram:
    """The program of a model that fixes its batch size while traced (``len(x)`` for its plate): traced at the
    two batch sizes :data:`STATIC_BATCHES`, it is the network for every batch size if the network is the same
    in both (:func:`pyro2pfp.frontend.trace_forms.batch_reaches_network`); else the message names where the fixed size
    reaches it."""
    assert wrapper.traced_args is not None
    programs = []
    for batch in STATIC_BATCHES:
        program = _export(wrapper, wrapper.traced_args.inputs(batch), input_shape, dynamic=False)
        fold_identity_broadcasts(program)
        programs.append(program)
    why = trace_forms.batch_reaches_network(
        programs[0], programs[1], STATIC_BATCHES,
        lambda p: input_dependent(p.graph, set(p.graph_signature.user_inputs)))
    if why is not None:
        raise TracingError(trace_forms.specialisation_message(fixed.name, fixed.where, why)) from fixed
    return programs[0]


def _forward_name(model: Any) -> str:
    """How messages name the code that computes the network: ``Net.forward``, ``model()``, ``Bnn.model()``."""
    name = _user_model_name(model)
    return f"{name}.forward" if isinstance(model, torch.nn.Module) else f"{name}()"


def _export(wrapper: _Wrapper, inputs: tuple[torch.Tensor, tuple[torch.Tensor, ...]], input_shape: tuple[int, ...],
            *, dynamic: bool = True) -> torch.export.ExportedProgram:
    """Export ``wrapper`` at the example ``inputs`` (the input batch and the batched further arguments,
    which share its batch dimension); device moves that change nothing are dropped
    (:mod:`pyro2pfp.frontend.trace_forms`)."""
    x, batched = inputs
    batch = torch.export.Dim("batch", min=1, max=2**20)
    dynamic_shapes: Any = None
    if dynamic:
        dynamic_shapes = {"x": {0: batch}, "batched": tuple({0: batch} for _ in batched)} if batched else \
            {"x": {0: batch}}
    example = (x, batched) if batched else (x,)
    fixed_at: list[str] = []
    try:  # each run of the model leaves the modules it assigns to as they were (pyro2pfp.frontend.preserve)
        with pyro.validation_enabled(False), torch.no_grad(), module_changes_undone(), \
                trace_forms.device_moves_kept(), trace_forms.batch_specialisations(fixed_at):
            for module in modules_of_function(wrapper.model):
                module.eval()  # undone on leaving the block
            program = torch.export.export(wrapper, example, dynamic_shapes=dynamic_shapes, strict=False)
        repair_users(program)
        trace_forms.fold_device_moves(program)
        return program
    except Exception as exc:
        args = wrapper.traced_args.call(x, batched) if wrapper.traced_args is not None else (x,)
        name = _user_model_name(wrapper.model)
        if padded_parameters(wrapper.model, args):
            raise TracingError(f"running the model {name} to trace it failed: "
                               f"{call_failure(wrapper.model, args, exc)}") from exc
        if "specialized it to be a constant" in str(exc) or "Constraints violated" in str(exc):
            raise _BatchFixed(name, fixed_at[0] if fixed_at else None) from exc
        cuda = trace_forms.cuda_message(exc)
        if cuda is not None:
            raise TracingError(f"the model {name}: {cuda}") from exc
        where = trace_forms.user_frame_of(exc)
        raise TracingError(
            f"torch.export could not trace the model {name} for input shape (batch, "
            f"{', '.join(map(str, input_shape))}){f' at {where}' if where else ''}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}. "
            "Check input_shape and that forward() works on a batch of that shape."
        ) from exc


def _pyro_sample_weights(model: Any, readings: dict[str, SiteReading], guide: Any) -> dict[str, GaussianParam]:
    """The posterior of every ``PyroSample`` attribute, keyed by parameter path (``fc1.weight``)."""
    if not isinstance(model, torch.nn.Module):
        return {}
    prior_shapes = _prior_shapes(model)
    params = {}
    for path, site in sample_sites(model).items():
        reading = readings.get(site)
        if reading is None:
            has = sorted(readings)
            raise PosteriorError(
                f"sample site '{site}' of the model (parameter {path}) has no posterior in the guide "
                f"{guide_name(guide)}, which samples {has[:6]}{' …' if len(has) > 6 else ''}. Sample it in the "
                f"guide (pyro.sample('{site}', Normal(loc, scale).to_event(...)) with the prior's shape) or make "
                "it a parameter (PyroParam / nn.Parameter) if it is deterministic; and check that the guide is "
                "the one trained for this model."
            )
        expected = prior_shapes.get(path)
        if reading.mean is None or reading.var is None:  # not usable as a weight: an error if it is one
            shape = expected if expected is not None else reading.shape
            params[path] = GaussianParam(np.zeros(shape), np.zeros(shape), site=site)
            continue
        if expected is not None and tuple(reading.mean.shape) != expected:
            raise PosteriorError(f"site '{site}': the guide's posterior has shape {tuple(reading.mean.shape)} but "
                                 f"the model's prior (parameter {path}) has shape {expected}. Was the guide (or the "
                                 "param store it was loaded from) trained for a model of other sizes? Give the "
                                 "guide's site the prior's shape, or convert the model it was trained for.")
        params[path] = GaussianParam(reading.mean, reading.var, site=site, factors=reading.factors)
    return params


def _split_pyro_samples(program: torch.export.ExportedProgram, pyro_sample_sites: dict[str, str],
                        params: dict[str, GaussianParam], readings: dict[str, SiteReading], guide: Any) -> set[str]:
    """``PyroSample`` attributes the network output does not use (e.g. a ``log_sigma`` noise scale) are
    non-weight sites: dropped from ``params`` and returned; the used ones must have a weight posterior."""
    used = used_parameters(program)
    unused = set()
    for path, site in pyro_sample_sites.items():
        if WRAPPER_PREFIX + path in used:
            require_weight_posterior(site, f"parameter {path}", readings[site], guide)
        else:
            unused.add(site)
            params.pop(path, None)
    return unused


def _random_module_nets(model: Any, example: ModelArgs) -> dict[str, torch.nn.Module]:
    """``{name: net}`` of the ``pyro.random_module(name, net, ...)`` calls of a model function."""
    if isinstance(model, torch.nn.Module):
        return {}
    try:
        return random_module.lifted_modules(model, lambda fn: call_with_model_args(fn, example))
    except Exception as exc:  # the model function's own error
        raise TracingError(f"running the model {_user_model_name(model)} failed: "
                           f"{call_failure(model, example, exc)}") from exc


def _build_wrapper(model: Any, readings: dict[str, SiteReading], weights: dict[str, GaussianParam],
                   lifted: dict[str, torch.nn.Module]) -> tuple[_Wrapper, dict[str, str]]:
    """The module to export: the deterministic copy (posterior means), a parameter per site sampled in
    ``forward``, a deterministic copy per ``pyro.random_module`` net (``lifted``).  Also ``{parameter path:
    site}`` of the random modules' parameters."""
    pyro_sample_sites = {p.site for p in weights.values() if p.site is not None}
    if isinstance(model, torch.nn.Module):
        det = _deterministic_copy(model, {path: torch.as_tensor(p.mean, dtype=torch.float32)
                                          for path, p in weights.items()})
    else:
        det = model
    lifted_paths = {f"lifted.m{i}.{path}": f"{name}{random_module.SEPARATOR}{path}"
                    for i, (name, module) in enumerate(lifted.items()) for path, _ in module.named_parameters()}
    lifted_means = {site: torch.as_tensor(readings[site].mean, dtype=torch.float32)
                    for site in lifted_paths.values() if site in readings and readings[site].mean is not None}
    wrapper = _Wrapper(det, _functional_means(readings, pyro_sample_sites | set(lifted_means)))
    for i, (name, module) in enumerate(lifted.items()):
        wrapper.lifted[f"m{i}"] = random_module.deterministic_copy(name, module, lifted_means)
    wrapper.lifted_names = list(lifted)
    return wrapper, lifted_paths


def _classify_exported_sites(wrapper: _Wrapper, lifted_paths: dict[str, str], program: torch.export.ExportedProgram,
                             readings: dict[str, SiteReading], guide: Any) -> tuple[dict[str, str], set[str]]:
    """``({parameter path: site}`` of the weights sampled in ``forward`` or lifted by ``random_module``,
    ``{non-weight sites}``): a site is a weight when the output depends on its parameter."""
    used = used_parameters(program)
    weights: dict[str, str] = {}
    nonweights: set[str] = set()
    candidates = [(path, site, f"parameter {site.split(random_module.SEPARATOR)[1]} of the random_module "
                               f"'{site.split(random_module.SEPARATOR)[0]}'")
                  for path, site in lifted_paths.items() if site in readings]
    candidates += [(f"functional.{wrapper.site_keys[site]}", site, "sampled in forward() and used by the network")
                   for site in wrapper.seen_sites]
    for path, site, where in candidates:
        if path in used:
            require_weight_posterior(site, where, readings[site], guide)
            weights[path] = site
        else:
            nonweights.add(site)
    return weights, nonweights


def _warn_moment_matched(params: dict[str, GaussianParam], readings: dict[str, SiteReading]) -> None:
    matched = [f"'{p.site}' ({readings[p.site].reason})" for p in params.values()
               if p.site is not None and readings[p.site].kind == "moments"]
    if matched:
        warnings.warn(f"weights with non-Gaussian posteriors are moment-matched (PFP uses their mean and "
                      f"variance only): {', '.join(matched)}", stacklevel=4)


def trace_model(model: Any, guide: Any, input_shape: tuple[int, ...] | None, *,
                check_posterior: bool = True, example: ModelArgs | None = None) -> TracedModel:
    """Trace ``model`` with the posterior of ``guide`` (as the param store holds it now) into a
    :class:`TracedModel`; ``check_posterior``: see :func:`pyro2pfp.frontend.posterior.read_posterior`.

    ``model`` is a ``PyroModule`` (weights as ``PyroSample`` attributes and/or sampled in
    ``forward``) or a model function (``pyro.random_module`` style; ``input_shape`` required).  Every
    latent site of the guide must be a weight or a non-weight site of the model
    (:mod:`pyro2pfp.frontend.site_matching`).  ``example``: the arguments to run the model and guide with
    (:mod:`pyro2pfp.frontend.model_args`; default: a zero batch of ``input_shape``).
    """
    if example is not None and input_shape is None:
        input_shape = tuple(example[0].shape[1:])
    check_has_forward(model)
    inferred = first_linear(model) if input_shape is None else None
    input_shape = checked_input_shape(model, input_shape)
    try:
        return _trace(model, guide, input_shape, check_posterior, example)
    except (PosteriorError, TracingError) as exc:  # a shape error where the input shape was guessed: say so
        if inferred is None or not re.search(r"mat1 and mat2|cannot be multiplied|size mismatch|must match the size|"
                                             r"is invalid for input of size|expected input", str(exc)):
            raise
        raise type(exc)(f"{exc} (input_shape was taken as {input_shape} from the first Linear layer '{inferred}': "
                        "pass input_shape=(...) if the model's input has another shape)").with_traceback(
            exc.__traceback__) from exc.__cause__


def _trace(model: Any, guide: Any, input_shape: tuple[int, ...], check_posterior: bool,
           example: ModelArgs | None) -> TracedModel:
    model_name = getattr(model, "__name__", type(model).__name__)
    warn_train_mode(model)
    for module in reachable_modules(model, guide):  # every run below in eval mode (convert restores the modes):
        module.eval()  # converted semantics, and running statistics that no run of the model updates
    if example is None:
        example = ModelArgs((_example_input(input_shape),))
    pyro_sample_sites = sample_sites(model) if isinstance(model, torch.nn.Module) else {}
    originals = module_tensors(reachable_modules(model, guide))  # before reading syncs them with the store
    readings = read_posterior(model, guide, example, weight_sites=pyro_sample_sites.values(),
                              check=check_posterior)
    factors = guide_factors(guide, readings)
    lifted = random_module.lifted_submodule(model, list(readings)) \
        if isinstance(model, torch.nn.Module) and not pyro_sample_sites else None
    if lifted is not None:  # the net a pyro.random_module model lifts (or a module holding it) as the model
        model = random_module.lifting_model(lifted[0], model, lifted[1], lifted[2])
    params = _pyro_sample_weights(model, readings, guide)
    nets = _random_module_nets(model, example)
    # The param store holds the deterministic parameters too: the user's modules take its values (restored
    # by convert), so the deterministic copy, the lifted nets and a model function's modules compute with them.
    registrations = registered_parameters(model, guide, example, reachable_modules(model, guide), nets, readings,
                                          originals)
    take_store_values(registrations)

    wrapper, lifted_paths = _build_wrapper(model, readings, params, nets)
    wrapper.traced_args = TracedArgs(example)
    wrapper.probe_head = scale_depends_on_input(model, guide, input_shape, wrapper.traced_args.at)
    with random_module.replaced_random_modules(
            {name: wrapper.lifted[f"m{i}"] for i, name in enumerate(wrapper.lifted_names)}):
        static_batch = None
        try:
            program = _export(wrapper, wrapper.traced_args.inputs(2), input_shape)
        except _BatchFixed as fixed:  # e.g. pyro.plate("data", len(x)): the network may not depend on it
            program, static_batch = _static_program(wrapper, input_shape, fixed), STATIC_BATCHES[0]
        fold_identity_broadcasts(program)
        fold_output_broadcast(program)
        extra_names = list(wrapper.traced_args.batched_names)
        if not wrapper.probe_head:  # else the program ends at the network output once the head is read
            check_output(program, model, extra_names)
            check_supported_ops(program, _forward_name(model), WRAPPER_PREFIX)
        single = _export(wrapper, wrapper.traced_args.inputs(1), input_shape, dynamic=False)
        fold_identity_broadcasts(single)
        check_batch_independent(program, single)
    traced_paths = [name.removeprefix(WRAPPER_PREFIX) for name, _ in program.named_parameters()]
    in_store = store_names(model, registrations, nets, traced_paths)
    check_store_values({name.removeprefix(WRAPPER_PREFIX): p.detach().to(torch.float64).numpy()
                        for name, p in program.named_parameters()
                        if name.removeprefix(WRAPPER_PREFIX) in in_store}, in_store)
    x = wrapper.traced_args.inputs(2)[0] if example.given else \
        torch.randn((2, *input_shape), generator=torch.Generator().manual_seed(0))
    means = {**{site: wrapper.functional[key].detach() for site, key in wrapper.site_keys.items()},
             **{p.site: torch.as_tensor(p.mean, dtype=torch.float32) for p in params.values() if p.site is not None},
             **{site: torch.as_tensor(readings[site].mean, dtype=torch.float32) for site in lifted_paths.values()
                if site in readings and readings[site].mean is not None}}
    check_against_model(program, model, wrapper.traced_args.at(x), wrapper.traced_args.inputs_at(x), means,
                        _user_model_name(model))
    head = _end_at_head(program, next(iter(wrapper.head_site))) if wrapper.probe_head else None
    if head is not None:
        check_output(program, model, extra_names)
        check_supported_ops(program, _forward_name(model), WRAPPER_PREFIX)

    exported_weights, nonweights = _classify_exported_sites(wrapper, lifted_paths, program, readings, guide)
    unused_samples = _split_pyro_samples(program, pyro_sample_sites, params, readings, guide)
    nonweights |= unused_samples
    model_parameters = [lifted_paths.get(name, name.removeprefix(WRAPPER_PREFIX))
                        for name, _ in program.named_parameters() if not name.startswith("functional.")]
    check_all_matched(readings, [*(set(pyro_sample_sites.values()) - unused_samples), *exported_weights.values()],
                      nonweights,
                      [*pyro_sample_sites, *model_parameters], guide,
                      model_name=repr(model_name))
    for path, site in exported_weights.items():
        reading = readings[site]
        assert reading.mean is not None and reading.var is not None
        params[path] = GaussianParam(reading.mean, reading.var, site=site, factors=reading.factors)
    _warn_moment_matched(params, readings)

    for name, param in program.named_parameters():
        path = name.removeprefix(WRAPPER_PREFIX)
        if path not in params and not path.startswith("functional."):
            arr = param.detach().to(torch.float64).numpy().copy()
            reg = in_store.get(path)
            params[path] = GaussianParam(arr, np.zeros_like(arr), store=reg.name if reg else None,
                                         stale=bool(reg and reg.stale))
    constants = _constants(program, registrations)
    for name, buffer in program.named_buffers():
        path = name.removeprefix(WRAPPER_PREFIX)
        arr = buffer.detach().to(torch.float64).numpy().copy()
        params[path] = GaussianParam(arr, np.zeros_like(arr))
    return TracedModel(program=program, params=params, input_shape=input_shape,
                       extra_inputs=list(wrapper.traced_args.batched_names), traced_args=wrapper.traced_args,
                       constants=constants, static_batch=static_batch,
                       model_name=model_name, forward_name=_forward_name(model),
                       nonweight_sites={site: readings[site] for site in sorted(nonweights)},
                       guide_factors=None if factors is None else factors.info(),
                       noise=head if head is not None else find_noise(model, readings, nonweights, input_shape,
                                                                        wrapper.traced_args.at))


def _constants(program: torch.export.ExportedProgram, registrations: list[Registration]) -> dict[str, GaussianParam]:
    """The program's floating-point tensor constants as deterministic parameters; a constant that is a param
    store tensor (a model function's module holds the store's tensors while it is traced) names its entry."""
    by_storage = {reg.tensor.untyped_storage().data_ptr(): reg for reg in registrations if reg.tensor.numel()}
    out = {}
    for name, value in program.constants.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            mean = value.detach().to(torch.float64).numpy().copy()
            reg = by_storage.get(value.untyped_storage().data_ptr()) if value.numel() else None
            out[name] = GaussianParam(mean, np.zeros_like(mean), store=reg.name if reg else None,
                                      stale=bool(reg and reg.stale))
    return out


def _end_at_head(program: torch.export.ExportedProgram, site: str) -> HeteroscedasticNoise:
    """Read the heteroscedastic head from a program traced with ``probe_head`` (outputs: the model's
    return, the likelihood's loc and scale) and make the program end at the network output they are
    read from (:func:`pyro2pfp.frontend.noise.read_head`)."""
    from torch.export.graph_signature import OutputKind, OutputSpec, TensorArgument
    from torch.utils import _pytree

    graph = program.graph_module.graph
    out_node = next(n for n in graph.nodes if n.op == "output")
    outs = list(out_node.args[0])
    loc, scale = outs[-2], outs[-1]
    try:
        if not isinstance(loc, torch.fx.Node) or not isinstance(scale, torch.fx.Node):
            raise ValueError("the loc or the scale is a constant")
        network_output, head = read_head(graph, loc, scale, site)
    except ValueError as exc:
        raise UnsupportedLayerError(
            f"the scale of the likelihood '{site}' depends on the input (a heteroscedastic head), but the head "
            f"cannot be read: {exc}. Supported: one network output S, the mean an index of it (S[..., 0], "
            "S[..., :k], chunk/unbind/split) and the scale an elementwise link (exp, softplus, sigmoid, abs, "
            "clamp, +,-,*,/ constants) of another index of it.") from exc
    out_node.args = ((network_output,),)
    program.graph_signature.output_specs[:] = [
        OutputSpec(kind=OutputKind.USER_OUTPUT, arg=TensorArgument(name=network_output.name), target=None)]
    signature = program._module_call_graph[0].signature
    if signature is not None:  # so program.module() returns the network output alone
        signature.out_spec = _pytree.tree_structure(torch.zeros(()))
    graph.eliminate_dead_code()
    program.graph_module.recompile()
    return head
