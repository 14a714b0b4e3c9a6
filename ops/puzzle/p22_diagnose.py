"""When a p22 package does not compile: where, what the compiler said, and which kernels it takes down.

``mojo precompile`` reports parse and type errors with file:line:col. Errors that Mojo finds only when it builds
a kernel for a device (a SIMD width that is not a power of two, say) come out of MAX with no location at all; a
small harness that instantiates every kernel function of the package with ``mojo build`` (seconds) finds them
with their location. Each error is mapped to the fill-in region (or the function) it sits in, and to the ops that
cannot be built while it stands: the ops registered in its file and in every file that imports from it.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ops.puzzle.skeleton import parse

# file:line:col: error: message   (mojo's own format; a relative or an absolute path)
_ERROR = re.compile(r"^(?P<path>[^:\n]+\.mojo):(?P<line>\d+):(?P<col>\d+): error: (?P<msg>.+)$", re.M)
_REGISTER = re.compile(r'@extensibility\.register\("(?P<name>\w+)"\)')
_IMPORT = re.compile(r"^from \.(?P<mod>\w+) import", re.M)
_DEF = re.compile(r"^\s*(?:def|struct) (?P<name>\w+)")

# What the harness instantiates, per target: every kernel function the package's ops launch or call, by file.
# The names and signatures lie outside the fill-in regions, so they are the same in problems/ and solutions/.
HARNESS = {
    "cpu": {"layernorm": ["layernorm_cpu"], "matmul": ["matmul_cpu"], "fused": ["fused_cpu"]},
    "gpu": {"layernorm": ["layernorm_kernel"], "transpose": ["transpose_kernel"], "matmul": ["matmul_kernel"],
            "bias_add": ["bias_add_kernel"], "fused": ["fused_naive_kernel", "fused_kernel"]},
}


@dataclass(frozen=True)
class CompileProblem:
    """One compiler error: where it is (``path`` None when the compiler gave no place) and what it says."""

    message: str
    path: Path | None = None
    line: int = 0
    col: int = 0
    source: tuple[str, ...] = ()   # the compiler's quoted source line and its caret line

    def where(self, root: Path) -> str:
        """``file:line:col`` with the file relative to ``root`` where it lies below it."""
        if self.path is None:
            return "(no location given)"
        shown = self.path.relative_to(root) if self.path.is_relative_to(root) else self.path
        return f"{shown}:{self.line}:{self.col}"


def parse_errors(log: str) -> list[CompileProblem]:
    """Every ``file:line:col: error:`` of a compiler log, with the quoted source lines that follow it."""
    lines = log.splitlines()
    found = []
    for i, text in enumerate(lines):
        m = _ERROR.match(text)
        if not m:
            continue
        quoted = []
        for follow in lines[i + 1:i + 3]:
            if _ERROR.match(follow) or ": note:" in follow or ": warning:" in follow or follow.startswith("Included"):
                break
            quoted.append(follow)
        found.append(CompileProblem(m["msg"].strip(), Path(m["path"]).resolve(), int(m["line"]), int(m["col"]),
                                    tuple(quoted)))
    return found


def unlocated(log: str) -> list[CompileProblem]:
    """The ``error:`` lines of a log that names no place (MAX's graph compiler), minus its generic ones."""
    msgs = [ln.split("error:", 1)[1].strip() for ln in log.splitlines() if "error:" in ln]
    msgs = [m for m in msgs if "could not elaborate" not in m] or msgs or [log.strip().splitlines()[-1]]
    return [CompileProblem(m) for m in msgs]


def harness_errors(package: Path, kind: str) -> list[CompileProblem]:
    """Build every kernel function of ``package`` for ``kind`` ("cpu" or "gpu") with ``mojo build``; its errors."""
    from mojo.run import subprocess_run_mojo

    package = Path(package).resolve()
    if not package.name.isidentifier():
        return []
    with tempfile.TemporaryDirectory(prefix="p22_harness_") as tmp:
        main = Path(tmp) / "harness.mojo"
        main.write_text(_harness_source(package.name, kind))
        proc = subprocess_run_mojo(["build", "-I", str(package.parent), str(main), "-o", str(Path(tmp) / "h")],
                                   capture_output=True, text=True)
    if proc.returncode == 0:
        return []
    return [p for p in parse_errors(proc.stdout + proc.stderr) if p.path != main]


def _harness_source(pkg: str, kind: str) -> str:
    target = ', target=H100.target' if kind == "gpu" else ""
    lines = ["from std.compile import compile_info", "from max.gpu.host.info import H100"]
    lines += [f"from {pkg}.{mod} import {', '.join(fns)}" for mod, fns in HARNESS[kind].items()]
    lines += ["", "", "def main():", "    comptime f = DType.float32"]
    lines += [f'    _ = compile_info[{fn}[f], emission_kind="asm"{target}]()'
              for fns in HARNESS[kind].values() for fn in fns]
    return "\n".join(lines) + "\n"


def region_of(problem: CompileProblem) -> str:
    """The fill-in region's label (``[row_stats_cpu]``) holding the error, else the function's name around it."""
    if problem.path is None or not problem.path.is_file():
        return "unknown"
    text = problem.path.read_text()
    for reg in parse(text, str(problem.path))[1]:
        if reg.start < problem.line < reg.end:
            return f"[{reg.label}]"
    lines = text.splitlines()[:problem.line]
    for text in reversed(lines):
        if m := _DEF.match(text):
            return m["name"]
    return problem.path.name


def ops_broken_by(package: Path, problems: list[CompileProblem]) -> set[str]:
    """The ops of ``package`` that cannot build while ``problems`` stand: all of them when an error has no place
    in the package, else the ops registered in each erring file and in the files that import from it."""
    package = Path(package).resolve()
    files = {f.stem: f.read_text() for f in package.glob("*.mojo")}
    registered = {stem: set(_REGISTER.findall(text)) for stem, text in files.items()}
    every = set().union(*registered.values())
    broken_files: set[str] = set()
    for p in problems:
        if p.path is None or p.path.parent != package:
            return every
        broken_files.add(p.path.stem)
    while True:   # a file that imports a broken file is broken too
        more = {stem for stem, text in files.items() if set(_IMPORT.findall(text)) & broken_files} - broken_files
        if not more:
            break
        broken_files |= more
    return set().union(*(registered[s] for s in broken_files)) if broken_files else every
