"""Fidelity against Monte Carlo sampling of the guide: the comparison, the check, sampling."""
