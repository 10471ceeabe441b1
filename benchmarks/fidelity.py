"""PFP logit moments against Monte Carlo over the guide's samples, for the paper's nets (MLP
784-100-10, LeNet-5) and CIFAR-style ResNet-8 / ResNet-20 / ResNet-18 (3×32×32; ResNet-18 with ``--nets resnet18``).

Every net has an untrained ``AutoNormal`` posterior with means at He scale and posterior sd 0.02
(:func:`pyro2pfp_experiments.zoo.he_posterior`, means from a NumPy generator so that they cannot
coincide with the guide's first Monte Carlo draw); inputs are standard normal.  Schemes (each
``pyro2pfp.convert(..., correlation=scheme)`` → ``net.reference``, float64): ``mean-field``,
``shared-factor`` and ``auto`` (the default; the row says which it chose), on the same MC samples, each
converted with ``check=False`` (this script is the check: convert's spot check refuses plans that are grossly off).
Per net it prints the median and p10–p90 of the PFP/MC logit-variance ratio (over inputs × classes),
the argmax agreement (PFP's mean class probabilities -- its logits' Gaussian sampled through the softmax --
vs the MC mean probabilities: like with like) and the mean error of the PFP
logit means in MC standard deviations, then a HOLDS/SHORT line per check (median ratio in [0.8, 1.25],
p10–p90 in [0.6, 1.6], argmax ≥ 99 %, mean error ≤ 0.1 sd).

    PYTHONPATH=. python benchmarks/fidelity.py [--samples 300] [--inputs 32] [--nets mlp,lenet,resnet8,resnet20]
                                              [--schemes mean-field,shared-factor] [--latency] [--cost]
                                              [--variants] [--injections regression,rescaled]
                                              [--markdown docs/generated/fidelity.md]

``--variants``: also the shared-factor rule variants that cost less arithmetic (the fidelity side of a
speed trade): ``hermite='none'`` (no second-Hermite factor per ReLU channel: fewer factor columns),
``injection='rescaled'`` (no profile convolution on the input mean) and both, each with the
multiply-adds of its fixed-K plan (what the compiled module computes, :func:`cost_model`) against
mean-field's.  ``--injections``: only the injection variants named (``sf[rescaled]``; ``regression``
is the ``shared-factor`` row).  The compiled and ONNX back ends run every variant too; the rows here
come from the NumPy reference.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
import torch
from markdown_report import add_markdown_argument, table, write_markdown

import pyro2pfp
from pyro2pfp.correlation import cost_model, plan_factors
from pyro2pfp.correlation.factors import FactorPlan, with_aligned_widths
from pyro2pfp.diagnosis import layer_fidelity
from pyro2pfp.network import PFPNetwork
from pyro2pfp.runtime.uncertainty import uncertainty
from pyro2pfp_experiments.zoo import BayesianLeNet5, BayesianMLP, bayesian_resnet, he_posterior

NETS = {
    "mlp": (lambda: BayesianMLP(784, (100,), 10), (784,)),
    "lenet": (lambda: BayesianLeNet5(), (1, 28, 28)),
    "resnet8": (lambda: bayesian_resnet(blocks=1), (3, 32, 32)),
    "resnet20": (lambda: bayesian_resnet(blocks=3), (3, 32, 32)),
    # CIFAR ResNet-18: two blocks per stage, 64-512 channels, BatchNorm (11 M weights)
    "resnet18": (lambda: bayesian_resnet(blocks=2, widths=(64, 128, 256, 512)), (3, 32, 32)),
}


def numpy_ms(fn, repeats: int = 3) -> float:
    """Best of ``repeats`` wall times of ``fn()`` in ms."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * min(times)


def latency_ms(net, x: np.ndarray, repeats: int = 20) -> float:
    exe = net.compile("native")
    exe(x)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        exe(x)
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


