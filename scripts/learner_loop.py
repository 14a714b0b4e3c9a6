"""The learner's loop, timed as a new learner meets it: fresh copy of the puzzle, empty caches.

    poe learner-loop            # writes results/learner_loop_cpu.md (_gpu.md on a GPU machine)
    poe learner-loop --quick    # CI: the same steps on the caches already there; checks exit codes, writes nothing

Each step runs `scripts/p22.py` of a copy of this checkout in a temporary directory, as a learner would
after `pip install -e .`, with the project's and MAX's caches in fresh folders (full mode). The first edit
pastes the solution's `row_stats_cpu` into its stub; later edits paste the other regions, a syntax error and
its fix. Exits 1 when a step's exit code is not the one the puzzle promises (targets are reported, not enforced).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ops.puzzle.p22 import CHECK_ROUTE  # noqa: E402
from ops.puzzle.skeleton import parse  # noqa: E402

OP = Path("problems/p22/op")
RESULTS = ROOT / "results"
VERDICT = re.compile(r"^(Summary:|not implemented yet:)")
# file:line:col of the syntax error the loop makes, as the runner must print it
SYNTAX_AT = re.compile(r"problems/p22/op/layernorm\.mojo:\d+:\d+: in \[row_stats_cpu\]")
# What each verdict route is, as the report says it
ROUTES = {"direct": "each kernel called without MAX: the CPU ops through a shared library, the GPU kernels from "
                    "their PTX", "max": "the ops' MAX graphs, the route --unfused and --fused time"}


@dataclass
class Step:
    """One command of the loop: what the learner did, the command, and what the puzzle promises."""

    what: str
    argv: list[str]
    exit_cpu: int             # expected exit code without a GPU
    exit_gpu: int             # ... with one (--check then checks the still-stubbed GPU kernels too)
    target_s: float | None    # wall-time target, seconds to the verdict
    edit: str = ""            # the edit made before the command (see edit())
    must_show: re.Pattern[str] | None = None


STEPS = [
    Step("first --check after install", ["--check"], 1, 1, 90.0),
    Step("--check again, nothing edited", ["--check"], 1, 1, 5.0),
    Step("edit one stub (row_stats_cpu), --check", ["--check"], 0, 1, 20.0, edit="row_stats_cpu"),
    Step("edit the other stubs, --check", ["--check"], 0, 0, 20.0, edit="rest"),
    Step("edit one stub (a comment), --unfused", ["--unfused"], 0, 0, 20.0, edit="comment"),
    Step("--unfused again, nothing edited", ["--unfused"], 0, 0, 5.0),
    Step("edit one stub (a comment), --fused", ["--fused"], 0, 0, 20.0, edit="comment"),
    Step("--fused again, nothing edited", ["--fused"], 0, 0, 5.0),
    Step("syntax error in row_stats_cpu, --check", ["--check"], 3, 3, 20.0, edit="syntax", must_show=SYNTAX_AT),
    Step("the error fixed, --check", ["--check"], 0, 0, 20.0, edit="fix"),
]


MEAN_LINE = "    var mean = s / Float32(hidden)"   # a line of the solution's row_stats_cpu that the edits change


def edit(copy: Path, how: str, count: list[int]) -> None:
    """Change the copy's problems/ as a learner would: paste solution regions, a comment, a syntax error, a fix."""
    if how in ("row_stats_cpu", "rest"):
        for f in sorted((copy / OP).glob("*.mojo")):
            labels = {"row_stats_cpu"} if how == "row_stats_cpu" else None
            paste_regions(f, copy / "solutions" / "p22" / "op" / f.name, labels)
        if how == "rest":   # with a comment of the learner's, so that it is not the solution's package to the byte
            how = "comment"
    if how == "comment":
        count[0] += 1
        replace_in(copy / OP / "layernorm.mojo", MEAN_LINE, f"{MEAN_LINE}  # edit {count[0]}")
    elif how == "syntax":
        replace_in(copy / OP / "layernorm.mojo", MEAN_LINE, MEAN_LINE + " +")
    elif how == "fix":
        replace_in(copy / OP / "layernorm.mojo", MEAN_LINE + " +", MEAN_LINE)


def replace_in(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    if old not in text:
        raise SystemExit(f"learner_loop: {path}: expected {old!r} (has the solution's row_stats_cpu changed?)")
    path.write_text(text.replace(old, new, 1))


def paste_regions(problem: Path, solution: Path, labels: set[str] | None) -> None:
    """The solution's body of each region (those in ``labels``, or all) pasted into the problem file."""
    lines = problem.read_text().splitlines()
    _, want = parse(solution.read_text(), str(solution))
    bodies = {r.label: r.body for r in want if labels is None or r.label in labels}
    _, have = parse(problem.read_text(), str(problem))
    for reg in sorted(have, key=lambda r: -r.start):   # from the bottom, so earlier line numbers hold
        if reg.label in bodies:
            lines[reg.start:reg.end - 1] = bodies[reg.label]
    problem.write_text("\n".join(lines) + "\n")


def run_step(copy: Path, step: Step, env: dict[str, str], route: str | None) -> tuple[int, float, float, str]:
    """Run one step (with ``--check-route route`` where given): exit code, seconds to the verdict line (else to the
    end), seconds to the end, output."""
    argv = [*step.argv, *(["--check-route", route] if route else [])]
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "scripts/p22.py", *argv], cwd=copy, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    out, verdict = [], None
    assert proc.stdout is not None
    for line in proc.stdout:
        out.append(line)
        if verdict is None and VERDICT.match(line):
            verdict = time.perf_counter() - start
    code = proc.wait()
    total = time.perf_counter() - start
    return code, verdict if verdict is not None else total, total, "".join(out)


