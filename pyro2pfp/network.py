"""The public entry point: :func:`convert` and the :class:`PFPNetwork` it returns."""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from . import correlation as correlation  # registers the shared-factor executor with the reference
from . import ops as ops  # the op registry: every op family registers its converter, reference, ONNX export
from ._version import __version__
from .analysis.fidelity import check_fidelity, spot_check
from .backends.onnx.builder import to_onnx
from .backends.reference import execute
from .correlation import replanned, with_correlation
from .correlation.compact import auto_compact, with_compact
from .correlation.cost import dense_head_caveat
from .correlation.guide_selection import select_guide_directions
from .errors import ArgumentError, InputShapeError, InternalError, PFPError, PFPWarning, PosteriorError
from .frontend.model_args import user_model_args
from .frontend.noise import HeteroscedasticNoise, NoiseModel, tyxe_noise
from .frontend.preserve import preserved
from .frontend.tracing import trace_model
from .frontend.walk import build_layer_graph
from .ops.head import append_head, check_head, head_output, is_head
from .options import Correlation, Head, MaxPool, MomentForm, SharedFactor, checked, correlation_choice
from .planning import folding
from .planning.correlated_pools import correlate_max_pools, pool_caveats
from .planning.graph import LayerGraph, Repr
from .planning.plan import PlannedGraph, plan
from .runtime.inputs import checked_inputs


