"""The mistakes users make with ``convert``: each one is a ``PFPError`` whose message names the cause and
the remedy.  Anything ``convert`` does not anticipate is an ``InternalError`` naming the layer or stage,
with the original exception chained."""
from __future__ import annotations

import re

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from pyro.infer import autoguide
from pyro.nn import PyroModule, PyroSample

import pyro2pfp
from pyro2pfp.planning import converters

D_IN, HIDDEN, CLASSES = 6, 5, 3


def prior(shape):
    return PyroSample(dist.Normal(0.0, 1.0).expand(shape).to_event(len(shape)))


class MLP(PyroModule):
    def __init__(self, hidden=HIDDEN, returns="logits", act=F.relu, names=("fc1", "fc2")):
        super().__init__()
        self.returns, self.act, self.names = returns, act, names
        setattr(self, names[0], PyroModule[nn.Linear](D_IN, hidden))
        setattr(self, names[1], PyroModule[nn.Linear](hidden, CLASSES))
        for name in names:
            layer = getattr(self, name)
            layer.weight, layer.bias = prior(layer.weight.shape), prior(layer.bias.shape)

    def forward(self, x, y=None):
        z = getattr(self, self.names[1])(self.act(getattr(self, self.names[0])(x)))
        if self.returns == "batch branch" and x.shape[0] == 1:
            z = z * 1.0 + 0.0
        elif self.returns == "batch branch":
            z = torch.relu(z)
        if self.returns == "likelihood":
            with pyro.plate("data", x.shape[0]):
                pyro.sample("obs", dist.Categorical(logits=z), obs=y)
        if self.returns == "len in the network":
            z = z / len(x)  # the batch size reaches the network (a plate sized len(x) alone would not)
            with pyro.plate("data", len(x)):
                pyro.sample("obs", dist.Categorical(logits=z), obs=y)
        return {"logits": z, "likelihood": z, "batch branch": z, "len in the network": z, "None": None, "pair": (z, z),
                "constant": torch.zeros(3)}[self.returns]


class LeNetLike(PyroModule):
    def __init__(self):
        super().__init__()
        self.conv = PyroModule[nn.Conv2d](1, 2, 3)
        self.conv.weight = prior(self.conv.weight.shape)

    def forward(self, x, y=None):
        return self.conv(x).flatten(1)


X = torch.randn(8, D_IN, generator=torch.Generator().manual_seed(0))
Y = torch.randint(0, CLASSES, (8,), generator=torch.Generator().manual_seed(1))


def trained(model, guide_cls=autoguide.AutoNormal, **kwargs):
    guide = guide_cls(model, **kwargs)
    guide(X, Y)
    return model, guide


SITES = {"fc1.weight": (HIDDEN, D_IN), "fc1.bias": (HIDDEN,), "fc2.weight": (CLASSES, HIDDEN), "fc2.bias": (CLASSES,)}


def hand_guide(skip=(), rename=None, shape=None, family=dist.Normal):
    def guide(x, y=None):
        for site, s in SITES.items():
            if site in skip:
                continue
            s = (shape or {}).get(site, s)
            pyro.sample((rename or {}).get(site, site), family(torch.zeros(s), torch.ones(s)).to_event(len(s)))
    return guide


def functional_model(X, cll):
    W = pyro.sample("W", dist.Normal(torch.zeros(D_IN, CLASSES), 1.0).to_event(2))
    b = pyro.sample("b", dist.Normal(torch.zeros(CLASSES), 1.0).to_event(1))
    with pyro.plate("data", cll.size(0)):
        pyro.sample("obs", dist.Categorical(logits=X.mm(W) + b), obs=cll)


def functional_guide(X, cll=None):
    pyro.sample("W", dist.Normal(torch.zeros(D_IN, CLASSES), torch.ones(D_IN, CLASSES)).to_event(2))
    pyro.sample("b", dist.Normal(torch.zeros(CLASSES), torch.ones(CLASSES)).to_event(1))


def guide_reading_labels(X, cll):
    cll.size(0)
    functional_guide(X, cll)


