"""The commands of ``pyro2pfp``: one ``cmd_<name>(args) -> exit status`` per sub-command, and the
conversion they share (:func:`convert_from_args`)."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np

import pyro2pfp

from ..errors import PFPError
from ..frontend.loading import build_model_and_guide, load_param_store
from ..runtime import deploy
from ..runtime.remote import Remote, fixed_inputs, upload, validate
from .files import LIBRARY_EXTS, CLIError, _batched, _check_output_path, load_array, load_example, load_predictor


def convert_from_args(args: argparse.Namespace):
    """Builder + param store → PFPNetwork (what convert / inspect / bench share)."""
    import pyro

    pyro.clear_param_store()
    model, guide = build_model_and_guide(args.builder)
    if args.params:
        # convert() takes the guide's parameters from the param store (pyro2pfp.frontend.posterior)
        load_param_store(args.params)
    options: dict[str, Any] = {}
    if getattr(args, "input_variance", False):
        options["input_variance"] = True
    if getattr(args, "head", None):
        options["head"] = args.head
    if getattr(args, "check", None):
        if getattr(args, "no_check", False):
            raise CLIError("--check X.npy and --no-check: give one (--check runs the careful check instead of the "
                           "spot check, --no-check skips both)")
        options["check"] = load_array(args.check, "check input")
    elif getattr(args, "no_check", False):
        options["check"] = False
    if getattr(args, "example", None):
        options["example_args"], options["example_kwargs"] = load_example(args.example)
    correlation: Any = args.correlation
    variants = {k: v for k in ("hermite", "injection") if (v := getattr(args, k, None)) is not None}
    if variants:
        if correlation != "shared-factor":
            raise CLIError(f"--{' --'.join(variants)} choose a variant of the shared-factor scheme: add "
                           "--correlation shared-factor")
        correlation = pyro2pfp.SharedFactor(**variants)
    try:
        net = pyro2pfp.convert(model, guide, input_shape=args.input_shape, calibration=args.calibration,
                               moment_form=args.moment_form, correlation=correlation, **options)
    except PFPError as exc:
        if args.params is None and "never been run" in str(exc):
            raise CLIError(f"{exc} Pass the trained parameters with --params params.pt.") from None
        if args.params is not None and "shape" in str(exc):
            raise CLIError(f"{exc} (the parameters come from '{args.params}': was it saved from a model "
                           "of other sizes?)") from None
        raise
    return model, guide, net


def cmd_convert(args: argparse.Namespace) -> int:
    from ..backends.onnx.builder import to_onnx  # SciPy: `pyro2pfp predict` runs on a board without it

    ext = _check_output_path(args.output, (".so", ".tar", ".onnx"), "the output file")
    tune = None
    if ext != ".onnx":
        deploy.resolve_target(args.target or "llvm")  # fail before the (slow) conversion
        tune = _tune_spec(args)
    t0 = time.perf_counter()
    model, _, net = convert_from_args(args)
    print(f"converted {type(model).__name__}: input shape {net.input_shape}, {len(net.plan.layers)} "
          f"layers, moment form '{net.plan.moment_form}', calibration {net.calibration:g} "
          f"({time.perf_counter() - t0:.1f} s)")
    if args.verbose:
        print(net.summary())
    if net.fidelity is not None and net.fidelity.passed:  # a failed check has warned (stderr)
        print(net.fidelity.message())
    t0 = time.perf_counter()
    if ext == ".onnx":
        if args.target not in (None, "llvm"):
            print(f"note: --target {args.target} is ignored for ONNX output", file=sys.stderr)
        for option, value in (("--batch-sizes", args.batch_sizes), ("--tune", args.tune), ("--remote", args.remote)):
            if value:
                print(f"note: {option} is ignored for ONNX output (dynamic batch)", file=sys.stderr)
        to_onnx(net, args.output, opset=args.opset)
        outputs = "probs, uncertainty" if net.head else "mean, var"
        print(f"wrote {args.output} (ONNX opset {args.opset}; inputs {'x, x_var' if net.input_variance else 'x'}; "
              f"outputs {outputs}) in {time.perf_counter() - t0:.1f} s")
        return 0
    from ..backends.tvm.compile import compile_network  # TVM's compiler: not on a board

    exe = compile_network(net, args.target or "llvm", schedule=not args.no_schedule,
                                 batch_sizes=args.batch_sizes or (), tune=tune)
    extra = {"model": type(model).__name__, "builder": args.builder,
             "params": os.path.basename(args.params) if args.params else None,
             "calibration": net.calibration, "moment_form": net.plan.moment_form, "plan": net.summary()}
    exe.export_library(args.output, metadata=extra)
    arch = deploy.target_arch(exe.target)
    files = [args.output, *(deploy.batch_library_path(args.output, b) for b in sorted(exe.tuned))]
    where = "" if exe.runnable else f" (for {arch}: copy all {len(files) + 1} files to the device)"
    print(f"wrote {', '.join(files)} and {deploy.sidecar_path(args.output)}{where} in "
          f"{time.perf_counter() - t0:.1f} s")
    return 0


def _tune_spec(args: argparse.Namespace) -> dict[str, Any] | None:
    """``convert --tune B,... [--trials N] [--remote ...]``: the ``tune=`` of ``net.compile`` (None without --tune)."""
    if args.remote and not args.tune:
        raise CLIError("--remote measures tuning candidates on a board: give --tune BATCH too")
    if not args.tune:
        return None
    spec: dict[str, Any] = {"batch": list(args.tune)}
    if args.trials is not None:  # else the library's default (pyro2pfp.backends.tvm.tuning.DEFAULT_TRIALS)
        spec["trials"] = args.trials
    if args.remote:
        spec["remote"] = Remote.parse(args.remote, session_timeout=args.remote_timeout)
    return spec


def cmd_inspect(args: argparse.Namespace) -> int:
    target = args.builder
    ext = os.path.splitext(target)[1].lower()
    if ext in LIBRARY_EXTS or target.endswith(deploy.SIDECAR_SUFFIX):
        info = deploy.read_metadata(target)
        print(f"{info['library']}: compiled pyro2pfp network for {info.get('target_arch')}")
        print(f"  inputs {', '.join(info['inputs'])}: float32 (batch, {', '.join(map(str, info['input_shape']))})")
        print(f"  outputs {', '.join(info['outputs'])}")
        for key in ("model", "builder", "params", "calibration", "moment_form", "pyro2pfp_version",
                    "tvm_version"):
            if info.get(key) is not None:
                print(f"  {key}: {info[key]}")
        target = info.get("target") or {}
        if isinstance(target, dict):
            keys = ("mtriple", "mcpu", "mattr", "num-cores")
            parts = [str(target.get("kind", "?"))] + [
                f"{k} {','.join(target[k]) if isinstance(target[k], list) else target[k]}"
                for k in keys if target.get(k)]
            target = ", ".join(parts)
        print(f"  target: {target}")
        batch_files = info.get(deploy.BATCH_KEY) or {}
        if isinstance(batch_files, dict) and batch_files:
            listed = ", ".join(f"{b} ({entry.get('library') if isinstance(entry, dict) else '?'})"
                               for b, entry in batch_files.items())
            print(f"  batch-specialised executables: {listed}")
        if info.get("plan"):
            print(info["plan"])
        return 0
    if ext == ".onnx":
        import onnx

        from ..backends.onnx.builder import onnx_ops_used  # SciPy: not on a board

        if not os.path.isfile(target):
            raise CLIError(f"'{target}' not found")
        model = onnx.load(target)
        props = {p.key: p.value for p in model.metadata_props}
        print(f"{target}: ONNX model, opset {model.opset_import[0].version}, {len(model.graph.node)} nodes")
        for value in list(model.graph.input) + list(model.graph.output):
            dims = [d.dim_param or str(d.dim_value) for d in value.type.tensor_type.shape.dim]
            kind = "input " if value in model.graph.input else "output"
            print(f"  {kind} {value.name}: float32 ({', '.join(dims)})")
        for key, value in props.items():
            print(f"  {key}: {value}")
        print("  operators: " + ", ".join(f"{op} {n}" for op, n in onnx_ops_used(model).most_common()))
        return 0
    if args.params is None and args.input_shape is None and ext not in ("", ".py"):
        raise CLIError(f"'{target}': expected a builder (FILE.py:FUNCTION) or a .so / .tar / .onnx file")
    _, _, net = convert_from_args(args)
    print(net.summary())
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    _check_output_path(args.output, (".npz",), "the output file")
    exe = load_predictor(args.model)
    x = _batched(load_array(args.input, "input"), exe.input_shape, "the input")
    x_var = None
    if args.input_var is not None:
        if not exe.input_variance:
            raise CLIError("--input-var given, but this network takes no input variance")
        x_var = _batched(load_array(args.input_var, "input variance"), exe.input_shape, "the input variance")
    elif exe.input_variance:
        raise CLIError("this network takes an input variance: pass --input-var VAR.npy")
    t0 = time.perf_counter()
    out = exe(x, x_var)
    elapsed = time.perf_counter() - t0
    if hasattr(out, "mutual_information"):  # converted with head="probs": probabilities and uncertainty
        np.savez(args.output, **out._asdict())
        print(f"wrote {args.output}: probs {out.probs.shape}, predictive_entropy, expected_entropy, "
              f"mutual_information (batch of {len(out.probs)} in {elapsed * 1e3:.1f} ms)")
        shown = min(len(out.probs), args.show)
        for i in range(shown):
            row = out.probs[i]
            top = int(row.argmax()) if row.size > 1 else int(row[0] >= 0.5)
            p = row[top] if row.size > 1 else (row[0] if top else 1 - row[0])
            print(f"  input {i}: class {top}  p {p:.4g}  mutual information {out.mutual_information[i]:.4g}")
        if len(out.probs) > shown:
            print(f"  … ({len(out.probs) - shown} more in {args.output})")
        return 0
    mean, var = out
    np.savez(args.output, mean=mean, var=var)
    print(f"wrote {args.output}: mean {mean.shape}, var {var.shape} (batch of {mean.shape[0]} in "
          f"{elapsed * 1e3:.1f} ms)")
    if mean.ndim == 2 and mean.shape[1] > 1:
        top = mean.argmax(1)
        std = np.sqrt(var[np.arange(len(top)), top])
        shown = min(len(top), args.show)
        for i in range(shown):
            print(f"  input {i}: class {top[i]}  mean {mean[i, top[i]]:.4g}  std {std[i]:.4g}")
        if len(top) > shown:
            print(f"  … ({len(top) - shown} more in {args.output})")
    return 0


def _median_ms(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def cmd_diagnose(args: argparse.Namespace) -> int:
    """Per-layer PFP vs Monte Carlo (pyro2pfp.diagnose) on inputs from a .npy file."""
    model, guide, net = convert_from_args(args)
    x = _batched(load_array(args.input, "input"), net.input_shape, "input")
    result = pyro2pfp.diagnose(model, guide, x[: args.max_inputs], num_samples=args.samples, net=net,
                               seed=args.seed)
    print(result.table())
    if args.plot:
        result.plot(args.plot)
        print(f"plot written to {args.plot}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from ..analysis.sampling import predictive_logits  # torch and Pyro: not on a board
    from ..backends.onnx.builder import to_onnx  # SciPy: not on a board
    from ..backends.tvm.compile import compile_network  # TVM's compiler: not on a board

    model, guide, net = convert_from_args(args)
    exe = compile_network(net, args.target)
    if args.remote:
        return _bench_remote(net, exe, args)
    if not exe.runnable:
        raise CLIError(f"--target {args.target} is for another CPU; bench runs on this machine")
    ort_session = None
    try:
        import onnxruntime as ort

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "net.onnx")
            to_onnx(net, path)
            ort_session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    except ImportError:
        print("note: onnxruntime is not installed; its column is skipped", file=sys.stderr)
    rng = np.random.default_rng(0)
    predictive = f"Predictive ({args.samples} samples) ms"
    header = f"{'batch':>6}  {'PFP TVM ms':>11}  {'PFP onnxruntime ms':>19}  {predictive:>28}  {'speed-up':>8}"
    print(f"target {exe.target.attrs.get('mcpu', '') or exe.target.kind.name}; median of {args.repeat} runs")
    print(header)
    print("-" * len(header))
    for batch in args.batch_sizes:
        x = rng.uniform(0.0, 1.0, (batch, *net.input_shape)).astype(np.float32)
        feeds = {"x": x}
        if net.input_variance:
            feeds["x_var"] = np.full_like(x, 1e-4)
        # The lambdas run inside _median_ms, in this iteration: binding the loop variables is safe.
        t_tvm = _median_ms(lambda: exe(*feeds.values()), args.repeat)  # noqa: B023
        t_ort = (_median_ms(lambda: ort_session.run(None, feeds), args.repeat)  # noqa: B023
                 if ort_session is not None else float("nan"))
        t_mc = _median_ms(lambda: predictive_logits(model, guide, x, num_samples=args.samples),  # noqa: B023
                          max(1, min(args.repeat, 5)))
        print(f"{batch:>6}  {t_tvm:>11.3f}  {t_ort:>19.3f}  {t_mc:>28.2f}  {t_mc / t_tvm:>7.0f}x")
    return 0


def _bench_remote(net, exe, args: argparse.Namespace) -> int:
    """``bench --remote``: upload the library to a board and time it there (time_evaluator)."""
    remote = Remote.parse(args.remote, session_timeout=args.remote_timeout)
    board = upload(exe, remote)
    print(f"target {exe.target.attrs.get('mcpu', '') or exe.target.kind.name} on {remote.address}; "
          f"time_evaluator on the board, {args.repeat} repeats")
    header = f"{'batch':>6}  {'median ms':>10}  {'mean ms':>10}  {'min ms':>10}"
    print(header)
    print("-" * len(header))
    for batch in args.batch_sizes:
        x = fixed_inputs(net.input_shape, batch)
        x_var = np.full_like(x, 1e-4) if net.input_variance else None
        t = board.time(x, x_var, repeats=args.repeat)
        print(f"{batch:>6}  {t.median_ms:>10.4f}  {t.mean_ms:>10.4f}  {t.min_ms:>10.4f}")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    """``validate --remote``: the board's outputs on a fixed input set against the float64 reference."""
    from ..backends.tvm.compile import compile_network  # TVM's compiler: not on a board

    _model, _guide, net = convert_from_args(args)
    exe = compile_network(net, args.target)
    report = validate(net, exe, Remote.parse(args.remote, session_timeout=args.remote_timeout),
                      count=args.count, rtol=args.rtol)
    print(report)
    return 0 if report.ok else 1
