"""The posterior guard on a full-covariance guide whose float32 factor is ill-conditioned, as training leaves it (a
unit-lower-triangular factor whose entries grew to O(1) over hundreds of dimensions): a correct read passes -- the
samples' float32 rounding, which whitening along the covariance's tiny directions amplifies by many orders of
magnitude, is not taken for a wrong posterior -- and a mean or a variance read wrong still fails.  (A trained
1,443-dimension ``AutoMultivariateNormal`` converts with the guard on across processes in
tests/user_code/test_guide_forms.py.)"""
from __future__ import annotations

import numpy as np
import pyro
import pytest
import torch
from pyro.distributions import constraints
from pyro.infer.autoguide import AutoMultivariateNormal

import pyro2pfp
from pyro2pfp.frontend.posterior import check_posterior
from tests.support.lifecycle_worker import CLASSES, D_IN, HIDDEN
from tests.support.lifecycle_worker import TutorialMLP as _MLP

# the Pyro tutorial's MLP (8 -> 24 -> 3): 291 latent dimensions


@pytest.fixture
def ill_conditioned():
    """``(guide, posterior read from its own get_posterior(), example args)``."""
    pyro.clear_param_store()
    gen = torch.Generator().manual_seed(0)
    dim = (D_IN + 1) * HIDDEN + (HIDDEN + 1) * CLASSES
    # a store as training leaves it, loaded before the guide is built (the guide reads its parameters from it)
    pyro.param("AutoMultivariateNormal.loc", torch.randn(dim, generator=gen))
    pyro.param("AutoMultivariateNormal.scale", torch.full((dim,), 0.1), constraint=constraints.softplus_positive)
    pyro.param("AutoMultivariateNormal.scale_tril", torch.eye(dim) + torch.tril(0.7 * torch.randn(
        dim, dim, generator=gen), -1), constraint=constraints.unit_lower_cholesky)
    model = _MLP()
    guide = AutoMultivariateNormal(model)
    args = (torch.randn(4, D_IN, generator=gen), torch.zeros(4, dtype=torch.long))
    guide(*args)
    with torch.no_grad():
        post = guide.get_posterior()
        loc, var = post.loc.double(), post.variance.double()
        read = {site["name"]: (m.numpy(), v.numpy()) for (site, m), (_, v) in
                zip(guide._unpack_latent(loc), guide._unpack_latent(var))}
    yield guide, read, args
    pyro.clear_param_store()


def test_the_factor_is_too_ill_conditioned_to_whiten_in_full(ill_conditioned):
    """The premise: whitened over every direction, a correct float32 sample is far from χ²."""
    guide, _, _ = ill_conditioned
    with torch.no_grad():
        post = guide.get_posterior()
        z = post.sample().double()
        full = torch.distributions.MultivariateNormal(post.loc.double(), scale_tril=post.scale_tril.double())
        mean_square = float(-2 * (full.log_prob(z) - full.log_prob(post.loc.double()))) / z.numel()
    assert mean_square > 10, mean_square


def test_a_correct_read_passes_and_wrong_reads_fail(ill_conditioned):
    guide, read, args = ill_conditioned
    pyro.set_rng_seed(0)
    check_posterior(guide, read, args)  # 64 samples of 291 dimensions, whitened
    with pytest.raises(pyro2pfp.PosteriorError, match="whitened"):
        check_posterior(guide, {s: (m + 0.2 * np.sqrt(v), v) for s, (m, v) in read.items()}, args)
    with pytest.raises(pyro2pfp.PosteriorError, match="marginal variances"):
        check_posterior(guide, {s: (m, 1.2 * v) for s, (m, v) in read.items()}, args)
