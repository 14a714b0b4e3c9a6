"""Check that problems/ equals solutions/ outside fill-in regions, for every file but the chapters (README.md:
the problem's statement, the solution's walkthrough), and that the walkthrough quotes the solution as it is.

    python scripts/check_skeleton.py            # check every puzzle, exit 1 on a difference
    python scripts/check_skeleton.py --write    # (maintainers) regenerate problems/ from solutions/
    python scripts/check_skeleton.py --requote  # (maintainers) rewrite the walkthrough's quoted code
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ops.puzzle.skeleton import CHAPTER, compare_trees, quote_errors, requote, stub  # noqa: E402

# Stub lines for regions where 'pass' would not compile.
STUBS = {"row_stats_cpu": "return (Float32(0.0), Float32(0.0))"}


def puzzles() -> list[str]:
    return sorted(p.name for p in (ROOT / "solutions").iterdir() if p.is_dir())


def write(puzzle: str) -> None:
    src, dst = ROOT / "solutions" / puzzle, ROOT / "problems" / puzzle
    for f in sorted(p for p in src.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                    and p.relative_to(src) != CHAPTER):
        out = dst / f.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(stub(f.read_text(), STUBS))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="regenerate problems/ from solutions/")
    parser.add_argument("--requote", action="store_true", help="rewrite the walkthrough's quotes from the solution")
    args = parser.parse_args()
    failed = False
    for puzzle in puzzles():
        if args.write:
            write(puzzle)
        solution = ROOT / "solutions" / puzzle
        if args.requote:
            requote(solution / CHAPTER, solution)
        errors = compare_trees(ROOT / "problems" / puzzle, solution) + quote_errors(solution / CHAPTER, solution)
        for e in errors:
            print(f"{puzzle}: {e}")
        failed |= bool(errors)
        print(f"{puzzle}: {'DIFFERS' if errors else 'ok'}: problems == solutions outside fill-in regions")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
