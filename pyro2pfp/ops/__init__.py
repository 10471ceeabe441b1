"""The PFP ops, one file per op family (NumPy-only: no TVM is imported here).

Each family file defines its ops completely for the NumPy side -- the :class:`~pyro2pfp.planning.registry.OpDef`
(torch ops, modules, representation contract, moment rule, assumptions), the converter(s) from torch
ops, the float64 reference and the ONNX export (one shared formula for both where the back ends
allow, :mod:`pyro2pfp.ops._formula`).  Their TVM kernels and CPU schedules are the matching files of
``pyro2pfp/backends/tvm/ops/``.  Importing this package registers everything (``import pyro2pfp`` does
it first).  See :mod:`pyro2pfp.planning.registry` and docs/architecture.md ("how to add an op").
"""
from ..planning.registry import OPS, OpDef, OpRegistryError, get_op, register_op, render_layer_table, supported_modules
from . import (  # noqa: F401  (registers the ops)
    activation,
    arithmetic,
    compute,
    compute_compact,
    concat,
    head,
    normalization,
    pooling,
    shape,
    window_covariance,
)

__all__ = ["OPS", "OpDef", "OpRegistryError", "get_op", "register_op", "render_layer_table",
           "supported_modules"]
