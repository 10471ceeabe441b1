#!/usr/bin/env python
"""Latency of PFP vs sampling vs the deterministic net: one table per run.

For the paper's MLP (784-100-10) and LeNet-5 (real MNIST test digits) and Bayesian ResNet-8 / ResNet-20
for 3×32×32 inputs (``--nets resnet8 resnet20``: ``to_pyro_module_`` with
``PyroSample`` priors on every conv/linear weight and bias, BatchNorm in eval mode (folded into the
convolutions by ``convert``), residual blocks, global average pooling; an untrained ``AutoNormal``
posterior at He scale, seeded random inputs: latency does not depend on the values), at batch sizes 1,
10 and 100, on the same inputs, the median of repeated calls of:

1. ``pyro.infer.Predictive(model, guide, num_samples=30)`` -- the sampling BNN of the paper;
2. the same 30 samples done the fast way in torch: weights drawn from the guide's Normal
   posteriors (``loc + scale * randn``, included in the time) and one ``torch.func.vmap`` of
   ``functional_call`` over them;
3. the deterministic net (posterior means): torch eager, and TVM -- ``torch.export`` +
   ``from_exported_program``, compiled with the default Relax pipeline (fused but *unscheduled*:
   naive loops, TVM has no CPU schedule rules), and MetaSchedule-tuned with the same trial budget
   as PFP (its static batch);
4. PFP: the float64 NumPy reference (``net.reference``), the compiled module with the default
   schedules (``net.compile()``: any batch), and the compiled module tuned with MetaSchedule for
   that batch (``pyro2pfp.backends.tvm.tuning.tune``; per kernel the faster of tuned and default schedule),
   called as ``net.compile(tune=batch)`` returns it; and the same network exported to ONNX
   (``net.to_onnx()``) run by onnxruntime.

Compiled modules are timed twice: ``e2e`` is the call a user makes (NumPy in, NumPy out:
``exe(x)``, ``vm["main"](x)``), ``VM`` is ``vm.time_evaluator`` (the compiled code alone, C++
timing loop).  Ratios: ``xPred``/``xvmap`` = that baseline's e2e time / this row's e2e time;
``/det`` = this row's time / the tuned deterministic TVM net's time (e2e and VM).

    .venv/bin/python benchmarks/latency.py                # full run (first run tunes: see --trials)
    .venv/bin/python benchmarks/latency.py --quick        # smoke run: MLP, batches 1 and 10, no search
    .venv/bin/python benchmarks/latency.py --markdown docs/generated/latency.md   # also for the docs

Each per-kernel profile (``--no-profile`` skips them) gives every kernel's multiply-adds, its rate
(G multiply-adds/s) and that rate over torch's whole-net rate (the deterministic net's multiply-adds
over its eager time, same batch, same run): ``pyro2pfp.backends.tvm.kernel_work.kernel_multiply_adds`` says how a
kernel's work is counted.

Tuning databases are cached (``~/.cache/pyro2pfp/tuning`` or ``$PYRO2PFP_CACHE``), keyed by the
kernels' structure, target and batch, so only the first run pays for the search.  The networks
are trained briefly (``--epochs``, default 2, lr 1e-2, 2,000 digits) -- latency does not depend on
the weight values; ``--epochs 0`` only initialises the guides.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

NETS = ("mlp", "lenet", "resnet8", "resnet20")
DEFAULT_NETS = ("mlp", "lenet")
RESNET_BLOCKS = {"resnet8": 1, "resnet20": 3}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: MLP only, batches 1 10, no training, no search (--trials 0), few repeats")
    ap.add_argument("--nets", nargs="+", choices=NETS, default=None)
    ap.add_argument("--batches", nargs="+", type=int, default=None)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("TVM_NUM_THREADS", 2)),
                    help="TVM_NUM_THREADS and torch threads (default: $TVM_NUM_THREADS or 2)")
    ap.add_argument("--trials", type=int, default=None,
                    help="MetaSchedule trials per (network, batch), PFP and deterministic alike (default 32)")
    ap.add_argument("--no-tune", action="store_true", help="skip the tuned rows")
    ap.add_argument("--static", action="store_true",
                    help="also a row for the static-shape executables of net.compile(batch_sizes=...)")
    ap.add_argument("--epochs", type=int, default=None, help="SVI epochs before measuring (default 2; 0: init only)")
    ap.add_argument("--samples", type=int, default=30, help="posterior samples of the sampling baselines")
    ap.add_argument("--equal-fidelity-samples", type=int, default=100,
                    help="samples of the second vmap row: the count whose variance estimate has PFP's measured "
                         "variance error (p10-p90 of the ratio to sampling ~ +-20 %%: ~100 samples; default 100)")
    ap.add_argument("--target", default="native", help="TVM target (default: this CPU)")
    ap.add_argument("--work-dir", default=None, help="tuning cache root (default ~/.cache/pyro2pfp/tuning)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds of timing per measurement (default 1.0, quick 0.3)")
    ap.add_argument("--no-profile", action="store_true", help="skip the per-kernel PFP profiles")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--correlation", default="auto", choices=("auto", "shared-factor", "compact-factor", "mean-field"),
                    help="convert(..., correlation=) of the PFP network (default: auto; 'mean-field' gives the "
                         "independent-activation plan of the ResNets)")
    ap.add_argument("--injection", default=None, choices=("regression", "rescaled"),
                    help="with --correlation shared-factor: the factor plan's injection rule "
                         "(convert(..., correlation=pyro2pfp.SharedFactor(injection=...)))")
    ap.add_argument("--max-pool", default="correlated", choices=("correlated", "independent"),
                    help="convert(..., max_pool=) of the PFP network (default: correlated)")
    ap.add_argument("--markdown", metavar="PATH",
                    help="also write the table and profiles (with the command, machine and date) to PATH")
    args = ap.parse_args(argv)
    if args.quick:
        args.nets = args.nets or ["mlp"]
        args.batches = args.batches or [1, 10]
        args.trials = 0 if args.trials is None else args.trials
        args.epochs = 0 if args.epochs is None else args.epochs
        args.budget = args.budget or 0.3
    args.nets = args.nets or list(DEFAULT_NETS)
    args.batches = args.batches or [1, 10, 100]
    args.trials = 32 if args.trials is None else args.trials
    args.epochs = 2 if args.epochs is None else args.epochs
    args.budget = args.budget or 1.0
    return args


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    os.environ["TVM_NUM_THREADS"] = str(ARGS.threads)
# TVM's thread pool pins the main thread to core 0 when it starts (TVM_BIND_THREADS=1, the
# default): every torch / OpenBLAS thread created afterwards shares that core, and torch with 2
# threads becomes ~250x slower (Linear 784x100 at batch 10: 0.03 ms -> 8 ms).  Without pinning the
# TVM kernels are as fast (measured), and the torch baselines are not handicapped.
os.environ.setdefault("TVM_BIND_THREADS", "0")

import numpy as np  # noqa: E402

from pyro2pfp_experiments.validation import median_seconds  # noqa: E402


# ------------------------------------------------------------------------------------------ timing
def median_time(fn, budget: float, min_repeats: int = 5, max_repeats: int = 2000, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` over as many calls as fit in ``budget`` seconds (within bounds)."""
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    repeats = int(min(max_repeats, max(min_repeats, budget / one)))
    return median_seconds(fn, repeats, warmup=0)


