"""Compatibility shims for third-party BNN libraries.

TyXe 0.0.2 (``VariationalBNN``) calls ``pyro.util.deep_getattr``, which Pyro 1.9 removed; its
guides' ``get_loc``/``get_scale`` and ``fit`` fail without it.  :func:`patch_pyro_for_tyxe` puts
the one-line function back (``functools.reduce(getattr, name.split("."), obj)``); call it before
training a TyXe model.  Nothing else is needed: ``pyro2pfp.convert(bnn)`` (or
``convert(bnn.net, bnn.net_guide)``) reads TyXe's mean-field Normal guide by tracing it.
"""
from __future__ import annotations

import functools
from typing import Any

import pyro.util


def _deep_getattr(obj: Any, name: str) -> Any:
    return functools.reduce(getattr, name.split("."), obj)


def patch_pyro_for_tyxe() -> None:
    """Restore ``pyro.util.deep_getattr`` (removed in Pyro 1.9) for TyXe 0.0.2."""
    if not hasattr(pyro.util, "deep_getattr"):
        pyro.util.deep_getattr = _deep_getattr  # type: ignore[attr-defined]  # restoring a removed name
