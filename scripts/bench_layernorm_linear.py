"""Linear(LayerNorm(x)) on the GPU: torch eager, torch.compile and ours, as a user calls them.

Per row, the headline first: pipelined time per call (back-to-back calls with their allocations, one
synchronisation, divided; median of repeats) and its ratio to torch eager F.linear(F.layer_norm(x)), host
time per call; then device microseconds (CUDA events, median, inputs rotated past the L2 cache), TFLOP/s
(2*M*N*K per forward), the peak memory one call allocates, and the call's kernel time by CUPTI
(torch.profiler). "ours" is the public ``layernorm_linear`` (what ``FusedLayerNormLinear`` runs; algo auto),
"ours:<algo>" the same call with that algo forced. Liger-Kernel has no LayerNorm+Linear op. TF32 is off.
Every contender is checked against the float64 reference first. Backward rows time all five gradients
(torch autograd vs ours); train rows a whole forward and backward from leaves that need gradients.
Writes results/layernorm_linear.{csv,md} and, with matplotlib, a PNG.

    poe bench-layernorm-linear            (needs a CUDA GPU)
    python scripts/bench_layernorm_linear.py --quick
    python scripts/bench_layernorm_linear.py --shape 4096x768x3072 --dtypes bfloat16   (one M x K x N, printed)
    python scripts/bench_layernorm_linear.py --plot-only
    python scripts/bench_layernorm_linear.py --dtypes float32 --append   (add to an earlier bfloat16 run)
    python scripts/bench_layernorm_linear.py --splits   (the fused kernel's k splits at small n:
                                                          table bench_layernorm_linear_splits)
    python scripts/bench_layernorm_linear.py --sm90     (the Hopper kernel, algo sm90, bfloat16, next to
                                                          torch, auto and cuBLAS's GEMM alone over the shape
                                                          grid, or with --quick at SM90_SHAPES:
                                                          table bench_layernorm_linear_sm90)
    python scripts/bench_layernorm_linear.py --workspace   (the unfused forward's cuBLASLt GEMM with the
                                                          workspace rule, with 32 MiB and with none, one
                                                          process each, bfloat16 grid:
                                                          table bench_layernorm_linear_workspace)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ops import layernorm_linear as LL  # noqa: E402
from ops.bench import reports, timing  # noqa: E402
from ops.reference import layernorm_linear_grads_ref, layernorm_linear_ref  # noqa: E402
from ops.tolerance import compare  # noqa: E402

OUT = ROOT / "results"
GRID_M = (16, 512, 4096, 16384)
GRID_K = (768, 1024, 4096)
GRID_N = (64, 768, 3072, 4096)
TARGETS = ((4096, 768, 3072), (4096, 4096, 64), (4096, 4096, 4096))
SPLIT_SHAPES = ((4096, 4096, 64), (4096, 4096, 128), (4096, 768, 64), (16384, 1024, 64), (512, 4096, 64),
                (16, 4096, 64), (4096, 4096, 256))
SPLIT_COUNTS = (1, 2, 4, 8, 16)
STRIDED_SHAPES = ((4096, 768, 3072), (4096, 4096, 64))
SM90_SHAPES = ((4096, 768, 3072), (4096, 768, 2304), (4096, 1024, 3072), (4096, 4096, 3072), (16384, 768, 3072),
               (4096, 1024, 4096), (4096, 4096, 4096))
ROTATE_BYTES = 256 << 20
FIELDS = ("kind", "impl", "dtype", "M", "K", "N", "pipe_us", "pipe_vs_torch", "pipe_runs", "pipe_spread", "host_us",
          "us", "TFLOPs", "vs_torch", "peak_MB", "kernel_us", "kernel_vs_torch")
Sets = list[tuple[torch.Tensor, ...]]


def input_sets(m: int, k: int, n: int, dtype: torch.dtype) -> Sets:
    """(x, ln_weight, ln_bias, weight, bias, dy) sets, enough of them to rotate x past the L2 cache."""
    count = max(2, min(16, -(-ROTATE_BYTES // (m * k * dtype.itemsize))))
    sets = []
    for _ in range(count):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        g = (1 + 0.1 * torch.randn(k, device="cuda")).to(dtype)
        b = (0.1 * torch.randn(k, device="cuda")).to(dtype)
        w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(dtype)
        bias = (0.1 * torch.randn(n, device="cuda")).to(dtype)
        sets.append((x, g, b, w, bias, torch.randn(m, n, device="cuda", dtype=dtype)))
    return sets


def torch_eager(x, g, b, w, bias, dy=None):
    return F.linear(F.layer_norm(x, (x.shape[-1],), g, b), w, bias)


def ours(algo: str) -> Callable:
    """The public call (no gradient to come: the inputs need none)."""
    def run(x, g, b, w, bias, dy=None):
        return LL.layernorm_linear(x, g, b, w, bias, algo=algo)
    return run


def peak_mb(fn: Callable, args: tuple) -> float:
    """Memory one call allocates beyond its inputs, at its peak."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(*args)
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def check_forward(fn: Callable, s: tuple, what: str) -> None:
    x, g, b, w, bias, _ = s
    if (bad := compare(fn(*s), layernorm_linear_ref(x, g, b, w, bias), x.dtype, reduction=x.shape[1])) is not None:
        raise SystemExit(f"{what} is wrong at x {tuple(x.shape)} weight {tuple(w.shape)} {x.dtype}: {bad}")


