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
import difflib
import functools
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyro
import torch
import torch.fx
from pyro.nn import PyroModule
from pyro.nn.module import _make_name
from pyro.poutine.messenger import Messenger
from pyro.poutine.subsample_messenger import _Subsample

from . import ops as _ops  # noqa: F401  (registers the converters that _check_supported_ops consults)
from . import random_module, trace_forms
from .converters import CONVERTERS, unsupported_message
from .errors import PosteriorError, TracingError, UnsupportedLayerError
from .graph import GaussianParam, GuideFactorInfo
from .model_args import TracedArgs
from .model_checks import check_has_forward, checked_input_shape, modules_of_function, warn_train_mode
from .noise import HeteroscedasticNoise, NoiseModel, NoNoiseModel, find_noise, read_head, scale_depends_on_input
from .output_chain import check_output, network_output_of, trailing_chain_nodes
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
from .preserve import module_changes_undone
from .site_matching import check_all_matched, guide_name, require_weight_posterior
from .trace_passes import (
    compute_ops,
    fold_identity_broadcasts,
    repair_users,
    tensor_ops,
    torch_module,
    used_parameters,
    user_line,
)

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
    # Latent sites the model samples that do not flow into the output (e.g. a noise scale).
    nonweight_sites: dict[str, SiteReading] = field(default_factory=dict)
    # The regression likelihood's noise (pyro2pfp.noise), or why there is none.
    noise: NoiseModel | HeteroscedasticNoise | NoNoiseModel | None = None
    # Whether the output feeds a Normal likelihood (a regression): set for a TyXe Gaussian likelihood,
    # which lives outside the traced net; see :meth:`regression`.
    tyxe_gaussian_likelihood: bool = False
    # The graph's inputs after the network input (batched example arguments), named for messages.
    extra_inputs: list[str] = field(default_factory=list)
    # A correlated guide's global factors (their loadings are in params[...].factors).
    guide_factors: GuideFactorInfo | None = None

    def regression(self) -> bool:
        """Whether the network's output is the mean (and scale) of a Normal likelihood (a regression),
        so that e.g. a final sigmoid is the mean's activation, not Bernoulli probabilities."""
        return self.tyxe_gaussian_likelihood or isinstance(self.noise, NoiseModel | HeteroscedasticNoise)


def _likelihood_mean(fn: Any) -> torch.Tensor:
    """What a model that returns its likelihood's sample is taken to return: the ``loc`` (the
    network output) of a Normal-like likelihood, else a placeholder."""
    loc = getattr(unwrap_independent(fn), "loc", None)
    return loc if isinstance(loc, torch.Tensor) else torch.zeros(())


class _ModelSites(Messenger):
    """While the deterministic copy is exported: a latent sample site the guide has a posterior for
    returns the wrapper's parameter holding its posterior mean (so the graph names it, and whether
    it flows into the output shows); every other non-plate ``pyro.sample`` (the likelihood) is a
    no-op returning its observed value or the mean that feeds it."""

    def __init__(self, wrapper: _Wrapper) -> None:
        super().__init__()
        self.wrapper = wrapper

    def _pyro_sample(self, msg: dict) -> None:
        if isinstance(msg["fn"], _Subsample):  # plates must keep working
            return
        key = self.wrapper.site_keys.get(msg["name"])
        if key is not None and not msg["is_observed"]:
            self.wrapper.seen_sites.add(msg["name"])
            msg["value"] = self.wrapper.functional[key]
        else:
            self.wrapper.likelihoods.append((msg["name"], msg["fn"]))
            if msg["value"] is None:
                msg["value"] = _likelihood_mean(msg["fn"])
                self.wrapper.placeholders.append(id(msg["value"]))
        msg["done"] = True
        msg["stop"] = True


def _module_call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    # Looked up at call time: torch.export patches nn.Module.__call__ to record module paths.
    return torch.nn.Module.__call__(self, *args, **kwargs)


