"""The ``pyro2pfp`` command line: convert a trained Pyro BNN to a compiled library or ONNX file,
inspect it, run it on saved inputs and benchmark it.  See ``pyro2pfp --help``."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect as pyinspect
import os
import sys
import textwrap
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .errors import InternalError, PFPError

DEFAULT_FUNCTION = "build"
LIBRARY_EXTS = (".so", ".tar")

MAIN_DESCRIPTION = """\
Turn a Bayesian neural network trained with Pyro into a Probabilistic Forward Pass (PFP) network:
one pass that predicts the mean and the variance of every output, instead of sampling the BNN.

You need two things from training:
  1. a BUILDER: a Python function that creates your model and guide and returns (model, guide),
     e.g. in builder.py:
         from pyro2pfp_experiments.zoo import BayesianMLP, make_guide
         def build():
             model = BayesianMLP(784, (100,), 10)
             return model, make_guide(model)
  2. the trained parameters, saved after training with
         pyro.get_param_store().save("params.pt")
"""

MAIN_EPILOG = """\
examples:
  pyro2pfp convert builder.py:build --params params.pt --input-shape 1,28,28 -o net.so
  pyro2pfp convert builder.py:build --params params.pt --input-shape 1,28,28 -o net.onnx
  pyro2pfp convert builder.py:build --params params.pt --input-shape 1,28,28 --target rpi4 -o net_rpi4.so
  pyro2pfp inspect builder.py:build --params params.pt --input-shape 1,28,28
  pyro2pfp inspect net.so
  pyro2pfp predict net.so images.npy -o predictions.npz
  pyro2pfp bench builder.py:build --params params.pt --input-shape 1,28,28

Run 'pyro2pfp COMMAND --help' for the options of each command.
"""

BUILDER_HELP = (
    "where to find the function returning (model, guide): FILE.py:FUNCTION or MODULE:FUNCTION "
    f"(FUNCTION defaults to '{DEFAULT_FUNCTION}'). It is called without arguments."
)


class CLIError(PFPError):
    """A user error reported by the command line (message only, no traceback)."""


# ---------------------------------------------------------------------------------------------
# Argument parsing helpers
# ---------------------------------------------------------------------------------------------


def parse_shape(text: str) -> tuple[int, ...]:
    """``"1,28,28"`` / ``"1x28x28"`` / ``"(1, 28, 28)"`` → ``(1, 28, 28)``."""
    cleaned = text.strip().strip("()[]").replace("x", ",").replace("X", ",")
    parts = [p.strip() for p in cleaned.split(",") if p.strip()]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not a shape; write the shape of ONE input without the batch dimension, "
            "e.g. 1,28,28 for MNIST images or 784 for flattened ones") from None
    if not shape or any(d <= 0 for d in shape):
        raise argparse.ArgumentTypeError(f"'{text}': the shape needs positive sizes, e.g. 1,28,28")
    return shape


def parse_int_list(text: str) -> list[int]:
    try:
        values = [int(p) for p in text.replace(" ", "").split(",") if p]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of integers") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"'{text}': positive integers expected, e.g. 1,32")
    return values


def _checked(text: str, convert: Any, what: str, ok: Any, expected: str) -> Any:
    """``convert(text)`` if it parses (else "is not ``what``") and ``ok`` (else ``expected``)."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not {what}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"'{text}': {expected}")
    return value


def non_negative_float(text: str) -> float:
    return _checked(text, float, "a number", lambda v: np.isfinite(v) and v >= 0,
                    "a finite number >= 0 is expected")


def positive_float(text: str) -> float:
    return _checked(text, float, "a number", lambda v: np.isfinite(v) and v > 0,
                    "a finite number > 0 is expected")


def positive_int(text: str) -> int:
    return _checked(text, int, "an integer", lambda v: v > 0, "a positive integer is expected")


# ---------------------------------------------------------------------------------------------
# Builder, param store, conversion
# ---------------------------------------------------------------------------------------------


