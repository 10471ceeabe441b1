"""Score batches of a dataset with an exported network: :class:`Scorer`, a callable class for Ray Data
(or any loop), and :class:`ModelFiles`, an exported network's files as bytes to ship to workers.

>>> import ray
>>> from pyro2pfp.runtime.scoring import Scorer
>>> ds = ray.data.read_parquet("pool/")                      # a column "x" of (1, 28, 28) tensors, an "id"
>>> scored = ds.map_batches(Scorer, fn_constructor_args=("net.so",), fn_constructor_kwargs={"metrics": True},
...                         compute=ray.data.ActorPoolStrategy(size=2), num_cpus=0.75, batch_size=256)
>>> scored.write_parquet("scored/")                          # id, mean, var, total, aleatoric, epistemic, probs

This is the runtime layer: it imports NumPy and what :func:`pyro2pfp.load` needs (the TVM runtime, or
onnxruntime for an ``.onnx`` file) -- neither torch, Pyro nor the TVM compiler -- so a worker process
starts in well under a second and holds the network once (loaded in ``__init__``, once per worker).

**Per worker, before the first batch**, the scorer picks the first of its models this worker can run:
a library whose sidecar names this CPU architecture (a library built with ``"native"`` or another
``mcpu`` is first loaded in a child process, so that code using instructions this CPU lacks fails
there, not in the worker), else an ONNX model (any architecture).  A cluster of mixed machines gets
``Scorer(["net_x86.so", "net_aarch64.so"])``; a worker that can run none of them fails with a
:class:`~pyro2pfp.errors.LoadError` naming the worker and why each model does not fit.

**Columns.**  A batch is a NumPy array of inputs, or a dict of columns (Ray Data's ``"numpy"`` batch
format) holding the input column (``column``, default ``"x"`` or the only column) and any others
(ids, keys), which are passed through unchanged, in order.  The scorer adds ``mean`` and ``var``
(float32, (rows, K)) and, with ``metrics=True``, the uncertainty metrics of
:func:`pyro2pfp.uncertainty` as float32 columns: ``total``, ``aleatoric``, ``epistemic`` (rows,) and
``probs`` (rows, K).  The metrics sample the logits ``mean + sqrt(var) * z`` with one set of
``num_samples`` standard normal draws ``z`` (from ``seed``) shared by every row, so a row's metrics do
not depend on the batch or the worker that scored it.  A network converted with ``head="probs"``
computes ``probs`` and the three entropies in its own graph (no sampling) and has no ``mean``/``var``.

**Errors** are :class:`~pyro2pfp.errors.PFPError` naming the rows: their id columns' ranges
(``rows id=1024…1279``) or, without ids, their positions in the batch.  ``exc.rows`` holds the same
as ``{column: (first, last)}``, and ``exc.first_bad`` the ids of the first row with a NaN or infinite
value (``{}`` if none).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ArgumentError, InputShapeError, LoadError, PFPError
from .deploy import load
from .library_files import BATCH_KEY, sidecar_path
from .predictor import set_num_threads
from .targets import _norm_arch, host_arch
from .uncertainty import uncertainty_from_logit_samples

__all__ = ["METRICS", "ModelFiles", "Scorer", "load_for_this_worker", "worker_description"]

METRICS = ("total", "aleatoric", "epistemic", "probs")
"""The uncertainty columns ``metrics=True`` adds (see :func:`pyro2pfp.uncertainty`)."""
LOGIT_OUTPUTS = ("mean", "var")
"""The columns of a network that outputs its logits' moments."""
_SAMPLE_BUDGET = 1 << 22
"""Logit samples (num_samples x rows x K) computed at once for the metrics (32 MB of float64)."""


