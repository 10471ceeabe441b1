"""The names ``tvm_backend/ops/correlation.py`` imports from their old module; the code lives in
:mod:`~pyro2pfp.tvm_backend.emit`, :mod:`~pyro2pfp.tvm_backend.fast_math` and
:mod:`~pyro2pfp.tvm_backend.te_let`.  New code imports from those."""
from __future__ import annotations

from .emit import LAYER_ATTR, OP_ATTR, SCHEME_STEPS, EmitContext, RelaxActivation, variance_of
from .fast_math import F32
from .te_let import te_shared

__all__ = ["F32", "LAYER_ATTR", "OP_ATTR", "SCHEME_STEPS", "EmitContext", "RelaxActivation", "te_shared",
           "variance_of"]
