"""Same-GPU A/B of the LayerNorm forward kernels against an earlier revision's builds of them.

    python scripts/ab_kernels.py 0306017 --build   (a machine with Mojo: both revisions' PTX, into build/ab_0306017/)
    python scripts/ab_kernels.py 0306017           (the GPU: table kernel_ab_vs_0306017, results/kernel_ab.*)

``scripts/compare_results.py`` sets the kernel times of two benchmark reports side by side. Those runs come from
other days and other H100s, whose clocks and memory differ by several percent on the same machine code. Here,
for each forward row of ours in the bench_layernorm table, the kernel that row launches as ``rev`` built and
launched it and as the working tree does run in one process on one GPU, on inputs rotated past the L2 cache as
the benchmark's (each call the next set), the calls in the order old, new, new, old, ... in one CUPTI session.
So the ratio is the code's, not the machine's. ``--build`` records each side's launch (its own
``layernorm.config`` at that revision) and PTX; the GPU run needs neither Mojo nor MAX.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from ops.bench.results import read_table  # noqa: E402

CALLS = 200   # calls per side and row, alternating
FIELDS = ("kind", "impl", "dtype", "M", "H", "old_kernel", "new_kernel", "same_ptx", "old_us", "new_us", "new_vs_old")

# Run in a revision's tree (cwd and PYTHONPATH): its launch of each row and its PTX (built if missing), as JSON.
LAUNCHES = """
import json, sys, torch
try:   # the layout of the op packages first, then the older ones (the editable install finds ops.launch anywhere)
    from ops.layernorm import config as C
    from ops.launch import ptx
except ImportError:
    from ops import layernorm_config as C
    try:
        from ops import direct as ptx
    except ImportError:
        from ops.launch import direct as ptx
found, specs = [], []
for kind, impl, dtype, m, h in json.load(sys.stdin):
    dt = getattr(torch, dtype)
    launch = C.fwd_launch(m, h, dt, True, impl.partition(":")[2] or "fast")
    spec = launch.spec(dt, 0 if kind == "fwd" else 2)
    specs.append(spec)
    found.append({"kernel": f"{launch.kernel}{list(launch.params)}", "args": spec.args, "grid": launch.grid,
                  "block": launch.block, "cluster": getattr(launch, "cluster", 1),
                  "ptx": str(ptx.ptx_path(spec, "H100"))})
ptx.build(specs, "H100", quiet=True)
print(json.dumps(found))
"""


def bench_rows() -> list[list]:
    """(kind, impl, dtype, M, H) of every forward row of ours in the bench_layernorm table."""
    variants = ("", "fast", "vector", "row_thread", "block_smem", "block_warp")
    return [[r["kind"], r["impl"], r["dtype"], int(r["M"]), int(r["H"])] for r in read_table("bench_layernorm")[1]
            if r["kind"] in ("fwd", "fwd+gelu") and r["impl"].partition(":")[0] == "ours"
            and r["impl"].partition(":")[2] in variants]


def launches(tree: Path, cache: Path, rows: list[list]) -> list[dict]:
    """Per row, the launch and PTX (built into ``cache``) of the revision checked out at ``tree`` (``LAUNCHES``)."""
    env = {**os.environ, "OPS_CACHE_DIR": str(cache), "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", LAUNCHES], cwd=tree, env=env, input=json.dumps(rows), check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.splitlines()[-1])


def build(rev: str) -> None:
    """Both sides' launches and PTX into build/ab_<rev>/ (old/, new/, manifest.json)."""
    from compare_ptx import fingerprint

    out = ROOT / "build" / f"ab_{rev}"
    rows = bench_rows()
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), rev], cwd=ROOT, check=True)
        try:
            old = launches(tree, out / "old", rows)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=True)
    new = launches(ROOT, out / "new", rows)
    manifest = []
    for row, o, n in zip(rows, old, new, strict=True):
        for side in (o, n):
            side["ptx"] = str(Path(side["ptx"]).relative_to(ROOT))
        same = fingerprint((ROOT / o["ptx"]).read_text()) == fingerprint((ROOT / n["ptx"]).read_text())
        manifest.append({"row": row, "old": o, "new": n, "same_ptx": same and o["grid"] == n["grid"]
                         and o["block"] == n["block"] and o["cluster"] == n["cluster"]})
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"{len(manifest)} rows, {sum(not m['same_ptx'] for m in manifest)} with another kernel or launch: {out}")