@dataclass(frozen=True)
class ModelFiles:
    """An exported network's files as bytes (``ModelFiles.read("net.so")``): the library, its sidecar
    and the batch-specialised libraries the sidecar lists, or an ONNX model.  A scorer given one
    writes the files to a private directory on its worker, so the workers of a cluster need not share
    a file system with the machine that holds the network."""

    name: str
    """The main file's name (``net.so``, ``net.onnx``)."""
    files: dict[str, bytes]
    """``{file name: content}``, the main file among them."""

    @classmethod
    def read(cls, path: str | os.PathLike) -> ModelFiles:
        """The files of the library (or ONNX model) at ``path``."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise LoadError(f"no such library or ONNX model: {path}")
        names = [os.path.basename(path)]
        directory = os.path.dirname(os.path.abspath(path))
        if not path.lower().endswith(".onnx") and os.path.isfile(sidecar_path(path)):
            names.append(os.path.basename(sidecar_path(path)))
            for entry in (_sidecar(path).get(BATCH_KEY) or {}).values():
                name = entry.get("library") if isinstance(entry, dict) else None
                if isinstance(name, str) and os.path.basename(name) == name and name not in ("", ".", ".."):
                    if os.path.isfile(os.path.join(directory, name)):
                        names.append(name)  # pyro2pfp.load names a missing one when it loads the copy
        files = {}
        for name in names:
            with open(os.path.join(directory, name), "rb") as f:
                files[name] = f.read()
        return cls(names[0], files)

    def metadata(self) -> dict[str, Any]:
        """Its library's sidecar (input shape, input variance, target; ``{}`` for an ONNX model or without one)."""
        sidecar = self.files.get(self.name + ".json")
        try:
            info = json.loads(sidecar) if sidecar else {}
        except ValueError:
            return {}
        return info if isinstance(info, dict) else {}

    def input_shape(self) -> tuple[int, ...] | None:
        """The input shape its library's sidecar states (``None`` for an ONNX model or without one)."""
        shape = self.metadata().get("input_shape")
        return tuple(int(d) for d in shape) if isinstance(shape, list) else None

    def write(self, directory: str) -> str:
        """Write the files into ``directory``; returns the main file's path."""
        for name, content in self.files.items():
            with open(os.path.join(directory, name), "wb") as f:
                f.write(content)
        return os.path.join(directory, self.name)


def _sidecar(path: str) -> dict[str, Any]:
    try:
        with open(sidecar_path(path)) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return {}  # pyro2pfp.load reports a missing or broken sidecar
    return info if isinstance(info, dict) else {}


