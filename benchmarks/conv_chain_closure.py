"""Where conv → conv goes wrong at wide posteriors: every layer of a CNN (``pool_fidelity.py``'s ``wide-cnn`` and
``vgg-cnn``: ``_Classifier`` nets, ``features`` then ``head``) taken apart against Monte Carlo over the guide.

For each layer, from ``--samples`` guide samples on ``--inputs`` held-out digits (moments streamed in float64):

* ``PFP``: the variance ratio PFP / Monte Carlo of the whole plan (``pyro2pfp.diagnose``) -- the error accumulated
  so far -- for the mean-field plan with correlated max pools (``correlated``), the default plan (``auto``), the
  shared-factor plan, and the shared-factor plan whose conv rule adds the input factors' correlated variance
  (:mod:`pyro2pfp_experiments.conv_shared_correction`, float64 reference only);
* ``local mean-field`` (conv / dense layers): the layer's mean-field moment rule fed the *sampled* marginal mean and
  variance of its input -- the same rule with exact inputs, so its ratio to Monte Carlo is what dropping the
  input's correlations (between positions and channels, from the earlier layers' shared weight noise) costs at
  this layer alone;
* ``local closure`` (activations): the Gaussian closure of the activation (its exact moments under
  ``N(μ, v)``, ``pfp-math`` eq. for ReLU / LeakyReLU) fed the sampled marginal mean and variance of the
  pre-activation -- its ratio to Monte Carlo is what the Gaussian assumption costs at this layer alone;
* ``local skew-normal closure``: the same with the skew-normal of the sampled mean, variance and skewness in
  place of the Gaussian -- what carrying the pre-activation's third moment would recover;
* ``skew`` / ``ex. kurt``: medians over elements of the sampled pre-activation's skewness and excess kurtosis
  (0 for a Gaussian), which the closure ignores.

Medians over elements with p10-p90, elements with a sampled variance below 1e-8 of the largest excluded.

    PYTHONPATH=. python benchmarks/conv_chain_closure.py [--nets wide-cnn,vgg-cnn] [--samples 500] [--inputs 16]
                                                        [--store-dir DIR] [--markdown docs/generated/conv-chain.md]
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import tempfile

import numpy as np
import pyro
import torch
import torch.nn.functional as F
from markdown_report import add_markdown_argument, write_markdown
from pool_fidelity import trained

import pyro2pfp
from pyro2pfp_experiments.conv_shared_correction import corrected_conv_rule

#: the plans diagnosed: label -> convert's correlation, and whether the experimental corrected conv rule runs
PLANS: dict[str, dict] = {"correlated": {"correlation": "mean-field"}, "auto": {"correlation": "auto"},
                          "shared-factor": {"correlation": "shared-factor"},
                          "shared + conv correction": {"correlation": "shared-factor", "corrected": True}}


def _matches(row, module: torch.nn.Module) -> bool:
    """Whether ``diagnose``'s next row is this module's output (an activation before a max pool has no row of its
    own: the correlated pool reads the pre-activation, and its row is named ``max_pool…``)."""
    kind = type(module).__name__.removeprefix("Pyro")
    pool = row.name.startswith("max_pool")
    return {"Conv2d": row.op == "conv2d", "Linear": row.op == "dense", "MaxPool2d": pool,
            "Flatten": row.op == "reshape", "LeakyReLU": row.op == "leaky_relu" and not pool,
            "ReLU": row.op == "relu" and not pool}.get(kind, False)


def _stats(r: np.ndarray) -> str:
    r = r[np.isfinite(r)]
    return f"{np.median(r):.3f} ({np.percentile(r, 10):.2f}-{np.percentile(r, 90):.2f})"


def sampled_moments(model, guide, x: torch.Tensor, modules: list[torch.nn.Module], samples: int,
                    seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """Per module output: mean, variance (unbiased), skewness, excess kurtosis over ``samples`` guide draws."""
    y = torch.zeros(len(x), dtype=torch.long)  # the guide's prototype traces the observed site
    sums: dict[int, list[torch.Tensor]] = {}
    torch.manual_seed(seed)
    with torch.no_grad():
        for _ in range(samples):
            tr = pyro.poutine.trace(guide).get_trace(x, y)
            draws = {k: v["value"] for k, v in tr.nodes.items() if v["type"] == "sample"}
            outs: list[tuple[int, torch.Tensor]] = []
            hooks = [m.register_forward_hook(lambda mod, inp, out, j=j: outs.append((j, out)))
                     for j, m in enumerate(modules)]
            try:
                pyro.poutine.condition(model, data=draws)(x, y)
            finally:
                for h in hooks:
                    h.remove()
            for j, o in outs:
                t = o.detach().double()
                acc = sums.setdefault(j, [torch.zeros_like(t) for _ in range(4)])
                for p in range(4):
                    acc[p] += t ** (p + 1)
    res = []
    for j in range(len(modules)):
        s1, s2, s3, s4 = (a / samples for a in sums[j])
        var = (s2 - s1 ** 2).clamp_min(0)
        c3 = s3 - 3 * s1 * s2 + 2 * s1 ** 3
        c4 = s4 - 4 * s1 * s3 + 6 * s1 ** 2 * s2 - 3 * s1 ** 4
        sd = var.clamp_min(1e-300).sqrt()
        res.append((s1, var * samples / (samples - 1), c3 / sd ** 3, c4 / var.clamp_min(1e-300) ** 2 - 3))
    return res


def leaky_closure(mean: torch.Tensor, var: torch.Tensor, slope: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance of LeakyReLU(a) for a ~ N(mean, var) (ReLU: slope 0), exact."""
    sd = var.clamp_min(1e-300).sqrt()
    z = mean / sd
    cdf = 0.5 * (1 + torch.erf(z / math.sqrt(2)))
    pdf = torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    e1, e2 = mean * cdf + sd * pdf, (mean ** 2 + var) * cdf + mean * sd * pdf
    f1, f2 = -mean * (1 - cdf) + sd * pdf, (mean ** 2 + var) * (1 - cdf) - mean * sd * pdf
    m = e1 - slope * f1
    return m, e2 + slope ** 2 * f2 - m * m


