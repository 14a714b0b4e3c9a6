"""LayerNorm on the GPU: ours vs torch eager, torch.compile and Liger-Kernel, forward, backward and LN+GELU.

Per row of the report, the headline first: pipelined time per call (back-to-back calls with their
allocations, one synchronisation, divided; median of repeats), its ratio to torch eager, and host time per
call. "ours" is the public ``layernorm`` (what our ``LayerNorm`` module runs), "ours:<variant>" the
validated ``layernorm_fwd`` of each kernel variant; "liger" is Liger-Kernel's ``LigerLayerNormFunction``
(its backward: ``layer_norm_backward``), timed where it is installed. Then device microseconds (CUDA events,
median, inputs rotated past the L2 cache), GB/s counting the bytes that must move (forward:
read x, write y; backward: read x and dy, write dx), % of the measured
device copy bandwidth, and the ratio to torch eager (and torch.compile); then
the same call's kernel time by CUPTI (torch.profiler), its GB/s and its ratio
to torch's kernel time. Events also count the launch gaps and the hop between
torch's stream and MAX's queue (about 2-3 us a call); kernel time does not.
Every result is checked against the float64 reference before it is timed. Rows of kind "fwd-strided" time a
strided x (a transposed view) beside a contiguous one, a copy of x and one of the strided x (ours copies a
strided x once, so ours:strided should cost at most ours plus copy:strided).
Writes results/layernorm.{csv,md} and, with matplotlib, a PNG.

    poe bench-layernorm                       (needs a CUDA GPU)
    python scripts/bench_layernorm.py --quick
    python scripts/bench_layernorm.py --shape 4096x768 --dtypes bfloat16   (one M x H, printed, nothing written)
    python scripts/bench_layernorm.py --plot-only   (PNG from the committed CSV)
    python scripts/bench_layernorm.py --dtypes bfloat16 --append   (add to an earlier float32 run)
    python scripts/bench_layernorm.py --bwd-sweep   (the backward's launch choices -> bench_layernorm_bwd_sweep.*)
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ops import layernorm as L  # noqa: E402
from ops.bench import reports, timing  # noqa: E402
from ops.layernorm import config as config  # noqa: E402
from ops.reference import layernorm_act_ref, layernorm_grads_ref  # noqa: E402
from ops.tolerance import compare  # noqa: E402

OUT = ROOT / "results"
GRID_M = (1, 32, 512, 4096, 16384, 65536)
GRID_H = (256, 768, 1024, 4096, 8192)
TARGETS = ((16384, 4096), (4096, 8192))  # the >= 2.75 TB/s points
PROGRESSION = ((4096, 768), (16384, 4096), (4096, 8192))
LONG_ROWS = ((4096, 16384), (512, 32768), (32, 65536))  # fast: a cluster of blocks per row; vector: one block
BWD_SWEEP_SHAPES = ((4096, 768), (16384, 768), (1024, 768), (4096, 1024), (4096, 4096), (128, 768), (512, 768),
                    (2048, 768), (512, 4096))
BWD_SWEEP_PER_SM = (1, 2, 4, 8, 12, 16)
SWEEP_FIELDS = ("dtype", "M", "H", "per_sm", "parts", "config", "ch", "wpr", "rpb", "blocks", "threads", "default",
                "us", "kernel_us", "reduce_us", "GBps", "pct_copy")
BWD_SHAPES = ((4096, 4096), (4096, 768), (16384, 1024), (4096, 8192))
GELU_SHAPES = ((4096, 768), (16384, 4096))
ROTATE_BYTES = 256 << 20  # input sets per shape cover at least this much (H100 L2: 50 MB)
FIELDS = ("kind", "impl", "dtype", "M", "H", "pipe_us", "pipe_vs_torch", "pipe_runs", "pipe_spread", "host_us", "us",
          "GBps", "pct_copy", "vs_torch", "vs_compile", "kernel_us", "kernel_GBps", "kernel_vs_torch")


def copy_gbps() -> float:
    """Device-to-device copy bandwidth (read + write), the ceiling for these ops."""
    src = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = timing.measure(timing.copy_into, [(src, dst)], iters=30)
    return 2 * src.numel() / t.device_us / 1e3


def input_sets(m: int, h: int, dtype: torch.dtype, with_dy: bool = False) -> list[tuple[torch.Tensor, ...]]:
    """Enough fresh (x, w, b[, dy]) sets that cycling through them defeats the L2 cache."""
    per_set = m * h * dtype.itemsize * (2 if with_dy else 1)
    n = max(2, min(32, -(-ROTATE_BYTES // per_set)))
    sets = []
    for _ in range(n):
        x = torch.randn(m, h, device="cuda", dtype=dtype)
        w = (1 + 0.1 * torch.randn(h, device="cuda")).to(dtype)
        b = (0.1 * torch.randn(h, device="cuda")).to(dtype)
        sets.append((x, w, b, torch.randn_like(x)) if with_dy else (x, w, b))
    return sets


def row(kind: str, impl: str, dtype: torch.dtype, m: int, h: int, t: timing.Timing, nbytes: int,
        copy: float, torch_t: timing.Timing, compile_t: timing.Timing | None = None) -> dict:
    gbps = nbytes / t.device_us / 1e3
    return {"kind": kind, "impl": impl, "dtype": str(dtype).removeprefix("torch."), "M": m, "H": h,
            **timing.call_fields(t, torch_t), "us": round(t.device_us, 2), "GBps": round(gbps, 1),
            "pct_copy": round(100 * gbps / copy, 1),
            "vs_torch": round(t.device_us / torch_t.device_us, 3),
            "vs_compile": None if compile_t is None else round(t.device_us / compile_t.device_us, 3),
            "kernel_us": round(t.kernel_us, 2), "kernel_GBps": round(nbytes / t.kernel_us / 1e3, 1),
            "kernel_vs_torch": round(t.kernel_us / torch_t.kernel_us, 3)}


def liger() -> object | None:
    """Liger-Kernel's layer_norm module (forward function, backward function), or None where it is not installed."""
    try:
        from liger_kernel.ops import layer_norm
    except ImportError:
        return None
    return layer_norm


