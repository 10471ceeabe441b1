"""The PFP op registry (NumPy-only): one :class:`OpDef` per op, in one module per op family.

See :mod:`pyro2pfp.ops.registry` and docs/architecture.md ("how to add an op").
"""
from . import activation, arithmetic, compute, pooling, shape  # noqa: F401  (registers the ops)
from .registry import OPS, OpDef, OpRegistryError, get_op, register_op, render_layer_table, supported_modules

__all__ = ["OPS", "OpDef", "OpRegistryError", "get_op", "register_op", "render_layer_table",
           "supported_modules"]
