"""One op family lives in one place: the names of the ops with the most per-op code (ReLU, LeakyReLU,
max and average pooling) appear as string literals only in their family files
(``pyro2pfp/ops/<family>.py``, ``pyro2pfp/backends/tvm/ops/<family>*.py``) and in the few other
package files listed here, each with the reason it still names the op.  Everything else reads the
registry (``OpDef`` fields, ``ActivationRule``, the stage tables).  A static check: no import of TVM."""
from __future__ import annotations

import ast
import functools
import importlib
from pathlib import Path

from pyro2pfp import ops
from pyro2pfp.planning.registry import OpDef

PACKAGE = Path(ops.__file__).resolve().parents[1]
CHECKED = ("relu", "leaky_relu", "max_pool2d", "avg_pool2d")
#: files outside the family files that still spell an op's name, and why
ELSEWHERE = {
    "relu": {"backends/tvm/fusion.py": "the emitter fuses a ReLU into the dense/add kernel before it"},
    "leaky_relu": {},
    "max_pool2d": {"planning/correlated_pools.py": "the planner's rewrite of max pools fed by a conv (correlated max)"},
    "avg_pool2d": {"correlation/factors.py": "the auto choice: an average pool of a conv's noise needs shared factors"},
}
MAX_ELSEWHERE = 3


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


def outside_family(op: str) -> set[str]:
    family = family_of(op)
    return {f for f in files_naming(op)
            if f != f"ops/{family}.py" and not (f.startswith(f"backends/tvm/ops/{family}") and f.count("/") == 3)}


def test_op_names_stay_in_their_family_files():
    for op in CHECKED:
        elsewhere = outside_family(op)
        assert elsewhere <= set(ELSEWHERE[op]), f"{op!r} is spelled outside its family files in {sorted(elsewhere)}"
        assert len(elsewhere) <= MAX_ELSEWHERE


def test_the_list_of_exceptions_is_current():
    """Every listed exception still spells the op (so the list shrinks when one is removed)."""
    for op in CHECKED:
        assert outside_family(op) == set(ELSEWHERE[op]), op
