"""pyro2pfp.options: the Enums of the string options, the one list of their allowed values."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import pyro2pfp
from pyro2pfp.cli import build_parser
from pyro2pfp.correlation import plan_factors
from pyro2pfp.correlation.factors import CORRELATIONS, HERMITE_MODES, INJECTIONS
from pyro2pfp.ops.head import HEADS
from pyro2pfp.options import Correlation, Head, Hermite, Injection, MaxPool, MomentForm, values
from pyro2pfp.planning.correlated_pools import MAX_POOL_RULES
from pyro2pfp.planning.plan import MOMENT_FORMS
from pyro2pfp_experiments.zoo import BayesianLeNet5, he_posterior

SHAPE = (1, 28, 28)


@pytest.fixture(scope="module")
def lenet():
    model = BayesianLeNet5(c1=2, c2=3, f1=8, f2=6)
    x = torch.randn(3, *SHAPE, generator=torch.Generator().manual_seed(0))
    return model, he_posterior(model, x, scale=0.05, seed=1), x.numpy().astype(np.float64)


def test_the_modules_allowed_values_are_the_enums_values():
    assert CORRELATIONS == ("auto", "shared-factor", "mean-field", "compact-factor") == values(Correlation)
    assert MOMENT_FORMS == ("variance", "raw") == values(MomentForm)
    assert MAX_POOL_RULES == ("correlated", "independent") == values(MaxPool)
    assert HEADS == ("probs",) == values(Head)
    assert HERMITE_MODES == ("factor", "none") == values(Hermite)
    assert INJECTIONS == ("regression", "rescaled") == values(Injection)
    for option in (Correlation, MomentForm, MaxPool, Head, Hermite, Injection):
        assert getattr(pyro2pfp, option.__name__) is option
        assert all(isinstance(member, str) and str(member) == member.value for member in option)


def test_the_cli_accepts_exactly_the_enums_values():
    parser = build_parser()
    base = ["convert", "builder.py", "-o", "net.so"]
    for flag, option, dest in (("--correlation", Correlation, "correlation"),
                               ("--moment-form", MomentForm, "moment_form"), ("--head", Head, "head"),
                               ("--hermite", Hermite, "hermite"), ("--injection", Injection, "injection")):
        for value in values(option):
            assert getattr(parser.parse_args([*base, flag, value]), dest) == value
        with pytest.raises(SystemExit):
            parser.parse_args([*base, flag, "not-an-option"])


@pytest.mark.parametrize("options", [
    {"moment_form": MomentForm.RAW, "correlation": Correlation.MEAN_FIELD, "max_pool": MaxPool.INDEPENDENT,
     "head": Head.PROBS},
    {"moment_form": MomentForm.VARIANCE, "correlation": Correlation.SHARED_FACTOR, "max_pool": MaxPool.CORRELATED},
    {"correlation": Correlation.AUTO, "max_pool": MaxPool.CORRELATED},
], ids=["raw-mean-field-independent-probs", "shared-factor", "auto-correlated-pools"])
def test_an_enum_member_gives_the_same_network_as_its_string(lenet, options):
    model, guide, x = lenet
    by_enum = pyro2pfp.convert(model, guide, input_shape=SHAPE, **options)
    by_string = pyro2pfp.convert(model, guide, input_shape=SHAPE, **{k: v.value for k, v in options.items()})
    assert by_enum.summary() == by_string.summary()
    assert type(by_enum.plan.moment_form) is str and by_enum.plan.moment_form == by_string.plan.moment_form
    assert by_enum.plan.correlation == by_string.plan.correlation
    for a, b in zip(by_enum.reference(x), by_string.reference(x), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name, option", [("correlation", Correlation), ("moment_form", MomentForm),
                                          ("max_pool", MaxPool), ("head", Head)])
def test_a_wrong_option_names_the_option_the_value_the_allowed_values_and_the_enum(lenet, name, option):
    model, guide, _ = lenet
    wrong = Hermite.NONE  # a member of another option's Enum
    for value in ("Mean_Field", wrong):
        with pytest.raises(pyro2pfp.ArgumentError) as info:
            pyro2pfp.convert(model, guide, input_shape=SHAPE, **{name: value})
        message = str(info.value)
        assert message.startswith(f"{name} must be ")
        assert f"got {value!r}" in message
        assert all(repr(allowed) in message for allowed in values(option))
        assert f"pyro2pfp.{option.__name__}" in message


def test_the_shared_factor_variants_take_members_and_refuse_other_values(lenet):
    model, guide, _ = lenet
    planned = pyro2pfp.convert(model, guide, input_shape=SHAPE, correlation="shared-factor").plan
    fp = plan_factors(planned, hermite=Hermite.NONE, injection=Injection.RESCALED)
    assert (type(fp.hermite), fp.hermite, type(fp.injection), fp.injection) == (str, "none", str, "rescaled")
    assert fp == plan_factors(planned, hermite="none", injection="rescaled")
    for keyword, option in (("hermite", Hermite), ("injection", Injection)):
        expected = re.escape(f"{keyword} must be one of {values(option)}, got 'full'")
        with pytest.raises(pyro2pfp.ArgumentError, match=expected):
            plan_factors(planned, **{keyword: "full"})


def test_shared_factor_spells_out_the_scheme_and_its_variants(lenet):
    """``correlation=SharedFactor(...)`` is the shared-factor scheme with the factor plan's variants: the
    default instance gives the network ``"shared-factor"`` gives; ``injection="rescaled"`` /
    ``hermite="none"`` give the plan ``plan_factors`` makes with them, and a different output variance."""
    import dataclasses

    from pyro2pfp import SharedFactor
    from pyro2pfp.network import PFPNetwork

    model, guide, x = lenet
    base = pyro2pfp.convert(model, guide, input_shape=SHAPE, correlation="shared-factor")
    same = pyro2pfp.convert(model, guide, input_shape=SHAPE, correlation=SharedFactor())
    assert same.plan.factors == base.plan.factors
    np.testing.assert_array_equal(same.reference(x)[1], base.reference(x)[1])
    variants: list[dict] = [{"injection": Injection.RESCALED}, {"hermite": "none"},
                            {"hermite": "none", "injection": "rescaled"}]
    for options in variants:
        net = pyro2pfp.convert(model, guide, input_shape=SHAPE, correlation=SharedFactor(**options))
        assert net.plan.correlation == "shared-factor"
        planned = dataclasses.replace(base.plan, factors=plan_factors(base.plan, **options))
        by_hand = PFPNetwork(base.layer_graph, planned)
        assert net.plan.factors == by_hand.plan.factors
        np.testing.assert_allclose(net.reference(x)[1], by_hand.reference(x)[1], rtol=1e-12)
        assert not np.allclose(net.reference(x)[1], base.reference(x)[1], rtol=1e-6)


def test_shared_factor_refuses_unknown_variants():
    from pyro2pfp import SharedFactor

    with pytest.raises(pyro2pfp.ArgumentError, match=r"injection must be one of \('regression', 'rescaled'\)"):
        SharedFactor(injection="regresion")
    with pytest.raises(pyro2pfp.ArgumentError, match=r"hermite must be one of \('factor', 'none'\)"):
        SharedFactor(hermite=True)
