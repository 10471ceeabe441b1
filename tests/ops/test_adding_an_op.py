"""docs/adding-an-op.md is complete: a new op family, written here the way the page says (an OpDef, a
converter, one formula for the reference and the ONNX export, a TVM kernel and schedule, the shared-factor
rule in every back end) and registered for the length of one test, converts a Pyro model that uses it, runs
in the float64 reference, the compiled module and ONNX with the same answers (mean-field and
shared-factor), agrees with sampling, and leaves the completeness test nothing to report.  What registering
it filled is exactly the tables the page lists; afterwards every table is as before (no registry state
leaks into the tests that run after it in the same process, as under xdist).

The toy op is ``toy_exp``, ``y = exp(x)`` (``torch.exp``): for ``a ~ N(μ, v)`` the output is LogNormal,
``E[y] = exp(μ + v/2)``, ``Var[y] = (exp(v) − 1)·E[y]²`` (exact); its shared-factor rule is Stein's
``Cov(exp(a), η) = E[exp'(a)]·s = E[y]·s`` (exact for a Gaussian ``a`` jointly Gaussian with the factors).
"""
from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyro
import pyro.distributions as dist
import torch
import torch.nn as nn
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroSample

import pyro2pfp
from tests.support.backends import ONNX_RTOL, assert_matches, onnx_run
from tests.support.op_coverage import COMPILED, MONTE_CARLO, covers
from tests.support.stats import assert_moments_agree

TOY = "toy_exp"
TORCH_OP = "aten.exp.default"
DOC = Path(__file__).resolve().parents[2] / "docs" / "adding-an-op.md"


def _package_tables() -> dict[int, tuple[str, dict[Any, Any]]]:
    """Every module-level dict of the loaded ``pyro2pfp`` modules, by identity: ``{id: (name, dict)}`` (a
    table re-exported by a package is found once, under its shortest spelling)."""
    found: dict[int, tuple[str, dict[Any, Any]]] = {}
    for module_name, module in sorted(sys.modules.items()):
        if not module_name.startswith("pyro2pfp") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, dict) and not attr.startswith("__"):
                found.setdefault(id(value), (attr, value))
    return found