class PFPNetwork:
    """A converted network: the planned layer graph, its Relax IRModule and a NumPy reference.

    ``net.mod``: ``tvm.IRModule`` whose ``main(x)`` maps ``x: (batch, *input_shape) float32`` to
    ``(mean, var)`` of the logits.  ``net.reference(x)``: the same network in float64 NumPy.
    ``net.compile(target)``: a compiled predictor.  ``print(net)`` shows the layer plan.

    With ``head="probs"`` (``convert(..., head="probs")``) the plan ends in the uncertainty head
    (:mod:`pyro2pfp.ops.head`): ``main`` returns ``(probs (batch, K), stats (batch, 3))`` and
    ``net.reference(x)`` / ``exe(x)`` return a :class:`~pyro2pfp.ops.head.HeadOutput` ``(probs,
    predictive_entropy, expected_entropy, mutual_information)``.  ``net.layer_graph`` stays the
    network up to the logits (re-planning it, e.g. :func:`pyro2pfp.calibrate`, gives the logits).
    """

    def __init__(self, layer_graph: LayerGraph, planned: PlannedGraph, *, fuse: bool = True,
                 nonweight_sites: dict[str, Any] | None = None, noise: Any = None) -> None:
        self.layer_graph = layer_graph
        self.plan = planned
        # Latent sites of the model that do not flow into the network (e.g. a likelihood's noise
        # scale): {site: pyro2pfp.frontend.posterior.SiteReading}.
        self.nonweight_sites = dict(nonweight_sites or {})
        # Regression: the Normal likelihood's noise (pyro2pfp.frontend.noise.NoiseModel), or why there is none.
        self.noise = noise
        self.fuse = fuse  # ReLUs after dense layers computed in the dense kernel (backends.tvm.fused_activations)
        self._mod = None
        self.fidelity: Any = None  # convert(..., check=x): the pyro2pfp.analysis.fidelity.FidelityCheck

    @property
    def head(self) -> str | None:
        """``"probs"`` if the plan ends in the uncertainty head, else None (outputs: the logits)."""
        return "probs" if is_head(self.plan.layer(self.plan.output)) else None

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.plan.input_shape

    @property
    def input_variance(self) -> bool:
        return self.plan.input_repr is not Repr.DETERMINISTIC

    @property
    def calibration(self) -> float:
        return self.plan.calibration

    @property
    def mod(self):
        """The Relax IRModule (built on first access; importing TVM takes a few seconds)."""
        return self.module()

    def module(self, on_kernel: Callable[[str, Any], None] | None = None):
        """:attr:`mod`; if it is not built yet, it is built now and ``on_kernel(name, prim_func)`` is
        called with each kernel as soon as it is emitted (``net.compile`` schedules and compiles
        kernels while the rest of the module is emitted)."""
        if self._mod is None:
            from .backends.tvm import emit_module  # TVM's compiler: seconds to import, not needed to convert

            self._mod = emit_module(self.plan, fuse=self.fuse, on_kernel=on_kernel)
        return self._mod

    def reference(self, x: Any, x_var: Any = None) -> Any:
        """Float64 NumPy execution: ``(mean, var)`` of the logits, each (batch, classes); with the
        head, a :class:`~pyro2pfp.ops.head.HeadOutput`."""
        arrays = checked_inputs(x, x_var, self.input_shape, self.input_variance, np.float64)
        out = execute(self.plan, arrays[0], arrays[1] if len(arrays) > 1 else None)
        if self.head is not None:
            return head_output(*out)
        return out

    def compile(self, target: Any = "native", *, tune: Any = None, schedule: bool = True,
                num_threads: int | None = None, remote: Any = None, batch_sizes: Any = ()):
        """Compile ``mod`` for ``target``: ``"native"`` (default: this machine's CPU and its full
        instruction set, e.g. AVX-512), ``"llvm"`` (generic x86-64: SSE2 only, portable, slower),
        a board preset (``"aarch64"``, ``"rpi3"``, ``"rpi4"``, ``"rpi5"``), a TVM tag, a dict or a
        ``tvm.target.Target``.

        Returns a :class:`~pyro2pfp.backends.tvm.runtime.CompiledPFP`: ``exe(x) -> (mean, var)``
        as float32 NumPy arrays, any batch size, every kernel with its default CPU schedule;
        ``exe.profile(x)`` times each kernel; ``exe.export_library("net.so")`` writes it for
        ``pyro2pfp.load`` (with every batch-specialised executable below, as ``net.batch<B>.so``
        files listed in the sidecar).  For another CPU architecture the predictor only exports
        (and uploads to a board, :mod:`pyro2pfp.runtime.remote`).

        ``tune``: also auto-tune with MetaSchedule for the batch sizes named -- ``tune=10``,
        ``tune=[1, 10]`` or ``tune={"batch": 10, "trials": 64, "work_dir": ...}`` (see
        :func:`pyro2pfp.backends.tvm.tuning.tune`).  Tuning results are cached on disk (keyed by network
        structure, target and batch: the second compile reuses them); calls with a tuned batch
        size run the tuned executable, each kernel the fastest correct of its tuned and default
        schedules.  ``num_threads``: TVM threads (process-wide, default: the physical cores).
        ``schedule=False`` skips the default CPU schedules (naive loops; for debugging).
        ``remote``: with ``tune``, measure the candidates on boards through TVM RPC --
        ``"tracker-host:9190/rpi4"``, ``"server-host:9090"`` or a :class:`pyro2pfp.runtime.remote.Remote`
        (the tuning database is then keyed by the board key as well as the target); the only way
        to tune for another CPU architecture (candidates built here, measured on the board).
        ``batch_sizes``: e.g. ``batch_sizes=[1]`` -- also build a static-shape executable (default
        schedules) for each batch size named; calls with that batch size run it (fewer VM
        instructions per call, which matters at small batches, where the call's overhead is a larger share;
        ``benchmarks/latency.py --static`` compares them).  Costs one more build per size.  Works for cross
        targets too (the executables are exported with the library).
        """
        from .backends.tvm.compile import compile_network  # TVM's compiler: not needed to convert

        if remote is not None:
            from .backends.tvm.tuning import with_remote  # TVM's compiler: not needed to convert

            tune = with_remote(tune, remote)
        return compile_network(self, target, schedule=schedule, tune=tune, num_threads=num_threads,
                               batch_sizes=batch_sizes)

    def regression(self, mean: Any, var: Any) -> dict[str, np.ndarray]:
        """The predictive distribution of a regression model's observation from the network's output
        (``net.reference(x)`` or the compiled ``exe(x)``): ``{"mean", "epistemic", "aleatoric",
        "total"}``, with ``epistemic`` = PFP's variance of the mean (from the weights), ``aleatoric`` =
        E[sigma²] of the Normal likelihood (input-independent, see :mod:`pyro2pfp.frontend.noise`) and
        ``total`` = their sum (law of total variance)."""
        if isinstance(self.noise, HeteroscedasticNoise):
            return self.noise.predictive(mean, var)
        if not isinstance(self.noise, NoiseModel):
            reason = getattr(self.noise, "reason", "no likelihood was found")
            raise PosteriorError(f"this network has no regression noise model: {reason}")
        mean, var = np.asarray(mean, dtype=np.float64), np.asarray(var, dtype=np.float64)
        try:
            noise = self.noise.expected_variance
            aleatoric = np.broadcast_to(noise.reshape(()) if noise.size == 1 else noise.reshape(-1), var.shape[1:])
        except ValueError as exc:
            raise InputShapeError(f"the noise variance has shape {self.noise.expected_variance.shape}, the "
                                  f"network's output {var.shape[1:]}: they do not broadcast") from exc
        aleatoric = np.broadcast_to(aleatoric, var.shape).copy()
        return {"mean": mean, "epistemic": var, "aleatoric": aleatoric, "total": var + aleatoric}

    def to_onnx(self, path: Any = None, *, opset: int = 17):
        """Write the network as an ONNX model (standard operators; inputs ``x`` [, ``x_var``],
        outputs ``mean``, ``var``; dynamic batch), checked with ``onnx.checker``; returns the
        ``onnx.ModelProto``."""
        return to_onnx(self, path, opset=opset)

    def summary(self) -> str:
        """The layer plan as a table."""
        text = self.plan.summary()
        if self.head is not None:
            text += ("\nhead: the module outputs (probs, [predictive_entropy, expected_entropy, mutual_information]) "
                     "instead of the logits' (mean, variance)")
        return text

    def __repr__(self) -> str:
        return f"PFPNetwork(input_shape={self.input_shape}, layers={len(self.plan.layers)})\n{self.summary()}"


