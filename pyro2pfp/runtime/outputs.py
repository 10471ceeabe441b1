"""What a network with the uncertainty head returns (:class:`HeadOutput`): NumPy only, so the
predictor on a board needs nothing else (the head itself is in :mod:`pyro2pfp.ops.head`)."""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

__all__ = ["OUTPUT_NAMES", "STATS", "HeadOutput", "head_output"]

STATS = ("predictive_entropy", "expected_entropy", "mutual_information")
"""The columns of the head's second output, in order."""
OUTPUT_NAMES = ("probs", "uncertainty")
"""The names of the module's two outputs with the head (ONNX output names, the library sidecar)."""


class HeadOutput(NamedTuple):
    """The outputs of a network converted with ``head="probs"`` (float32 from a compiled predictor,
    float64 from ``net.reference``): ``probs`` (batch, K) -- ``P(y = 1)`` (batch, 1) for one logit --
    and per input the predictive (total) entropy ``H[p̄]``, the expected softmax entropy ``E[H]``
    (aleatoric) and the mutual information ``H[p̄] − E[H]`` (epistemic), in nats, each (batch,)."""

    probs: np.ndarray
    predictive_entropy: np.ndarray
    expected_entropy: np.ndarray
    mutual_information: np.ndarray

    def as_dict(self) -> dict[str, np.ndarray]:
        """The same quantities under the keys of :func:`pyro2pfp.uncertainty`: ``probs``,
        ``total``, ``aleatoric``, ``epistemic``."""
        return {"probs": self.probs, "total": self.predictive_entropy, "aleatoric": self.expected_entropy,
                "epistemic": self.mutual_information}

    def module_outputs(self) -> tuple[np.ndarray, np.ndarray]:
        """The module's two outputs ``(probs, stats)`` again (stats: (batch, 3), columns :data:`STATS`):
        the inverse of :func:`head_output`."""
        return np.asarray(self.probs), np.stack([getattr(self, name) for name in STATS], axis=1)


def head_output(probs: Any, stats: Any) -> HeadOutput:
    """Unpack the module's two outputs ``(probs, stats)`` (stats: (batch, 3), columns :data:`STATS`)."""
    return HeadOutput(probs, stats[:, 0], stats[:, 1], stats[:, 2])
