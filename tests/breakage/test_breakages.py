"""The breakage list stays applicable: every entry names a file of the repository that holds its text
exactly once, and tests that exist (the breakages themselves run in ``python -m tests.breakage.run``,
which CI runs after the suite)."""
from __future__ import annotations

import pytest

from tests.breakage.breakages import BREAKAGES
from tests.breakage.run import REPO, apply


def test_names_are_unique():
    names = [b.name for b in BREAKAGES]
    assert len(names) == len(set(names)) and all(" " not in n for n in names)


@pytest.mark.parametrize("breakage", BREAKAGES, ids=lambda b: b.name)
def test_each_breakage_applies_to_the_code_as_it_is(breakage, tmp_path):
    original = (REPO / breakage.path).read_text()
    copy = tmp_path / breakage.path
    copy.parent.mkdir(parents=True)
    copy.write_text(original)
    assert apply(tmp_path, breakage) == original
    broken = copy.read_text()
    assert broken != original and broken.count(breakage.new) >= 1
    compile(broken, breakage.path, "exec")  # still Python: the tests, not the import, must fail
    for test in breakage.first:
        assert (REPO / test.split("::")[0]).exists(), test


def test_a_breakage_whose_code_moved_is_reported(tmp_path):
    b = BREAKAGES[0]
    (tmp_path / b.path).parent.mkdir(parents=True)
    (tmp_path / b.path).write_text("# the code was rewritten\n")
    with pytest.raises(ValueError, match="occurs 0 times"):
        apply(tmp_path, b)