def convert(model: Any, guide: Any = None, *, input_shape: tuple[int, ...] | None = None,
            calibration: float = 1.0, moment_form: MomentForm | str = MomentForm.VARIANCE,
            input_variance: bool = False, check_posterior: bool = True,
            fold_batch_norm: bool = True, correlation: Correlation | SharedFactor | str = Correlation.AUTO,
            head: Head | str | None = None, max_pool: MaxPool | str = MaxPool.CORRELATED, check: Any = None,
            example_args: tuple | None = None, example_kwargs: dict[str, Any] | None = None) -> PFPNetwork:
    """Convert a Pyro BNN (``model`` and its trained ``guide``) into a PFP network.

    Traces ``model`` over a deterministic copy holding the posterior means, reads the posterior
    variances from ``guide`` through its own API and the param store, maps the traced torch ops to PFP
    layers, plans the representation of every edge and the correlation scheme, and ends with a spot
    check against guide samples.  Converting runs the model and the guide but leaves the model, the
    guide, the modules their code uses, the param store and the global random state as it found them,
    on success and on failure (:mod:`pyro2pfp.frontend.preserve`).  What each option changes and when
    to pick another value: ``docs/options.md``.

    Parameters
    ----------
    model
        The Pyro model: a ``PyroModule``, a module whose ``forward`` calls ``pyro.module`` /
        ``random_module``, or a TyXe ``VariationalBNN`` (then ``guide`` may be omitted: its ``net``
        and ``net_guide`` are used).
    guide
        The trained guide (``AutoNormal``, another autoguide, or a hand-written guide whose weights
        are ``Normal`` sample sites).  The posterior is the one the param store holds at the moment of
        the call: a guide that has not run since the store was loaded or set is first brought in line
        with it.
    input_shape
        The shape of one input without the batch dimension; may be omitted when the first layer is a
        Linear layer or ``example_args`` is given.
    calibration
        Factor on every weight and bias variance (``pyro2pfp.calibrate`` finds one).
    moment_form
        ``"variance"`` (default): variances on every edge, cancellation-free in float32; ``"raw"``:
        the paper's plan (raw second moments into compute layers).  A :class:`~pyro2pfp.options.MomentForm`
        or its string.
    input_variance
        ``True``: the network's ``main`` takes ``(x, x_var)`` and propagates input (sensor) noise.
    check_posterior
        ``False`` skips the check of one guide sample against what was read (for guides that cannot be
        sampled with the model's input alone).
    fold_batch_norm
        ``True`` (default): every eval-mode batch norm after a Linear/Conv layer is folded into that
        layer's weight and bias moments (exact, :mod:`pyro2pfp.planning.folding`).
    correlation
        How the noise shared between activations is treated: ``"auto"`` (default: chosen per network,
        with its reason in ``net.summary()``), ``"mean-field"`` (every element independent, the paper),
        ``"shared-factor"``, ``"compact-factor"``, or a :class:`~pyro2pfp.options.SharedFactor` with the
        shared-factor scheme's variants.  ``net.plan.correlation`` tells which was chosen.
    head
        ``None`` (default): the logits' mean and variance; ``"probs"``: the class probabilities and the
        predictive entropies computed in the same pass (:mod:`pyro2pfp.ops.head`; the output must be a
        vector of logits per input).
    max_pool
        ``"correlated"`` (default): a max pool fed by a conv folds Clark's max of its window's
        correlated Gaussians; ``"independent"``: the paper's rule.
    check
        ``None`` (default): the spot check (deterministic parameters against the param store, 64 guide
        samples on two inputs against the network's reference within gross bounds; a
        :class:`~pyro2pfp.errors.FidelityError` names the first layer that departs); ``False``: no check;
        an input batch ``x``: the careful check on those inputs (150 guide samples, layer by layer; a
        :class:`~pyro2pfp.errors.FidelityWarning` names the first layer that parts from sampling).
        ``net.fidelity`` holds the figures (:mod:`pyro2pfp.analysis.fidelity`).
    example_args, example_kwargs
        The arguments of one call of the model and guide (the input batch first), for models and guides
        that need more than the input (labels, sizes); the labels never enter the network.  Without them
        the model and guide are called with a batch of zeros and ``None`` for further required parameters.

    Returns
    -------
    PFPNetwork
        ``net.reference(x)`` (float64 NumPy), ``net.compile(target)`` (TVM), ``net.to_onnx(path)``,
        ``net.summary()`` (the plan), ``net.fidelity`` (the check's figures).

    Raises
    ------
    PFPError
        Every failure is a subclass naming the module, site, line or shape, the cause and the remedy:
        :class:`~pyro2pfp.errors.ArgumentError` (an option's value),
        :class:`~pyro2pfp.errors.UnsupportedLayerError` (an op without a PFP rule),
        :class:`~pyro2pfp.errors.TracingError`, :class:`~pyro2pfp.errors.PosteriorError` (the guide or
        the param store), :class:`~pyro2pfp.errors.FidelityError` (the spot check).
    """
    with preserved(model, guide):  # the user's objects, the param store, the random state: as found
        stage = "checking the arguments"
        try:
            head = check_head(head)
            moment_form = checked(MomentForm, moment_form)
            correlation, factor_options = correlation_choice(correlation)
            max_pool = checked(MaxPool, max_pool)
            if not isinstance(input_variance, bool | np.bool_):
                raise ArgumentError(f"input_variance must be True or False, got {input_variance!r}")
            tyxe_bnn, model, guide = _model_and_guide(model, guide)
            example = user_model_args(example_args, example_kwargs, input_shape)
            stage = "reading the posterior and tracing the model"
            traced = trace_model(model, guide, input_shape, check_posterior=check_posterior, example=example)
            if not isinstance(fold_batch_norm, bool | np.bool_):
                raise ArgumentError(f"fold_batch_norm must be True or False, got {fold_batch_norm!r}")
            stage = "converting the traced graph into layers"
            layer_graph, noise = _layers_and_noise(traced, tyxe_bnn, bool(input_variance), bool(fold_batch_norm),
                                                   head)
            # a correlated guide: the directions that carry the logits' variance
            select_guide_directions(layer_graph, example[0] if example is not None and example.given and
                                    len(example) > 0 else None)
            stage = "planning the network"
            layer_graph, planned = _planned_network(layer_graph, head, calibration, moment_form, correlation,
                                                    factor_options, max_pool)
            net = PFPNetwork(layer_graph, planned, nonweight_sites=traced.nonweight_sites, noise=noise)
            if check is not False:
                stage = ("checking the network against samples of the guide (the spot check)"
                         if check is None or check is True else "checking the network against sampling")
                _check_network(net, model, guide, check, traced, example)
            return net
        except (PFPError, Warning):  # a Warning: the user's warnings filter made one an error
            raise
        except Exception as exc:  # not a mistake of the user's that pyro2pfp recognises: a bug
            raise InternalError(
                f"internal error while {stage} -- please report it with the model's code (pyro2pfp "
                f"{__version__}): {type(exc).__name__}: {exc}. The original exception is chained.") from exc



