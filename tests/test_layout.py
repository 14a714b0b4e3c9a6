"""The library's imports, read from the source (no GPU): no import cycle in ``ops/``, no private name imported
from another module, and the launch layer (``ops/launch/``) importing nothing above it; and the house's sizes (files
and functions a reader can hold)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OPS = ROOT / "ops"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(f): f for f in sorted(OPS.rglob("*.py"))}


def imports(name: str) -> list[tuple[str, str]]:
    """(imported module, imported name or "") for every import of an ``ops`` module in ``name``, at any depth
    (an import inside a function counts: it makes a cycle all the same)."""
    found = []
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ops":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.append((sub, "") if sub in MODULES else (node.module, alias.name))
        elif isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names if a.name.split(".")[0] == "ops"]
    return found


def edges() -> dict[str, set[str]]:
    return {name: {mod for mod, _ in imports(name) if mod in MODULES and mod != name} for name in MODULES}


# Each op's package, its files from the top layer down: a file imports only the files after it.
OP_LAYERS = ("module", "functional", "traced", "inductor", "autograd", "fwd_bwd", "algo", "checks", "launch", "config")
OP_PACKAGES = ("ops.layernorm", "ops.layernorm_linear", "ops.rmsnorm")


def test_the_reader_sees_every_module() -> None:
    assert {"ops.launch.bridge", "ops.launch.direct", "ops.layernorm", "ops.layernorm_linear"} <= set(MODULES)
    assert ("ops.launch.direct", "") in imports("ops.layernorm_linear.launch")
    for package in OP_PACKAGES:
        files = {n.rpartition(".")[2] for n in MODULES if n.startswith(f"{package}.")}
        assert {"module", "functional", "autograd", "fwd_bwd", "checks", "launch", "config"} <= files, package


def test_no_import_cycle() -> None:
    graph, cycles = edges(), []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt == path[0]:
                cycles.append(" -> ".join([*path, nxt]))
            elif nxt not in path and nxt > path[0]:   # each cycle once, from its smallest module
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, [start])
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_private_name_imported(name: str) -> None:
    private = [f"{mod}.{what}" for mod, what in imports(name) if what.startswith("_") and not what.startswith("__")]
    assert not private, f"{name} imports private names: {private}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("ops.launch")))
def test_the_launch_layer_looks_only_down(name: str) -> None:
    upward = sorted({mod for mod, _ in imports(name) if mod in MODULES and not mod.startswith("ops.launch")})
    assert not upward, f"{name} imports the layers above it: {upward}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.rpartition(".")[0] in OP_PACKAGES))
def test_an_op_file_looks_only_down(name: str) -> None:
    """Within an op's package, a file imports only the layers below it (``OP_LAYERS``), never the package's own
    ``__init__`` (which imports them all) nor another op's files above its public API."""
    package, _, file = name.rpartition(".")
    rank = OP_LAYERS.index(file) if file in OP_LAYERS else len(OP_LAYERS)
    upward = sorted(mod for mod, _ in imports(name) if mod == package or (
        mod.rpartition(".")[0] == package and OP_LAYERS.index(mod.rpartition(".")[2]) <= rank))
    assert not upward, f"{name} imports its own layers above it: {upward}"


# The house's sizes: a file a reader can hold, a function read in one screen.
MAX_PY_LINES, MAX_FUNCTION_LINES, MAX_CPP_LINES = 500, 60, 600
PY_FILES = sorted(f for d in ("ops", "scripts", "tests") for f in (ROOT / d).rglob("*.py"))


def test_files_and_functions_stay_readable() -> None:
    """Python files of ops/, scripts/ and tests/ at most 500 lines and their functions 60 (from ``def`` to the end,
    docstring included); C++ files of ops/ at most 600."""
    long = [f"{f.relative_to(ROOT)}: {n} lines" for f in PY_FILES
            if (n := len(f.read_text().splitlines())) > MAX_PY_LINES]
    long += [f"{f.relative_to(ROOT)}: {n} lines" for f in sorted(OPS.rglob("*.[ch]*")) if f.suffix in (".cpp", ".h")
             and (n := len(f.read_text().splitlines())) > MAX_CPP_LINES]
    for f in PY_FILES:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and \
                    (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                long.append(f"{f.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not long, "\n".join(long)
