"""Compute family kernels (pyro2pfp/tvm_backend/ops/winograd.py, compute_shared.py): Winograd conv."""
