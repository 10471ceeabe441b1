"""Optional MetaSchedule auto-tuning of a PFP network for one static batch size.

The default compile (:func:`pyro2pfp.backends.tvm.schedules.schedule_module`) gives every PFP
kernel a hand-written schedule that serves *any* batch size.  MetaSchedule only tunes static
shapes, so tuning is per batch size::

    result = tune(net.mod, target, batch=10, trials=64, plan=net.plan)
    exe = tvm.compile(result.mod, target=result.target)      # main(x) now takes exactly (10, ...)

What :func:`~pyro2pfp.backends.tvm.tuning.api.tune` does (one module per job):

1. **specialise** (:mod:`.specialize`) ``main``'s symbolic batch to ``batch`` (``BindSymbolicVars`` +
   ``SpecializePrimFuncBasedOnCallSite``); a module made of high-level Relax operators (e.g. from
   TVM's torch frontend) is also legalised and fused (the ``"zero"`` pipeline), so the tasks are
   the fused kernels;
2. **key** a work directory (:mod:`.database`; the key: :func:`.specialize.tuning_key`) by a hash
   of the specialised kernels' structure (not the weights: retraining keeps the tuning), the target
   and the batch: ``<work_dir>/<key>/`` holds MetaSchedule's JSON database
   (``database_workload.json``, ``database_tuning_record.json``), its logs and
   ``pyro2pfp_tuning.json`` (trials done, per-kernel choices).  A second call with the same
   network, target and batch reuses it and tunes nothing (unless more ``trials`` are asked for
   than were done, then it tunes the difference);
3. **time** every kernel with its default schedule (:mod:`.measure`), and **search** with
   MetaSchedule (:mod:`.search`; ``trials`` candidates in total) the kernels that matter: the PFP
   ``dense``/``conv2d`` kernels taking at least ``min_share`` of the time
   (:data:`.search.SEARCH_OPS`), and every kernel that has no default schedule (e.g. the
   deterministic net from the torch frontend);
4. **pick, per kernel, the fastest correct** (:mod:`.choose`) of: the tuned schedule, the default
   schedule applied to the specialised kernel, and the any-batch default kernel that
   ``net.compile()`` uses -- each checked against the unscheduled kernel on the same data and timed
   back to back -- so a kernel is never slower than in the untuned module (up to timing noise) and
   never wrong.

A tuned module takes exactly ``batch`` rows (the VM rejects other shapes with a clear error);
:func:`~pyro2pfp.backends.tvm.tuning.api.tune_network` builds one executable per requested batch, for
``CompiledPFP`` to dispatch on the batch size (other batch sizes run the default-scheduled,
any-batch module).

The traps of MetaSchedule in TVM 0.27 are handled here rather than on one machine:

* **tvm-ffi 0.1.15.x segfaults** in ``tvm.ir.save_json`` (MetaSchedule's mutators and JSON
  database): :func:`.environment.check_environment` raises a clear error instead of crashing; the
  project pins ``apache-tvm-ffi==0.1.14.post1``.
* **A minutes-long import in every builder worker** (``tvm.s_tir.tensor_intrin`` under a slow
  ``inspect.stack``) and a new set of workers per round in MetaSchedule's ``LocalBuilder``: the
  default :class:`.measure.PooledBuilder` starts its worker processes once per run, with
  :func:`pyro2pfp.backends.tvm.tuning._fast_inspect.worker_init` (the ``inspect.stack`` patch, then the
  import: seconds),
  builds candidates in parallel and kills a build that hangs (LLVM can take many minutes on a huge
  unrolled candidate); :class:`.measure.InProcessRunner` times the built libraries in this
  process.  The in-process ``TuneContext`` import is patched too (scoped: ``inspect.stack`` is
  restored).
  ``builder="inprocess"`` (no workers at all, no timeout) and ``builder="local"`` (MetaSchedule's
  own builder and runner, with the same initializer) are the alternatives.
* **Unaligned NumPy input**: a VM receives a NumPy array without a copy; kernels compiled for
  static shapes may use 64-byte-aligned vector loads (AVX-512) and then segfault about half of the
  time.  Everything here passes TVM-allocated tensors; so must users of a tuned VM
  (``CompiledPFP`` copies its inputs).
* **Wrong kernels**: every candidate schedule of the final module is checked against the
  unscheduled kernel on the same data before it can be chosen (this caught a default schedule that
  vectorises the parallel loop when a pooling output is 1x1 at a static batch).
* **xgboost cost model**: ``cost_model="auto"`` uses ``"xgb"`` when ``xgboost`` is importable
  and ``"random"`` otherwise (xgboost is not a dependency).
* **num-cores**: MetaSchedule needs it in the target; :func:`.environment.tuning_target` adds the
  number of physical cores when it is missing (code generation is the same).

Modules, one per job (none imports another in a cycle): :mod:`.environment` (version check, tuning
target, host check, cache root), :mod:`.specialize` (batch specialisation, the tuning key, the
default-schedule fingerprint), :mod:`.database` (the directory lock, the meta file, applying a
MetaSchedule database), :mod:`.measure` (builders, runners, running and timing kernels here or on a
board), :mod:`.search` (which kernels are searched, the MetaSchedule search, progress lines),
:mod:`.choose` (default schedules, the per-kernel choice and its output check), :mod:`.results`
(:class:`TuneResult`, :class:`KernelChoice`) and :mod:`.api` (:func:`tune`, :func:`tune_network`,
:func:`parse_tune_spec`, :func:`with_remote`).  This package re-exports the public names.
"""
from __future__ import annotations

from ....errors import TuningError
from .api import DEFAULT_TRIALS, parse_tune_spec, tune, tune_network, with_remote
from .environment import check_environment, default_cache_dir, tuning_target
from .measure import InProcessBuilder, InProcessRunner, PooledBuilder
from .results import KernelChoice, TuneResult
from .search import SEARCH_OPS
from .specialize import specialize_batch, tuning_key

__all__ = [
    "DEFAULT_TRIALS",
    "SEARCH_OPS",
    "KernelChoice",
    "TuneResult",
    "TuningError",
    "PooledBuilder",
    "InProcessBuilder",
    "InProcessRunner",
    "check_environment",
    "default_cache_dir",
    "specialize_batch",
    "tuning_key",
    "tuning_target",
    "tune",
    "parse_tune_spec",
    "tune_network",
    "with_remote",
]
