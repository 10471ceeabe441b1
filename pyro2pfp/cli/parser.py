"""The argument parser of the ``pyro2pfp`` command: help texts, argument types and one sub-parser per
command."""
from __future__ import annotations

import argparse
import textwrap
from typing import Any

import numpy as np

from .._version import __version__
from ..frontend.loading import DEFAULT_FUNCTION
from ..options import Correlation, Head, Hermite, Injection, MomentForm, values
from ..runtime.deploy import PRESET_HELP
from .commands import cmd_bench, cmd_convert, cmd_diagnose, cmd_inspect, cmd_predict, cmd_validate
from .score import cmd_score

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
  pyro2pfp score net.so pool/ -o scored/ --metrics
  pyro2pfp bench builder.py:build --params params.pt --input-shape 1,28,28

Run 'pyro2pfp COMMAND --help' for the options of each command.
"""

BUILDER_HELP = (
    "where to find the function returning (model, guide): FILE.py:FUNCTION or MODULE:FUNCTION "
    f"(FUNCTION defaults to '{DEFAULT_FUNCTION}'). It is called without arguments."
)



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
    p.add_argument("--moment-form", choices=values(MomentForm), default=MomentForm.VARIANCE.value,
                   help="'variance' (default, accurate in float32) or 'raw' (the paper's raw-moment plan)")
    p.add_argument("--input-variance", action="store_true",
                   help="the network also takes the variance of its input (sensor noise): inputs x, x_var")
    p.add_argument("--example", "-e", metavar="EXAMPLE.npz",
                   help="arguments of one call of the model and guide, for models/guides that need more than "
                        "the input (e.g. model(x, y) reading y.size(0)): np.savez(EXAMPLE.npz, x, y) with a few "
                        "real inputs first (named arrays are keyword arguments); the labels never enter the net")
    p.add_argument("--correlation", choices=values(Correlation), default=Correlation.AUTO.value,
                   help="treatment of noise shared across positions/branches: 'auto' (default: shared-factor "
                        "for nets with average pooling of conv outputs or residual adds), 'shared-factor' or "
                        "'mean-field' (the paper)")
    p.add_argument("--hermite", choices=values(Hermite), default=None,
                   help="shared-factor variant (with --correlation shared-factor): 'factor' (default) or 'none' "
                        "(no second-Hermite factor per ReLU: cheaper)")
    p.add_argument("--injection", choices=values(Injection), default=None,
                   help="shared-factor variant (with --correlation shared-factor): 'regression' (default) or "
                        "'rescaled' (no regression convolution per conv layer: cheaper)")


def _add_remote_options(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--remote", "-r", required=required, metavar="HOST:PORT[/KEY]",
                   help="a board through TVM RPC: 'tracker-host:9190/rpi4' (tracker and key) or "
                        "'server-host:9090' (one rpc_server, no tracker)")
    p.add_argument("--remote-timeout", type=positive_float, default=60.0, metavar="SEC",
                   help="RPC session timeout in seconds (default 60)")


def _target_help() -> str:
    presets = "; ".join(f"{k}: {v}" for k, v in PRESET_HELP.items())
    return ("where the library will run: 'llvm' (this machine, generic; default), 'native' (this CPU), "
            f"a preset ({presets}), a TVM tag, or a JSON target dict")


def build_parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="pyro2pfp", description=MAIN_DESCRIPTION, epilog=MAIN_EPILOG,
                                     formatter_class=formatter)

    parser.add_argument("--version", action="version", version=f"pyro2pfp {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an internal error (for bug reports)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    _add_convert_parser(sub, formatter)

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

    _add_score_parser(sub, formatter)
    return parser


def _add_convert_parser(sub: Any, formatter: Any) -> None:
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
    p.add_argument("--head", choices=values(Head), default=None,
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
                   help="MetaSchedule trials per --tune batch (default: the library's, "
                        "pyro2pfp.backends.tvm.tuning.DEFAULT_TRIALS)")
    _add_remote_options(p, required=False)
    p.add_argument("--verbose", "-v", action="store_true", help="print the layer plan")
    p.add_argument("--check", metavar="X.npy",
                   help="after converting, compare the output moments with 150 samples of the guide on these "
                        "inputs (a few, e.g. 16; ~150 forward passes of them) and warn, naming the first layer "
                        "that parts from sampling, when they differ beyond the sampling noise (convert(check=x))")
    p.add_argument("--no-check", action="store_true",
                   help="skip the spot check every conversion ends with (64 guide samples on two inputs; a gross "
                        "difference from the network is an error naming the first layer that departs; "
                        "convert(check=False))")
    p.set_defaults(func=cmd_convert)


def _add_score_parser(sub: Any, formatter: Any) -> None:
    p = sub.add_parser(
        "score", formatter_class=formatter, help="score .npy/.npz/Parquet shards on Ray Data into Parquet files",
        description=textwrap.dedent("""\
        Score every row of the input shards with a converted network on Ray Data -- a local Ray instance
        with this machine's CPUs, or a cluster (--ray-address) -- and write one Parquet file per shard to
        OUT_DIR: the shard's row index, its id columns, mean and var (with --metrics also the uncertainty:
        total, aleatoric, epistemic, probs).  A shard whose output file exists is skipped, so an
        interrupted run continues where it stopped; a shard that cannot be read or scored is reported by
        name and the others are finished (exit status 1)."""),
        epilog="examples:\n"
               "  pyro2pfp score net.so pool/ -o scored/ --metrics\n"
               "  pyro2pfp score net.so shard_*.npy -o scored/ --ray-address auto\n"
               "  pyro2pfp score net_x86.so data.parquet -o scored/ --library net_aarch64.so --column image")
    p.add_argument("model", metavar="MODEL", help="net.so / net.tar (with its .json file) or net.onnx; its files "
                                                  "are sent to every worker")
    p.add_argument("inputs", metavar="INPUT", nargs="+",
                   help=".npy / .npz files (inputs (rows, *input_shape); an .npz's 'x' and its 1-D arrays as ids), "
                        "Parquet files with a fixed-shape tensor column, or directories of them")
    p.add_argument("--output", "-o", required=True, metavar="OUT_DIR", help="directory of the output Parquet files")
    p.add_argument("--library", action="append", metavar="PATH",
                   help="another library (or ONNX model) for workers that cannot run MODEL, e.g. one "
                        "cross-compiled for aarch64 nodes; each worker takes the first it can run (repeatable)")
    p.add_argument("--metrics", action="store_true",
                   help="add total, aleatoric and epistemic uncertainty (nats) and probs (logit sampling)")
    p.add_argument("--samples", type=positive_int, default=100, help="logit samples for --metrics (default 100)")
    p.add_argument("--seed", type=int, default=0, help="seed of the logit samples (default 0)")
    p.add_argument("--column", metavar="NAME", help="the input column of Parquet / .npz shards (default 'x', "
                                                    "or the only tensor column)")
    p.add_argument("--batch-size", type=positive_int, default=256, help="rows per call of the network (default 256)")
    p.add_argument("--rows-per-block", type=positive_int, default=None, metavar="ROWS",
                   help="rows per read task and object-store block (default 16 x batch size; Parquet shards are "
                        "read by whole row groups)")
    p.add_argument("--workers", type=positive_int, default=None,
                   help="scoring workers (default: one per CPU of the Ray cluster)")
    p.add_argument("--cpus-per-worker", type=positive_float, default=None, metavar="CPUS",
                   help="logical CPUs per worker (default: just under 1, leaving every node 0.5 CPU for reading)")
    p.add_argument("--ray-address", metavar="auto|HOST:PORT",
                   help="run on an existing Ray cluster (ray start --head); default: a local Ray instance "
                        "with this machine's CPUs")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_score)