VARIANTS = {"sf[hermite=none]": {"hermite": "none"}, "sf[rescaled]": {"injection": "rescaled"},
            "sf[both]": {"hermite": "none", "injection": "rescaled"}}
"""``--variants``: label -> the :func:`plan_factors` options of a cheaper shared-factor rule variant."""


def variant_nets(model, guide, shape: tuple[int, ...]) -> dict[str, PFPNetwork]:
    """The shared-factor net of ``model`` with each of :data:`VARIANTS`' factor plans (reference only);
    empty if the net has no shared-factor plan."""
    base = pyro2pfp.convert(model, guide, input_shape=shape, correlation="auto", check=False)
    if not isinstance(base.plan.factors, FactorPlan):  # mean-field, or the compact factor plan
        return {}
    return {label: PFPNetwork(base.layer_graph,
                              dataclasses.replace(base.plan, factors=plan_factors(base.plan, **options)))
            for label, options in VARIANTS.items()}


def injection_nets(model, guide, shape: tuple[int, ...], injections: list[str]) -> dict[str, PFPNetwork]:
    """``{"sf[<injection>]": net}``: the shared-factor net of ``model`` with each injection rule of
    ``injections`` (``plan_factors(injection=...)``); empty if the net has no shared-factor plan."""
    base = pyro2pfp.convert(model, guide, input_shape=shape, correlation="auto", check=False)
    if not isinstance(base.plan.factors, FactorPlan):  # mean-field, or the compact factor plan
        return {}
    return {f"sf[{injection}]": PFPNetwork(base.layer_graph, dataclasses.replace(
        base.plan, factors=plan_factors(base.plan, injection=injection))) for injection in injections}