def _model_and_guide(model: Any, guide: Any) -> tuple[Any, Any, Any]:
    """``(tyxe_bnn, model, guide)``: a TyXe ``VariationalBNN`` passed alone becomes its ``net`` and ``net_guide``
    (``tyxe_bnn`` None otherwise); a missing guide is an error."""
    tyxe_bnn = None
    if guide is None and hasattr(model, "net") and hasattr(model, "net_guide"):  # TyXe VariationalBNN
        tyxe_bnn, model, guide = model, model.net, model.net_guide
    if guide is None:
        raise PosteriorError("convert(model, guide) needs the trained guide that holds the posterior: "
                             "pass the guide trained with SVI as the second argument (a TyXe "
                             "VariationalBNN may be passed alone)")
    return tyxe_bnn, model, guide


def _check_network(net: PFPNetwork, model: Any, guide: Any, check: Any, traced: Any, example: Any) -> None:
    """``net.fidelity`` from the spot check (``check`` None or True; not for a network with an input variance)
    or the careful check on the inputs ``check``."""
    if check is None or check is True:
        if not net.input_variance:
            net.fidelity = spot_check(net, model, guide, traced=traced, args=example)
    else:
        net.fidelity = check_fidelity(net, model, guide, check, traced=traced, args=example)

def _layers_and_noise(traced: Any, tyxe_bnn: Any, input_variance: bool, fold_batch_norm: bool,
                      head: str | None) -> tuple[LayerGraph, Any]:
    """The layer graph of a traced model (batch norms folded if asked) and its likelihood's noise model
    (a TyXe BNN's from its ``likelihood``, which is outside ``bnn.net``, also marked on ``traced`` when it is
    Gaussian); a head needs a classifier."""
    if tyxe_bnn is not None:
        traced.tyxe_gaussian_likelihood = type(getattr(tyxe_bnn, "likelihood", None)).__name__ in (
            "HomoskedasticGaussian", "HeteroskedasticGaussian")
    layer_graph = build_layer_graph(traced)
    layer_graph.input_variance = input_variance
    if fold_batch_norm:
        layer_graph = folding.fold_batch_norm(layer_graph)
    noise = traced.noise
    if tyxe_bnn is not None and hasattr(tyxe_bnn, "likelihood"):
        output_shape = layer_graph.shape_of(layer_graph.output)
        noise = tyxe_noise(tyxe_bnn, traced.input_shape, tuple(output_shape))
    if head is not None and isinstance(noise, NoiseModel | HeteroscedasticNoise):
        raise ArgumentError(f"head={head!r} is for classifiers (logits); this model has a Normal likelihood "
                            "(regression): use net.regression(mean, var) instead")
    return layer_graph, noise


