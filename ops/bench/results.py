"""The benchmarks' results: one long-format CSV per benchmark family (``results/<family>.csv``), one row per
measured value with the GPU, commit and date of the run that measured it, and its Markdown view
(``results/<family>.md``) generated from it.

A benchmark writes tables (``reports.write_report``: a name, wide rows, their columns, a stamp, a title and a note);
each is stored in its family's CSV under its name, and ``read_table`` gives it back as it was written. Columns:

* ``table``, ``row``: the table and the row's place in it;
* ``case``, ``contender``, ``dtype``, ``shape``: what was measured (``case``: the row's other text columns as
  ``name=value;...``; ``shape``: its size columns, ``M=4096;H=768``);
* ``metric``, ``value``: one measured column of the row (none where a row has no value; metrics named
  ``_title``, ``_note``, ``_stamp`` and ``_fields`` hold the table's own text, in rows of no ``row``);
* ``gpu``, ``commit``, ``date``: the run that measured it (a table keeps the rows of earlier runs for dtypes not
  rerun: each row keeps its own run's).
"""

from __future__ import annotations

import csv
import datetime
import io
import re
from collections.abc import Collection, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
RESULTS = ROOT / "results"
FIELDS = ("table", "row", "case", "contender", "dtype", "shape", "metric", "value", "gpu", "commit", "date")
# a table's family, by the start of its name: the first match
FAMILIES = (("bench_layernorm_linear", "layernorm_linear"), ("bench_layernorm", "layernorm"),
            ("bench_rmsnorm", "rmsnorm"), ("bench_transformer", "transformer"), ("probe_captured_gemms", "transformer"),
            ("bench_models", "transformer"),
            ("bench_dispatch", "host"), ("bench_launch", "host"), ("kernel_ab", "kernel_ab"))
SHAPE_COLUMNS = ("M", "H", "K", "N", "tokens")   # size columns, joined into ``shape``
META = ("_title", "_note", "_stamp", "_fields")


def family_of(table: str) -> str:
    """The family (the CSV's name) a table belongs to.

    Raises:
        ValueError: a table no family takes (add it to FAMILIES).
    """
    for start, family in FAMILIES:
        if table.startswith(start):
            return family
    raise ValueError(f"table: {table!r} belongs to no results family (ops/bench/results.py FAMILIES)")


def _is_number(value: object) -> bool:
    try:
        float(value)
        return True
    except (TypeError, ValueError):
        return False


KEPT = "; rows of other {column}s kept from: "   # before the runs whose rows a report kept, by the column's name
KEPT_ANY = re.compile(KEPT.format(column=r"\w+"))


def stamp_runs(stamp: str) -> list[tuple[frozenset[str] | None, str]]:
    """The runs a report's stamp names, newest first: each run's dtypes (None: all the rest) and its own stamp.

    A report rerun for some dtypes (``appended``) is stamped "<stamp> (D1,D2 rows); rows of other dtypes kept
    from: <the earlier report's stamp>"; the oldest run, unlabelled, wrote whatever no later one did. A label
    "V/W" names the rows holding both values (some models of a mode rerun: "eager/opt"; ``labels_name``).
    """
    runs = []
    for seg in KEPT_ANY.split(stamp):
        label = re.search(r" \(([^()]+) rows\)$", seg)   # values such as "add+rms_norm" too
        runs.append((frozenset(label.group(1).split(",")), seg[: label.start()]) if label else (None, seg))
    return runs


def labels_name(labels: frozenset[str] | None, keys: set[str]) -> bool:
    """Whether a run's labels (None: the oldest run's, all the rest) name a row of the values ``keys``: a label
    names it when the row holds each of the label's "/"-separated values."""
    return labels is None or any(set(label.split("/")) <= keys for label in labels)


def run_stamp(stamp: str, key: str | Collection[str]) -> str | None:
    """The own stamp of the newest run that wrote the rows of ``key`` (a dtype, mode or kind; or several of one row's
    values, any of which its label may name) in a report stamped ``stamp``; None if no run did."""
    keys = {key} if isinstance(key, str) else set(key)
    return next((own for labels, own in stamp_runs(stamp) if labels_name(labels, keys)), None)


def stamp_commit(stamp: str, key: str | Collection[str]) -> str:
    """The commit of the run that wrote the rows of ``key`` (``run_stamp``) in a report stamped ``stamp`` ('?' if
    none says)."""
    return _commit_in(run_stamp(stamp, key) or "")


def _commit_in(text: str) -> str:
    found = re.search(r"commit (\w+)", text)
    return found.group(1) if found else "?"


def _run_of(stamp: str, row: dict) -> tuple[str, str]:
    """The GPU and commit of the run that wrote ``row`` of a table stamped ``stamp``: the newest run whose label
    names one of the row's values (its dtype, mode or kind, whichever column the report was rerun by)."""
    own = run_stamp(stamp, [str(v) for v in row.values()])
    own = stamp if own is None else own
    gpu = re.search(r"GPU: ([^;(]+)", own)
    return (gpu.group(1).strip() if gpu else "?"), _commit_in(own)


