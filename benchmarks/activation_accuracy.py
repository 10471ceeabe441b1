"""Accuracy of the activation moment rules of :mod:`pyro2pfp.moments` against adaptive quadrature.

For every activation, over a grid of ``(μ, v)`` (μ from −30 to 30, v from 0 to 1e3, incl. the
switch points of the rules), it prints the max and median of

* the mean error in units of the true output standard deviation, ``|Δμ|/max(sd, 1e-10·|μ_out|)``
  (``1e-6·|μ_out|`` for float32; for ``v > 0``, at ``v = 0`` the table says whether the rule
  returns the deterministic activation bit for bit);
* the relative variance error ``|Δv|/v`` (where the true variance is > 1e-290);

for the float64 NumPy evaluation, and (``--te``) for the *same function* evaluated in float32 by a
TVM TE kernel (vectorised, ``te_shared``), against the float64 NumPy result, with its build time.
Baselines: the probit sigmoid (``σ(μ/√(1+πv/8))`` and the bivariate-normal probit variance),
16-node Gauss–Hermite on the sigmoid, and SiLU through the probit surrogate ``x·Φ(√(π/8)·x)``
(the GELU rule on a scaled input).  The ground truth is
:mod:`pyro2pfp_experiments.activation_reference`.

    PYTHONPATH=. python benchmarks/activation_accuracy.py [--quick] [--te] [--only sigmoid,gelu]
"""
from __future__ import annotations

import argparse
import math
import time
import warnings
from collections.abc import Callable

import numpy as np
import scipy.special as sp

from pyro2pfp import moments as M
from pyro2pfp_experiments import activation_reference as R

MUS = (-30, -20, -12, -8, -5, -3, -2, -1.35, -1, -0.5, -0.1, 0, 0.1, 0.5, 1, 2, 3, 5, 8, 12, 20, 30)
VARS = (0, 1e-12, 1e-8, 1e-5, 1e-3, 0.01, 0.03, 0.049, 0.05, 0.1, 0.3, 1, 1.21, 2, 5, 10, 30, 100, 1e3)
LAM2 = math.pi / 8.0

Rule = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]

RULES: dict[str, tuple[R.Activation, Rule, Callable]] = {
    "sigmoid": (R.SIGMOID, M.sigmoid_moments, M.sigmoid_moments),
    "tanh": (R.TANH, M.tanh_moments, M.tanh_moments),
    "silu": (R.SILU, M.silu_moments, M.silu_moments),
    "softplus": (R.SOFTPLUS, M.softplus_moments, M.softplus_moments),
    "gelu": (R.GELU, M.gelu_moments, M.gelu_moments),
    "elu": (R.elu(1.0), lambda m, v: M.elu_moments(m, v, 1.0), lambda m, v, ops: M.elu_moments(m, v, 1.0, ops)),
    "elu(0.5)": (R.elu(0.5), lambda m, v: M.elu_moments(m, v, 0.5), lambda m, v, ops: M.elu_moments(m, v, 0.5, ops)),
    "relu6": (R.hardtanh(0.0, 6.0), M.relu6_moments, M.relu6_moments),
    "hardtanh": (R.hardtanh(-1.0, 1.0), lambda m, v: M.hardtanh_moments(m, v, -1.0, 1.0),
                 lambda m, v, ops: M.hardtanh_moments(m, v, -1.0, 1.0, ops)),
}