def _register_toy_family() -> None:
    """The toy op family: what ``pyro2pfp/ops/<family>.py`` and ``backends/tvm/ops/<family>.py`` would hold."""
    from tvm import te

    from pyro2pfp.backends.tvm import kernel, schedule
    from pyro2pfp.backends.tvm.emit import activation_out, epilogue, variance_of
    from pyro2pfp.backends.tvm.ops.activation import schedule_elementwise
    from pyro2pfp.backends.tvm.shared_factor import SharedRelax, emit_part
    from pyro2pfp.backends.tvm.shared_factor import clip as te_clip
    from pyro2pfp.backends.tvm.shared_factor_schedule import schedule_shared
    from pyro2pfp.correlation.shared import Shared
    from pyro2pfp.correlation.shared_algebra import clip
    from pyro2pfp.ops._formula import formula, shared_formula
    from pyro2pfp.planning.converters import register
    from pyro2pfp.planning.graph import Layer, Repr
    from pyro2pfp.planning.registry import (
        VARIANCE_IN_OUT,
        OpDef,
        register_op,
        shared_kernel,
    )

    # 1. the OpDef and its contract (variance in, variance out; a deterministic input stays deterministic)
    register_op(OpDef(TOY, (TORCH_OP,), modules="`torch.exp`", modules_short=("exp",),
                      moments="exact (LogNormal)", assumptions="input treated as Gaussian", contract=VARIANCE_IN_OUT))

    # 2. its converter
    @register(TORCH_OP, produces=(TOY,))
    def convert_exp(node: Any, ctx: Any) -> Layer:
        return Layer(name=ctx.new_name(node, prefer_module=False), op=TOY, inputs=[ctx.activation(node.args[0], node)],
                     out_shape=ctx.shape(node), source=ctx.source(node))

    # 3. its moments: one formula for the NumPy reference and the ONNX export
    @formula(TOY)
    def toy_exp(bk: Any, layer: Any, inputs: list[Any]) -> Any:
        x = inputs[0]
        if x.repr is Repr.DETERMINISTIC:
            return bk.deterministic(bk.ops.exp(x.mean))
        var = bk.variance(x)
        mean = bk.ops.exp(x.mean + bk.ops.const(0.5) * var)
        return bk.emit(mean, (bk.ops.exp(var) - bk.ops.const(1.0)) * mean * mean, layer)

    # 4. its TE kernel and default CPU schedule
    @kernel(TOY)
    def toy_exp_kernel(ctx: Any, layer: Any, inputs: list[Any]) -> Any:
        x = inputs[0]
        if x.repr is Repr.DETERMINISTIC:
            def exact(m: te.Tensor) -> te.Tensor:
                return te.compute(m.shape, lambda *i: te.exp(m[i]), name=TOY)

            return activation_out(ctx.emit_te(exact, [x.mean], layer), layer)

        def matched(m: te.Tensor, s: te.Tensor) -> list[te.Tensor]:
            def element(*i: Any) -> list[Any]:
                var = variance_of(m[i], s[i], x.repr)
                mean = te.exp(m[i] + 0.5 * var)
                return epilogue(mean, (te.exp(var) - 1.0) * mean * mean, layer)

            return te.compute(m.shape, element, name=TOY)

        return activation_out(ctx.emit_te(matched, x.tensors(), layer), layer)

    schedule(TOY)(schedule_elementwise)

    # 5. its shared-factor rule: one formula for float64 and ONNX, the TVM kernel (+ the schedule of its part)
    @shared_formula(TOY)
    def toy_exp_shared(bk: Any, layer: Any, inputs: list[Any], shared: list[Any], fp: Any, var: Any) -> Any:
        x, sh = inputs[0], shared[0]
        if sh is None:
            return None, var
        slope = bk.ops.exp(x.mean + bk.ops.const(0.5) * bk.variance(x))  # E[exp'(a)] = E[exp(a)]
        s = slope * bk.reshape(sh.s, tuple(layer.layer.out_shape))
        return Shared(clip(bk, s, var), sh.g, sh.k), var

    @shared_kernel(TOY)
    def toy_exp_shared_kernel(step: Any, ctx: Any, layer: Any, inputs: list[Any], shared: list[Any], out: Any) -> Any:
        sh = shared[0]
        assert sh is not None

        def fn(s: te.Tensor, m: te.Tensor, v: te.Tensor) -> te.Tensor:
            return te.compute(s.shape, lambda *i: te_clip(m[i] * s[i], v[i]), name="toy_exp_shared")

        return SharedRelax(emit_part(ctx, fn, [sh.s, out.mean, out.second], layer, TOY)[0], sh.g, sh.k), out

    schedule(f"sf_{TOY}")(schedule_shared)


def _toy_keys(keys: Any) -> set[Any]:
    return {key for key in keys if key == TORCH_OP or TOY in str(key)}


def leftovers(before: dict[int, tuple[str, set[Any]]]) -> dict[str, set[Any]]:
    """``{table: keys naming the toy op}`` that a package table holds now and did not hold in ``before``
    (``_snapshot()``), including tables made since."""
    out = {}
    for key, (name, table) in _package_tables().items():
        new = _toy_keys(set(table) - before.get(key, ("", set()))[1])
        if new:
            out[name] = new
    return out


def _snapshot() -> dict[int, tuple[str, set[Any]]]:
    return {key: (name, set(table)) for key, (name, table) in _package_tables().items()}


