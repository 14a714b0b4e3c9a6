"""The benchmarks' reports: their command lines, stamps (GPU, commit, dtypes kept from earlier runs), CSV and
Markdown writers and plots, apart from the timing itself (``timing.py``)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ops.bench import results
from ops.bench.results import KEPT, labels_name, stamp_runs

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


def write_report(table: str | Path, rows: list[dict], fields: Sequence[str], stamp: str, title: str,
                 note: str) -> None:
    """Store a table (its name: ``table``'s last part) in its family's long-format CSV and regenerate the family's
    Markdown view (``results.write_table``)."""
    path = results.write_table(Path(table).name, rows, fields, stamp, title, note)
    print(f"wrote {path} and {path.with_suffix('.md')}")


def kept_rows(table: str, dtypes: set[str], column: str = "dtype") -> list[dict]:
    """Rows of a table's earlier run whose ``column`` (dtype; the transformer's: mode) is not in ``dtypes`` (a
    benchmark run one dtype per device call appends to the others' rows)."""
    return [r for r in results.read_table(table)[1] if r[column] not in dtypes]


def kept_stamp(table: str, dtypes: set[str] | None = None, column: str = "dtype") -> str:
    """What to add to the stamp of a report that keeps ``kept_rows(table, dtypes, column)``: the earlier
    report's stamp, less the runs none of whose rows are kept, so each kept row's commit stays known ('' when
    there is no earlier report)."""
    stamp, rows = results.read_table(table)
    return _stamp_tail(stamp, [r for r in rows if r[column] not in (dtypes or set())], column)


def _stamp_tail(stamp: str, kept: list[dict], column: str) -> str:
    """What a report's stamp appends for the rows ``kept`` of an earlier report stamped ``stamp``: each run that
    wrote one of them (the newest whose labels name the row, ``results.labels_name``), in the stamp's order."""
    runs = stamp_runs(stamp)
    owners = {next((i for i, (labels, _) in enumerate(runs) if labels_name(labels, {str(v) for v in r.values()})),
                   None) for r in kept}
    texts = [own if labels is None else f"{own} ({','.join(sorted(labels))} rows)"
             for i, (labels, own) in enumerate(runs) if i in owners]
    sep = KEPT.format(column=column)
    return sep + sep.join(texts) if texts else ""


def appended(table: str, dtypes: str, rows: list[dict], column: str = "dtype",
             within: tuple[str, str] | None = None) -> tuple[list[dict], str]:
    """A run of the comma-separated ``dtypes`` (values of ``column``) added to ``table``: the earlier run's rows of
    other values, then ``rows``, and what the new report's stamp appends (``kept_stamp``; nothing when no row is
    kept). With ``within`` (another column, comma-separated values of it), the run replaces only the rows holding
    one of those too (some models of a mode), and its label names each pair ("eager/opt"). The table is read once."""
    stamp, earlier = results.read_table(table)
    run = dtypes.split(",")
    inner = None if within is None else (within[0], within[1].split(","))
    kept = [r for r in earlier if r[column] not in run or (inner is not None and r[inner[0]] not in inner[1])]
    label = dtypes if inner is None else ",".join(f"{v}/{w}" for v in run for w in inner[1])
    tail = _stamp_tail(stamp, kept, column)
    return kept + rows, f" ({label} rows){tail}" if tail else ""


def plot_forward(table: str, title: str, value: str, ylabel: str, shape_cols: Sequence[str],
                 shape_fmt: str, impls: Sequence[str] | None = None, log: bool = False) -> dict[str, list[str]]:
    """Draw ``results/<family>.png`` from a benchmark table: one panel per dtype of its forward rows, ``value``
    per shape (the columns ``shape_cols``, labelled by ``shape_fmt``) for each of ``impls`` found (default: every
    impl), titled with the table's stamp. Returns the impls drawn per dtype."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stamp, rows = results.read_table(table)
    rows = [r for r in rows if r["kind"] == "fwd"]
    png = results.RESULTS / f"{results.family_of(table)}.png"
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