def _module_setattr(self: torch.nn.Module, name: str, value: Any) -> None:
    torch.nn.Module.__setattr__(self, name, value)  # looked up at call time (pyro2pfp.preserve wraps it)


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
    try:
        det = copy.deepcopy(model)
    except Exception as exc:
        raise TracingError(f"the model {type(model).__name__} cannot be copied ({type(exc).__name__}: {exc}): PFP "
                           "traces a copy of it that holds the posterior means. Make the model deep-copyable "
                           "(no open files, locks or generators among its attributes).") from exc
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
    """The exported module: the deterministic copy of the model (``model``, or a model function) and
    one parameter per latent site sampled in ``forward`` (``functional.site<i>``: its posterior mean)."""

    def __init__(self, model: Any, functional_means: dict[str, torch.Tensor]) -> None:
        super().__init__()
        if isinstance(model, torch.nn.Module):
            self.model = model
        else:
            self.__dict__["model"] = model  # a model function (pyro.random_module style)
        self.site_keys = {site: f"site{i}" for i, site in enumerate(functional_means)}
        self.functional = torch.nn.ParameterDict(
            {self.site_keys[site]: torch.nn.Parameter(mean, requires_grad=False)
             for site, mean in functional_means.items()})
        self.seen_sites: set[str] = set()
        self.lifted = torch.nn.ModuleDict()  # deterministic copies of pyro.random_module nets
        self.lifted_names: list[str] = []
        # The non-latent sample sites of the last run (the likelihood): [(name, distribution)].
        self.likelihoods: list[tuple[str, Any]] = []
        self.placeholders: list[int] = []  # ids of the values the likelihood sites returned (no observation)
        # Heteroscedastic head: also return the Normal likelihood's loc and scale, so the graph shows
        # where they are read from (pyro2pfp.noise.read_head).
        self.probe_head = False
        # The Normal likelihood's site: a set, mutated in place (export restores assigned attributes and lists).
        self.head_site: set[str] = set()
        self.traced_args: TracedArgs | None = None  # the model's further arguments (convert's example_args)

    def forward(self, x: torch.Tensor, batched: tuple = ()) -> Any:
        self.likelihoods, self.placeholders = [], []
        args = self.traced_args.call(x, batched) if self.traced_args is not None else (x,)
        with _ModelSites(self):
            out = call_with_model_args(self.model, args)
        if out is None or id(out) in self.placeholders:
            # The model returns nothing (or its likelihood's sample): the network output is what the
            # likelihood is built from (Categorical(logits=...), Bernoulli(probs=...), Normal(loc, ...)).
            built_from = [t for t in (network_output_of(fn) for _, fn in self.likelihoods) if t is not None]
            if len(built_from) == 1:
                out = built_from[0]
        if not self.probe_head:
            return out
        normals = [(name, unwrap_independent(fn)) for name, fn in self.likelihoods]
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


def _check_supported_ops(program: torch.export.ExportedProgram, model_name: str) -> None:
    """Raise :class:`UnsupportedLayerError` for the first op the output depends on that has no PFP
    converter, naming the built-in torch module it is computed in (``attn`` (nn.MultiheadAttention)),
    before anything else compares or converts the graph."""
    chain = trailing_chain_nodes(program)  # a final normalisation: stripped later (pyro2pfp.output_chain)
    for node in tensor_ops(program):
        target = str(node.target)
        if target in CONVERTERS or target.startswith("aten.sym_") or node in chain:
            continue
        op = target.removesuffix(".default")
        module = torch_module(node, _WRAPPER_PREFIX)
        if module is None:
            raise UnsupportedLayerError(unsupported_message(f"{model_name or 'model'}.forward ({op})"))
        path, cls = module
        raise UnsupportedLayerError(unsupported_message(f"`{path}` ({cls})", f": {path} ({op}) has no PFP rule"))


