"""Per-layer fidelity of PFP against Monte Carlo: where do the propagated moments part from sampling?

:func:`diagnose` draws ``num_samples`` weight sets from the guide (its own sampling API, so the
truth is the guide's posterior, not our reading of it), runs each through the *traced* torch
program (the deterministic copy of the model that :func:`pyro2pfp.convert` exports, with the
sampled weights in place of the means), and records every traced node that a planned layer
computes.  From the samples it estimates each activation's Monte Carlo mean ``m`` and variance
``s²`` (Welford, float64) and compares them with the float64 NumPy reference of the PFP plan
``(μ, v)`` of the same layer:

* mean error ``|μ − m| / s`` (averaged over the layer's elements and the inputs).  With ``N``
  samples the MC mean itself is off by ``s/√N``, so ``≈ 0.8/√N`` is the noise floor;
* variance ratio ``v / s²`` per element: median, 10th and 90th percentile (the MC variance has a
  relative sd ``√(2/(N−1))``, e.g. 0.08 at ``N = 300``).

Elements whose MC variance is zero (deterministic so far) are left out of both figures.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyro
import torch
import torch.fx

from .errors import PFPError
from .posterior import call_with_model_args
from .tracing import _WRAPPER_PREFIX


@dataclass(frozen=True)
class LayerFidelity:
    """PFP vs Monte Carlo for one planned layer (all inputs pooled)."""

    name: str
    op: str
    shape: tuple[int, ...]
    mean_error: float  # mean over elements of |μ_pfp − μ_mc| / sd_mc
    ratio_median: float  # of var_pfp / var_mc over elements
    ratio_p10: float
    ratio_p90: float


@dataclass
class Diagnosis:
    """The result of :func:`diagnose`: per-layer rows in plan order and output-level figures."""

    layers: list[LayerFidelity]
    num_samples: int
    num_inputs: int
    argmax_agreement: float  # PFP mean-logit argmax == argmax of the MC mean class probabilities
    output: dict[str, np.ndarray] = field(default_factory=dict)  # pfp_mean/var, mc_mean/var (logits)

    def table(self) -> str:
        """The per-layer figures as a fixed-width text table."""
        head = f"{'layer':<24} {'op':<11} {'shape':<14} {'mean err/sd':>11} {'var ratio med':>13} {'p10':>7} {'p90':>7}"
        lines = [head, "-" * len(head)]
        for r in self.layers:
            lines.append(f"{r.name:<24} {r.op:<11} {str(r.shape):<14} {r.mean_error:11.3f} "
                         f"{r.ratio_median:13.3f} {r.ratio_p10:7.3f} {r.ratio_p90:7.3f}")
        lines.append(f"{self.num_samples} MC samples, {self.num_inputs} inputs; argmax agreement "
                     f"{100 * self.argmax_agreement:.1f} %; MC noise floor: mean err ≈ "
                     f"{0.8 / math.sqrt(self.num_samples):.3f}, ratio sd ≈ {math.sqrt(2 / (self.num_samples - 1)):.3f}")
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
    def __init__(self, gm: torch.fx.GraphModule, wanted: set[str]) -> None:
        super().__init__(gm)
        self.wanted = wanted
        self.values: dict[str, torch.Tensor] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if n.name in self.wanted:
            self.values[n.name] = out
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


def _guide_sample(guide: Any, example: torch.Tensor) -> dict[str, torch.Tensor]:
    tr = pyro.poutine.trace(lambda *a: call_with_model_args(guide, a)).get_trace(example)
    return {name: torch.as_tensor(site["value"]).detach() for name, site in tr.nodes.items()
            if site["type"] == "sample"}


def layer_fidelity(name: str, op: str, pfp_mean: np.ndarray, pfp_var: np.ndarray, mc_mean: np.ndarray,
                   mc_var: np.ndarray) -> LayerFidelity:
    """The :class:`LayerFidelity` of one layer from PFP and MC moments of the same shape."""
    keep = mc_var > 1e-12 * (mc_mean**2 + 1e-12)
    if not keep.any():
        nan = float("nan")
        return LayerFidelity(name, op, tuple(pfp_mean.shape[1:]), nan, nan, nan, nan)
    sd = np.sqrt(mc_var[keep])
    err = np.abs(pfp_mean[keep] - mc_mean[keep]) / sd
    ratio = pfp_var[keep] / mc_var[keep]
    p10, med, p90 = np.percentile(ratio, [10, 50, 90])
    return LayerFidelity(name, op, tuple(pfp_mean.shape[1:]), float(err.mean()), float(med), float(p10),
                         float(p90))


def diagnose(model: Any, guide: Any, x: Any, *, num_samples: int = 300, input_shape: tuple[int, ...] | None = None,
             calibration: float = 1.0, net: Any = None, seed: int = 0, per_layer: bool = True,
             execute: Any = None, correlation: str = "auto") -> Diagnosis:
    """Compare every planned layer's PFP moments with Monte Carlo over the guide's samples.

    ``x``: a batch of inputs ``(B, *input_shape)``; ``input_shape`` defaults to ``x.shape[1:]``.
    ``net``: an already converted :class:`~pyro2pfp.PFPNetwork` of ``(model, guide)`` (skips conversion;
    its plan is diagnosed, whatever its calibration and correlation scheme; without it the network is
    converted with ``calibration`` and ``correlation``, see :func:`pyro2pfp.convert`).  Layers inserted
    by the planner (representation conversions) and layers that share a traced node with a later one are
    not listed.  See the module docstring for the figures.  ``per_layer=False`` records only the output
    (logits): faster, and the returned ``layers`` then hold the output layer alone.  ``execute(plan, x)
    -> {layer: Activation}`` replaces the NumPy reference (:func:`pyro2pfp.reference.execute_all`, which
    runs the plan's correlation scheme) as the PFP side.
    """
    from .inputs import as_input_array
    from .network import convert
    from .posterior import ready_to_sample
    from .preserve import preserved
    from .reference import execute_all
    from .tracing import trace_model

    if num_samples < 2:
        raise PFPError(f"diagnose needs num_samples >= 2, got {num_samples}")
    if net is None:
        if input_shape is None:
            input_shape = tuple(np.shape(x)[1:])
        net = convert(model, guide, input_shape=input_shape, calibration=calibration, correlation=correlation)
    if net.input_variance:
        raise PFPError("diagnose supports networks without input variance only")
    xs = as_input_array(x, net.input_shape, dtype=np.float64)
    with preserved(model, guide):
        traced = trace_model(model, guide, net.input_shape)
    ready_to_sample(model, guide, (torch.as_tensor(xs[:2], dtype=torch.float32),))  # it is sampled below
    gm = traced.program.module()
    params = dict(gm.named_parameters())
    by_site = {p.site: params[path] if path in params else params[_WRAPPER_PREFIX + path]
               for path, p in traced.params.items() if p.site is not None}
    origins = net.layer_graph.origins
    planned = [layer for layer in net.plan.layers if layer.name in origins
               and (per_layer or layer.name == net.plan.output)]
    wanted = {origins[layer.name] for layer in planned}
    out_node = origins.get(net.plan.output)
    stats = {node: _Welford() for node in wanted}
    probs = _Welford()
    xt = torch.as_tensor(xs, dtype=torch.float32)
    example = xt[:1]
    pyro.set_rng_seed(seed)
    with torch.no_grad(), pyro.validation_enabled(False):
        for _ in range(num_samples):
            for site, value in _guide_sample(guide, example).items():
                param = by_site.get(site)
                if param is not None:
                    param.data.copy_(value.reshape(param.shape))
            cap = _Capture(gm, wanted)
            cap.run(xt)
            for node, value in cap.values.items():
                stats[node].add(value.double().numpy())
            if out_node is not None:
                probs.add(torch.softmax(cap.values[out_node].double(), -1).numpy())
    values = (execute or execute_all)(net.plan, xs)
    rows = []
    for layer in planned:
        act, st = values[layer.name], stats[origins[layer.name]]
        mc_mean, mc_var = st.mean, st.var
        mean, var = act.mean.reshape(mc_mean.shape), act.variance().reshape(mc_mean.shape)
        rows.append(layer_fidelity(layer.name, layer.op, mean, var, mc_mean, mc_var))
    out = values[net.plan.output]
    agreement = float("nan")
    output: dict[str, np.ndarray] = {"pfp_mean": out.mean, "pfp_var": out.variance()}
    if out_node is not None:
        agreement = float(np.mean(out.mean.argmax(-1) == probs.mean.argmax(-1)))
        output.update(mc_mean=stats[out_node].mean, mc_var=stats[out_node].var, mc_prob=probs.mean)
    return Diagnosis(rows, num_samples, len(xs), agreement, output)