def labels_in_the_network(X, cll):
    W = pyro.sample("W", dist.Normal(torch.zeros(D_IN, CLASSES), 1.0).to_event(2))
    b = pyro.sample("b", dist.Normal(torch.zeros(CLASSES), 1.0).to_event(1))
    return X.mm(W) + b + cll[:, None].float()


def scaled_weight_model(X, cll=None):
    W = pyro.sample("W", dist.Normal(torch.zeros(CLASSES, D_IN), 1.0).to_event(2))
    return F.linear(X, W.exp())  # a log-normal weight: not an independent Gaussian one


def scaled_weight_guide(X, cll=None):
    pyro.sample("W", dist.Normal(torch.zeros(CLASSES, D_IN), torch.ones(CLASSES, D_IN)).to_event(2))


def regression():
    class Regression(PyroModule):
        def __init__(self):
            super().__init__()
            self.fc = PyroModule[nn.Linear](D_IN, 1)
            self.fc.weight, self.fc.bias = prior(self.fc.weight.shape), prior(self.fc.bias.shape)

        def forward(self, x, y=None):
            mean = self.fc(x)
            with pyro.plate("data", x.shape[0]):
                pyro.sample("obs", dist.Normal(mean, 0.1).to_event(1), obs=y)
            return mean

    model = Regression()
    guide = autoguide.AutoNormal(model)
    guide(X, torch.zeros(8, 1))
    return model, guide


def another_models_store():
    """A guide that never ran, with a param store trained for the same class at another size."""
    trained(MLP(hidden=HIDDEN + 2))
    model = MLP()
    return model, autoguide.AutoNormal(model)