def vm_time(vm, args, budget: float) -> float:
    """Median seconds of ``vm["main"](*args)`` measured by ``vm.time_evaluator`` (C++ loop)."""
    import tvm

    dev = tvm.cpu()
    tensors = [tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in args]
    vm["main"](*tensors)
    repeat = 15
    min_ms = max(1, int(1000 * budget / repeat))
    return float(np.median(vm.time_evaluator("main", dev, number=1, repeat=repeat,
                                             min_repeat_ms=min_ms)(*tensors).results))


# ------------------------------------------------------------------------------------------ models
def build_models(name: str):
    import torch
    import torch.nn.functional as F
    from pyro.infer.autoguide import init_to_uniform
    from torch import nn

    from pyro2pfp_experiments.zoo import BayesianLeNet5, BayesianMLP, make_guide

    if name == "mlp":
        model = BayesianMLP(784, (100,), 10)
        guide = make_guide(model)

        class Det(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc1, self.fc2 = nn.Linear(784, 100), nn.Linear(100, 10)

            def forward(self, x):
                return self.fc2(F.relu(self.fc1(x.reshape(x.shape[0], -1))))

        return model, guide, Det(), (784,)
    model = BayesianLeNet5()
    guide = make_guide(model, init_loc_fn=init_to_uniform(radius=0.1))

    class Det(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(1, 6, 5, padding=2)
            self.conv2 = nn.Conv2d(6, 16, 5)
            self.fc1, self.fc2, self.fc3 = nn.Linear(400, 120), nn.Linear(120, 84), nn.Linear(84, 10)

        def forward(self, x):
            x = F.max_pool2d(F.relu(self.conv1(x)), 2)
            x = F.max_pool2d(F.relu(self.conv2(x)), 2)
            x = torch.flatten(x, 1)
            return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))

    return model, guide, Det(), (1, 28, 28)


def build_resnet(name: str):
    """A Bayesian ResNet (``pyro2pfp_experiments.zoo.bayesian_resnet``) and its deterministic twin (a plain
    ``zoo.ResNet`` whose batch norms are copied from the Bayesian one)."""
    import torch
    import torch.nn.functional as F

    from pyro2pfp_experiments.zoo import ResNet, bayesian_resnet

    class DetResNet(ResNet):
        def forward(self, x, y=None):  # the logits, without the likelihood
            out = self.layers(F.relu(self.bn1(self.conv1(x))))
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))

    model = bayesian_resnet(blocks=RESNET_BLOCKS[name])
    det = DetResNet(RESNET_BLOCKS[name], (16, 32, 64), 3, 10).eval()
    det.load_state_dict(model.state_dict(), strict=False)  # batch norm weights and running statistics
    return model, None, det, (3, 32, 32)


