"""Agreement of the converted gallery models (tests/support/gallery_models.py, and the nets of joined
branches of tests/support/branch_models.py) with Pyro's ``Predictive``.

For each model of the gallery: train it (its own style, a few hundred SVI steps, seeded), sample the
truth (``obs`` for regression, the logits for classification) with ``--samples`` draws of the trained
guide, convert, and print per test point (24 inputs; regression: the observation, classification:
every logit):

* ``mean err/sd``: ``|PFP mean − MC mean|`` in MC standard errors of the MC mean (median, max);
* ``var ratio``: PFP's variance (regression: epistemic + aleatoric, ``net.regression``) over the MC
  variance (median, min, max), and ``var err/se``: the max of ``|Δvar|`` in standard errors of the MC
  variance (from the MC 4th central moment);
* ``argmax``: the fraction of inputs whose most probable class agrees (classification).

    PYTHONPATH=. python benchmarks/gallery.py [--samples 4000] [--only tutorial-regression,...]
                                              [--markdown docs/generated/gallery.md]
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import pyro  # noqa: E402
import torch  # noqa: E402
from markdown_report import add_markdown_argument, table, write_markdown  # noqa: E402

from tests.support import branch_models as B  # noqa: E402
from tests.support import gallery_models as G  # noqa: E402

GALLERY = {**G.GALLERY, **B.BRANCHES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--only", default="")
    add_markdown_argument(parser)
    args = parser.parse_args()
    rows = []
    names = [n for n in args.only.split(",") if n] or list(GALLERY)
    torch.set_num_threads(1)
    print(f"{'model':26} {'exact':>5} {'mean err/sd med':>15} {'max':>6} {'var ratio med':>13} {'min':>6} "
          f"{'max':>6} {'var err/se max':>14} {'argmax':>6}")
    for name in names:
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        entry = GALLERY[name]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pfp, mc = G.run_in_process(entry, args.samples)
        a = G.agreement(entry, pfp, mc)
        arg = f"{a['argmax_agreement']:.3f}" if "argmax_agreement" in a else "—"
        print(f"{name:26} {'yes' if entry.exact else 'no':>5} {a['median_mean_err_sd']:15.2f} "
              f"{a['max_mean_err_sd']:6.2f} {a['median_var_ratio']:13.3f} {a['min_var_ratio']:6.3f} "
              f"{a['max_var_ratio']:6.3f} {a['max_var_err_se']:14.2f} {arg:>6}", flush=True)
        rows.append([name, entry.style, "yes" if entry.exact else "no",
                     f"{a['median_mean_err_sd']:.2f}, {a['max_mean_err_sd']:.2f}",
                     f"{a['median_var_ratio']:.3f}, {a['min_var_ratio']:.3f}, {a['max_var_ratio']:.3f}",
                     f"{a['max_var_err_se']:.2f}", arg])
    write_markdown(args.markdown, [
        table(["model", "style", "exact", "mean err/sd (median, max)", "var ratio (median, min, max)",
               "var err/se max", "argmax"], rows),
        f"{args.samples} `Predictive` draws per model; 24 test inputs."])


if __name__ == "__main__":
    main()
