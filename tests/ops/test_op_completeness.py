"""Every registered PFP op is complete: something converts to it (or the planner inserts it), the
NumPy reference executes it, the TVM back end has its kernel and a default CPU schedule, the ONNX
exporter writes it, shared-factor PFP has its rule in every back end (float64, ONNX, TVM; unless the
OpDef says why not, ``no_shared_rule``), and the tests its OpDef requires (a Monte Carlo test and a
compiled-vs-reference test) check it -- a compiled-vs-reference test in the fast loop too (one not
marked ``slow``), so that a kernel that drops a term fails the loop run before every commit.

Adding an op without one of these fails here, with the name of what is missing (the checklist of
docs/architecture.md)."""
from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

from pyro2pfp import ops as ops  # the op registry: every op family registers itself
from pyro2pfp.backends.onnx.builder import EXPORTERS
from pyro2pfp.backends.reference import REFERENCES
from pyro2pfp.planning.converters import PRODUCES
from pyro2pfp.planning.registry import (
    COMPACT_EXPORTERS,
    COMPACT_REFERENCES,
    OPS,
    SHARED_EXPORTERS,
    SHARED_KERNELS,
    SHARED_REFERENCES,
    OpDef,
)
from tests.support.op_coverage import COMPILED, COVERAGE, FAST_COMPILED, MONTE_CARLO, fast_coverage

# every test module, in every folder of tests/: their @covers decorators fill COVERAGE (pytest has
# imported them already when it collects the whole suite; a new test file needs no registration here)
TESTS = Path(__file__).resolve().parents[1]
TEST_MODULES = tuple(sorted(
    ".".join(p.relative_to(TESTS.parent).with_suffix("").parts)
    for p in TESTS.rglob("test_*.py") if p.resolve() != Path(__file__).resolve()))
TEST_KINDS = {"monte_carlo": MONTE_CARLO, "compiled": COMPILED}


def import_test_modules() -> None:
    """Import every test module: their ``@covers`` fill COVERAGE (also where pytest collected only some,
    as on one xdist worker)."""
    for name in TEST_MODULES:
        importlib.import_module(name)


def missing_parts() -> list[str]:
    from pyro2pfp.backends.tvm import KERNELS, SCHEDULES

    import_test_modules()
    missing = []
    for name, op in sorted(OPS.items()):
        parts = {
            "converter": name in PRODUCES or op.internal,  # internal: inserted by the planner
            "NumPy reference": name in REFERENCES,
            "TVM kernel": name in KERNELS,
            "CPU schedule": name in SCHEDULES or op.view,  # a view emits no PrimFunc
            "ONNX export": name in EXPORTERS,
            "shared-factor rule (NumPy)": name in SHARED_REFERENCES or bool(op.no_shared_rule),
            "shared-factor rule (ONNX)": name in SHARED_EXPORTERS or bool(op.no_shared_rule),
            "shared-factor rule (TVM)": name in SHARED_KERNELS or bool(op.no_shared_rule),
            # a compact factor rule is optional; one in the reference must run in the float32 back ends too
            "compact factor rule (ONNX, TVM)": name not in COMPACT_REFERENCES or name in COMPACT_EXPORTERS,
        }
        parts.update({TEST_KINDS[kind]: TEST_KINDS[kind] in COVERAGE[name] for kind in op.required_tests})
        if "compiled" in op.required_tests:
            parts[FAST_COMPILED] = bool(fast_coverage(name, COMPILED))
        missing += [f"{name}: no {part}" for part, present in parts.items() if not present]
    return missing


def test_every_op_is_complete():
    assert missing_parts() == []


def test_an_incomplete_op_is_reported(monkeypatch):
    monkeypatch.setitem(OPS, "mish", OpDef("mish", ("aten.mish.default",)))
    assert missing_parts() == [f"mish: no {part}" for part in (
        "converter", "NumPy reference", "TVM kernel", "CPU schedule", "ONNX export", "shared-factor rule (NumPy)",
        "shared-factor rule (ONNX)", "shared-factor rule (TVM)", MONTE_CARLO, COMPILED, FAST_COMPILED)]


def test_a_compiled_check_only_in_slow_tests_is_reported(monkeypatch):
    """Slow compiled checks alone do not count: a slow test (or one whose every case is slow) is not
    the fast one the op needs."""
    from tests.support import op_coverage

    import_test_modules()
    slow_only = [fn for fn in op_coverage.COVERING["dense", COMPILED] if not op_coverage.runs_in_fast_loop(fn)]
    assert slow_only, "dense keeps its slow hypothesis sweep"
    monkeypatch.setitem(op_coverage.COVERING, ("dense", COMPILED), slow_only)
    assert missing_parts() == [f"dense: no {FAST_COMPILED}"]


def test_an_op_without_a_shared_factor_rule_says_why(monkeypatch):
    """An op may go without a shared-factor rule only with its reason in the OpDef (then a plan with
    factors refuses the network, naming the layer, and ``auto`` falls back to mean-field)."""
    monkeypatch.delitem(SHARED_KERNELS, "avg_pool2d")
    assert missing_parts() == ["avg_pool2d: no shared-factor rule (TVM)"]
    monkeypatch.setitem(OPS, "avg_pool2d", dataclasses.replace(OPS["avg_pool2d"], no_shared_rule="(a test)"))
    assert missing_parts() == []


def test_ops_are_registered_once():
    from pyro2pfp.planning.converters import register

    try:
        register("aten.relu.default", produces=("relu",))(lambda node, ctx: None)
    except ValueError as exc:
        assert "registered twice" in str(exc)
    else:
        raise AssertionError("registering a torch op twice must fail")
