"""One helper for the per-op tables every stage keeps (converters, references, kernels, schedules,
ONNX exporters): registration by decorator, a second registration of the same key is an error."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def add_to(table: dict[str, Any], what: str) -> Callable[..., Callable[[F], F]]:
    """A decorator factory: ``@deco(key, ...)`` puts the function into ``table`` under each key."""

    def register(*keys: str) -> Callable[[F], F]:
        def deco(fn: F) -> F:
            for key in keys:
                if key in table:
                    raise ValueError(f"{what} {key!r} is registered twice ({table[key].__name__} and {fn.__name__})")
                table[key] = fn
            return fn

        return deco

    return register
