"""Puzzle p22: fused vs unfused LayerNorm + Linear.

    poe p22 --unfused            run your problems/p22 kernels, unfused path
    poe p22 --fused              ... fused path (--variant naive for the first version)
    poe p22 --solution --fused   run solutions/p22 instead
    poe p22 --check              compare your kernels with the solution's, kernel by kernel
    poe p22 --fused --batch 8 --seq 512 --hidden 768 --out 3072

Runs on the GPU when torch sees one (force the CPU with --cpu); --check checks the CPU and the GPU.
While anything compiles, one line says what is being built (on standard error). Every verdict calls the kernels
without MAX (built in seconds); --unfused and --fused then build them through MAX, check them once more and time them.

Exit codes: 0 every result correct; 1 a wrong result; 2 a needed kernel is still a stub;
3 a kernel does not compile (file:line and the compiler's message come first); 4 a usage error
(bad option or sizes too large for memory); 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ops.launch import packages  # noqa: E402  (no torch)

if __name__ == "__main__":   # the puzzle's packages precompile while torch loads (seconds on a slow host)
    packages.precompile_soon(ROOT / "problems", ROOT / "solutions")

import torch  # noqa: E402

from ops.bench.timing import kernel_times, measure  # noqa: E402
from ops.launch import bridge, progress  # noqa: E402
from ops.launch.cache import CacheError  # noqa: E402
from ops.puzzle.p22 import (  # noqa: E402
    CHECK_ROUTE,
    PROBLEMS,
    SOLUTIONS,
    P22Kernels,
    col_tiles_override,
    fused,
    kernel_cases,
    make_inputs,
    unfused,
)
from ops.puzzle.p22_builds import DIRECT, build_all_reported, build_reported, built_direct, shown  # noqa: E402
from ops.puzzle.p22_cpu import P22Cpu  # noqa: E402
from ops.puzzle.p22_direct import P22Direct  # noqa: E402
from ops.puzzle.skeleton import regions_in  # noqa: E402
from ops.reference import layernorm_linear_ref  # noqa: E402
from ops.tolerance import compare  # noqa: E402

EXIT_OK, EXIT_WRONG, EXIT_STUB, EXIT_COMPILE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130

# Above this many GFLOP per call the scalar CPU kernels take many seconds; a
# GPU run then checks and times the GPU only (unless --cpu asks for the CPU).
CPU_GFLOP_LIMIT = 0.5

# Which fill-in regions each path needs, on each target.
NEEDS = {
    ("unfused", "gpu"): ["layernorm_kernel"],
    ("unfused", "cpu"): ["row_stats_cpu"],
    ("fused", "gpu"): ["fused_stats", "fused_normalize_on_load"],
    ("fused", "cpu"): ["row_stats_cpu"],
}

# What to look at when a kernel fails --check, per target: on the CPU the LayerNorm and both
# fused kernels take their row statistics from the learner's row_stats_cpu.
ROW_STATS_HINT = ("[row_stats_cpu] in layernorm.mojo: the mean over the row, then the mean of (x - mean)^2; "
                  "rstd = rsqrt(var + EPS)")
HINTS = {
    "p22_layernorm": {"gpu": "[layernorm_kernel]: both passes must cover every element "
                             "(i = tid; i < h; i += LN_BLOCK) and rstd uses EPS",
                      "cpu": ROW_STATS_HINT},
    "p22_transpose": "given kernel: a failure here means the tile indices were edited",
    "p22_matmul": "given kernel: a failure here means the tile loads or bounds checks were edited",
    "p22_bias_add": "given kernel: bias is indexed by the column, i % n",
    "p22_fused": {"gpu": "[fused_stats] and [fused_normalize_on_load]: the prologue's mean_s/rstd_s and the "
                         "normalize-on-load must match p22_layernorm",
                  "cpu": "its CPU path normalizes with your " + ROW_STATS_HINT},
    "p22_fused_naive": {"gpu": "given kernel: first fused version, one thread per row",
                        "cpu": "given kernel, but its CPU path normalizes with your " + ROW_STATS_HINT},
}


def hint(name: str, target: str) -> str:
    """The --check hint for kernel ``name`` on ``target`` ("cpu" or "gpu")."""
    h = HINTS[name]
    return h if isinstance(h, str) else h[target]


class UsageError(Exception):
    """A bad option or size: the run stops before anything is built or allocated, with exit code 4."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would exit 2, the code of a stub
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(prog="p22", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--unfused", action="store_true", help="run the unfused path")
    p.add_argument("--fused", action="store_true", help="run the fused path")
    p.add_argument("--variant", choices=["tiled", "naive"], default="tiled", help="fused kernel version")
    p.add_argument("--solution", action="store_true", help="run solutions/p22 instead of problems/p22")
    p.add_argument("--package", type=Path, default=None, help=argparse.SUPPRESS)  # tests: another kernel dir
    p.add_argument("--check-route", choices=["max", "direct"], default=CHECK_ROUTE,
                   help=argparse.SUPPRESS)  # measurements: how a verdict runs the kernels (CHECK_ROUTE)
    p.add_argument("--check", action="store_true", help="compare problems/p22 with solutions/p22 kernel by kernel")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is present")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4)
    p.add_argument("--hidden", type=int, default=8)
    p.add_argument("--out", type=int, default=16)
    p.add_argument("--iters", type=int, default=50, help="timed calls per benchmark")
    p.add_argument("--no-bench", action="store_true", help="skip the benchmark")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--col-tiles-sweep", action="store_true",
                   help="GPU: also time the tiled fused kernel at every tiles-per-block count (P22_FUSED_COL_TILES)")
    args = p.parse_args(argv)
    if not (args.unfused or args.fused or args.check):
        p.error("choose --unfused, --fused (or both), or --check")
    for name in ("batch", "seq", "hidden", "out", "iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    return args


def stubs_left(package: Path, modes: list[str], target: str) -> list[str]:
    """'label (file:line)' for every fill-in region a run needs that is still a stub."""
    needed = {label for mode in modes for label in NEEDS[(mode, target)]}
    return [f"{reg.label} ({shown(path)}:{reg.start})"
            for path, reg in regions_in(package) if reg.label in needed and not reg.filled]


Kernels = P22Kernels | P22Cpu | P22Direct   # one package's ops: through MAX, or called without it (DIRECT)


def run_path(k: Kernels, mode: str, variant: str, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return unfused(k, *inputs) if mode == "unfused" else fused(k, *inputs, variant=variant)


def wrong_results(kernels: dict[str, Kernels], modes: list[str], args: argparse.Namespace,
                  inputs: tuple[torch.Tensor, ...], ref: torch.Tensor) -> list[tuple[str, str, float, str | None]]:
    """(mode, device, max abs error, what is wrong or None) of each path on each device of ``kernels``."""
    rows = []
    for mode in modes:
        for dev, k in kernels.items():
            got = run_path(k, mode, args.variant, tuple(t.to(dev) for t in inputs)).cpu()
            bad = compare(got, ref, torch.float32, reduction=args.hidden)
            rows.append((mode, dev, (got.double() - ref).abs().max().item(), bad))
    return rows


def report_correctness(kernels: dict[str, Kernels], modes: list[str], args: argparse.Namespace,
                       inputs: tuple[torch.Tensor, ...], ref: torch.Tensor) -> bool:
    print("\nCorrectness vs the float64 PyTorch reference")
    print(f"  reference : y[0, 0, :4] = {[round(v, 5) for v in ref[0, 0, :4].tolist()]}")
    rows = wrong_results(kernels, modes, args, inputs, ref)
    for mode, dev, err, bad in rows:
        print(f"  {mode:8s} on {dev:4s}: max abs err {err:.2e}  {'PASS' if bad is None else f'FAIL: {bad}'}")
    return all(bad is None for *_, bad in rows)


def benchmark(k: Kernels, modes: list[str], args: argparse.Namespace, devices: list[str]) -> None:
    sets = [make_inputs(args.batch, args.seq, args.hidden, args.out) for _ in range(4)]
    flops = 2.0 * args.batch * args.seq * args.hidden * args.out
    print(f"\nBenchmark: median of {args.iters} calls after warm-up, 4 rotating input sets")
    print(f"  {'path':28s} {'device us':>10s} {'host us':>9s} {'GFLOP/s':>9s}")
    results, sets_on = {}, {}
    for dev in devices:
        dev_sets = sets_on[dev] = [tuple(t.to(dev) for t in s) for s in sets]
        iters = args.iters if dev == "cuda" else max(3, min(args.iters, 10))
        for mode in modes:
            label = f"{mode}{'/' + args.variant if mode == 'fused' else ''} ({dev})"
            t = measure(lambda *a, m=mode: run_path(k, m, args.variant, a), dev_sets, iters=iters, warmup=2)
            results[(mode, dev)] = t
            print(f"  {label:28s} {t.device_us:10.1f} {t.host_us:9.1f} {flops / t.device_us / 1e3:9.1f}")
    for dev in devices:
        if ("fused", dev) in results and ("unfused", dev) in results:
            ratio = results[("fused", dev)].device_us / results[("unfused", dev)].device_us
            print(f"  fused / unfused device time on {dev}: {ratio:.2f}x")
    print("  (device us: CUDA events on the GPU, wall time on the CPU; host us: time for the call to return)")
    if "cuda" in devices:
        kernel_breakdown(k, modes, args, sets_on["cuda"][0])
        if args.col_tiles_sweep and "fused" in modes and args.variant == "tiled":
            col_tiles_sweep(k, args, sets_on["cuda"])


def col_tiles_sweep(k: P22Kernels, args: argparse.Namespace, sets: list[tuple[torch.Tensor, ...]]) -> None:
    """Device time of the tiled fused kernel at each tiles-per-block count, next to the launcher's pick."""
    print("\nFused kernel vs output tiles per block (P22_FUSED_COL_TILES), device us")
    cells = []
    for forced in ["", *map(str, range(1, 9))]:
        with col_tiles_override(forced):
            t = measure(lambda *a: fused(k, *a), sets, iters=args.iters, warmup=2)
        cells.append(f"{forced or 'picked'} {t.device_us:.1f}")
    print("  " + " | ".join(cells))


def kernel_breakdown(k: P22Kernels, modes: list[str], args: argparse.Namespace,
                     inputs: tuple[torch.Tensor, ...]) -> None:
    """Where each path's device time goes, kernel by kernel (torch.profiler / CUPTI)."""
    print("\nDevice time per kernel, us per call (torch.profiler, 20 calls)")
    for mode in modes:
        times = kernel_times(lambda m=mode: run_path(k, m, args.variant, inputs))
        parts = ", ".join(f"{short_kernel_name(name)} {us:.1f}" for name, (_, us) in times.items())
        print(f"  {mode:8s}: {parts}")


def short_kernel_name(name: str) -> str:
    """'op_matmul_matmul_kernel_DTyp6A...' -> 'matmul_kernel': MAX names a kernel op_<file>_<function>
    plus a hash, and each p22 kernel function starts with its file's name."""
    if not name.startswith("op_"):
        return name[:40]
    head, found, _ = name.removeprefix("op_").partition("_kernel")
    for i, ch in enumerate(head):
        if ch == "_" and head[i + 1:].startswith(head[:i]):
            return head[i + 1:] + "_kernel"
    return head + found if found else name[:40]


def run(args: argparse.Namespace) -> int:
    package = (args.package or (SOLUTIONS if args.solution else PROBLEMS)).resolve()
    modes = [m for m in ("unfused", "fused") if getattr(args, m)]
    gpu = torch.cuda.is_available() and not args.cpu
    print(f"Puzzle p22: y = Linear(LayerNorm(x)), x [{args.batch}, {args.seq}, {args.hidden}] -> "
          f"y [{args.batch}, {args.seq}, {args.out}], float32")
    print(f"  kernels : {shown(package)}   paths: {', '.join(modes)}   "
          f"device: {torch.cuda.get_device_name() if gpu else 'cpu (no GPU in use)'}")
    missing = stubs_left(package, modes, "cpu") + (stubs_left(package, modes, "gpu") if gpu else [])
    if missing:
        for m in dict.fromkeys(missing):
            print(f"not implemented yet: {m}")
        return EXIT_STUB
    devices = ["cpu", "cuda"] if gpu else ["cpu"]
    gflop = 2e-9 * args.batch * args.seq * args.hidden * args.out
    if gpu and gflop > CPU_GFLOP_LIMIT:
        devices = ["cuda"]
        print(f"  cpu path skipped: {gflop:.1f} GFLOP per call is too slow for the scalar CPU kernels "
              f"(limit {CPU_GFLOP_LIMIT}; run with --cpu to force it)")
    check_memory(args, devices)
    k = P22Kernels(package)
    t0 = time.perf_counter()
    if args.check_route == "direct":
        checked = {dev: DIRECT[dev](package) for dev in devices}
        failed = build_all_reported({(dev, package): d for dev, d in checked.items()}, shown(package))
    else:
        checked = dict.fromkeys(devices, k)
        failed = build_reported([(k, dev) for dev in devices], partial=False)
    if failed:
        return EXIT_COMPILE
    print(f"  kernels built in {time.perf_counter() - t0:.1f} s ({ROUTE_NAMES[args.check_route]})")
    inputs = make_inputs(args.batch, args.seq, args.hidden, args.out, seed=args.seed)
    ref = layernorm_linear_ref(*inputs)   # float64: the verdict's, and the timed route's check after it
    ok = report_correctness(checked, modes, args, inputs, ref)
    print(f"\nSummary: {'all results correct' if ok else 'SOME RESULTS ARE WRONG'}")
    if not ok or args.no_bench:
        return EXIT_OK if ok else EXIT_WRONG
    return timed(k, modes, args, devices, inputs, ref, by_max=args.check_route == "max")


# How each route runs the kernels, as the run says it
ROUTE_NAMES = {"direct": "called without MAX", "max": "through MAX"}


def timed(k: P22Kernels, modes: list[str], args: argparse.Namespace, devices: list[str],
          inputs: tuple[torch.Tensor, ...], ref: torch.Tensor, by_max: bool) -> int:
    """The benchmark, through MAX: unless the verdict came through MAX too (``by_max``), built now and its results
    checked once more before they are timed (a wrong answer from the timed route fails the run like any other)."""
    if not by_max:
        t0 = time.perf_counter()
        if build_reported([(k, dev) for dev in devices], partial=False):
            return EXIT_COMPILE
        print(f"\nTiming through MAX: {bridge.compile_count} models loaded in {time.perf_counter() - t0:.1f} s")
        wrong = [row for row in wrong_results(dict.fromkeys(devices, k), modes, args, inputs, ref) if row[3]]
        for mode, dev, _, bad in wrong:
            print(f"  {mode} on {dev} through MAX: FAIL: {bad}")
        if wrong:
            return EXIT_WRONG
    benchmark(k, modes, args, devices)
    return EXIT_OK


def check_memory(args: argparse.Namespace, devices: list[str]) -> None:
    """Refuse sizes whose tensors would not fit, before anything is allocated (UsageError)."""
    b, s, h, o = args.batch, args.seq, args.hidden, args.out
    inputs = b * s * h + 2 * h + o * h + o
    outputs = b * s * h + h * o + 2 * b * s * o        # y and the unfused path's three intermediates
    sets = 1 if args.no_bench else 5                    # the checked inputs and four benchmark sets
    need = {"cpu": 4 * (sets * inputs + outputs) + 8 * (b * s * h + o * h + b * s * o)}  # + the float64 reference
    if "cuda" in devices:
        need["cuda"] = 4 * (sets * inputs + outputs)
    for dev, nbytes in need.items():
        free = _free_bytes(dev)
        if free is not None and nbytes > free:
            raise UsageError(f"--batch {b} --seq {s} --hidden {h} --out {o}: this run needs about "
                             f"{nbytes / 1e9:.1f} GB of {'GPU' if dev == 'cuda' else 'host'} memory and "
                             f"{free / 1e9:.1f} GB is free; choose smaller sizes")


def _free_bytes(dev: str) -> int | None:
    if dev == "cuda":
        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return check(args) if args.check else run(args)
    except UsageError as e:
        print(f"p22: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except CacheError as e:   # OPS_CACHE_DIR at a file, or a read-only cache that lacks a build
        print(f"p22: error: {e}", file=sys.stderr)
        return EXIT_USAGE


# ---------------------------------------------------------------- --check

CHECK_SHAPES = [(1, 1, 1, 1), (2, 3, 37, 7), (4, 4, 8, 16), (1, 7, 1000, 65), (2, 2, 1023, 130)]


def check(args: argparse.Namespace) -> int:
    devices = ["cpu", "cuda"] if torch.cuda.is_available() and not args.cpu else ["cpu"]
    bridge.poison_outputs = True  # an unwritten element is NaN and fails
    learner, solution = P22Kernels((args.package or PROBLEMS).resolve()), P22Kernels(SOLUTIONS)
    print(f"p22 --check: {shown(learner.package)} against solutions/p22 on {', '.join(devices)}, "
          "outputs poisoned with NaN")
    by_max = devices if args.check_route == "max" else []
    unbuilt = build_reported([(k, dev) for dev in by_max for k in (solution, learner)], partial=True)
    kernels: dict[str, tuple] = {dev: (learner, solution) for dev in by_max}
    if args.check_route == "direct":
        kernels.update(built_direct(learner, solution, devices, unbuilt))
    wrong = False
    for dev in devices:
        skip = unbuilt.get((learner.package, dev), frozenset())
        failures = check_device(*kernels[dev], dev, skip, args.seed)
        target = bridge.device_kind(torch.device(dev))
        print(f" on {dev}:")
        for name in HINTS:
            if name in skip:
                print(f"  FAIL {name:16s} does not compile (the error above)")
            elif name in failures:
                print(f"  FAIL {name:16s} {failures[name]}\n       hint: {hint(name, target)}")
            else:
                print(f"  pass {name:16s} all {len(CHECK_SHAPES)} shapes")
        wrong |= bool(failures)
    return EXIT_COMPILE if unbuilt else EXIT_WRONG if wrong else EXIT_OK


def check_device(learner: P22Kernels | P22Cpu | P22Direct, solution: P22Kernels | P22Cpu | P22Direct, dev: str,
                 skip: frozenset[str], seed: int | None) -> dict[str, str]:
    """Each learner kernel but those in ``skip`` against the solution's and float64 on every check shape:
    kernel name -> its first failure."""
    failures: dict[str, str] = {}
    for shape in CHECK_SHAPES:
        mean = 1e3 if shape[2] > 100 else 0.0  # large-mean rows catch one-pass statistics
        inputs = make_inputs(*shape, device=dev, mean=mean, seed=seed)
        mine, theirs = kernel_cases(learner, inputs, skip), kernel_cases(solution, inputs, skip)
        for name, (got, ref, red) in mine.items():
            if name in failures:
                continue
            cond = 1.0 + mean if name in ("p22_layernorm", "p22_fused", "p22_fused_naive") else 1.0
            bad = compare(got, theirs[name][0], torch.float32, reduction=red, cond=cond) or \
                compare(got, ref, torch.float32, reduction=red, cond=cond)
            if bad is not None:
                failures[name] = f"shape {shape}: {bad}"
    return failures


if __name__ == "__main__":
    progress.enable()   # a learner at a keyboard sees every build that takes a while
    try:
        code = main()
    except KeyboardInterrupt:   # at once, even while a compile's thread still runs: nothing half-built is kept
        sys.stdout.flush()
        print("\np22: interrupted", file=sys.stderr)
        os._exit(EXIT_INTERRUPTED)
    sys.exit(code)
