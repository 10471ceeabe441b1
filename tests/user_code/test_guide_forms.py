"""Correlated guides (``AutoLowRankMultivariateNormal`` on an MLP and a small CNN, ``AutoMultivariateNormal`` on an
MLP; tests/support/guide_forms.py) trained in one process and converted with the default ``correlation='auto'``
in a fresh one: the plan carries the guide's global factors, the float64 reference agrees with ``Predictive`` on
the same guide, and the compiled (TVM) and ONNX networks agree with the reference to float32 rounding.

Bounds: the Monte Carlo truth has ``MC_SAMPLES`` = 2,000 samples, so a logit mean's standard error is
``sd/√2000 = 0.022 sd`` and a variance's relative sd ``√(2/1999) = 0.032``.  PFP's own error is its moment
closure through the ReLUs and max pools (the targets: mean error ≤ 0.1 sd, variance ratio median in
[0.9, 1.1]); the bounds add three Monte Carlo standard errors to each: median ``|mean error|/sd ≤ 0.1 + 3·0.022``,
the median variance ratio in ``[0.9 − 3·0.032, 1.1 + 3·0.032]``.  Without the guide's factors (mean-field) these
nets miss the bounds (checked by the benchmark, ``benchmarks/correlated_guides.py``).
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.support import guide_forms as forms
from tests.support.backends import ONNX_RTOL, RTOL, assert_matches
from tests.support.cross_process import train_then_convert

pytestmark = pytest.mark.slow  # trains, and converts and compiles in fresh processes

MEAN_SE = 1 / np.sqrt(forms.MC_SAMPLES)
VAR_SE = np.sqrt(2 / (forms.MC_SAMPLES - 1))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return train_then_convert(forms.__file__, tmp_path_factory.mktemp("guide_forms"), timeout=2400)


@pytest.mark.parametrize("name", forms.ENTRIES)
def test_auto_carries_the_guides_factors_and_matches_predictive(name, converted):
    truth = np.load(converted / f"{name}-truth.npz")
    pfp = np.load(converted / f"{name}-pfp.npz")
    assert int(pfp["guide"]) == int(pfp["k"]) > 0, str(pfp["summary"])
    assert "global factors" in str(pfp["summary"]) and "not carried" not in str(pfp["summary"])
    sd = np.sqrt(truth["var"])
    assert np.median(np.abs(truth["mean"]) / sd) > 0.5  # trained: the classes are told apart
    err = np.abs(pfp["mean"] - truth["mean"]) / sd
    assert np.median(err) <= 0.1 + 3 * MEAN_SE, np.median(err)
    ratio = np.median(pfp["var"] / truth["var"])
    assert 0.9 - 3 * VAR_SE <= ratio <= 1.1 + 3 * VAR_SE, ratio


@pytest.mark.parametrize("name", forms.ENTRIES)
def test_compiled_and_onnx_match_the_reference(name, converted):
    pfp = np.load(converted / f"{name}-pfp.npz")
    want = (pfp["mean"], pfp["var"])
    assert_matches((pfp["tvm_mean"], pfp["tvm_var"]), want, RTOL)
    assert_matches((pfp["onnx_mean"], pfp["onnx_var"]), want, ONNX_RTOL)
