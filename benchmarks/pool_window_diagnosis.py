"""Where a correlated max pool's error comes from: the pool's conv, its in-window covariances and the
activation after it, each against Monte Carlo over the guide (the nets of ``pool_fidelity.py``).

For every max pool of a mean-field plan that folds Clark's correlated max (a ``window_cov`` layer), the
guide is sampled ``--samples`` times on ``--inputs`` held-out digits; per draw the torch layers up to the
pool's conv give that conv's input ``h``, the conv (with the draw's weights) its output ``a``, then the
max over the pool's windows and the activation.  Three samplings of the same conv:

* **MC**: the network as it is (neighbouring elements of ``h`` share the earlier layers' weights);
* **mean-field MC**: every element of ``h`` takes its value from a different, randomly permuted draw,
  and the conv has fresh weights: ``h``'s elements keep their distributions but are independent of each
  other and of the conv's weights -- exactly the model under which ``window_cov`` is exact;
* **formula**: ``window_cov`` and the conv's variance evaluated on the MC mean and variance of ``h``.

Columns (medians over elements; "corr": correlation of two taps of a window, over all pairs with both
taps inside the conv output):

* ``conv var``: the plan's variance of the pool's conv over MC;
* ``corr plan / mf-MC / MC``: the plan's in-window correlation, the mean-field MC's, the network's;
* ``cov formula / mf-MC``: ``window_cov`` on MC input moments over the mean-field MC's covariance
  (1 when the formula is right; its p10-p90 spread is sampling noise);
* ``max var``, ``max err``: the plan's pooled (pre-activation) variance over MC and mean error in MC sd;
* ``out var``, ``out err``: the same after the activation (the pool's torch output, what
  ``pool_fidelity.py`` reports);
* ``out var, MC corr``, ``out err, MC corr``: the plan's own tap means and variances folded with the
  network's (MC) in-window correlations instead of the plan's, then the activation: how much of the
  error the missing upstream correlation accounts for;
* ``fold on MC``: Clark's correlated fold of the MC tap moments and covariances over the MC max's
  variance (the fold's own approximation).

    PYTHONPATH=. python benchmarks/pool_window_diagnosis.py [--nets vgg-cnn,wide-cnn] [--samples 1000]
                                                           [--inputs 4] [--markdown PATH]
"""
from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import numpy as np
import pyro
import torch
import torch.nn.functional as F
from markdown_report import add_markdown_argument, table, write_markdown
from pool_fidelity import trained

import pyro2pfp
from pyro2pfp import moments
from pyro2pfp.analysis.mc_compare import _guide_sample
from pyro2pfp.backends.reference import Activation, execute_all
from pyro2pfp.backends.reference.arrays import LOWEST, padded, window_views
from pyro2pfp.frontend.posterior import ready_to_sample
from pyro2pfp.ops.window_covariance import tap_masks, window_cov
from pyro2pfp.planning.graph import Repr

COLUMNS = ["net", "pool", "conv var", "corr plan / mf-MC / MC", "cov formula / mf-MC (p10-p90)", "max var",
           "max err", "out var", "out err", "out var, MC corr", "out err, MC corr", "fold on MC"]


