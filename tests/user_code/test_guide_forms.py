"""Correlated guides (``AutoLowRankMultivariateNormal`` on an MLP and a small CNN, ``AutoMultivariateNormal`` on an
MLP; tests/support/guide_forms.py) trained in one process and converted with the default ``correlation='auto'``
in a fresh one: the plan carries the guide's global factors, the float64 reference's means are closer to
``Predictive`` on the same guide than the marginals' alone (mean-field), and the compiled (TVM) and ONNX networks
agree with the reference to float32 rounding.

Bounds: the Monte Carlo truth has ``MC_SAMPLES`` = 2,000 samples, so a logit mean's standard error is
``sd/√2000 = 0.022 sd``.  The mean: median ``|error|/sd ≤ 0.1 + 3·0.022`` (the target 0.1 sd plus three
standard errors), and below mean-field's.  The variance: a sampled variance's relative standard error is
``√((κ − 1)/N)`` with ``κ`` the logit's kurtosis (saved with the truth: these wide posteriors give heavy-tailed
logits, the full covariance's a median ``κ`` near 30, so 0.12 at 2,000 samples where a Gaussian's would be 0.03).
These briefly trained nets lose variance in the layers that read noisy inputs (median ratio 0.77 for the low-rank
MLP against its 2,000 samples; 0.60 for the full covariance and 0.72 for the CNN in separate runs of 20,000 and
4,000 samples, when this test was written; the target [0.9, 1.1] is met by the benchmark's MLP,
``benchmarks/correlated_guides.py``, not by these): the ratio
must be closer to 1 than mean-field's (on a log scale; both share the truth, so its sampling error mostly
cancels) and above 0.55 within three of its standard errors.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.support import guide_forms as forms
from tests.support.backends import ONNX_RTOL, RTOL, assert_matches
from tests.support.cross_process import train_then_convert

pytestmark = pytest.mark.slow  # trains, and converts and compiles in fresh processes

MEAN_SE = 1 / np.sqrt(forms.MC_SAMPLES)


@pytest.fixture(scope="session")  # built once per worker even if other modules' tests run between these
def converted(tmp_path_factory):
    return train_then_convert(forms.__file__, tmp_path_factory.mktemp("guide_forms"), timeout=2400)


@pytest.mark.parametrize("name", forms.ENTRIES)
def test_auto_carries_the_guides_factors_and_holds_the_mean(name, converted):
    truth = np.load(converted / f"{name}-truth.npz")
    pfp = np.load(converted / f"{name}-pfp.npz")
    assert int(pfp["guide"]) == int(pfp["k"]) > 0, str(pfp["summary"])
    assert "global factors" in str(pfp["summary"]) and "not carried" not in str(pfp["summary"])
    sd = np.sqrt(truth["var"])
    # trained, with wide posteriors: logit means of about one sd (the low-rank MLP 1.0, the CNN 1.5 when this test
    # was written; the full covariance, with its 1,443² factor, learns slowest: 0.21)
    assert np.median(np.abs(truth["mean"]) / sd) > 0.15
    err = np.median(np.abs(pfp["mean"] - truth["mean"]) / sd)
    mf_err = np.median(np.abs(pfp["mf_mean"] - truth["mean"]) / sd)
    assert err <= 0.1 + 3 * MEAN_SE and err < mf_err, (err, mf_err)


@pytest.mark.parametrize("name", forms.ENTRIES)
def test_the_guides_factors_bring_the_variance_closer_to_sampling(name, converted):
    truth = np.load(converted / f"{name}-truth.npz")
    pfp = np.load(converted / f"{name}-pfp.npz")
    ratio = np.median(pfp["var"] / truth["var"])
    mf_ratio = np.median(pfp["mf_var"] / truth["var"])
    se = np.median(np.sqrt((truth["kurtosis"] - 1) / forms.MC_SAMPLES))  # the sampled variance's relative error
    assert abs(np.log(ratio)) < abs(np.log(mf_ratio)) and ratio * (1 + 3 * se) > 0.55, (ratio, mf_ratio, se)


@pytest.mark.parametrize("name", forms.ENTRIES)
def test_compiled_and_onnx_match_the_reference(name, converted):
    pfp = np.load(converted / f"{name}-pfp.npz")
    want = (pfp["mean"], pfp["var"])
    assert_matches((pfp["tvm_mean"], pfp["tvm_var"]), want, RTOL)
    assert_matches((pfp["onnx_mean"], pfp["onnx_var"]), want, ONNX_RTOL)