def probit_sigmoid(mu: np.ndarray, var: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Probit sigmoid: mean ``σ(μ/√(1+λ²v))``, variance ``Φ2(h,h;ρ) − Φ(h)²`` of ``Φ(λX)``."""
    k = 1.0 / np.sqrt(1.0 + LAM2 * var)
    h = np.sqrt(LAM2) * mu * k
    return sp.expit(mu * k), M._bvn_equal_excess(h, LAM2 * var, M.NUMPY)


def gauss_hermite_sigmoid(mu: np.ndarray, var: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    t, w = np.polynomial.hermite.hermgauss(16)
    x = mu[..., None] + np.sqrt(2.0 * var)[..., None] * t
    f, w = sp.expit(x), w / np.sqrt(np.pi)
    m = (w * f).sum(-1)
    return m, (w * (f - m[..., None]) ** 2).sum(-1)


def probit_silu(mu: np.ndarray, var: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """SiLU ≈ x·Φ(λx) = GELU(λx)/λ: the GELU rule at (λμ, λ²v)."""
    lam = math.sqrt(LAM2)
    m, v = M.gelu_moments(lam * mu, LAM2 * var)
    return m / lam, v / LAM2


BASELINES: dict[str, tuple[str, Rule]] = {
    "sigmoid probit": ("sigmoid", probit_sigmoid),
    "sigmoid GH-16": ("sigmoid", gauss_hermite_sigmoid),
    "silu probit x*Phi(lx)": ("silu", probit_silu),
}


def errors(truth: np.ndarray, got_mean: np.ndarray, got_var: np.ndarray, rel_floor: float = 1e-10
           ) -> tuple[np.ndarray, np.ndarray]:
    tm, tv = truth[:, 0], truth[:, 1]
    scale = np.maximum(np.sqrt(tv), rel_floor * np.abs(tm))
    with np.errstate(divide="ignore", invalid="ignore"):  # v = 0 rows: checked bitwise instead
        em = np.where(tv > 0, np.abs(got_mean - tm) / scale, np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        ev = np.where(tv > 1e-290, np.abs(got_var - tv) / tv, np.nan)
    return em, ev


def summary(label: str, em: np.ndarray, ev: np.ndarray, grid: np.ndarray, extra: str = "") -> None:
    iv, im = np.nanargmax(ev), np.nanargmax(em)
    print(f"| {label:24s} | {np.nanmax(em):8.1e} | {np.nanmedian(em):8.1e} | {np.nanmax(ev):8.1e} | "
          f"{np.nanmedian(ev):8.1e} | μ={grid[im, 0]:g}, v={grid[im, 1]:g} | μ={grid[iv, 0]:g}, v={grid[iv, 1]:g} |"
          f"{extra}")


def te_kernel(rule: Callable, n: int):  # pragma: no cover - needs TVM
    import tvm
    from tvm import s_tir, te

    from pyro2pfp.backends.tvm.te_let import te_shared

    m = te.placeholder((n,), "float32", name="m")
    v = te.placeholder((n,), "float32", name="v")
    outs = te.compute((n,), lambda i: te_shared(lambda ops: list(rule(m[i], v[i], ops))), name="moments")
    sch = s_tir.Schedule(te.create_prim_func([m, v, *outs]))
    loops = sch.get_loops(sch.get_sblock(sch.get(sch.get_child_blocks(sch.get_sblock("root"))[0]).name_hint))
    sch.vectorize(sch.split(loops[0], [None, 8])[1])
    target = tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})
    t0 = time.perf_counter()
    lib = tvm.tirx.build(sch.mod, target=target)
    return lib, time.perf_counter() - t0


def run_te(rule: Callable, mu: np.ndarray, var: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    import tvm

    n = len(mu)
    pad = (-n) % 8
    m32 = np.concatenate([mu, np.zeros(pad)]).astype(np.float32)
    v32 = np.concatenate([var, np.zeros(pad)]).astype(np.float32)
    lib, seconds = te_kernel(rule, len(m32))
    outs = [tvm.runtime.tensor(np.zeros_like(m32)) for _ in range(2)]
    lib(tvm.runtime.tensor(m32), tvm.runtime.tensor(v32), *outs)
    return outs[0].numpy()[:n].astype(np.float64), outs[1].numpy()[:n].astype(np.float64), seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="every other grid point")
    ap.add_argument("--te", action="store_true", help="also the float32 TVM TE evaluation")
    ap.add_argument("--only", default="", help="comma-separated activations")
    args = ap.parse_args()
    mus = MUS[::2] if args.quick else MUS
    grid = np.array([(m, v) for m in mus for v in VARS], dtype=np.float64)
    names = [n for n in RULES if not args.only or n in args.only.split(",")]
    truths: dict[str, np.ndarray] = {}
    print(f"grid: {len(mus)} means in [{min(mus)}, {max(mus)}] x {len(VARS)} variances in [0, {max(VARS):g}]"
          f" = {len(grid)} points\n")
    header = ("| rule                     | mean max | mean med | var max  | var med  | worst mean at "
              "| worst variance at |")
    print(header)
    print("|---|---|---|---|---|---|---|")
    for name in names:
        act, rule, _ = RULES[name]
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quad's roundoff notes
            truths[name] = np.array([R.moments(act, m, v) for m, v in grid])
        t_truth = time.perf_counter() - t0
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the rules themselves must not warn
            gm, gv = rule(grid[:, 0], grid[:, 1])
        em, ev = errors(truths[name], gm, gv)
        exact0 = grid[:, 1] == 0
        det = {"sigmoid": M.sigmoid_exact, "tanh": M.tanh_exact, "silu": M.silu_exact,
               "softplus": M.softplus_exact, "gelu": M.gelu_exact,
               "elu": lambda x: M.elu_exact(x, 1.0), "elu(0.5)": lambda x: M.elu_exact(x, 0.5),
               "relu6": lambda x: M.hardtanh_exact(x, 0.0, 6.0),
               "hardtanh": lambda x: M.hardtanh_exact(x, -1.0, 1.0)}[name](grid[exact0, 0])
        bitwise = bool(np.all(gm[exact0] == det) and np.all(gv[exact0] == 0))
        summary(f"{name} (float64)", em, ev, grid,
                f" v=0 exact: {'yes' if bitwise else 'NO'} (truth {t_truth:.0f} s)")
    for label, (name, rule) in BASELINES.items():
        if name not in truths:
            continue
        with np.errstate(all="ignore"):
            gm, gv = rule(grid[:, 0], grid[:, 1])
        em, ev = errors(truths[name], gm, gv)
        abs_err = np.max(np.abs(gm - truths[name][:, 0]))
        summary(f"baseline: {label}", em, ev, grid, f" max abs mean error {abs_err:.3f}")
        sub = {"sigmoid probit": ("  same, |μ| ≤ 5 only", np.abs(grid[:, 0]) <= 5),
               "sigmoid GH-16": ("  same, v ≥ 10 only", grid[:, 1] >= 10)}.get(label)
        if sub is not None:
            em_c, ev_c = errors(truths[name][sub[1]], gm[sub[1]], gv[sub[1]])
            summary(sub[0], em_c, ev_c, grid[sub[1]])
    if args.te:
        print("\nfloat32 TVM TE kernel (te_shared, vectorised) against the float64 NumPy rule:\n")
        print(header + " build |")
        print("|---|---|---|---|---|---|---|---|")
        for name in names:
            _, rule, te_rule = RULES[name]
            ref_m, ref_v = rule(grid[:, 0], grid[:, 1])
            tm, tv, seconds = run_te(te_rule, grid[:, 0], grid[:, 1])
            ok = np.isfinite(tm).all() and np.isfinite(tv).all() and (tv >= 0).all()
            # float32 cannot represent variances below its smallest normal (1.2e-38)
            ref = np.stack([ref_m, np.where(ref_v > 1e-30, ref_v, 0.0)], axis=1)
            em, ev = errors(ref, tm, tv, rel_floor=1e-6)
            summary(f"{name} (TE float32)", em, ev, grid, f" {seconds:.1f} s {'' if ok else 'NOT FINITE'}")


if __name__ == "__main__":
    main()
