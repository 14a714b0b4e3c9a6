"""Every public entry of the library documents itself the same way, its docstring examples run, and README's
performance section is what scripts/readme_tables.py makes of results/."""

from __future__ import annotations

import doctest
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ops import layernorm, layernorm_linear
from ops.bench import results

SECTIONS = ("Args:", "Shape:", "Returns:", "Raises:", "Example:")
PUBLIC = [(m, name) for m in (layernorm, layernorm_linear) for name in m.__all__ if callable(getattr(m, name))]


@pytest.mark.parametrize(("module", "name"), PUBLIC, ids=[f"{m.__name__}.{n}" for m, n in PUBLIC])
def test_public_docstrings_have_the_sections_in_order(module: object, name: str) -> None:
    doc = inspect.getdoc(getattr(module, name)) or ""
    where = [doc.find(f"\n{s}\n") for s in SECTIONS]
    missing = [s for s, i in zip(SECTIONS, where, strict=True) if i < 0]
    assert not missing, f"{name}: no {missing}"
    assert where == sorted(where), f"{name}: sections out of order (want {SECTIONS})"


@pytest.mark.parametrize(("module", "name"), PUBLIC, ids=[f"{m.__name__}.{n}" for m, n in PUBLIC])
def test_public_docstring_examples_run(module: object, name: str) -> None:
    """The Example runs on the CPU (doctest; examples print nothing, so a run without an error passes)."""
    obj = getattr(module, name)
    finder = doctest.DocTestFinder(recurse=False)
    tests = finder.find(obj, name, globs={**vars(module), "torch": torch})
    assert tests and tests[0].examples, f"{name}: no runnable example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for t in tests:
        runner.run(t)
    assert runner.failures == 0, f"{name}: its example failed (run python -m doctest on it)"


def test_readme_results_section_is_generated() -> None:
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "scripts" / "readme_tables.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_readme_library_example_runs() -> None:
    """README's library example, as a newcomer pastes it: it runs and fills every gradient."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    lines = readme.split("## The library", 1)[1].splitlines()[2:]
    block = lines[:next(i for i, line in enumerate(lines) if line and not line.startswith("    "))]
    code = "\n".join(line[4:] for line in block)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["y"].shape == (8, 512, 3072) and scope["x"].grad is not None
    assert all(p.grad is not None for p in scope["mlp_in"].parameters())


RESULTS = Path(__file__).resolve().parent.parent / "results"


@pytest.mark.parametrize("family", sorted({family for _, family in results.FAMILIES}))
def test_results_markdown_is_generated_from_its_csv(family: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Each family's committed .md is what ops/bench/results.py renders from its committed .csv, and every table
    reads back with its stamp and its columns."""
    (tmp_path / f"{family}.csv").write_text((RESULTS / f"{family}.csv").read_text())
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    assert results.render(family) == (RESULTS / f"{family}.md").read_text()
    tables = dict.fromkeys(r["table"] for r in results.read_long(family))
    assert tables, f"{family}.csv holds no table"
    for table in tables:
        stamp, rows = results.read_table(table)
        assert stamp.startswith("GPU: ") and rows, table


def test_results_readme_lists_every_file() -> None:
    """results/ keeps about 25 files, and its README says which script wrote each (its names in backquotes:
    ``{a,b}`` for either, ``<rev>`` for a revision)."""
    readme = (RESULTS / "README.md").read_text()
    patterns = []
    for name in re.findall(r"`([^`\s]+)`", readme):
        pattern = re.escape(name).replace(re.escape("<rev>"), "[0-9a-f]+")
        pattern = re.sub(r"\\\{([^}]*)\\\}", lambda m: "(" + m.group(1).replace(",", "|") + ")", pattern)
        patterns.append(re.compile(pattern))
    files = sorted(p.name for p in RESULTS.iterdir() if p.is_file() and p.name != "README.md")
    assert len(files) <= 27, files
    for name in files:
        assert any(p.fullmatch(name) for p in patterns), f"results/{name} is not in results/README.md"
