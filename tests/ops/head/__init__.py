"""The uncertainty head (pyro2pfp/ops/head.py)."""
