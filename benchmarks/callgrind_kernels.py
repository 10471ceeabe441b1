"""Instructions (and, optionally, simulated cache misses) per call of compiled kernels, counted by
``valgrind --tool=callgrind`` -- a measure of a schedule that the load of a shared machine does not
change.  Used by ``kernel_rates.py`` and ``conv_throughput.py`` (``--callgrind``).

The kernels run from exported libraries (``executable.export_library``), called by a small C driver
(:data:`DRIVER_C`: no Python, no TVM runtime; parallel loops run serially, workspaces come from a
stack), so a run costs little more than the kernels themselves under valgrind.  A kernel's count per
call is the inclusive count of its entry function ``__tvm_ffi_<symbol>`` over :data:`CALLS` calls,
divided by :data:`CALLS`.  Valgrind 3.19 does not decode AVX-512: build the libraries for an AVX2 CPU
(:data:`AVX2_CPU`); the schedules then choose their AVX2 (8-lane) tiles.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import Any

AVX2_CPU = "haswell"
"""The ``mcpu`` of libraries counted under valgrind (AVX2 + FMA: 8 float32 lanes)."""
CALLS = 2

DRIVER_C = r"""
/* Calls kernels of exported TVM libraries without TVM's runtime: serial parallel loops, workspaces from
   a stack.  argv: calls, then (library, symbol, arguments file) triples; an arguments file holds per
   argument: int32 kind (0 tensor, 1 int), then a tensor's int32 dtype code, int32 bits, int32 ndim,
   int64 shape[ndim] and its data, or an int's int64 value. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
typedef struct { void* sync; int32_t num_task; } Env;
typedef int (*Lambda)(int, Env*, void*);
typedef struct { void* data; int32_t device_type, device_id; int32_t ndim; uint8_t code, bits; uint16_t lanes;
                 int64_t* shape; int64_t* strides; uint64_t offset; } DLT;
typedef struct { int32_t type_index; uint32_t pad; union { int64_t i; void* p; } v; } Any;
typedef int (*Entry)(void*, const Any*, int32_t, Any*);
static int launch(Lambda f, void* cdata, int n) { Env env = {0, 1}; (void)n; return f(0, &env, cdata); }
static char* arena; static uint64_t top; static uint64_t marks[4096]; static int depth;
static void* alloc_ws(int dt, int di, uint64_t nbytes, int c, int b) {
  (void)dt; (void)di; (void)c; (void)b; marks[depth++] = top; void* p = arena + top;
  top += (nbytes + 63) / 64 * 64; return p; }
static int free_ws(int dt, int di, void* p) { (void)dt; (void)di; (void)p; top = marks[--depth]; return 0; }
int main(int argc, char** argv) {
  arena = aligned_alloc(64, (uint64_t)1 << 30);
  int calls = atoi(argv[1]);
  for (int k = 2; k + 2 < argc; k += 3) {
    void* lib = dlopen(argv[k], RTLD_NOW | RTLD_LOCAL);
    if (!lib) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    void** slot;
    if ((slot = dlsym(lib, "__TVMBackendParallelLaunch"))) *slot = (void*)launch;
    if ((slot = dlsym(lib, "__TVMBackendAllocWorkspace"))) *slot = (void*)alloc_ws;
    if ((slot = dlsym(lib, "__TVMBackendFreeWorkspace"))) *slot = (void*)free_ws;
    char name[512]; snprintf(name, sizeof name, "__tvm_ffi_%s", argv[k + 1]);
    Entry f = (Entry)dlsym(lib, name);
    if (!f) { fprintf(stderr, "no %s in %s\n", name, argv[k]); return 1; }
    FILE* in = fopen(argv[k + 2], "rb");
    Any args[64]; DLT ts[64]; int n = 0; int32_t kind;
    while (fread(&kind, 4, 1, in) == 1) {
      if (kind == 1) {
        args[n].type_index = 1; args[n].pad = 0;
        if (fread(&args[n].v.i, 8, 1, in) != 1) return 1;
        n++; continue;
      }
      int32_t head[3]; if (fread(head, 4, 3, in) != 3) return 1;
      DLT* t = &ts[n]; memset(t, 0, sizeof *t);
      t->device_type = 1; t->code = (uint8_t)head[0]; t->bits = (uint8_t)head[1]; t->lanes = 1; t->ndim = head[2];
      t->shape = malloc(8 * (head[2] + 1)); if (fread(t->shape, 8, head[2], in) != (size_t)head[2]) return 1;
      uint64_t size = head[1] / 8; for (int d = 0; d < head[2]; d++) size *= t->shape[d];
      t->data = aligned_alloc(64, (size + 63) / 64 * 64 + 64); if (fread(t->data, 1, size, in) != size) return 1;
      args[n].type_index = 7; args[n].pad = 0; args[n].v.p = t; n++;
    }
    fclose(in);
    Any result; memset(&result, 0, sizeof result);
    for (int c = 0; c < calls; c++)
      if (f(NULL, args, n, &result) != 0) { fprintf(stderr, "%s failed\n", argv[k + 1]); return 1; }
  }
  return 0;
}
"""


def write_arguments(path: str, arrays: list[Any]) -> None:
    """The arguments of one kernel call (NumPy arrays or ints) in :data:`DRIVER_C`'s format."""
    import numpy as np

    codes = {"i": 0, "u": 1, "f": 2}
    with open(path, "wb") as f:
        for a in arrays:
            if isinstance(a, int | np.integer):
                f.write(np.array([1], np.int32).tobytes() + np.array([a], np.int64).tobytes())
                continue
            a = np.ascontiguousarray(a)
            f.write(np.array([0, codes[a.dtype.kind], 8 * a.dtype.itemsize, a.ndim], np.int32).tobytes())
            f.write(np.array(a.shape, np.int64).tobytes() + a.tobytes())


def count(kernels: list[tuple[str, str, list[Any]]], cache_sim: bool = False, work_dir: str | None = None
          ) -> list[dict[str, float]]:
    """Events of one call of each ``(library path, symbol, arguments)`` -- ``Ir`` (instructions) and,
    with ``cache_sim``, the simulated data misses ``D1`` (``D1mr + D1mw``) and ``LL`` (``DLmr + DLmw``).
    The arguments are NumPy arrays or ints (a kernel's inputs and outputs, as the VM passes them).
    Kernels with distinct symbols run in one valgrind process; callgrind names a function by its
    source file and name, which the same symbol in two libraries share, so a repeated symbol gets
    a process of its own."""
    work_dir = work_dir or tempfile.mkdtemp(prefix="callgrind_kernels_")
    os.makedirs(work_dir, exist_ok=True)
    driver = os.path.join(work_dir, "driver")
    with open(driver + ".c", "w") as f:
        f.write(DRIVER_C)
    subprocess.run(["cc", "-O1", "-o", driver, driver + ".c", "-ldl"], check=True)
    groups: list[list[int]] = []
    for k, (_, symbol, _) in enumerate(kernels):
        group = next((g for g in groups if all(kernels[i][1] != symbol for i in g)), None)
        if group is None:
            groups.append(group := [])
        group.append(k)
    result: dict[int, dict[str, float]] = {}
    for g, group in enumerate(groups):
        triples = []
        for k in group:
            lib, symbol, arrays = kernels[k]
            path = os.path.join(work_dir, f"args{k}.bin")
            write_arguments(path, arrays)
            triples += [os.path.abspath(lib), symbol, path]
        found = _run(driver, triples, cache_sim, os.path.join(work_dir, f"callgrind{g}.out"))
        for k in group:
            result[k] = found[kernels[k][1]]
    return [result[k] for k in range(len(kernels))]


def _run(driver: str, triples: list[str], cache_sim: bool, out: str) -> dict[str, dict[str, float]]:
    """``{symbol: events per call}`` of one valgrind run of ``driver`` over ``triples``."""
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *(["--cache-sim=yes"] if cache_sim else []),
           driver, str(CALLS), *triples]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    report = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", out],
                            check=True, capture_output=True, text=True).stdout
    events: list[str] = []
    found: dict[str, dict[str, float]] = {}
    for line in report.splitlines():
        if line.startswith("Events shown:"):
            events = line.split(":", 1)[1].split()
        match = re.search(r"__tvm_ffi_(\S+) \[(.+)\]\s*$", line)
        if match:
            values = [float(v.replace(",", "")) for v in re.findall(r"([\d,]+) \(", line)]
            counts = dict(zip(events, values))
            ev = {"Ir": counts["Ir"] / CALLS}
            if cache_sim:
                ev["D1"] = (counts.get("D1mr", 0) + counts.get("D1mw", 0)) / CALLS
                ev["LL"] = (counts.get("DLmr", 0) + counts.get("DLmw", 0)) / CALLS
            found[match.group(1)] = ev
    return found