# name -> (call, error class, the cause, the remedy)
MISTAKES = {
    "no guide": (lambda: pyro2pfp.convert(MLP()), pyro2pfp.PosteriorError,
                 r"needs the trained guide", r"pass the guide"),
    "not a model": (lambda: pyro2pfp.convert(42, hand_guide(), input_shape=(D_IN,)), pyro2pfp.TracingError,
                    r"got int", r"torch\.nn\.Module .* or a Pyro model function"),
    "input_shape of another size": (lambda: pyro2pfp.convert(*trained(MLP()), input_shape=(D_IN + 1,)),
                                    pyro2pfp.TracingError, r"input shape \(batch, 7\).*\[6, 5\]", r"Check input_shape"),
    "input_shape a string": (lambda: pyro2pfp.convert(*trained(MLP()), input_shape="6"), pyro2pfp.InputShapeError,
                             r"got '6'", r"tuple of positive ints .* e\.g\. \(784,\)"),
    "input_shape with a zero": (lambda: pyro2pfp.convert(*trained(MLP()), input_shape=(0,)),
                                pyro2pfp.InputShapeError, r"got \(0,\)", r"positive sizes without the batch"),
    "conv net without input_shape": (lambda: pyro2pfp.convert(*_lenet()),
                                     pyro2pfp.InputShapeError, r"'conv' is a convolution",
                                     r"Pass input_shape=\(channels, height, width\)"),
    "model function without input_shape": (lambda: pyro2pfp.convert(functional_model, functional_guide),
                                           pyro2pfp.InputShapeError, r"is a function", r"pass input_shape"),
    "guide never trained": (lambda: pyro2pfp.convert(MLP(), autoguide.AutoNormal(MLP())), pyro2pfp.PosteriorError,
                            r"never been run .* param store is empty", r"load the trained parameters"),
    "store of another model's sizes": (lambda: pyro2pfp.convert(*another_models_store()), pyro2pfp.PosteriorError,
                                       r"shape \(7, 6\) but the model's prior .* \(5, 6\)",
                                       r"trained for a model of other sizes"),
    "guide of another model": (lambda: pyro2pfp.convert(MLP(), trained(MLP(names=("a", "b")))[1]),
                               pyro2pfp.PosteriorError, r"'fc1\.weight' .* no posterior .* samples \['a\.bias'",
                               r"the one trained for this model"),
    "guide with a misspelt site": (lambda: pyro2pfp.convert(MLP(), hand_guide(rename={"fc1.bias": "fc1.bais"})),
                                   pyro2pfp.PosteriorError, r"'fc1\.bias' .* no posterior",
                                   r"Sample it in the guide"),
    "guide missing a site": (lambda: pyro2pfp.convert(MLP(), hand_guide(skip=("fc2.bias",))), pyro2pfp.PosteriorError,
                             r"'fc2\.bias' .* no posterior", r"Sample it in the guide .* or make it a parameter"),
    "guide site of the wrong shape": (lambda: pyro2pfp.convert(MLP(), hand_guide(shape={"fc1.weight": (D_IN, HIDDEN)})),
                                      pyro2pfp.PosteriorError, r"'fc1\.weight'.*shape \(6, 5\).*\(5, 6\)",
                                      r"Give the guide's site the prior's shape"),
    "Cauchy posterior": (lambda: pyro2pfp.convert(MLP(), hand_guide(family=dist.Cauchy)), pyro2pfp.PosteriorError,
                         r"without closed-form mean .*Cauchy", r"use a Normal"),
    "AutoDelta guide": (lambda: pyro2pfp.convert(*trained(MLP(), autoguide.AutoDelta)), pyro2pfp.PosteriorError,
                        r"point estimate", r"Use AutoNormal"),
    "normalizing-flow guide": (lambda: pyro2pfp.convert(*trained(MLP(), autoguide.AutoIAFNormal)),
                               pyro2pfp.PosteriorError, r"normalizing-flow", r"Use AutoNormal or AutoDiagonalNormal"),
    "Laplace guide": (lambda: pyro2pfp.convert(*trained(MLP(), autoguide.AutoLaplaceApproximation)),
                      pyro2pfp.PosteriorError, r"point estimate \(MAP\)", r"laplace_approximation\(x, y\)"),
    "model returns None without a likelihood": (lambda: pyro2pfp.convert(*trained(MLP(returns="None"))),
                                                pyro2pfp.TracingError, r"returned None, and no likelihood",
                                                r"return the logits .* or sample a likelihood built from them"),
    "model returns a pair": (lambda: pyro2pfp.convert(*trained(MLP(returns="pair"))), pyro2pfp.TracingError,
                             r"returned 2 values", r"return the logits alone"),
    "output does not depend on the input": (lambda: pyro2pfp.convert(*trained(MLP(returns="constant"))),
                                            pyro2pfp.TracingError, r"does not depend on its input",
                                            r"return the logits computed from the input"),
    "unsupported module": (lambda: pyro2pfp.convert(*trained(MLP(act=nn.Mish()))), pyro2pfp.UnsupportedLayerError,
                           r"aten\.mish", r"Replace it by one of the supported"),
    "softmax inside the network": (lambda: pyro2pfp.convert(*trained(MLP(act=lambda h: F.softmax(h, -1)))),
                                   pyro2pfp.UnsupportedLayerError, r"softmax inside the network",
                                   r"move the softmax to the end"),
    "forward branches on the batch size": (lambda: pyro2pfp.convert(*trained(MLP(returns="batch branch"))),
                                           pyro2pfp.TracingError, r"batch 1", r"remove the branch"),
    "len(x) in the network": (lambda: pyro2pfp.convert(*trained(MLP(returns="len in the network"))),
                              pyro2pfp.TracingError,
                              r"fixes the batch size .*at \S*test_user_mistakes\.py:\d+.*the batch size reaches the "
                              r"arguments of div at \S*test_user_mistakes\.py:\d+ \(`z = z / len\(x\)",
                              r"pyro\.plate\('data', x\.shape\[0\]\)"),
    "guide needs the labels": (lambda: pyro2pfp.convert(functional_model, guide_reading_labels, input_shape=(D_IN,)),
                               pyro2pfp.PosteriorError, r"cll got None", r"example_args=\(x, cll\)"),
    "model needs the labels": (lambda: pyro2pfp.convert(functional_model, functional_guide, input_shape=(D_IN,)),
                               pyro2pfp.TracingError, r"'NoneType' object has no attribute 'size'.*cll got None",
                               r"example_args=\(x, cll\)"),
    "labels enter the network": (lambda: pyro2pfp.convert(labels_in_the_network, functional_guide, example_args=(X, Y)),
                                 pyro2pfp.TracingError, r"depends on example_args\[1\]",
                                 r"Compute the output from the input alone"),
    "example input of another shape": (lambda: pyro2pfp.convert(functional_model, functional_guide,
                                                                example_args=(X, Y), input_shape=(5,)),
                                       pyro2pfp.InputShapeError, r"shape \(8, 6\), but input_shape=\(5,\)",
                                       r"drop input_shape"),
    "example_args without an input batch": (lambda: pyro2pfp.convert(functional_model, functional_guide,
                                                                     example_args=(Y,)),
                                            pyro2pfp.ArgumentError, r"example_args\[0\] must be a batch of inputs",
                                            r"a float tensor \(batch, \*input_shape\)"),
    "weight computed in forward": (lambda: pyro2pfp.convert(scaled_weight_model, scaled_weight_guide,
                                                            input_shape=(D_IN,)),
                                   pyro2pfp.UnsupportedLayerError,
                                   r"a weight is computed from sample site 'W' by exp \(.*test_user_mistakes\.py:\d+ "
                                   r"\(`return F\.linear\(X, W\.exp\(\)\)",
                                   r"make the weight the layer uses the sample site itself"),
    "negative calibration": (lambda: pyro2pfp.convert(*trained(MLP()), calibration=-1.0), pyro2pfp.PFPError,
                             r"got -1\.0", r"finite non-negative factor"),
    "unknown moment form": (lambda: pyro2pfp.convert(*trained(MLP()), moment_form="fast"), pyro2pfp.PFPError,
                            r"got 'fast'", r"one of \('variance', 'raw'\)"),
    "unknown head": (lambda: pyro2pfp.convert(*trained(MLP()), head="probabilities"), pyro2pfp.ArgumentError,
                     r"got 'probabilities'", r"one of \('probs',\)"),
    "unknown correlation": (lambda: pyro2pfp.convert(*trained(MLP()), correlation="full"), pyro2pfp.PFPError,
                            r"'full'", r"mean-field"),
    "input_variance not a bool": (lambda: pyro2pfp.convert(*trained(MLP()), input_variance="yes"),
                                  pyro2pfp.ArgumentError, r"got 'yes'", r"True or False"),
    "head for a regression": (lambda: pyro2pfp.convert(*regression(), head="probs"), pyro2pfp.ArgumentError,
                              r"Normal likelihood \(regression\)", r"net\.regression\(mean, var\)"),
}


