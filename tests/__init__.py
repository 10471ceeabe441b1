"""The test suite (a package, so that the helpers in tests/support import as ``tests.support.*``)."""