def checked(fn: Callable, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, activation: str, what: str) -> None:
    """Fail loudly before timing anything that is wrong."""
    y = fn(x, w, b)
    if (bad := compare(y, layernorm_act_ref(x, w, b, activation=activation), x.dtype)) is not None:
        raise SystemExit(f"{what} is wrong at M={x.shape[0]} H={x.shape[1]} {x.dtype}: {bad}")


def forward_contenders(sets: list, activation: str, torch_fn: Callable, compiled: Callable | None,
                       with_copy: bool, variants: list[str], iters: int) -> list[tuple]:
    """The forward's contenders on one shape's input sets: torch, the copy ceiling (no activation), torch.compile,
    ours, Liger (no activation) and each of our kernel ``variants`` (the slow ones timed 5 times)."""
    contenders: list[tuple] = [("torch", torch_fn, sets)]
    if with_copy and activation == "none":  # the ceiling at this size: a plain copy of the same bytes
        contenders.append(timing.copy_contender("copy", sets))
    if compiled is not None:
        contenders.append(("torch.compile", compiled, sets))
    contenders.append(("ours", lambda x, w, b: L.layernorm(x, w, b, activation=activation), sets))
    if (lg := liger()) is not None and activation == "none":
        contenders.append(("liger", lambda x, w, b: lg.LigerLayerNormFunction.apply(x, w, b, 1e-5), sets))
    for v in variants:
        def variant(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, v: str = v) -> torch.Tensor:
            return L.layernorm_fwd(x, w, b, variant=v, activation=activation)[0]
        contenders.append((f"ours:{v}", variant, sets, iters if v in ("vector", "fast") else 5))
    return contenders


def bench_forward(dtype: torch.dtype, shapes: list[tuple[int, int]], variants: list[str], copy: float,
                  activation: str = "none", with_compile: bool = True, with_copy: bool = True,
                  iters: int = 50) -> list[dict]:
    """Forward (with ``activation``) rows per shape: every contender of ``forward_contenders``, checked against
    the float64 reference first, then timed side by side."""
    act = {"none": lambda t: t, "gelu": F.gelu}[activation]
    kind = "fwd" if activation == "none" else "fwd+gelu"

    def torch_fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return act(F.layer_norm(x, (x.shape[-1],), w, b))

    compiled = torch.compile(torch_fn, dynamic=True) if with_compile else None
    rows = []
    for m, h in shapes:
        sets = input_sets(m, h, dtype)
        contenders = forward_contenders(sets, activation, torch_fn, compiled, with_copy, variants, iters)
        for name, fn, *_ in contenders[1:]:
            if not name.startswith("copy"):
                checked(fn, *sets[0], activation, name)
        times = timing.side_by_side(contenders, iters, kernels=True)
        t_torch, t_comp = times["torch"], times.get("torch.compile")
        nbytes = 2 * m * h * dtype.itemsize
        for name, *_ in contenders:
            rows.append(row(kind, name, dtype, m, h, times[name], nbytes, copy, t_torch,
                            None if name in ("torch", "copy") else t_comp))
        print(" | ".join(f"{r['impl']} {r['pipe_us']}us {r['GBps']}GB/s" for r in rows if (r["M"], r["H"]) == (m, h)),
              flush=True)
        del sets, contenders
    return rows


