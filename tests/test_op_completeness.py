"""Every registered PFP op is complete: something converts to it (or the planner inserts it), the
NumPy reference executes it, the TVM back end has its kernel and a default CPU schedule, the ONNX
exporter writes it, and the tests its OpDef requires (a Monte Carlo test and a compiled-vs-reference
test) check it.

Adding an op without one of these fails here, with the name of what is missing (the checklist of
docs/architecture.md)."""
from __future__ import annotations

import importlib
from pathlib import Path

from pyro2pfp import ops as ops  # the op registry: every op family registers itself
from pyro2pfp.converters import PRODUCES
from pyro2pfp.onnx_export import EXPORTERS
from pyro2pfp.reference import REFERENCES
from pyro2pfp.registry import OPS, OpDef
from tests.support.op_coverage import COMPILED, COVERAGE, MONTE_CARLO

# every test module: their @covers decorators fill COVERAGE (pytest has imported them already when it
# collects the whole suite; a new test file needs no registration here)
TEST_MODULES = tuple(sorted(p.stem for p in Path(__file__).parent.glob("test_*.py") if p.stem != Path(__file__).stem))
TEST_KINDS = {"monte_carlo": MONTE_CARLO, "compiled": COMPILED}


def missing_parts() -> list[str]:
    from pyro2pfp.tvm_backend import KERNELS, SCHEDULES

    for name in TEST_MODULES:
        importlib.import_module(f"tests.{name}")
    missing = []
    for name, op in sorted(OPS.items()):
        parts = {
            "converter": name in PRODUCES or op.internal,  # internal: inserted by the planner
            "NumPy reference": name in REFERENCES,
            "TVM kernel": name in KERNELS,
            "CPU schedule": name in SCHEDULES or op.view,  # a view emits no PrimFunc
            "ONNX export": name in EXPORTERS,
        }
        parts.update({TEST_KINDS[kind]: TEST_KINDS[kind] in COVERAGE[name] for kind in op.required_tests})
        missing += [f"{name}: no {part}" for part, present in parts.items() if not present]
    return missing


def test_every_op_is_complete():
    assert missing_parts() == []


def test_an_incomplete_op_is_reported(monkeypatch):
    monkeypatch.setitem(OPS, "mish", OpDef("mish", ("aten.mish.default",)))
    assert missing_parts() == [f"mish: no {part}" for part in (
        "converter", "NumPy reference", "TVM kernel", "CPU schedule", "ONNX export", MONTE_CARLO, COMPILED)]


def test_ops_are_registered_once():
    from pyro2pfp.converters import register

    try:
        register("aten.relu.default", produces=("relu",))(lambda node, ctx: None)
    except ValueError as exc:
        assert "registered twice" in str(exc)
    else:
        raise AssertionError("registering a torch op twice must fail")
