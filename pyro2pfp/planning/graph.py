"""The layer graph: plain data passed between the pipeline stages.

trace → **layer graph** → representation plan → (Relax emitter | NumPy executor).

A :class:`LayerGraph` is a topologically ordered list of :class:`Layer` s.  Every layer names
its inputs by the names of the layers that produce them (the network input is called
``"input"``), carries plain-Python attributes (stride, padding, …) and its parameters as
independent Gaussians (:class:`GaussianParam`, mean and variance in float64, torch layout).
Shapes never include the batch dimension.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

INPUT = "input"


class Repr(enum.Enum):
    """How the second component of an activation's (mean, second) pair is represented.

    * ``DETERMINISTIC``: the activation is known exactly; only the mean is carried (variance 0).
    * ``VARIANCE``: ``second = var = E[x²] − E[x]²``.
    * ``SECOND_MOMENT``: ``second = E[x²] = mean² + var`` (the raw moment).
    """

    DETERMINISTIC = "deterministic"
    VARIANCE = "variance"
    SECOND_MOMENT = "second moment"

    def __str__(self) -> str:  # used in summaries
        return self.value


@dataclass(frozen=True)
class GaussianParam:
    """A parameter tensor with Gaussian entries: ``N(mean, var)`` elementwise.

    ``var`` is all zeros for a deterministic parameter.  Arrays are float64, torch layout.
    ``factors`` (the shape + ``(k,)``, or None): the entries' covariances with the guide's global
    factors ``z ~ N(0, I_k)`` (a correlated guide, :mod:`pyro2pfp.frontend.posterior.correlated`), so that
    ``w = mean + factors·z + rest`` with an independent ``rest`` of variance ``var − Σ_f factors²``.
    """

    mean: np.ndarray
    var: np.ndarray
    site: str | None = None  # the Pyro sample site it came from; None for a deterministic parameter
    factors: np.ndarray | None = None
    # A deterministic parameter the param store holds: its name there (the values are the store's) and
    # whether the user's module object held other values (a module that is stale in a fresh process).
    store: str | None = None
    stale: bool = False

    def __post_init__(self) -> None:
        if self.mean.shape != self.var.shape:
            raise ValueError(f"mean shape {self.mean.shape} != var shape {self.var.shape}")
        if self.factors is not None and self.factors.shape[:-1] != self.mean.shape:
            raise ValueError(f"factors shape {self.factors.shape} does not extend mean shape {self.mean.shape}")

    @property
    def is_deterministic(self) -> bool:
        return not np.any(self.var)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.mean.shape)

    def mapped(self, fn: Any, scale: np.ndarray | None = None) -> GaussianParam:
        """The parameter under a linear map ``fn`` of its entries (a reshape, transpose, zero padding: any
        function of an array whose leading axes are the parameter's), optionally times ``scale``
        (broadcast against the mapped mean): mean and factors are mapped, the variance by ``fn`` and
        ``scale²``.  The factors' trailing axis rides along as the last axis."""
        mean, var = fn(self.mean), fn(self.var)
        factors = None
        if self.factors is not None:
            moved = np.moveaxis(self.factors, -1, 0)
            factors = np.moveaxis(np.stack([fn(f) for f in moved]), 0, -1)
        if scale is not None:
            mean, var = mean * scale, var * scale * scale
            factors = None if factors is None else factors * scale[..., None]
        return GaussianParam(mean, var, site=self.site, factors=factors)


@dataclass(frozen=True)
class GuideFactorInfo:
    """What a correlated guide's global factors are (their loadings live in the parameters'
    :attr:`GaussianParam.factors`): ``k`` factors in the loadings of the guide's ``rank`` directions, ``keep``
    of them to carry (``keep < k``: candidates that convert selects from by the logits' variance), ``kept``
    the share they carry -- of the logits' variance due to the guide's correlated part when ``at_logits``
    (measured over the ``measured`` candidate directions), else of its covariance between weights (1:
    exact) -- and ``source`` the guide."""

    k: int
    rank: int
    kept: float
    source: str
    keep: int = 0
    at_logits: bool = False
    measured: int = 0

    def describe(self) -> str:
        if self.k == self.rank or (self.kept >= 1.0 and not self.at_logits):
            return f"{self.source}: {self.k} global factors (its covariance between weights, exact)"
        if self.at_logits:
            return (f"{self.source}: the {self.k} of {self.rank} directions that carry the most of the logits' "
                    f"variance as global factors ({100 * self.kept:.1f} % of the logit variance of its top "
                    f"{self.measured} directions kept, at the network's linearisation; the rest independent)")
        return (f"{self.source}: the top {self.k} of {self.rank} directions as global factors "
                f"({100 * self.kept:.0f} % of its covariance between weights kept, the rest independent)")


@dataclass
class Layer:
    """One PFP operation.

    ``op`` is the PFP operator (``dense``, ``conv2d``, ``relu``, ``max_pool2d``, ``reshape``,
    ``convert``, …); ``source`` says where it came from (module path and torch op) for errors and
    summaries.
    """

    name: str
    op: str
    inputs: list[str]
    out_shape: tuple[int, ...]
    source: str
    attrs: dict[str, Any] = field(default_factory=dict)
    params: dict[str, GaussianParam] = field(default_factory=dict)
    note: str = ""  # what the planner changed about this layer, for the plan summary


@dataclass
class LayerGraph:
    """A traced network: input shape (without batch), layers in topological order, output name."""

    input_shape: tuple[int, ...]
    layers: list[Layer]
    output: str
    input_variance: bool = False  # whether the network input carries a variance (sensor noise)
    origins: dict[str, str] = field(default_factory=dict)  # layer name → traced fx node it computes
    guide_factors: GuideFactorInfo | None = None  # a correlated guide's global factors (GaussianParam.factors)

    def layer(self, name: str) -> Layer:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(name)

    def consumers(self, name: str) -> list[Layer]:
        return [layer for layer in self.layers if name in layer.inputs]

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self.input_shape if name == INPUT else self.layer(name).out_shape
