"""Per-layer fidelity of PFP against Monte Carlo: where do the propagated moments part from sampling?

:func:`diagnose` draws ``num_samples`` weight sets from the guide, runs each through the traced torch
model and compares every planned layer's Monte Carlo mean and variance with the float64 NumPy
reference of the PFP plan; the figures (mean error as median/p90 over elements with a floored sd,
variance ratio median/p10/p90) are defined in :mod:`pyro2pfp.mc_compare`, which does the work.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pyro
import pyro.util

from .errors import PFPError
from .mc_compare import SD_FLOOR, Diagnosis, LayerFidelity, compare, layer_fidelity, model_and_guide, restored_rng
from .options import Correlation, SharedFactor

__all__ = ["SD_FLOOR", "Diagnosis", "LayerFidelity", "compare", "diagnose", "layer_fidelity", "model_and_guide"]


def diagnose(model: Any, guide: Any, x: Any, *, num_samples: int = 300, input_shape: tuple[int, ...] | None = None,
             calibration: float = 1.0, net: Any = None, seed: int = 0, per_layer: bool = True,
             execute: Any = None, correlation: Correlation | SharedFactor | str = Correlation.AUTO) -> Diagnosis:
    """Compare every planned layer's PFP moments with Monte Carlo over the guide's samples.

    ``model``, ``guide``: as for :func:`pyro2pfp.convert` (a TyXe ``VariationalBNN`` may be passed
    alone).  Leaves the model, the guide, the param store and the random number generators (torch,
    NumPy, Python) as it found them.

    ``x``: a batch of inputs ``(B, *input_shape)``; ``input_shape`` defaults to ``x.shape[1:]``.
    ``net``: an already converted :class:`~pyro2pfp.PFPNetwork` of ``(model, guide)`` (skips conversion;
    its plan is diagnosed, whatever its calibration and correlation scheme; without it the network is
    converted with ``calibration`` and ``correlation``, see :func:`pyro2pfp.convert`).  Layers inserted
    by the planner (representation conversions) and layers that share a traced node with a later one are
    not listed.  The figures are defined in :mod:`pyro2pfp.mc_compare`.  ``per_layer=False`` records only the output
    (logits): faster, and the returned ``layers`` then hold the output layer alone.  ``execute(plan, x)
    -> {layer: Activation}`` replaces the NumPy reference (:func:`pyro2pfp.reference.execute_all`, which
    runs the plan's correlation scheme) as the PFP side.
    """
    from .network import convert

    if num_samples < 2:
        raise PFPError(f"diagnose needs num_samples >= 2, got {num_samples}")
    model, guide = model_and_guide(model, guide)
    if net is None:
        if input_shape is None:
            input_shape = tuple(np.shape(x)[1:])
        with restored_rng(pyro.util.get_rng_state()):
            net = convert(model, guide, input_shape=input_shape, calibration=calibration, correlation=correlation)
    return compare(net, model, guide, x, num_samples=num_samples, seed=seed, per_layer=per_layer, execute=execute)
