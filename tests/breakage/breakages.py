"""The deliberate breakages the fast loop must catch: each a small wrong edit of one package file, of the
kind a refactor makes without noticing (a dropped term, a flipped sign or orientation, a skipped factor).

``python -m tests.breakage.run`` applies each to a copy of the repository and runs the fast loop
(``-m "not slow and not board"``) with ``-x``: a breakage on which it passes fails the run.  To add one,
append a :class:`Breakage`: ``old`` must occur exactly once in ``path`` (``test_breakages.py`` checks it,
so a change of the code it names fails the fast loop until the entry follows), ``first`` names the tests
expected to catch it (run first, to keep the check short; if they pass, the whole fast loop runs).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Breakage:
    name: str  # short, unique: the identifier --only takes
    what: str  # what is wrong, in words
    path: str  # the file, relative to the repository root
    old: str  # exact text, found exactly once in the file
    new: str  # what it becomes
    first: tuple[str, ...] = ()  # tests (paths or node ids, part of the fast loop) tried first


BREAKAGES: tuple[Breakage, ...] = (
    Breakage(
        "conv-kernel-drops-weight-mean-term",
        "the compiled conv2d kernel drops μw²·vx from the variance of a variance input (the reference keeps it)",
        "pyro2pfp/backends/tvm/ops/compute.py",
        "            return pair_sum(_terms(x_mean[pos], xs, wm, wv, x.repr), axis=[rc, rp, rq])\n",
        "            mean_t, var_t = _terms(x_mean[pos], xs, wm, wv, x.repr)\n"
        "            if x.repr is Repr.VARIANCE:\n"
        "                var_t = var_t - wm * wm * xs\n"
        "            return pair_sum((mean_t, var_t), axis=[rc, rp, rq])\n",
        ("tests/stages/backends/test_compiled_vs_reference.py",),
    ),
    Breakage(
        "window-shift-flipped",
        "window_cov's reference shifts the conv input the wrong way (Cov(a[P], a[P − d]) instead of a[P + d])",
        "pyro2pfp/ops/window_covariance.py",
        "        if d not in at_offset:  # Cov(a[P], a[P + d]) at every conv output position P\n"
        "            shift = (stride[0] * d[0], stride[1] * d[1])\n",
        "        if d not in at_offset:  # Cov(a[P], a[P + d]) at every conv output position P\n"
        "            shift = (-stride[0] * d[0], -stride[1] * d[1])\n",
        ("tests/ops/pooling/test_correlated_pooling.py",),
    ),
    Breakage(
        "window-pair-kernel-flipped",
        "window_cov's reference pairs the input variance with the weight products of the opposite shift "
        "(W_k·W_{k+d} for W_k·W_{k−d}): within the Clark fold's own error on windows of more than two taps",
        "pyro2pfp/ops/window_covariance.py",
        "full = full + bk.conv2d(var, shift_product_kernel(t[\"weight_mean\"], shift), no_pad,",
        "full = full + bk.conv2d(var, shift_product_kernel(t[\"weight_mean\"], (-shift[0], -shift[1])), no_pad,",
        ("tests/ops/pooling/test_correlated_pooling.py::test_two_tap_pools_are_exact_against_sampling",),
    ),
    Breakage(
        "window-shift-flipped-in-kernel",
        "the compiled window_cov kernel pairs the input variance with the weight products of the opposite shift",
        "pyro2pfp/backends/tvm/ops/window_covariance.py",
        "shift_product_kernel(t[\"weight_mean\"], d).transpose(1, 2, 3, 0)",
        "shift_product_kernel(t[\"weight_mean\"], (-d[0], -d[1])).transpose(1, 2, 3, 0)",
        ("tests/ops/pooling/test_correlated_pooling.py",),
    ),
    Breakage(
        "clark-covariance-sign",
        "Clark's max of correlated Gaussians adds the covariance: θ² = v1 + v2 + 2·c12",
        "pyro2pfp/moments/maximum.py",
        "theta2 = ops.maximum(var1 + var2 - ops.const(2.0) * cov, ops.const(0.0))",
        "theta2 = ops.maximum(var1 + var2 + ops.const(2.0) * cov, ops.const(0.0))",
        ("tests/ops/pooling/test_correlated_pooling.py",),
    ),
    Breakage(
        "shared-factor-dense-keeps-independent-part",
        "the shared-factor dense rule adds the inputs' shared parts with their correlations but does not "
        "take out the independent sum the mean-field variance already holds",
        "pyro2pfp/ops/compute.py",
        "var = ops.maximum(var + bk.rsum(loading * loading, 2) - total(counted), ops.const(0.0))",
        "var = ops.maximum(var + bk.rsum(loading * loading, 2), ops.const(0.0))",
        ("tests/stages/correlation/test_correlation.py",),
    ),
    Breakage(
        "calibration-ignored",
        "the plan stores the posterior variances without the calibration factor",
        "pyro2pfp/planning/plan.py",
        "    scaled = calibration * np.asarray(var, dtype=np.float64)\n",
        "    scaled = np.asarray(var, dtype=np.float64)\n",
        ("tests/stages/test_options.py", "tests/stages/test_convert.py"),
    ),
    Breakage(
        "relu-mean-drops-sigma-phi",
        "the ReLU mean loses its σ·φ(α) term (one formula for NumPy, TVM and ONNX: every back end is wrong)",
        "pyro2pfp/moments/relu.py",
        "    out_mean = mean * cdf + sigma * pdf\n    out_var = ops.maximum(var * (cdf + _g(",
        "    out_mean = mean * cdf\n    out_var = ops.maximum(var * (cdf + _g(",
        ("tests/ops/test_monte_carlo.py",),
    ),
    Breakage(
        "stale-store-read",
        "the tracer no longer makes the user's modules hold the param store's tensors: a deterministic layer "
        "registered in the store (pyro.module, random_module, a PyroModule's own parameter) keeps the module "
        "object's values, which are stale in a fresh process",
        "pyro2pfp/frontend/posterior/registrations.py",
        "        parameters[reg.attr] = store[reg.name]\n",
        "        parameters[reg.attr] = parameters[reg.attr]\n",
        ("tests/user_code/test_store_truth.py",),
    ),
    Breakage(
        "layer-norm-shared-drops-coherent-sum",
        "LayerNorm's shared-factor rule keeps the mean-field variance (the factors' part not summed through "
        "the Jacobian coherently)",
        "pyro2pfp/ops/normalization.py",
        "var = bk.reshape(var, (d,)) + bk.tensor(gm**2 + gv, \"ln_gamma_second\") * (coherent - independent)",
        "var = bk.reshape(var, (d,)) + 0.0 * bk.tensor(gm**2 + gv, \"ln_gamma_second\") * (coherent - independent)",
        ("tests/stages/correlation/test_layer_norm_shared.py",),
    ),
    Breakage(
        "sf-layer-norm-kernel-drops-row-mean",
        "the compiled sf_layer_norm kernel leaves the row mean of the loadings in J·L",
        "pyro2pfp/backends/tvm/ops/normalization.py",
        "r[b] * (load(b, j, f) - lm[b, f] - z[b, j] * lz[b, f])",
        "r[b] * (load(b, j, f) - z[b, j] * lz[b, f])",
        ("tests/stages/correlation/test_layer_norm_shared.py::test_layer_norm_shared_kernel_matches_the_reference",),
    ),
    Breakage(
        "window-closure-one-sided",
        "window_closure's covariance between two residual branches keeps Cov(a_P, b_Q) and drops Cov(b_P, a_Q)",
        "pyro2pfp/ops/window_covariance.py",
        "return [(s_a[i] * s_b[j] + s_b[i] * s_a[j]) * dot for i, j in pairs]",
        "return [(2.0 * s_a[i] * s_b[j]) * dot for i, j in pairs]",
        ("tests/ops/pooling/test_pool_covariance_sources.py",),
    ),
    Breakage(
        "mehler-first-term-dropped",
        "window_activation's covariance keeps only the bound of Mehler's higher terms",
        "pyro2pfp/ops/window_covariance.py",
        "return rho * i[1] * j[1] + rho * rho * ops.sqrt(i[2] * j[2])",
        "return rho * rho * ops.sqrt(i[2] * j[2])",
        ("tests/ops/pooling/test_pool_covariance_sources.py",),
    ),
)
