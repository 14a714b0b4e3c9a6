"""pyproject.toml and pixi.toml agree; the skeleton check passes; CI calls README's test command."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _pins(deps: list[str]) -> dict[str, str]:
    out = {}
    for dep in deps:
        m = re.match(r"^([A-Za-z0-9_.-]+)\s*(.*)$", dep)
        out[m.group(1).lower()] = m.group(2).replace(" ", "")
    return out


def test_pixi_and_pyproject_agree() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pixi = tomllib.loads((ROOT / "pixi.toml").read_text())
    pins = _pins(pyproject["project"]["dependencies"])
    for name in ("max", "mojo"):
        assert pins[name] == pixi["dependencies"][name], name
    assert pins["torch"] == pixi["dependencies"]["pytorch"]
    assert set(pyproject["tool"]["poe"]["tasks"]) == set(pixi["tasks"])
    assert pins["max"] == "==26.7.0" and pins["mojo"] == "==1.2.0"


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "poe test" in readme and "poe test" in ci


def test_problems_equal_solutions_outside_fill_regions() -> None:
    proc = subprocess.run([sys.executable, "scripts/check_skeleton.py"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "p22: ok" in proc.stdout


def test_every_ops_package_is_installed() -> None:
    """pyproject's setuptools package list names every package under ops/ (a wheel holds only those)."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "ops").rglob("__init__.py")}
    assert listed == found
