"""The dispatch table from torch op names to converters."""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..registry import add_to, supported_modules


@dataclass(frozen=True)
class Alias:
    """The node is the identity on the activation given by ``node`` (an fx node argument)."""

    node: Any


Converter = Callable[..., Any]
CONVERTERS: dict[str, Converter] = {}
#: PFP op -> the torch op names whose converters produce it.
PRODUCES: dict[str, set[str]] = {}


def register(*targets: str, produces: tuple[str, ...] = ()) -> Callable[[Converter], Converter]:
    """Register a converter ``fn(node, ctx) -> Layer | list[Layer] | Alias`` for torch op names
    (``str(node.target)``); ``produces``: the PFP ops its layers have (none for an alias).
    Registering a torch op twice is an error."""

    def deco(fn: Converter) -> Converter:
        _add(*targets)(fn)
        for op in produces:
            PRODUCES.setdefault(op, set()).update(targets)
        return fn

    return deco


_add = add_to(CONVERTERS, "converter of torch op")


def supported_ops() -> list[str]:
    """Torch op names the converters handle."""
    return sorted(CONVERTERS)


_THREE_D = re.compile(r"aten\.(conv3d|conv_transpose3d|max_pool3d\w*|avg_pool3d|adaptive_\w+_pool3d)\b")


def unsupported_message(what: str, detail: str = "") -> str:
    """``"<what> is not supported by PFP<detail>. Supported torch ops: … Supported modules: …"``
    (a 3-D convolution or pooling: said so, before the lists)."""
    if _THREE_D.search(what + detail):
        detail += (": 3-D (volumetric) convolution and pooling are not supported (PFP converts Conv1d/Conv2d and "
                   "the 1-D and 2-D pools); keep the layer outside the converted model or use 2-D layers")
    return (f"{what} is not supported by PFP{detail}. Supported torch ops: "
            + ", ".join(t.removesuffix(".default") for t in supported_ops())
            + ". Supported modules: " + ", ".join(supported_modules()) + ". Replace it by one of the supported "
            "ops (e.g. an activation PFP has a moment rule for), or keep it outside the converted model.")