def model_with_inputs(name: str, batch: int):
    """``name``'s Bayesian model, an initialised guide (ResNets: ``zoo.he_posterior``), its deterministic twin,
    its input shape and ``batch`` standard-normal inputs (seed 0; the param store cleared first)."""
    import pyro
    import torch

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    rng = np.random.default_rng(0)
    if name.startswith("resnet"):
        from pyro2pfp_experiments.zoo import he_posterior

        model, _, det, shape = build_resnet(name)
        x = rng.standard_normal((batch, *shape)).astype(np.float32)
        guide = he_posterior(model, torch.as_tensor(x[:1]), seed=0)
    else:
        model, guide, det, shape = build_models(name)
        x = rng.standard_normal((batch, *shape)).astype(np.float32)
        guide(torch.as_tensor(x[:1]), torch.zeros(1, dtype=torch.long))  # initialise the guide
    return model, guide, det, shape, x


def posterior(guide, det) -> dict:
    """{site: (loc, scale)} of every parameter of the deterministic twin that is a site of the
    AutoNormal guide (the others, e.g. batch norm weights, are deterministic)."""
    out = {}
    sites = {name for name, _ in guide.prototype_trace.iter_stochastic_nodes()}
    for name, _ in det.named_parameters():
        if name in sites:
            loc, scale = guide._get_loc_and_scale(name)
            out[name] = (loc.detach().clone(), scale.detach().clone())
    return out


# ------------------------------------------------------------------------------------------ rows
class Row:
    def __init__(self, net: str, batch: int, method: str, e2e: float | None, vm: float | None = None,
                 kind: str = "") -> None:
        self.net, self.batch, self.method, self.e2e, self.vm, self.kind = net, batch, method, e2e, vm, kind


def fmt_ms(s: float | None) -> str:
    if s is None:
        return "-"
    ms = s * 1e3
    return f"{ms:.4f}" if ms < 0.1 else f"{ms:.3f}" if ms < 10 else f"{ms:.1f}"


def fmt_ratio(r: float | None) -> str:
    if r is None or not np.isfinite(r):
        return "-"
    return f"{r:.0f}x" if r >= 100 else f"{r:.1f}x" if r >= 10 else f"{r:.2f}x"


# ------------------------------------------------------------------------------------------ main
def det_multiply_adds(net) -> int:
    """Multiply-adds per input of the deterministic net (its conv and dense products)."""
    return sum(int(np.prod(p.layer.out_shape[1:])) * int(p.tensors["weight_mean"].size)
               if p.op == "conv2d" else int(p.tensors["weight_mean"].size)
               for p in net.plan.layers if p.op in ("conv2d", "dense"))


def plan_multiply_adds(net) -> int:
    """Multiply-adds per input of the PFP plan: ``pyro2pfp.correlation.cost_model``'s count (mean-field
    products and, for a shared-factor plan, the scheme's), or -- for a plan the cost model does not
    cover (correlated max pools' ``window_cov``) -- the sum of
    :func:`pyro2pfp.backends.tvm.kernel_work.kernel_multiply_adds` over the kernels at batch 1."""
    from pyro2pfp.backends.tvm.kernel_work import kernel_multiply_adds
    from pyro2pfp.correlation import cost_model, plan_factors
    from pyro2pfp.correlation.factors import CorrelationError

    try:
        cost = cost_model(net.plan, net.plan.factors or plan_factors(net.plan))
    except CorrelationError:  # net.mod has one kernel per layer (none shared yet)
        return int(sum(kernel_multiply_adds(net, 1).values()))
    return cost.mean_field_macs + (cost.extra_macs if net.plan.factors is not None else 0)


def work_line(net) -> str:
    """Multiply-adds per input of the deterministic net, of mean-field PFP and of the plan's scheme (shared-factor
    for a mean-field plan)
    (``pyro2pfp.correlation.cost_model``; conv/dense products, elementwise ops counted per element) --
    the floor under the ``PFP / det`` ratios: PFP cannot be cheaper than its arithmetic at the same
    efficiency per multiply-add."""
    from pyro2pfp.correlation import cost_model, plan_factors

    det = det_multiply_adds(net)
    from pyro2pfp.correlation.factors import CorrelationError

    try:
        cost = cost_model(net.plan, net.plan.factors or plan_factors(net.plan))
    except CorrelationError:  # a mean-field plan with ops of its own (correlated max pools' window_cov)
        return f"multiply-adds per input: deterministic {det / 1e6:.1f} M (plan: {net.plan.correlation})"
    sf = cost.mean_field_macs + cost.extra_macs
    scheme = net.plan.factors.scheme if net.plan.factors is not None else "shared-factor"
    return (f"multiply-adds per input: deterministic {det / 1e6:.1f} M, mean-field PFP "
            f"{cost.mean_field_macs / 1e6:.1f} M ({cost.mean_field_macs / det:.1f}x), {scheme} PFP "
            f"{sf / 1e6:.1f} M ({sf / det:.1f}x; plan: {net.plan.correlation})")


