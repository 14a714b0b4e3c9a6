"""Fill-in regions shared by problems/ and solutions/.

A region is the lines strictly between a start marker and an end marker:

    # FILL ME IN [label] (roughly N lines)
    # Hint: ...            (comment lines: the hint, kept in the problem)
    ...code...             (the solution; in the problem a line marked '# stub')
    # END FILL ME IN

Outside regions a problem file must equal its solution byte for byte. A
region is *unfilled* when it has no code line other than ones marked '# stub'.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

START = re.compile(r"^\s*# FILL ME IN \[(?P<label>[\w.-]+)\] \(roughly \d+ lines?\)")
END = re.compile(r"^\s*# END FILL ME IN\s*$")
STUB_MARK = "# stub"


@dataclass(frozen=True)
class Region:
    """One fill-in region: its label, 1-based marker line numbers and body lines."""

    label: str
    start: int
    end: int
    body: tuple[str, ...]

    @property
    def filled(self) -> bool:
        code = [ln for ln in self.body if ln.strip() and not ln.strip().startswith("#")]
        return any(not ln.rstrip().endswith(STUB_MARK) for ln in code)


class SkeletonError(ValueError):
    """Markers are unbalanced or malformed."""


def parse(text: str, name: str = "<text>") -> tuple[list[str], list[Region]]:
    """Split ``text`` into the lines outside regions (markers included) and the regions."""
    outside: list[str] = []
    regions: list[Region] = []
    open_label, open_line, body = None, 0, []
    for no, line in enumerate(text.splitlines(), start=1):
        start, end = START.match(line), END.match(line)
        if open_label is None:
            if end:
                raise SkeletonError(f"{name}:{no}: END FILL ME IN without a start marker")
            if start:
                open_label, open_line, body = start["label"], no, []
            elif line.strip().startswith(("# FILL ME IN", "# END FILL")):
                raise SkeletonError(f"{name}:{no}: malformed marker: {line.strip()}")
            outside.append(line)
            continue
        if start:
            raise SkeletonError(f"{name}:{no}: nested FILL ME IN (region {open_label} opened at line {open_line})")
        if end:
            regions.append(Region(open_label, open_line, no, tuple(body)))
            open_label = None
            outside.append(line)
        else:
            body.append(line)
    if open_label is not None:
        raise SkeletonError(f"{name}:{open_line}: region {open_label} has no END FILL ME IN")
    return outside, regions


def regions_in(package: Path) -> list[tuple[Path, Region]]:
    """Every region of every file under ``package``."""
    found = []
    for f in sorted(p for p in package.rglob("*") if p.is_file()):
        _, regs = parse(f.read_text(), str(f))
        found += [(f, r) for r in regs]
    return found


CHAPTER = Path("README.md")   # each tree's own chapter: the problem's statement, the solution's walkthrough


def _files(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def compare_trees(problems: Path, solutions: Path) -> list[str]:
    """Differences between the two trees outside fill-in regions; empty when they agree."""
    errors = []
    probs, sols = _files(problems), _files(solutions)
    errors += [f"only in {problems}: {p}" for p in sorted(probs - sols)]
    errors += [f"only in {solutions}: {p}" for p in sorted(sols - probs)]
    for rel in sorted(probs & sols - {CHAPTER}):
        try:
            p_out, p_regs = parse((problems / rel).read_text(), str(problems / rel))
            s_out, s_regs = parse((solutions / rel).read_text(), str(solutions / rel))
        except SkeletonError as e:
            errors.append(str(e))
            continue
        if [r.label for r in p_regs] != [r.label for r in s_regs]:
            errors.append(f"{rel}: regions differ: {[r.label for r in p_regs]} vs {[r.label for r in s_regs]}")
        elif p_out != s_out:
            line = next(i for i, (a, b) in enumerate(zip(p_out + [""], s_out + [""], strict=False)) if a != b)
            errors.append(f"{rel}: differs outside fill-in regions near: {(p_out + [''])[line].strip()!r}")
    return errors


def stub(text: str, stubs: dict[str, str] | None = None) -> str:
    """The problem version of a solution file: each region keeps its leading
    comment lines (the hint) and gets one stub line (``stubs[label]`` or ``pass``)."""
    stubs = stubs or {}
    lines = text.splitlines()
    _, regs = parse(text)
    for reg in reversed(regs):
        indent = re.match(r"\s*", lines[reg.start - 1]).group(0)
        hint = []
        for ln in reg.body:
            if not ln.strip().startswith("#"):
                break
            hint.append(ln)
        code = f"{indent}{stubs.get(reg.label, 'pass')}  {STUB_MARK}"
        lines[reg.start:reg.end - 1] = [*hint, code]
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


ANCHOR = re.compile(r"^\s*# ANCHOR: (?P<name>[\w.-]+)\s*$")
QUOTE = re.compile(r"^<!-- quote: (?P<file>\S+) (?P<name>[\w.-]+) -->$")


def anchored(text: str, name: str) -> str:
    """The lines between ``# ANCHOR: name`` and ``# ANCHOR_END: name``, dedented as a block.

    Raises:
        SkeletonError: no such anchor, or no end for it.
    """
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if (m := ANCHOR.match(ln)) and m["name"] == name), None)
    if start is None:
        raise SkeletonError(f"no ANCHOR: {name}")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].strip() == f"# ANCHOR_END: {name}"), None)
    if end is None:
        raise SkeletonError(f"ANCHOR: {name} has no ANCHOR_END")
    body = lines[start + 1:end]
    indent = min((len(ln) - len(ln.lstrip()) for ln in body if ln.strip()), default=0)
    return "\n".join(ln[indent:] for ln in body)


def _quotes(lines: list[str]) -> list[tuple[int, re.Match, int | None]]:
    """Each quote marker of a chapter's ``lines``: its index, its match, and the index of the fence that closes
    the block after it (None when no fenced block follows the marker); the block's code is lines[i + 2:end]."""
    found = []
    for i, line in enumerate(lines):
        if m := QUOTE.match(line):
            fenced = i + 1 < len(lines) and lines[i + 1].startswith("```")
            end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), len(lines))
            found.append((i, m, end if fenced else None))
    return found


def quote_errors(chapter: Path, package: Path) -> list[str]:
    """Where ``chapter`` quotes code (a ``<!-- quote: FILE NAME -->`` line, then a fenced block) that is not the
    anchored region NAME of ``package``/FILE as it is now; empty when every quote is current."""
    errors = []
    lines = chapter.read_text().splitlines()
    for i, m, end in _quotes(lines):
        if end is None:
            errors.append(f"{chapter}:{i + 1}: a quote marker without a fenced block after it")
            continue
        try:
            want = anchored((package / m["file"]).read_text(), m["name"])
        except (OSError, SkeletonError) as e:
            errors.append(f"{chapter}:{i + 1}: {e}")
            continue
        if "\n".join(lines[i + 2:end]) != want:
            errors.append(f"{chapter}:{i + 1}: the quote of {m['file']} {m['name']} is not the code as it is now")
    return errors


def requote(chapter: Path, package: Path) -> None:
    """Rewrite every quoted block of ``chapter`` from the anchored regions it names (``quote_errors``)."""
    lines = chapter.read_text().splitlines()
    for i, m, end in reversed(_quotes(lines)):   # from the last, so earlier indices stay valid
        if end is not None:
            lines[i + 2:end] = anchored((package / m["file"]).read_text(), m["name"]).splitlines()
    chapter.write_text("\n".join(lines) + "\n")