def bench_strided(dtype: torch.dtype, shapes: list[tuple[int, int]], copy: float, iters: int = 50) -> list[dict]:
    """Forward of a strided x (a transposed view, strides (1, M)) beside a contiguous one, torch and ours, and
    the copies: "copy" of the contiguous x, "copy:strided" of the strided x into a contiguous tensor by torch
    (``x.contiguous()``, a transposing copy, slower than a plain one; ours copies it with its own tiled kernel,
    ``copy_transposed``). So "ours:strided" should cost at most "ours" plus "copy:strided" (issue 34). Rows of
    kind "fwd-strided"; vs_torch is against torch on the contiguous x."""
    def torch_fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), w, b)

    def ours(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return L.layernorm(x, w, b)

    rows = []
    for m, h in shapes:
        sets = input_sets(m, h, dtype)
        strided = [(x.t().contiguous().t(), w, b) for x, w, b in sets]   # the same values, not contiguous
        contenders = [("torch", torch_fn, sets), ("torch:strided", torch_fn, strided), ("ours", ours, sets),
                      ("ours:strided", ours, strided),
                      timing.copy_contender("copy", sets), timing.copy_contender("copy:strided", strided)]
        for name, fn, inputs in contenders:
            if not name.startswith("copy"):
                checked(fn, *inputs[0], "none", name)
        times = timing.side_by_side(contenders, iters, kernels=True)
        for name, *_ in contenders:
            rows.append(row("fwd-strided", name, dtype, m, h, times[name], 2 * m * h * dtype.itemsize, copy,
                            times["torch"]))
        print(" | ".join(f"{r['impl']} {r['pipe_us']}us" for r in rows if (r["M"], r["H"]) == (m, h)), flush=True)
        del sets, strided, contenders
    return rows


def bench_backward(dtype: torch.dtype, shapes: list[tuple[int, int]], copy: float, activation: str = "none",
                   iters: int = 50) -> list[dict]:
    kind = "bwd" if activation == "none" else "bwd+gelu"
    rows = []
    for m, h in shapes:
        sets = [(*s, *L.layernorm_fwd(*s[:3], activation=activation)[1:]) for s in input_sets(m, h, dtype, True)]
        x, w, b, dy, mean, rstd = sets[0]
        got = L.layernorm_bwd(dy, x, w, b, mean, rstd, activation)
        for name, g, r, n in zip(("dx", "dw", "db"), got, layernorm_grads_ref(x, w, b, dy, activation=activation),
                                 (h, m, m), strict=True):
            if (bad := compare(g, r, dtype, reduction=n)) is not None:
                raise SystemExit(f"backward {name} is wrong at M={m} H={h} {dtype}: {bad}")
        nbytes = 3 * m * h * dtype.itemsize
        if activation == "none":
            def torch_fn(x, w, b, dy, mean, rstd):  # torch's own LayerNorm backward kernels
                return torch.ops.aten.native_layer_norm_backward(
                    dy, x, (x.shape[-1],), mean.unsqueeze(-1), rstd.unsqueeze(-1), w, b, [True, True, True])
            baseline = ("torch", torch_fn, sets)
        else:
            baseline = ("torch", *torch_gelu_backward(sets))
        contenders: list[tuple] = [
            baseline,
            ("ours:fast", lambda x, w, b, dy, mean, rstd: L.layernorm_bwd(dy, x, w, b, mean, rstd, activation), sets)]
        if (lg := liger()) is not None and activation == "none":
            stats = {id(s[0]): lg.layer_norm_forward(*s[:3], 1e-5)[2:4] for s in sets}

            def liger_bwd(x, w, b, dy, mean, rstd, stats=stats):
                return lg.layer_norm_backward(dy, x, w, b, *stats[id(x)])
            contenders.append(("liger", liger_bwd, sets))
        times = timing.side_by_side(contenders, iters, kernels=True)
        for name, *_ in contenders:
            rows.append(row(kind, name, dtype, m, h, times[name], nbytes, copy, times["torch"]))
        print(" | ".join(f"{r['kind']} {r['impl']} M={m} H={h} {r['pipe_us']}us {r['GBps']}GB/s"
                         for r in rows if (r["M"], r["H"], r["kind"]) == (m, h, kind)), flush=True)
    return rows


def backward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, dy: torch.Tensor, mean: torch.Tensor,
             rstd: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Our backward from an input set of ``bench_bwd_sweep`` (x, w, b, dy, mean, rstd)."""
    return L.layernorm_bwd(dy, x, w, b, mean, rstd)


def bench_bwd_sweep(dtype: torch.dtype, shapes: list[tuple[int, int]], copy: float, iters: int = 30) -> list[dict]:
    """The backward's launch choices at each shape: each register configuration that holds the row
    at each count of row groups per SM (``config.forced_backward``), checked against the float64
    reference, then timed (CUPTI kernel time of the row-group and column-sum kernels; ``reduce_us``: the
    column sums' share, by torch.profiler). ``default`` marks what ops/layernorm/config.py chooses; GB/s counts
    x, dy read and dx written."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = []
    for m, h in shapes:
        sets = [(*s, *L.layernorm_fwd(*s[:3])[1:]) for s in input_sets(m, h, dtype, True)]
        x, w, b, dy, mean, rstd = sets[0]
        ref = layernorm_grads_ref(x, w, b, dy)
        parts = L.launch.bwd_parts(m, h, dtype, x.device)
        default, seen = (parts, config.bwd_launch(parts, h, dtype, True)), set()
        for per_sm in BWD_SWEEP_PER_SM:
            parts = min(m, per_sm * sms)
            if parts in seen:
                continue
            seen.add(parts)
            for i, (ch, wpr, rpb) in enumerate(config.BWD_REGS):
                try:
                    launch = config.bwd_launch(parts, h, dtype, True, i)
                except ValueError:
                    continue   # it does not hold the row
                with L.config.forced_backward(parts, i):
                    for name, g, r, n in zip(("dx", "dw", "db"), L.layernorm_bwd(dy, x, w, b, mean, rstd), ref,
                                             (h, m, m), strict=True):
                        if (bad := compare(g, r, dtype, reduction=n)) is not None:
                            raise SystemExit(f"backward {name} is wrong at M={m} H={h} {dtype} config {i} parts "
                                             f"{parts}: {bad}")
                    t = timing.measure(backward, sets, iters, kernels=True, pipelined=False)
                    found = timing.kernel_times(functools.partial(backward, *sets[0]), 10)
                reduce_us = sum(us for name, (_, us) in found.items() if "ln_bwd_reduc" in name)  # names cut short
                gbps = 3 * m * h * dtype.itemsize / t.kernel_us / 1e3
                out.append({"dtype": str(dtype).removeprefix("torch."), "M": m, "H": h, "per_sm": per_sm,
                            "parts": parts, "config": i, "ch": ch, "wpr": wpr, "rpb": rpb, "blocks": launch.grid[0],
                            "threads": launch.block, "default": (parts, launch) == default,
                            "us": round(t.device_us, 2), "kernel_us": round(t.kernel_us, 2),
                            "reduce_us": round(reduce_us, 2), "GBps": round(gbps, 1),
                            "pct_copy": round(100 * gbps / copy, 1)})
                print(" ".join(f"{k}={v}" for k, v in out[-1].items()), flush=True)
    return out


def torch_gelu_backward(sets: list[tuple[torch.Tensor, ...]]) -> tuple[Callable, list[tuple]]:
    """torch autograd's backward through F.gelu(F.layer_norm(x)): the call and its prepared graphs."""
    graphs = []
    for x, w, b, dy, _, _ in sets:
        xs, ws, bs = (t.detach().requires_grad_() for t in (x, w, b))
        graphs.append((F.gelu(F.layer_norm(xs, (xs.shape[-1],), ws, bs)), xs, ws, bs, dy))

    def run(y, xs, ws, bs, dy):
        return torch.autograd.grad(y, (xs, ws, bs), dy, retain_graph=True)
    return run, graphs


def write(rows: list[dict], copy: float, kept: str = "") -> None:
    """The bench_layernorm table (results/layernorm.{csv,md}); ``kept``: ``kept_stamp`` of the run whose rows were
    kept."""
    stamp = f"GPU: {reports.gpu_name()}; commit {reports.commit()}; device copy {copy:.0f} GB/s (read+write){kept}"
    reports.write_report(
        OUT / "bench_layernorm", rows, FIELDS, stamp, "LayerNorm benchmark (scripts/bench_layernorm.py)",
        "pipe_us: pipelined time per call, the headline (back-to-back calls with their allocations, one "
        "synchronisation, divided; median of 5 runs); pipe_vs_torch divides by torch eager's; host_us: "
        "the host's time per call in the same runs (until the last call returned). ours: the public layernorm; "
        "ours:<variant>: layernorm_fwd of that "
        "kernel variant; liger: Liger-Kernel. Device time per call (CUDA events, median, inputs rotated past "
        "L2). GB/s counts x read + y write "
        "(backward: x, dy read + dx write). vs_torch < 1 is faster than torch eager. impl `copy` is torch's "
        "device copy of the same tensor (x read + y write), the ceiling at that size. kernel_*: the same "
        "call's kernels alone, by CUPTI (torch.profiler; median over as many calls, each call's busy time "
        "on the device), without the launch gaps and the stream hop that the events include; "
        "kernel_vs_torch divides by torch's kernel time.")


def plot() -> None:
    """GB/s of torch vs ours per forward shape, one panel per dtype, from the committed CSV."""
    reports.plot_forward("bench_layernorm", "LayerNorm forward", "GBps",
                        "GB/s (x read + y write)", ("M", "H"), "{}x{}",
                        ("copy", "torch", "torch.compile", "liger", "ours"))


def main() -> int:
    args = reports.bench_args(__doc__, "targets, progression and backward only", "float32,bfloat16",
                             ("--bwd-sweep", "sweep the backward's row groups and register configurations instead"))
    if (status := reports.run_without_gpu(args, plot, "bench_layernorm")) is not None:
        return status
    copy = copy_gbps()
    print(f"{reports.gpu_name()}: device copy {copy:.0f} GB/s", flush=True)
    rows: list[dict] = []
    if args.bwd_sweep:
        rows = [r for d in args.dtypes.split(",") for r in bench_bwd_sweep(getattr(torch, d), list(BWD_SWEEP_SHAPES),
                                                                           copy)]
        reports.write_report(OUT / "bench_layernorm_bwd_sweep", rows, SWEEP_FIELDS,
                            f"GPU: {reports.gpu_name()}; commit {reports.commit()}; device copy {copy:.0f} GB/s",
                            "LayerNorm backward launch sweep (scripts/bench_layernorm.py --bwd-sweep)",
                            bench_bwd_sweep.__doc__.replace("\n    ", " "))
        return 0
    if args.shape:   # a quick look at one shape: forward and backward, printed
        shape = reports.parse_shape(args.shape, 2)
        for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
            rows += bench_forward(dtype, [shape], ["fast"], copy, with_compile=not args.no_compile)
            rows += bench_backward(dtype, [shape], copy)
        reports.print_rows(rows, FIELDS)
        return 0
    fast = ["fast"] if args.quick else ["vector", "fast"]
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        grid = list(TARGETS) if args.quick else [(m, h) for m in GRID_M for h in GRID_H]
        rows += bench_forward(dtype, grid, fast, copy, with_compile=not args.no_compile)
        rows += bench_forward(dtype, list(PROGRESSION), list(L.VARIANTS)[:3], copy, with_compile=False,
                              with_copy=False)  # the grid above timed the copy at these shapes
        rows += bench_forward(dtype, list(LONG_ROWS), ["vector", "fast"], copy, with_compile=False)
        rows += bench_backward(dtype, list(BWD_SHAPES), copy)
        rows += bench_strided(dtype, list(PROGRESSION), copy)
        rows += bench_forward(dtype, list(GELU_SHAPES), ["fast"], copy, "gelu", with_compile=not args.no_compile)
        rows += bench_backward(dtype, list(GELU_SHAPES), copy, "gelu")
    kept = ""
    if args.append:  # keep the other dtypes' rows of an earlier run (one device call per dtype)
        rows, kept = reports.appended("bench_layernorm", args.dtypes, rows)
    write(rows, copy, kept)
    reports.save_plot(plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
