"""The generic shared-factor activation rule (Stein's lemma, ``pyro2pfp/correlation/stein.py``): the
slope ``E[f'(a)]`` by forward-mode AD of each registered rule's mean, against an independent truth
(the torch activation's derivative by autograd, integrated against the Gaussian by Gauss–Legendre
between its kinks), in float64 (NumPy) and in the compiled float32 kernel; and a SiLU / GELU ResNet
written the way users write it, converted with ``correlation="auto"``."""
from __future__ import annotations

import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro.nn import PyroSample
from torch import nn

import pyro2pfp
from pyro2pfp import moments
from pyro2pfp import ops as ops  # the op registry: every op family registers itself
from pyro2pfp.correlation.stein import UnsupportedDualOp, dual_ops, stein_slope
from pyro2pfp.diagnosis import layer_fidelity
from pyro2pfp.planning.registry import OPS

#: the torch function of every registered activation (given its example attrs) and its kinks
TORCH = {
    "scale": (lambda x, a: a["factor"] * x, lambda a: []),
    "sigmoid": (lambda x, a: torch.sigmoid(x), lambda a: []),
    "tanh": (lambda x, a: torch.tanh(x), lambda a: []),
    "gelu": (lambda x, a: F.gelu(x), lambda a: []),
    "silu": (lambda x, a: F.silu(x), lambda a: []),
    "softplus": (lambda x, a: F.softplus(x, beta=a["beta"]), lambda a: []),
    "elu": (lambda x, a: F.elu(x, alpha=a["alpha"]), lambda a: [0.0]),
    "hardtanh": (lambda x, a: F.hardtanh(x, a["lo"], a["hi"]), lambda a: [a["lo"], a["hi"]]),
}
GENERIC = [name for name, op in OPS.items() if op.activation is not None and name not in ("relu", "leaky_relu")]
MEANS = np.array([-30.0, -3.3, -1.28, -0.4, 0.0, 0.7, 2.5, 8.0])
VARIANCES = np.array([0.0, 1e-3, 0.04, 0.3, 4.0, 100.0, 1e12, 1e14])
HUGE_MEANS = np.array([-1e30, -1e4, 1e4, 1e30])
#: beyond the logistic family's clamp (|μ| > 1000, moments._A_CLAMP) with σ from 1e-2·|μ| to 1e2·|μ|: the
#: slope there is ~Φ(μ/σ) (SiLU, softplus) or ~φ(μ/σ)/σ (sigmoid, tanh), not 0
FAR_POINTS = [(sign * m, (r * m) ** 2) for m in (1e3 * (1 + 1e-6), 1e4, 1e6) for r in (1e-2, 0.1, 0.3, 1.0, 10.0, 1e2)
              for sign in (-1.0, 1.0)]
FEATURES = (-30.0, -10.0, -3.0, -1.0, 0.0, 1.0, 3.0, 10.0, 30.0)
_GL_X, _GL_W = np.polynomial.legendre.leggauss(200)


def torch_derivative(name: str, x: np.ndarray) -> np.ndarray:
    """``f'(x)`` of the torch activation by autograd (float64)."""
    fn, _ = TORCH[name]
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    fn(t, OPS[name].example_attrs).sum().backward()
    assert t.grad is not None
    return t.grad.numpy()


def true_slope(name: str, mu: float, var: float) -> float:
    """``E[f'(μ + σZ)]``: f' by autograd, 200-point Gauss–Legendre in ``z`` on each piece of
    ``[−12, 12]`` between the kinks (``f'(μ)`` for ``σ = 0``)."""
    if var == 0.0:
        return float(torch_derivative(name, np.array([mu]))[0])
    sd = np.sqrt(var)
    # the kinks, and where f' varies (|x| ≲ 30) resolved for any σ
    kinks = [(k - mu) / sd for k in [*TORCH[name][1](OPS[name].example_attrs), *FEATURES]]
    edges = sorted({-12.0, 12.0, *(z for z in kinks if -12.0 < z < 12.0)})
    total = 0.0
    for a, b in zip(edges[:-1], edges[1:]):
        z = 0.5 * (a + b) + 0.5 * (b - a) * _GL_X
        dens = np.exp(-0.5 * z**2) / np.sqrt(2 * np.pi)
        total += 0.5 * (b - a) * float(np.sum(_GL_W * dens * torch_derivative(name, mu + sd * z)))
    return total