def _check_batch_independent(program: torch.export.ExportedProgram, wrapper: _Wrapper,
                             input_shape: tuple[int, ...]) -> None:
    """Raise :class:`TracingError` if ``forward`` computes something else at batch 1.

    The program is traced with a symbolic batch, which torch assumes to be ≥ 2 (sizes 0 and 1 are
    specialised), so ``if x.shape[0] > 1:`` is baked in without a guard.  A second trace at batch 1
    must run the same computing ops in the same order, or the converted network would be wrong there.
    Compared are the tensor ops the output depends on (arithmetic on the symbolic batch size exists
    at batch ≥ 2 only); a difference inside a built-in torch module is torch lowering the same
    module differently at batch 1, not a branch in the model, and is passed over.
    """
    assert wrapper.traced_args is not None
    single = _export(wrapper, wrapper.traced_args.inputs(1), input_shape, dynamic=False)
    fold_identity_broadcasts(single)
    ops, ops1 = compute_ops(program), compute_ops(single)
    keys, keys1 = ([(str(n.target), str(torch_module(n))) for n in nodes] for nodes in (ops, ops1))
    matcher = difflib.SequenceMatcher(a=keys, b=keys1, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        differing = [n for n in [*ops[i1:i2], *ops1[j1:j2]] if torch_module(n) is None]
        if not differing:
            continue
        a = ops[i1] if i1 < i2 else None
        b = ops1[j1] if j1 < j2 else None
        where = user_line(differing[0])
        first, second = (n.target if n is not None else "nothing" for n in (a, b))
        raise TracingError(
            f"the model computes differently at batch 1 than at batch ≥ 2 ({first} vs {second} at {where}): "
            "forward() branches on the batch "
            "size (e.g. `if x.shape[0] > 1:`). PFP needs one network for every batch size: remove the branch.")


def _user_model_name(model: Any) -> str:
    """The name the user knows the model by (not the class of its deterministic copy)."""
    original = getattr(type(model), "_pfp_original", None)
    if isinstance(model, torch.nn.Module) and original is not None:
        return str(original.__name__)
    owner = getattr(model, "__self__", None)
    name = getattr(model, "__name__", None) or type(model).__name__
    return f"{type(owner).__name__}.{name}" if owner is not None else name


def _export(wrapper: _Wrapper, inputs: tuple[torch.Tensor, tuple[torch.Tensor, ...]], input_shape: tuple[int, ...],
            *, dynamic: bool = True) -> torch.export.ExportedProgram:
    """Export ``wrapper`` at the example ``inputs`` (the input batch and the batched further arguments,
    which share its batch dimension); device moves that change nothing are dropped
    (:mod:`pyro2pfp.trace_forms`)."""
    x, batched = inputs
    batch = torch.export.Dim("batch", min=1, max=2**20)
    dynamic_shapes: Any = None
    if dynamic:
        dynamic_shapes = {"x": {0: batch}, "batched": tuple({0: batch} for _ in batched)} if batched else \
            {"x": {0: batch}}
    example = (x, batched) if batched else (x,)
    fixed_at: list[str] = []
    try:  # each run of the model leaves the modules it assigns to as they were (pyro2pfp.preserve)
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
            raise TracingError(trace_forms.specialisation_message(name, fixed_at[0] if fixed_at else None)) from exc
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
        if _WRAPPER_PREFIX + path in used:
            require_weight_posterior(site, f"parameter {path}", readings[site], guide)
        else:
            unused.add(site)
            params.pop(path, None)
    return unused


def _build_wrapper(model: Any, readings: dict[str, SiteReading], weights: dict[str, GaussianParam],
                   example: ModelArgs) -> tuple[_Wrapper, dict[str, str]]:
    """The module to export: the deterministic copy (posterior means), a parameter per site sampled in
    ``forward``, a deterministic copy per ``pyro.random_module`` net.  Also ``{parameter path: site}``
    of the random modules' parameters."""
    pyro_sample_sites = {p.site for p in weights.values() if p.site is not None}
    if isinstance(model, torch.nn.Module):
        det = _deterministic_copy(model, {path: torch.as_tensor(p.mean, dtype=torch.float32)
                                          for path, p in weights.items()})
        lifted: dict[str, torch.nn.Module] = {}
    else:
        det = model
        try:
            lifted = random_module.lifted_modules(model, lambda fn: call_with_model_args(fn, example))
        except Exception as exc:  # the model function's own error
            raise TracingError(f"running the model {_user_model_name(model)} failed: "
                               f"{call_failure(model, example, exc)}") from exc
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
    :class:`TracedModel`; ``check_posterior``: see :func:`pyro2pfp.posterior.read_posterior`.

    ``model`` is a ``PyroModule`` (weights as ``PyroSample`` attributes and/or sampled in
    ``forward``) or a model function (``pyro.random_module`` style; ``input_shape`` required).  Every
    latent site of the guide must be a weight or a non-weight site of the model
    (:mod:`pyro2pfp.site_matching`).  ``example``: the arguments to run the model and guide with
    (:mod:`pyro2pfp.model_args`; default: a zero batch of ``input_shape``).
    """
    if example is not None and input_shape is None:
        input_shape = tuple(example[0].shape[1:])
    check_has_forward(model)
    input_shape = checked_input_shape(model, input_shape)
    model_name = getattr(model, "__name__", type(model).__name__)
    warn_train_mode(model)
    if example is None:
        example = ModelArgs((_example_input(input_shape),))
    pyro_sample_sites = sample_sites(model) if isinstance(model, torch.nn.Module) else {}
    readings = read_posterior(model, guide, example, weight_sites=pyro_sample_sites.values(),
                              check=check_posterior)
    factors = guide_factors(guide, readings)
    lifted = random_module.lifted_submodule(model, list(readings)) \
        if isinstance(model, torch.nn.Module) and not pyro_sample_sites else None
    if lifted is not None:  # the net a pyro.random_module model lifts (or a module holding it) as the model
        model = random_module.lifting_model(lifted[0], model, lifted[1])
    params = _pyro_sample_weights(model, readings, guide)

    wrapper, lifted_paths = _build_wrapper(model, readings, params, example)
    wrapper.traced_args = TracedArgs(example)
    wrapper.probe_head = scale_depends_on_input(model, guide, input_shape, wrapper.traced_args.at)
    with random_module.replaced_random_modules(
            {name: wrapper.lifted[f"m{i}"] for i, name in enumerate(wrapper.lifted_names)}):
        program = _export(wrapper, wrapper.traced_args.inputs(2), input_shape)
        fold_identity_broadcasts(program)
        extra_names = list(wrapper.traced_args.batched_names)
        if not wrapper.probe_head:  # else the program ends at the network output once the head is read
            check_output(program, model, extra_names)
            _check_supported_ops(program, model_name)
        _check_batch_independent(program, wrapper, input_shape)
    head = _end_at_head(program, next(iter(wrapper.head_site))) if wrapper.probe_head else None
    if head is not None:
        check_output(program, model, extra_names)
        _check_supported_ops(program, model_name)

    exported_weights, nonweights = _classify_exported_sites(wrapper, lifted_paths, program, readings, guide)
    unused_samples = _split_pyro_samples(program, pyro_sample_sites, params, readings, guide)
    nonweights |= unused_samples
    model_parameters = [lifted_paths.get(name, name.removeprefix(_WRAPPER_PREFIX))
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
        path = name.removeprefix(_WRAPPER_PREFIX)
        if path not in params and not path.startswith("functional."):
            arr = param.detach().to(torch.float64).numpy().copy()
            params[path] = GaussianParam(arr, np.zeros_like(arr))
    for name, buffer in program.named_buffers():
        path = name.removeprefix(_WRAPPER_PREFIX)
        arr = buffer.detach().to(torch.float64).numpy().copy()
        params[path] = GaussianParam(arr, np.zeros_like(arr))
    return TracedModel(program=program, params=params, input_shape=input_shape,
                       extra_inputs=list(wrapper.traced_args.batched_names),
                       model_name=model_name,
                       nonweight_sites={site: readings[site] for site in sorted(nonweights)},
                       guide_factors=None if factors is None else factors.info(),
                       noise=head if head is not None else find_noise(model, readings, nonweights, input_shape,
                                                                        wrapper.traced_args.at))


def _end_at_head(program: torch.export.ExportedProgram, site: str) -> HeteroscedasticNoise:
    """Read the heteroscedastic head from a program traced with ``probe_head`` (outputs: the model's
    return, the likelihood's loc and scale) and make the program end at the network output they are
    read from (:func:`pyro2pfp.noise.read_head`)."""
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
