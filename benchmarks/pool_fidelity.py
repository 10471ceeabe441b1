"""Max-pooling fidelity: PFP after every max pool and at the logits against Monte Carlo over the guide,
with the correlated max (``convert(..., max_pool="correlated")``, the default) and the independent one
(``"independent"``, the paper's rule), and the shared-factor plan
(``correlation="shared-factor"``), on CNNs trained the way users train them:

* ``lenet``: the main job's LeNet-5 (``examples/mnist_pfp.py``: ``AutoNormal`` with
  ``init_to_uniform(radius=0.1)``, SVI with KL annealing, lr 1e-2, ``--epochs`` epochs on 4,000 MNIST
  digits), saved, loaded into a fresh model and guide and converted from the store;
* ``wide-cnn``: a user-written CNN (``nn.Conv2d`` 5×5 → LeakyReLU(0.1) → MaxPool2d(3, 2, 1) → conv 5×5 →
  LeakyReLU → MaxPool2d(2) → Linear → LeakyReLU → Linear, made Bayesian with ``PyroSample`` priors) with a
  wide posterior: ``AutoNormal(init_scale=0.2)``, one epoch;
* ``vgg-cnn``: the same with two 3×3 convs before each pool (conv → conv → pool: the pool's conv has a
  random input whose neighbouring elements are correlated, which mean-field PFP does not carry).

The ``compact-factor`` plan (:mod:`pyro2pfp.correlation.compact`): its multiply-adds are the mean-field plan's
plus :func:`~pyro2pfp.correlation.compact.compact_macs`.  ``auto`` is the default (the plan ``convert`` picks; the
table names it); its cost is compared with ``correlated`` (the mean-field plan with correlated pools, the default
before ``auto`` picked the compact plan for conv → pool → dense nets): multiply-adds, and with ``--latency`` the
compiled latency at batch 1 and 10 measured in the same run (target ≤ 1.3x each).

For each: :func:`pyro2pfp.diagnose` (``--samples`` guide samples, ``--inputs`` held-out digits) per
layer, then a HOLDS/SHORT line per target: after every max pool mean error ≤ 0.1 MC sd, variance ratio
median in [0.9, 1.1] and p10 ≥ 0.8; at the logits median in [0.9, 1.1], p10–p90 within [0.75, 1.33],
mean error ≤ 0.1 sd, argmax agreement ≥ 97 % measured like with like: the argmax of PFP's mean class
probabilities (its logits' Gaussian sampled through the softmax) against that of the sampled mean
probabilities (the argmax of PFP's mean logits is shown beside it).  ``--latency``: compiled batch-1 and
batch-10 latency (median of repeated calls) and the multiply-adds of the linear maps per input, correlated
against independent.

    PYTHONPATH=. python benchmarks/pool_fidelity.py [--nets lenet,wide-cnn] [--samples 1000] [--inputs 64]
                                                   [--epochs 10] [--latency] [--store-dir DIR] [--rules R1,R2]
                                                   [--markdown docs/generated/pool-fidelity.md]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import pyro
import torch
from fidelity import latency_ms  # benchmarks/fidelity.py, beside this script
from markdown_report import add_markdown_argument, write_markdown
from pyro.infer.autoguide import init_to_uniform
from pyro.nn import PyroModule, PyroSample
from torch import nn

import pyro2pfp
from pyro2pfp_experiments.datasets import load_mnist
from pyro2pfp_experiments.zoo import BayesianLeNet5, make_guide, train_svi

#: the plans compared: label -> convert() keywords (the two max-pool rules of mean-field plans, and the
#: shared-factor plan, whose max pools fold the correlated max with the scheme's own covariances)
RULES = {"independent": {"max_pool": "independent", "correlation": "mean-field"},
         "correlated": {"max_pool": "correlated", "correlation": "mean-field"},
         "shared-factor": {"correlation": "shared-factor"},
         "compact-factor": {"correlation": "compact-factor"},
         "auto": {"correlation": "auto"}}


class _Classifier(nn.Module):
    def __init__(self, features: nn.Module, flat: int) -> None:
        super().__init__()
        self.features = features
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(flat, 64), nn.LeakyReLU(0.1), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.head(self.features(x))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", pyro.distributions.Categorical(logits=logits), obs=y)
        return logits


def wide_cnn() -> nn.Module:
    """conv 5×5 → LeakyReLU → MaxPool2d(3, 2, 1) → conv 5×5 → LeakyReLU → MaxPool2d(2) → dense head."""
    return _Classifier(nn.Sequential(
        nn.Conv2d(1, 8, 5, padding=2), nn.LeakyReLU(0.1), nn.MaxPool2d(3, 2, 1),
        nn.Conv2d(8, 16, 5), nn.LeakyReLU(0.1), nn.MaxPool2d(2)), 16 * 5 * 5)


def vgg_cnn() -> nn.Module:
    """(conv 3×3 → LeakyReLU) ×2 → MaxPool2d(3, 2, 1) → (conv 3×3 → LeakyReLU) ×2 → MaxPool2d(2) → dense head."""
    return _Classifier(nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.LeakyReLU(0.1), nn.Conv2d(8, 8, 3, padding=1), nn.LeakyReLU(0.1),
        nn.MaxPool2d(3, 2, 1),
        nn.Conv2d(8, 16, 3, padding=1), nn.LeakyReLU(0.1), nn.Conv2d(16, 16, 3), nn.LeakyReLU(0.1),
        nn.MaxPool2d(2)), 16 * 6 * 6)


def bayesian(module: nn.Module, prior_scale: float = 1.0) -> PyroModule:
    """``module`` with ``Normal(0, prior_scale)`` priors on every weight and bias (``to_pyro_module_``)."""
    pyro.nn.module.to_pyro_module_(module)
    for m in module.modules():
        for name, value in list(m.named_parameters(recurse=False)):
            setattr(m, name, PyroSample(pyro.distributions.Normal(0.0, prior_scale).expand(value.shape)
                                        .to_event(value.dim())))
    return module


NETS = {
    # name: (constructor, epochs (None: --epochs), guide)
    "lenet": (BayesianLeNet5, None, lambda m: make_guide(m, init_loc_fn=init_to_uniform(radius=0.1))),
    "wide-cnn": (lambda: bayesian(wide_cnn()), 1, lambda m: make_guide(m, init_scale=0.2)),
    "vgg-cnn": (lambda: bayesian(vgg_cnn()), 1, lambda m: make_guide(m, init_scale=0.2)),
}


def trained(name: str, epochs: int, store: str, reuse: bool = False):
    """Train, save the param store, and return a fresh model and guide loaded from it (as a deployment would).
    ``reuse``: load ``store`` if it exists instead of training (``--store-dir``)."""
    ctor, fixed_epochs, make = NETS[name]
    x_train, y_train, x_test, _ = load_mnist()
    if not (reuse and os.path.exists(store)):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        model = ctor()
        guide = make(model)
        t = time.perf_counter()
        train_svi(model, guide, x_train, y_train, epochs=fixed_epochs or epochs, lr=1e-2)
        print(f"{name}: trained in {time.perf_counter() - t:.0f} s", flush=True)
        pyro.get_param_store().save(store)
    pyro.clear_param_store()
    model = ctor()
    guide = make(model)
    pyro.get_param_store().load(store)
    return model, guide, x_test


def linear_macs(net: pyro2pfp.PFPNetwork) -> int:
    """Multiply-adds of the linear maps per input: compute layers (mean + variance sums), window_cov, and for a
    shared-factor plan the factor work on top (``pyro2pfp.correlation.cost_model``)."""
    total = 0
    for p in net.plan.layers:
        t = p.tensors
        if p.op in ("dense", "conv2d"):
            per_out = t["weight_mean"][0].size
            outs = int(np.prod(p.layer.out_shape))
            total += per_out * outs * (2 if p.in_reprs[0].name == "DETERMINISTIC" else 3)
        elif p.op == "window_cov":
            out = int(np.prod(p.layer.out_shape))
            total += t["weight_mean"][0].size * out * (1 if p.in_reprs[0].name == "DETERMINISTIC" else 2)
    if net.plan.correlation == "compact-factor":
        from pyro2pfp.correlation.compact import compact_macs

        total += compact_macs(net.plan)
    elif net.plan.factors is not None:
        from pyro2pfp.correlation import cost_model

        total += cost_model(net.plan, net.plan.factors).extra_macs
    return total


def latency_us(net: pyro2pfp.PFPNetwork, x: np.ndarray) -> float:
    """Median of 300 calls of the compiled network (``fidelity.latency_ms``), in µs."""
    return 1e3 * latency_ms(net, x, repeats=300)


def verdict(ok: bool) -> str:
    return "HOLDS" if ok else "SHORT"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", default=",".join(NETS))  # lenet,wide-cnn,vgg-cnn
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--inputs", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=10, help="LeNet-5's epochs (the main job's)")
    ap.add_argument("--latency", action="store_true")
    ap.add_argument("--rules", default=",".join(RULES), help="the plans compared (default: all)")
    ap.add_argument("--store-dir", help="keep the trained param stores here (<net>.pt) and reuse them when present")
    add_markdown_argument(ap)
    args = ap.parse_args()
    out: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.nets.split(","):
            model, guide, x_test = trained(name, args.epochs, os.path.join(args.store_dir or tmp, f"{name}.pt"),
                                           reuse=bool(args.store_dir))
            x = x_test[:args.inputs]
            out += [f"### {name}", "", "| rule | layer | op | mean err / sd | var ratio median | p10 | p90 | targets |",
                    "|---|---|---|---|---|---|---|---|"]
            nets = {}
            for rule, options in ((r, RULES[r]) for r in args.rules.split(",")):
                net = pyro2pfp.convert(model, guide, input_shape=(1, 28, 28), **options)
                nets[rule] = net
                if rule == "auto":
                    out.append(f"| auto: {net.plan.summary().splitlines()[-1]} | | | | | | | |")
                d = pyro2pfp.diagnose(model, guide, x, num_samples=args.samples, net=net)
                pools = [r for r in d.layers if r.name.startswith(("max_pool", "features.4", "features.9"))
                         or "pool" in r.name]
                for r in pools:
                    ok = r.mean_error <= 0.1 and 0.9 <= r.ratio_median <= 1.1 and r.ratio_p10 >= 0.8
                    out.append(f"| {rule} | {r.name} | {r.op} | {r.mean_error:.3f} | {r.ratio_median:.3f} | "
                               f"{r.ratio_p10:.3f} | {r.ratio_p90:.3f} | {verdict(ok)} |")
                r = d.layers[-1]
                ok = (0.9 <= r.ratio_median <= 1.1 and r.ratio_p10 >= 0.75 and r.ratio_p90 <= 1.33
                      and r.mean_error <= 0.1 and d.argmax_agreement_probs >= 0.97)
                out.append(f"| {rule} | logits ({r.name}) | {r.op} | {r.mean_error:.3f} | {r.ratio_median:.3f} | "
                           f"{r.ratio_p10:.3f} | {r.ratio_p90:.3f} | {verdict(ok)} "
                           f"(argmax of mean probabilities {100 * d.argmax_agreement_probs:.1f} %, "
                           f"of mean logits {100 * d.argmax_agreement:.1f} %) |")
                print("\n".join(out[-len(pools) - 1:]), flush=True)
            out.append(f"\n{args.samples} guide samples, {len(x)} held-out digits; MC noise: mean err ≈ "
                       f"{0.8 / np.sqrt(args.samples):.3f}, ratio sd ≈ {np.sqrt(2 / (args.samples - 1)):.3f}\n")
            timed = args.latency
            out += ["| rule | multiply-adds / input | batch 1 (µs) | batch 10 (µs) |" if timed
                    else "| rule | multiply-adds / input |", "|---|---|---|---|" if timed else "|---|---|"]
            macs = {rule: linear_macs(net) for rule, net in nets.items()}
            lat: dict[str, list[float]] = {}
            for rule, net in nets.items():
                if not timed:
                    out.append(f"| {rule} | {macs[rule]:,} |")
                else:
                    lat[rule] = [latency_us(net, x_test[:b]) for b in (1, 10)]
                    out.append(f"| {rule} | {macs[rule]:,} | {lat[rule][0]:.0f} | {lat[rule][1]:.0f} |")
            for rule in [r for r in ("shared-factor", "compact-factor", "auto") if r in macs and "correlated" in macs]:
                within = macs[rule] <= 1.3 * macs["correlated"]
                ok = "" if rule == "shared-factor" else f" (target ≤ 1.3x: {verdict(within)})"
                out.append(f"\n{rule} / correlated (the mean-field plan) multiply-adds: "
                           f"{macs[rule] / macs['correlated']:.2f}x{ok}")
                if rule in lat and "correlated" in lat:
                    ratios = [lat[rule][i] / lat["correlated"][i] for i in (0, 1)]
                    target = "" if rule == "shared-factor" else f" (target ≤ 1.3x: {verdict(max(ratios) <= 1.3)})"
                    out.append(f"\n{rule} / correlated latency, batch 1: {ratios[0]:.2f}x, "
                               f"batch 10: {ratios[1]:.2f}x{target}")
            for rule in ("correlated", "shared-factor"):
                if rule in lat and "independent" in lat:
                    out.append(f"\n{rule} / independent at batch 1: {lat[rule][0] / lat['independent'][0]:.2f}x")
            out.append("")
            print("\n".join(out[-len(nets) - 8:]), flush=True)
    text = "\n".join(out)
    print(text)
    write_markdown(args.markdown, [text])


if __name__ == "__main__":
    main()
