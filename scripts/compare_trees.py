"""Per-call time of the public modules in two source trees, side by side on one GPU in one sitting.

    python scripts/compare_trees.py --tree before=.probe/before --tree after=. [--rounds 3] [--pin-core 4]

A tree's ``build/ops_cache``, where it exists, is its process's cache (build each tree's kernels ahead there on the
CPU machine: ``OPS_CACHE_DIR=<tree>/build/ops_cache python -m ops.build_kernels``, run in the tree).

For a change that must not move speed (a refactor), run on the GPU machine: each round starts one process per tree
(their ``ops`` first on PYTHONPATH), the order reversed every other round (ABBA), and each process times ours and
torch's own modules at the same shapes: LayerNorm, LayerNorm+Linear, and GPT-2-small's twelve blocks
(scripts/gpt2_block.py, eager) for the transformer benchmark. Torch's rows are the control: the same code in both
trees, so their after/before ratio is the run-to-run noise that ours' ratio is read against. Only the public API is
used, so any layout of ``ops`` works. Kernels are not compared here (``scripts/compare_ptx.py`` does, on the CPU).
Writes results/compare_trees.{csv,md}.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "results" / "compare_trees"
# (case, rows, k, n): LayerNorm over k, or LayerNorm+Linear k -> n; 8 rows: host-bound, 4096: device-bound;
# GPT-2-small's blocks on [8, 512, 768] (rows = 8 x 512)
CASES = (("layernorm", 8, 768, 0), ("layernorm", 4096, 768, 0), ("layernorm_linear", 8, 768, 3072),
         ("layernorm_linear", 4096, 768, 3072), ("gpt2_small", 4096, 768, 0))
CALLS, REPEATS = 100, 5
MODEL_CALLS = 5   # a model's call takes milliseconds
CONTROL = "torch_again"   # a second copy of torch's module in the same process: the A/A pair
MAX_BAND = 0.05   # a noise band wider than this is reported as too wide to rule out a smaller slowdown


def worker() -> None:
    """In one tree's process: pipelined us per call (``calls`` back to back, one sync; median of REPEATS, the
    contenders interleaved) of ours, torch's modules and a second copy of torch's (the A/A control), inference and a
    training step (forward and backward), bfloat16, checked against torch first."""
    if (pin := os.environ.get("COMPARE_TREES_PIN")) is not None:
        os.sched_setaffinity(0, {int(pin)})
    import copy

    import torch

    import ops
    from ops.layernorm import LayerNorm
    from ops.layernorm_linear import FusedLayerNormLinear

    sys.path.append(str(ROOT / "scripts"))
    import gpt2_block  # after the tree's ops: its own imports of ops find them, not this file's tree's

    assert Path(ops.__file__).resolve().is_relative_to(Path.cwd().resolve()), ops.__file__
    rows_out = []
    dev, dt = torch.device("cuda"), torch.bfloat16
    for case, rows, k, n in CASES:
        torch.manual_seed(0)
        if case == "gpt2_small":
            ref, x = gpt2_block.reference(8, rows // 8)
            theirs, ours = gpt2_block.contender(ref, "torch"), gpt2_block.contender(ref, "ours")
        elif case == "layernorm":
            theirs = torch.nn.LayerNorm(k, device=dev, dtype=dt)
            ours = LayerNorm.from_torch(theirs)
        else:
            theirs = torch.nn.Sequential(torch.nn.LayerNorm(k), torch.nn.Linear(k, n)).to(dev, dt)
            ours = FusedLayerNormLinear.from_torch(theirs)
        if case != "gpt2_small":
            x = torch.randn(rows, k, device=dev, dtype=dt)
        with torch.no_grad():
            err = gpt2_block.rel_err(ours(x), theirs(x))
        if not err <= 0.02:
            raise SystemExit(f"{case} {rows}x{k}: ours differs from torch's by {err} (relative)")
        contenders = {"ours": ours, "torch": theirs, CONTROL: copy.deepcopy(theirs)}
        for phase in ("infer", "train"):
            times = _time(contenders, x, phase, MODEL_CALLS if case == "gpt2_small" else CALLS)
            rows_out += [{"case": case, "shape": f"{rows}x{k}" + (f"->{n}" if n else ""), "phase": phase,
                          "impl": impl, "us": us, "py_calls": _py_calls(contenders[impl], x, phase)}
                         for impl, us in times.items()]
    print(json.dumps(rows_out))


def _py_calls(m: object, x: object, phase: str) -> int:
    """Python-level calls (functions and builtins) in one call of ``m``: the host work a layout change could add,
    counted exactly where time is noisy."""
    import torch

    xg = x.detach().requires_grad_(phase == "train")
    count = 0

    def profile(frame: object, event: str, arg: object) -> None:
        nonlocal count
        count += event in ("call", "c_call")

    sys.setprofile(profile)
    try:
        if phase == "infer":
            with torch.no_grad():
                m(x)
        else:
            m(xg).sum().backward()
    finally:
        sys.setprofile(None)
    return count


def _time(contenders: dict[str, object], x: object, phase: str, calls: int) -> dict[str, float]:
    """Each contender's median us per call over REPEATS, the contenders taking turns in each repeat."""
    import torch

    xg = x.detach().requires_grad_(phase == "train")

    def steps(m: object) -> None:
        for _ in range(calls):
            if phase == "infer":
                with torch.no_grad():
                    m(x)
            else:
                m(xg).sum().backward()

    for m in contenders.values():
        steps(m)   # warm-up
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {impl: [] for impl in contenders}
    for _ in range(REPEATS):
        for impl, m in contenders.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            steps(m)
            end.record()
            torch.cuda.synchronize()
            times[impl].append(start.elapsed_time(end) * 1000 / calls)
    return {impl: statistics.median(t) for impl, t in times.items()}