def forward(mods: list[tuple[int, torch.nn.Module]], h: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """The feature layers ``mods`` (conv, LeakyReLU, max pool) with the sampled weights ``w``."""
    for i, m in mods:
        if isinstance(m, torch.nn.Conv2d):
            h = F.conv2d(h, w[f"features.{i}.weight"], w[f"features.{i}.bias"], m.stride, m.padding)
        elif isinstance(m, torch.nn.LeakyReLU):
            h = F.leaky_relu(h, m.negative_slope)
        elif isinstance(m, torch.nn.MaxPool2d):
            h = F.max_pool2d(h, m.kernel_size, m.stride, m.padding)
        else:
            raise TypeError(f"pool_window_diagnosis: no forward rule for {type(m).__name__}")
    return h


def window_taps(a: np.ndarray, pool: dict[str, Any], out_hw: tuple[int, int], fill: float) -> np.ndarray:
    """``(B, C, K, OH, OW)``: the K taps of every window of ``a`` (``fill`` outside)."""
    return np.stack(list(window_views(padded(a, pool, out_hw, fill), pool["kernel"], pool["stride"], out_hw)), 2)


def pair_stack(t: np.ndarray, pairs: list[tuple[int, int]], f: Any) -> np.ndarray:
    return np.stack([f(t[:, :, i], t[:, :, j]) for i, j in pairs], 2)


class Accumulator:
    """Running sums of the conv output's taps, their pair products, the max and the activation."""

    def __init__(self, pool: dict[str, Any], out_hw: tuple[int, int], slope: float) -> None:
        self.pool, self.out_hw, self.slope = pool, out_hw, slope
        self.pairs = moments.window_pairs(pool["kernel"][0] * pool["kernel"][1])
        self.sums: dict[str, np.ndarray] = {}
        self.n = 0

    def add(self, a: np.ndarray) -> None:
        t = window_taps(a, self.pool, self.out_hw, 0.0)
        mx = F.max_pool2d(torch.as_tensor(a), self.pool["kernel"], self.pool["stride"], self.pool["padding"]).numpy()
        out = np.where(mx > 0, mx, self.slope * mx)
        for key, v in (("t", t), ("t2", t * t), ("p", pair_stack(t, self.pairs, np.multiply)), ("m", mx),
                       ("m2", mx * mx), ("o", out), ("o2", out * out)):
            self.sums[key] = self.sums.get(key, 0.0) + v
        self.n += 1

    def moments(self) -> dict[str, np.ndarray]:
        s = {k: v / self.n for k, v in self.sums.items()}
        r = {"t_mean": s["t"], "t_var": s["t2"] - s["t"] ** 2, "m_mean": s["m"], "m_var": s["m2"] - s["m"] ** 2,
             "o_mean": s["o"], "o_var": s["o2"] - s["o"] ** 2}
        r["cov"] = s["p"] - pair_stack(s["t"], self.pairs, np.multiply)
        return r


def correlations(cov: np.ndarray, var: np.ndarray, pairs: list[tuple[int, int]]) -> np.ndarray:
    return cov / np.sqrt(np.maximum(pair_stack(var, pairs, np.multiply), 1e-300))


def diagnose_pool(model: Any, guide: Any, net: Any, x: np.ndarray, pool_index: int, samples: int) -> list[str]:
    """One table row for the ``pool_index``-th correlated max pool of ``net`` (see the module docstring)."""
    plan = net.plan
    pools = [p for p in plan.layers if p.op == "max_pool2d" and len(p.inputs) == 2]
    pool_layer = pools[pool_index]
    conv_name, cov_name = pool_layer.inputs
    cov_layer = plan.layer(cov_name)
    after = next(p for p in plan.layers if p.inputs == [pool_layer.name])
    mods = list(model.features)
    conv_idx = int(conv_name.split(".")[1])
    conv = mods[conv_idx]
    slope = float(mods[conv_idx + 1].negative_slope)
    attrs = pool_layer.layer.attrs
    pool = {k: list(attrs[k]) for k in ("kernel", "stride", "padding")}
    out_hw = tuple(pool_layer.layer.out_shape[1:])
    values = execute_all(plan, x)
    xt = torch.as_tensor(x, dtype=torch.float32)
    ready_to_sample(model, guide, (xt[:2],))

    def draw() -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return {k: v.double() for k, v in _guide_sample(guide, xt[:1]).items()}

    pyro.set_rng_seed(1)
    hs, ws = [], []
    with torch.no_grad():
        for _ in range(samples):
            w = draw()
            hs.append(forward(list(enumerate(mods))[:conv_idx], xt.double(), w).float())
            ws.append((w[f"{conv_name}.weight"], w[f"{conv_name}.bias"]))
    h = torch.stack(hs)
    order = torch.argsort(torch.rand(h.shape, generator=torch.Generator().manual_seed(3)), dim=0)
    h_mf = torch.gather(h, 0, order)  # each element's value from another draw: independent elements
    pyro.set_rng_seed(2)
    ws_mf = [(lambda w: (w[f"{conv_name}.weight"], w[f"{conv_name}.bias"]))(draw()) for _ in range(samples)]
    stats = {}
    for key, hh, wl in (("mc", h, ws), ("mf", h_mf, ws_mf)):
        acc = Accumulator(pool, out_hw, slope)
        for hk, (wt, bt) in zip(hh, wl):
            acc.add(F.conv2d(hk.double(), wt, bt, conv.stride, conv.padding).numpy())
        stats[key] = acc.moments()
    mc, mf = stats["mc"], stats["mf"]
    pairs = moments.window_pairs(pool["kernel"][0] * pool["kernel"][1])
    inside = np.broadcast_to(tap_masks(cov_layer)[None, None] > 0, mc["cov"].shape)

    # the plan's taps, and window_cov on the MC moments of the conv's input
    plan_var = window_taps(values[conv_name].variance(), pool, out_hw, 0.0)
    plan_mean = window_taps(values[conv_name].mean, pool, out_hw, LOWEST)
    h_mean, h_var = h.double().mean(0).numpy(), h.double().var(0).numpy()
    formula_cov = window_cov(cov_layer, [Activation(h_mean, h_var, Repr.VARIANCE)]).mean

    # the plan's tap moments folded with the network's (MC) in-window correlations, then the activation
    rho_mc = correlations(mc["cov"], mc["t_var"], pairs)
    cov_mc = np.where(inside, rho_mc * np.sqrt(pair_stack(plan_var, pairs, np.multiply)), 0.0)
    taps = [(plan_mean[:, :, k], plan_var[:, :, k]) for k in range(plan_mean.shape[2])]
    xm, xv = moments.correlated_window_max(taps, {p: cov_mc[:, :, k] for k, p in enumerate(pairs)})
    om, ov = moments.leaky_relu_moments(xm, xv, slope)
    # Clark's fold on the MC moments themselves (outside taps: the fold's identity)
    t_mean = np.where(window_taps(np.zeros_like(values[conv_name].mean), pool, out_hw, 1.0) > 0, LOWEST,
                      mc["t_mean"])
    taps_mc = [(t_mean[:, :, k], mc["t_var"][:, :, k]) for k in range(t_mean.shape[2])]
    _, fold_v = moments.correlated_window_max(taps_mc, {p: mc["cov"][:, :, k] for k, p in enumerate(pairs)})

    pool_out, act_out = values[pool_layer.name], values[after.name]
    live = mc["t_var"] > 0

    def med(a: np.ndarray) -> str:
        return f"{np.median(a):.3f}"

    def err(mean: np.ndarray, ref_mean: np.ndarray, ref_var: np.ndarray) -> str:
        return med(np.abs(mean - ref_mean) / np.sqrt(ref_var))

    cov_ratio = formula_cov[inside] / mf["cov"][inside]
    corr = [correlations(values[cov_name].mean, plan_var, pairs), correlations(mf["cov"], mf["t_var"], pairs), rho_mc]
    return ["", after.name, med((plan_var / np.where(live, mc["t_var"], 1))[live]),
            " / ".join(med(c[inside]) for c in corr),
            f"{med(cov_ratio)} ({np.percentile(cov_ratio, 10):.2f}-{np.percentile(cov_ratio, 90):.2f})",
            med(pool_out.variance() / mc["m_var"]), err(pool_out.mean, mc["m_mean"], mc["m_var"]),
            med(act_out.variance() / mc["o_var"]), err(act_out.mean, mc["o_mean"], mc["o_var"]),
            med(ov / mc["o_var"]), err(om, mc["o_mean"], mc["o_var"]), med(fold_v / mc["m_var"])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", default="vgg-cnn,wide-cnn")
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--inputs", type=int, default=4)
    add_markdown_argument(ap)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.nets.split(","):
            model, guide, x_test = trained(name, 10, os.path.join(tmp, f"{name}.pt"))
            x = np.asarray(x_test[:args.inputs], dtype=np.float64)
            net = pyro2pfp.convert(model, guide, input_shape=(1, 28, 28), max_pool="correlated",
                                   correlation="mean-field")
            count = sum(p.op == "window_cov" for p in net.plan.layers)
            for k in range(count):
                row = diagnose_pool(model, guide, net, x, k, args.samples)
                row[0] = name
                rows.append(row)
                print(" | ".join(row), flush=True)
    text = table(COLUMNS, rows)
    note = (f"{args.samples} guide samples, {args.inputs} held-out digits; per-element ratio sd from sampling "
            f"≈ {np.sqrt(2 / (args.samples - 1)):.3f}")
    print(text)
    print(note)
    write_markdown(args.markdown, [text, note])


if __name__ == "__main__":
    main()
