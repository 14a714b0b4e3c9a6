"""ops/skeleton.py: region parsing, tree comparison, stub generation."""

from __future__ import annotations

from pathlib import Path

import pytest

from ops.p22 import PROBLEMS
from ops.skeleton import SkeletonError, compare_trees, parse, regions_in, stub

SOLUTION = """def f():
    x = 1
    # FILL ME IN [body] (roughly 2 lines)
    # Hint: add one
    y = x + 1
    # END FILL ME IN
    return y
"""


def test_stub_keeps_hint_and_marks_stub() -> None:
    text = stub(SOLUTION)
    outside, regs = parse(text)
    assert [r.label for r in regs] == ["body"] and not regs[0].filled
    assert "    # Hint: add one\n    pass  # stub\n" in text
    assert outside == parse(SOLUTION)[0]
    assert parse(SOLUTION)[1][0].filled


@pytest.mark.parametrize("bad", [
    "# END FILL ME IN\n",
    "# FILL ME IN [a] (roughly 1 lines)\n",
    "# FILL ME IN [a] (roughly 1 lines)\n# FILL ME IN [b] (roughly 1 lines)\n",
    "# FILL ME IN a\n",
])
def test_malformed_markers_raise(bad: str) -> None:
    with pytest.raises(SkeletonError):
        parse(bad)


def test_compare_trees_finds_outside_edits(tmp_path: Path) -> None:
    (tmp_path / "p").mkdir()
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "k.mojo").write_text(SOLUTION)
    (tmp_path / "p" / "k.mojo").write_text(stub(SOLUTION).replace("x = 1", "x = 2"))
    assert any("differs outside" in e for e in compare_trees(tmp_path / "p", tmp_path / "s"))
    (tmp_path / "p" / "k.mojo").write_text(stub(SOLUTION).replace("pass  # stub", "y = x + 5"))
    assert compare_trees(tmp_path / "p", tmp_path / "s") == []  # learner edits inside regions are fine
    (tmp_path / "s" / "extra.py").write_text("")
    assert compare_trees(tmp_path / "p", tmp_path / "s") == ["only in %s: extra.py" % (tmp_path / "s")]


def test_committed_problems_are_stubs() -> None:
    regs = regions_in(PROBLEMS)
    assert {r.label for _, r in regs} == {"layernorm_kernel", "row_stats_cpu", "fused_stats",
                                          "fused_normalize_on_load"}
    assert not any(r.filled for _, r in regs)
