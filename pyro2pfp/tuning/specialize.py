"""Tuning: module preparation -- specialise ``main``'s symbolic batch (and legalise/fuse a module
of high-level Relax operators), the PrimFuncs to tune, the key of a tuning run and the fingerprint
of the default schedules."""
from __future__ import annotations

import hashlib
import inspect
import json

import tvm
import tvm_ffi
from tvm import relax, tirx

from ..errors import TuningError
from .database import FORMAT_VERSION


def batch_var(mod: tvm.IRModule) -> tirx.Var | int:
    """The batch dimension of ``main``'s first parameter (a ``tirx.Var`` if symbolic)."""
    shape = mod["main"].params[0].ty.shape
    dim = shape[0] if shape is not None else None
    if isinstance(dim, tirx.IntImm):
        return int(dim)
    if isinstance(dim, tirx.Var):
        return dim
    raise TuningError(f"main's first parameter has no batch dimension to specialise: {shape}")


def _has_relax_ops(mod: tvm.IRModule) -> bool:
    """Whether ``mod`` still calls high-level Relax operators (LegalizeOps would change it)."""
    return not tvm_ffi.structural_equal(relax.transform.LegalizeOps()(mod), mod)


def specialize_batch(mod: tvm.IRModule, batch: int, *, fuse: bool | None = None) -> tvm.IRModule:
    """``mod`` with ``main``'s batch dimension fixed to ``batch`` in Relax and in every PrimFunc.

    Remaining high-level Relax operators are legalised.  ``fuse`` (default: only for a module
    that has no PrimFunc yet, e.g. from TVM's torch frontend) also runs FuseOps + FuseTIR (the
    ``"zero"`` pipeline) so that the tasks are the fused kernels a build would run.  A PFP module
    is not fused: its kernels are already one joint mean/variance PrimFunc per layer, and fusion
    would rename them (``fused_pfp_relu_...``) away from their default schedules.
    """
    batch = int(batch)
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    var = batch_var(mod)
    if isinstance(var, int):
        if var != batch:
            raise TuningError(f"main takes a static batch of {var}, cannot specialise it to {batch}")
        out = mod
    else:
        out = relax.transform.BindSymbolicVars({var: batch}, "main")(mod)
    if fuse is None:
        fuse = not _prim_funcs(mod)
    if fuse and _has_relax_ops(out):
        out = relax.get_pipeline("zero")(out)
    elif _has_relax_ops(out):
        out = relax.transform.LegalizeOps()(out)
    out = relax.transform.SpecializePrimFuncBasedOnCallSite()(out)
    out = relax.transform.DeadCodeElimination(["main"])(out)
    return out


def _prim_funcs(mod: tvm.IRModule) -> dict[str, tirx.PrimFunc]:
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


def _target_json(target: tvm.target.Target) -> str:
    return json.dumps(dict(target.export()), sort_keys=True, default=str)


def tuning_key(mod: tvm.IRModule, target: tvm.target.Target, batch: int, board: str | None = None) -> str:
    """Hex key of a tuning run: the specialised kernels' structure, the target, the batch, TVM,
    and the board (the RPC tracker key of a remote run; ``None``: this machine).

    The weights (Relax constants) do not enter it: retraining a network keeps its tuning.
    """
    h = hashlib.sha256()
    h.update(f"pyro2pfp-tuning-v{FORMAT_VERSION}|tvm {tvm.__version__}|batch {int(batch)}|".encode())
    if board is not None:
        h.update(f"board {board}|".encode())
    h.update(_target_json(target).encode())
    for name, func in sorted(_prim_funcs(mod).items()):
        h.update(f"|{name}:{tvm_ffi.structural_hash(func)}".encode())
    return h.hexdigest()[:20]


def _schedules_fingerprint() -> str:
    """Hash of the default schedules' and kernels' source (the schedule helpers and every op family's
    TVM file): the per-kernel choices depend on it."""
    from ..tvm_backend import ops, schedules

    sources = []
    for module in (schedules, *(getattr(ops, name) for name in sorted(vars(ops)) if not name.startswith("_")
                                if inspect.ismodule(getattr(ops, name)))):
        try:
            sources.append(inspect.getsource(module))
        except OSError:  # pragma: no cover -- no source (zipped install)
            sources.append(module.__file__ or "")
    return hashlib.sha256("\n".join(sources).encode()).hexdigest()[:16]
