"""Kernel times in results/ against those committed at an earlier revision: did a change move device time?

    python scripts/compare_results.py 0306017            (prints the comparison)
    python scripts/compare_results.py 0306017 --write    (and writes results/kernel_times_vs_0306017.md)

Rows of the tables bench_layernorm and bench_layernorm_linear are matched by their key columns (kind, contender,
dtype, shape) and compared by ``kernel_us`` (CUPTI device time). torch's and the
copy's rows are the control: their ratios show how far the two runs' machines agree. Each ratio's commits come
from the reports' stamps, per dtype.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ops.bench.results import family_of, read_table, stamp_commit  # noqa: E402

BENCHES = ("bench_layernorm", "bench_layernorm_linear")
KEY_COLUMNS = ("kind", "impl", "dtype", "M", "H", "K", "N")


def keyed(rows: list[dict]) -> dict[tuple[str, ...], float]:
    """A table's kernel time per row key (rows without one are left out)."""
    if not rows:
        return {}
    key_cols = [c for c in rows[0] if c in KEY_COLUMNS]
    return {tuple(r[c] for c in key_cols): float(r["kernel_us"]) for r in rows if r.get("kernel_us")}


def table_at(rev: str, name: str) -> tuple[str, list[dict]]:
    """Table ``name`` as committed at ``rev``: from its family's long CSV, or, at a revision before those, from the
    wide results/<name>.csv (its stamp on the first line)."""
    family = subprocess.run(["git", "show", f"{rev}:results/{family_of(name)}.csv"], cwd=ROOT, capture_output=True,
                            text=True)
    if family.returncode == 0 and (found := read_table(name, family.stdout))[1]:
        return found
    lines = subprocess.run(["git", "show", f"{rev}:results/{name}.csv"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    return lines[0].lstrip("# "), list(csv.DictReader(lines[1:]))


def ratios(name: str, rev: str) -> tuple[str, str, list[tuple[float, tuple[str, ...], float, float]]]:
    """Table ``name`` against ``rev``'s: the old and new stamps, and per row in both, (new / old kernel time, row
    key, old us, new us)."""
    old_stamp, old_rows = table_at(rev, name)
    new_stamp, new_rows = read_table(name)
    old, new = keyed(old_rows), keyed(new_rows)
    return old_stamp, new_stamp, [(us / old[key], key, old[key], us) for key, us in new.items()
                                  if key in old and old[key] > 0]


def compare(name: str, rev: str, band: float) -> list[str]:
    """Markdown lines: per dtype and contender, the new/old kernel-time ratios; then the rows outside the band."""
    old_stamp, new_stamp, matched = ratios(name, rev)
    by_contender: dict[tuple[str, str], list[tuple[float, tuple[str, ...], float, float]]] = {}
    for m in matched:
        by_contender.setdefault((m[1][2], m[1][1]), []).append(m)
    out = [f"## {name}", "", "| dtype | contender | rows | commits (old -> new) | median | min | max |",
           "|---|---|---|---|---|---|---|"]
    outside = []
    for (dtype, impl), rs in sorted(by_contender.items()):
        values = [m[0] for m in rs]
        commits = f"{stamp_commit(old_stamp, dtype)} -> {stamp_commit(new_stamp, dtype)}"
        out.append(f"| {dtype} | {impl} | {len(rs)} | {commits} | {statistics.median(values):.3f} | "
                   f"{min(values):.3f} | {max(values):.3f} |")
        outside += [m for m in rs if abs(m[0] - 1.0) > band]
    out += ["", f"Rows more than {band:.0%} off ({len(outside)}):", ""]
    if outside:
        out += ["| row | old us | new us | new / old |", "|---|---|---|---|"]
        out += [f"| {' '.join(key)} | {old} | {new} | {r:.3f} |" for r, key, old, new in sorted(outside)]
    return out + [""]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rev", help="the git revision whose committed reports are the baseline")
    p.add_argument("--band", type=float, default=0.05, help="list rows whose ratio is off by more (default 0.05)")
    p.add_argument("--write", action="store_true", help="write results/kernel_times_vs_<rev>.md")
    a = p.parse_args(argv)
    lines = [f"# Kernel times in results/ against {a.rev}'s", "",
             f"`python scripts/compare_results.py {a.rev}`: new / old CUPTI kernel time per row.", ""]
    for name in BENCHES:
        lines += compare(name, a.rev, a.band)
    text = "\n".join(lines)
    print(text)
    if a.write:
        (ROOT / "results" / f"kernel_times_vs_{a.rev}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
