"""The library's shape: what importing it pulls in."""
from __future__ import annotations

import subprocess
import sys

import pytest


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    return set(out.split())


def test_core_library_needs_no_experiment_packages():
    """Converting, the reference, uncertainty and the CLI work without matplotlib and mlxtend (the
    ``experiments`` extra) and without the experiment code (pyro2pfp_experiments)."""
    loaded = _modules_after("import pyro2pfp, pyro2pfp.network, pyro2pfp.runtime.uncertainty, pyro2pfp.cli, "
                            "pyro2pfp.backends.onnx.builder, pyro2pfp.frontend.posterior")
    assert "pyro2pfp.network" in loaded
    for module in ("matplotlib", "mlxtend", "pyro2pfp_experiments"):
        assert module not in loaded, f"importing the core library imported {module}"


def _import_graph() -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``, counting every import statement, also the
    ones inside functions (a lazy import is still a dependency), but not those under
    ``if TYPE_CHECKING:`` (annotations only: nothing is imported when the code runs)."""
    import ast
    from pathlib import Path

    def statements(tree: ast.AST) -> list[ast.AST]:
        out, todo = [], [tree]
        while todo:
            node = todo.pop()
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                todo.extend(node.orelse)
                continue
            out.append(node)
            todo.extend(ast.iter_child_nodes(node))
        return out

    root = Path(__file__).resolve().parents[2] / "pyro2pfp"
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in statements(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
                target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
                for alias in node.names:
                    for candidate in (f"{target}.{alias.name}", target):
                        if candidate in modules:
                            graph[name].add(candidate)
                            break
            elif isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names if a.name in modules)
        graph[name].discard(name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_no_import_cycles():
    """The package's modules form a layered graph: no module imports (even lazily) one that imports it."""
    graph = _import_graph()
    assert "pyro2pfp.network" in graph and "pyro2pfp.runtime.deploy" in graph["pyro2pfp"]
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


#: The package's wings, lowest first: a module may import its own wing and the wings below it, never one
#: above (a lazy import too).  The stages of docs/architecture.md, in the order their imports allow: the
#: runtime (a board's whole install) needs nothing of the converter; the op families register into the
#: reference and ONNX tables below them and are read by the TVM back end above them.
WINGS = [
    ("base", ["pyro2pfp.errors", "pyro2pfp.options", "pyro2pfp._version", "pyro2pfp.compat"]),
    ("moments", ["pyro2pfp.moments"]),
    ("runtime", ["pyro2pfp.runtime"]),
    ("planning", ["pyro2pfp.planning"]),
    ("reference and ONNX back ends", ["pyro2pfp.backends", "pyro2pfp.backends.reference", "pyro2pfp.backends.onnx"]),
    ("correlation", ["pyro2pfp.correlation"]),
    ("ops", ["pyro2pfp.ops"]),
    ("TVM back end", ["pyro2pfp.backends.tvm"]),
    ("frontend", ["pyro2pfp.frontend"]),
    ("analysis", ["pyro2pfp.analysis"]),
    ("API", ["pyro2pfp", "pyro2pfp.network", "pyro2pfp.diagnosis", "pyro2pfp.calibration"]),
    ("command line", ["pyro2pfp.cli", "pyro2pfp.__main__"]),
]


def _wing(module: str) -> int:
    """The rank of ``module``'s wing (the longest listed prefix)."""
    best, rank = "", -1
    for i, (_, prefixes) in enumerate(WINGS):
        for p in prefixes:
            if (module == p or (module.startswith(p + ".") and p != "pyro2pfp")) and len(p) > len(best):
                best, rank = p, i
    assert rank >= 0, f"{module} belongs to no wing: add it to WINGS"
    return rank


def test_wings_point_down():
    """Every import (lazy ones too) goes to the importer's own wing or one below it."""
    up = [f"{a} ({WINGS[_wing(a)][0]}) -> {b} ({WINGS[_wing(b)][0]})"
          for a, bs in sorted(_import_graph().items()) for b in sorted(bs) if _wing(b) > _wing(a)]
    assert not up, "imports pointing up: " + "; ".join(up)


