"""What the spot check every ``convert`` runs costs, and what it says, on the paper's nets and the ResNets.

For each net (untrained ``AutoNormal`` posteriors at He scale, posterior sd 0.02: ``zoo.he_posterior``, as in
benchmarks/fidelity.py) it converts ``--repeats`` times with ``check=False`` and with the default spot check,
alternating, and prints the median convert times, the spot check's own time (``net.fidelity.seconds``) and
its share of the default convert; then the spot check's figures (median mean error in MC standard errors,
median variance ratio and the gross bounds).  With ``--mean-field`` the ResNets are also converted with
``correlation='mean-field'``, whose logit variance is a fraction of the sampled one: the spot check must
refuse them (``FidelityError``), which the last column says.

    PYTHONPATH=. python benchmarks/spot_check_cost.py [--nets mlp,lenet,resnet8,resnet20] [--repeats 3]
                                                      [--mean-field] [--markdown docs/generated/spot-check.md]

Timings taken while other work loads the machine are not comparable across runs; the share column
compares times measured in the same run, alternating.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from markdown_report import add_markdown_argument, table, write_markdown

import pyro2pfp
from pyro2pfp_experiments.zoo import BayesianLeNet5, BayesianMLP, bayesian_resnet, he_posterior

NETS = {
    "mlp": (lambda: BayesianMLP(784, (100,), 10), (784,)),
    "lenet": (lambda: BayesianLeNet5(), (1, 28, 28)),
    "resnet8": (lambda: bayesian_resnet(blocks=1), (3, 32, 32)),
    "resnet20": (lambda: bayesian_resnet(blocks=3), (3, 32, 32)),
}


def measure(name: str, repeats: int, mean_field: bool) -> dict:
    build, shape = NETS[name]
    model = build()
    guide = he_posterior(model, torch.randn(2, *shape))
    plain, checked, spot = [], [], []
    net = None
    for _ in range(repeats):
        t = time.perf_counter()
        pyro2pfp.convert(model, guide, input_shape=shape, check=False)
        plain.append(time.perf_counter() - t)
        t = time.perf_counter()
        net = pyro2pfp.convert(model, guide, input_shape=shape)
        checked.append(time.perf_counter() - t)
        spot.append(net.fidelity.seconds)
    assert net is not None
    row = {"net": name, "plan": net.plan.correlation, "plain": statistics.median(plain),
           "checked": statistics.median(checked), "spot": statistics.median(spot), "check": net.fidelity}
    if mean_field and name.startswith("resnet"):
        try:
            mf = pyro2pfp.convert(model, guide, input_shape=shape, correlation="mean-field")
            row["mean_field"] = f"passed (ratio {mf.fidelity.ratio:.2f})"
        except pyro2pfp.FidelityError as exc:
            row["mean_field"] = "FidelityError: " + str(exc).split(": ", 2)[-1].split(". ")[0][:140]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nets", default="mlp,lenet,resnet8,resnet20")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mean-field", action="store_true", help="also convert the ResNets mean-field")
    add_markdown_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows = [measure(name, args.repeats, args.mean_field) for name in args.nets.split(",")]
    cost = table(["net", "plan", "convert, check=False (s)", "convert (s)", "spot check (s)", "share of convert"],
                 [(r["net"], r["plan"], f"{r['plain']:.2f}", f"{r['checked']:.2f}", f"{r['spot']:.2f}",
                   f"{100 * r['spot'] / r['checked']:.1f} %") for r in rows])
    figures = table(["net", "samples × inputs", "mean error (MC se, median)", "variance ratio (median)",
                     "gross bounds", "mean-field plan"],
                    [(r["net"], f"{r['check'].num_samples} × {r['check'].num_inputs}",
                      f"{r['check'].mean_error_se:.2f}", f"{r['check'].ratio:.3f}",
                      f"[{r['check'].ratio_bounds[0]:.2f}, {r['check'].ratio_bounds[1]:.2f}]",
                      r.get("mean_field", "-")) for r in rows])
    print(cost)
    print()
    print(figures)
    if args.markdown:
        write_markdown(args.markdown, [cost, figures])


if __name__ == "__main__":
    main()
