"""The string options of :func:`pyro2pfp.convert` and of the shared-factor plan, one Enum each.

Every option takes either a member (``correlation=pyro2pfp.Correlation.MEAN_FIELD``) or its string
(``correlation="mean-field"``); the members *are* strings (:class:`enum.StrEnum`: ``str`` Enums whose
``str()`` is the value), so the two are interchangeable and give the same network.  The tuples the modules check against
(``CORRELATIONS``, ``MOMENT_FORMS``, ...) are derived from these Enums, so this module is the one
list of allowed values; :func:`checked` turns a value into its plain string, or raises an
:class:`~pyro2pfp.errors.ArgumentError` that names the option, the value, the allowed values and
what to pass instead.  The options are explained with their trade-offs in ``docs/options.md``.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Any

from .errors import ArgumentError


class Correlation(StrEnum):
    """How the noise shared between activations is treated (``convert(..., correlation=...)``,
    :mod:`pyro2pfp.correlation`)."""

    AUTO = "auto"
    """Shared factors where mean-field would under-state the output variance -- the network averages
    positions of a conv output or adds two noisy residual branches -- and mean-field otherwise (MLPs,
    LeNet-5), falling back to mean-field with a warning when an op has no shared-factor rule.  The
    default; ``net.plan.correlation`` tells which was chosen."""

    SHARED_FACTOR = "shared-factor"
    """Always shared factors: beside each edge's moments, per-channel factors for the noise shared by
    the positions of a conv channel and by the branches of a residual add (one pass, no sampling).
    Use it to force the scheme; an op without a rule raises an ``ArgumentError`` naming the layer."""

    MEAN_FIELD = "mean-field"
    """Every activation element independent (the paper's PFP): the cheapest plan, exact for
    sums whose terms are independent; use it to reproduce the paper or to compare with the scheme."""

    COMPACT_FACTOR = "compact-factor"
    """Mean-field with correlated max pools, plus a few explicit factors where a CNN's dense head sums
    correlated elements: the last convs' weight noise per output channel, and the input noise of a dense
    layer whose units a later dense layer sums (:mod:`pyro2pfp.correlation.compact`).  Every back end runs
    it (reference, compiled, ONNX); ``auto`` picks it where a dense layer sums conv positions and its cost
    model accepts it."""


class MomentForm(StrEnum):
    """Which second moment the compute layers take (``convert(..., moment_form=...)``)."""

    VARIANCE = "variance"
    """Every edge carries variances and compute layers use the variance-input form, whose terms are
    all non-negative: no cancellation in float32, an exact zero variance in the deterministic limit.
    The default; use it unless reproducing the paper."""

    RAW = "raw"
    """The paper's plan: compute layers take raw second moments (``E[w²]`` precomputed).  In float32
    it loses variances below about ``1e-7·mean²`` (cancellation), so narrow SVI posteriors lose
    digits; use it only to reproduce the paper."""


class MaxPool(StrEnum):
    """The rule of max pooling in mean-field plans (``convert(..., max_pool=...)``,
    :mod:`pyro2pfp.planning.correlated_pools`)."""

    CORRELATED = "correlated"
    """Where a conv feeds the pool (directly or through a non-decreasing activation, then applied
    after the pool: an exact rewrite), Clark's max of the window's correlated Gaussians, their
    covariances computed from the conv.  The default: neighbouring conv outputs are strongly
    correlated, and treating them as independent over-states the mean of the max."""

    INDEPENDENT = "independent"
    """Every pool treats its window's taps as independent (the paper's rule, no extra convolution);
    it under-states the variance after a pool when the posterior is wide.  Use it to reproduce the
    paper or to save the covariance convolutions."""


class Head(StrEnum):
    """What the network outputs (``convert(..., head=...)``; ``None``, the default, is the logits'
    mean and variance)."""

    PROBS = "probs"
    """Append the uncertainty head (:mod:`pyro2pfp.ops.head`): the class probabilities and, per
    input, the predictive entropy, the expected entropy and the mutual information, in the same
    compiled pass (a fixed moment-matched quadrature of the logits, no sampling).  Use it for
    classifiers whose users want probabilities and uncertainty rather than logit moments."""


class Hermite(StrEnum):
    """Whether each ReLU adds a factor block for its second Hermite term (shared-factor plans,
    :func:`pyro2pfp.correlation.plan_factors`)."""

    FACTOR = "factor"
    """Each ReLU (and LeakyReLU) with a shared input adds one factor per channel for its second
    Hermite term, the part of its output noise the linear (Stein) response misses.  The default:
    it keeps the logit variance of deep residual nets closest to sampling."""

    NONE = "none"
    """Only the linear response: fewer factor columns and less arithmetic, at some loss of the shared
    variance after each ReLU; a cheaper variant, compiled and exported like the default
    (``benchmarks/fidelity.py --variants`` compares it with sampling)."""


class Injection(StrEnum):
    """How a noisy compute layer's weight noise enters its shared profile (shared-factor plans,
    :func:`pyro2pfp.correlation.plan_factors`)."""

    REGRESSION = "regression"
    """The profile of the layer's new factor is the exact covariance of each output position with it
    (given the closure): one more convolution, of the weight variances with the input's mean and
    shared profile.  The default."""

    RESCALED = "rescaled"
    """The mean-field weight-variance term's square root, rescaled to the same spatial mean: no extra
    convolution (the compiled conv kernel hands the term it computes anyway to the factor rule), a
    coarser profile and so a somewhat lower shared variance on deep nets
    (``benchmarks/fidelity.py --injections rescaled`` compares it with sampling)."""


@dataclass(frozen=True)
class SharedFactor:
    """``correlation="shared-factor"`` with the factor plan's variants spelled out:
    ``convert(model, guide, correlation=pyro2pfp.SharedFactor(injection="rescaled"))``.

    ``SharedFactor()`` is the same as ``correlation="shared-factor"``.  The fields take a member of
    :class:`Hermite` / :class:`Injection` or its string, checked on construction (an
    :class:`~pyro2pfp.errors.ArgumentError` names the field and the allowed values)."""

    hermite: Hermite | str = Hermite.FACTOR
    """Whether each ReLU adds a factor block for its second Hermite term (:class:`Hermite`)."""

    injection: Injection | str = Injection.REGRESSION
    """How a compute layer's weight noise enters its shared profile (:class:`Injection`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "hermite", checked(Hermite, self.hermite))
        object.__setattr__(self, "injection", checked(Injection, self.injection))

    def factor_options(self) -> dict[str, str]:
        """The keywords of :func:`pyro2pfp.correlation.plan_factors` this choice stands for."""
        return {"hermite": str(self.hermite), "injection": str(self.injection)}