def row(kind: str, impl: str, s: tuple, t: timing.Timing, torch_t: timing.Timing, mb: float) -> dict:
    x, w = s[0], s[3]
    (m, k), n = x.shape, w.shape[0]
    flops = 2 * m * n * k * (2 if kind == "bwd" else 1)
    return {"kind": kind, "impl": impl, "dtype": str(x.dtype).removeprefix("torch."), "M": m, "K": k, "N": n,
            **timing.call_fields(t, torch_t), "us": round(t.device_us, 2),
            "TFLOPs": round(flops / t.device_us / 1e6, 2), "vs_torch": round(t.device_us / torch_t.device_us, 3),
            "peak_MB": round(mb, 1),
            "kernel_us": round(t.kernel_us, 2), "kernel_vs_torch": round(t.kernel_us / torch_t.kernel_us, 3)}


def iters_for(m: int, k: int, n: int) -> int:
    return 50 if m * k * n <= 1 << 33 else 20


def time_contenders(dtype: torch.dtype, shape: tuple[int, int, int],
                    contenders: Callable[[Sets], list[tuple[str, Callable]]]) -> list[dict]:
    """Check, then time every (name, fn) that ``contenders(input sets)`` lists at one shape, side by side
    (pipelined runs interleaved); the first one is the baseline of the ratios."""
    m, k, n = shape
    sets = input_sets(m, k, n, dtype)
    named = contenders(sets)
    for impl, fn in named:
        check_forward(fn, sets[0], impl)
    times = timing.side_by_side([(impl, fn, sets) for impl, fn in named], iters_for(m, k, n), kernels=True)
    rows = [row("fwd", impl, sets[0], times[impl], times[named[0][0]], peak_mb(fn, sets[0])) for impl, fn in named]
    print(f"fwd {dtype} M={m} K={k} N={n}: " + " | ".join(f"{r['impl']} {r['pipe_us']}us" for r in rows), flush=True)
    return rows


def bench_forward(dtype: torch.dtype, shapes: list[tuple[int, int, int]], with_compile: bool) -> list[dict]:
    compiled = torch.compile(torch_eager, dynamic=True) if with_compile else None
    contenders = [("torch", torch_eager)] + ([("torch.compile", compiled)] if compiled else [])
    contenders += [("ours", ours("auto"))] + [(f"ours:{a}", ours(a)) for a in ("unfused", "fused")]
    return [r for shape in shapes for r in time_contenders(dtype, shape, lambda _: contenders)]


def fused_with(splits: int | None) -> Callable:
    def run(x, g, b, w, bias, dy=None):
        return LL.launch.fused_fwd(x, g, b, w, bias, 1e-5, splits)[0]
    return run


def bench_splits(dtype: torch.dtype) -> list[dict]:
    """The fused kernel at each split count (and the count fused_splits picks) next to torch and unfused."""
    def contenders(sets: Sets) -> list[tuple[str, Callable]]:
        x, w = sets[0][0], sets[0][3]
        picked = LL.launch.fused_splits(x.shape[0], x.shape[1], w.shape[0], x.device, x.dtype)
        return ([("torch", torch_eager), ("ours:unfused", ours("unfused")),
                 (f"ours:fused splits={picked} (picked)", fused_with(None))]
                + [(f"ours:fused splits={s}", fused_with(s)) for s in SPLIT_COUNTS if s != picked])
    return [r for shape in SPLIT_SHAPES for r in time_contenders(dtype, shape, contenders)]


