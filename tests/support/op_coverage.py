"""Which tests check which PFP op: ``@covers("relu", kind=MONTE_CARLO)`` on a test function.

The completeness test (tests/ops/test_op_completeness.py) imports the test modules and requires, for
every op the planner knows, a Monte Carlo test (the moments against sampling) and a compiled-vs-
reference test (the TVM kernel against the float64 NumPy reference), and among the compiled-vs-
reference tests one that the fast loop (``-m "not slow and not board"``) runs: a kernel that drops a
term must fail the loop that runs before every commit, not only the full suite.
"""
from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

MONTE_CARLO = "Monte Carlo test"
COMPILED = "compiled-vs-reference test"
FAST_COMPILED = "fast compiled-vs-reference test (one not marked slow)"
COVERAGE: dict[str, set[str]] = defaultdict(set)
#: the decorated test functions, per (op, kind): their marks tell whether the fast loop runs them
COVERING: dict[tuple[str, str], list[Callable[..., Any]]] = defaultdict(list)

_SKIPPED_MARKS = ("slow", "board")


def covers(*ops: str, kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Record that the decorated test checks ``ops`` in the way ``kind`` says."""
    assert kind in (MONTE_CARLO, COMPILED), kind

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in ops:
            COVERAGE[op].add(kind)
            COVERING[op, kind].append(fn)
        return fn

    return deco


def _marks(obj: Any) -> list[Any]:
    marks = getattr(obj, "pytestmark", [])
    return list(marks) if isinstance(marks, list | tuple) else [marks]


def _inner(fn: Any) -> Iterator[Any]:
    """``fn`` and the functions it wraps (hypothesis's ``@given``, ``functools.wraps``)."""
    seen = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        yield fn
        hyp = getattr(fn, "hypothesis", None)
        fn = getattr(hyp, "inner_test", None) or getattr(fn, "__wrapped__", None)


def _collected_as(fn: Callable[..., Any]) -> Any:
    """The object pytest collects for the decorated ``fn``: a decorator applied after ``@covers``
    (``@given``, marks) may have wrapped it; found among its module's test functions and classes."""
    module = sys.modules.get(fn.__module__)
    for name, obj in vars(module).items() if module is not None else ():
        if name.startswith("test") and callable(obj) and any(inner is fn for inner in _inner(obj)):
            return obj
    return fn


def runs_in_fast_loop(fn: Callable[..., Any]) -> bool:
    """Whether the fast loop (``-m "not slow and not board"``) runs at least one case of test ``fn``:
    neither it nor its module is marked ``slow``/``board``, and not every one of its parametrized
    cases is."""
    collected = _collected_as(fn)
    module = sys.modules.get(fn.__module__)
    marks = _marks(collected) + _marks(module)
    if any(m.name in _SKIPPED_MARKS for m in marks):
        return False
    for mark in marks:
        if mark.name != "parametrize":
            continue
        values = mark.args[1] if len(mark.args) > 1 else mark.kwargs.get("argvalues", [])
        if values and all(any(m.name in _SKIPPED_MARKS for m in getattr(v, "marks", ())) for v in values):
            return False
    return True


def fast_coverage(op: str, kind: str) -> list[str]:
    """The tests of ``kind`` for ``op`` that the fast loop runs (``module.function`` names)."""
    return [f"{fn.__module__}.{fn.__name__}" for fn in COVERING[op, kind] if runs_in_fast_loop(fn)]
