"""The cost model's part of the compute layers (``FactorSpec.cost`` of dense and conv2d): the multiply-adds
per input of one product of the layer's linear map, and those the shared-factor rule adds
(:func:`pyro2pfp.correlation.cost.cost_model` sums them, its docstring gives the counts)."""
from __future__ import annotations

import numpy as np

from ..correlation.factors import FactorPlan
from ..planning.plan import PlannedLayer


def conv2d_cost(layer: PlannedLayer, fp: FactorPlan, k_in: int) -> tuple[int, int]:
    """A conv layer: the profile convolutions as the compiled kernel computes them (``sf_conv_profile``),
    the loadings ``O·C·(K_in + K_out)`` and the per-input weights (``cost_model``)."""
    wm = layer.tensors["weight_mean"]
    shape = layer.layer.out_shape
    o, c_in, size = wm.shape[0], wm.shape[1], int(wm.size)
    macs = int(np.prod(shape[1:])) * size
    k = fp.width[layer.name]
    extra = _guide_macs(layer, fp, k_in, macs, size, dense=False)
    noisy = layer.name in fp.offsets
    if fp.injection == "regression" or not noisy:
        extra += (macs if k_in else 0) + (macs if noisy else 0) + o * c_in * (k_in + k) + 2 * size
    else:  # rescaled: the propagated term's weights only, the root's mean and the scaled root
        extra += (macs + size if k_in else 0) + o * c_in * (k_in + k) + 2 * int(np.prod(shape))
    return macs, extra


def dense_cost(layer: PlannedLayer, fp: FactorPlan, k_in: int) -> tuple[int, int]:
    """A dense layer: two products of its size and ``O·C·K`` (``cost_model``)."""
    wm = layer.tensors["weight_mean"]
    o, size = wm.shape[0], int(wm.size)
    macs = size
    k = fp.width[layer.name]
    c_in = fp.rows.get(layer.inputs[0], 1)
    extra = _guide_macs(layer, fp, k_in, macs, size, dense=True)
    extra += (2 * macs + o * c_in * k_in if k_in else 0) + o * k
    return macs, extra


def _guide_macs(layer: PlannedLayer, fp: FactorPlan, k_in: int, macs: int, size: int, dense: bool) -> int:
    """The multiply-adds a compute layer spends on a correlated guide's factors
    (:mod:`pyro2pfp.correlation.guide`): dense -- the injection ``F·μ`` (``|W|·k``), the mean shift
    ``Σ F·ℓ_in`` (``|W|·k``) and the product's variance ``2‖sym A‖²`` (``|W|·k²``), both with an input that
    loads on them, and the mean-field part removed from the variance (``|W|``); conv2d -- the pooled injection
    and the per-input filter ``G = Σ_f g·F_f`` (``2·|W|·k``), the profile ``conv(μ, G)`` (one convolution),
    the mean shift (one convolution and ``|W|·k``) and the per-position variance's terms
    (:func:`~pyro2pfp.correlation.guide.conv_variance`): ``λ`` (``k`` convolutions of ``μ``; with an input that
    loads on the factors one per-channel convolution of ``s_in`` and ``k·C`` per output more), what mean-field
    counted (one convolution, two with such an input), ``|λ|²`` (``k`` per output) and, with such an input, the
    product's ``A`` (``k`` per-channel convolutions, ``k²·C`` per output) and ``2‖sym A‖²`` (``2·k²`` per
    output)."""
    wf = layer.tensors.get("weight_factors") if getattr(fp, "guide", 0) else None
    if wf is None:
        return 0
    guide = int(wf.shape[-1])
    has_in = k_in > 0
    if dense:
        return size * guide * ((2 + guide) if has_in else 1) + size
    c_in = int(wf.shape[1])
    outputs = int(np.prod(layer.layer.out_shape))  # O·OH·OW
    variance = guide * macs + macs + guide * outputs
    if has_in:
        variance += (guide + 2) * macs + guide * outputs * c_in + guide * guide * outputs * (c_in + 2)
    return 2 * size * guide + macs + ((macs + size * guide) if has_in else 0) + variance