def bench_sm90(shapes: list[tuple[int, int, int]]) -> list[dict]:
    """The Hopper kernel (bfloat16, sm_90) next to torch, auto, and cuBLAS's GEMM alone on LayerNorm(x)
    computed beforehand (outside the timing): the floor a fused kernel has to approach."""
    def contenders(sets: Sets) -> list[tuple[str, Callable]]:
        normalized = {id(s[0]): F.layer_norm(s[0], (s[0].shape[-1],), s[1], s[2]) for s in sets}

        def gemm_alone(x, g, b, w, bias, dy=None):
            return F.linear(normalized[id(x)], w, bias)
        return [("torch", torch_eager), ("ours:auto", ours("auto")), ("ours:sm90", ours("sm90")),
                ("cublas GEMM alone (xn given)", gemm_alone)]
    return [r for shape in shapes for r in time_contenders(torch.bfloat16, shape, contenders)]


# --workspace: the cuBLASLt workspace cap per process (the C++ entries' set_lt_workspace, before any GEMM; "rule":
# the library's)
WORKSPACE_CAPS = (("rule", None), ("32MiB", str(32 << 20)), ("none", "0"))
WORKSPACE_FIELDS = ("M", "K", "N", "rule_picks", *(f"kernel_us_{c}" for c, _ in WORKSPACE_CAPS),
                    "kernel_none_vs_32MiB", *(f"pipe_us_{c}" for c, _ in WORKSPACE_CAPS))
WORKSPACE_CHILD = "OPS_BENCH_WORKSPACE_CHILD"


def workspace_child(shapes: list[tuple[int, int, int]], cap: str) -> None:
    """One --workspace process under workspace cap ``cap`` (bytes, or "rule"): torch and ours:unfused (bfloat16) at
    each shape, ours' times as JSON lines."""
    from ops.launch import direct

    if cap != "rule":
        direct.load_native().ops.set_lt_workspace(int(cap))
    for shape in shapes:
        rows = time_contenders(torch.bfloat16, shape, lambda _: [("torch", torch_eager), ("ours", ours("unfused"))])
        print("ROW " + json.dumps(rows[-1]), flush=True)


