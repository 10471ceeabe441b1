"""The sampling baseline: Monte Carlo logits of a Pyro BNN from ``pyro.infer.Predictive``."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pyro
import torch
from pyro.infer import Predictive

from ..frontend.posterior import ready_to_sample


def predictive_logits(
    model: Callable[..., Any],
    guide: Callable[..., Any],
    x: np.ndarray | torch.Tensor,
    num_samples: int = 30,
    seed: int | None = None,
) -> np.ndarray:
    """Monte Carlo logits from the posterior: the sampling baseline.

    Runs ``pyro.infer.Predictive(model, guide=guide, num_samples=num_samples,
    return_sites=("_RETURN",))(x)`` under ``torch.no_grad``, after bringing the model's and guide's
    parameters in line with the param store (:func:`pyro2pfp.frontend.posterior.ready_to_sample`).

    Parameters
    ----------
    model
        Pyro model returning logits.
    guide
        Trained guide.
    x
        Inputs (converted to float32).
    num_samples
        Number of posterior weight samples.
    seed
        If given, ``pyro.set_rng_seed(seed)`` is called first.

    Returns
    -------
    numpy.ndarray
        ``float64`` array of shape ``(num_samples, B, classes)``. Class predictions are
        ``predictive_logits(...).mean(0).argmax(-1)``.
    """
    x_t = x.detach().to(torch.float32) if isinstance(x, torch.Tensor) else torch.as_tensor(
        np.asarray(x), dtype=torch.float32)
    # Pyro's own Predictive samples the guide's cached parameters, and a fresh autoguide needs the labels to
    # set itself up: set it up and bring it in line with the param store first.
    ready_to_sample(model, guide, (x_t,))
    if seed is not None:
        pyro.set_rng_seed(seed)
    predictive = Predictive(model, guide=guide, num_samples=num_samples, return_sites=("_RETURN",))
    with torch.no_grad():
        out = predictive(x_t)["_RETURN"]
    return out.detach().cpu().numpy().astype(np.float64)
