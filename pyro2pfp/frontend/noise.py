"""Regression: the likelihood's noise, so a converted network can give the predictive variance.

For a model whose likelihood is ``Normal(f(x), sigma)`` the predictive distribution of ``obs`` has
(law of total variance, with the weights and ``sigma`` independent under a mean-field posterior)

    E[obs]   = E[f(x)]                        (PFP's mean)
    Var[obs] = Var[f(x)] + E[sigma²]          (epistemic, from the weights: PFP's variance;
                                                aleatoric: the noise)

``sigma`` may be a latent site (``sigma ~ Uniform(0, 10)``, ``HalfNormal``, ``LogNormal``, a
``log_sigma`` site used as ``exp(log_sigma)``, …), a ``PyroParam`` or a constant.  It is found by
running the model once eagerly with every latent site at its posterior mean and reading the
likelihood's ``scale``; the site it depends on is found by perturbing each non-weight site.
``E[sigma²]`` is then exact for a point estimate or a constant, and computed by Gauss–Hermite
quadrature (``NODES`` = 64 nodes, exact for polynomials of degree < 128 in the latent Normal) over
the guide's Normal of the site in unconstrained space otherwise — e.g. ``E[exp(2z)]`` of a LogNormal
to ~1e-12 relative.  A noise scale that depends on several sites is not supported yet (``noise`` is
then a :class:`NoNoiseModel` with the reason).

**Heteroscedastic heads** (:class:`HeteroscedasticNoise`): a scale that depends on the input, read
like the mean from the network output ``S`` (``loc = S[..., i]``, ``scale = g(S[..., j])``, ``g`` an
elementwise link).  Tracing exports the model once more returning the likelihood's ``loc`` and
``scale`` (:func:`read_head` walks the graph back from both to ``S``), and the PFP network ends at
``S``.  Then (law of total variance, no independence needed: ``E[Var(obs | w)] = E[σ(x, w)²]``)

    E[obs]   = E[S_i]                  Var[obs] = Var[S_i] + E[g(S_j)²]

with ``E[g(S_j)²]`` integrated over PFP's Gaussian ``N(μ_j, v_j)`` of the scale column
(:func:`expected_square`: closed forms for affine and ``exp``-then-affine links, Gauss–Hermite
quadrature otherwise).  Exact when ``S_j`` is Gaussian (a linear head with a deterministic input);
behind a hidden layer ``S_j`` is a sum of products, so the Gaussian is an approximation.

**TyXe** (:func:`tyxe_noise`): the likelihood object of a ``VariationalBNN`` (outside ``bnn.net``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyro
import torch
from pyro import poutine
from pyro.poutine.messenger import Messenger
from pyro.poutine.subsample_messenger import _Subsample

from ..errors import InputShapeError, brief
from .posterior import SiteReading, call_with_model_args, read_posterior, unwrap_independent

NODES = 64


@dataclass
class NoiseModel:
    """A Normal likelihood's noise: ``expected_variance`` = E[sigma²] per output (network output shape
    without the batch), from site ``site`` (None: a parameter or constant); ``how`` says how."""

    likelihood_site: str
    site: str | None
    expected_variance: np.ndarray
    how: str


@dataclass
class NoNoiseModel:
    """Why a model has no (supported) regression noise: ``reason``."""

    reason: str


class _AtValues(Messenger):
    """Latent sites take the given values; the likelihood (any other sample site) is recorded."""

    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.values = values
        self.likelihoods: list[tuple[str, Any]] = []

    def _pyro_sample(self, msg: Any) -> None:
        if isinstance(msg["fn"], _Subsample):
            return
        if msg["name"] in self.values and not msg["is_observed"]:
            msg["value"] = self.values[msg["name"]]
        else:
            self.likelihoods.append((msg["name"], msg["fn"]))
            if msg["value"] is None:
                msg["value"] = msg["fn"].mean if hasattr(msg["fn"], "mean") else torch.zeros(())
        msg["done"] = True
        msg["stop"] = True


def _value(reading: SiteReading) -> torch.Tensor:
    if reading.mean is not None:
        return torch.as_tensor(reading.mean, dtype=torch.float32)
    assert reading.latent is not None
    loc, _, transform = reading.latent
    return transform(torch.as_tensor(loc, dtype=torch.float32))


ArgsFor = Callable[[torch.Tensor], tuple]
"""The model's arguments for an input batch ``x`` (``convert``'s example arguments at that batch)."""


def _args(x: torch.Tensor, args_for: ArgsFor | None) -> tuple:
    return args_for(x) if args_for is not None else (x,)


def _likelihood_scale(model: Any, values: dict[str, torch.Tensor], x: torch.Tensor,
                      args_for: ArgsFor | None = None) -> tuple[str, Any]:
    """(likelihood site, its scale tensor or None) of one eager run with the sites at ``values``."""
    capture = _AtValues(values)
    with torch.no_grad(), poutine.block(), pyro.validation_enabled(False), capture:
        call_with_model_args(model, _args(x, args_for))
    if len(capture.likelihoods) != 1:
        return "", None
    name, fn = capture.likelihoods[0]
    fn = unwrap_independent(fn)
    return name, fn.scale.detach().to(torch.float64) if isinstance(fn, torch.distributions.Normal) else None


def _quadrature(reading: SiteReading, scale_at: Any) -> np.ndarray:
    """E[scale(v)²] for the site ``v`` ~ its posterior, elementwise (mean-field)."""
    if reading.kind == "point" or reading.latent is None:
        return scale_at(_value(reading)) ** 2
    loc, sd, transform = reading.latent
    nodes, weights = np.polynomial.hermite.hermgauss(NODES)
    total = 0.0
    for t, w in zip(nodes, weights, strict=True):
        z = torch.as_tensor(loc + np.sqrt(2.0) * sd * t, dtype=torch.float64)
        total = total + w / np.sqrt(np.pi) * scale_at(transform(z).to(torch.float32)) ** 2
    return np.asarray(total)


def find_noise(model: Any, readings: dict[str, SiteReading], nonweight_sites: set[str],
               input_shape: tuple[int, ...], args_for: ArgsFor | None = None) -> NoiseModel | NoNoiseModel:
    """The model's regression noise, or why there is none (see the module docstring)."""
    x = torch.randn((3, *input_shape), generator=torch.Generator().manual_seed(0))
    values = {site: _value(r) for site, r in readings.items() if r.mean is not None or r.latent is not None}
    try:
        name, scale = _likelihood_scale(model, values, x, args_for)
    except Exception as exc:  # the model's own error: no noise model, not a failed conversion
        return NoNoiseModel(f"running the model eagerly failed: {brief(exc)}")
    if scale is None:
        return NoNoiseModel("the likelihood is not a single Normal(mean, scale) site (classification?)")
    rows = scale.reshape(x.shape[0], -1) if scale.dim() and scale.shape[0] == x.shape[0] else None
    if rows is not None and not torch.allclose(rows, rows[:1].expand_as(rows)):
        return NoNoiseModel("the noise scale depends on the input (a heteroscedastic head): not supported yet")
    per_output = rows[0] if rows is not None else scale.reshape(-1)
    depends = []
    for site in sorted(nonweight_sites & set(values)):
        moved = dict(values, **{site: values[site] * 1.5 + 0.1})
        _, other = _likelihood_scale(model, moved, x, args_for)
        if other is None or other.shape != scale.shape or not torch.equal(other, scale):
            depends.append(site)
    if not depends:
        return NoiseModel(name, None, (per_output ** 2).numpy(), "a parameter or constant: exact")
    if len(depends) > 1:
        return NoNoiseModel(f"the noise scale depends on several sites {depends}: not supported yet")
    site = depends[0]

    def scale_at(value: torch.Tensor) -> np.ndarray:
        _, s = _likelihood_scale(model, dict(values, **{site: value}), x, args_for)
        assert s is not None
        return (s.reshape(x.shape[0], -1)[0] if s.dim() and s.shape[0] == x.shape[0] else s.reshape(-1)).numpy()

    reading = readings[site]
    how = "exact (point estimate)" if reading.kind == "point" or reading.latent is None else \
        f"Gauss-Hermite quadrature, {NODES} nodes, over the guide's Normal of '{site}'"
    return NoiseModel(name, site, _quadrature(reading, scale_at), how)


