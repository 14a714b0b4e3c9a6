"""Every public entry of the library documents itself the same way, its docstring examples run, and README's
performance section is what scripts/readme_tables.py makes of results/."""

from __future__ import annotations

import doctest
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ops import layernorm, layernorm_linear

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
