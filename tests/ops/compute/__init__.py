"""Compute family kernels (pyro2pfp/backends/tvm/ops/winograd.py, compute_shared.py): Winograd conv."""
