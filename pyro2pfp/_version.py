"""The package version (its own module, so any module can import it without a cycle)."""
__version__ = "0.1.0"
