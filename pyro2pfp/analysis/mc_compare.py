"""PFP against Monte Carlo, layer by layer: the machinery of :func:`pyro2pfp.diagnose` and of
``convert(..., check=x)`` (:mod:`pyro2pfp.analysis.fidelity`), which needs no conversion of its own.

:func:`compare` draws ``num_samples`` weight sets from the guide (its own sampling API, so the
truth is the guide's posterior, not our reading of it), runs each through the *traced* torch
program (the deterministic copy of the model that :func:`pyro2pfp.convert` exports, with the
sampled weights in place of the means), and records every traced node that a planned layer
computes.  From the samples it estimates each activation's Monte Carlo mean ``m`` and variance
``s²`` (Welford, float64) and compares them with the float64 NumPy reference of the PFP plan
``(μ, v)`` of the same layer:

* mean error ``|μ − m| / max(s, s_floor)`` per element, reported as its median and 90th percentile
  over the layer's elements and the inputs.  ``s_floor`` is a tenth of the layer's median ``s``:
  a saturated unit (a Softplus or sigmoid far in its flat tail) has a sampled ``s`` near 0, and
  dividing by it alone turns a negligible absolute difference into a figure of millions.  With
  ``N`` samples the MC mean itself is off by ``s/√N``, so an exact PFP mean gives a median of
  ``≈ 0.67/√N`` (the median of ``|N(0, 1)|`` over ``√N``): that is the noise floor;
* variance ratio ``v / s²`` per element: median, 10th and 90th percentile (the MC variance has a
  relative sd ``√(2/(N−1))`` for Gaussian activations, e.g. 0.08 at ``N = 300``).

Elements whose MC variance is zero (deterministic so far) are left out of both figures.  The
medians are what :func:`pyro2pfp.analysis.fidelity.check_fidelity` (``convert(..., check=x)``) tests.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyro
import pyro.util
import torch
import torch.fx

from ..backends.reference import execute_all
from ..errors import PFPError
from ..frontend.posterior import call_with_model_args, ready_to_sample
from ..frontend.preserve import preserved
from ..frontend.tracing import _WRAPPER_PREFIX, trace_model
from ..planning.protocols import ConvertedNetwork
from ..runtime.inputs import as_input_array

SD_FLOOR = 0.1  # the mean error's sd floor, as a fraction of the layer's median MC sd
SPLITS = 10  # sample groups for the noise of the median variance ratio (:func:`median_ratio_noise`)


@dataclass(frozen=True)
class LayerFidelity:
    """PFP vs Monte Carlo for one planned layer (all inputs pooled)."""

    name: str
    op: str
    shape: tuple[int, ...]
    mean_error: float  # median over elements of |μ_pfp − μ_mc| / max(sd_mc, sd_floor) (module docstring)
    ratio_median: float  # of var_pfp / var_mc over elements
    ratio_p10: float
    ratio_p90: float
    mean_error_p90: float = float("nan")  # 90th percentile of the same per-element mean error
    # the standard deviation of ln(ratio_median) that sampling noise explains, measured (split samples)
    ratio_noise: float = float("nan")
    # every sample gave the same output (no weight noise reaches the layer): the figures above are NaN,
    # these say how the PFP layer compares -- the largest |μ_pfp − μ_mc| and the largest PFP variance
    deterministic: bool = False
    deterministic_mean_error: float = float("nan")
    deterministic_pfp_var: float = float("nan")

    def describe_deterministic(self) -> str:
        """The table's text for a layer every sample computes the same: ``deterministic (as sampled)``,
        the largest mean difference and, if PFP gives this layer a variance, how large."""
        text = f"deterministic (as sampled): max |PFP − MC| mean {self.deterministic_mean_error:.3g}"
        if self.deterministic_pfp_var > 0:
            text += f"; PFP variance up to {self.deterministic_pfp_var:.3g}, sampling gives 0"
        return text

    # over the elements sampling gives no variance (deterministic so far): max |μ_pfp − μ_mc| over the
    # largest |μ_mc| (the spot check names a deterministic layer whose output departs by this)
    deterministic_error: float = float("nan")


@dataclass
class Diagnosis:
    """The result of :func:`pyro2pfp.diagnose` and :func:`compare`: per-layer rows in plan order and
    output-level figures."""

    layers: list[LayerFidelity]
    num_samples: int
    num_inputs: int
    argmax_agreement: float  # PFP mean-logit argmax == argmax of the MC mean class probabilities
    output: dict[str, np.ndarray] = field(default_factory=dict)  # pfp_mean/var, mc_mean/var (logits)
    #: like with like: the argmax of PFP's mean class probabilities (its logits' Gaussian sampled through the
    #: softmax, :func:`sampled_head_probs`) == that of the MC mean probabilities
    argmax_agreement_probs: float = float("nan")
    # Deterministic parameters of the network that differ from the param store's (store_mismatches).
    mismatches: list[str] = field(default_factory=list)

    def table(self) -> str:
        """The per-layer figures as a fixed-width text table."""
        head = (f"{'layer':<24} {'op':<11} {'shape':<14} {'mean err/sd':>11} {'p90':>7} {'var ratio med':>13} "
                f"{'p10':>7} {'p90':>7}")
        lines = [f"NOTE: {m}" for m in self.mismatches] + [head, "-" * len(head)]
        for r in self.layers:
            if r.deterministic:
                lines.append(f"{r.name:<24} {r.op:<11} {str(r.shape):<14} {r.describe_deterministic()}")
                continue
            lines.append(f"{r.name:<24} {r.op:<11} {str(r.shape):<14} {r.mean_error:11.3f} {r.mean_error_p90:7.3f} "
                         f"{r.ratio_median:13.3f} {r.ratio_p10:7.3f} {r.ratio_p90:7.3f}")
        n = self.num_samples
        lines.append(f"{n} MC samples, {self.num_inputs} inputs; argmax agreement with the MC mean probabilities: "
                     f"PFP's mean probabilities (sampled head) {100 * self.argmax_agreement_probs:.1f} %, "
                     f"PFP's mean logits {100 * self.argmax_agreement:.1f} %; MC noise floor: mean err median ≈ "
                     f"{0.67 / math.sqrt(n):.3f}, ratio sd ≈ {math.sqrt(2 / (n - 1)):.3f}")
        lines.append("mean err: median and p90 over elements of |PFP − MC| / MC sd, the sd floored at a tenth of "
                     "the layer's median sd (saturated units)")
        return "\n".join(lines)

    def plot(self, path: Any) -> None:
        """Write a PNG of the variance ratio (median, p10–p90 band) along the depth (log scale)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        k = np.arange(len(self.layers))
        fig, ax = plt.subplots(figsize=(max(6.0, 0.28 * len(k)), 4.0))
        ax.fill_between(k, [r.ratio_p10 for r in self.layers], [r.ratio_p90 for r in self.layers],
                        alpha=0.3, label="p10–p90")
        ax.plot(k, [r.ratio_median for r in self.layers], "o-", label="median")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set_xticks(k, [r.name for r in self.layers], rotation=80, fontsize=7)
        ax.set_ylabel("PFP / MC variance")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    def __str__(self) -> str:
        return self.table()