def run(trees: dict[str, Path], rounds: int, pin_core: int | None, out: Path) -> list[dict]:
    """``rounds`` of one process per tree, in ABBA order; their rows, the CSV at ``out`` rewritten after each
    process (a run cut short keeps its finished rounds: ``--from-csv``)."""
    rows = []
    for r in range(rounds):
        for name, tree in (list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]):
            env = {**os.environ, "PYTHONPATH": f"{tree.resolve()}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            if (cache := tree / "build" / "ops_cache").is_dir():   # each tree's own kernels, built ahead
                env["OPS_CACHE_DIR"] = str(cache.resolve())
            if pin_core is not None:
                env["COMPARE_TREES_PIN"] = str(pin_core)
            proc = subprocess.run([sys.executable, __file__, "--worker"], cwd=tree, env=env, capture_output=True,
                                  text=True)
            if proc.returncode:
                raise SystemExit(f"{name}: {proc.stderr[-3000:]}")
            rows += [{"round": r, "tree": name, **row} for row in json.loads(proc.stdout.strip().splitlines()[-1])]
            _write_csv(rows, out)
    return rows


def _write_csv(rows: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def report(rows: list[dict], before: str, after: str) -> str:
    """Per case: each process's ours / torch (paired: the same process, the same minutes), its median over rounds
    in each tree, and after / before of that, read against the noise band (the A/A pair's same statistic, and ours'
    own spread between one tree's rounds). The processes of one machine differ by far more than a pair in one
    process does (torch's own after / before column shows by how much)."""
    def us(tree: str, key: tuple, impl: str) -> dict[int, float]:
        return {r["round"]: r["us"] for r in rows if r["tree"] == tree and r["impl"] == impl
                and (r["case"], r["shape"], r["phase"]) == key}

    def paired(tree: str, key: tuple, impl: str, half: int | None = None) -> float:
        theirs = us(tree, key, "torch")
        return statistics.median(t / theirs[r] for r, t in us(tree, key, impl).items()
                                 if half is None or r % 2 == half)

    def change(key: tuple, impl: str) -> float:
        return paired(after, key, impl) / paired(before, key, impl)

    def calls(tree: str, key: tuple) -> str:   # ours' Python calls per call, the same in every round
        counts = sorted({int(r["py_calls"]) for r in rows if r["tree"] == tree and r["impl"] == "ours"
                         and (r["case"], r["shape"], r["phase"]) == key})
        return "-".join(map(str, counts[:1] + counts[-1:] if len(counts) > 1 else counts))

    def split(key: tuple, tree: str) -> float:   # ours, even rounds against odd: one tree's own spread
        return paired(tree, key, "ours", 1) / paired(tree, key, "ours", 0)

    keys = sorted({(r["case"], r["shape"], r["phase"]) for r in rows})
    aa_band = max(abs(change(key, CONTROL) - 1) for key in keys)
    split_band = max(abs(split(key, tree) - 1) for key in keys for tree in (before, after))
    band = max(aa_band, split_band)
    verdict_note = (f" (over {MAX_BAND}: too wide to rule out a smaller slowdown by time alone; the Python calls "
                    "per call are exact)." if band > MAX_BAND else ".")
    lines = [f"# {after} against {before}: per-call time of the public modules", "",
             f"`python scripts/compare_trees.py`, bfloat16, pipelined us per call (median of {REPEATS} x {CALLS} "
             f"calls, a model's {REPEATS} x {MODEL_CALLS}, the contenders taking turns), in "
             f"{len({r['round'] for r in rows})} rounds of one process per tree. Ours is read as ours / torch in the "
             "same process (median over rounds), after against before. The noise band is the larger of two controls: "
             "a second copy of torch's module in the same processes, read the same way (its largest change: "
             f"{aa_band:.3f}), and ours in one tree's even rounds against its odd ones (largest: {split_band:.3f}). "
             f"Band: {band:.3f}{verdict_note}", "",
             f"| case | shape | phase | ours {before} us | ours {after} us | ours/torch {before} | "
             f"ours/torch {after} | change | A/A change | torch's own after/before | verdict | "
             f"Python calls {before} | Python calls {after} |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in keys:
        med = {(tree, impl): statistics.median(us(tree, key, impl).values()) for tree in (before, after)
               for impl in ("ours", "torch")}
        ratio = change(key, "ours")
        verdict = ("slower beyond noise" if ratio > 1 + band else
                   f"within a wide band (over {MAX_BAND})" if band > MAX_BAND else "within noise")
        lines.append(f"| {' | '.join(key)} | {med[before, 'ours']:.2f} | {med[after, 'ours']:.2f} | "
                     f"{paired(before, key, 'ours'):.3f} | {paired(after, key, 'ours'):.3f} | {ratio:.3f} | "
                     f"{change(key, CONTROL):.3f} | {med[after, 'torch'] / med[before, 'torch']:.3f} | {verdict} | "
                     f"{calls(before, key)} | {calls(after, key)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", action="append", default=[], help="NAME=PATH, twice: the earlier tree first")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pin-core", type=int, help="pin each process to this CPU (less host noise)")
    p.add_argument("--from-csv", action="store_true", help="rewrite the Markdown from the CSV at --out")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=OUT, help="the CSV and Markdown's path without suffix")
    a = p.parse_args(argv)
    if a.worker:
        worker()
        return 0
    if a.from_csv:
        with open(a.out.with_suffix(".csv")) as f:
            rows = [{**r, "us": float(r["us"]), "round": int(r["round"])} for r in csv.DictReader(f)]
        before, after = dict.fromkeys(r["tree"] for r in sorted(rows, key=lambda r: r["round"]))
    else:
        trees = dict(t.split("=", 1) for t in a.tree)
        if len(trees) != 2:
            p.error("--tree: give two, NAME=PATH each")
        rows = run({name: Path(path) for name, path in trees.items()}, a.rounds, a.pin_core, a.out)
        before, after = trees
    text = report(rows, before, after)
    a.out.with_suffix(".md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