def fresh_copy(dest: Path) -> Path:
    """This checkout's tracked and untracked-not-ignored files, as a clone would hold them (without git: the
    tree less virtual environments, caches and bundles)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                            text=True)
    skip = (".git/", ".venv/", ".gpu/", ".whl/", ".device/")
    if listed.returncode == 0:
        files = listed.stdout.splitlines()
    else:
        files = [str(f.relative_to(ROOT)) for f in ROOT.rglob("*") if f.is_file() and "__pycache__" not in f.parts]
    for name in files:
        src = ROOT / name
        if src.is_file() and not name.startswith(skip):
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} cores, {gpu}"


def commit() -> str:
    if os.environ.get("P22_COMMIT"):   # a copy without git (the GPU machine): the caller names it
        return os.environ["P22_COMMIT"]
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="keep the caches already there; check exit codes only")
    p.add_argument("--out", type=Path, default=None,
                   help="the report (full mode); default results/learner_loop_cpu.md, _gpu.md with a GPU")
    p.add_argument("--log", type=Path, default=None, help="also write every step's output here")
    p.add_argument("--check-route", choices=["max", "direct"], default=None,
                   help="how a verdict runs the kernels (default: p22's CHECK_ROUTE); reported")
    args = p.parse_args(argv)
    import torch

    gpu = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="learner_loop_") as tmp:
        copy = fresh_copy(Path(tmp) / "p22-fusion")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        bytecode = None
        if not args.quick:
            env.update(OPS_CACHE_DIR=str(Path(tmp) / "ops_cache"), MODULAR_CACHE_DIR=str(Path(tmp) / "max_cache"))
            bytecode = bytecode_as_installed(env, Path(tmp))
        rows, bad, log, comments = [], [], [], [0]
        for step in STEPS:
            if step.edit:
                edit(copy, step.edit, comments)
            code, verdict, total, out = run_step(copy, step, env, args.check_route)
            want = step.exit_gpu if gpu else step.exit_cpu
            shown = step.must_show is None or bool(step.must_show.search(out))
            met = "" if step.target_s is None or args.quick else ("met" if verdict <= step.target_s else "NOT MET")
            rows.append((step, code, want, verdict, total, met, shown))
            log.append(f"=== {step.what}: p22 {' '.join(step.argv)} -> exit {code} in {total:.1f} s\n{out}")
            if code != want or not shown:
                bad.append(f"{step.what}: exit {code} (want {want}){'' if shown else ', no file:line shown'}")
            print(f"{step.what:45s} exit {code} (want {want})  verdict {verdict:5.1f} s  total {total:5.1f} s  {met}",
                  flush=True)
    if args.log:
        args.log.write_text("\n".join(log))
    if not args.quick:
        out = args.out or RESULTS / f"learner_loop_{'gpu' if gpu else 'cpu'}.md"
        out.write_text(report(rows, gpu, args.check_route or CHECK_ROUTE, bytecode))
        print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    for b in bad:
        print(f"learner_loop: {b}", file=sys.stderr)
    return 1 if bad else 0


def bytecode_as_installed(env: dict[str, str], tmp: Path) -> str | None:
    """Where the host sets PYTHONDONTWRITEBYTECODE (the lent GPU machine does, and its torch has no bytecode), every
    Python process compiles torch's sources again; ``pip install`` compiles them once on a learner's machine. So the
    steps run with bytecode written to a folder of this run's own (``env`` is changed), compiled before the first step
    as an install would; returns the report's line saying so, with what the host's setting costs, or None."""
    if not os.environ.get("PYTHONDONTWRITEBYTECODE"):
        return None
    env.pop("PYTHONDONTWRITEBYTECODE")
    env["PYTHONPYCACHEPREFIX"] = str(tmp / "pycache")
    probe = [sys.executable, "-c",
             "import torch; torch.zeros(1, device='cuda' if torch.cuda.is_available() else 'cpu')"]

    def median_s(e: dict[str, str]) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            subprocess.run(probe, env=e, check=True)
            times.append(time.perf_counter() - start)
        return sorted(times)[1]

    subprocess.run(probe, env=env, check=True)   # compiles torch's bytecode, as pip install would have
    host, kept = median_s(dict(os.environ)), median_s(env)
    return (f"This host sets PYTHONDONTWRITEBYTECODE, so each Python process compiles torch's sources again: "
            f"`import torch` and a first CUDA allocation take {host:.1f} s so, {kept:.1f} s with bytecode kept "
            "(median of 3). The steps ran with bytecode kept (PYTHONPYCACHEPREFIX in the run's own folder, torch's "
            "compiled before the first step), as `pip install` leaves a learner's machine.")


def report(rows: list[tuple], gpu: bool, route: str, bytecode: str | None = None) -> str:
    lines = ["# The learner's loop (scripts/learner_loop.py)", "",
             f"Machine: {machine()}; commit {commit()}; fresh copy of the checkout, empty caches; "
             f"{time.strftime('%Y-%m-%d')}.",
             "Seconds from the command to its verdict (the `Summary:` line of `--unfused`/`--fused`, the end of "
             "`--check`), and to its end (a run's benchmark, through MAX, included). Every verdict checks the " +
             ("CPU and the GPU" if gpu else "CPU") + f" by the {route} route ({ROUTES[route]}).",
             *([bytecode] if bytecode else []), "",
             "| step | command | exit | want | verdict s | total s | target s | |", "|---|---|---|---|---|---|---|---|"]
    for step, code, want, verdict, total, met, shown in rows:
        target = "" if step.target_s is None else f"<= {step.target_s:g}"
        note = met + ("" if shown else ", file:line missing")
        lines.append(f"| {step.what} | `p22 {' '.join(step.argv)}` | {code} | {want} | {verdict:.1f} | {total:.1f} | "
                     f"{target} | {note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
