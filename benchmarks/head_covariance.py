"""Where a CNN's dense head loses variance under mean-field PFP: Monte Carlo of the main job's LeNet-5 over
its guide, with no PFP in the loop.

Two tables:

* **fc1's quadratic term** ``Σ_j m_jᵀ C m_j`` (``C``: the covariance of the flattened pool2 output over the
  guide's samples, ``m_j``: fc1's mean weights): the share of it an approximation of ``C`` keeps -- the
  diagonal (mean-field), the 16 within-channel blocks (full, or each block's top-r eigenvectors plus the
  rest of its diagonal), the global top-r eigenvectors plus the rest of the diagonal -- with all the
  weight noise, and with only conv2's or only conv1's noise (the other weights at their guide
  medians).
* **decorrelated inputs**: the logits' variance when one dense layer's inputs are made independent of
  each other while keeping their sampled marginals (each element's N samples permuted independently),
  over the logits' variance of the network itself (median and p10-p90 over digits × classes).  This is
  what treating that layer's input elements as independent costs at the logits, everything else exact.

    PYTHONPATH=. python benchmarks/head_covariance.py [--samples 2000] [--inputs 16] [--epochs 10]
                                                     [--store PATH] [--markdown docs/generated/head-covariance.md]

``--store``: a saved param store of ``examples/mnist_pfp.py``'s LeNet-5 (``out/mnist_lenet-5_params.pt``)
instead of training one.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
import pyro
import torch
import torch.nn.functional as F
from markdown_report import add_markdown_argument, table, write_markdown
from pool_fidelity import NETS, trained

from pyro2pfp.analysis.mc_compare import _guide_sample
from pyro2pfp.frontend.posterior import ready_to_sample
from pyro2pfp_experiments.datasets import load_mnist

LAYERS = ("conv1", "conv2", "fc1", "fc2", "fc3")
NOISE = {"all": LAYERS, "conv2 only": ("conv2",), "conv1 only": ("conv1",)}


def head(h: torch.Tensor, w: dict[str, torch.Tensor], start: str, decorrelate: tuple[str, ...],
         gen: torch.Generator) -> torch.Tensor:
    """The dense head from layer ``start`` on (``h``: its input, samples first), each layer of ``decorrelate``
    reading its input with every element's samples permuted independently."""
    names = ("fc1", "fc2", "fc3")
    for name in names[names.index(start):]:
        if name in decorrelate:
            order = torch.argsort(torch.rand(h.shape, generator=gen, dtype=torch.float64), dim=0)
            h = torch.gather(h, 0, order)
        h = torch.einsum("nbi,nji->nbj", h, w[f"{name}.weight"]) + w[f"{name}.bias"][:, None]
        if name != "fc3":
            h = F.relu(h)
    return h


def sample(model, guide, x: torch.Tensor, n: int, noisy: tuple[str, ...], seed: int):
    """``n`` guide draws: the weights (stacked), pool2's flattened output (n, B, 400)."""
    pyro.set_rng_seed(seed)
    median = {k: v.detach().double() for k, v in guide.median(x[:1]).items()}
    draws: dict[str, list[torch.Tensor]] = {k: [] for k in median}
    pools = []
    with torch.no_grad():
        for _ in range(n):
            s = _guide_sample(guide, x[:1])
            w = {k: (s[k].double() if k.split(".")[0] in noisy else median[k]) for k in median}
            for k in draws:
                draws[k].append(w[k])
            h = F.max_pool2d(F.relu(F.conv2d(x, w["conv1.weight"], w["conv1.bias"], padding=2)), 2)
            h = F.max_pool2d(F.relu(F.conv2d(h, w["conv2.weight"], w["conv2.bias"])), 2)
            pools.append(h.flatten(1))
    return {k: torch.stack(v) for k, v in draws.items()}, torch.stack(pools)


def kept(c: np.ndarray, h: np.ndarray, kind: str, r: int, channels: int) -> float:
    """``tr(Ĉ·H)`` for the approximation ``Ĉ`` of ``c`` named by ``kind`` and ``r``."""
    if kind == "diagonal":
        return float(np.sum(np.diag(c) * np.diag(h)))
    if kind == "global":
        w, u = np.linalg.eigh(c)
        low = (u[:, -r:] * w[-r:]) @ u[:, -r:].T
        return float(np.sum((low + np.diag(np.diag(c - low))) * h))
    size = c.shape[0] // channels
    total = 0.0
    for k in range(channels):
        s = slice(k * size, (k + 1) * size)
        blk = c[s, s]
        if r:
            w, u = np.linalg.eigh(blk)
            low = (u[:, -r:] * w[-r:]) @ u[:, -r:].T
            blk = low + np.diag(np.diag(blk - low))
        total += float(np.sum(blk * h[s, s]))
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--inputs", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=10, help="LeNet-5's epochs (the main job's)")
    ap.add_argument("--store", help="a saved param store of the main job's LeNet-5 instead of training one")
    add_markdown_argument(ap)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        if args.store:
            ctor, _, make = NETS["lenet"]
            pyro.clear_param_store()
            model = ctor()
            guide = make(model)
            pyro.get_param_store().load(args.store)
            x_test = load_mnist()[2]
        else:
            model, guide, x_test = trained("lenet", args.epochs, os.path.join(tmp, "lenet.pt"))
    x = torch.as_tensor(x_test[:args.inputs]).double()
    ready_to_sample(model, guide, (x[:2].float(),))
    rows_share = {(kind, r): [] for kind, r in (("diagonal", 0), ("blocks", 0), ("blocks", 1), ("blocks", 2),
                                                ("blocks", 4), ("global", 4), ("global", 16))}
    decor_rows = []
    gen = torch.Generator().manual_seed(5)
    for label, noisy in NOISE.items():
        w, pool2 = sample(model, guide, x.float().double(), args.samples, noisy, seed=1)
        m = w["fc1.weight"].mean(0).numpy() if "fc1" in noisy else w["fc1.weight"][0].numpy()
        h = m.T @ m
        covs = [np.cov(pool2[:, b].numpy().T) for b in range(pool2.shape[1])]
        total = sum(float(np.sum(c * h)) for c in covs)
        for (kind, r), col in rows_share.items():
            col.append(sum(kept(c, h, kind, r, 16) for c in covs) / total)
        if label != "all":
            continue
        truth = head(pool2, w, "fc1", (), gen).var(0).numpy()
        for what in (("fc1",), ("fc2",), ("fc3",), ("fc2", "fc3"), ("fc1", "fc2", "fc3")):
            ratio = (head(pool2, w, "fc1", what, gen).var(0).numpy() / truth).ravel()
            decor_rows.append([" + ".join(what), f"{np.median(ratio):.3f}",
                               f"{np.percentile(ratio, 10):.2f}-{np.percentile(ratio, 90):.2f}"])
    share = table(["approximation of C", *NOISE],
                  [[f"{kind}" + (f", rank {r}" if r else ""), *(f"{v:.3f}" for v in col)]
                   for (kind, r), col in rows_share.items()])
    decor = table(["inputs made independent", "logit variance / network's (median)", "p10-p90"], decor_rows)
    note = (f"{args.samples} guide samples, {args.inputs} held-out digits; the ratio's sampling sd per element "
            f"≈ {np.sqrt(2 / (args.samples - 1)):.3f}")
    print(share, decor, note, sep="\n\n")
    write_markdown(args.markdown, ["### Share of fc1's quadratic term kept", share,
                                   "### Logit variance with one dense layer's inputs independent", decor, note])


if __name__ == "__main__":
    main()