def _split_spec(spec: str) -> tuple[str, str | None]:
    if ":" in spec:
        where, _, func = spec.rpartition(":")
        if where and func and os.sep not in func and "." not in func:
            return where, func
    return spec, None


def load_builder(spec: str):
    """The builder function named by ``FILE.py[:FUNCTION]`` or ``MODULE:FUNCTION``."""
    where, func = _split_spec(spec)
    name = func or DEFAULT_FUNCTION
    if where.endswith(".py") or os.sep in where or os.path.exists(where):
        path = Path(where)
        if not path.is_file():
            raise CLIError(f"builder file '{where}' not found (expected FILE.py:FUNCTION, e.g. builder.py:build)")
        mod_name = f"_pyro2pfp_builder_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        if module_spec is None or module_spec.loader is None:
            raise CLIError(f"builder file '{where}' cannot be imported as Python")
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, str(path.resolve().parent))  # let the builder import its neighbours
        try:
            sys.modules[mod_name] = module
            module_spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(mod_name, None)
            raise CLIError(f"running builder file '{where}' failed: {type(exc).__name__}: {exc}") from exc
        finally:
            sys.path.remove(str(path.resolve().parent))
    else:
        if func is None:
            raise CLIError(f"'{spec}': give the builder as FILE.py:FUNCTION or MODULE:FUNCTION")
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise CLIError(f"cannot import module '{where}' for the builder '{spec}': {exc}") from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        functions = sorted(n for n, obj in vars(module).items()
                           if pyinspect.isfunction(obj) and obj.__module__ == module.__name__
                           and not n.startswith("_"))
        hint = f"; functions defined there: {', '.join(functions)}" if functions else ""
        raise CLIError(f"'{where}' has no function '{name}'{hint}. Name it as {where}:FUNCTION.")
    return fn


def build_model_and_guide(spec: str) -> tuple[Any, Any]:
    fn = load_builder(spec)
    try:
        result = fn()
    except Exception as exc:
        raise CLIError(f"the builder {spec} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise CLIError(f"the builder {spec} must return (model, guide), got {type(result).__name__}"
                       + (f" of length {len(result)}" if isinstance(result, (tuple, list)) else ""))
    return result[0], result[1]


def _constraint_classes() -> list[type]:
    """Every Constraint class of torch and Pyro: the only non-tensor objects a param store holds."""
    import pyro.distributions.constraints as pyro_constraints
    import torch.distributions.constraints as torch_constraints

    classes = set()
    for module in (torch_constraints, pyro_constraints):
        for obj in vars(module).values():
            if pyinspect.isclass(obj) and issubclass(obj, torch_constraints.Constraint):
                classes.add(obj)
    return sorted(classes, key=lambda c: (c.__module__, c.__name__))


