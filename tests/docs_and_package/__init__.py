"""The documentation holds together, the package's import graph, the experiment zoo."""