def grid(name: str, float32: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Every (μ, v) of (MEANS ∪ HUGE_MEANS) × VARIANCES and FAR_POINTS (float32: v ≤ 1e14); tiny
    σ = 1e-8·|μ| (in float32's range); no zero variance at a kink of f (no derivative there)."""
    mu, var = (a.ravel() for a in np.meshgrid(np.concatenate([MEANS, HUGE_MEANS]), VARIANCES, indexing="ij"))
    far_mu, far_var = (np.array(c) for c in zip(*FAR_POINTS, strict=True))
    if float32:
        far_mu, far_var = far_mu[far_var <= 1e14], far_var[far_var <= 1e14]
    nonzero = np.concatenate([MEANS[MEANS != 0], HUGE_MEANS])
    if float32:
        nonzero = nonzero[np.abs(nonzero) <= 1e18]
    mu, var = np.concatenate([mu, far_mu, nonzero]), np.concatenate([var, far_var, (1e-8 * nonzero) ** 2])
    kinks = TORCH[name][1](OPS[name].example_attrs)
    keep = ~((var == 0) & np.isin(mu, kinks))
    return mu[keep], var[keep]


def test_every_activation_has_a_torch_truth():
    assert sorted(GENERIC) == sorted(TORCH), "add the torch function of the new activation to TORCH"


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "tanh" else n for n in GENERIC])
def test_dual_slope_is_the_expected_derivative(name):
    """float64: the slope of the rule's mean against E[f'(a)] (the rule's approximation error only,
    measured ≤ 3e-6 absolute on this grid), and against a central difference of the rule's mean
    where that is accurate (moderate μ, σ ≥ 0.03: only the difference's own error)."""
    rule, attrs = OPS[name].activation, OPS[name].example_attrs
    mu, var = grid(name)
    with np.errstate(all="ignore"):
        slope = np.broadcast_to(stein_slope(rule, mu, var, attrs, moments.NUMPY), mu.shape)
    truth = np.array([true_slope(name, m, v) for m, v in zip(mu, var)])
    assert np.all(np.isfinite(slope))
    err = np.abs(slope - truth)
    worst = int(np.argmax(err))
    assert err[worst] <= 2e-5, f"{name}: μ={mu[worst]:.3g} v={var[worst]:.3g}: {slope[worst]} vs {truth[worst]}"
    ok = (np.abs(mu) < 50) & (var >= 1e-3)
    h = 1e-5 * np.sqrt(var[ok])
    up = rule.moments(mu[ok] + h, var[ok], attrs, moments.NUMPY)[0]
    down = rule.moments(mu[ok] - h, var[ok], attrs, moments.NUMPY)[0]
    np.testing.assert_allclose(slope[ok], (up - down) / (2 * h), atol=1e-6, err_msg=name)


def test_zero_variance_slope_is_the_derivative_exactly():
    x = np.array([-7.5, -1.28, -0.3, 0.2, 1.1, 4.0])
    slope = stein_slope(OPS["silu"].activation, x, np.zeros_like(x), {}, moments.NUMPY)
    s = 1 / (1 + np.exp(-x))
    np.testing.assert_allclose(slope, s * (1 + x * (1 - s)), rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("name", [n if n in ("scale", "gelu") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in GENERIC])
def test_compiled_float32_slope_matches_the_float64_rule(name):
    """The float32 TE kernel body (``stein_kernel``, on TE_OPS) against the float64 slope on the grid."""
    import tvm
    from tvm import te

    from pyro2pfp.backends.tvm.ops.activation import stein_kernel
    from pyro2pfp.planning.graph import Layer, Repr
    from pyro2pfp.planning.plan import PlannedLayer

    rule, attrs = OPS[name].activation, OPS[name].example_attrs
    mu, var = grid(name, float32=True)
    n = len(mu)
    m, v, s, vo = (te.placeholder((n,), "float32", t) for t in ("m", "v", "s", "vo"))
    layer = Layer(name=name, op=name, inputs=["x"], out_shape=(n,), source=f"{name} (test)", attrs=attrs)
    planned = PlannedLayer(layer=layer, in_reprs=[Repr.VARIANCE], out_repr=Repr.VARIANCE)
    out = stein_kernel(planned, Repr.VARIANCE)(m, v, s, vo)
    lib = tvm.compile(tvm.IRModule({"main": te.create_prim_func([m, v, s, vo, out])}), target="llvm")
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(a.astype(np.float32), dev) for a in (mu, var, np.ones(n), np.full(n, np.inf))]
    result = tvm.runtime.tensor(np.zeros(n, np.float32), dev)
    lib(*args, result)
    mu32, var32 = mu.astype(np.float32).astype(np.float64), var.astype(np.float32).astype(np.float64)
    with np.errstate(all="ignore"):
        want = np.broadcast_to(stein_slope(rule, mu32, var32, attrs, moments.NUMPY), mu.shape)
    got = result.numpy()
    assert np.all(np.isfinite(got)), (mu[~np.isfinite(got)], var[~np.isfinite(got)])
    err = np.abs(got - want)
    worst = int(np.argmax(err))
    assert err[worst] <= 1e-4, f"μ={mu[worst]:.3g} v={var[worst]:.3g}: {got[worst]} vs {want[worst]}"