def worker_description() -> str:
    """This machine as a worker: host name, CPU architecture and model."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith(("model name", "Model", "CPU part"))), "")
    except OSError:
        pass
    return f"worker {os.uname().nodename} ({host_arch()}{', ' + model if model else ''})"


_PROBE = """\
import sys
sys.path[:0] = sys.argv[2:]
import pyro2pfp
pyro2pfp.load(sys.argv[1])
"""


def _probe(path: str) -> str | None:
    """Load ``path`` (which runs it once) in a child process: ``None`` if that works, else why not."""
    try:
        child = subprocess.run([sys.executable, "-c", _PROBE, path, *sys.path], capture_output=True, text=True,
                               timeout=600)
    except subprocess.TimeoutExpired:
        return "loading it in a child process did not finish in 600 s"
    if child.returncode == 0:
        return None
    if child.returncode < 0:
        return (f"loading it in a child process crashed (signal {-child.returncode}): the code uses "
                "instructions this CPU lacks")
    lines = [line for line in child.stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"loading it in a child process failed (exit status {child.returncode})"


def _why_not_here(path: str) -> str | None:
    """Why this worker cannot run the library (or ONNX model) at ``path``, or ``None``."""
    if path.lower().endswith(".onnx"):
        return None  # onnxruntime runs it on any CPU; pyro2pfp.load reports a missing onnxruntime
    info = _sidecar(path)
    arch = info.get("target_arch")
    if isinstance(arch, str) and _norm_arch(arch) != host_arch():
        return f"compiled for {arch}"
    target = info.get("target")
    if isinstance(target, dict) and (target.get("mcpu") or target.get("mattr")):
        return _probe(path)  # a CPU-specific build ("native", a board): may use instructions this CPU lacks
    return None


def load_for_this_worker(models: Sequence[str | os.PathLike | ModelFiles], directory: str | None = None,
                         **load_kwargs: Any) -> tuple[Any, str]:
    """``(predictor, path)``: the first of ``models`` this worker can run, loaded with
    :func:`pyro2pfp.load` (see the module docstring for the check).  :class:`ModelFiles` are written to
    ``directory`` first.  A :class:`~pyro2pfp.errors.LoadError` naming the worker and every model's
    reason if none fits."""
    reasons = []
    for i, model in enumerate(models):
        if isinstance(model, ModelFiles):
            if directory is None:
                raise ArgumentError("load_for_this_worker: ModelFiles need a directory to be written to")
            os.makedirs(os.path.join(directory, str(i)), exist_ok=True)
            path = model.write(os.path.join(directory, str(i)))
            shown = model.name
        else:
            path = shown = os.fspath(model)
            if not os.path.isfile(path):
                reasons.append(f"{shown}: not found on this worker (pass ModelFiles.read({shown!r}) to ship "
                               "the files to every worker)")
                continue
        reason = _why_not_here(path)
        if reason is None:
            return load(path, **load_kwargs), path
        reasons.append(f"{shown}: {reason}")
    raise LoadError(f"{worker_description()} can run none of the models: {'; '.join(reasons)}. Give the scorer "
                    f"a library compiled for this CPU (cross-compile one for {host_arch()}, or 'llvm' for any "
                    f"{host_arch()} CPU) or an ONNX model (net.to_onnx), which runs on any CPU")


def _models(model: Any) -> list[str | os.PathLike | ModelFiles]:
    if isinstance(model, str | os.PathLike | ModelFiles):
        return [model]
    if isinstance(model, Sequence) and model and all(isinstance(m, str | os.PathLike | ModelFiles) for m in model):
        return list(model)
    raise ArgumentError(f"Scorer: model must be a library or ONNX path, a ModelFiles, or a non-empty list of "
                        f"them (one per worker architecture), got {model!r}")


def _ray_cpus() -> float | None:
    """The CPUs Ray assigned to this worker, or ``None`` outside a Ray worker."""
    if "ray" not in sys.modules:
        return None
    try:
        import ray

        if not ray.is_initialized():
            return None
        return float(ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)) or None
    except Exception:  # noqa: BLE001 -- not a worker, or an older Ray: leave the threads as they are
        return None


class Scorer:
    """Map a batch of inputs to their PFP outputs and uncertainty (see the module docstring).

    ``model``: a library (``.so``/``.tar``) or ONNX path, a :class:`ModelFiles`, or a list of them (one
    per worker architecture: each worker takes the first it can run).  ``column``: the input column
    (default ``"x"``, or the only column); ``var_column``: the input variance column of a network
    converted with ``input_variance=True`` (default ``"x_var"``).  ``metrics``: add the uncertainty
    columns (``True`` for all of :data:`METRICS`, or a list of them); ``outputs``: the network's own
    columns to keep (default all: ``mean``, ``var``, or for a network with the uncertainty head
    ``probs``, ``total``, ``aleatoric``, ``epistemic``).  ``num_samples``, ``seed``: the metrics'
    logit samples.  ``keep_inputs``: keep the input column(s) in the output (default: dropped).
    ``id_columns``: the columns errors name rows by (default: the other 1-D integer or string columns).
    ``num_threads``: TVM threads of this worker (default: the CPUs Ray assigned it, at least 1;
    outside Ray, unchanged).  ``verify_sha256``: as for :func:`pyro2pfp.load`.

    The instance pickles as its arguments (a copy loads the model again).
    """

    def __init__(self, model: Any, *, column: str | None = None, var_column: str = "x_var",
                 metrics: bool | Sequence[str] = False, outputs: Sequence[str] | None = None,
                 num_samples: int = 100, seed: int = 0, keep_inputs: bool = False,
                 id_columns: Sequence[str] | None = None, num_threads: int | None = None,
                 verify_sha256: bool = True) -> None:
        self._arguments = (model, dict(column=column, var_column=var_column, metrics=metrics, outputs=outputs,
                                       num_samples=num_samples, seed=seed, keep_inputs=keep_inputs,
                                       id_columns=id_columns, num_threads=num_threads,
                                       verify_sha256=verify_sha256))
        models = _models(model)
        if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
            raise ArgumentError(f"Scorer: num_samples must be a positive int, got {num_samples!r}")
        self._directory: str | None = None
        if any(isinstance(m, ModelFiles) for m in models):
            self._directory = tempfile.mkdtemp(prefix="pyro2pfp-scorer-")
            weakref.finalize(self, shutil.rmtree, self._directory, True)
        threads = num_threads
        if threads is None and (cpus := _ray_cpus()) is not None:
            threads = max(1, int(cpus + 0.5))
        if threads is not None:
            os.environ["TVM_NUM_THREADS"] = str(threads)  # read when the thread pool starts (the first call)
        self.exe, self.path = load_for_this_worker(models, self._directory, verify_sha256=verify_sha256)
        if threads is not None and hasattr(self.exe, "vm"):
            set_num_threads(threads)
        self.column, self.var_column = column, var_column
        self.keep_inputs, self.id_columns = keep_inputs, None if id_columns is None else list(id_columns)
        self.input_shape = tuple(self.exe.input_shape)
        self.head = getattr(self.exe, "head", None)
        own = ("probs", "total", "aleatoric", "epistemic") if self.head else LOGIT_OUTPUTS
        self.outputs = list(own if outputs is None else outputs)
        wanted = list(METRICS) if metrics is True else [] if metrics is False else list(metrics)
        if unknown := [m for m in wanted if m not in METRICS]:
            raise ArgumentError(f"Scorer: unknown metrics {unknown}; choose from {list(METRICS)} (or metrics=True)")
        if bad := [o for o in self.outputs if o not in own]:
            raise ArgumentError(f"Scorer: {self.path} outputs {list(own)}, not {bad}")
        self.metrics = [m for m in wanted if m not in self.outputs] if not self.head else []
        self.num_samples, self.seed = num_samples, seed
        self._z: np.ndarray | None = None  # (num_samples, K) standard normal draws, on the first batch

    def __reduce__(self) -> tuple[Any, ...]:
        model, kwargs = self._arguments
        return _rebuild, (type(self), model, kwargs)

    def __repr__(self) -> str:
        return f"Scorer({os.path.basename(self.path)!r}, outputs={self.outputs + self.metrics})"

    # -- one batch --------------------------------------------------------------------------------
    def __call__(self, batch: Any) -> dict[str, np.ndarray]:
        columns = self._columns(batch)
        column = self._input_column(columns)
        x = columns[column]
        rows = len(x)
        id_columns = self._ids(columns, column, rows)
        try:
            inputs = [self._checked(x, column, id_columns, columns)]
            if self.exe.input_variance:
                if self.var_column not in columns:
                    raise InputShapeError(f"this network takes an input variance: the batch needs a column "
                                          f"{self.var_column!r} (Scorer(var_column=...)); it has {list(columns)}")
                inputs.append(self._checked(columns[self.var_column], self.var_column, id_columns, columns))
            out = self.exe(*inputs)
        except PFPError as exc:
            raise self._located(exc, id_columns, columns, rows, x) from exc
        result = {name: value for name, value in columns.items()
                  if self.keep_inputs or name not in (column, self.var_column)}
        if self.head:
            own = dict(zip(("probs", "total", "aleatoric", "epistemic"), out, strict=True))
        else:
            own = dict(zip(LOGIT_OUTPUTS, out, strict=True))
        result.update({name: own[name] for name in self.outputs})
        if self.metrics:
            result.update(self._metrics(*out))
        return result

    def _columns(self, batch: Any) -> dict[str, np.ndarray]:
        if isinstance(batch, np.ndarray):
            return {self.column or "x": batch}
        if isinstance(batch, Mapping):
            return {str(k): np.asarray(v) for k, v in batch.items()}
        if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # a pandas DataFrame
            return {str(c): _stacked(batch[c].to_numpy()) for c in batch.columns}
        raise ArgumentError(f"Scorer: a batch must be a NumPy array or a dict of columns, got {type(batch).__name__} "
                            "(ds.map_batches(..., batch_format='numpy'))")

    def _input_column(self, columns: dict[str, np.ndarray]) -> str:
        if self.column is not None:
            if self.column not in columns:
                raise InputShapeError(f"the batch has no input column {self.column!r}; its columns: {list(columns)}")
            return self.column
        if "x" in columns:
            return "x"
        if len(columns) == 1:
            return next(iter(columns))
        raise InputShapeError(f"the batch has columns {list(columns)}: name the input column, "
                              "Scorer(..., column='image')")

    def _ids(self, columns: dict[str, np.ndarray], column: str, rows: int) -> list[str]:
        if self.id_columns is not None:
            return [c for c in self.id_columns if c in columns]
        return [c for c, v in columns.items() if c not in (column, self.var_column) and v.ndim == 1
                and len(v) == rows and v.dtype.kind in "iuUSO"]

    def _checked(self, x: np.ndarray, name: str, id_columns: list[str], columns: dict[str, np.ndarray]) -> np.ndarray:
        """``x`` as (rows, *input_shape): a column of equal-shaped row arrays (dtype object) stacked,
        size-1 axes added or dropped (nothing else is reshaped)."""
        if x.dtype == object:
            x = _stacked(x)
        if x.shape[1:] != self.input_shape and x.ndim >= 1:
            squeezed = tuple(d for d in x.shape[1:] if d != 1)
            if squeezed == tuple(d for d in self.input_shape if d != 1):
                x = x.reshape(len(x), *self.input_shape)
            else:
                raise InputShapeError(
                    f"column {name!r} holds rows of shape {x.shape[1:]}; the network takes rows of shape "
                    f"{self.input_shape} (store the column as a fixed-shape tensor of that shape)")
        return x

    def _located(self, exc: PFPError, id_columns: list[str], columns: dict[str, np.ndarray], rows: int,
                 x: np.ndarray) -> PFPError:
        """``exc`` again (same type), its message prefixed with the rows it is about."""
        where: dict[str, tuple[Any, Any]] = {}
        bad = _non_finite_rows(x)
        for c in id_columns:
            v = columns[c]
            where[c] = (_plain(v[0]), _plain(v[-1]))
        if where:
            text = "rows " + ", ".join(f"{c}={a}" if a == b else f"{c}={a}…{b}" for c, (a, b) in where.items())
        else:
            text = f"rows 0…{rows - 1} of a batch of {rows} (an id column would name them)"
            where["position"] = (0, rows - 1)
        if bad is not None and len(bad):
            shown = [(_plain(columns[id_columns[-1]][i]) if id_columns else int(i)) for i in bad[:5]]
            text += f"; non-finite values in row(s) {shown}{' …' if len(bad) > 5 else ''}"
        located = type(exc)(f"{text}: {exc}")
        # pickled with the exception (its __dict__): where it happened, for a caller that routes errors
        located.rows = where  # type: ignore[attr-defined]
        located.first_bad = ({c: _plain(columns[c][bad[0]]) for c in id_columns}  # type: ignore[attr-defined]
                             if bad is not None and len(bad) else {})
        return located

    def _metrics(self, mean: np.ndarray, var: np.ndarray) -> dict[str, np.ndarray]:
        """:func:`pyro2pfp.uncertainty`'s metrics from shared logit draws ``z`` (float32 columns)."""
        k = mean.shape[1]
        if self._z is None or self._z.shape[1] != k:
            self._z = np.random.default_rng(self.seed).standard_normal((self.num_samples, k))
        z = self._z
        step = max(1, _SAMPLE_BUDGET // (self.num_samples * max(k, 1)))
        parts: dict[str, list[np.ndarray]] = {m: [] for m in self.metrics}
        for start in range(0, len(mean), step):
            mu = mean[start:start + step].astype(np.float64)
            sd = np.sqrt(var[start:start + step].astype(np.float64))
            metrics = uncertainty_from_logit_samples(mu[None] + sd[None] * z[:, None, :])
            for m in self.metrics:
                parts[m].append(metrics[m].astype(np.float32))
        return {m: np.concatenate(parts[m]) for m in self.metrics}


def _rebuild(cls: type, model: Any, kwargs: dict[str, Any]) -> Scorer:
    return cls(model, **kwargs)


def _stacked(values: np.ndarray) -> np.ndarray:
    """A column of per-row arrays (dtype object) as one array; an :class:`InputShapeError` naming the
    first row whose shape differs."""
    if values.dtype != object:
        return values
    if len(values) == 0:
        raise InputShapeError("the input column is empty")
    first = np.shape(values[0])
    for i, v in enumerate(values):
        if np.shape(v) != first:
            raise InputShapeError(f"the input column holds rows of different shapes ({first} in its first row, "
                                  f"{np.shape(v)} in row {i} of the batch)")
    try:
        return np.stack([np.asarray(v) for v in values])
    except Exception as exc:  # noqa: BLE001 -- objects that are not numbers
        raise InputShapeError(f"the input column cannot be read as numbers ({type(exc).__name__}: {exc})") from None


def _non_finite_rows(x: np.ndarray) -> np.ndarray | None:
    """Positions of the rows holding NaN or inf (float arrays), else ``None``."""
    if not isinstance(x, np.ndarray) or x.dtype.kind != "f" or x.ndim < 1 or not len(x):
        return None
    return np.nonzero(~np.isfinite(x.reshape(len(x), -1)).all(axis=1))[0]


def _plain(value: Any) -> Any:
    """A NumPy scalar as the Python value (for messages and pickling)."""
    return value.item() if isinstance(value, np.generic) else value


