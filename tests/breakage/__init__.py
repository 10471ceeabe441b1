"""Deliberate breakages of the library (:mod:`.breakages`), each applied alone to a copy of the repository,
on which the fast loop must fail (:mod:`.run`; CI runs it after the tests)."""
