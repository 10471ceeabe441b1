"""``convert`` leaves the user's objects as it found them: model, guide, the modules their code uses,
the param store, parameters and buffers (objects and values), train/eval mode, hooks, the global
random state -- after a conversion that succeeds and after one that fails."""
from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from pyro.infer import SVI, Trace_ELBO, autoguide
from pyro.nn import PyroModule, PyroSample

import pyro2pfp

D_IN, HIDDEN, CLASSES = 6, 5, 3


def data(n=16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, D_IN, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


class MLP(PyroModule):
    def __init__(self):
        super().__init__()
        self.fc1 = PyroModule[nn.Linear](D_IN, HIDDEN)
        self.fc2 = PyroModule[nn.Linear](HIDDEN, CLASSES)
        for layer in (self.fc1, self.fc2):
            layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand(layer.weight.shape).to_event(2))
            layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand(layer.bias.shape).to_event(1))
        self.drop = nn.Dropout(0.1)
        self.norm = nn.BatchNorm1d(HIDDEN)

    def forward(self, x, y=None):
        logits = self.fc2(self.drop(self.norm(F.relu(self.fc1(x)))))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


class AssigningBNN(PyroModule):
    """``forward`` assigns ``pyro.sample`` values to the layers of a ``PyroModule[nn.Sequential]`` (with
    Dropout); the hand-written guide assigns its samples to the same layers."""

    def __init__(self):
        super().__init__()
        self.net = PyroModule[nn.Sequential](nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Dropout(0.2),
                                             nn.Linear(HIDDEN, CLASSES))
        self.shapes = {}
        for i in (0, 3):
            layer = self.net[i]
            self.shapes[i] = (tuple(layer.weight.shape), tuple(layer.bias.shape))
            del layer.weight, layer.bias  # set in forward() from the sample sites

    def forward(self, x, y=None):
        for i, (w, b) in self.shapes.items():
            self.net[i].weight = pyro.sample(f"w{i}", dist.Normal(torch.zeros(w), 1.0).to_event(2))
            self.net[i].bias = pyro.sample(f"b{i}", dist.Normal(torch.zeros(b), 1.0).to_event(1))
        logits = self.net(x)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


def assigning_guide(model):
    def guide(x, y=None):
        for i, (w, b) in model.shapes.items():
            for name, shape, target in ((f"w{i}", w, "weight"), (f"b{i}", b, "bias")):
                loc = pyro.param(f"{name}_loc", torch.zeros(shape))
                scale = pyro.param(f"{name}_scale", torch.full(shape, 0.1), constraint=dist.constraints.positive)
                setattr(model.net[i], target, pyro.sample(name, dist.Normal(loc, scale).to_event(len(shape))))
    return guide


# The same style as model/guide *functions* over a global network (the layers are not inside `model`).
GLOBAL_NET = PyroModule[nn.Sequential](nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Dropout(0.2), nn.Linear(HIDDEN, CLASSES))
GLOBAL_SHAPES = {i: (tuple(GLOBAL_NET[i].weight.shape), tuple(GLOBAL_NET[i].bias.shape)) for i in (0, 3)}
for _i in (0, 3):
    del GLOBAL_NET[_i].weight, GLOBAL_NET[_i].bias


def functional_model(x, y=None):
    for i, (w, b) in GLOBAL_SHAPES.items():
        GLOBAL_NET[i].weight = pyro.sample(f"w{i}", dist.Normal(torch.zeros(w), 1.0).to_event(2))
        GLOBAL_NET[i].bias = pyro.sample(f"b{i}", dist.Normal(torch.zeros(b), 1.0).to_event(1))
    logits = GLOBAL_NET(x)
    with pyro.plate("data", x.shape[0]):
        pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
    return logits


def functional_model_len_plate(x, y=None):
    """Fails to convert *after* its layers were assigned: ``len(x)`` fixes the batch size of a tensor the
    network adds (a size that only reaches the likelihood's plate would convert)."""
    for i, (w, b) in GLOBAL_SHAPES.items():
        GLOBAL_NET[i].weight = pyro.sample(f"w{i}", dist.Normal(torch.zeros(w), 1.0).to_event(2))
        GLOBAL_NET[i].bias = pyro.sample(f"b{i}", dist.Normal(torch.zeros(b), 1.0).to_event(1))
    logits = GLOBAL_NET(x) + torch.zeros(len(x), CLASSES)
    with pyro.plate("data", len(x)):
        pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
    return logits


def functional_guide(x, y=None):
    for i, (w, b) in GLOBAL_SHAPES.items():
        for name, shape, target in ((f"w{i}", w, "weight"), (f"b{i}", b, "bias")):
            loc = pyro.param(f"{name}_loc", torch.zeros(shape))
            scale = pyro.param(f"{name}_scale", torch.full(shape, 0.1), constraint=dist.constraints.positive)
            setattr(GLOBAL_NET[i], target, pyro.sample(name, dist.Normal(loc, scale).to_event(len(shape))))


def fit(model, guide, steps=3):
    x, y = data()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    for _ in range(steps):
        svi.step(x, y)


def _tensor(t):
    return (type(t).__name__, id(t), t.requires_grad if isinstance(t, torch.Tensor) else None,
            t.detach().clone() if isinstance(t, torch.Tensor) else t)


