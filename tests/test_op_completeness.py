"""Every PFP op the planner knows is complete: something converts to it (or the planner inserts
it), the NumPy reference executes it, the TVM back end has its kernel and a default CPU schedule,
the ONNX exporter writes it, and a Monte Carlo test and a compiled-vs-reference test check it.

Adding an op without one of these fails here, with the name of what is missing (the checklist of
docs/architecture.md)."""
from __future__ import annotations

import importlib

from op_coverage import COMPILED, COVERAGE, MONTE_CARLO

from pyro2pfp.converters import PRODUCES
from pyro2pfp.onnx_export import EXPORTERS
from pyro2pfp.plan import OP_SPECS
from pyro2pfp.reference._core import REFERENCES

# Ops the planner inserts between layers (representation conversions): no torch op converts to them.
PLAN_INSERTED = {"convert"}
# Ops whose TVM kernel is a Relax operator (no PrimFunc, so nothing to schedule): tvm_backend/shape.py.
RELAX_ONLY = {"reshape"}
TEST_MODULES = ("test_monte_carlo", "test_compiled_vs_reference", "test_layers", "test_vs_predictive")


def missing_parts() -> list[str]:
    from pyro2pfp.tvm_backend import KERNELS
    from pyro2pfp.tvm_backend.schedules import SCHEDULES

    for name in TEST_MODULES:  # their @covers decorators fill COVERAGE
        importlib.import_module(name)
    missing = []
    for op in sorted(OP_SPECS):
        parts = {
            "converter": op in PRODUCES or op in PLAN_INSERTED,
            "NumPy reference": op in REFERENCES,
            "TVM kernel": op in KERNELS,
            "CPU schedule": op in SCHEDULES or op in RELAX_ONLY,
            "ONNX export": op in EXPORTERS,
            MONTE_CARLO: MONTE_CARLO in COVERAGE[op],
            COMPILED: COMPILED in COVERAGE[op],
        }
        missing += [f"{op}: no {part}" for part, present in parts.items() if not present]
    return missing


def test_every_op_is_complete():
    assert missing_parts() == []


def test_an_incomplete_op_is_reported(monkeypatch):
    monkeypatch.setitem(OP_SPECS, "gelu", OP_SPECS["relu"])
    assert missing_parts() == [f"gelu: no {part}" for part in (
        "converter", "NumPy reference", "TVM kernel", "CPU schedule", "ONNX export", MONTE_CARLO, COMPILED)]


def test_ops_are_registered_once():
    from pyro2pfp.converters import register

    try:
        register("aten.relu.default", produces=("relu",))(lambda node, ctx: None)
    except ValueError as exc:
        assert "registered twice" in str(exc)
    else:
        raise AssertionError("registering a torch op twice must fail")
