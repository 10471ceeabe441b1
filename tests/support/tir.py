"""Looking into IRModules in tests (imports TVM; the other helpers do not)."""
from __future__ import annotations

import tvm


def prim_funcs(mod: tvm.IRModule) -> dict[str, tvm.tirx.PrimFunc]:
    """The module's kernels (TIR PrimFuncs) by name."""
    return {gv.name_hint: mod[gv] for gv in mod.get_global_vars() if isinstance(mod[gv], tvm.tirx.PrimFunc)}