def test_unsupported_function_is_named():
    ops = dual_ops(moments.NUMPY)
    with pytest.raises(UnsupportedDualOp, match="ops.lgamma has no forward-mode derivative"):
        ops.lgamma(1.0)


# ------------------------------------------------------------------ a SiLU / GELU ResNet, the user way
class Block(nn.Module):
    def __init__(self, c: int, act: type[nn.Module]) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.act = act()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(self.act(self.bn1(self.conv1(x)))))
        return self.act(out + x)


class SmallResNet(nn.Module):
    def __init__(self, act: type[nn.Module], c: int = 6) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.act = act()
        self.block = Block(c, act)
        self.fc = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        out = self.block(self.act(self.bn(self.stem(x))))
        logits = self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


def bayesian(net: nn.Module) -> nn.Module:
    """Every conv/linear parameter a ``PyroSample`` with a N(0, 1) prior; BatchNorm in eval mode with
    non-trivial running statistics."""
    gen = torch.Generator().manual_seed(1)
    for module in net.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean = 0.3 * torch.randn(module.num_features, generator=gen)
            module.running_var = 0.5 + torch.rand(module.num_features, generator=gen)
    pyro.nn.module.to_pyro_module_(net)
    for module in net.modules():
        if isinstance(module, nn.Conv2d | nn.Linear):
            for name, p in list(module.named_parameters(recurse=False)):
                setattr(module, name, PyroSample(dist.Normal(0.0, 1.0).expand(list(p.shape)).to_event(p.dim())))
    return net.eval()


def converted(act: type[nn.Module]):
    from pyro2pfp_experiments.zoo import he_posterior

    torch.manual_seed(0)
    model = bayesian(SmallResNet(act))
    x = torch.randn(6, 3, 8, 8)
    guide = he_posterior(model, x[:2], scale=0.05, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fall-back warning
        net = pyro2pfp.convert(model, guide, input_shape=(3, 8, 8))
    return model, guide, net, x


@pytest.fixture(scope="module")
def silu_resnet():
    return converted(nn.SiLU)


@pytest.mark.slow
def test_silu_resnet_auto_is_shared_factor_and_closer_to_sampling(silu_resnet):
    model, guide, net, x = silu_resnet
    assert net.plan.correlation == "shared-factor"
    assert "silu" in {layer.op for layer in net.plan.layers}
    mean_field = pyro2pfp.convert(model, guide, input_shape=(3, 8, 8), correlation="mean-field")
    diag = pyro2pfp.diagnose(model, guide, x, num_samples=200, net=mean_field, per_layer=False, seed=7)
    mc_mean, mc_var = diag.output["mc_mean"], diag.output["mc_var"]
    xs = x.numpy().astype(np.float64)
    factored = layer_fidelity("logits", "", *net.reference(xs), mc_mean, mc_var)
    plain = layer_fidelity("logits", "", *mean_field.reference(xs), mc_mean, mc_var)
    # 200 samples: each logit's MC variance has relative sd ~0.1, their median (60 logits) ~0.02
    assert 0.85 <= factored.ratio_median <= 1.2, factored  # slope 0 (no shared part through SiLU): 0.76
    assert abs(np.log(factored.ratio_median)) < abs(np.log(plain.ratio_median)), (factored, plain)


@pytest.mark.slow
@pytest.mark.parametrize("act", [nn.SiLU, nn.GELU])
def test_resnet_compiled_and_onnx_match_the_reference(act, silu_resnet):
    from tests.support.backends import ONNX_RTOL, assert_matches, onnx_run

    _, _, net, x = silu_resnet if act is nn.SiLU else converted(act)
    xs = x.numpy()
    ref = net.reference(xs.astype(np.float64))
    assert_matches(net.compile("native")(xs), ref)
    assert_matches(onnx_run(net, xs), ref, rtol=ONNX_RTOL)