# ------------------------------------------------------------------------------ heteroscedastic heads
# A head whose likelihood is ``Normal(loc, scale)`` with both read from the network output ``S``:
# ``loc`` = an index of ``S`` (``out[..., 0]``, ``out[..., :k]``, ``chunk``/``unbind``/``split``),
# ``scale`` = a link (``exp``, ``softplus``, affine steps, …) of another index of ``S``.  The PFP
# network ends at ``S``; the head is recorded as plain data (flat column indices and link steps).

_INDEX_OPS = {"aten.select.int", "aten.slice.Tensor", "aten.squeeze.dim", "aten.squeeze.dims",
              "aten.squeeze.default", "aten.unsqueeze.default", "aten.view.default", "aten.reshape.default",
              "aten._unsafe_view.default", "aten.unbind.int", "aten.split.Tensor", "aten.split_with_sizes.default",
              "aten.chunk.default", "aten.narrow.default", "aten.clone.default", "aten.contiguous.default",
              "aten.alias.default", "aten.expand.default", "aten.flatten.using_ints", "aten.unflatten.int",
              "aten.detach.default", "<built-in function getitem>"}
# Elementwise links of one tensor and scalar constants: ``name -> (numpy function of (h, *constants))``.
_LINKS: dict[str, Any] = {
    "aten.exp.default": lambda h: np.exp(h),
    "aten.softplus.default": lambda h, beta=1.0, threshold=20.0: np.where(
        beta * h > threshold, h, np.logaddexp(0.0, beta * h) / beta),
    "aten.sigmoid.default": lambda h: 0.5 * (1.0 + np.tanh(0.5 * h)),
    "aten.abs.default": lambda h: np.abs(h),
    "aten.neg.default": lambda h: -h,
    "aten.add.Tensor": lambda h, c, alpha=1.0: h + alpha * c,
    "aten.sub.Tensor": lambda h, c, alpha=1.0: h - alpha * c,
    "aten.rsub.Scalar": lambda h, c, alpha=1.0: c - alpha * h,
    "aten.mul.Tensor": lambda h, c: h * c,
    "aten.div.Tensor": lambda h, c: h / c,
    "aten.pow.Tensor_Scalar": lambda h, p: np.power(h, p),
    "aten.square.default": lambda h: h * h,
    "aten.sqrt.default": lambda h: np.sqrt(np.maximum(h, 0.0)),
    "aten.clamp_min.default": lambda h, lo: np.maximum(h, lo),
    "aten.clamp.default": lambda h, lo=None, hi=None: np.clip(h, lo, hi),
}
_AFFINE = {"aten.add.Tensor", "aten.sub.Tensor", "aten.rsub.Scalar", "aten.mul.Tensor", "aten.div.Tensor",
           "aten.neg.default"}
