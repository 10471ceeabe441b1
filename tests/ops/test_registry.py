"""The op registry (pyro2pfp.ops) against every stage's implementation registry.

(The per-op completeness check -- converter, reference, kernel, schedule, ONNX export, tests --
is tests/ops/test_op_completeness.py.)
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pyro2pfp import ops as ops  # the op registry: every op family registers itself
from pyro2pfp.backends.onnx import builder as onnx_builder
from pyro2pfp.backends.reference._core import REFERENCES
from pyro2pfp.backends.tvm import emit
from pyro2pfp.planning.converters import CONVERTERS
from pyro2pfp.planning.plan import op_specs
from pyro2pfp.planning.registry import (
    OPS,
    PASS_THROUGH_TORCH_OPS,
    OpDef,
    OpRegistryError,
    register_op,
    render_layer_table,
)

TESTS = Path(__file__).resolve().parents[1]  # tests/
REPO = TESTS.parent


def test_no_unregistered_implementations():
    """Every stage implements only registered ops, and every converter target belongs to an op
    (or is a pass-through: dropout, identity, the final softmax)."""
    names = set(OPS)
    for form in ("variance", "raw"):
        assert set(op_specs(form)) == names, "the planner's contracts and the registry know different ops"
    for what, impl in [("reference", REFERENCES), ("kernel", emit.KERNELS),
                       ("ONNX exporter", onnx_builder.EXPORTERS)]:
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
    assert render_layer_table() in readme, ("regenerate the README table with "
                                            "pyro2pfp.planning.registry.render_layer_table()")


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