def load_param_store(path: str) -> set[str]:
    """Load ``pyro.get_param_store().save(path)`` output with ``torch.load(weights_only=True)``.

    Only tensors and Pyro/torch constraint objects are accepted (no arbitrary pickled code).
    Returns the names of the loaded parameters.
    """
    import pickle

    import pyro
    import torch

    if not os.path.isfile(path):
        raise CLIError(f"parameter file '{path}' not found (save it after training with "
                       "pyro.get_param_store().save(path))")
    try:
        with torch.serialization.safe_globals(list[Any](_constraint_classes())):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        boilerplate = ("Weights only load failed", "Check the documentation", "Please file an issue")
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        detail = " ".join(line.replace("WeightsUnpickler error:", "").strip() for line in lines
                          if not line.startswith(boilerplate)).strip() or "unreadable"
        if "global" in detail.lower():
            raise CLIError(f"'{path}' holds objects other than tensors and Pyro constraints, so it is not "
                           f"loaded (torch.load with weights_only=True: {detail})") from None
        raise CLIError(f"'{path}' is not a file written by pyro.get_param_store().save() "
                       f"(torch.load with weights_only=True: {detail})") from None
    except Exception as exc:
        raise CLIError(f"'{path}' is not a file written by pyro.get_param_store().save(): "
                       f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    if not isinstance(state, dict) or set(state) != {"params", "constraints"}:
        keys = sorted(state)[:5] if isinstance(state, dict) else type(state).__name__
        raise CLIError(f"'{path}' is not a Pyro param store (expected what pyro.get_param_store().save() "
                       f"writes: a dict with 'params' and 'constraints'; got {keys})")
    bad = [k for k, v in state["params"].items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CLIError(f"'{path}': parameters {bad[:3]} are not tensors")
    pyro.get_param_store().set_state(state)  # type: ignore[arg-type]  # checked above: params and constraints
    return set(state["params"])


def load_example(path: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``--example FILE``: the arguments of one call of the model and guide, for ``convert(...,
    example_args=..., example_kwargs=...)``: a ``.npy`` (the input batch) or a ``.npz`` whose unnamed
    arrays (``np.savez(path, x, y)``: ``arr_0``, ``arr_1``, …) are the positional arguments in order and
    named ones the keyword arguments."""
    if not os.path.isfile(path):
        raise CLIError(f"example file '{path}' not found")
    try:
        data = np.load(path, allow_pickle=False)
    except Exception as exc:
        raise CLIError(f"cannot read the example '{path}' as a NumPy .npy/.npz file: {exc}") from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        return (data,), {}
    with data:
        arrays = {key: data[key] for key in data.keys()}
    positional = sorted((k for k in arrays if k.startswith("arr_") and k[4:].isdigit()), key=lambda k: int(k[4:]))
    args = tuple(arrays[k] for k in positional)
    kwargs = {k: v for k, v in arrays.items() if k not in positional}
    if not args and "x" in kwargs:
        args = (kwargs.pop("x"),)
    if not args:
        raise CLIError(f"{path} holds arrays {sorted(arrays)}: save the input batch first, e.g. "
                       "np.savez(path, x, y) (positional arguments) or np.savez(path, x=x, y=y)")
    return args, kwargs


def convert_from_args(args: argparse.Namespace):
    """Builder + param store → PFPNetwork (what convert / inspect / bench share)."""
    import pyro

    import pyro2pfp

    pyro.clear_param_store()
    model, guide = build_model_and_guide(args.builder)
    if args.params:
        # convert() takes the guide's parameters from the param store (pyro2pfp.posterior)
        load_param_store(args.params)
    options: dict[str, Any] = {}
    if getattr(args, "input_variance", False):
        options["input_variance"] = True
    if getattr(args, "head", None):
        options["head"] = args.head
    if getattr(args, "check", None):
        options["check"] = _load_array(args.check, "check input")
    if getattr(args, "example", None):
        options["example_args"], options["example_kwargs"] = load_example(args.example)
    try:
        net = pyro2pfp.convert(model, guide, input_shape=args.input_shape, calibration=args.calibration,
                               moment_form=args.moment_form, correlation=args.correlation, **options)
    except PFPError as exc:
        if args.params is None and "never been run" in str(exc):
            raise CLIError(f"{exc} Pass the trained parameters with --params params.pt.") from None
        if args.params is not None and "shape" in str(exc):
            raise CLIError(f"{exc} (the parameters come from '{args.params}': was it saved from a model "
                           "of other sizes?)") from None
        raise
    return model, guide, net


# ---------------------------------------------------------------------------------------------
# Inputs / artefacts
# ---------------------------------------------------------------------------------------------


def _load_array(path: str, what: str) -> np.ndarray:
    if not os.path.isfile(path):
        raise CLIError(f"{what} file '{path}' not found")
    try:
        data = np.load(path, allow_pickle=False)
    except Exception as exc:
        raise CLIError(f"cannot read {what} '{path}' as a NumPy .npy/.npz file: {exc}") from None
    if isinstance(data, np.lib.npyio.NpzFile):
        with data:
            keys = list(data.keys())
            key = "x_var" if what == "input variance" and "x_var" in keys else "x" if "x" in keys else None
            if key is None and len(keys) == 1:
                key = keys[0]
            if key is None:
                raise CLIError(f"{path} holds arrays {keys}; name the input 'x' (np.savez(path, x=...))")
            data = data[key]
    return data


def _batched(x: np.ndarray, input_shape: tuple[int, ...], name: str) -> np.ndarray:
    if x.ndim == len(input_shape) and tuple(x.shape) == tuple(input_shape):
        print(f"note: {name} has the shape of one input {x.shape}; treating it as a batch of 1", file=sys.stderr)
        return x[None]
    return x


class _OnnxPredictor:
    """onnxruntime session with the same input checks as the compiled predictor."""

    def __init__(self, path: str) -> None:
        import onnx
        import onnxruntime as ort

        model = onnx.load(path)
        props = {p.key: p.value for p in model.metadata_props}
        names = [i.name for i in model.graph.input]
        if "x" not in names:
            raise CLIError(f"{path} has inputs {names}; a pyro2pfp ONNX model has input 'x'")
        if "pyro2pfp.input_shape" in props:
            self.input_shape = tuple(int(d) for d in props["pyro2pfp.input_shape"].split(","))
        else:
            dims = model.graph.input[0].type.tensor_type.shape.dim[1:]
            self.input_shape = tuple(int(d.dim_value) for d in dims)
        self.input_variance = "x_var" in names
        self.session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])

    def __call__(self, x: Any, x_var: Any = None) -> Any:
        from .inputs import checked_inputs, compiled_outputs

        arrays = checked_inputs(x, x_var, self.input_shape, self.input_variance, np.float32)
        names = [o.name for o in self.session.get_outputs()]
        head = names == ["probs", "uncertainty"]  # converted with head="probs" (pyro2pfp.ops.head)
        mean, var = self.session.run(names if head else ["mean", "var"],
                                     dict(zip(("x", "x_var"), arrays, strict=False)))
        return compiled_outputs(mean, var, "probs" if head else None)


def load_predictor(path: str):
    """A compiled library (.so/.tar, via pyro2pfp.load) or an ONNX model (via onnxruntime)."""
    from . import deploy

    if not os.path.isfile(path):
        raise CLIError(f"model file '{path}' not found")
    ext = os.path.splitext(path)[1].lower()
    if ext in LIBRARY_EXTS:
        return deploy.load(path)
    if ext == ".onnx":
        return _OnnxPredictor(path)
    raise CLIError(f"'{path}': expected a .so / .tar library (pyro2pfp convert -o net.so) or a .onnx model")


def _check_output_path(path: str, exts: Sequence[str], what: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in exts:
        raise CLIError(f"output '{path}': {what} must end in {' or '.join(exts)}")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise CLIError(f"output directory '{directory}' does not exist")
    return ext


# ---------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------


def cmd_convert(args: argparse.Namespace) -> int:
    from . import deploy
    from .onnx_export import to_onnx

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
    exe = deploy.compile_network(net, args.target or "llvm", schedule=not args.no_schedule,
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
    if args.trials is not None:  # else the library's default (pyro2pfp.tuning.DEFAULT_TRIALS)
        spec["trials"] = args.trials
    if args.remote:
        from .remote import Remote

        spec["remote"] = Remote.parse(args.remote, session_timeout=args.remote_timeout)
    return spec


def cmd_inspect(args: argparse.Namespace) -> int:
    from . import deploy

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

        from .onnx_export import onnx_ops_used

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
    x = _batched(_load_array(args.input, "input"), exe.input_shape, "the input")
    x_var = None
    if args.input_var is not None:
        if not exe.input_variance:
            raise CLIError("--input-var given, but this network takes no input variance")
        x_var = _batched(_load_array(args.input_var, "input variance"), exe.input_shape, "the input variance")
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
    import pyro2pfp

    model, guide, net = convert_from_args(args)
    x = _batched(_load_array(args.input, "input"), net.input_shape, "input")
    result = pyro2pfp.diagnose(model, guide, x[: args.max_inputs], num_samples=args.samples, net=net,
                               seed=args.seed)
    print(result.table())
    if args.plot:
        result.plot(args.plot)
        print(f"plot written to {args.plot}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import tempfile

    from . import deploy
    from .onnx_export import to_onnx
    from .sampling import predictive_logits

    model, guide, net = convert_from_args(args)
    exe = deploy.compile_network(net, args.target)
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
    from .remote import Remote, fixed_inputs, upload

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
    from . import deploy
    from .remote import Remote, validate

    _model, _guide, net = convert_from_args(args)
    exe = deploy.compile_network(net, args.target)
    report = validate(net, exe, Remote.parse(args.remote, session_timeout=args.remote_timeout),
                      count=args.count, rtol=args.rtol)
    print(report)
    return 0 if report.ok else 1


# ---------------------------------------------------------------------------------------------
# Parser
# ---------------------------------------------------------------------------------------------


def _add_conversion_options(p: argparse.ArgumentParser, builder_help: str = BUILDER_HELP) -> None:
    p.add_argument("builder", metavar="BUILDER", help=builder_help)
    p.add_argument("--params", "-p", metavar="PARAMS.pt",
                   help="trained parameters saved with pyro.get_param_store().save(PARAMS.pt); loaded with "
                        "torch.load(weights_only=True) (tensors and Pyro constraints only)")
    p.add_argument("--input-shape", "-s", type=parse_shape, metavar="C,H,W",
                   help="shape of ONE input without the batch dimension, e.g. 1,28,28 (needed when the "
                        "first layer is a convolution; a Linear first layer gives it)")
    p.add_argument("--calibration", "-c", type=non_negative_float, default=1.0, metavar="FACTOR",
                   help="multiply every posterior weight variance by FACTOR (default 1.0)")
    p.add_argument("--moment-form", choices=("variance", "raw"), default="variance",
                   help="'variance' (default, accurate in float32) or 'raw' (the paper's raw-moment plan)")
    p.add_argument("--input-variance", action="store_true",
                   help="the network also takes the variance of its input (sensor noise): inputs x, x_var")
    p.add_argument("--example", "-e", metavar="EXAMPLE.npz",
                   help="arguments of one call of the model and guide, for models/guides that need more than "
                        "the input (e.g. model(x, y) reading y.size(0)): np.savez(EXAMPLE.npz, x, y) with a few "
                        "real inputs first (named arrays are keyword arguments); the labels never enter the net")
    p.add_argument("--correlation", choices=("auto", "shared-factor", "mean-field"), default="auto",
                   help="treatment of noise shared across positions/branches: 'auto' (default: shared-factor "
                        "for nets with average pooling of conv outputs or residual adds), 'shared-factor' or "
                        "'mean-field' (the paper)")


def _add_remote_options(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--remote", "-r", required=required, metavar="HOST:PORT[/KEY]",
                   help="a board through TVM RPC: 'tracker-host:9190/rpi4' (tracker and key) or "
                        "'server-host:9090' (one rpc_server, no tracker)")
    p.add_argument("--remote-timeout", type=positive_float, default=60.0, metavar="SEC",
                   help="RPC session timeout in seconds (default 60)")


def _target_help() -> str:
    from .deploy import PRESET_HELP

    presets = "; ".join(f"{k}: {v}" for k, v in PRESET_HELP.items())
    return ("where the library will run: 'llvm' (this machine, generic; default), 'native' (this CPU), "
            f"a preset ({presets}), a TVM tag, or a JSON target dict")


def build_parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="pyro2pfp", description=MAIN_DESCRIPTION, epilog=MAIN_EPILOG,
                                     formatter_class=formatter)
    from ._version import __version__

    parser.add_argument("--version", action="version", version=f"pyro2pfp {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an internal error (for bug reports)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("convert", formatter_class=formatter, help="convert a trained model to .so/.tar or .onnx",
                       description=textwrap.dedent("""\
        Convert a trained Pyro BNN into a PFP network and write it as
          .so    compiled shared library (TVM) + a .so.json metadata file: load with pyro2pfp.load()
                 or 'pyro2pfp predict'; with --target for another CPU, copy both files to the device
          .tar   the same as object files (no cross linker needed; linked when loaded)
          .onnx  ONNX model (standard operators; inputs x [, x_var], outputs mean, var)"""),
                       epilog=textwrap.dedent("""\
        example:
          pyro2pfp convert builder.py:build --params params.pt --input-shape 1,28,28 -o net.so"""))
    _add_conversion_options(p)
    p.add_argument("--head", choices=("probs",), default=None,
                   help="append the uncertainty head (pyro2pfp.ops.head): outputs class probabilities and the "
                        "predictive entropy, expected entropy and mutual information instead of the logits' "
                        "mean and variance")
    p.add_argument("--output", "-o", required=True, metavar="OUT",
                   help="output file: net.so, net.tar or net.onnx")
    p.add_argument("--target", "-t", default=None, help=_target_help())
    p.add_argument("--opset", type=int, default=17, help="ONNX opset for .onnx output (default 17)")
    p.add_argument("--no-schedule", action="store_true", help="skip the CPU schedules (debugging)")
    p.add_argument("--batch-sizes", "-b", type=parse_int_list, default=None, metavar="1,10",
                   help="also build a static-shape executable for each batch size (net.compile(batch_sizes=...)); "
                        "each is written next to OUT as OUT-stem.batch<B>.so and listed in OUT.json, and "
                        "pyro2pfp.load / predict run it for inputs of that many rows")
    p.add_argument("--tune", type=parse_int_list, default=None, metavar="10",
                   help="also tune with MetaSchedule for these batch sizes (on this machine, or with --remote on "
                        "a board of the target's architecture; cached in ~/.cache/pyro2pfp/tuning), exported "
                        "like --batch-sizes")
    p.add_argument("--trials", type=positive_int, default=None,
                   help="MetaSchedule trials per --tune batch (default: the library's, pyro2pfp.tuning.DEFAULT_TRIALS)")
    _add_remote_options(p, required=False)
    p.add_argument("--verbose", "-v", action="store_true", help="print the layer plan")
    p.add_argument("--check", metavar="X.npy",
                   help="after converting, compare the output moments with 150 samples of the guide on these "
                        "inputs (a few, e.g. 16; ~150 forward passes of them) and warn, naming the first layer "
                        "that parts from sampling, when they differ beyond the sampling noise (convert(check=x))")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("inspect", formatter_class=formatter, help="print the layer plan of a model or file",
                       description="Print the PFP layer plan (ops, shapes, mean/variance representations) "
                                   "of a builder + parameters, or describe a .so/.tar/.onnx file.",
                       epilog="examples:\n"
                              "  pyro2pfp inspect builder.py:build --params params.pt --input-shape 1,28,28\n"
                              "  pyro2pfp inspect net.so\n  pyro2pfp inspect net.onnx")
    _add_conversion_options(p, BUILDER_HELP + " Or a .so/.tar/.onnx file written by 'convert'.")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("predict", formatter_class=formatter, help="run a converted network on a .npy file",
                       description="Run a converted network (.so/.tar from 'convert', or .onnx via "
                                   "onnxruntime) on inputs from a .npy file and save mean and variance.",
                       epilog="example:\n  pyro2pfp predict net.so images.npy -o predictions.npz\n"
                              "  python -c \"import numpy as np; d = np.load('predictions.npz'); "
                              "print(d['mean'], d['var'])\"")
    p.add_argument("model", metavar="MODEL", help="net.so / net.tar (with its .json file) or net.onnx")
    p.add_argument("input", metavar="INPUT.npy",
                   help="float array of shape (batch, *input_shape), saved with np.save (or .npz with 'x')")
    p.add_argument("--input-var", metavar="VAR.npy", help="input variances (networks converted with input noise)")
    p.add_argument("--output", "-o", required=True, metavar="OUT.npz",
                   help="where to save the arrays 'mean' and 'var' (each (batch, outputs))")
    p.add_argument("--show", type=int, default=5, help="print the top class of the first N inputs (default 5)")
    p.set_defaults(func=cmd_predict)

    p = sub.add_parser("diagnose", formatter_class=formatter, help="per-layer PFP moments against sampling",
                       description="Run the guide's weight samples through the traced model and report, per "
                                   "planned layer, the PFP mean error in MC standard deviations and the PFP/MC "
                                   "variance ratio (median, p10, p90); optionally a PNG of the ratio along the depth.",
                       epilog="example:\n  pyro2pfp diagnose builder.py:build images.npy --params params.pt "
                              "--input-shape 3,32,32 --plot ratio.png")
    _add_conversion_options(p)
    p.add_argument("input", metavar="INPUT.npy", help="inputs (batch, *input_shape), saved with np.save")
    p.add_argument("--samples", "-n", type=positive_int, default=300, help="Monte Carlo samples (default 300)")
    p.add_argument("--max-inputs", type=positive_int, default=32, help="use the first N inputs (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the guide's samples (default 0)")
    p.add_argument("--plot", metavar="OUT.png", help="write the variance ratio along the depth as a PNG")
    p.set_defaults(func=cmd_diagnose)

    p = sub.add_parser("bench", formatter_class=formatter, help="time the PFP network against sampling",
                       description="Convert and compile the model for this machine, then time one PFP pass "
                                   "(TVM and onnxruntime) against pyro.infer.Predictive sampling.")
    _add_conversion_options(p)
    p.add_argument("--target", "-t", default="native", help="this machine's target (default 'native')")
    p.add_argument("--batch-sizes", "-b", type=parse_int_list, default=[1, 32], metavar="1,32",
                   help="batch sizes to time (default 1,32)")
    p.add_argument("--samples", type=positive_int, default=30, help="Predictive samples (default 30)")
    p.add_argument("--repeat", type=positive_int, default=20, help="timed runs per measurement (default 20)")
    # Kept for old command lines: bench never runs benchmarks/latency.py (or any file) any more.
    p.add_argument("--builtin", action="store_true", help=argparse.SUPPRESS)
    _add_remote_options(p, required=False)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("validate", formatter_class=formatter, help="check the library on a remote board",
                       description="Convert and compile the model for --target, upload the library to a "
                                   "board through TVM RPC, run a fixed input set there and compare with the "
                                   "float64 NumPy reference (max error; exit status 1 above --rtol).",
                       epilog="example:\n  pyro2pfp validate builder.py:build -p params.pt -t rpi4 "
                              "--remote tracker-host:9190/rpi4")
    _add_conversion_options(p)
    p.add_argument("--target", "-t", default="llvm", help=_target_help())
    p.add_argument("--count", type=positive_int, default=32, help="inputs in the fixed set (default 32)")
    p.add_argument("--rtol", type=non_negative_float, default=1e-4,
                   help="allowed error relative to the largest reference value (default 1e-4)")
    _add_remote_options(p, required=True)
    p.set_defaults(func=cmd_validate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pyro2pfp`` command; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except InternalError as exc:  # a bug the library caught and named: as below, its cause chained
        print(f"pyro2pfp {args.command}: {' '.join(str(exc).split())}"
              + ("" if args.debug else " (rerun with --debug for the traceback)"), file=sys.stderr)
        if args.debug:
            traceback.print_exc()
        return 2
    except (PFPError, OSError) as exc:  # a user error (or a file system one): one clear line, no traceback
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"pyro2pfp {args.command}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 -- a bug in pyro2pfp or a dependency
        print(f"pyro2pfp {args.command}: internal error ({type(exc).__name__}: {' '.join(str(exc).split())[:300]}). "
              "Please report it with the command line"
              + (":" if args.debug else "; rerun with --debug for the traceback."), file=sys.stderr)
        if args.debug:
            traceback.print_exc()
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
