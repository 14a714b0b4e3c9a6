"""Where an edited puzzle's first verdict waits: the imports, the package's ``mojo precompile``, building the MAX graphs
and MAX's compile, for the solution's ops on one device, each measurement in a fresh process with fresh caches.

    python scripts/learner_compile_costs.py                  (the GPU when there is one, else the CPU)
    python scripts/learner_compile_costs.py --device cpu --sets all

Op sets: "all" (the six ops ``--check`` builds, one module), "unfused" (the four ``--unfused`` runs), "fused" (the
two fused kernels) and each op alone. Prints one row per set: seconds for each step and the process's wall time
(``--one-process``: the sets compiled one after another in one process, whose wall time each row repeats).
docs/learner_loop.md says what the numbers mean for issue 67's targets.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPS = ("p22_layernorm", "p22_transpose", "p22_matmul", "p22_bias_add", "p22_fused", "p22_fused_naive")
SETS = {"all": OPS, "unfused": OPS[:4], "fused": OPS[4:], **{op: (op,) for op in OPS}}
STEPS = ("imports", "package", "graphs", "compile")

# Measurements in one process: per op set (";" between sets), the step times on one line, tab-separated; the
# imports count in the first set alone.
CHILD = """
import sys, time
t0 = time.perf_counter()
import torch
from ops.launch import bridge, packages, together
from ops.puzzle.p22 import SOLUTIONS, P22Kernels
device = torch.device(sys.argv[2])
for names in sys.argv[1].split(";"):
    t1 = time.perf_counter()
    calls = [c for c in P22Kernels(SOLUTIONS).calls() if c[0].name in names.split(",")]
    library = packages.compile_package(SOLUTIONS)
    t2 = time.perf_counter()
    module = together.module_of([f"{op.name}_{i}" for i, (op, _) in enumerate(calls)], calls, device)
    t3 = time.perf_counter()
    bridge.session(device).compile(module, custom_extensions=[library])
    t4 = time.perf_counter()
    print("\\t".join(f"{t:.2f}" for t in (t1 - t0, t2 - t1, t3 - t2, t4 - t3)), flush=True)
    t0 = t1 = time.perf_counter()
"""


def measure(sets: list[tuple[str, ...]], device: str) -> tuple[list[list[str]], float]:
    """The step times of one fresh process compiling each of ``sets`` in turn for ``device``, with empty caches, and
    its wall time."""
    with tempfile.TemporaryDirectory(prefix="learner_costs_") as tmp:
        env = dict(os.environ, OPS_CACHE_DIR=f"{tmp}/ops", MODULAR_CACHE_DIR=f"{tmp}/max",
                   PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", CHILD, ";".join(",".join(names) for names in sets), device],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"learner_compile_costs: {sets} on {device} failed:\n{proc.stderr[-2000:]}")
    return [line.split("\t") for line in proc.stdout.strip().splitlines()[-len(sets):]], wall


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when torch sees a GPU")
    p.add_argument("--sets", default="all,unfused,fused", help=f"comma-separated, of {','.join(SETS)}")
    p.add_argument("--one-process", action="store_true",
                   help="compile the sets one after another in one process (is the cost per process or per compile?)")
    args = p.parse_args()
    if unknown := set(args.sets.split(",")) - set(SETS):
        p.error(f"--sets: {sorted(unknown)} not of {list(SETS)}")
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"{'ops':16s} " + " ".join(f"{s:>8s}" for s in STEPS) + f" {'wall':>8s}   (seconds, {device})")
    names = args.sets.split(",")
    runs = [measure([SETS[n] for n in names], device)] if args.one_process else [measure([SETS[n]], device)
                                                                                  for n in names]
    rows = [(steps, wall) for lines, wall in runs for steps in lines]
    for name, (steps, wall) in zip(names, rows, strict=True):
        print(f"{name:16s} " + " ".join(f"{s:>8s}" for s in steps) + f" {wall:8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
