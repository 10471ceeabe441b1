"""Pooling family (pyro2pfp/ops/pooling.py, window_covariance.py): forms, the fast path, in-window covariances."""