def snapshot(*modules):
    """Everything observable of the modules, the param store and the random state."""
    out = []
    for root in modules:
        for path, m in root.named_modules():
            state = vars(m)
            out.append((path, type(m).__name__, m.training, sorted(state),
                        {k: _tensor(v) for k, v in state["_parameters"].items()},
                        {k: _tensor(v) for k, v in state["_buffers"].items()},
                        {k: id(v) for k, v in state["_modules"].items()},
                        {k: list(v) for k, v in state.items() if k.endswith("hooks") and isinstance(v, dict)},
                        {k: _tensor(v) for k, v in state.items() if isinstance(v, torch.Tensor)},
                        sorted(state.get("_pyro_samples", {})), sorted(state.get("_pyro_params", {}))))
    store = pyro.get_param_store()
    out.append({k: _tensor(v) for k, v in store._params.items()})
    out.append(sorted(store._constraints))
    out.append(torch.get_rng_state())
    return out


def assert_same(before, after):
    assert len(before) == len(after)
    for a, b in zip(before, after, strict=True):
        _same(a, b)


def _same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (list(a), list(b))
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), (a, b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b, (a, b)


def _mlp(guide_cls):
    model = MLP()
    guide = guide_cls(model)
    fit(model, guide)
    return model, guide, [model, guide]


def _hand_written():
    model = MLP()

    shapes = {"fc1.weight": (HIDDEN, D_IN), "fc1.bias": (HIDDEN,), "fc2.weight": (CLASSES, HIDDEN),
              "fc2.bias": (CLASSES,)}

    def guide(x, y=None):
        for site, shape in shapes.items():
            loc = pyro.param(f"{site}_loc", torch.zeros(shape))
            scale = pyro.param(f"{site}_scale", torch.full(shape, 0.1), constraint=dist.constraints.positive)
            pyro.sample(site, dist.Normal(loc, scale).to_event(len(shape)))

    fit(model, guide)
    return model, guide, [model]


def _assigning():
    model = AssigningBNN()
    guide = assigning_guide(model)
    fit(model, guide)
    return model, guide, [model]


def _functional(model=functional_model):
    fit(functional_model, functional_guide)
    return model, functional_guide, [GLOBAL_NET]


def _fresh_process(tmp_path):
    """Trained, saved, then rebuilt with a guide that never ran and the store loaded (no guide run)."""
    model, guide, _ = _mlp(autoguide.AutoDiagonalNormal)
    pyro.get_param_store().save(tmp_path / "params.pt")
    pyro.clear_param_store()
    model = MLP()
    guide = autoguide.AutoDiagonalNormal(model)
    pyro.get_param_store().load(tmp_path / "params.pt")
    return model, guide, [model, guide]


STYLES = {
    "AutoNormal": lambda tmp: _mlp(autoguide.AutoNormal),
    "AutoDiagonalNormal": lambda tmp: _mlp(autoguide.AutoDiagonalNormal),
    "AutoLowRankMultivariateNormal": lambda tmp: _mlp(autoguide.AutoLowRankMultivariateNormal),
    "hand-written guide": lambda tmp: _hand_written(),
    "forward assigns samples to layers": lambda tmp: _assigning(),
    "model function assigns to a global net": lambda tmp: _functional(),
    "guide never run, store loaded": _fresh_process,
}


@pytest.mark.parametrize("style", [pytest.param(s, marks=pytest.mark.slow) if "LowRank" in s else s for s in STYLES])
def test_convert_leaves_everything_as_it_found_it(style, tmp_path):
    pyro.clear_param_store()
    model, guide, owned = STYLES[style](tmp_path)
    for m in owned:
        m.train()  # train mode stays train mode (converted with eval semantics, with a warning)
        m.register_forward_hook(lambda *args: None)
    before = snapshot(*owned)
    net = pyro2pfp.convert(model, guide, input_shape=(D_IN,))
    assert net.layer_graph.shape_of(net.layer_graph.output) == (CLASSES,)
    assert_same(before, snapshot(*owned))
    x, y = data(4)
    guide(x, y)  # the user's own objects still work
    model(x, y)


@pytest.mark.parametrize("style,mistake", [
    ("AutoNormal", "input_shape"), ("hand-written guide", "input_shape"),
    ("forward assigns samples to layers", "input_shape"), ("model function assigns to a global net", "len(x)"),
    ("guide never run, store loaded", "input_shape")])
def test_a_failing_conversion_leaves_everything_as_it_found_it(style, mistake, tmp_path):
    pyro.clear_param_store()
    model, guide, owned = STYLES[style](tmp_path)
    if mistake == "len(x)":
        model = functional_model_len_plate
    before = snapshot(*owned)
    with pytest.raises(pyro2pfp.PFPError):
        pyro2pfp.convert(model, guide, input_shape=(D_IN + 1,) if mistake == "input_shape" else (D_IN,))
    assert_same(before, snapshot(*owned))
    x, y = data(4)
    guide(x, y)
    # and the same objects convert afterwards
    net = pyro2pfp.convert(functional_model if mistake == "len(x)" else model, guide, input_shape=(D_IN,))
    assert net.layer_graph.shape_of(net.layer_graph.output) == (CLASSES,)
