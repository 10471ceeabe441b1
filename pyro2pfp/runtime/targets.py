"""Compilation targets: names, presets and CPU architectures (``tvm`` is imported only when needed).

A target is a ``tvm.target.Target`` made from a preset name (:data:`TARGET_PRESETS`), ``"llvm"``
(generic x86-64), ``"native"`` (this CPU and its full instruction set), a TVM tag, a dict or a JSON
dict string.  A target whose ``mtriple`` names another architecture than this machine's is a cross
target: code for it compiles here but runs only on the device.
"""
from __future__ import annotations

import json
import platform
from typing import Any

from ..errors import PFPError

#: Named targets.  ``"aarch64"`` is any 64-bit ARM with NEON (Advanced SIMD is mandatory in
#: AArch64); the boards are the paper's Raspberry Pi class Cortex-A53 / A72 / A76.
TARGET_PRESETS: dict[str, Any] = {
    "aarch64": {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]},
    "rpi3": {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a53", "mattr": ["+neon"],
             "num-cores": 4},  # Raspberry Pi 3 (BCM2837, 64-bit OS); TVM's arm/rasp3b tag is 32-bit
    "rpi4": "raspberry-pi/4b-aarch64",  # TVM tag: Cortex-A72, 4 cores, +neon, aarch64 host
    "rpi5": {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a76", "mattr": ["+neon"],
             "num-cores": 4},  # Raspberry Pi 5 (BCM2712)
}
PRESET_HELP = {
    "aarch64": "generic 64-bit ARM Linux, NEON",
    "rpi3": "Raspberry Pi 3 (Cortex-A53), 64-bit OS",
    "rpi4": "Raspberry Pi 4 (Cortex-A72), TVM tag raspberry-pi/4b-aarch64",
    "rpi5": "Raspberry Pi 5 (Cortex-A76)",
}
_ARCH_ALIASES = {"arm64": "aarch64", "amd64": "x86_64", "x64": "x86_64", "i686": "x86", "i386": "x86"}
_ARCH_ALIASES = {"arm64": "aarch64", "amd64": "x86_64", "x64": "x86_64", "i686": "x86", "i386": "x86"}


def make_target(target: Any) -> Any:
    """A ``tvm.target.Target`` from a name (``"llvm"``, ``"native"``), a tag, a dict or a Target."""
    import tvm

    if isinstance(target, tvm.target.Target):
        return target
    if target == "native":
        cpu = tvm.target.codegen.llvm_get_system_cpu()
        return tvm.target.Target({"kind": "llvm", "mcpu": cpu})
    return tvm.target.Target(target)


def resolve_target(target: Any = "llvm"):
    """A ``tvm.target.Target`` from a preset name (:data:`TARGET_PRESETS`), ``"llvm"``,
    ``"native"``, a TVM tag, a dict, a JSON dict string or a Target."""
    import tvm

    if isinstance(target, str):
        spec = target.strip()
        if spec in TARGET_PRESETS:
            return tvm.target.Target(TARGET_PRESETS[spec])
        if spec.startswith("{"):
            try:
                target = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise PFPError(f"target {spec!r} is not valid JSON: {exc}") from None
        elif " -" in spec:
            raise PFPError(f"target {spec!r}: TVM 0.27 does not accept 'llvm -mcpu=...' strings; use a "
                           f"preset ({', '.join(TARGET_PRESETS)}), a TVM tag or a JSON dict such as "
                           '\'{"kind": "llvm", "mcpu": "cortex-a72"}\'')
    try:
        return make_target(target)
    except Exception as exc:  # TVM raises ValueError / TVMError with long messages
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PFPError(f"unknown target {target!r} ({first}). Use 'llvm', 'native', a preset "
                       f"({', '.join(TARGET_PRESETS)}), a TVM tag (tvm.target.list_tags()) or a "
                       "target dict.") from None


def _norm_arch(arch: str) -> str:
    arch = arch.lower()
    return _ARCH_ALIASES.get(arch, arch)


def host_arch() -> str:
    """This machine's CPU architecture (``x86_64``, ``aarch64``, …)."""
    return _norm_arch(platform.machine())


def target_arch(target: Any) -> str:
    """The CPU architecture a target generates code for (from its ``mtriple``; host if unset)."""
    triple = _target_triple(target)
    return _norm_arch(triple.split("-")[0]) if triple else host_arch()


def _target_triple(target: Any) -> str:
    t = resolve_target(target)
    triple = str(t.attrs.get("mtriple", "") or "")
    if not triple and t.host is not None:
        triple = str(t.host.attrs.get("mtriple", "") or "")
    return triple


def is_cross_target(target: Any) -> bool:
    """Whether code for ``target`` cannot run on this machine (another CPU architecture)."""
    return target_arch(target) != host_arch()
