"""Which tests check which PFP op: ``@covers("relu", kind=MONTE_CARLO)`` on a test function.

The completeness test (tests/ops/test_op_completeness.py) imports the test modules and requires, for
every op the planner knows, a Monte Carlo test (the moments against sampling) and a compiled-vs-
reference test (the TVM kernel against the float64 NumPy reference).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

MONTE_CARLO = "Monte Carlo test"
COMPILED = "compiled-vs-reference test"
COVERAGE: dict[str, set[str]] = defaultdict(set)


def covers(*ops: str, kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Record that the decorated test checks ``ops`` in the way ``kind`` says."""
    assert kind in (MONTE_CARLO, COMPILED), kind

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in ops:
            COVERAGE[op].add(kind)
        return fn

    return deco