@contextlib.contextmanager
def toy_family() -> Iterator[set[str]]:
    """The toy family registered for the ``with`` block; yields the names of the package tables its
    registration added keys to.  Afterwards every key naming it that a package table gained is removed
    again (also when the block fails)."""
    import pyro2pfp.backends.tvm  # noqa: F401  (the TVM tables exist before the snapshot)

    before = _snapshot()
    try:
        _register_toy_family()
        yield set(leftovers(before))
    finally:
        for key, (_, table) in _package_tables().items():
            for new in _toy_keys(set(table) - before.get(key, ("", set()))[1]):
                del table[new]


def documented_tables() -> set[str]:
    """The tables docs/adding-an-op.md says a new op fills (its section "What registering an op fills")."""
    text = DOC.read_text()
    section = text.split("## What registering an op fills", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([A-Z_]+)` \|", section, flags=re.M))


class ExpNet(PyroModule):
    """A Bayesian MLP with an exponential activation, written as users write Pyro models."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = PyroModule[nn.Linear](4, 6)
        self.fc2 = PyroModule[nn.Linear](6, 3)
        for layer in (self.fc1, self.fc2):
            layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand(layer.weight.shape).to_event(2))
            layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand(layer.bias.shape).to_event(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.exp(self.fc1(x)))


def _posterior_samples(guide: AutoNormal, x: torch.Tensor, n: int) -> np.ndarray:
    """``n`` draws of the network's output on ``x`` under the guide's Normal posterior, the weights drawn
    from the guide's locations and scales: (n, B, 3)."""
    draws = {}
    with torch.no_grad():
        for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
            loc, scale = guide._get_loc_and_scale(name)
            draws[name] = loc.double() + scale.double() * torch.randn(n, *loc.shape, dtype=torch.float64)
        h = torch.exp(torch.einsum("bi,noi->nbo", x.double(), draws["fc1.weight"]) + draws["fc1.bias"][:, None])
        return (torch.einsum("nbi,noi->nbo", h, draws["fc2.weight"]) + draws["fc2.bias"][:, None]).numpy()


def _model_and_guide(x: torch.Tensor) -> tuple[ExpNet, AutoNormal]:
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = ExpNet()
    guide = AutoNormal(model, init_scale=0.15)
    guide(x)
    with torch.no_grad():
        for name, value in pyro.get_param_store().named_parameters():
            if "locs" in name:
                value.copy_(0.3 * torch.randn_like(value))
    return model, guide


@covers(TOY, kind=COMPILED)
@covers(TOY, kind=MONTE_CARLO)
def test_a_new_op_family_runs_everywhere_and_is_complete():
    from tests.ops.test_op_completeness import missing_parts

    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    before = _snapshot()
    with toy_family() as filled:
        assert filled == documented_tables(), "docs/adding-an-op.md lists the tables a new op fills"
        assert missing_parts() == []
        model, guide = _model_and_guide(x)
        samples = _posterior_samples(guide, x, 100_000)
        for correlation in ("mean-field", "shared-factor"):
            net = pyro2pfp.convert(model, guide, input_shape=(4,), correlation=correlation)
            assert TOY in [layer.op for layer in net.plan.layers]
            xs = x.numpy()
            ref = net.reference(xs)
            assert_matches(net.compile()(xs), ref)
            assert_matches(onnx_run(net, xs), ref, ONNX_RTOL)
            # every unit of fc1 is Gaussian and independent of the others: both plans are exact here
            assert_moments_agree(samples, *ref)
            if correlation == "shared-factor":  # the toy's rule ran: its input carries factors
                toy = next(layer for layer in net.plan.layers if layer.op == TOY)
                assert net.plan.factors.width[toy.inputs[0]] > 0
    assert leftovers(before) == {}
    assert missing_parts() == []


def test_an_op_registered_for_a_test_is_gone_afterwards():
    """The registration is undone also when the test body fails."""
    from pyro2pfp.planning.registry import OPS

    before = _snapshot()
    try:
        with toy_family():
            assert TOY in OPS
            raise RuntimeError("the test failed")
    except RuntimeError:
        pass
    assert TOY not in OPS
    assert leftovers(before) == {}
