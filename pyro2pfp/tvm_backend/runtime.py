"""Compile a PFP network with TVM and run it from NumPy or torch."""
from __future__ import annotations

from typing import Any

import numpy as np
import tvm
from tvm import relax

from ..errors import InputShapeError
from ..network import as_input_array
from .schedules import schedule_module


def make_target(target: Any) -> tvm.target.Target:
    """A ``tvm.target.Target`` from a name (``"llvm"``, ``"native"``), a tag, a dict or a Target."""
    if isinstance(target, tvm.target.Target):
        return target
    if target == "native":
        cpu = tvm.target.codegen.llvm_get_system_cpu()
        return tvm.target.Target({"kind": "llvm", "mcpu": cpu})
    return tvm.target.Target(target)


class CompiledPFP:
    """A compiled PFP network: ``exe(x[, x_var]) -> (mean, var)`` float32 NumPy arrays."""

    def __init__(self, executable: Any, input_shape: tuple[int, ...], input_variance: bool,
                 target: tvm.target.Target) -> None:
        self.executable = executable
        self.input_shape = tuple(input_shape)
        self.input_variance = input_variance
        self.target = target
        self.device = tvm.cpu()
        self.vm = relax.VirtualMachine(executable, self.device)
        self._main = self.vm["main"]

    def _args(self, x: Any, x_var: Any) -> list:
        args = [as_input_array(x, self.input_shape)]
        if self.input_variance:
            if x_var is None:
                raise InputShapeError("this network was converted with input_variance=True: pass x_var too")
            var = as_input_array(x_var, self.input_shape, "x_var")
            if np.any(var < 0):
                raise InputShapeError("x_var must be non-negative")
            args.append(var)
        return [tvm.runtime.tensor(a, self.device) for a in args]

    def __call__(self, x: Any, x_var: Any = None) -> tuple[np.ndarray, np.ndarray]:
        mean, var = self._main(*self._args(x, x_var))
        return mean.numpy(), var.numpy()

    # -- deployment (implemented in pyro2pfp.deploy) ------------------------------------------

    @classmethod
    def for_cross_target(cls, executable: Any, input_shape: tuple[int, ...], input_variance: bool,
                         target: tvm.target.Target) -> "CompiledPFP":
        """A predictor compiled for another CPU architecture: it cannot run here, only export."""
        from ..deploy import target_arch, host_arch
        from ..errors import PFPError

        self = cls.__new__(cls)
        self.executable = executable
        self.input_shape = tuple(input_shape)
        self.input_variance = input_variance
        self.target = target
        self.device = None
        self.vm = None
        arch = target_arch(target)

        def not_here(*_: Any) -> None:
            raise PFPError(
                f"this network was compiled for {arch} and cannot run on this {host_arch()} machine: "
                f"exe.export_library('net.so') and run it on the device with pyro2pfp.load('net.so')")

        self._main = not_here
        return self

    @property
    def runnable(self) -> bool:
        """False for a cross-compiled predictor (another CPU architecture): export it instead."""
        return self.vm is not None

    def export_library(self, path: Any, *, cc: str | None = None, metadata: dict | None = None) -> str:
        """Write the compiled network to ``path`` (``.so`` or ``.tar``) with TVM's ``export_library``
        plus ``path + ".json"`` (input shape, input-variance flag, target); ``pyro2pfp.load(path)``
        gives back a predictor with the same outputs.  Cross targets: ``.so`` uses the cross compiler
        (``cc``, default ``aarch64-linux-gnu-gcc`` for AArch64), ``.tar`` needs no toolchain."""
        from ..deploy import export_library

        return export_library(self, path, cc=cc, metadata=metadata)


def compile_network(net: Any, target: Any = "llvm", *, schedule: bool = True) -> CompiledPFP:
    """Schedule (default CPU schedules) and build ``net.mod`` for ``target``."""
    tgt = make_target(target)
    mod = net.mod
    if schedule:
        mod = schedule_module(mod, net.plan, tgt)
    executable = tvm.compile(mod, target=tgt)
    return CompiledPFP(executable, net.input_shape, net.input_variance, tgt)
