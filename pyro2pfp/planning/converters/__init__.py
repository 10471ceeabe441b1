"""The dispatch table from torch op names to converters (the converters themselves are in the op
family files, ``pyro2pfp/ops/<family>.py``; the walk over an exported program that calls them is
:mod:`pyro2pfp.frontend.walk`).

A converter ``fn(node, ctx) -> Layer | list[Layer] | Alias`` is registered with :func:`register` for
the torch op names it handles (``str(node.target)``, e.g. ``"aten.linear.default"``).
"""
from ._registry import CONVERTERS, PRODUCES, Alias, register, supported_ops, unsupported_message

__all__ = ["CONVERTERS", "PRODUCES", "Alias", "register", "supported_ops", "unsupported_message"]