def bench_workspace(shapes: list[tuple[int, int, int]], quick: bool) -> list[dict]:
    """The unfused forward at each shape (TARGETS if ``quick``) under each of WORKSPACE_CAPS, one fresh process
    per cap."""
    from ops.layernorm_linear import config as config

    times: dict[str, dict[tuple, dict]] = {}
    for cap, value in WORKSPACE_CAPS:
        env = os.environ | {WORKSPACE_CHILD: "rule" if value is None else value}
        args = [sys.executable, __file__, "--workspace", "--dtypes", "bfloat16"] + (["--quick"] if quick else [])
        out = subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout
        rows = [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ROW ")]
        times[cap] = {(r["M"], r["K"], r["N"]): r for r in rows}
        print(f"--workspace {cap}: {len(rows)} shapes", flush=True)
    merged = []
    for m, k, n in shapes:
        t = {cap: times[cap][(m, k, n)] for cap, _ in WORKSPACE_CAPS}
        merged.append({"M": m, "K": k, "N": n,
                       "rule_picks": "none" if config.lt_without_workspace(k, n) else "32MiB",
                       **{f"kernel_us_{c}": t[c]["kernel_us"] for c in t},
                       "kernel_none_vs_32MiB": round(t["none"]["kernel_us"] / t["32MiB"]["kernel_us"], 3),
                       **{f"pipe_us_{c}": t[c]["pipe_us"] for c in t}})
    return merged


def run_grads(y: torch.Tensor, leaves: tuple[torch.Tensor, ...], dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The backward of one prepared graph (all five gradients)."""
    return torch.autograd.grad(y, leaves, dy, retain_graph=True)


def prepared(impl: str, sets: Sets) -> list[tuple]:
    graphs = []
    for x, g, b, w, bias, dy in sets:
        leaves = tuple(t.detach().requires_grad_() for t in (x, g, b, w, bias))
        y = torch_eager(*leaves) if impl == "torch" else LL.layernorm_linear(*leaves)
        graphs.append((y, leaves, dy))
    return graphs


def bench_strided(dtype: torch.dtype, shapes: list[tuple[int, int, int]]) -> list[dict]:
    """Forward of a strided x (a transposed view) beside a contiguous one, torch and ours (algo auto), and torch's
    copy of the strided x into a contiguous tensor ("copy:strided"; ours copies it first with its own tiled kernel).
    "ours:strided" should cost at most "ours" plus "copy:strided" (issue 34). Rows of kind "fwd-strided", against
    torch on contiguous x."""
    rows = []
    for m, k, n in shapes:
        sets = input_sets(m, k, n, dtype)
        strided = [(x.t().contiguous().t(), *rest) for x, *rest in sets]   # the same values, not contiguous
        contenders = [("torch", torch_eager, sets), ("torch:strided", torch_eager, strided),
                      ("ours", ours("auto"), sets), ("ours:strided", ours("auto"), strided)]
        for name, fn, inputs in contenders:
            check_forward(fn, inputs[0], name)
        contenders.append(timing.copy_contender("copy:strided", strided))
        times = timing.side_by_side(contenders, iters_for(m, k, n), kernels=True)
        rows += [row("fwd-strided", name, sets[0], times[name], times["torch"], peak_mb(fn, inputs[0]))
                 for name, fn, inputs in contenders]
        print(f"fwd-strided {dtype} M={m} K={k} N={n}: " + " | ".join(f"{r['impl']} {r['pipe_us']}us"
                                                                     for r in rows[-len(contenders):]), flush=True)
        del sets, strided, contenders
    return rows


def bench_backward(dtype: torch.dtype, shapes: list[tuple[int, int, int]]) -> list[dict]:
    rows = []
    for m, k, n in shapes:
        sets = input_sets(m, k, n, dtype)[:4]
        x, g, b, w, bias, dy = sets[0]
        y, leaves, _ = prepared("ours", sets[:1])[0]
        got = torch.autograd.grad(y, leaves, dy)
        for name, gv, r in zip(("dx", "dln_w", "dln_b", "dw", "db"), got,
                               layernorm_linear_grads_ref(x, g, b, w, bias, dy), strict=True):
            if (bad := compare(gv, r, dtype, reduction=max(m, n * k), cond=10.0)) is not None:
                raise SystemExit(f"backward {name} is wrong at M={m} K={k} N={n} {dtype}: {bad}")
        graphs = {impl: prepared(impl, sets) for impl in ("torch", "ours")}
        times = timing.side_by_side([(impl, run_grads, g) for impl, g in graphs.items()], iters_for(m, k, n),
                                    kernels=True)
        for impl, g in graphs.items():
            rows.append(row("bwd", impl, sets[0], times[impl], times["torch"], peak_mb(run_grads, g[0])))
        del graphs
        print(f"bwd {dtype} M={m} K={k} N={n}: " + " | ".join(f"{r['impl']} {r['pipe_us']}us" for r in rows[-2:]),
              flush=True)
    return rows


def bench_train(dtype: torch.dtype, shapes: list[tuple[int, int, int]]) -> list[dict]:
    """A training step of the op: forward from leaves that need gradients, then all five gradients."""
    def step(fwd: Callable) -> Callable:
        def run(x, g, b, w, bias, dy):
            leaves = tuple(t.requires_grad_() for t in (x, g, b, w, bias))
            return torch.autograd.grad(fwd(*leaves), leaves, dy)
        return run
    rows = []
    for m, k, n in shapes:
        sets = [tuple(t.detach() for t in s) for s in input_sets(m, k, n, dtype)[:4]]
        steps = {"torch": step(torch_eager), "ours": step(LL.layernorm_linear)}
        times = timing.side_by_side([(impl, fn, sets) for impl, fn in steps.items()], iters_for(m, k, n), kernels=True)
        for impl, fn in steps.items():
            rows.append(row("train", impl, sets[0], times[impl], times["torch"], peak_mb(fn, sets[0])))
        print(f"train {dtype} M={m} K={k} N={n}: " + " | ".join(f"{r['impl']} {r['pipe_us']}us" for r in rows[-2:]),
              flush=True)
    return rows


def write(rows: list[dict], stem: str = "bench_layernorm_linear", kept: str = "") -> None:
    """The table ``stem`` (results/layernorm_linear.{csv,md}); ``kept``: ``kept_stamp`` of the run whose rows were
    kept."""
    reports.write_report(
        OUT / stem, rows, FIELDS, f"GPU: {reports.gpu_name()}; commit {reports.commit()}; TF32 off{kept}",
        "LayerNorm + Linear benchmark (scripts/bench_layernorm_linear.py)",
        "pipe_us: pipelined time per call, the headline (back-to-back calls with their allocations, one "
        "synchronisation, divided; median of 5 runs); pipe_vs_torch divides by torch eager's; host_us: "
        "the host's time per call in the same runs (until the last call returned). ours: the public "
        "layernorm_linear (algo auto; ours:<algo> forces one). "
        "Device time per call (CUDA events, median, inputs rotated past L2). TFLOPs counts 2*M*N*K "
        "(backward: twice that). vs_torch < 1 is faster than torch eager F.linear(F.layer_norm(x)) "
        "(backward: torch autograd). peak_MB: memory one call allocates at its peak. kernel_us: the "
        "call's kernels, memsets and copies alone, by CUPTI (torch.profiler; median over as many calls, "
        "each call's busy time on the device), without the launch gaps and stream hops that the events "
        "include; kernel_vs_torch divides by torch's kernel time. Kind fwd-strided: torch:strided and "
        "ours:strided take a transposed (strided) x of the same values; copy:strided copies it into a contiguous "
        "tensor (what ours does first).")


def plot() -> None:
    """Forward time relative to torch eager per shape, one panel per dtype, from the committed CSV."""
    reports.plot_forward("bench_layernorm_linear", "LayerNorm+Linear forward", "pipe_vs_torch",
                         "pipelined time / torch eager", ("M", "K", "N"), "{}x{}->{}", log=True)


def main() -> int:
    args = reports.bench_args(__doc__, "the issue's target shapes only", "bfloat16,float32",
                             ("--splits", "sweep the fused kernel's k splits instead (small n)"),
                             ("--sm90", "time the Hopper kernel (algo sm90, bfloat16) instead"),
                             ("--workspace", "time the unfused forward's GEMM under each workspace cap instead"))
    if (status := reports.run_without_gpu(args, plot, "bench_layernorm_linear")) is not None:
        return status
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.splits:
        write([r for d in args.dtypes.split(",") for r in bench_splits(getattr(torch, d))],
              "bench_layernorm_linear_splits")
        return 0
    if args.shape:   # a quick look at one shape: forward, backward and training step, printed
        shape = reports.parse_shape(args.shape, 3)
        rows = []
        for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
            rows += bench_forward(dtype, [shape], not args.no_compile)
            rows += bench_backward(dtype, [shape]) + bench_train(dtype, [shape])
        reports.print_rows(rows, FIELDS)
        return 0
    full = list(dict.fromkeys(list(TARGETS) + [(m, k, n) for m in GRID_M for k in GRID_K for n in GRID_N]))
    if args.sm90:
        write(bench_sm90(list(SM90_SHAPES) if args.quick else full), "bench_layernorm_linear_sm90")
        return 0
    if args.workspace:
        shapes = list(TARGETS) if args.quick else full
        if os.environ.get(WORKSPACE_CHILD):
            workspace_child(shapes, os.environ[WORKSPACE_CHILD])
            return 0
        reports.write_report(
            OUT / "bench_layernorm_linear_workspace", bench_workspace(shapes, args.quick), WORKSPACE_FIELDS,
            f"GPU: {reports.gpu_name()}; commit {reports.commit()}", "LayerNorm + Linear: cuBLASLt's workspace "
            "(scripts/bench_layernorm_linear.py --workspace)",
            "ours:unfused (our LayerNorm, then the GEMM by cuBLASLt with the bias in its epilogue), bfloat16, in one "
            "fresh process per workspace cap (set_lt_workspace): rule is the library's (no workspace where "
            "K <= LT_NO_WORKSPACE_MAX_K_PER_N * N, ops/layernorm_linear/config.py; rule_picks says which), 32MiB "
            "lets every algorithm take up to 32 MiB (the heuristics' first choice), none gives none. kernel_us: "
            "the call's kernels and memsets by CUPTI; pipe_us: pipelined time per call (as in "
            "the bench_layernorm_linear table).")
        return 0
    grid = list(TARGETS) if args.quick else full
    rows: list[dict] = []
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        rows += bench_forward(dtype, grid, not args.no_compile)
        rows += bench_backward(dtype, list(TARGETS))
        rows += bench_train(dtype, list(TARGETS))
        rows += bench_strided(dtype, list(STRIDED_SHAPES))
    kept = ""
    if args.append:  # keep the other dtypes' rows of an earlier run (one device call per dtype)
        rows, kept = reports.appended("bench_layernorm_linear", args.dtypes, rows)
    write(rows, kept=kept)
    reports.save_plot(plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
