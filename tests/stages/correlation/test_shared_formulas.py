"""Every shared-factor rule has one definition for the float64 reference and the ONNX export: the two tables'
entries of an op are the same function, or wrap the same formula (``ops._formula.shared_formula``; max pooling's
export wraps its fold because the fold gives the layer's mean-field outputs too)."""
from __future__ import annotations

from pyro2pfp import ops as ops  # the op registry: every op family registers itself
from pyro2pfp.planning.registry import SHARED_EXPORTERS, SHARED_REFERENCES


def _definition(rule: object) -> object:
    return getattr(rule, "formula", rule)


def test_every_shared_rule_is_one_definition_for_numpy_and_onnx():
    assert set(SHARED_REFERENCES) == set(SHARED_EXPORTERS)
    twice = sorted(op for op in SHARED_REFERENCES
                   if _definition(SHARED_REFERENCES[op]) is not _definition(SHARED_EXPORTERS[op]))
    assert not twice, f"shared-factor rules written twice (NumPy and ONNX): {twice}"


def test_the_check_sees_a_rule_written_twice():
    def numpy_rule() -> None: ...

    def onnx_rule() -> None: ...

    assert _definition(numpy_rule) is not _definition(onnx_rule)
    assert _definition(SHARED_REFERENCES["conv2d"]) is _definition(SHARED_EXPORTERS["conv2d"])