class _Capture(torch.fx.Interpreter):
    """Runs the traced program and records the value of every ``wanted`` node *as that node produced
    it*: a copy, since a later in-place op (``out += identity``, ``h += x``, ``relu_``) writes into the
    same tensor (or a view of it), and the layer's recorded output must not be what that op made of it."""

    def __init__(self, gm: torch.fx.GraphModule, wanted: set[str]) -> None:
        super().__init__(gm)
        self.wanted = wanted
        self.values: dict[str, torch.Tensor] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if n.name in self.wanted:
            self.values[n.name] = out.clone() if isinstance(out, torch.Tensor) else out
        return out


class _Welford:
    def __init__(self) -> None:
        self.n = 0
        self.mean: np.ndarray = np.zeros(())
        self.m2: np.ndarray = np.zeros(())

    def add(self, x: np.ndarray) -> None:
        self.n += 1
        if self.n == 1:
            self.mean, self.m2 = x.copy(), np.zeros_like(x)
            return
        delta = x - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (x - self.mean)

    @property
    def var(self) -> np.ndarray:
        return self.m2 / max(self.n - 1, 1)


@contextlib.contextmanager
def restored_rng(state: dict[str, Any]) -> Iterator[None]:
    """Put back the random number generators' ``state`` (``pyro.util.get_rng_state()``) on leaving."""
    try:
        yield
    finally:
        pyro.util.set_rng_state(state)