def run_net(name: str, args, tgt, x_all: np.ndarray, y_all: np.ndarray, log
            ) -> tuple[list[Row], list[str], list, dict]:
    """Rows, checks and per-kernel profiles of one net, and its facts: ``compile`` (the seconds of
    ``net.compile(tgt)``, default schedules, any batch), ``recompile`` (the same again: the compiled
    kernels come from the cache) and ``mac_ratio`` (the plan's multiply-adds over the deterministic net's)."""
    import pyro
    import torch
    import tvm
    from torch.func import functional_call, vmap
    from tvm import relax

    import pyro2pfp
    from pyro2pfp.backends.tvm import tuning
    from pyro2pfp.backends.tvm.build import build
    from pyro2pfp.backends.tvm.kernel_work import kernel_multiply_adds
    from pyro2pfp.backends.tvm.runtime import CompiledPFP
    from pyro2pfp.runtime.profiling import profile
    from pyro2pfp_experiments.zoo import train_svi

    pyro.clear_param_store()
    pyro.set_rng_seed(args.seed)
    resnet = name in RESNET_BLOCKS
    if resnet:
        from pyro2pfp_experiments.zoo import he_posterior

        model, _, det, input_shape = build_resnet(name)
        rng = np.random.default_rng(args.seed)
        x_all = rng.standard_normal((max(args.batches) + 2, *input_shape)).astype(np.float32)
        y_all = rng.integers(0, 10, len(x_all))
        guide = he_posterior(model, torch.as_tensor(x_all[:2]), seed=args.seed)
    else:
        model, guide, det, input_shape = build_models(name)
    x_train = x_all[:2000].reshape(-1, *input_shape)
    y_train = y_all[:2000]
    t0 = time.perf_counter()
    if resnet:
        log(f"[{name}] untrained AutoNormal posterior at He scale (sd 0.02), random 3x32x32 inputs")
    elif args.epochs > 0:
        train_svi(model, guide, x_train, y_train, epochs=args.epochs, lr=1e-2, batch_size=100, seed=args.seed)
        log(f"[{name}] trained {args.epochs} epochs on {len(x_train)} digits in {time.perf_counter() - t0:.0f} s")
    else:
        guide(torch.as_tensor(x_train[:2]), torch.as_tensor(y_train[:2]))  # initialise the guide only
        log(f"[{name}] guide initialised, not trained (--epochs 0)")
    post = posterior(guide, det)
    with torch.no_grad():
        for pname, p in det.named_parameters():
            if pname in post:  # a site of the guide (batch norm weights are plain parameters)
                p.copy_(post[pname][0])
    det.eval()

    t0 = time.perf_counter()
    correlation = (pyro2pfp.SharedFactor(injection=args.injection) if args.injection is not None
                   else args.correlation)
    net = pyro2pfp.convert(model, guide, input_shape=input_shape, correlation=correlation,
                           max_pool=args.max_pool)
    t1 = time.perf_counter()
    exe = net.compile(tgt)
    t2 = time.perf_counter()
    compile_s = t2 - t1
    t2 = time.perf_counter()
    net.compile(tgt)
    recompile_s = time.perf_counter() - t2
    static_exe = net.compile(tgt, batch_sizes=args.batches) if args.static else None
    log(f"[{name}] converted in {t1 - t0:.1f} s, compiled (default schedules) in {compile_s:.1f} s "
        f"({sum(p.op != 'reshape' for p in net.plan.layers)} PFP layers, correlation {net.plan.correlation})")
    ort_session = None
    try:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = args.threads
        ort_session = ort.InferenceSession(net.to_onnx().SerializeToString(), opts,
                                           providers=["CPUExecutionProvider"])
    except ImportError:
        log("onnxruntime is not installed: no onnxruntime row")
    except pyro2pfp.ArgumentError as exc:  # e.g. a shared-factor plan
        log(f"no onnxruntime row: {exc}")

    # deterministic net in TVM: torch.export -> Relax (symbolic batch)
    t0 = time.perf_counter()
    from tvm.relax.frontend.torch import from_exported_program

    example = torch.as_tensor(x_train[:2])
    ep = torch.export.export(det, (example,),
                             dynamic_shapes={"x": {0: torch.export.Dim("batch", min=1, max=4096)}})
    with torch.no_grad():
        det_mod = from_exported_program(ep, keep_params_as_input=False, unwrap_unit_return_tuple=True)
    det_vm = relax.VirtualMachine(build(det_mod, tgt, relax.get_default_pipeline(tgt)),
                                  tvm.cpu())
    log(f"[{name}] deterministic net exported and compiled in {time.perf_counter() - t0:.1f} s")

    samples = args.samples
    predictive = pyro.infer.Predictive(model, guide=guide, num_samples=samples, return_sites=("_RETURN",))
    locs = {k: v[0] for k, v in post.items()}
    scales = {k: v[1] for k, v in post.items()}

    def vmap_sampling(xt, n=samples):
        params = {k: locs[k] + scales[k] * torch.randn((n, *locs[k].shape)) for k in locs}
        return vmap(lambda p: functional_call(det, p, (xt,)))(params)

    n_eq = args.equal_fidelity_samples

    rows: list[Row] = []
    checks: list[str] = [f"{name}: PFP compile time (default schedules, any batch) {compile_s:.1f} s",
                         f"{name}: {work_line(net)}"]
    det_macs = det_multiply_adds(net)
    profiles = []
    budget = args.budget
    for batch in args.batches:
        x = np.ascontiguousarray(x_all[-batch:].reshape(batch, *input_shape), dtype=np.float32)
        xt = torch.as_tensor(x)
        label = f"{name} b{batch}"
        with torch.no_grad():
            t_pred = median_time(lambda: predictive(xt), budget * 4, min_repeats=3 if args.quick else 5,
                                 max_repeats=15, warmup=1)
            rows.append(Row(name, batch, f"Pyro Predictive({samples})", t_pred, kind="pred"))
            t_vmap = median_time(lambda: vmap_sampling(xt), budget)
            rows.append(Row(name, batch, f"torch vmap, {samples} sampled weight sets", t_vmap, kind="vmap"))
            if n_eq != samples:
                t_eq = median_time(lambda: vmap_sampling(xt, n_eq), budget)
                rows.append(Row(name, batch, f"torch vmap, {n_eq} sampled weight sets (PFP's variance error)",
                                t_eq, kind="vmap_eq"))
            t_det = median_time(lambda: det(xt), budget)
            rows.append(Row(name, batch, "det torch eager (posterior means)", t_det, kind="det_torch"))
            det_ref = det(xt).numpy()
        out = det_vm["main"](tvm.runtime.tensor(x))
        checks.append(f"{label}: det TVM default vs torch max|diff| {np.abs(out.numpy() - det_ref).max():.1e}")
        rows.append(Row(name, batch, "det TVM, default pipeline (unscheduled)",
                        median_time(lambda: det_vm["main"](tvm.runtime.tensor(x)).numpy(), budget),
                        vm_time(det_vm, [x], budget),
                        kind="det_tvm_default"))
        det_tuned_vm = None
        if not args.no_tune:
            res = tuning.tune(det_mod, tgt, batch=batch, trials=args.trials, work_dir=args.work_dir,
                              progress=log, label=f"tune det {label}")
            det_tuned_vm = relax.VirtualMachine(res.build(), tvm.cpu())
            out = det_tuned_vm["main"](tvm.runtime.tensor(x))
            checks.append(f"{label}: det TVM tuned vs torch max|diff| {np.abs(out.numpy() - det_ref).max():.1e}"
                          f" ({sum(k.choice == 'tuned' for k in res.kernels)}/{len(res.kernels)} kernels tuned)")
            rows.append(Row(name, batch, f"det TVM, MetaSchedule {res.trials} trials",
                            median_time(lambda: det_tuned_vm["main"](tvm.runtime.tensor(x)).numpy(), budget),
                            vm_time(det_tuned_vm, [x], budget), kind="det_tvm_tuned"))

        ref_mean, ref_var = net.reference(x)
        # the reference's row is timed after the compiled ones (inserted here): OpenBLAS's worker threads keep
        # spinning for a while after its matmuls and slow the next ~500 TVM calls (MLP b100: 0.22 -> 0.12 ms VM)
        ref_row = len(rows)

        def rel_err(outs):
            return max(float(np.abs(o - r).max() / (np.abs(r).max() + 1e-30))
                       for o, r in zip(outs, (ref_mean, ref_var)))

        checks.append(f"{label}: PFP default schedules vs reference: rel. error {rel_err(exe(x)):.1e}")
        rows.append(Row(name, batch, "PFP TVM, default schedules (any batch)", median_time(lambda: exe(x), budget),
                        vm_time(exe.vm, [x], budget), kind="pfp_default"))
        best_exe = exe
        if static_exe is not None:
            checks.append(f"{label}: PFP static batch vs reference: rel. error {rel_err(static_exe(x)):.1e}")
            rows.append(Row(name, batch, f"PFP TVM, static batch {batch} (net.compile(batch_sizes=...))",
                            median_time(lambda: static_exe(x), budget),
                            vm_time(static_exe.vm_for_batch(batch), [x], budget), kind="pfp_static"))
            if rows[-1].e2e < rows[-2].e2e:
                best_exe = static_exe
        if not args.no_tune:
            res = tuning.tune(net.mod, tgt, batch=batch, trials=args.trials, plan=net.plan,
                              work_dir=args.work_dir, progress=log, label=f"tune PFP {label}")
            tuned = CompiledPFP(exe.executable, net.input_shape, net.input_variance, exe.target,
                                tuned={batch: res.build()})  # what net.compile(tune=batch) returns
            checks.append(f"{label}: PFP tuned vs reference: rel. error {rel_err(tuned(x)):.1e} "
                          f"({sum(k.choice == 'tuned' for k in res.kernels)}/{len(res.kernels)} kernels tuned)")
            rows.append(Row(name, batch, f"PFP TVM, tuned for batch {batch} ({res.trials} trials)",
                            median_time(lambda: tuned(x), budget), vm_time(tuned.vm_for_batch(batch), [x], budget),
                            kind="pfp_tuned"))
            if rows[-1].e2e < rows[-2].e2e:
                best_exe = tuned
        if ort_session is not None:
            feeds = {"x": x}
            checks.append(f"{label}: PFP onnxruntime vs reference: rel. error "
                          f"{rel_err(ort_session.run(None, feeds)):.1e}")
            rows.append(Row(name, batch, "PFP onnxruntime (same network, ONNX export)",
                            median_time(lambda: ort_session.run(None, feeds), budget), kind="pfp_ort"))
        rows.insert(ref_row, Row(name, batch, "PFP NumPy reference (float64)",
                                 median_time(lambda: net.reference(x), budget), kind="pfp_ref"))
        if not args.no_profile:
            torch_rate = det_macs * batch / t_det * 1e-9
            prof = profile(best_exe, [x], repeats=10 if args.quick else 20, work=kernel_multiply_adds(net, batch),
                           reference_rate=torch_rate, reference_name="torch")
            profiles.append((label, prof, "tuned" if best_exe is not exe else "default schedules"))
    facts = {"compile": compile_s, "recompile": recompile_s,
             "mac_ratio": plan_multiply_adds(net) / det_macs}
    return rows, checks, profiles, facts