HEAD_NODES = 64  # Gauss-Hermite nodes for E[g(h)²] when g has no closed form (softplus, sigmoid, …)


@dataclass(frozen=True)
class LinkStep:
    """One elementwise step of the scale's link: ``op`` (an ``aten`` name of :data:`_LINKS`) with its
    scalar ``constants`` (positional, after the tensor)."""

    op: str
    constants: tuple[float, ...] = ()

    def __call__(self, h: np.ndarray) -> np.ndarray:
        return np.asarray(_LINKS[self.op](h, *self.constants), dtype=np.float64)

    def __str__(self) -> str:
        name = self.op.removeprefix("aten.").split(".")[0]
        return f"{name}({', '.join(['h', *map(repr, self.constants)])})"


def _affine(step: LinkStep) -> tuple[float, float]:
    """``(a, b)`` with ``step(h) = a·h + b`` for an affine step."""
    b = float(step(np.zeros(())))
    return float(step(np.ones(()))) - b, b


def _rule(steps: tuple[LinkStep, ...]) -> str:
    """How :func:`expected_square` integrates ``g``: ``affine``, ``exp`` (closed forms) or ``quadrature``."""
    nonlinear = [i for i, s in enumerate(steps) if s.op not in _AFFINE]
    if not nonlinear:
        return "affine"
    if len(nonlinear) == 1 and steps[nonlinear[0]].op == "aten.exp.default":
        return "exp"
    return "quadrature"