def _guide_sample(guide: Any, args: tuple) -> dict[str, torch.Tensor]:
    tr = pyro.poutine.trace(lambda: call_with_model_args(guide, args)).get_trace()
    return {name: torch.as_tensor(site["value"]).detach() for name, site in tr.nodes.items()
            if site["type"] == "sample"}


VMAP_CHUNK = 64  # weight samples per vectorised forward pass
SAMPLE_DIM = 10  # the samples' plate: left of every batch dimension a guide's sites have (weights have none)


def _has_variance(fn: Any) -> bool:
    """Whether a site's distribution spreads (a Normal's scale above 0; True when it cannot tell)."""
    try:
        return bool(torch.as_tensor(fn.variance).max() > 0)
    except Exception:  # noqa: BLE001  no closed-form variance
        return True


def weight_samples(guide: Any, args: tuple, shapes: dict[str, tuple[int, ...]], n: int) -> dict[str, torch.Tensor]:
    """``n`` samples of the guide's sites ``shapes`` (``{site: shape}``), as ``{site: (n, *shape) tensor}``.

    Drawn in one run of the guide inside a ``pyro.plate`` of size ``n`` left of every batch dimension its
    sites may have (at dimension -:data:`SAMPLE_DIM`, as ``Predictive(parallel=True)`` puts its plate left of
    the model's); a guide that does not vectorise that way -- it fails, a site comes out with another number
    of entries, or a site with a variance comes out as ``n`` identical copies -- is run ``n`` times instead."""
    try:
        with pyro.plate("_pyro2pfp_samples", n, dim=-SAMPLE_DIM):
            trace = pyro.poutine.trace(lambda: call_with_model_args(guide, args)).get_trace()
        out = {}
        for site, shape in shapes.items():
            node = trace.nodes.get(site)
            if node is None:
                continue
            value = torch.as_tensor(node["value"]).detach()
            if value.numel() != n * math.prod(shape):
                raise ValueError(site)
            value = value.reshape(n, *shape)
            if n > 1 and torch.equal(value, value[:1].expand_as(value)) and _has_variance(node["fn"]):
                raise ValueError(site)  # copies of one sample (not a draw per plate entry)
            out[site] = value
        return out
    except torch.linalg.LinAlgError:
        raise  # a singular covariance: the guide cannot be sampled at all
    except Exception:  # noqa: BLE001  not vectorisable: one run per sample
        draws = [_guide_sample(guide, args) for _ in range(n)]
        return {site: torch.stack([d[site].reshape(shape) for d in draws]) for site, shape in shapes.items()
                if all(site in d for d in draws)}


def _input_chunks(traced: Any, xt: torch.Tensor) -> list[tuple[torch.Tensor, tuple]]:
    """The traced program's inputs for the input batch ``xt``: one batch, or -- for a program traced at a fixed
    batch size (``traced.static_batch``) -- consecutive batches of that size, the last one padded by repeating
    its first row (the caller keeps the first ``len(xt)`` rows of the outputs)."""
    at = traced.traced_args.inputs_at if getattr(traced, "traced_args", None) is not None else (lambda x: (x, ()))
    size = getattr(traced, "static_batch", None)
    if size is None:
        return [at(xt)]
    chunks = []
    for i in range(0, len(xt), size):
        part = xt[i:i + size]
        if len(part) < size:
            part = torch.cat([part, part[:1].expand(size - len(part), *part.shape[1:])])
        chunks.append(at(part))
    return chunks