def test_the_wing_check_sees_an_upward_import():
    assert _wing("pyro2pfp.runtime.predictor") < _wing("pyro2pfp.analysis.fidelity")
    assert _wing("pyro2pfp.backends.reference._core") < _wing("pyro2pfp.ops.compute")
    assert _wing("pyro2pfp.ops.compute") < _wing("pyro2pfp.backends.tvm.emit")


def test_the_top_level_holds_few_modules():
    """Stages live in their wings; the top level keeps the base (errors, options, version) and the API."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "pyro2pfp"
    top = sorted(p.name for p in root.glob("*.py"))
    assert len(top) <= 12, top


def test_cycle_detector_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


MAX_FUNCTION_LINES = 120


def _long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    """``(name, lines)`` of every function or method in ``source`` longer than ``limit`` lines, from its
    ``def`` (decorators not counted) to its last line, nested functions included in their parent's count."""
    import ast

    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None
            and node.end_lineno - node.lineno + 1 > limit]


def test_no_package_function_is_longer_than_120_lines():
    """Every function in ``pyro2pfp/`` (docstring and nested functions included) fits in 120 lines: a longer one
    does several jobs and is split into functions with one each."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    long = [f"{path.relative_to(root)}:{name} ({lines} lines)"
            for path in sorted((root / "pyro2pfp").rglob("*.py"))
            for name, lines in _long_functions(path.read_text(encoding="utf-8"), MAX_FUNCTION_LINES)]
    assert not long, "functions longer than 120 lines: " + "; ".join(long)


def test_the_length_check_sees_a_long_function():
    body = "".join(f"        x{n} = {n}\n" for n in range(MAX_FUNCTION_LINES))
    source = f"def short():\n    pass\n\n\nclass A:\n    def long(self):\n{body}"
    assert _long_functions(source, MAX_FUNCTION_LINES) == [("long", MAX_FUNCTION_LINES + 1)]


PICKLING = """\
import pickle, pkgutil, sys, importlib

import cloudpickle
import pyro2pfp


class Scorer:  # a user's class referring to the module-level package, as Ray ships it to workers
    def __call__(self, x):
        return pyro2pfp.uncertainty, pyro2pfp.load


# every submodule imported (the import system binds each to the package's attribute of its name)
for info in pkgutil.walk_packages(pyro2pfp.__path__, "pyro2pfp."):
    if not info.name.endswith("__main__"):
        importlib.import_module(info.name)
assert callable(pyro2pfp.diagnose) and callable(pyro2pfp.uncertainty), (pyro2pfp.diagnose, pyro2pfp.uncertainty)
assert type(pyro2pfp) is type(sys), type(pyro2pfp)
assert cloudpickle.loads(cloudpickle.dumps(pyro2pfp)) is pyro2pfp
assert cloudpickle.loads(cloudpickle.dumps(Scorer))()(None) == (pyro2pfp.uncertainty, pyro2pfp.load)
for obj in (pyro2pfp.diagnose, pyro2pfp.convert, pyro2pfp.PFPNetwork, pyro2pfp.Correlation.AUTO,
            pyro2pfp.SharedFactor(), pyro2pfp.InputShapeError("x has shape (3,)"), pyro2pfp.Diagnosis):
    for dumps in (pickle.dumps, cloudpickle.dumps):
        back = pickle.loads(dumps(obj))
        assert back is obj or (back == obj or str(back) == str(obj)), (obj, back)
print("ok")
"""


def test_the_package_pickles_by_reference():
    """A user's class that refers to the module-level package ships to a Ray worker (cloudpickle)."""
    import cloudpickle

    import pyro2pfp

    assert type(pyro2pfp) is type(sys) and cloudpickle.loads(cloudpickle.dumps(pyro2pfp)) is pyro2pfp


@pytest.mark.slow
def test_the_package_and_its_objects_pickle_after_any_submodule_is_imported():
    """``import pyro2pfp`` is a plain module: it pickles by reference with cloudpickle (a user's class
    that refers to it ships to a Ray worker), as do its functions, classes, options and errors with the
    standard pickle; and importing any submodule leaves the package's functions the functions."""
    out = subprocess.run([sys.executable, "-c", PICKLING], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
