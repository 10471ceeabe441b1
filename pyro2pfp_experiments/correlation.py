"""Correlation-aware PFP (issue 12, NumPy prototype): a per-channel component of every activation
that is perfectly correlated across spatial positions.

Mean-field PFP (``pfp-math.md``) treats all activations as independent.  A conv weight is shared
by every position, so the part of an activation's variance that comes from weight noise is
correlated across positions; average pooling (global pooling in ResNets) and flatten → dense then
sum positions as if independent and lose most of the variance.  This module keeps the
per-position ``(μ, v)`` of the mean-field plan (its per-position variances match sampling) and
carries beside them ``s ≥ 0``, ``s² ≤ v``: the standard deviation of the part of the activation
``a[c, p] = μ[c, p] + s[c, p]·ζ_c + (independent rest)`` that loads on one standard normal ``ζ_c``
shared by all positions of channel ``c`` (a rank-1 covariance per channel,
``Cov(a[c,p], a[c,q]) ≈ s_p·s_q`` for ``p ≠ q``).  Rules (``vw``, ``μw``: weight variance/mean;
``m̄`` a mean over the output positions; ``x_{p+k}`` the input under kernel offset ``k``):

* conv2d: three independent sources of shared noise, combined as a sum of squares:
  weight noise ``s_w[o,p] = κ_o·√(Σ vw·E[x²_{p+k}])`` with ``κ_o`` chosen so that the pooled
  variance ``(m̄ s_w)²`` equals ``Σ_{c,k} vw·(m̄ μx_{p+k})² + (m̄ sx_{p+k})²``, the exact weight-noise
  variance of the pooled output for a deterministic input (moment-rules.md); the input's shared
  part through the mean weights, ``u_c[o,p] = Σ_k μw·sx[c,p+k]``, collapsed the same way
  (``√Σ_c u_c²`` scaled so the pooled variance is ``Σ_c (m̄ u_c)²``, exact for the pooled value); and
  the bias variance ``vb`` (shared by all positions).  Minkowski's inequality gives ``κ ≤ 1``.
* affine (BatchNorm eval): ``s ↦ |a|·s``.  ReLU: ``s ↦ Φ(μ/σ)·s`` — by Stein's lemma the exact
  covariance of ``relu(z)`` with the shared normal; LeakyReLU: ``(Φ + slope·(1 − Φ))·s``.
* add: the two branches' shared parts are treated as independent, ``s = √(s_a² + s_b²)``.
* avg_pool2d: ``v = Σ(v − s²)/n² + (Σ s/n)²``, ``s ↦ Σ s/n``.  max_pool2d: mean-field ``(μ, v)``,
  ``s ↦`` window mean of ``s`` (linearisation).  Reshape keeps ``s`` with its channel grouping.
* dense after flatten: ``v += Σ_c (Σ_{i∈c} μw_i s_i)² − Σ_i μw_i² s_i²`` (the within-channel
  covariances); its output has no shared part.

Measured (``benchmarks/fidelity.py``): ResNet-8 logit variance ratio 0.35 → 0.91, ResNet-20 0.14 →
0.57; the diagnostic shows that in ResNet-20 the *per-position* variances themselves fall to ~0.55
of MC by the last stage (cross-channel correlations from shared upstream noise, not modelled here).

Approximations: rank-1 per channel (exact for the pooled value of conv → avg-pool, an
approximation for other pairs of positions), cross-channel correlations are dropped, the branches
of a residual add are independent.  Prediction stays a single pass without sampling.
"""
from __future__ import annotations

import numpy as np
from scipy.special import ndtr

from pyro2pfp.graph import INPUT, Repr
from pyro2pfp.plan import PlannedGraph, PlannedLayer
from pyro2pfp.reference import REFERENCES, Activation
from pyro2pfp.reference.arrays import padded, window_views

ADD_RULES = ("independent", "aligned")


def _patches(x: np.ndarray, layer: PlannedLayer, kernel: tuple[int, int]):
    """The strided input views of every kernel offset (as in ``conv2d_nchw``), shape (B, C, H', W')."""
    a = layer.layer.attrs
    stride, pad, dil = a["stride"], a["padding"], a["dilation"]
    oh, ow = layer.layer.out_shape[1:]
    xp = np.pad(x, ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))
    for p in range(kernel[0]):
        for q in range(kernel[1]):
            r0, c0 = p * dil[0], q * dil[1]
            yield xp[:, :, r0:r0 + stride[0] * (oh - 1) + 1:stride[0], c0:c0 + stride[1] * (ow - 1) + 1:stride[1]]