class Loaded:
    """A kernel from a PTX file, launched by cuda.core on torch's current stream."""

    def __init__(self, side: dict) -> None:
        from cuda.core import Device, ObjectCode

        from ops.launch.ptx import entry_name

        Device(torch.cuda.current_device()).set_current()
        ptx = (ROOT / side["ptx"]).read_text()
        self.kernel = ObjectCode.from_ptx(ptx.encode()).get_kernel(entry_name(ptx))
        self.side = side

    def __call__(self, *args: object) -> None:
        import numpy as np
        from cuda.core import LaunchConfig, Stream, launch

        s = self.side
        conv = {"p": int, "i": np.int32, "f": np.float32}
        cluster = {"cluster": s["cluster"]} if s["cluster"] > 1 else {}   # then the grid counts clusters
        config = LaunchConfig(grid=s["grid"][0], block=s["block"], **cluster)
        launch(Stream.from_handle(torch.cuda.current_stream().cuda_stream), config, self.kernel,
               *[conv[a](v) for a, v in zip(s["args"], args, strict=True)])


def time_pair(old: Loaded, new: Loaded, m: int, h: int, dtype: torch.dtype, activation: str) -> tuple[float, float]:
    """Median CUPTI kernel time of each side over CALLS calls each, alternating, on rotated inputs (each side's
    output checked against the float64 reference first)."""
    from bench_layernorm import checked, input_sets

    from ops.bench import timing

    sets = input_sets(m, h, dtype)
    y = torch.empty(m, h, device="cuda", dtype=dtype)
    mean, rstd = (torch.empty(m, device="cuda") for _ in range(2))

    def call(k: Loaded, i: int) -> None:
        x, w, b = sets[i % len(sets)]
        k(y.data_ptr(), mean.data_ptr(), rstd.data_ptr(), x.data_ptr(), w.data_ptr(), b.data_ptr(), m, h, 1e-5)

    for k, side in ((old, "old"), (new, "new")):
        y.fill_(float("nan"))
        checked(lambda *_, k=k: (call(k, 0), y)[1], *sets[0], activation, f"{side} {k.side['kernel']}")
    # Old and new in the order ABBA ABBA ..., each call on the next input set: neither side goes first more
    # often, nor reads what the other just brought into the L2 cache.
    sides = [(i + i // 2) % 2 for i in range(2 * CALLS)]
    per_call = timing.marked_calls_us(lambda i: call((old, new)[sides[i]], i), 2 * CALLS)
    return tuple(statistics.median(t for t, s in zip(per_call, sides, strict=True) if s == side) for side in (0, 1))


def run(rev: str) -> list[dict]:
    manifest = json.loads((ROOT / "build" / f"ab_{rev}" / "manifest.json").read_text())
    timed: dict[str, tuple[float, float]] = {}
    rows = []
    for item in manifest:
        kind, impl, dtype, m, h = item["row"]
        key = json.dumps([item["old"]["ptx"], item["new"]["ptx"], item["old"]["grid"], dtype, m, h])
        if key not in timed:
            timed[key] = time_pair(Loaded(item["old"]), Loaded(item["new"]), m, h, getattr(torch, dtype),
                                   "none" if kind == "fwd" else "gelu")
        old_us, new_us = timed[key]
        rows.append({"kind": kind, "impl": impl, "dtype": dtype, "M": m, "H": h, "old_kernel": item["old"]["kernel"],
                     "new_kernel": item["new"]["kernel"], "same_ptx": item["same_ptx"], "old_us": round(old_us, 2),
                     "new_us": round(new_us, 2), "new_vs_old": round(new_us / old_us, 3)})
        print(f"{kind} {impl} {dtype} {m}x{h}: {old_us:.2f} -> {new_us:.2f} us ({new_us / old_us:.3f})", flush=True)
    return rows


def write(rev: str, rows: list[dict]) -> None:
    from ops.bench import reports

    worst = sorted(rows, key=lambda r: -r["new_vs_old"])[:15]
    reports.write_report(
        ROOT / "results" / f"kernel_ab_vs_{rev}", rows, FIELDS,
        f"GPU: {reports.gpu_name()}; commit {reports.commit()}; against {rev}",
        f"LayerNorm forward kernels, A/B against {rev} (scripts/ab_kernels.py)",
        f"Each forward row of ours in results/layernorm.csv: the kernel {rev} launched for it (old_kernel, "
        f"its PTX and launch as built at {rev}) and the one the working tree launches (new_kernel), timed in one "
        f"process on the same inputs, {CALLS} calls each, alternating (CUPTI kernel time, median). same_ptx: the "
        f"same PTX (names aside) and launch. Worst new_vs_old: "
        + "; ".join(f"{r['kind']} {r['impl']} {r['dtype']} {r['M']}x{r['H']} {r['new_vs_old']}" for r in worst[:5]))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev")
    parser.add_argument("--build", action="store_true", help="record both sides' launches and PTX (needs Mojo)")
    args = parser.parse_args(argv)
    if args.build:
        build(args.rev)
        return 0
    if not torch.cuda.is_available():
        print("ab_kernels needs a CUDA GPU (or --build)")
        return 1
    write(args.rev, run(args.rev))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