def correlation_choice(value: Any) -> tuple[str, dict[str, str]]:
    """``(scheme, factor options)`` of a ``correlation=`` argument: a :class:`SharedFactor` gives
    ``("shared-factor", its options)``, a :class:`Correlation` member or string gives ``(its string,
    {})``; anything else raises the :func:`checked` error."""
    if isinstance(value, SharedFactor):
        return Correlation.SHARED_FACTOR.value, value.factor_options()
    return checked(Correlation, value), {}


def values(option: type[Enum]) -> tuple[str, ...]:
    """The allowed strings of ``option``, in declaration order (the default first; ``head``'s default
    is ``None``, which is not among them)."""
    return tuple(member.value for member in option)


#: what each option is called as a keyword argument
NAMES: dict[type[Enum], str] = {Correlation: "correlation", MomentForm: "moment_form", MaxPool: "max_pool",
                                Head: "head", Hermite: "hermite", Injection: "injection"}


def checked(option: type[Enum], value: Any) -> str:
    """``value`` -- a member of ``option`` or one of its strings -- as the plain string.

    A plain ``str`` is returned (not the member) so that the plan, the messages and the exported
    metadata hold the same value whichever form the caller passed.  Anything else raises an
    :class:`~pyro2pfp.errors.ArgumentError` naming the option, the value, the allowed values and the
    remedy."""
    try:
        return str(option(value).value)
    except (ValueError, TypeError):
        raise _refused(option, value) from None


def checked_or_none(option: type[Enum], value: Any, none_means: str) -> str | None:
    """:func:`checked` for an option whose default is ``None`` (``none_means`` says what ``None``
    does, for the message)."""
    if value is None:
        return None
    try:
        return str(option(value).value)
    except (ValueError, TypeError):
        raise _refused(option, value, none_means) from None


def _refused(option: type[Enum], value: Any, none_means: str | None = None) -> ArgumentError:
    name, allowed = NAMES[option], values(option)
    accepted = f"None ({none_means}) or one of {allowed}" if none_means else f"one of {allowed}"
    first = next(iter(option))
    return ArgumentError(f"{name} must be {accepted}, got {value!r}: pass one of these strings or a member of "
                         f"pyro2pfp.{option.__name__} ({name}=pyro2pfp.{option.__name__}.{first.name} is the same "
                         f"as {name}={first.value!r})")
