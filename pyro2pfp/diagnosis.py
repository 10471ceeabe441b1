"""Per-layer fidelity of PFP against Monte Carlo: where do the propagated moments part from sampling?

:func:`diagnose` draws ``num_samples`` weight sets from the guide, runs each through the traced torch
model and compares every planned layer's Monte Carlo mean and variance with the float64 NumPy
reference of the PFP plan; the figures (mean error as median/p90 over elements with a floored sd,
variance ratio median/p10/p90) are defined in :mod:`pyro2pfp.analysis.mc_compare`, which does the work.

Importing this module is cheap (NumPy only): ``import pyro2pfp`` imports it; torch and Pyro come with the
first call, and the names re-exported from :mod:`pyro2pfp.analysis.mc_compare` (``layer_fidelity``,
``Diagnosis``, ...) when first read.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import PFPError, converter_not_installed
from .options import Correlation, SharedFactor

if TYPE_CHECKING:
    from .analysis.mc_compare import SD_FLOOR, Diagnosis, LayerFidelity, compare, layer_fidelity, model_and_guide
    from .network import PFPNetwork

__all__ = ["SD_FLOOR", "Diagnosis", "LayerFidelity", "compare", "diagnose", "layer_fidelity", "model_and_guide"]

#: Re-exported from :mod:`pyro2pfp.analysis.mc_compare` (which imports torch) when first read (PEP 562).
_FROM_MC_COMPARE = ("SD_FLOOR", "Diagnosis", "LayerFidelity", "compare", "layer_fidelity", "model_and_guide")


def __getattr__(name: str) -> Any:
    if name in _FROM_MC_COMPARE:
        value = getattr(importlib.import_module(".analysis.mc_compare", __package__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def diagnose(model: Any, guide: Any, x: Any, *, num_samples: int = 300, input_shape: tuple[int, ...] | None = None,
             calibration: float = 1.0, net: PFPNetwork | None = None, seed: int = 0, per_layer: bool = True,
             execute: Any = None, correlation: Correlation | SharedFactor | str = Correlation.AUTO) -> Diagnosis:
    """Compare every planned layer's PFP moments with Monte Carlo over the guide's samples.

    Leaves the model, the guide, the param store and the random number generators (torch, NumPy,
    Python) as it found them.  Layers inserted by the planner (representation conversions) and layers
    that share a traced node with a later one are not listed.  The figures are defined in
    :mod:`pyro2pfp.analysis.mc_compare`.

    Parameters
    ----------
    model, guide
        As for :func:`pyro2pfp.convert` (a TyXe ``VariationalBNN`` may be passed alone).
    x
        A batch of inputs ``(B, *input_shape)``.
    num_samples
        Guide samples.
    input_shape
        Defaults to ``x.shape[1:]``.
    calibration, correlation
        As for :func:`pyro2pfp.convert`, when ``net`` is not given.
    net
        An already converted :class:`~pyro2pfp.PFPNetwork` of ``(model, guide)``: its plan is diagnosed,
        whatever its calibration and correlation scheme (no conversion).
    seed
        Seeds the guide samples.
    per_layer
        ``False`` records only the output (logits): faster; ``layers`` then holds the output layer alone.
    execute
        ``execute(plan, x) -> {layer: Activation}`` replaces the NumPy reference
        (:func:`pyro2pfp.backends.reference.execute_all`, which runs the plan's correlation scheme) as the
        PFP side.

    Returns
    -------
    Diagnosis
        Per-layer rows in plan order (``print`` shows the table).
    """
    try:
        # torch and Pyro: `import pyro2pfp` loads neither
        import pyro.util

        from .analysis.mc_compare import compare, model_and_guide, restored_rng
        from .network import convert
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] == __package__:
            raise
        raise converter_not_installed("pyro2pfp.diagnose", exc) from None

    if num_samples < 2:
        raise PFPError(f"diagnose needs num_samples >= 2, got {num_samples}")
    model, guide = model_and_guide(model, guide)
    if net is None:
        if input_shape is None:
            input_shape = tuple(np.shape(x)[1:])
        with restored_rng(pyro.util.get_rng_state()):
            net = convert(model, guide, input_shape=input_shape, calibration=calibration, correlation=correlation)
    return compare(net, model, guide, x, num_samples=num_samples, seed=seed, per_layer=per_layer, execute=execute)
