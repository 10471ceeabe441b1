"""Tuning: choosing per kernel -- the default schedules (specialised and any-batch), the output
check against the unscheduled kernel and the fastest correct of tuned / default / any-batch /
naive."""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import tvm
import tvm_ffi
from tvm import tirx

from ....planning.plan import PlannedGraph
from .. import schedules
from ..emit import kernel_info, kernel_table
from .measure import _BatchRunner, _kernel_inputs, _seconds
from .specialize import _prim_funcs


def _default_schedules(mod: tvm.IRModule, plan: PlannedGraph | None,
                       target: tvm.target.Target) -> dict[str, tirx.PrimFunc]:
    """The default (hand-written) schedule of every PFP kernel of ``mod`` that has one."""
    layers = {layer.name: layer for layer in getattr(plan, "layers", ())}
    out = {}
    for name, func in _prim_funcs(mod).items():
        op, layer_name = kernel_info(func)
        layer = layers.get(layer_name) if layer_name is not None else None
        if op is None or schedules._schedule_fn(op) is None:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out[name] = schedules.schedule_function(func, op, layer, target)
        except Exception:  # noqa: BLE001 -- the same fail-soft rule as schedule_module
            continue
    return out


def _any_batch_defaults(mod: tvm.IRModule, plan: PlannedGraph | None, target: tvm.target.Target,
                        names: set[str]) -> dict[str, tirx.PrimFunc]:
    """The default-scheduled kernels of the *symbolic-batch* module (what ``net.compile()``
    runs), for the kernels the specialised module has too.  They accept any batch, so they are
    candidates in the specialised module as well: the tuned module is then never slower, kernel
    by kernel, than the untuned one (a schedule applied to the static kernel can differ)."""
    if not set(kernel_table(mod)) & names:
        return {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scheduled = schedules.schedule_module(mod, plan, target)
    return {name: f for name, f in _prim_funcs(scheduled).items()
            if name in names and f.attrs is not None and f.attrs.get("tirx.is_scheduled", False)}


def _same_outputs(got: list[np.ndarray], want: list[np.ndarray], rtol: float = 1e-3) -> bool:
    """Every buffer equal up to ``rtol`` of its largest magnitude (reduction order may differ)."""
    for g, w in zip(got, want):
        scale = float(np.nanmax(np.abs(w))) if w.size else 0.0
        if not np.allclose(g, w, rtol=0, atol=rtol * max(scale, 1e-30), equal_nan=True):
            return False
    return True


def _choose(static: tvm.IRModule, tuned: tvm.IRModule, defaults: dict[str, tirx.PrimFunc],
            target: tvm.target.Target, any_batch: dict[str, tirx.PrimFunc] | None = None,
            run: Callable[..., tuple[list[np.ndarray], float | None]] | None = None, remote: Any = None
            ) -> dict[str, dict[str, Any]]:
    """Per kernel: check each available schedule against the unscheduled kernel on the same data
    (a schedule that computes something else -- a miscompile -- is never chosen), time them back
    to back and keep the fastest.  ``run(func, arrays, time_it)`` runs one candidate (default:
    all candidates built as one module)."""
    per_kernel: dict[str, tuple[tirx.PrimFunc, dict[str, tirx.PrimFunc]]] = {}
    for name, func in _prim_funcs(static).items():
        candidates: dict[str, tirx.PrimFunc] = {}
        tuned_func = tuned[name]
        if tuned_func.attrs is not None and tuned_func.attrs.get("tirx.is_scheduled", False) \
                and not tvm_ffi.structural_equal(tuned_func, func):
            candidates["tuned"] = tuned_func
        if name in defaults:
            candidates["default"] = defaults[name]
        if any_batch and name in any_batch:
            candidates["any-batch"] = any_batch[name]
        per_kernel[name] = (func, candidates)
    if run is None:
        run = _BatchRunner([f for func, cands in per_kernel.values() for f in (func, *cands.values())], target,
                           remote)
    choices = {}
    for name, (func, candidates) in per_kernel.items():
        arrays = _kernel_inputs(func)
        want, naive_s = run(func, arrays, time_it=not candidates)
        times: dict[str, float] = {}
        rejected = []
        for kind, f in candidates.items():
            try:
                got, seconds = run(f, arrays, time_it=True)
            except Exception:  # noqa: BLE001 -- a candidate that does not build/run is not chosen
                rejected.append(kind)
                continue
            if not _same_outputs(got, want):
                rejected.append(kind)
                warnings.warn(f"pyro2pfp.backends.tvm.tuning: the {kind} schedule of {name} computes different values "
                              f"than the unscheduled kernel at this batch size (a TVM miscompile?); not used",
                              RuntimeWarning, stacklevel=3)
                continue
            times[kind] = _seconds((got, seconds)) * 1e6
        if not times:  # nothing valid: the unscheduled kernel
            times["naive"] = (naive_s if naive_s is not None else _seconds(run(func, arrays, time_it=True))) * 1e6
        best = min(times, key=times.__getitem__)
        choices[name] = {"choice": best, "times_us": times, "rejected": rejected}
    return choices
