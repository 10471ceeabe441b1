"""One op family lives in one place: the name of every registered op appears as a string literal only in
its family files (``pyro2pfp/ops/<family>.py`` and ``ops/<family>_<part>.py``,
``pyro2pfp/backends/tvm/ops/<family>*.py``) and in the few other package files listed here, each with the
reason it still names the op.  Everything else reads the registry (``OpDef`` fields and hooks,
``FactorSpec``, ``CompactSpec``, ``ActivationRule``, the stage tables).  A static check: no import of TVM."""
from __future__ import annotations

import ast
import functools
import importlib
from pathlib import Path

from pyro2pfp import ops
from pyro2pfp.planning.registry import OPS, OpDef

PACKAGE = Path(ops.__file__).resolve().parents[1]
CHECKED = tuple(sorted(OPS))

_COVS = "the planner inserts the in-window covariance layers before a max pool (correlated_pools)"
_TORCH = "a torch function of the same name (aten.{0}), not the PFP op"
#: files outside the family files that still spell an op's name, and why (an op not listed: none)
ELSEWHERE: dict[str, dict[str, str]] = {
    "add": {
        "backends/tvm/fusion.py": "the TVM emitter fuses a ReLU into the dense/add kernel before it",
    },
    "affine": {
        "frontend/noise.py": "the name of a noise rule (an affine map of a sample site), not the PFP op",
        "planning/folding.py": "the planner folds an eval-mode BatchNorm (affine) into the compute layer before it",
    },
    "conv2d": {
        "backends/tvm/guide_factor.py": "the name of a TE stage (a guide's convolution), not the PFP op",
        "backends/tvm/ops/winograd.py": "the compute family's Winograd kernel (a conv2d algorithm of its own file)",
        "backends/tvm/subnormals.py": "kernel names measured slowed by subnormals (the conv kernel's symbol)",
    },
    "convert": {
        "__init__.py": "the public function pyro2pfp.convert, not the PFP op",
        "cli/parser.py": "the CLI command, not the PFP op",
        "planning/plan.py": "the planner inserts convert layers (the op exists for it)",
    },
    "dense": {"backends/tvm/fusion.py": "the TVM emitter fuses a ReLU into the dense/add kernel before it"},
    "relu": {"backends/tvm/fusion.py": "the TVM emitter fuses a ReLU into the dense/add kernel before it"},
    "reshape": {
        "frontend/output_chain.py": "a link of a stripped output chain (torch's view/reshape), not the PFP op",
        "frontend/param_expressions.py": _TORCH.format("reshape"),
        "frontend/trace_forms.py": _TORCH.format("reshape"),
        "frontend/trace_passes.py": _TORCH.format("reshape"),
        "ops/compute.py": "the 1-D conv's converter emits reshapes around the 2-D layer (planning.onedim.as_2d)",
        "ops/concat.py": "the stack converter emits reshapes",
        "ops/pooling.py": "the pools' converters emit reshapes (1-D pools, global pools)",
        "planning/onedim.py": "the planner's 1-D lift moves and merges reshapes",
    },
    "scale": {
        "backends/tvm/ops/arithmetic.py": "scale's shared-factor kernel is affine's (one linear rule for both)",
        "correlation/loadings.py": "the name of a constant tensor (a scaling column), not the PFP op",
        "frontend/output_chain.py": "a link of a stripped output chain (× a constant), not the PFP op",
        "ops/arithmetic.py": "scale's shared-factor rule is affine's (one linear rule for both)",
        "planning/folding.py": "the name of a BatchNorm's scale parameter, not the PFP op",
    },
    "sigmoid": {
        "frontend/output_chain.py": "a final torch sigmoid (probabilities) stripped from the output, not the PFP op",
        "moments/far_tail.py": "the far-tail constants of the sigmoid's moment function, not the PFP op",
    },
    "silu": {"moments/far_tail.py": "the far-tail constants of the SiLU's moment function, not the PFP op"},
    "softmax_head": {"runtime/deploy.py": "a library file written without its head entry names the head's kernel"},
    "softplus": {"moments/far_tail.py": "the far-tail constants of the softplus' moment function, not the PFP op"},
    "tanh": {"correlation/stein.py": "the tanh of the ops namespace (forward-mode AD), not the PFP op"},
    "window_activation": {"planning/correlated_pools.py": _COVS},
    "window_closure": {"planning/correlated_pools.py": _COVS},
    "window_cov": {"planning/correlated_pools.py": _COVS},
}


def family_of(op: str) -> str:
    """The family (``ops/<family>.py`` stem) whose module defines ``op``'s OpDef."""
    for path in (PACKAGE / "ops").glob("*.py"):
        module = importlib.import_module(f"pyro2pfp.ops.{path.stem}")
        if any(isinstance(v, OpDef) and v.name == op for v in vars(module).values()):
            return path.stem
    raise AssertionError(f"no family file defines op {op!r}")


@functools.cache
def _literals() -> dict[str, frozenset[str]]:
    """``{package file (relative path): the checked op names among its string literals}``."""
    out = {}
    quoted = [f"{q}{op}{q}" for op in CHECKED for q in "\"'"]
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if not any(q in text for q in quoted):  # cheap filter: parse only the files that may name one
            continue
        out[path.relative_to(PACKAGE).as_posix()] = frozenset(
            n.value for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Constant) and n.value in CHECKED)
    return out


def files_naming(op: str) -> set[str]:
    """The package files (relative paths) with a string literal equal to ``op``."""
    return {f for f, names in _literals().items() if op in names}


def in_family(path: str, family: str) -> bool:
    """``path`` is one of ``family``'s files: ``ops/<family>.py``, ``ops/<family>_<part>.py`` or a
    ``backends/tvm/ops/<family>*.py``."""
    folder, _, name = path.rpartition("/")
    if folder == "ops":
        return name == f"{family}.py" or name.startswith(f"{family}_")
    return folder == "backends/tvm/ops" and name.startswith(family)


def outside_family(op: str) -> set[str]:
    family = family_of(op)
    return {f for f in files_naming(op) if not in_family(f, family)}


def test_the_exceptions_name_registered_ops():
    assert set(ELSEWHERE) <= set(CHECKED)


def test_op_names_stay_in_their_family_files():
    for op in CHECKED:
        elsewhere = outside_family(op)
        assert elsewhere <= set(ELSEWHERE.get(op, {})), \
            f"{op!r} is spelled outside its family files in {sorted(elsewhere)}"


def test_the_list_of_exceptions_is_current():
    """Every listed exception still spells the op (so the list shrinks when one is removed)."""
    for op in CHECKED:
        assert outside_family(op) == set(ELSEWHERE.get(op, {})), op