def expected_square(steps: tuple[LinkStep, ...], mu: np.ndarray, var: np.ndarray) -> np.ndarray:
    """``E[g(h)²]`` for ``h ~ N(mu, var)`` elementwise, ``g`` = the composition of ``steps``.

    Affine steps before the first nonlinearity are folded into the Gaussian (``a·h + b ~
    N(aμ + b, a²v)``).  Closed forms (exact): no nonlinearity, ``E[h'²] = μ'² + v'``; ``exp`` followed
    by affine steps only, ``g = p·e^{h'} + q``: ``E[g²] = p² e^{2μ'+2v'} + 2pq e^{μ'+v'/2} + q²``
    (the LogNormal moments ``E[e^{kh'}] = e^{kμ'+k²v'/2}``).  Otherwise Gauss–Hermite quadrature with
    :data:`HEAD_NODES` fixed nodes over ``N(μ', v')`` (softplus, sigmoid, clamps: smooth or bounded
    growth, so the rule converges fast; exact at ``v = 0``).
    """
    mu, var = np.asarray(mu, dtype=np.float64), np.maximum(np.asarray(var, dtype=np.float64), 0.0)
    rule, rest = _rule(steps), list(steps)
    while rest and rest[0].op in _AFFINE:
        a, b = _affine(rest.pop(0))
        mu, var = a * mu + b, a * a * var
    if rule == "affine":
        return mu * mu + var
    if rule == "exp":
        p, q = 1.0, 0.0
        for step in rest[1:]:
            a, b = _affine(step)
            p, q = a * p, a * q + b
        with np.errstate(over="ignore"):
            return p * p * np.exp(2.0 * mu + 2.0 * var) + 2.0 * p * q * np.exp(mu + 0.5 * var) + q * q
    nodes, weights = np.polynomial.hermite.hermgauss(HEAD_NODES)
    sd = np.sqrt(var)
    total = np.zeros(np.broadcast(mu, sd).shape)
    for t, w in zip(nodes, weights, strict=True):
        g = mu + np.sqrt(2.0) * sd * t
        for step in rest:
            g = step(g)
        total = total + w / np.sqrt(np.pi) * g * g
    return total


@dataclass
class HeteroscedasticNoise:
    """A Normal likelihood whose mean and scale are both read from the network's output ``S``
    (shape ``(batch, *output_shape)``): ``loc = S.flat[mean_index]``, ``scale = g(S.flat[scale_index])``
    with ``g`` the composition of ``link``; ``mean_index``/``scale_index`` are int arrays of the
    likelihood's shape without the batch, indices into ``S`` flattened per sample."""

    likelihood_site: str
    output_shape: tuple[int, ...]
    mean_index: np.ndarray
    scale_index: np.ndarray
    link: tuple[LinkStep, ...]
    how: str

    @property
    def link_name(self) -> str:
        return " ∘ ".join(str(s) for s in reversed(self.link)) or "identity"

    def predictive(self, mean: np.ndarray, var: np.ndarray) -> dict[str, np.ndarray]:
        """``{"mean", "epistemic", "aleatoric", "total"}`` of the observation from the network's output
        moments ``(mean, var)``: the mean column's moments, ``E[g(h)²]`` of the scale column
        (:func:`expected_square`, ``h`` ~ PFP's Gaussian of that column) and their sum."""
        mean, var = np.asarray(mean, dtype=np.float64), np.asarray(var, dtype=np.float64)
        if mean.shape[1:] != self.output_shape or var.shape != mean.shape:
            raise InputShapeError(f"the network's output has shape {self.output_shape} per sample; got mean "
                                  f"{mean.shape} and var {var.shape}")
        flat_m, flat_v = mean.reshape(len(mean), -1), var.reshape(len(var), -1)
        shape = (len(mean), *self.mean_index.shape)
        loc = flat_m[:, self.mean_index.reshape(-1)].reshape(shape)
        epistemic = flat_v[:, self.mean_index.reshape(-1)].reshape(shape)
        s = self.scale_index.reshape(-1)
        aleatoric = expected_square(self.link, flat_m[:, s], flat_v[:, s]).reshape(len(mean), *self.scale_index.shape)
        aleatoric = np.broadcast_to(aleatoric, shape).copy()
        return {"mean": loc, "epistemic": epistemic, "aleatoric": aleatoric, "total": epistemic + aleatoric}


