"""An experimental variant of the shared-factor conv rule (float64 reference only) for
``benchmarks/conv_chain_closure.py``: the rule of :func:`pyro2pfp.ops.compute.conv2d_shared` plus the
correlated-variance correction the dense rule has (:func:`~pyro2pfp.ops.compute.dense_shared`).

The input's shared part enters output ``(o, p)`` as ``Σ_c A_c(p)·g_c`` with ``A_c(p) = Σ_k W̄[o, c, k]·s_in[c, p+k]``
(the mean weights on the input's shared profile; ``g_c`` the input channel's unit factor loading), so its
variance is ``‖Σ_c A_c(p)·g_c‖² = Σ_{c,c'} A_c(p)·A_{c'}(p)·⟨g_c, g_{c'}⟩``, whereas the mean-field rule counted
``Σ_{c,k} W̄[o, c, k]²·s_in[c, p+k]²`` of it as independent (the same argument as the dense rule's
``v_out = v_mf + ‖Σ_c (…)·g[c]‖² − Σ_i W[o, i]²·s_i²``; ``docs/math.md``, the shared-factor scheme).
The product's conv rule leaves the variance mean-field; this module measures what correcting it does.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from pyro2pfp.backends.reference.arrays import conv2d_nchw
from pyro2pfp.ops import compute
from pyro2pfp.planning import registry


def corrected_conv2d_shared(layer, inputs, shared, fp, var):  # noqa: ANN001, ANN201 -- the registry's signature
    """:func:`pyro2pfp.ops.compute.conv2d_shared` with the output variance corrected (module docstring)."""
    out, v = _PRODUCT_RULE(layer, inputs, shared, fp, var)
    sh = shared[0]
    if sh is None:
        return out, v
    x, a, wm = inputs[0], layer.layer.attrs, layer.tensors["weight_mean"]
    s_in = sh.s.reshape(x.mean.shape)
    args = (a["stride"], a["padding"], a["dilation"], 1)
    per_channel = np.stack([conv2d_nchw(s_in[:, c:c + 1], wm[:, c:c + 1], *args) for c in range(wm.shape[1])],
                           axis=2)  # (B, O, C, H, W): A_c(p)
    gram = np.einsum("bcf,bdf->bcd", sh.g, sh.g)
    coherent = np.einsum("bochw,bcd,bodhw->bohw", per_channel, gram, per_channel)
    return out, np.maximum(v + coherent - conv2d_nchw(s_in ** 2, wm ** 2, *args), 0.0)


_PRODUCT_RULE = compute.conv2d_shared


@contextlib.contextmanager
def corrected_conv_rule() -> Iterator[None]:
    """Within the block, the float64 reference runs shared-factor conv layers with the corrected rule."""
    registry.SHARED_REFERENCES["conv2d"] = corrected_conv2d_shared
    try:
        yield
    finally:
        registry.SHARED_REFERENCES["conv2d"] = _PRODUCT_RULE
