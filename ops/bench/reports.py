"""The benchmarks' reports: their command lines, stamps (GPU, commit, dtypes kept from earlier runs), CSV and
Markdown writers and plots, apart from the timing itself (``timing.py``)."""

from __future__ import annotations

import argparse
import csv
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

# About 5 ms at H100 clocks: longer than the host needs to enqueue any call we
# time (the unfused p22 path is four bridge calls).


def gpu_name() -> str:
    """The CUDA device name, or "cpu"."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def commit() -> str:
    """Short git commit of the checkout (with '+dirty' when files changed), or 'unknown'.

    ``OPS_COMMIT`` overrides it: copies of the tree without .git (the GPU machine) set it.
    """
    import subprocess

    if os.environ.get("OPS_COMMIT"):
        return os.environ["OPS_COMMIT"]
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True)
        return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def bench_args(doc: str, quick_help: str, dtypes: str, *flags: tuple[str, str]) -> argparse.Namespace:
    """The command line every kernel benchmark takes (--quick, --plot-only, --no-compile, --dtypes,
    --append), plus boolean ``flags`` given as (name, help)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--plot-only", action="store_true", help="draw the PNG from the committed CSV")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--dtypes", default=dtypes, help="comma-separated torch dtype names")
    p.add_argument("--append", action="store_true", help="keep the CSV's rows of the dtypes not run now")
    p.add_argument("--shape", help="one shape only (e.g. 4096x768, or MxKxN): time it and print, write nothing")
    for name, help_text in flags:
        p.add_argument(name, action="store_true", help=help_text)
    return p.parse_args()


def run_without_gpu(args: argparse.Namespace, plot: Callable[[], None], name: str) -> int | None:
    """What a benchmark does before it needs the GPU: draw the plot for ``--plot-only`` (exit status 0), or
    say that ``name`` needs a CUDA GPU where there is none (2); None: go on and time."""
    if args.plot_only:
        plot()
        return 0
    if not torch.cuda.is_available():
        print(f"{name} needs a CUDA GPU")
        return 2
    return None


def parse_shape(text: str, dims: int) -> tuple[int, ...]:
    """``--shape``'s value: ``dims`` positive sizes joined by 'x' (``4096x768``).

    Raises:
        SystemExit: anything else, with a message naming --shape.
    """
    parts = text.lower().split("x")
    if len(parts) != dims or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise SystemExit(f"--shape: expected {dims} positive sizes joined by 'x', got {text!r}")
    return tuple(int(p) for p in parts)


def print_rows(rows: list[dict], fields: Sequence[str]) -> None:
    """``rows`` as an aligned text table of ``fields`` (a quick look, nothing written)."""
    table = [list(fields)] + [["" if r.get(k) is None else str(r[k]) for k in fields] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(fields))]
    for row in table:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))


def write_report(stem: Path, rows: list[dict], fields: Sequence[str], stamp: str, title: str, note: str) -> None:
    """``stem``.csv (stamp as a leading # line) and ``stem``.md (title, stamp, note, one table)."""
    stem.parent.mkdir(exist_ok=True)
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        f.write(f"# {stamp}\n")
        w = csv.DictWriter(f, fields)
        w.writeheader()
        w.writerows(rows)
    lines = [f"# {title}", "", stamp, "", note, "", "| " + " | ".join(fields) + " |", "|" + "---|" * len(fields)]
    lines += ["| " + " | ".join("" if r.get(k) is None else str(r[k]) for k in fields) + " |" for r in rows]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")


def kept_rows(csv_path: Path, dtypes: set[str], column: str = "dtype") -> list[dict]:
    """Rows of an earlier report's CSV whose ``column`` (dtype; the transformer's: mode) is not in ``dtypes`` (a
    benchmark run one dtype per device call appends to the others' rows)."""
    if not csv_path.exists():
        return []
    return [r for r in csv.DictReader(csv_path.read_text().splitlines()[1:]) if r[column] not in dtypes]


KEPT = "; rows of other {column}s kept from: "   # before the runs whose rows a report kept, by the column's name
KEPT_ANY = re.compile(KEPT.format(column=r"\w+"))