def scale_depends_on_input(model: Any, guide: Any, input_shape: tuple[int, ...],
                           args_for: ArgsFor | None = None) -> bool:
    """Whether the model's Normal likelihood has a scale that changes with the input: one eager run
    with the latent sites at one sample of the guide (not at the means: an untrained net's weights
    may all be 0, which makes every output constant)."""
    x = torch.randn((3, *input_shape), generator=torch.Generator().manual_seed(0))
    try:
        with torch.random.fork_rng(), torch.no_grad(), poutine.block(), pyro.validation_enabled(False):
            torch.manual_seed(0)
            trace = poutine.trace(lambda: call_with_model_args(guide, _args(x, args_for))).get_trace()
        values = {name: site["value"].detach() for name, site in trace.nodes.items()
                  if site["type"] == "sample" and not site["is_observed"] and isinstance(site["value"], torch.Tensor)}
        _, scale = _likelihood_scale(model, values, x, args_for)
    except Exception:  # the model's or guide's own error: decided (and reported) later by find_noise
        return False
    if scale is None or not scale.dim() or scale.shape[0] != x.shape[0]:
        return False
    rows = scale.reshape(x.shape[0], -1)
    return not torch.allclose(rows, rows[:1].expand_as(rows))


def _tensor_input(node: Any) -> Any:
    """The one tensor (fx node) argument of an index/link node, or None."""
    import torch.fx

    tensors = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor | tuple | list)]
    return tensors[0] if len(tensors) == 1 else None


def _chain(node: Any, allow_links: bool) -> tuple[Any, list[Any]]:
    """Walk back from ``node`` through index (and link) ops: ``(source node, [chain nodes, source first])``."""
    chain = []
    def walkable(op: str) -> bool:
        return op in _INDEX_OPS or (allow_links and op in _LINKS)

    while node.op == "call_function" and walkable(str(node.target)):
        src = _tensor_input(node)
        if src is None:
            break
        chain.append(node)
        node = src
    return node, chain[::-1]


def _evaluate_index(source: Any, chain: list[Any]) -> np.ndarray:
    """Which elements of ``source`` (flat per sample) the chain's end holds: the index ops run on
    ``arange`` (batch 1); links are skipped (elementwise: they commute with indexing)."""
    import torch.fx

    shape = tuple(int(d) for d in source.meta["val"].shape[1:])
    env: dict[Any, Any] = {source: torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(1, *shape)}

    def arg(a: Any) -> Any:
        if a in env:
            return env[a]
        val = a.meta.get("val")
        if isinstance(val, torch.SymInt):
            return 1  # the batch size
        raise ValueError(f"{a.name} is not a constant")

    for node in chain:
        if str(node.target) in _LINKS:
            env[node] = env[_tensor_input(node)]
            continue
        args = torch.fx.node.map_arg(node.args, arg)
        kwargs = torch.fx.node.map_arg(node.kwargs, arg)
        env[node] = node.target(*args, **kwargs)
    out = env[chain[-1]] if chain else env[source]
    if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.shape[0] != 1:
        raise ValueError("the indexing does not keep the batch dimension first")
    return out[0].to(torch.int64).numpy()


def _where(node: Any) -> str:
    """``'fc2' (aten.linear)``: the module path and op of a traced node, for messages."""
    stack = node.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0].removeprefix("L['self'].").removeprefix("model.") if stack else ""
    op = str(node.target).removeprefix("aten.").split(".")[0] if node.op == "call_function" else node.name
    return f"'{path}' ({op})" if path and path != "model" else f"'{node.name}' ({op})"


def _link_steps(chain: list[Any]) -> tuple[LinkStep, ...]:
    steps = []
    for node in chain:
        op = str(node.target)
        if op not in _LINKS:
            continue
        tensor = _tensor_input(node)
        if node.args[0] is not tensor and op not in ("aten.rsub.Scalar",):
            if op in ("aten.add.Tensor", "aten.mul.Tensor"):  # c + h, c * h: commutative
                constants = (node.args[0], *node.args[2:])
            else:
                raise ValueError(f"{op} with the tensor as its second operand")
        else:
            constants = tuple(node.args[1:])
        if "alpha" in node.kwargs:
            constants = (*constants, node.kwargs["alpha"])
        if any(isinstance(c, torch.fx.Node) or not isinstance(c, int | float | type(None)) for c in constants):
            raise ValueError(f"{op} with a non-constant operand {constants}")
        steps.append(LinkStep(op, tuple(constants)))
    return tuple(steps)


