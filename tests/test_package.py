"""The library's shape: what importing it pulls in."""
from __future__ import annotations

import subprocess
import sys


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    return set(out.split())


def test_core_library_needs_no_experiment_packages():
    """Converting, the reference, uncertainty and the CLI work without matplotlib and mlxtend (the
    ``experiments`` extra) and without the experiment code (pyro2pfp_experiments)."""
    loaded = _modules_after("import pyro2pfp, pyro2pfp.network, pyro2pfp.uncertainty, pyro2pfp.cli, "
                            "pyro2pfp.onnx_export, pyro2pfp.posterior")
    assert "pyro2pfp.network" in loaded
    for module in ("matplotlib", "mlxtend", "pyro2pfp_experiments"):
        assert module not in loaded, f"importing the core library imported {module}"