def stamp_runs(stamp: str) -> list[tuple[frozenset[str] | None, str]]:
    """The runs a report's stamp names, newest first: each run's dtypes (None: all the rest) and its own stamp.

    A report rerun for some dtypes (``appended``) is stamped "<stamp> (D1,D2 rows); rows of other dtypes kept
    from: <the earlier report's stamp>"; the oldest run, unlabelled, wrote whatever no later one did.
    """
    runs = []
    for seg in KEPT_ANY.split(stamp):
        label = re.search(r" \(([\w,]+) rows\)$", seg)
        runs.append((frozenset(label.group(1).split(",")), seg[: label.start()]) if label else (None, seg))
    return runs


def stamp_commit(stamp: str, dtype: str) -> str:
    """The commit of the run that wrote ``dtype``'s rows of a report stamped ``stamp`` ('?' if none says)."""
    for dtypes, own in stamp_runs(stamp):
        if dtypes is None or dtype in dtypes:
            found = re.search(r"commit (\w+)", own)
            return found.group(1) if found else "?"
    return "?"


def kept_stamp(csv_path: Path, dtypes: set[str] | None = None, column: str = "dtype") -> str:
    """What to add to the stamp of a report that keeps ``kept_rows(csv_path, dtypes, column)``: the earlier
    report's stamp, less the runs none of whose rows are kept, so each kept row's commit stays known ('' when
    there is no earlier report)."""
    if not csv_path.exists():
        return ""
    lines = csv_path.read_text().splitlines()
    kept = {r[column] for r in csv.DictReader(lines[1:])} - (dtypes or set())
    runs, owned = [], set()
    for run_dtypes, own in stamp_runs(lines[0].lstrip("# ")):
        wrote = (kept - owned) if run_dtypes is None else (run_dtypes & kept) - owned
        if wrote:
            runs.append(own if run_dtypes is None else f"{own} ({','.join(sorted(run_dtypes))} rows)")
        owned |= wrote
        if run_dtypes is None:
            break
    sep = KEPT.format(column=column)
    return sep + sep.join(runs) if runs else ""


def appended(csv_path: Path, dtypes: str, rows: list[dict], column: str = "dtype") -> tuple[list[dict], str]:
    """A run of the comma-separated ``dtypes`` (values of ``column``) added to the report at ``csv_path``: the
    earlier report's rows of other values, then ``rows``, and what the new report's stamp appends
    (``kept_stamp``; nothing when no row is kept)."""
    kept = kept_rows(csv_path, set(dtypes.split(",")), column)
    tail = kept_stamp(csv_path, set(dtypes.split(",")), column)
    return kept + rows, f" ({dtypes} rows){tail}" if tail else ""


def plot_forward(csv_path: Path, png: Path, title: str, value: str, ylabel: str, shape_cols: Sequence[str],
                 shape_fmt: str, impls: Sequence[str] | None = None, log: bool = False) -> dict[str, list[str]]:
    """Draw ``png`` from a benchmark CSV: one panel per dtype of its forward rows, ``value`` per shape
    (the columns ``shape_cols``, labelled by ``shape_fmt``) for each of ``impls`` found (default: every
    impl), titled with the CSV's stamp line. Returns the impls drawn per dtype."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    text = csv_path.read_text().splitlines()
    stamp = text[0].lstrip("# ")
    rows = [r for r in csv.DictReader(text[1:]) if r["kind"] == "fwd"]
    dtypes = sorted({r["dtype"] for r in rows})
    fig, axes = plt.subplots(len(dtypes), 1, figsize=(15, 4.5 * len(dtypes)), squeeze=False)

    def shape(r: dict) -> tuple[int, ...]:
        return tuple(int(r[c]) for c in shape_cols)

    drawn: dict[str, list[str]] = {}
    for ax, dt in zip(axes[:, 0], dtypes, strict=True):
        sel = [r for r in rows if r["dtype"] == dt]
        shapes = sorted({shape(r) for r in sel})
        for impl in impls or sorted({r["impl"] for r in sel}):
            got = {shape(r): float(r[value]) for r in sel if r["impl"] == impl}
            if got:
                drawn.setdefault(dt, []).append(impl)
                ax.plot(range(len(shapes)), [got.get(s, float("nan")) for s in shapes], "o-", label=impl, ms=3)
        ax.set_xticks(range(len(shapes)), [shape_fmt.format(*s) for s in shapes], rotation=75, fontsize=6)
        if log:
            ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}, {dt} - {stamp}", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    print(f"wrote {png}")
    return drawn


def save_plot(plot: Callable[[], None]) -> None:
    """Draw the PNG where matplotlib is installed; say how to draw it later otherwise."""
    try:
        plot()
    except ImportError:
        print("matplotlib missing: run with --plot-only where it is installed")