def _planned_network(layer_graph: LayerGraph, head: str | None, calibration: float, moment_form: str,
                     correlation: Any, factor_options: dict[str, Any], max_pool: str
                     ) -> tuple[LayerGraph, PlannedGraph]:
    """The representation plan of ``layer_graph`` (with ``head`` appended) and its correlation scheme; max pools
    fed by a conv folded into their correlated form where ``max_pool`` says so (the layer graph returned is the
    rewritten one).  Warns where a pool's or the dense head's correlation is not carried."""
    planned_graph = append_head(layer_graph, head) if head is not None else layer_graph
    planned = with_correlation(plan(planned_graph, calibration, moment_form), correlation, **factor_options)
    caveat = dense_head_caveat(planned) if correlation == "auto" and planned.factors is None else None
    if max_pool == "correlated":
        rewritten = correlate_max_pools(layer_graph, shared=planned.factors is not None)
        if rewritten is not layer_graph:
            layer_graph = rewritten
            planned_graph = append_head(layer_graph, head) if head is not None else layer_graph
            planned = replanned(plan(planned_graph, calibration, moment_form), planned.factors)
        for note in pool_caveats(layer_graph, shared=planned.factors is not None):
            warnings.warn(f"{note}. Measure it with convert(..., check=x) or pyro2pfp.diagnosis.",
                          PFPWarning, stacklevel=4)
    planned = with_compact(planned, correlation)
    if caveat is not None:  # auto: the compact factor plan where its cost model accepts it, else a warning
        planned.factors, why_not = auto_compact(planned)
        if planned.factors is None:
            warnings.warn(f"{caveat}; {why_not}", PFPWarning, stacklevel=4)
    return layer_graph, planned
