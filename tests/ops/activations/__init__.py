"""Activation family (pyro2pfp/ops/activation.py, moments/): moment rules, kernels, converters, ``scale``."""
