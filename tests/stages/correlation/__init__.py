"""Shared-factor PFP (pyro2pfp/correlation): rules against Monte Carlo, compiled and ONNX against the reference."""