def macs_summary(net: PFPNetwork) -> str:
    """The multiply-adds per input of ``net``'s shared-factor plan as the compiled module runs it
    (compaction where the reference compacts, ``K`` in whole SIMD vectors) relative to mean-field PFP's,
    and both counts."""
    fp = net.plan.factors
    cost = cost_model(net.plan, with_aligned_widths(plan_factors(net.plan, fp.hermite, compact=True,
                                                                  injection=fp.injection))
                      if isinstance(fp, FactorPlan) else fp)  # the compact factor plan: as it runs
    total = cost.mean_field_macs + cost.extra_macs
    return (f"x{total / cost.mean_field_macs:.2f} of mean-field's "
            f"({total / 1e6:.1f} M of {cost.mean_field_macs / 1e6:.1f} M)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--inputs", type=int, default=32)
    ap.add_argument("--nets", default="mlp,lenet,resnet8,resnet20")
    ap.add_argument("--schemes", default="mean-field,shared-factor",
                    help="values of convert(..., correlation=) compared with the same MC samples "
                         "(mean-field, shared-factor, auto)")
    ap.add_argument("--latency", action="store_true",
                    help="also time the compiled net of each scheme (batch 1, median of 20)")
    ap.add_argument("--cost", action="store_true",
                    help="also print the scheme's cost model and NumPy float64 times (batch 1, best of 3)")
    ap.add_argument("--variants", action="store_true",
                    help="also the cheaper shared-factor rule variants (hermite='none', injection='rescaled', both) "
                         "with their multiply-adds")
    ap.add_argument("--injections", default="regression",
                    help="shared-factor injection rules compared (regression, rescaled): each but regression (the "
                         "shared-factor row) adds a row sf[<injection>]; with their multiply-adds")
    ap.add_argument("--seed", type=int, default=0)
    add_markdown_argument(ap)
    args = ap.parse_args()
    injections = [i for i in args.injections.split(",") if i != "regression"]
    with_macs = args.variants or bool(injections)
    print(f"{args.samples} MC samples, {args.inputs} inputs")
    head = f"{'net':<9} {'scheme':<16} {'var ratio med':>13} {'p10':>6} {'p90':>6} {'argmax %':>9} {'mean err/sd':>11}"
    rows, verdicts = [head, "-" * len(head)], []
    md_rows: list[list[str]] = []
    for name in args.nets.split(","):
        make, shape = NETS[name]
        torch.manual_seed(args.seed)
        model = make()
        x = torch.randn(args.inputs, *shape)
        guide = he_posterior(model, x, scale=0.02, seed=args.seed)
        nets = {scheme: pyro2pfp.convert(model, guide, input_shape=shape, correlation=scheme, check=False)
                for scheme in args.schemes.split(",")}
        if args.variants:
            nets.update(variant_nets(model, guide, shape))
        if injections:
            nets.update(injection_nets(model, guide, shape, injections))
        d = pyro2pfp.diagnose(model, guide, x, num_samples=args.samples, net=next(iter(nets.values())),
                              seed=args.seed, per_layer=False)
        for scheme, net in nets.items():
            mean, var = net.reference(x.numpy().astype(np.float64))
            label = f"auto={net.plan.correlation}" if scheme == "auto" else scheme
            r = layer_fidelity("logits", "", mean, var, d.output["mc_mean"], d.output["mc_var"])
            # like with like: PFP's mean class probabilities (its logits' Gaussian sampled through the softmax)
            probs = uncertainty(mean, var, num_samples=1000, seed=0)["probs"]
            agree = float(np.mean(probs.argmax(-1) == d.output["mc_prob"].argmax(-1)))
            line = (f"{name:<9} {label:<16} {r.ratio_median:13.3f} {r.ratio_p10:6.3f} {r.ratio_p90:6.3f} "
                    f"{100 * agree:9.1f} {r.mean_error:11.3f}")
            if args.latency:
                line += f"   compiled latency (batch 1) {latency_ms(net, x[:1].numpy()):.3f} ms"
            if args.cost:
                x1 = x[:1].numpy().astype(np.float64)
                line += f"   NumPy float64 reference batch 1: {numpy_ms(lambda: net.reference(x1)):.1f} ms"  # noqa: B023
                if net.plan.factors is not None:
                    fixed = cost_model(net.plan, plan_factors(net.plan, compact=False))
                    line += (f"\n{'':23}reference (QR compaction): {cost_model(net.plan).summary()}"
                             f"\n{'':23}compiled / ONNX (fixed K): {fixed.summary()}")
            if scheme in VARIANTS or (with_macs and scheme == "shared-factor"):
                line += f"   multiply-adds {macs_summary(net)}"
            rows.append(line)
            print(line, flush=True)
            md_rows.append([name, label, f"{r.ratio_median:.3f} ({r.ratio_p10:.2f}–{r.ratio_p90:.2f})",
                            f"{100 * agree:.1f} %", f"{r.mean_error:.3f}"]
                           + ([macs_summary(net) if net.plan.factors is not None else ""] if with_macs else []))
            ok = {"median in [0.8, 1.25]": 0.8 <= r.ratio_median <= 1.25,
                  "p10-p90 in [0.6, 1.6]": r.ratio_p10 >= 0.6 and r.ratio_p90 <= 1.6,
                  "argmax >= 99 %": agree >= 0.99, "mean err <= 0.1 sd": r.mean_error <= 0.1}
            verdicts += [f"{name} {scheme}: {k}: {'HOLDS' if v else 'SHORT'}" for k, v in ok.items()]
    print("\n".join(rows))
    print("\n".join(verdicts))
    columns = ["net", "scheme", "logit variance ratio PFP/MC: median (p10–p90)",
               "argmax agreement (mean probabilities)",
               "mean error / MC sd"] + (["multiply-adds"] if with_macs else [])
    write_markdown(args.markdown, [
        table(columns, md_rows),
        f"{args.samples} Monte Carlo samples of the guide, {args.inputs} standard-normal inputs; untrained "
        "He-scale posteriors with sd 0.02 (`pyro2pfp_experiments.zoo.he_posterior`)."])


if __name__ == "__main__":
    main()