def _lenet():
    model = LeNetLike()
    guide = autoguide.AutoNormal(model)
    guide(torch.zeros(2, 1, 8, 8))
    return model, guide


def test_the_corpus_is_large():
    assert len(MISTAKES) >= 25


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_each_mistake_names_its_cause_and_remedy(mistake):
    call, error, cause, remedy = MISTAKES[mistake]
    pyro.clear_param_store()
    with pytest.raises(pyro2pfp.PFPError) as info:
        call()
    assert isinstance(info.value, error), f"{type(info.value).__name__}: {info.value}"
    text = str(info.value)
    assert re.search(cause, text, re.S), f"cause {cause!r} not in: {text}"
    assert re.search(remedy, text, re.S), f"remedy {remedy!r} not in: {text}"
    assert "tensor(" not in text  # no tensor dumps


def test_an_unexpected_failure_in_a_converter_is_an_internal_error(monkeypatch):
    def broken(node, ctx):
        raise KeyError("weight")

    monkeypatch.setitem(converters.CONVERTERS, "aten.linear.default", broken)
    with pytest.raises(pyro2pfp.InternalError, match=r"internal error converting layer fc1 \(aten\.linear\).*"
                                                    r"KeyError.*please report") as info:
        pyro2pfp.convert(*trained(MLP()))
    assert isinstance(info.value.__cause__, KeyError)


def test_an_unexpected_failure_elsewhere_names_the_stage(monkeypatch):
    import pyro2pfp.network as network

    def broken(*args, **kwargs):
        raise IndexError("list index out of range")

    monkeypatch.setattr(network, "plan", broken)
    with pytest.raises(pyro2pfp.InternalError, match=r"internal error while planning the network.*please report"
                                                    r".*IndexError") as info:
        pyro2pfp.convert(*trained(MLP()))
    assert isinstance(info.value.__cause__, IndexError)
