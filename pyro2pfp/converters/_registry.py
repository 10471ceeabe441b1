"""The dispatch table from torch op names to converters."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Alias:
    """The node is the identity on the activation given by ``node`` (an fx node argument)."""

    node: Any


Converter = Callable[..., Any]
CONVERTERS: dict[str, Converter] = {}


def register(*targets: str) -> Callable[[Converter], Converter]:
    """Register a converter ``fn(node, ctx) -> Layer | Alias`` for torch op names (``str(node.target)``)."""

    def deco(fn: Converter) -> Converter:
        for target in targets:
            CONVERTERS[target] = fn
        return fn

    return deco


def supported_ops() -> list[str]:
    """Torch op names the converters handle."""
    return sorted(CONVERTERS)
