"""Let-bound TE expressions: :func:`te_shared` computes the shared sub-expressions of a moment formula
once per element instead of copying them through the expression tree."""
from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import tvm
import tvm_ffi
from tvm import te, tirx

from .fast_math import TE_OPS, _normal_cdfs, fast_erfcx, fast_exp

_LEAVES = (tirx.Var, tirx.IntImm, tirx.FloatImm, te.tensor.TensorSlice)


def _is_leaf(value: Any) -> bool:
    """Constants, variables and tensor loads: as cheap to repeat as a variable."""
    return isinstance(value, _LEAVES) or (isinstance(value, tvm.ir.expr.Call) and isinstance(value.op, tvm.ir.Op)
                                          and value.op.name == "te.tensor_load")


def te_shared(build: Callable[[SimpleNamespace], Any], reuse: bool = False) -> list[tirx.PrimExpr]:
    """``build(ops)`` -- a sequence of TE expressions computed with ``ops``, e.g. ``lambda ops:
    moments.relu_moments(m, v, ops)`` -- with its shared sub-expressions computed once.

    The :mod:`pyro2pfp.moments` formulas use ``α``, ``σ``, ``Φ(±α)`` and ``φ(α)`` several times
    each, and ``fast_erf``/``fast_exp`` their argument many times; as plain TE expressions these
    are trees (TIR passes do not share the nodes of a DAG), so one ReLU or Clark max would be
    thousands of nodes that every TIR pass processes copy by copy (compile time grows with
    every copy).  Here ``ops`` is :data:`TE_OPS` whose ``sqrt``, ``minimum`` (the clamp of
    ``α``), ``normal_cdfs`` and ``exp`` return fresh variables (``ops.bind(e)`` names any other
    expression ``e`` the same way), and each returned expression is
    wrapped in the ``Let`` bindings it uses.  ``build`` runs once per output, so every output has
    its own variables: TIR requires each variable to be defined once per function, and a
    multi-output compute becomes one block per output.  (The lets are plain values: they
    vectorise, and a loop that is not vectorised evaluates them per element; see
    :func:`~pyro2pfp.backends.tvm.schedules.vectorizable` for the one case where lets miscompile.)

    ``reuse``: a call of ``sqrt``, ``minimum``, ``exp``, ``erfcx`` or ``normal_cdfs`` on an argument
    structurally equal to an earlier call's (in the same run of ``build``) returns that call's
    variables instead of binding the value again -- so ``build`` may evaluate the same formula twice
    (e.g. :func:`moments.gaussian_terms` inside a moment rule and again for another output) and get
    one ``erf``/``exp`` per element.  Off by default.
    """
    outs = []
    index = 0
    while True:
        bindings: list[tuple[tirx.Var, tirx.PrimExpr]] = []

        def bind(value: tirx.PrimExpr) -> tirx.PrimExpr:  # used within this iteration only
            if _is_leaf(value):
                return value
            var = tirx.Var(f"s{len(bindings)}", value.ty)  # noqa: B023
            bindings.append((var, value))  # noqa: B023
            return var

        ops = SimpleNamespace(**vars(TE_OPS))
        ops.bind = bind  # for callers: name an intermediate result used several times
        ops.sqrt = lambda x: bind(te.sqrt(x))
        ops.minimum = lambda a, b: bind(te.min(a, b))
        ops.exp = lambda x: bind(fast_exp(x, bind))
        ops.erfcx = lambda x: bind(fast_erfcx(x, bind))
        ops.normal_cdfs = lambda alpha: _normal_cdfs(alpha, bind)
        if reuse:
            for name in ("sqrt", "minimum", "exp", "erfcx", "normal_cdfs"):
                setattr(ops, name, _reusing(getattr(ops, name)))
        built = list(build(ops))
        outs.append(_with_lets(built[index], bindings))
        index += 1
        if index == len(built):
            return outs


def _reusing(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` that returns its first result again for arguments structurally equal to earlier ones
    (:func:`te_shared` with ``reuse``; free variables must be the same objects)."""
    calls: list[tuple[list[Any], Any]] = []

    def call(*args: Any) -> Any:
        for earlier, result in calls:
            if tvm_ffi.structural_equal(earlier, list(args)):
                return result
        result = fn(*args)
        calls.append((list(args), result))
        return result

    return call


def _with_lets(expr: tirx.PrimExpr, bindings: list[tuple[tirx.Var, tirx.PrimExpr]]) -> tirx.PrimExpr:
    """``expr`` preceded by the bindings it uses (directly or through other bindings)."""
    needed = set(tirx.analysis.undefined_vars(expr))
    used = []
    for var, value in reversed(bindings):
        if var in needed:
            used.append((var, value))
            needed |= set(tirx.analysis.undefined_vars(value))
    for var, value in used:  # innermost (last bound) first
        expr = tirx.Let(var, value, expr)
    return expr