def melt(table: str, rows: Sequence[dict], fields: Sequence[str], stamp: str, title: str, note: str,
         dates: dict[str, str] | None = None) -> list[dict]:
    """A wide table as long rows (``FIELDS``). ``dates``: the date of each earlier run's commit (today's
    otherwise)."""
    today = datetime.date.today().isoformat()
    dates = dates or {}
    text_columns = [f for f in fields if f not in ("impl", "dtype") and f not in SHAPE_COLUMNS
                    and any(r.get(f) not in (None, "") and not _is_number(r.get(f)) for r in rows)
                    and not any(c in str(r.get(f, "")) for r in rows for c in ";=")]   # else kept as a metric
    gpu = _run_of(stamp, {})[0]
    newest = re.search(r"commit (\w+)", stamp)   # the table's own text: the newest run's
    commit = newest.group(1) if newest else "?"
    out = [{"table": table, "row": "", "case": "", "contender": "", "dtype": "", "shape": "", "metric": name,
            "value": value, "gpu": gpu, "commit": commit, "date": dates.get(commit, today)}
           for name, value in zip(META, (title, note, stamp, ",".join(fields)), strict=True)]
    named = {"impl", "dtype", *SHAPE_COLUMNS, *text_columns}   # identity columns; the rest are metrics
    for i, r in enumerate(rows):
        gpu, commit = _run_of(stamp, r)
        ident = {"table": table, "row": i, "case": ";".join(f"{f}={r[f]}" for f in text_columns if f in r),
                 "contender": r.get("impl", ""), "dtype": r.get("dtype", ""),
                 "shape": ";".join(f"{f}={r[f]}" for f in SHAPE_COLUMNS if f in fields and r.get(f) not in
                                   (None, "")),
                 "gpu": gpu, "commit": commit, "date": dates.get(commit, today)}
        values = [{**ident, "metric": f, "value": r[f]} for f in fields
                  if f not in named and r.get(f) not in (None, "")]
        out += values or [{**ident, "metric": "", "value": ""}]   # a row of no value keeps its place
    return out


def pivot(long_rows: Sequence[dict], table: str) -> tuple[dict[str, str], list[dict]]:
    """A table's text (``META``, without the underscore) and its wide rows, columns as written, values as text."""
    mine = [r for r in long_rows if r["table"] == table]
    meta = {r["metric"][1:]: r["value"] for r in mine if r["row"] == ""}
    fields = meta.get("fields", "").split(",") if meta.get("fields") else []
    wide: dict[int, dict] = {}
    for r in mine:
        if r["row"] == "":
            continue
        row = wide.setdefault(int(r["row"]), {})
        if not row:
            row.update(pair.split("=", 1) for part in (r["case"], r["shape"]) for pair in part.split(";") if pair)
            if r["contender"] or "impl" in fields:
                row["impl"] = r["contender"]
            if r["dtype"] or "dtype" in fields:
                row["dtype"] = r["dtype"]
        if r["metric"]:
            row[r["metric"]] = r["value"]
    rows = [{f: wide[i].get(f, "") for f in fields} for i in sorted(wide)]
    return meta, rows


def path_of(family: str) -> Path:
    return RESULTS / f"{family}.csv"


def read_long(family: str, text: str | None = None) -> list[dict]:
    """A family's long rows (``text``: the CSV's text, e.g. from an earlier commit; else the file; [] if none)."""
    if text is None:
        path = path_of(family)
        if not path.exists():
            return []
        text = path.read_text()
    return list(csv.DictReader(io.StringIO(text)))


def read_table(table: str, text: str | None = None) -> tuple[str, list[dict]]:
    """A table's stamp and its wide rows as written (values as text); ("", []) if it has none."""
    meta, rows = pivot(read_long(family_of(table), text), table)
    return meta.get("stamp", ""), rows


def write_table(table: str, rows: Sequence[dict], fields: Sequence[str], stamp: str, title: str, note: str) -> Path:
    """Store a table in its family's CSV, in place of its earlier rows, and regenerate the family's Markdown view.
    Returns the CSV's path."""
    family = family_of(table)
    earlier = read_long(family)
    dates = {r["commit"]: r["date"] for r in earlier if r["table"] == table}
    others = [r for r in earlier if r["table"] != table]
    RESULTS.mkdir(exist_ok=True)
    buf = io.StringIO()
    w = csv.DictWriter(buf, FIELDS, lineterminator="\n")
    w.writeheader()
    w.writerows([*others, *melt(table, rows, fields, stamp, title, note, dates)])
    path_of(family).write_text(buf.getvalue())
    render(family)
    return path_of(family)


def render(family: str) -> str:
    """``results/<family>.md`` from the family's CSV: each table (title, stamp, note, its wide rows) in the order
    the CSV holds them. Returns the text."""
    long_rows = read_long(family)
    lines = [f"# Results: {family}", "",
             f"Generated by ops/bench/results.py from [{family}.csv]({family}.csv) (one row per measured value); "
             "each table below names the script that wrote it.", ""]
    for table in dict.fromkeys(r["table"] for r in long_rows):
        meta, rows = pivot(long_rows, table)
        fields = meta.get("fields", "").split(",")
        lines += [f"## {meta.get('title', table)}", "", f"Table `{table}`. {meta.get('stamp', '')}", "",
                  meta.get("note", ""), "", "| " + " | ".join(fields) + " |", "|" + "---|" * len(fields)]
        lines += ["| " + " | ".join(r[f] for f in fields) + " |" for r in rows]
        lines.append("")
    text = "\n".join(lines)
    (RESULTS / f"{family}.md").write_text(text)
    return text