def _output_samples(gm: torch.fx.GraphModule, out_node: str, by_site: dict[str, torch.Tensor],
                    draws: dict[str, torch.Tensor], inputs: tuple) -> torch.Tensor | None:
    """The node ``out_node`` of ``gm`` for every weight sample in ``draws``, vectorised over the samples
    (``torch.func.vmap``, in chunks); None where the program does not vectorise (then it is run per sample)."""
    try:
        graph = copy.deepcopy(gm.graph)
        node = next(n for n in graph.nodes if n.name == out_node)
        output = next(n for n in graph.nodes if n.op == "output")
        graph.erase_node(output)
        graph.output(node)
        graph.set_codegen(torch.fx.graph.CodeGen())
        sub = torch.fx.GraphModule(gm, graph)
        sub.graph.eliminate_dead_code()
        sub.recompile()
        names = {id(p): name for name, p in sub.named_parameters()}
        keys = {site: names[id(param)] for site, param in by_site.items() if site in draws and id(param) in names}

        def run(*values: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(sub, dict(zip(keys.values(), values, strict=True)),
                                              (inputs[0], *inputs[1]))

        batched = torch.func.vmap(run)
        stacked = [draws[site] for site in keys]
        n = stacked[0].shape[0] if stacked else 0
        chunks = [batched(*[t[i:i + VMAP_CHUNK] for t in stacked]) for i in range(0, n, VMAP_CHUNK)]
        return torch.cat(chunks) if chunks else None
    except Exception:  # noqa: BLE001  an op without a batching rule: run per sample
        return None


def store_mismatches(net: ConvertedNetwork) -> list[str]:
    """What of ``net``'s deterministic parameters differs from the param store's values now: ``["layer fc1's
    weight differs from the param store's 'module$$$fc1.weight' (max |difference| 0.41)", ...]`` (parameters
    read from the store: :attr:`pyro2pfp.planning.graph.GaussianParam.store`)."""
    store = pyro.get_param_store()
    out = []
    for layer in net.layer_graph.layers:
        for role, param in layer.params.items():
            if param.store is None or param.store not in store:
                continue
            stored = store[param.store].detach().to(torch.float64).cpu().numpy()
            if stored.shape != param.mean.shape:
                out.append(f"layer {layer.name}'s {role} has shape {param.mean.shape}, the param store's "
                           f"'{param.store}' {stored.shape}")
            elif not np.array_equal(stored, param.mean):
                out.append(f"layer {layer.name}'s {role} differs from the param store's '{param.store}' (max "
                           f"|difference| {float(np.max(np.abs(stored - param.mean))):.3g})")
    return out


def model_and_guide(model: Any, guide: Any) -> tuple[Any, Any]:
    """A TyXe ``VariationalBNN`` (alone, or with its ``guide`` or ``net_guide``) stands for its ``net`` and
    ``net_guide``, as in :func:`pyro2pfp.convert`: the wrapper itself also holds the guides and the
    likelihood, which are not part of the network (and need not survive a deep copy)."""
    if hasattr(model, "net") and hasattr(model, "net_guide"):
        if guide is None or guide is model.net_guide or guide == getattr(model, "guide", None):
            return model.net, model.net_guide
    return model, guide


def sampled_head_probs(mean: np.ndarray, var: np.ndarray, num_samples: int = 1000, seed: int = 0) -> np.ndarray:
    """PFP's mean class probabilities: the logits' Gaussian ``N(mean, var)`` (independent classes) sampled
    ``num_samples`` times through the softmax (as :func:`pyro2pfp.runtime.uncertainty.uncertainty` does) -- what is
    compared with the sampled network's mean probabilities, like with like."""
    z = np.random.default_rng(seed).standard_normal((num_samples, *mean.shape))
    logits = mean[None] + np.sqrt(np.maximum(var, 0.0))[None] * z
    logits -= logits.max(axis=-1, keepdims=True)
    p = np.exp(logits)
    return (p / p.sum(axis=-1, keepdims=True)).mean(axis=0)


def random_elements(mc_mean: np.ndarray, mc_var: np.ndarray) -> np.ndarray:
    """The elements whose sampled variance is not zero up to rounding (the ones a ratio is taken of)."""
    return mc_var > 1e-12 * (mc_mean**2 + 1e-12)


def layer_fidelity(name: str, op: str, pfp_mean: np.ndarray, pfp_var: np.ndarray, mc_mean: np.ndarray,
                   mc_var: np.ndarray) -> LayerFidelity:
    """The :class:`LayerFidelity` of one layer from PFP and MC moments of the same shape."""
    keep = random_elements(mc_mean, mc_var)
    fixed = ~keep & ~random_elements(pfp_mean, pfp_var)  # deterministic in both (not a unit no sample woke)
    # measured against the layer's size, its largest sampled mean or sd: a fixed element's own mean may be 0
    size = max(float(np.max(np.abs(mc_mean), initial=0.0)), float(np.sqrt(np.max(mc_var, initial=0.0))))
    det = float(np.max(np.abs(pfp_mean[fixed] - mc_mean[fixed])) / (size + 1e-30)) if fixed.any() else float("nan")
    if not keep.any():
        nan = float("nan")
        return LayerFidelity(name, op, tuple(pfp_mean.shape[1:]), nan, nan, nan, nan, nan, deterministic=True,
                             deterministic_mean_error=float(np.max(np.abs(pfp_mean - mc_mean), initial=0.0)),
                             deterministic_pfp_var=float(np.max(pfp_var, initial=0.0)), deterministic_error=det)
    sd = np.sqrt(mc_var[keep])
    # A saturated unit's sampled sd is ~0: measure its mean error against a tenth of the layer's median sd.
    floor = SD_FLOOR * float(np.median(sd))
    err = np.abs(pfp_mean[keep] - mc_mean[keep]) / np.maximum(sd, floor)
    err_med, err_p90 = np.percentile(err, [50, 90])
    ratio = pfp_var[keep] / mc_var[keep]
    p10, med, p90 = np.percentile(ratio, [10, 50, 90])
    return LayerFidelity(name, op, tuple(pfp_mean.shape[1:]), float(err_med), float(med), float(p10),
                         float(p90), float(err_p90), deterministic_error=det)


def median_ratio_noise(pfp_var: np.ndarray, group_vars: list[np.ndarray], keep: np.ndarray) -> float:
    """The standard deviation of ``ln`` of the median variance ratio over all ``n`` samples that sampling
    noise explains, measured: the samples were split into ``G`` groups (:data:`SPLITS`, by sample index)
    and each group's median ratio ``PFP / MC_group`` computed over the same elements; their spread in
    ``ln``, divided by ``√G``, is the noise of the median from all samples.  It is measured rather than
    derived because every element is driven by the same weight samples: the elements' errors are
    correlated, so the median's noise lies anywhere between the per-element ``√(2/(n−1))`` (fully
    correlated) and that divided by the square root of the element count (independent)."""
    if len(group_vars) < 2 or not keep.any():
        return float("nan")
    logs = []
    for gv in group_vars:
        ok = keep & (gv > 0)
        if not ok.any():
            return float("nan")
        logs.append(float(np.log(np.median(pfp_var[ok] / gv[ok]))))
    return float(np.std(logs, ddof=1) / np.sqrt(len(logs)))


def compare(net: ConvertedNetwork, model: Any, guide: Any, x: Any, *, num_samples: int, seed: int = 0,
            per_layer: bool = True, execute: Any = None, traced: Any = None, args: Any = None,
            samples: list | None = None, calibration: float = 1.0) -> Diagnosis:
    """:class:`Diagnosis` of ``net`` (converted from ``model``, ``guide``) on the inputs ``x``: the work of
    :func:`pyro2pfp.diagnose` once the network is converted (see there for the arguments).  Leaves the
    random number generators as it found them.

    ``traced``: the :class:`~pyro2pfp.frontend.tracing.TracedModel` ``net`` was built from (``convert`` passes it: the
    model is then not traced again); ``args``: the model arguments to sample the guide with (default: the
    first input); ``samples``: a list that receives the output's samples (arrays of the output's shape);
    ``calibration``: sample the posterior with every weight's deviation from its mean scaled by
    ``√calibration`` (its variance times ``calibration``, as a calibrated plan takes it; default: the guide's)."""
    if num_samples < 2:
        raise PFPError(f"diagnose needs num_samples >= 2, got {num_samples}")
    model, guide = model_and_guide(model, guide)
    with restored_rng(pyro.util.get_rng_state()):  # the caller's random streams are not disturbed
        return _compare(net, model, guide, x, num_samples, seed, per_layer, execute, traced, args, samples,
                        calibration)


def _compare(net: ConvertedNetwork, model: Any, guide: Any, x: Any, num_samples: int, seed: int, per_layer: bool,
             execute: Any, traced: Any, args: Any, samples: list | None, calibration: float) -> Diagnosis:
    if net.input_variance:
        raise PFPError("diagnose supports networks without input variance only")
    xs = as_input_array(x, net.input_shape, dtype=np.float64)
    xt = torch.as_tensor(xs, dtype=torch.float32)
    if traced is None:
        with preserved(model, guide):
            traced = trace_model(model, guide, net.input_shape)
    ready_to_sample(model, guide, args if args is not None else (xt[:2],))  # it is sampled below
    if args is None:
        args = (xt[:1],)
    mismatches = store_mismatches(net)
    gm = traced.program.module()
    params = dict(gm.named_parameters())
    by_site = {p.site: params[path] if path in params else params[_WRAPPER_PREFIX + path]
               for path, p in traced.params.items() if p.site is not None}
    means = {site: param.detach().clone() for site, param in by_site.items()}  # restored at the end
    scale = math.sqrt(calibration)
    chunks = _input_chunks(traced, xt)
    origins = net.layer_graph.origins
    planned = [layer for layer in net.plan.layers if layer.name in origins
               and (per_layer or layer.name == net.plan.output)]
    wanted = {origins[layer.name] for layer in planned}
    out_node = origins.get(net.plan.output)
    stats = {node: _Welford() for node in wanted}
    splits = SPLITS if num_samples >= 5 * SPLITS else 0
    groups = {node: [_Welford() for _ in range(splits)] for node in wanted}
    probs = _Welford()
    pyro.set_rng_seed(seed)
    with torch.no_grad(), pyro.validation_enabled(False):
        draws = weight_samples(guide, args, {site: tuple(p.shape) for site, p in by_site.items()}, num_samples)
        if scale != 1.0:  # the posterior with its variances times calibration
            draws = {site: means[site] + scale * (value - means[site]) for site, value in draws.items()}
        fast = None
        if not per_layer and out_node:
            parts = [_output_samples(gm, out_node, by_site, draws, inputs) for inputs in chunks]
            done = [p for p in parts if p is not None]
            fast = torch.cat(done, 1)[:, :len(xs)] if len(done) == len(parts) else None
        for k in range(num_samples):
            sampled: dict[Any, torch.Tensor]
            if fast is not None:
                sampled = {out_node: fast[k]}
            else:
                for site, param in by_site.items():
                    if site in draws:
                        param.data.copy_(draws[site][k])
                captured = []
                for inputs in chunks:
                    cap = _Capture(gm, wanted)
                    cap.run(inputs[0], *inputs[1])
                    captured.append(cap.values)
                sampled = {node: torch.cat([c[node] for c in captured])[:len(xs)] for node in captured[0]}
            arrays = {node: value.double().numpy() for node, value in sampled.items()}
            for node, array in arrays.items():
                stats[node].add(array)
                if splits:
                    groups[node][k % splits].add(array)
            if out_node is not None:
                logits = arrays[out_node]
                e = np.exp(logits - logits.max(-1, keepdims=True))  # softmax in NumPy: tiny arrays, no threads
                probs.add(e / e.sum(-1, keepdims=True))
                if samples is not None:
                    samples.append(logits.copy())
    for site, param in by_site.items():
        param.data.copy_(means[site])
    values = (execute or execute_all)(net.plan, xs)
    rows = []
    for layer in planned:
        act, st = values[layer.name], stats[origins[layer.name]]
        mc_mean, mc_var = st.mean, st.var
        mean, var = act.mean.reshape(mc_mean.shape), act.variance().reshape(mc_mean.shape)
        row = layer_fidelity(layer.name, layer.op, mean, var, mc_mean, mc_var)
        noise = median_ratio_noise(var, [g.var for g in groups[origins[layer.name]]], random_elements(mc_mean, mc_var))
        rows.append(dataclasses.replace(row, ratio_noise=noise))
    out = values[net.plan.output]
    agreement = float("nan")
    output: dict[str, np.ndarray] = {"pfp_mean": out.mean, "pfp_var": out.variance()}
    agreement_probs = float("nan")
    if out_node is not None:
        agreement = float(np.mean(out.mean.argmax(-1) == probs.mean.argmax(-1)))
        pfp_prob = sampled_head_probs(out.mean, out.variance())
        agreement_probs = float(np.mean(pfp_prob.argmax(-1) == probs.mean.argmax(-1)))
        output.update(mc_mean=stats[out_node].mean, mc_var=stats[out_node].var, mc_prob=probs.mean, pfp_prob=pfp_prob)
    return Diagnosis(rows, num_samples, len(xs), agreement, output, agreement_probs, mismatches)
