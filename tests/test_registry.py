"""The op registry (pyro2pfp.ops) against every stage's implementation registry.

Adding an op without one of its parts fails here with the op and the missing part named.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from pyro2pfp import onnx_export
from pyro2pfp.converters import CONVERTERS
from pyro2pfp.ops import OPS, OpDef, OpRegistryError, register_op, render_layer_table
from pyro2pfp.ops.registry import PASS_THROUGH_TORCH_OPS
from pyro2pfp.reference._core import REFERENCES
from pyro2pfp.tvm_backend import _core
from pyro2pfp.tvm_backend.schedules import _schedule_fn

TESTS = Path(__file__).parent
REPO = TESTS.parent


def op_test_marks() -> set[tuple[str, str]]:
    """``(op, kind)`` of every ``@pytest.mark.pfp_op(op, kind)`` decorator in the test files."""
    marks = set()
    for path in TESTS.glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "pfp_op" and len(node.args) == 2
                    and all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args)):
                marks.add((node.args[0].value, node.args[1].value))
    return marks


def missing_parts(op: OpDef, marks: set[tuple[str, str]]) -> list[str]:
    missing = []
    if not op.internal:
        if not op.torch_ops:
            missing.append("torch ops (OpDef.torch_ops)")
        missing += [f"converter for {t}" for t in op.torch_ops if t not in CONVERTERS]
    if op.name not in REFERENCES:
        missing.append("reference (@pyro2pfp.reference.reference)")
    if op.name not in _core.KERNELS:
        missing.append("TVM kernel (@tvm_backend.kernel)")
    if not op.view and _schedule_fn(op.name) is None:
        missing.append("CPU schedule (@tvm_backend.schedule)")
    if op.name not in onnx_export.EXPORTERS:
        missing.append("ONNX export (@onnx_export.exporter)")
    missing += [f"{kind} test (@pytest.mark.pfp_op({op.name!r}, {kind!r}))"
                for kind in op.required_tests if (op.name, kind) not in marks]
    return missing


def test_every_op_is_complete():
    marks = op_test_marks()
    incomplete = {name: missing_parts(op, marks) for name, op in OPS.items()}
    incomplete = {name: parts for name, parts in incomplete.items() if parts}
    assert not incomplete, "ops with missing parts: " + "; ".join(
        f"{name}: {', '.join(parts)}" for name, parts in incomplete.items())


def test_completeness_check_names_what_is_missing():
    """The check itself can fail: an op registered nowhere else misses every part."""
    ghost = OpDef("ghost", ("aten.ghost.default",))
    parts = missing_parts(ghost, op_test_marks())
    assert parts == ["converter for aten.ghost.default", "reference (@pyro2pfp.reference.reference)",
                     "TVM kernel (@tvm_backend.kernel)", "CPU schedule (@tvm_backend.schedule)",
                     "ONNX export (@onnx_export.exporter)",
                     "monte_carlo test (@pytest.mark.pfp_op('ghost', 'monte_carlo'))",
                     "compiled test (@pytest.mark.pfp_op('ghost', 'compiled'))"]


def test_no_unregistered_implementations():
    """Every stage implements only registered ops, and every converter target belongs to an op
    (or is a pass-through: dropout, identity, the final softmax)."""
    names = set(OPS)
    for what, impl in [("reference", REFERENCES), ("kernel", _core.KERNELS),
                       ("ONNX exporter", onnx_export.EXPORTERS)]:
        assert set(impl) <= names, f"{what} for unregistered ops: {sorted(set(impl) - names)}"
    claimed = {t for op in OPS.values() for t in op.torch_ops} | set(PASS_THROUGH_TORCH_OPS)
    assert set(CONVERTERS) <= claimed, f"converters for unregistered torch ops: {sorted(set(CONVERTERS) - claimed)}"


def test_duplicates_are_rejected():
    with pytest.raises(OpRegistryError, match="'relu' is registered twice"):
        register_op(OpDef("relu"))
    with pytest.raises(OpRegistryError, match="aten.relu.default"):
        register_op(OpDef("relu_again", ("aten.relu.default",)))
    assert "relu_again" not in OPS


def test_readme_layer_table_is_the_generated_one():
    readme = (REPO / "README.md").read_text()
    assert render_layer_table() in readme, "regenerate the README table with pyro2pfp.ops.render_layer_table()"


def test_convert_never_imports_tvm(tmp_path):
    code = (
        "import sys, torch, pyro, pyro.nn as pnn, pyro.distributions as dist\n"
        "from pyro.infer.autoguide import AutoNormal\n"
        "import pyro2pfp\n"
        "class Net(pnn.PyroModule):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = pnn.PyroModule[torch.nn.Linear](3, 2)\n"
        "        self.fc.weight = pnn.PyroSample(dist.Normal(0., 1.).expand([2, 3]).to_event(2))\n"
        "    def forward(self, x):\n"
        "        return torch.relu(self.fc(x))\n"
        "net = Net(); guide = AutoNormal(net); guide(torch.zeros(1, 3))\n"
        "pfp = pyro2pfp.convert(net, guide, input_shape=(3,))\n"
        "pfp.reference(torch.zeros(1, 3).numpy())\n"
        "print(sorted(m for m in sys.modules if m == 'tvm' or m.startswith('tvm.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
