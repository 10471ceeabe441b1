"""Whole networks against sampling: Predictive, check=, diagnose, and the uncertainty metrics."""