def best(rows: list[Row], kinds: tuple[str, ...], attr: str = "e2e") -> Row | None:
    cands = [r for r in rows if r.kind in kinds and getattr(r, attr) is not None]
    return min(cands, key=lambda r: getattr(r, attr)) if cands else None


def render(all_rows: list[Row], header: list[str]) -> tuple[str, dict]:
    cols = ("net", "batch", "method", "e2e ms", "VM ms", "xPred", "xvmap", "/det e2e", "/det VM")
    table = [cols]
    groups: dict[tuple[str, int], list[Row]] = {}
    for r in all_rows:
        groups.setdefault((r.net, r.batch), []).append(r)
    summary = {}
    for (net, batch), rows in groups.items():
        pred = best(rows, ("pred",))
        vmap_row = best(rows, ("vmap",))
        vmap_eq = best(rows, ("vmap_eq",))
        det = best(rows, ("det_tvm_tuned",)) or best(rows, ("det_tvm_default",))
        det_vm = best(rows, ("det_tvm_tuned",), "vm") or best(rows, ("det_tvm_default",), "vm")
        for r in rows:
            table.append((net, str(batch), r.method, fmt_ms(r.e2e), fmt_ms(r.vm),
                          fmt_ratio(pred.e2e / r.e2e) if pred else "-",
                          fmt_ratio(vmap_row.e2e / r.e2e) if vmap_row else "-",
                          fmt_ratio(r.e2e / det.e2e) if det and r.kind.startswith(("pfp", "det")) else "-",
                          fmt_ratio(r.vm / det_vm.vm) if det_vm and r.vm is not None else "-"))
        pfp = best(rows, ("pfp_default", "pfp_static", "pfp_tuned"))
        pfp_vm = best(rows, ("pfp_default", "pfp_static", "pfp_tuned"), "vm")
        ort_row = best(rows, ("pfp_ort",))
        summary[(net, batch)] = dict(
            pred=pred.e2e if pred else None, vmap=vmap_row.e2e if vmap_row else None,
            vmap_eq=vmap_eq.e2e if vmap_eq else None,
            pfp=pfp.e2e if pfp else None, pfp_vm=pfp_vm.vm if pfp_vm else None,
            det=det.e2e if det else None, det_vm=det_vm.vm if det_vm else None,
            det_tuned=best(rows, ("det_tvm_tuned",)) is not None, ort=ort_row.e2e if ort_row else None,
            ref=best(rows, ("pfp_ref",)).e2e if best(rows, ("pfp_ref",)) else None,
            det_torch=best(rows, ("det_torch",)).e2e if best(rows, ("det_torch",)) else None)
    widths = [max(len(str(row[i])) for row in table) for i in range(len(cols))]
    lines = list(header)
    prev = None
    for i, row in enumerate(table):
        if i and prev is not None and (row[0], row[1]) != prev:
            lines.append("")
        prev = (row[0], row[1]) if i else None
        lines.append("  ".join(str(c).ljust(w) if j < 3 else str(c).rjust(w)
                               for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines), summary


TARGETS = [
    # (description, net, batch, kind, threshold); PFP = the faster of default/tuned exe(x)
    ("MLP b1: PFP >= 3000x faster than Predictive(30)", "mlp", 1, "vs_pred", 3000),
    ("MLP b10: PFP >= 1000x faster than Predictive(30)", "mlp", 10, "vs_pred", 1000),
    ("LeNet-5 b10: PFP >= 400x faster than Predictive(30)", "lenet", 10, "vs_pred", 400),
    ("MLP: PFP compiled <= 2.5x deterministic compiled", "mlp", None, "vs_det", 2.5),
    ("LeNet-5: PFP compiled <= 4x deterministic compiled", "lenet", None, "vs_det", 4.0),
    ("PFP compiled faster than the NumPy reference", None, None, "vs_ref", 1.0),
    ("ResNet-8 b1: PFP >= 150x faster than Predictive(30)", "resnet8", 1, "vs_pred", 150),
    ("ResNet-20 b1: PFP >= 150x faster than Predictive(30)", "resnet20", 1, "vs_pred", 150),
    ("ResNet-8 b10: PFP / deterministic torch eager <= the plan's multiply-add ratio", "resnet8", 10,
     "vs_det_torch_macs", 1.0),
    ("ResNet-20 b10: PFP / deterministic torch eager <= the plan's multiply-add ratio", "resnet20", 10,
     "vs_det_torch_macs", 1.0),
    ("b10: every PFP conv kernel >= 0.8x torch's whole-net multiply-adds/s", None, 10, "conv_rate", 0.8),
    ("ResNet-8: PFP >= 20x faster than the vmap sampler at PFP's variance error", "resnet8", None, "vs_vmap_eq", 20),
    ("ResNet-20: PFP >= 20x faster than the vmap sampler at PFP's variance error", "resnet20", None,
     "vs_vmap_eq", 20),
    ("PFP TVM no slower than PFP onnxruntime", None, None, "vs_ort", 1.0),
    ("LeNet-5 compiles (default schedules) in <= 1 s", "lenet", None, "compile", 1.0),
    ("ResNet-20 compiles (default schedules) in <= 5 s", "resnet20", None, "compile", 5.0),
    ("a second compile of the same network (compiled kernels cached) in <= 1 s", None, None, "recompile", 1.0),
]


def conv_rates(profiles: list, batch: int) -> list[tuple[str, str, float]]:
    """(net label, kernel, rate / torch's whole-net rate) of every conv kernel (op ``conv2d`` or a
    shared-factor ``sf_conv*``) in the profiles of batch ``batch``."""
    out = []
    for label, prof, _ in profiles:
        if prof.batch != batch or not prof.reference_rate:
            continue
        for row in prof.kernels:
            if ("conv" in row.op and "window" not in row.op) and row.rate is not None:
                out.append((label, row.name, row.rate / prof.reference_rate))
    return out


def evaluate_targets(summary: dict, facts: dict[str, dict], profiles: list) -> list[str]:
    lines = []
    for desc, net, batch, kind, thr in TARGETS:
        if kind in ("compile", "recompile"):  # one figure per net, not per batch
            nets = [n for n in facts if net in (None, n)]
            if nets:
                ok = all(facts[n][kind] <= thr for n in nets)
                lines.append(f"  [{'HOLDS' if ok else 'SHORT'}] {desc}: "
                             + "; ".join(f"{n}: {facts[n][kind]:.2f} s" for n in nets))
            continue
        if kind == "conv_rate":
            rates = conv_rates(profiles, batch)
            if rates:
                ok = all(r >= thr for _, _, r in rates)
                worst = sorted(rates, key=lambda t: t[2])[:4]
                lines.append(f"  [{'HOLDS' if ok else 'SHORT'}] {desc}: {sum(r >= thr for *_, r in rates)}/"
                             f"{len(rates)} kernels; slowest "
                             + ", ".join(f"{k} ({lb}) {r:.2f}x" for lb, k, r in worst))
            continue
        keys = [k for k in summary if (net is None or k[0] == net) and (batch is None or k[1] == batch)]
        if not keys:
            continue
        parts, ok = [], True
        for key in sorted(keys):
            s = summary[key]
            tag = f"{key[0]} b{key[1]}"
            if kind == "vs_pred":
                if s["pred"] is None or s["pfp"] is None:
                    continue
                r = s["pred"] / s["pfp"]
                rv = s["pred"] / s["pfp_vm"] if s["pfp_vm"] else None
                ok &= r >= thr
                extra = f" (compiled code alone {rv:.0f}x)" if rv else ""
                parts.append(f"{tag}: {r:.0f}x with exe(x)" + extra)
            elif kind == "vs_det":
                if s["det_vm"] is None or s["pfp_vm"] is None:
                    continue
                r_vm = s["pfp_vm"] / s["det_vm"]
                r_e2e = s["pfp"] / s["det"]
                ok &= r_vm <= thr
                parts.append(f"{tag}: {r_vm:.2f}x VM, {r_e2e:.2f}x e2e"
                             + ("" if s["det_tuned"] else " (det untuned!)"))
            elif kind == "vs_det_torch":
                if s["det_torch"] is None or s["pfp"] is None:
                    continue
                r = s["pfp"] / s["det_torch"]
                ok &= r <= thr
                parts.append(f"{tag}: {r:.2f}x e2e")
            elif kind == "vs_det_torch_macs":
                if s["det_torch"] is None or s["pfp"] is None or key[0] not in facts:
                    continue
                r, floor = s["pfp"] / s["det_torch"], facts[key[0]]["mac_ratio"]
                ok &= r <= thr * floor
                parts.append(f"{tag}: {r:.2f}x e2e against the plan's {floor:.2f}x multiply-adds")
            elif kind == "vs_vmap_eq":
                if s.get("vmap_eq") is None or s["pfp"] is None:
                    continue
                r = s["vmap_eq"] / s["pfp"]
                ok &= r >= thr
                parts.append(f"{tag}: {r:.1f}x")
            elif kind == "vs_ort":
                if s["ort"] is None or s["pfp"] is None:
                    continue
                r = s["pfp"] / s["ort"]
                ok &= r <= thr
                parts.append(f"{tag}: {r:.2f}x")
            else:
                if s["ref"] is None or s["pfp"] is None:
                    continue
                r = s["ref"] / s["pfp"]
                ok &= r > thr
                parts.append(f"{tag}: {r:.1f}x")
        if parts:
            lines.append(f"  [{'HOLDS' if ok else 'SHORT'}] {desc}: " + "; ".join(parts))
    return lines


def main(argv=None) -> int:
    args = ARGS if argv is None and ARGS is not None else parse_args(argv)
    import shutil
    import tempfile

    # an empty kernel cache: each net's first compile is a cold one, its second finds the kernels
    kernel_cache = tempfile.mkdtemp(prefix="pyro2pfp-latency-kernels-")
    os.environ["PYRO2PFP_KERNEL_CACHE"] = kernel_cache
    try:
        return _main(args, argv)
    finally:
        shutil.rmtree(kernel_cache, ignore_errors=True)


def _main(args, argv) -> int:
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("TVM_BIND_THREADS", "0")
    t_start = time.perf_counter()
    load0 = os.getloadavg()
    import torch

    torch.set_num_threads(args.threads)
    import tvm

    from pyro2pfp.backends.tvm import tuning
    from pyro2pfp_experiments.datasets import load_mnist

    tgt = tuning.tuning_target(args.target)
    lines_log: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines_log.append(msg)

    x_tr, y_tr, x_te, y_te = load_mnist(n_train=2000, n_test=1000, seed=args.seed)
    x_all = np.concatenate([x_tr, x_te])
    y_all = np.concatenate([y_tr, y_te])
    all_rows, all_checks, all_profiles = [], [], []
    facts: dict[str, dict] = {}
    for name in args.nets:
        rows, checks, profiles, facts[name] = run_net(name, args, tgt, x_all, y_all, log)
        all_rows += rows
        all_checks += checks
        all_profiles += profiles
    load1 = os.getloadavg()
    cache = args.work_dir or str(tuning.default_cache_dir())
    header = [
        "",
        "=" * 100,
        f"pyro2pfp latency benchmark  ({time.strftime('%Y-%m-%d %H:%M')}, {time.perf_counter() - t_start:.0f} s)",
        f"TVM {tvm.__version__}, torch {torch.__version__}; target {tgt}",
        f"threads: TVM {tvm.runtime.num_threads()} (TVM_NUM_THREADS={os.environ.get('TVM_NUM_THREADS')}), "
        f"torch {torch.get_num_threads()}; TVM_BIND_THREADS={os.environ.get('TVM_BIND_THREADS')}; "
        f"CPU cores {os.cpu_count()}",
        f"load average (1/5/15 min): start {load0[0]:.1f}/{load0[1]:.1f}/{load0[2]:.1f}, "
        f"end {load1[0]:.1f}/{load1[1]:.1f}/{load1[2]:.1f}  (a shared machine: expect noise)",
        "weights: "
        + (f"SVI {args.epochs} epochs, lr 1e-2, 2000 digits" if args.epochs else "initialised guide (untrained)")
        + "; inputs: MNIST digits (ResNets: seeded random 3x32x32, He-scale posterior); medians of repeated calls",
        f"tuning: {'off' if args.no_tune else f'MetaSchedule, {args.trials} trials per (net, batch), cache {cache}'}",
        "e2e = user call from NumPy (exe(x); vm['main'](tvm.runtime.tensor(x)).numpy(); the torch or Pyro call); "
        "VM = vm.time_evaluator",
        "xPred, xvmap = baseline e2e / row e2e;  /det = row / deterministic TVM net (MetaSchedule, same trials)",
        "=" * 100,
    ]
    table, summary = render(all_rows, header)
    print(table)
    if max(load0[0], load1[0]) > (os.cpu_count() or 1):
        print("\nWARNING: the machine was busy (load average above the core count). Multithreaded torch and"
              "\nNumPy (OpenMP/OpenBLAS spin barriers) slow down far more than TVM under contention, which"
              "\ninflates every 'x faster than Predictive/vmap' ratio: rerun when idle, or with --threads 1.")
    print("\ntargets (this run; PFP = the faster of default/tuned exe(x), as users call it):")
    target_lines = evaluate_targets(summary, facts, all_profiles)
    for line in target_lines:
        print(line)
    print("\nchecks:")
    for c in all_checks:
        print("  " + c)
    for label, prof, which in all_profiles:
        print()
        print(prof.table(f"per-kernel profile, PFP {which}, {label} (kernels timed alone; "
                         f"(vm overhead) = VM total - kernels)"))
    from markdown_report import write_markdown  # benchmarks/markdown_report.py, beside this script

    write_markdown(args.markdown, ["```text\n" + table + "\n```",
                                   "Targets (this run):\n\n```text\n" + "\n".join(target_lines) + "\n```"]
                   + ["```text\n" + prof.table(f"per-kernel profile, PFP {which}, {label}") + "\n```"
                      for label, prof, which in all_profiles], argv=argv and ["benchmarks/latency.py", *argv])
    bad = [c for c in all_checks if "rel. error" in c and float(c.split("rel. error ")[1].split()[0]) > 1e-3]
    if bad:
        print("\nMISMATCH:\n  " + "\n  ".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