def read_head(graph: Any, loc: Any, scale: Any, likelihood_site: str) -> tuple[Any, HeteroscedasticNoise]:
    """``(network output node S, head)`` of a heteroscedastic Normal likelihood whose ``loc`` and
    ``scale`` are the fx nodes given; raises ``ValueError`` saying why when the head cannot be read."""
    import torch.fx  # noqa: F401

    mean_src, mean_chain = _chain(loc, allow_links=False)
    scale_src, scale_chain = _chain(scale, allow_links=True)
    if mean_src is not scale_src:
        raise ValueError(f"the likelihood's loc comes from {_where(mean_src)} and its scale from {_where(scale_src)} "
                         "(two output heads — join them, torch.cat([mean, scale], -1), and read the columns of "
                         "that, or give the network one output layer with both columns, e.g. nn.Linear(hidden, 2) "
                         "— or an operation other than indexing and an elementwise link "
                         f"({', '.join(sorted(k.removeprefix('aten.').split('.')[0] for k in _LINKS))}) "
                         "between them)")
    mean_index = _evaluate_index(mean_src, mean_chain)
    scale_index = _evaluate_index(scale_src, scale_chain)
    link = _link_steps(scale_chain)
    if not scale_chain or (not link and np.array_equal(mean_index, scale_index)):
        raise ValueError("the scale is the network output itself")
    shape = tuple(int(d) for d in mean_src.meta["val"].shape[1:])
    try:
        np.broadcast_shapes(mean_index.shape, scale_index.shape)
    except ValueError as exc:
        raise ValueError(f"the mean {mean_index.shape} and the scale {scale_index.shape} do not broadcast") from exc
    how = {"exp": "exact (closed form: LogNormal moments)", "affine": "exact (closed form)",
           "quadrature": f"Gauss-Hermite quadrature, {HEAD_NODES} nodes"}[_rule(link)]
    return mean_src, HeteroscedasticNoise(likelihood_site, shape, mean_index, scale_index, link,
                                          f"E[scale²] over PFP's Gaussian of the scale column: {how}")


def tyxe_noise(bnn: Any, input_shape: tuple[int, ...],
               output_shape: tuple[int, ...]) -> NoiseModel | HeteroscedasticNoise | NoNoiseModel:
    """The noise of a TyXe ``VariationalBNN``'s likelihood (``bnn.likelihood``; TyXe 0.0.2).

    ``HomoskedasticGaussian(n, scale=…)``: a fixed scale (number, tensor, parameter) is exact; a scale
    or precision with a prior (a ``PyroSample`` of the likelihood, guided by ``bnn.likelihood_guide``)
    gives ``E[scale²]`` over that guide's posterior by quadrature (:func:`find_noise` on ``bnn.model``).
    ``HeteroskedasticGaussian``: TyXe splits the network output in half along the last axis, means
    first, then the scales (``softplus`` unless ``positive_scale``): a :class:`HeteroscedasticNoise`.
    """
    likelihood: Any = getattr(bnn, "likelihood", None)
    kind = type(likelihood).__name__
    site = getattr(likelihood, "data_name", "data")
    if kind == "HeteroskedasticGaussian":
        if not output_shape or output_shape[-1] % 2:
            return NoNoiseModel(f"TyXe's HeteroskedasticGaussian needs an even last output size, got {output_shape}")
        index = np.arange(int(np.prod(output_shape))).reshape(output_shape)
        half = output_shape[-1] // 2
        link = () if likelihood.positive_scale else (LinkStep("aten.softplus.default", (1.0, 20.0)),)
        return HeteroscedasticNoise(site, tuple(output_shape), index[..., :half], index[..., half:], link,
                                    "TyXe HeteroskedasticGaussian (means, then scales, along the last axis): "
                                    + ("identity scale: exact" if not link else
                                       f"softplus scale: Gauss-Hermite quadrature, {HEAD_NODES} nodes"))
    if kind != "HomoskedasticGaussian":
        return NoNoiseModel(f"the TyXe likelihood is {kind}, not a Gaussian (classification?)")

    readings: dict[str, SiteReading] = {}
    guide = getattr(bnn, "likelihood_guide", None)
    if guide is not None and getattr(guide, "__name__", "") != "_empty_guide":
        x = torch.zeros((2, *input_shape))
        readings = read_posterior(bnn.model, guide, (x,), check=False)
    # The network's weights are sampled (from the prior) but hidden: only the likelihood is recorded.
    model = poutine.block(bnn.model, hide_fn=lambda msg: msg["type"] == "sample" and msg["name"] != site
                          and msg["name"] not in readings)
    return find_noise(model, readings, set(readings), input_shape)