def _scaled_to_pooled(profile2: np.ndarray, pooled: np.ndarray) -> np.ndarray:
    """``κ·√profile2`` with ``κ`` per (batch, channel) making ``(mean_p κ√profile2)² = pooled``."""
    root = np.sqrt(np.maximum(profile2, 0.0))
    avg = root.mean(axis=(2, 3), keepdims=True)
    kappa = np.where(avg > 0, np.sqrt(pooled)[..., None, None] / np.where(avg > 0, avg, 1.0), 0.0)
    return kappa * root


def _conv_shared(layer: PlannedLayer, x: Activation, s_in: np.ndarray | None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """``(stacked (s, r) of the output, variance to add for the within-window covariances)``."""
    t = layer.tensors
    wm = t["weight_mean"]
    wv = t["weight_var"] if "weight_var" in t else t["weight_second_moment"] - wm**2
    if layer.layer.attrs.get("groups", 1) != 1:
        raise NotImplementedError(f"{layer.layer.source}: grouped convolutions in the correlated prototype")
    o, c, kh, kw = wm.shape
    mu = x.mean
    sx = np.zeros_like(mu) if s_in is None else s_in[0].reshape(mu.shape)
    second = x.second_moment() if x.repr is not Repr.DETERMINISTIC else mu**2
    b = mu.shape[0]
    oh, ow = layer.layer.out_shape[1:]
    prof_w = np.zeros((b, o, oh, ow))
    pooled_w = np.zeros((b, o))
    u = np.zeros((b, o, c, oh, ow)) if s_in is not None else None
    pooled_u = np.zeros((b, o, c))
    diag_u = np.zeros((b, o, oh, ow))
    views = zip(_patches(mu, layer, (kh, kw)), _patches(sx, layer, (kh, kw)), _patches(second, layer, (kh, kw)))
    for k, (pm, ps, p2) in enumerate(views):
        i, j = divmod(k, kw)
        prof_w += np.einsum("nchw,oc->nohw", p2, wv[:, :, i, j])
        mbar, sbar = pm.mean(axis=(2, 3)), ps.mean(axis=(2, 3))
        pooled_w += (mbar**2 + sbar**2) @ wv[:, :, i, j].T
        if u is not None:
            u += ps[:, None] * wm[None, :, :, i, j, None, None]
            diag_u += np.einsum("nchw,oc->nohw", ps**2, wm[:, :, i, j] ** 2)
            pooled_u += sbar[:, None, :] * wm[None, :, :, i, j]
    loading2 = _scaled_to_pooled(prof_w, pooled_w) ** 2
    corr2 = prof_w.copy()
    var_extra = np.zeros_like(prof_w)
    if u is not None:
        b2 = (u**2).sum(axis=2)
        # the 3×3 window of one input channel shares ζ_c: Var += Σ_c (Σ_k μw·s)² − Σ_{c,k} μw²·s²
        var_extra = b2 - diag_u
        loading2 += _scaled_to_pooled(b2, (pooled_u**2).sum(axis=2)) ** 2
        corr2 += b2
    if "bias_var" in t:
        loading2 += t["bias_var"].reshape(1, -1, 1, 1)
        corr2 += t["bias_var"].reshape(1, -1, 1, 1)
    return np.stack([np.sqrt(loading2), np.sqrt(corr2)]), var_extra


def _channels(s: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Keep ``(s, r)`` grouped as (2, batch, channels, positions)."""
    return s.reshape(2, s.shape[1], shape[0], -1) if len(shape) >= 2 else s.reshape(2, s.shape[1], -1, 1)


def execute_correlated(graph: PlannedGraph, x: np.ndarray, add_rule: str = "independent"
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Run the planned network in float64 with the shared per-channel component (module docstring);
    returns the output ``(mean, variance)``.  Deterministic network input only."""
    result = execute_correlated_all(graph, x, add_rule)[graph.output]
    return result.mean, result.variance()


def execute_correlated_all(graph: PlannedGraph, x: np.ndarray, add_rule: str = "independent",
                           self_hermite2: bool = True, within_window: bool = False) -> dict[str, Activation]:
    """:func:`execute_correlated`, returning every layer's activation by name.

    ``self_hermite2``: add the second Hermite term at ReLUs (measured: ResNet-8 logit variance ratio
    0.836 → 0.860).  ``within_window``: add to conv variances the covariances of the kernel window's
    positions of one input channel through the mean weights (measured: no gain on ResNet-8/20,
    0.308 → 0.304 on ResNet-20, so off by default)."""
    if add_rule not in ADD_RULES:
        raise ValueError(f"add_rule must be one of {ADD_RULES}")
    values = {INPUT: Activation(np.asarray(x, dtype=np.float64), None, Repr.DETERMINISTIC)}
    # (loading s, correlated sd r) stacked: (2, batch, channels, positions), or None
    shared: dict[str, np.ndarray | None] = {INPUT: None}
    for layer in graph.layers:
        ins = [values[n] for n in layer.inputs]
        s_ins = [shared[n] for n in layer.inputs]
        op = layer.op
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            out = REFERENCES[op](layer, ins)
            mean, var = out.mean, out.variance()
            s = None
            if op == "conv2d":
                s, var_extra = _conv_shared(layer, ins[0], s_ins[0])
                if within_window:
                    var = np.maximum(var + var_extra, 0.0)
            elif op == "dense" and s_ins[0] is not None and s_ins[0].shape[3] > 1:
                wm = layer.tensors["weight_mean"]
                sc = s_ins[0][0]
                t = np.einsum("ncp,ocp->noc", sc, wm.reshape(wm.shape[0], sc.shape[1], sc.shape[2]))
                var = var + (t**2).sum(axis=2) - sc.reshape(sc.shape[0], -1) ** 2 @ (wm**2).T
            elif s_ins[0] is not None and op in ("affine", "relu", "leaky_relu", "reshape", "convert",
                                                 "max_pool2d", "avg_pool2d", "add"):
                s_in = s_ins[0].reshape((2, *ins[0].mean.shape))
                if op == "affine":
                    s = np.abs(layer.tensors["scale"].reshape((1, 1, -1) + (1,) * (s_in.ndim - 3))) * s_in
                elif op in ("relu", "leaky_relu"):
                    sd = np.sqrt(ins[0].variance())
                    safe = np.where(sd > 0, sd, 1.0)
                    alpha = ins[0].mean / safe
                    phi = np.where(sd > 0, ndtr(alpha), ins[0].mean > 0)
                    slope = layer.layer.attrs["slope"] if op == "leaky_relu" else 0.0
                    first = (phi + slope * (1 - phi)) * s_in
                    # second Hermite (Mehler) term: E[f''] = (1 − slope)·pdf(α)/σ, loading s²/√2
                    second = np.where(sd > 0, (1 - slope) * np.exp(-0.5 * alpha**2) / np.sqrt(2 * np.pi) / safe, 0.0) \
                        * s_in**2 / np.sqrt(2.0)
                    s = np.sqrt(first**2 + second**2) if self_hermite2 else first
                elif op in ("reshape", "convert"):
                    s = s_in
                elif op in ("avg_pool2d", "max_pool2d"):
                    s, var = _pool_shared(layer, ins[0], s_in, var)
                elif op == "add":
                    sb = np.zeros_like(s_in) if s_ins[1] is None else s_ins[1].reshape((2, *ins[1].mean.shape))
                    s = np.sqrt(s_in**2 + sb**2) if add_rule == "independent" else s_in + sb
            elif op == "add" and s_ins[1] is not None:
                s = s_ins[1].reshape((2, *ins[1].mean.shape))
        source = s_ins[0]
        if s is not None and op == "reshape" and source is not None:
            s = source  # keeps its (channel, position) grouping through flatten
        elif s is not None:
            s = s.reshape((2, *mean.shape))
            r = np.minimum(s[1], np.sqrt(np.maximum(var, 0.0)))
            s = _channels(np.stack([np.minimum(s[0], r), r]), layer.layer.out_shape)
        values[layer.name] = _emit(mean, var, layer)
        shared[layer.name] = s
    return values


def _pool_shared(layer: PlannedLayer, x: Activation, s_in: np.ndarray, var: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Pooling of ``(s, r)`` (stacked): window means of the loadings; for average pooling the
    variance ``Σ(v − r²)/n² + (Σ s/n)²`` (the correlated part summed as fully correlated)."""
    from pyro2pfp.reference.arrays import average_divisor

    a = dict(layer.layer.attrs)
    a.setdefault("divisor", None)
    a.setdefault("count_include_pad", False)
    out_hw = layer.layer.out_shape[1:]
    divisor = average_divisor(a, x.mean.shape[2:], out_hw)

    def window_mean(t: np.ndarray) -> np.ndarray:
        return sum(window_views(padded(t, a, out_hw, 0.0), a["kernel"], a["stride"], out_hw)) / divisor

    s = window_mean(s_in[0])
    if layer.op == "max_pool2d":
        return np.stack([s, window_mean(s_in[1])]), var
    indep = np.maximum(x.variance() - s_in[1] ** 2, 0.0)
    var = sum(window_views(padded(indep, a, out_hw, 0.0), a["kernel"], a["stride"], out_hw)) / divisor**2 + s**2
    return np.stack([s, s]), var


def _emit(mean: np.ndarray, var: np.ndarray, layer: PlannedLayer) -> Activation:
    from pyro2pfp.reference import emit_output

    return emit_output(mean, var, layer)
