"""Compile a PFP network with TVM: :func:`build_network`.

The predictor it is run by, :class:`~pyro2pfp.runtime.predictor.CompiledPFP`, lives in
:mod:`pyro2pfp.runtime.predictor` (it needs only the TVM runtime) and is re-exported here, with the thread
controls (:func:`set_num_threads`, :func:`num_threads`, :func:`default_num_threads`).
"""
from __future__ import annotations

from typing import Any

import tvm

from ...planning.protocols import ConvertedNetwork
from ...runtime.predictor import CompiledPFP, default_num_threads, num_threads, set_num_threads
from .build import KernelPool, KernelStream, build, parallel
from .schedules import schedule_module
from .sharing import share_identical_kernels
from .tuning.specialize import specialize_batch

__all__ = ["CompiledPFP", "build_network", "default_num_threads", "num_threads", "set_num_threads"]


def cached_kernels(mod: tvm.IRModule, kernels: Any) -> tuple[tvm.IRModule, dict[str, str]]:
    """``mod`` with every kernel whose compiled code the kernel cache holds replaced by its stand-in
    (:meth:`~pyro2pfp.backends.tvm.build.KernelPool.lookup`), and the cache keys of the others (to store
    their code under once scheduled and compiled)."""
    out, keys = mod, {}
    for gv, func in mod.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc):
            stand_in, key = kernels.lookup(gv.name_hint, func)
            if stand_in is not None:
                out = out.clone() if out is mod else out
                out[gv] = stand_in
            elif key is not None:
                keys[gv.name_hint] = key
    return out, keys


def build_network(net: ConvertedNetwork, target: tvm.target.Target, schedule: bool = True,
                  batch: int | None = None) -> Any:
    """``net.mod`` with the default CPU schedules (unless ``schedule=False``), built for ``target``.
    Identical kernels are shared first (:func:`~pyro2pfp.backends.tvm.sharing.share_identical_kernels`;
    the schedules depend only on the PrimFunc), so each distinct kernel is scheduled once.
    ``batch``: a static-shape executable for that batch size only (``net.mod`` specialised by
    :func:`pyro2pfp.backends.tvm.tuning.specialize_batch`, as for tuning: the batch fixed in Relax and in every
    PrimFunc -- no shape arithmetic per call, storage planned once), else the any-batch one."""
    # LLVM compiles each kernel on the build threads as soon as it is scheduled -- for a module not yet
    # emitted, as soon as it is emitted (KernelStream)
    kernels = KernelPool(target) if schedule and parallel(target) else None
    try:
        stream = KernelStream(net.plan, target, kernels) if kernels is not None and batch is None else None
        if stream is not None:  # a module emitted earlier announces no kernel: stream.scheduled stays empty
            mod = net.module(on_kernel=stream.add)
        else:
            mod = net.mod if batch is None else specialize_batch(net.mod, batch)
        mod = share_identical_kernels(mod, prefer=stream.scheduled if stream is not None else ())
        if not schedule:
            return build(mod, target)
        if stream is not None:
            mod = stream.scheduled_module(mod)
        keys: dict[str, str] = {}
        if kernels is not None and kernels.cache is not None:  # cached kernels are not scheduled again
            mod, keys = cached_kernels(mod, kernels)
        mod = schedule_module(mod, net.plan, target,
                              on_scheduled=(lambda name, func: kernels.add(name, func, key=keys.get(name)))
                              if kernels else None)
        if kernels is not None:
            kernels.flush()  # the last kernels compile while the Relax pipeline runs
    except BaseException:
        if kernels is not None:
            kernels.close()
        raise
    return build(mod, target, kernels=kernels)