def skew_normal_closure(mean: torch.Tensor, var: torch.Tensor, skew: torch.Tensor, slope: float,
                        points: int = 801) -> torch.Tensor:
    """Variance of LeakyReLU(a) for ``a`` skew-normal with the given mean, variance and skewness (|skew| clipped
    to 0.99, the family's limit; Azzalini 1985, moments in Azzalini & Capitanio 1999 §2), by quadrature on
    ``points`` nodes of the standardized variable over [-10, 10]."""
    g = skew.clamp(-0.99, 0.99).abs() ** (2 / 3)
    delta = torch.sign(skew) * torch.sqrt(math.pi / 2 * g / (g + ((4 - math.pi) / 2) ** (2 / 3)))
    omega = var.clamp_min(1e-300).sqrt() / torch.sqrt(1 - 2 * delta ** 2 / math.pi)
    loc = mean - omega * delta * math.sqrt(2 / math.pi)
    alpha = delta / torch.sqrt(1 - delta ** 2)
    t = torch.linspace(-10, 10, points, dtype=torch.float64)
    dt = float(t[1] - t[0])
    shape = (-1, 1)
    a = alpha.reshape(shape)
    w = 2 * torch.exp(-0.5 * t * t) / math.sqrt(2 * math.pi) * 0.5 * (1 + torch.erf(a * t / math.sqrt(2))) * dt
    xs = loc.reshape(shape) + omega.reshape(shape) * t
    f = torch.where(xs > 0, xs, slope * xs)
    m1, m2 = (w * f).sum(1), (w * f * f).sum(1)
    return (m2 - m1 * m1).reshape(mean.shape)


