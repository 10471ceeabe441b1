"""The layer graph's data, the op registry's tables and the representation plan."""
