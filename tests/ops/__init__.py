"""Op tests: the registry and its completeness, every op's moments against Monte Carlo, one folder per op family."""