def local_mean_field(module: torch.nn.Module, params, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """The mean-field variance rule of a conv / dense layer on the input marginals ``(mean, var)``."""
    wm, wv = (torch.as_tensor(a, dtype=torch.float64) for a in (params["weight"].mean, params["weight"].var))
    bv = torch.as_tensor(params["bias"].var, dtype=torch.float64) if "bias" in params else torch.zeros(len(wm))
    if isinstance(module, torch.nn.Conv2d):
        def op(a, w):
            return F.conv2d(a, w, padding=module.padding)
        bv = bv.reshape(-1, 1, 1)
    else:
        def op(a, w):
            return F.linear(a.flatten(1), w)
    return op(var, wm * wm + wv) + op(mean * mean, wv) + bv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", default="wide-cnn,vgg-cnn")
    ap.add_argument("--samples", type=int, default=500)
    ap.add_argument("--inputs", type=int, default=16)
    ap.add_argument("--store-dir", help="reuse / keep the trained param stores here (<net>.pt)")
    add_markdown_argument(ap)
    args = ap.parse_args()
    out: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.nets.split(","):
            model, guide, x_test = trained(name, 1, os.path.join(args.store_dir or tmp, f"{name}.pt"),
                                           reuse=bool(args.store_dir))
            x = torch.as_tensor(np.asarray(x_test[:args.inputs]), dtype=torch.float32)
            names = ([f"features.{i}" for i in range(len(model.features))]
                     + [f"head.{i}" for i in range(len(model.head))])
            modules = list(model.features) + list(model.head)
            pfp: dict[str, list] = {}
            for rule, options in PLANS.items():
                net = pyro2pfp.convert(model, guide, input_shape=(1, 28, 28), check=False,
                                       correlation=options["correlation"])
                with corrected_conv_rule() if options.get("corrected") else contextlib.nullcontext():
                    d = pyro2pfp.diagnose(model, guide, x.numpy(), num_samples=args.samples, net=net)
                pfp[rule] = list(d.layers)
            graph = net.layer_graph
            mc = sampled_moments(model, guide, x, modules, args.samples)
            out += [f"### {name}", "", "| layer | op | " + " | ".join(f"PFP {r}" for r in PLANS)
                    + " | local mean-field | local closure | local skew-normal closure | skew | ex. kurt |",
                    "|---|---|" + "---|" * (len(PLANS) + 5)]
            prev = (x.double(), torch.zeros_like(x, dtype=torch.float64), torch.zeros_like(x, dtype=torch.float64))
            for n, module, (m, v, skew, kurt) in zip(names, modules, mc):
                keep = v > 1e-8 * v.max()
                local = closure = skewed = sk = ku = ""
                if isinstance(module, torch.nn.Conv2d | torch.nn.Linear):
                    local = _stats((local_mean_field(module, graph.layer(n).params, *prev[:2]) / v)[keep].numpy())
                    sk, ku = (f"{float(t[keep].median()):.2f}" for t in (skew, kurt))
                elif isinstance(module, torch.nn.LeakyReLU | torch.nn.ReLU):
                    slope = getattr(module, "negative_slope", 0.0)
                    closure = _stats((leaky_closure(*prev[:2], slope)[1] / v)[keep].numpy())
                    skewed = _stats((skew_normal_closure(*prev, slope) / v)[keep].numpy())
                cells = []
                for rule in PLANS:
                    row = pfp[rule][0] if pfp[rule] else None
                    take = row is not None and _matches(row, module)
                    if take:
                        pfp[rule].pop(0)
                    cells.append(f"{row.ratio_median:.3f}" if take else "")
                out.append(f"| {n} | {type(module).__name__.removeprefix('Pyro')} | {' | '.join(cells)} | "
                           f"{local} | {closure} | {skewed} | {sk} | {ku} |")
                prev = (m, v, skew)
            out.append(f"\n{args.samples} guide samples, {len(x)} held-out digits; PFP columns: median variance "
                       "ratio of the whole plan; local columns: median (p10-p90) of one rule fed sampled marginals\n")
            print("\n".join(out[-len(names) - 4:]), flush=True)
    text = "\n".join(out)
    print(text)
    write_markdown(args.markdown, [text])


if __name__ == "__main__":
    main()
