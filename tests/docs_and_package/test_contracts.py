"""The package's typed contracts, read from its source: no ``Any`` where a stage's object is passed, and no
import inside a function without a reason."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "pyro2pfp"

#: parameters that carry a stage's object: the factor plan, the converted network, a planned layer, a plan
TYPED_PARAMETERS = ("factors", "net", "layer", "plan")


def _sources() -> dict[str, Path]:
    """``{module name: path}`` of every module of the package."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _any_parameters(tree: ast.AST, names: tuple[str, ...] = TYPED_PARAMETERS) -> list[tuple[int, str]]:
    """``(line, parameter)`` of every function parameter named one of ``names`` whose type is ``Any`` (or
    ``Any | None``; a container of ``Any`` such as ``list[Any]`` is a type of its own)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        args = node.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            if arg.arg in names and arg.annotation is not None:
                text = ast.unparse(arg.annotation).replace(" ", "").strip("'\"")
                if text in {"Any", "typing.Any", "Any|None", "None|Any", "Optional[Any]"}:
                    found.append((node.lineno, arg.arg))
    return found


def test_stage_objects_are_not_typed_any():
    """A parameter named ``factors``, ``net``, ``layer`` or ``plan`` has its class or Protocol as its type
    (``PlannedLayer``, ``ConvertedNetwork``, ``FactorScheme``, ``CompactPlan``, ...), never ``Any``: mypy then
    checks what the function reads of it."""
    offenders = [f"{path.relative_to(ROOT.parent)}:{line}: {name}: Any"
                 for path in sorted(_sources().values())
                 for line, name in _any_parameters(ast.parse(path.read_text()))]
    assert not offenders, "parameters typed Any:\n" + "\n".join(offenders)


def test_the_any_check_sees_an_any_parameter():
    tree = ast.parse("from typing import Any\n"
                     "def f(net: Any, layer: 'Any', plan: Any | None = None, x: Any = 0, factors: int = 0): ...\n"
                     "def g(factors: list[Any]): ...\n")
    assert _any_parameters(tree) == [(2, "net"), (2, "layer"), (2, "plan")]


#: Third-party modules a module of the package may import inside a function (and why it does not import
#: them at its top): the longest prefix of the imported name decides.  Any other function-level import
#: -- of the standard library, NumPy, or a module of the package that loads none of these -- belongs at the
#: module's top, unless its line says why not (``# lazy: <reason>``, e.g. the cycle it breaks).
LAZY_REASONS = {
    "tvm": "the TVM compiler takes seconds to import; a board runs libraries with the TVM runtime alone",
    "tvm_ffi": "the TVM runtime's FFI loads libtvm_runtime: only when a library is loaded or run",
    "torch": "torch takes seconds to import; a board runs exported networks without it",
    "pyro": "Pyro imports torch",
    "sympy": "torch's symbolic shapes, read only where a traced program is",
    "onnx": "only the ONNX export and the ONNX predictor need onnx",
    "onnxruntime": "only the ONNX predictor needs onnxruntime",
    "ray": "the optional `ray` extra: scoring on Ray Data only",
    "pyarrow": "Parquet shards only (pyarrow comes with the `ray` extra)",
    "scipy": "a board runs exported networks without SciPy",
    "matplotlib": "the optional `experiments` extra: plots only",
    "psutil": "MetaSchedule's and the thread count's need, not a board's",
    "cloudpickle": "MetaSchedule's worker processes' need, not a board's",
    "xgboost": "MetaSchedule's optional cost model",
}


def _heavy(name: str) -> str | None:
    """The longest key of :data:`LAZY_REASONS` that ``name`` (a dotted module name) starts with."""
    keys = [k for k in LAZY_REASONS if name == k or name.startswith(k + ".")]
    return max(keys, key=len) if keys else None


class _Imports:
    """Each module's imports, split into those at its top (``if TYPE_CHECKING:`` left out) and those inside
    functions, as dotted names (a module of the package when the name is one, else the name imported)."""

    def __init__(self) -> None:
        self.modules = _sources()
        self.top: dict[str, list[str]] = {}
        self.lazy: dict[str, list[tuple[int, list[str], str]]] = {}
        for name, path in self.modules.items():
            lines = path.read_text().splitlines()
            top: list[str] = []
            lazy: list[tuple[int, list[str], str]] = []

            def walk(node: ast.AST, in_function: bool, name: str = name, path: Path = path,
                     lines: list[str] = lines, top: list[str] = top, lazy: list = lazy) -> None:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                        continue
                    if isinstance(child, ast.Import | ast.ImportFrom):
                        targets = self._targets(name, path, child)
                        if in_function:
                            lazy.append((child.lineno, targets, lines[child.lineno - 1]))
                        else:
                            top.extend(targets)
                    walk(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

            walk(ast.parse(path.read_text()), False)
            self.top[name], self.lazy[name] = top, lazy
        self._loads: dict[str, set[str]] = {}

    def _targets(self, name: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        if node.level:
            package = name if path.name == "__init__.py" else name.rpartition(".")[0]
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        if module.split(".")[0] != "pyro2pfp":  # ``from tvm.s_tir import meta_schedule``: the submodule counts
            return [f"{module}.{a.name}" for a in node.names]
        return [f"{module}.{a.name}" if f"{module}.{a.name}" in self.modules else module for a in node.names]

    def _module(self, name: str) -> str | None:
        """The module of the package that ``name`` is or lies in (None: not the package's)."""
        while name and name not in self.modules:
            name = name.rpartition(".")[0]
        return name or None

    def loads(self, module: str, seen: frozenset[str] = frozenset()) -> set[str]:
        """The keys of :data:`LAZY_REASONS` importing ``module`` loads (its packages' ``__init__`` and every
        import at the top of the modules it imports, transitively)."""
        if module in self._loads:
            return self._loads[module]
        if module in seen:
            return set()
        seen = seen | {module}
        parts = module.split(".")
        out: set[str] = set()
        for target in [".".join(parts[:i]) for i in range(1, len(parts))] + self.top[module]:
            inner = self._module(target) if target.split(".")[0] == "pyro2pfp" else None
            if inner is not None:
                out |= self.loads(inner, seen)
            elif (key := _heavy(target)) is not None:
                out.add(key)
        self._loads[module] = out
        return out

    def unexplained(self) -> list[str]:
        """The function-level imports that defer none of :data:`LAZY_REASONS`' modules (beyond those the
        importing module loads anyway) and carry no ``# lazy:`` reason."""
        out = []
        for name in sorted(self.modules):
            loaded = self.loads(name)
            for line, targets, text in self.lazy[name]:
                deferred = set()
                for target in targets:
                    inner = self._module(target) if target.split(".")[0] == "pyro2pfp" else None
                    if inner is not None:
                        deferred |= self.loads(inner) - loaded
                    elif (key := _heavy(target)) is not None:
                        deferred.add(key)
                if not deferred and "# lazy:" not in text:
                    out.append(f"{self.modules[name].relative_to(ROOT.parent)}:{line}: {text.strip()}")
        return out


def test_imports_inside_functions_defer_a_heavy_module():
    """An import inside a function defers a module the package must not load at import (:data:`LAZY_REASONS`:
    TVM, torch, ONNX, Ray, ... -- directly or through the package module it imports); any other import is at
    the module's top, or its line says why not (``# lazy: <reason>``)."""
    unexplained = _Imports().unexplained()
    assert not unexplained, "imports inside functions that defer no heavy module:\n" + "\n".join(unexplained)


def test_the_lazy_import_check_follows_the_package():
    imports = _Imports()
    assert "tvm" in imports.loads("pyro2pfp.backends.tvm.emit")
    assert "tvm" not in imports.loads("pyro2pfp.runtime.deploy") and "torch" not in imports.loads("pyro2pfp")
    assert _heavy("tvm.s_tir.meta_schedule.runner") == "tvm" and _heavy("numpy") is None and _heavy("tvmx") is None


def _annotation_imports() -> list[tuple[str, str]]:
    """``(module, package module it imports under if TYPE_CHECKING:)`` over the package."""
    modules = _sources()
    imports = _Imports()
    out = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                for child in node.body:
                    if isinstance(child, ast.Import | ast.ImportFrom):
                        out.extend((name, inner) for t in imports._targets(name, path, child)
                                   if t.split(".")[0] == "pyro2pfp" and (inner := imports._module(t)) is not None)
    return out


def test_annotation_imports_point_down_the_wings_too():
    """An import for annotations only (``if TYPE_CHECKING:``, which the import-graph test leaves out) still names
    a module of the importer's own wing or one below it: a back end or analysis that reads an object built above
    it names a Protocol (``planning.protocols``) instead of the class."""
    from tests.docs_and_package.test_package import WINGS, _wing

    found = _annotation_imports()
    assert ("pyro2pfp.backends.reference.arrays", "pyro2pfp.planning.plan") in found  # the collector sees them
    up = [f"{a} ({WINGS[_wing(a)][0]}) -> {b} ({WINGS[_wing(b)][0]})" for a, b in sorted(found) if _wing(b) > _wing(a)]
    assert not up, "annotation imports pointing up: " + "; ".join(up)
