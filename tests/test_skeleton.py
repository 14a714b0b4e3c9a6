"""ops/puzzle/skeleton.py: region parsing, tree comparison, stub generation."""

from __future__ import annotations

from pathlib import Path

import pytest

from ops.puzzle.p22 import PROBLEMS
from ops.puzzle.skeleton import SkeletonError, compare_trees, parse, regions_in, stub

ROOT = Path(__file__).resolve().parent.parent

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


def test_walkthrough_quotes_follow_the_solution(tmp_path: Path) -> None:
    """A quote in the solution's chapter is the anchored code as it is; an edit to that code makes it stale, and
    requote brings it back."""
    from ops.puzzle.skeleton import anchored, quote_errors, requote

    (tmp_path / "op.mojo").write_text("x = 1\n    # ANCHOR: body\n    y = 2\n    z = 3\n    # ANCHOR_END: body\n")
    assert anchored((tmp_path / "op.mojo").read_text(), "body") == "y = 2\nz = 3"
    chapter = tmp_path / "README.md"
    chapter.write_text("text\n<!-- quote: op.mojo body -->\n```mojo\ny = 2\nz = 3\n```\nmore\n")
    assert quote_errors(chapter, tmp_path) == []
    (tmp_path / "op.mojo").write_text("    # ANCHOR: body\n    y = 5\n    # ANCHOR_END: body\n")
    assert len(errors := quote_errors(chapter, tmp_path)) == 1 and "not the code as it is now" in errors[0]
    requote(chapter, tmp_path)
    assert quote_errors(chapter, tmp_path) == []
    assert chapter.read_text() == "text\n<!-- quote: op.mojo body -->\n```mojo\ny = 5\n```\nmore\n"
    chapter.write_text("<!-- quote: op.mojo missing -->\n```\n```\n")
    assert "no ANCHOR: missing" in quote_errors(chapter, tmp_path)[0]


def test_committed_walkthrough_quotes_are_current() -> None:
    from ops.puzzle.skeleton import CHAPTER, quote_errors

    solution = ROOT / "solutions" / "p22"
    assert quote_errors(solution / CHAPTER, solution) == []
    assert (solution / CHAPTER).read_text() != (ROOT / "problems" / "p22" / CHAPTER).read_text()
