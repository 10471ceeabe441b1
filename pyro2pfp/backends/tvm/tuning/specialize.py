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
from tvm.relax.expr_functor import PyExprMutator, mutator

from ....errors import TuningError
from .. import ops, schedules
from ..schedules import driver, elementwise, primitives, table, work
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
    out = bind_scalar_arguments(out)
    out = relax.transform.SpecializePrimFuncBasedOnCallSite()(out)
    out = relax.transform.DeadCodeElimination(["main"])(out)
    return out


@mutator
class _BindScalars(PyExprMutator):
    """Rewrites each ``call_tir`` that passes constant scalars (``R.prim_value``) to call a copy of
    its PrimFunc with those scalars bound (one copy per distinct callee and values)."""

    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.mod_in = mod
        self.copies: dict[tuple[str, tuple[int, ...]], relax.GlobalVar] = {}

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # noqa: N802 (TVM's name)
        call = super().visit_call_(call)
        if call.op != tvm.ir.Op.get("relax.call_tir") or not isinstance(call.args[1], relax.Tuple):
            return call
        args = list(call.args[1].fields)
        scalars = [a for a in args if isinstance(a, tirx.IntImm)]  # R.prim_value(int) is an IntImm
        if not scalars:
            return call
        gv = call.args[0]
        func = self.mod_in[gv]
        tensors = [a for a in args if not isinstance(a, tirx.IntImm)]
        params = func.params[len(tensors):len(tensors) + len(scalars)]
        values = tuple(int(a.value) for a in scalars)
        key = (gv.name_hint, values)
        if key not in self.copies:
            bound = func.specialize(dict(zip(params, (tirx.IntImm("int64", v) for v in values),
                                             strict=True)))
            suffix = "_".join(str(v) for v in values)
            self.copies[key] = self.builder_.add_func(bound, f"{gv.name_hint}_k{suffix}")
        return relax.Call(call.op, [self.copies[key], relax.Tuple(tensors)], call.attrs, call.ty_args)


def bind_scalar_arguments(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every PrimFunc called with constant scalar arguments (the factor widths of a
    shared-factor kernel shared across layers) replaced, per call site, by a copy with them bound:
    the static kernels a static-shape build schedules and tunes (TVM's
    ``SpecializePrimFuncBasedOnCallSite`` does not take scalar arguments)."""
    if not any(isinstance(f, relax.Function) for f in mod.functions.values()):
        return mod
    mutator_ = _BindScalars(mod)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            mutator_.builder_.update_func(gv, mutator_.visit_expr(func))
    out = mutator_.builder_.get()
    return relax.transform.DeadCodeElimination(["main"])(out) if mutator_.copies else mod


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
    """Hash of the default schedules' and kernels' source (the modules of ``backends.tvm.schedules`` and
    every op family's TVM file): the per-kernel choices depend on it."""
    sources = []
    families = [getattr(ops, name) for name in sorted(vars(ops))
                if not name.startswith("_") and inspect.ismodule(getattr(ops, name))]
    for module in (schedules, table, primitives, elementwise, work, driver, *families):
        try:
            sources.append(inspect.getsource(module))
        except OSError:  # pragma: no cover -- no source (zipped install)
            sources.append(module.__file__ or "")
    return hashlib.sha256("\n".join(sources).encode()).hexdigest()[:16]
