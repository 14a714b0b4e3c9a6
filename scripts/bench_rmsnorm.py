"""RMSNorm on the GPU: ours vs torch eager, torch.compile and Liger-Kernel, forward, backward and a training step.

Per row, the headline first: pipelined time per call (back-to-back calls with their allocations, one
synchronisation, divided; median of repeats), its ratio to torch eager's, and host time per call; then device time
(CUDA events, median, inputs rotated past the L2 cache), GB/s counting each tensor read or written once (forward: x
read, y written; backward: x and dy read, dx written; a training step: both), % of the measured device copy, and the
kernels' own time by CUPTI. Contenders: "torch" is ``F.rms_norm`` (torch's semantics), "torch.compile" the same
compiled, "ours" our ``rms_norm`` (torch's semantics), "ours:llama" ours with Hugging Face Llama's semantics, "liger"
Liger-Kernel's ``LigerRMSNormFunction`` (its default, Llama's casting; timed where it is installed), "torch:again" a
second copy of torch's call (the noise of the ratios), "copy" torch's copy of x (the ceiling), "floor" (training rows)
x * w through ``torch.autograd.grad``, the cheapest call with the same two gradients (what the autograd engine costs
any such op per call: a training step's floor). Backward and training rows take the gradients through each
contender's autograd (``torch.autograd.grad``). Every contender but "copy" and "floor" is checked against the float64
reference of its semantics first. Rows of kind "add+rms_norm" and "add+layer_norm" time a
pre-norm block's add and norm, s = x + r and y = norm(s), both returned (torch: the add, then the norm; ours:
add_rms_norm / add_layer_norm; Liger's fused add and RMSNorm), GB/s counting x and r read, s and y written.
Writes results/rmsnorm.{csv,md} (table bench_rmsnorm). With ``--linear``: Linear(RMSNorm(x)) instead, table
bench_rmsnorm_linear (``linear_doc``).

    python scripts/bench_rmsnorm.py                     (needs a CUDA GPU)
    python scripts/bench_rmsnorm.py --quick             (the issue's shapes only)
    python scripts/bench_rmsnorm.py --shape 4096x768    (one M x H, printed, nothing written)
    python scripts/bench_rmsnorm.py --sweep --dtypes bfloat16   (the forward's configurations at long rows)
    python scripts/bench_rmsnorm.py --add-only --dtypes bfloat16   (the add+norm rows again, the rest kept)
    python scripts/bench_rmsnorm.py --linear --dtypes bfloat16     (RMSNorm+Linear: table bench_rmsnorm_linear)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import bench_layernorm_linear as lnl_bench  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_layernorm import ROTATE_BYTES, copy_gbps, row  # noqa: E402

from ops.bench import reports, timing  # noqa: E402
from ops.layernorm import add_layer_norm  # noqa: E402
from ops.reference import (  # noqa: E402
    layernorm_ref,
    rmsnorm_grads_ref,
    rmsnorm_linear_grads_ref,
    rmsnorm_linear_ref,
    rmsnorm_ref,
)
from ops.rmsnorm import add_rms_norm, rms_norm, rms_norm_linear  # noqa: E402
from ops.tolerance import compare  # noqa: E402

OUT = ROOT / "results"
EPS = 1e-6
FWD_SHAPES = ((4096, 768), (16384, 4096), (1, 4096), (32, 4096), (4096, 4096), (4096, 8192), (65536, 4096),
              (1024, 16384))
BWD_SHAPES = ((4096, 768), (16384, 4096), (4096, 4096))
TRAIN_SHAPES = ((4, 768), (128, 768), (4096, 768), (4, 4096), (128, 4096), (4096, 4096))
QUICK = ((4096, 768), (16384, 4096))   # the issue's
ADD_NORMS = ("rms_norm", "layer_norm")
FIELDS = ("kind", "impl", "dtype", "M", "H", "pipe_us", "pipe_vs_torch", "pipe_runs", "pipe_spread", "host_us", "us",
          "GBps", "pct_copy", "vs_torch", "kernel_us", "kernel_GBps", "kernel_vs_torch")
BYTES_PER_ELEMENT = {"fwd": 2, "bwd": 3, "train": 5}   # tensors of [M, H] each kind reads or writes once


def liger() -> Callable | None:
    """Liger-Kernel's RMSNorm (x, w, eps) -> y with its autograd (dY not overwritten), or None where not installed."""
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        return None
    return lambda x, w, eps: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)


def contenders() -> dict[str, tuple[Callable, str]]:
    """Each contender's call (x, w) -> y and the semantics it computes."""
    compiled = torch.compile(lambda x, w: F.rms_norm(x, x.shape[-1:], w, EPS), dynamic=True)
    calls = {"torch": (lambda x, w: F.rms_norm(x, x.shape[-1:], w, EPS), "torch"),
             "torch:again": (lambda x, w: F.rms_norm(x, x.shape[-1:], w, EPS), "torch"),
             "torch.compile": (compiled, "torch"),
             "ours": (lambda x, w: rms_norm(x, x.shape[-1:], w, EPS), "torch"),
             "ours:llama": (lambda x, w: rms_norm(x, x.shape[-1:], w, EPS, semantics="llama"), "llama")}
    if (lg := liger()) is not None:
        calls["liger"] = (lambda x, w: lg(x, w, EPS), "llama")
    return calls


def add_contenders(norm: str) -> dict[str, tuple[Callable, str]]:
    """A pre-norm block's add and ``norm`` ("rms_norm" or "layer_norm"): each contender's call (x, r, w) -> (y, s)
    and the semantics its y has; torch's is the add, then the norm (also compiled)."""
    def torch_fn(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = x + r
        if norm == "rms_norm":
            return F.rms_norm(s, s.shape[-1:], w, EPS), s
        return F.layer_norm(s, s.shape[-1:], w, None, EPS), s

    compiled = torch.compile(torch_fn, dynamic=True)
    ours = ((lambda x, r, w: add_rms_norm(x, r, w, EPS)) if norm == "rms_norm"
            else (lambda x, r, w: add_layer_norm(x, r, w, None, EPS)))
    calls = {"torch": (torch_fn, "torch"), "torch:again": (torch_fn, "torch"), "torch.compile": (compiled, "torch"),
             "ours": (ours, "torch")}
    if norm == "rms_norm" and (lg := liger_add()) is not None:
        calls["liger"] = (lambda x, r, w: lg(x, r, w, EPS), "llama")
    return calls


def liger_add() -> Callable | None:
    """Liger-Kernel's fused add and RMSNorm (x, r, w, eps) -> (y, s), or None where it is not installed."""
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    except ImportError:
        return None
    return lambda x, r, w, eps: LigerFusedAddRMSNormFunction.apply(x, r, w, eps, 0.0, "llama", False)


def bench_add(norm: str, dtype: torch.dtype, shapes: tuple[tuple[int, int], ...], copy: float) -> list[dict]:
    """Forward rows of kind "add+<norm>" per shape: s = x + r and y = norm(s), both returned (x, r read; s, y
    written), every contender checked (s exactly x + r as torch rounds it; y against float64 of that s), then
    timed side by side."""
    rows = []
    for m, h in shapes:
        sets = [(x, torch.randn_like(x), w) for x, w, _ in input_sets(m, h, dtype, grad=False)]
        for name, (fn, semantics) in add_contenders(norm).items():
            x, r, w = sets[0]
            y, s = fn(x, r, w)
            want = (layernorm_ref(s, w, torch.zeros_like(w), EPS) if norm == "layer_norm"
                    else rmsnorm_ref(s, w, EPS, semantics))
            exact, bad = torch.equal(s, x + r), compare(y, want, dtype)
            if not exact or bad is not None:
                raise SystemExit(f"add+{norm} {name} is wrong at {m}x{h} {dtype}: s exact {exact}, y {bad}")
        entrants = [(name, fn, sets) for name, (fn, _) in add_contenders(norm).items()]
        rows += timed_rows(f"add+{norm}", dtype, m, h, entrants, 4 * m * h * dtype.itemsize, copy)
        del sets, entrants
    return rows


def input_sets(m: int, h: int, dtype: torch.dtype, grad: bool) -> list[tuple[torch.Tensor, ...]]:
    """Enough fresh (x, w, dy) sets that cycling through them defeats the L2 cache; x and w want gradients for the
    backward and training kinds."""
    n = max(2, min(32, -(-ROTATE_BYTES // (2 * m * h * dtype.itemsize))))
    sets = []
    for _ in range(n):
        x = torch.randn(m, h, device="cuda", dtype=dtype).requires_grad_(grad)
        w = (1 + 0.1 * torch.randn(h, device="cuda")).to(dtype).requires_grad_(grad)
        sets.append((x, w, torch.randn_like(x)))
    return sets


def checked(name: str, fn: Callable, semantics: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> None:
    """Fail loudly before timing a contender whose output (or, with gradients, dx and dw) is wrong."""
    y = fn(x, w)
    problems = [compare(y, rmsnorm_ref(x, w, EPS, semantics), x.dtype)]
    if x.requires_grad:
        dx, dw = torch.autograd.grad(y, (x, w), dy)
        want_dx, want_dw = rmsnorm_grads_ref(x, w, dy, EPS, semantics)
        problems += [compare(dx, want_dx, x.dtype, reduction=x.shape[-1]),
                     compare(dw, want_dw, x.dtype, reduction=x.shape[0])]
    if any(p is not None for p in problems):
        raise SystemExit(f"{name} is wrong at {tuple(x.shape)} {x.dtype}: {[p for p in problems if p]}")


def timed_call(kind: str, fn: Callable) -> Callable:
    """The call a row of ``kind`` times on an input set (x, w, dy): the forward; the backward of a forward made once
    per set (its graph kept); or a training step, forward and backward."""
    if kind == "fwd":
        return lambda x, w, dy: fn(x, w)
    if kind == "train":
        return lambda x, w, dy: torch.autograd.grad(fn(x, w), (x, w), dy)
    graphs: dict[int, torch.Tensor] = {}

    def backward(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> tuple:
        y = graphs.get(id(x))
        if y is None:
            y = graphs[id(x)] = fn(x, w)
        return torch.autograd.grad(y, (x, w), dy, retain_graph=True)
    return backward


def bench(kind: str, dtype: torch.dtype, shapes: tuple[tuple[int, int], ...], copy: float) -> list[dict]:
    """Rows of ``kind`` per shape: every contender checked, then timed side by side."""
    calls = contenders()
    if kind != "fwd":
        del calls["torch.compile"]   # its backward recompiles per graph: timed where it matters, the forward
    rows = []
    for m, h in shapes:
        sets = input_sets(m, h, dtype, grad=kind != "fwd")
        for name, (fn, semantics) in calls.items():
            checked(name, fn, semantics, *sets[0])
        entrants = [(name, timed_call(kind, fn), sets) for name, (fn, _) in calls.items()]
        if kind == "fwd":
            entrants.append(timing.copy_contender("copy", [(x.detach(),) for x, _, _ in sets]))
        if kind == "train":
            entrants.append(("floor", timed_call(kind, lambda x, w: x * w), sets))
        rows += timed_rows(kind, dtype, m, h, entrants, BYTES_PER_ELEMENT[kind] * m * h * dtype.itemsize, copy)
        del sets, entrants
    return rows


def timed_rows(kind: str, dtype: torch.dtype, m: int, h: int, entrants: list[tuple], nbytes: int,
               copy: float) -> list[dict]:
    """The contenders of one shape timed side by side, as rows (ratios to "torch"); ``nbytes``: what the call must
    move."""
    times = timing.side_by_side(entrants, kernels=True)
    rows = [row(kind, name, dtype, m, h, times[name], nbytes, copy, times["torch"]) for name, *_ in entrants]
    print(f"{kind} {dtype} {m}x{h}: " + " | ".join(f"{r['impl']} {r['pipe_us']}us pipe, {r['us']}us dev" for r in rows),
          flush=True)
    return rows


# M, K, N: the two, then more with M >= 1024 (a Llama MLP's 4096 -> 14336 among them) and one small M
LINEAR_SHAPES = ((4096, 4096, 4096), (4096, 2048, 8192), (1024, 4096, 4096), (4096, 768, 3072), (16384, 4096, 4096),
                 (4096, 4096, 14336), (16, 4096, 4096))


def linear_doc() -> str:
    """Rows of table bench_rmsnorm_linear: Linear(RMSNorm(x)) (torch's semantics), the forward (kind fwd: no gradient
    to come) and a training step (kind train: forward from leaves that need gradients, then all four gradients through
    each contender's autograd). Contenders: "torch" F.linear(F.rms_norm(x)), "torch:again" the same call again (the
    noise of the ratios), "torch.compile" the pair compiled (forward), "ours" ``rms_norm_linear`` (what
    ``FusedRMSNormLinear`` runs). Liger-Kernel has no RMSNorm+Linear op. Columns as bench_layernorm_linear's:
    pipelined time per call first (its ratio to torch's), host time, device time, TFLOP/s (2*M*N*K per forward), the
    memory a call allocates at its peak, CUPTI kernel time. Every contender is checked against float64 first (the
    training step's four gradients too). TF32 off."""
    return linear_doc.__doc__.replace("\n    ", " ")


def torch_rms_linear(x, g, b, w, bias, dy=None):
    return F.linear(F.rms_norm(x, x.shape[-1:], g, EPS), w, bias)


def ours_rms_linear(x, g, b, w, bias, dy=None):
    return rms_norm_linear(x, g, w, bias, EPS)


def bench_linear(dtype: torch.dtype, shapes: tuple[tuple[int, int, int], ...]) -> list[dict]:
    """bench_rmsnorm_linear's rows (``linear_doc``) per M, K, N."""
    compiled = torch.compile(torch_rms_linear, dynamic=True)
    fwd = {"torch": torch_rms_linear, "torch:again": torch_rms_linear, "torch.compile": compiled,
           "ours": ours_rms_linear}
    rows = []
    for m, k, n in shapes:
        sets = lnl_bench.input_sets(m, k, n, dtype)
        x, g, _, w, bias, dy = sets[0]
        want = rmsnorm_linear_ref(x, g, w, bias, EPS)
        for name, fn in fwd.items():
            if (bad := compare(fn(*sets[0]), want, dtype, reduction=k)) is not None:
                raise SystemExit(f"rms_norm+linear {name} is wrong at {m}x{k}x{n} {dtype}: {bad}")
        iters = lnl_bench.iters_for(m, k, n)
        times = timing.side_by_side([(name, fn, sets) for name, fn in fwd.items()], iters, kernels=True)
        rows += [lnl_bench.row("fwd", name, sets[0], times[name], times["torch"], lnl_bench.peak_mb(fn, sets[0]))
                 for name, fn in fwd.items()]
        steps = {name: train_step(fn) for name, fn in fwd.items() if name != "torch.compile"}
        plain = [tuple(t.detach() for t in s) for s in sets[:4]]
        want_grads = rmsnorm_linear_grads_ref(x, g, w, bias, dy, EPS)
        for name, step in steps.items():
            for what, got, ref in zip(("dx", "dnorm_weight", "dweight", "dbias"), step(*plain[0]), want_grads,
                                      strict=True):
                if (bad := compare(got, ref, dtype, reduction=max(m, n * k), cond=10.0)) is not None:
                    raise SystemExit(f"rms_norm+linear {name} {what} is wrong at {m}x{k}x{n} {dtype}: {bad}")
        times = timing.side_by_side([(name, fn, plain) for name, fn in steps.items()], iters, kernels=True)
        rows += [lnl_bench.row("train", name, plain[0], times[name], times["torch"], lnl_bench.peak_mb(fn, plain[0]))
                 for name, fn in steps.items()]
        print(f"rms_norm+linear {dtype} {m}x{k}x{n}: " + " | ".join(f"{r['kind']} {r['impl']} {r['pipe_us']}us"
                                                                   for r in rows[-7:]), flush=True)
        del sets, plain
    return rows


def train_step(fn: Callable) -> Callable:
    """A training step of ``fn`` (x, g, b, w, bias, dy): the forward from leaves that need gradients (b unused), then
    the gradients of x, g, w and bias."""
    def run(x, g, b, w, bias, dy):
        leaves = tuple(t.requires_grad_() for t in (x, g, w, bias))
        return torch.autograd.grad(fn(x, g, b, w, bias), leaves, dy)
    return run


SWEEP_SHAPES = ((4096, 4096), (16384, 4096), (4096, 8192), (1024, 16384), (256, 32768))
SWEEP_FIELDS = ("dtype", "M", "H", "config", "kernel", "params", "default", "us", "kernel_us", "GBps", "pct_copy")


def sweep_launches(m: int, h: int, dtype: torch.dtype) -> list[tuple[int, object]]:
    """(i, launch) of each forward configuration ``config:<i>`` that holds a row of h (the others fall back)."""
    from ops.layernorm import config as ln_config

    nv = h // ln_config.VECTOR_WIDTH[dtype]
    return [(i, ln_config.fwd_launch(m, h, dtype, True, f"config:{i}"))
            for i in range(len(ln_config.FWD_REGS) + len(ln_config.FWD_CLUSTERS)) if ln_config.fwd_capacity(i) >= nv]


def sweep_specs() -> list[object]:
    """The sweep's kernel instantiations, to build ahead on a machine without a GPU."""
    from ops.rmsnorm.config import SEMANTICS

    return [launch.spec(dtype, SEMANTICS["torch"]) for dtype in (torch.bfloat16, torch.float32)
            for m, h in SWEEP_SHAPES for _, launch in sweep_launches(m, h, dtype)]


def bench_sweep(dtype: torch.dtype, copy: float, shapes: tuple[tuple[int, int], ...] = SWEEP_SHAPES) -> list[dict]:
    """The forward's launch choices at long rows: every register and cluster configuration that holds the row
    (LayerNorm's ``config:<i>`` variants, run with RMSNorm's code), checked against float64, then timed (device and
    kernel time); ``default`` marks what ops/layernorm/config.py picks."""
    from ops.layernorm import config as ln_config
    from ops.layernorm.launch import fwd_direct
    from ops.rmsnorm.config import SEMANTICS

    out = []
    for m, h in shapes:
        sets = [(x, w) for x, w, _ in input_sets(m, h, dtype, grad=False)]
        default = ln_config.fwd_launch(m, h, dtype, True, act=SEMANTICS["torch"])
        for i, launch in sweep_launches(m, h, dtype):
            def call(x: torch.Tensor, w: torch.Tensor, i: int = i) -> torch.Tensor:
                return fwd_direct(x, w, w, EPS, f"config:{i}", SEMANTICS["torch"])
            if (bad := compare(call(*sets[0]), rmsnorm_ref(*sets[0], EPS), dtype)) is not None:
                raise SystemExit(f"config {i} is wrong at {m}x{h} {dtype}: {bad}")
            t = timing.measure(call, sets, 30, kernels=True, pipelined=False)
            gbps = 2 * m * h * dtype.itemsize / t.device_us / 1e3
            out.append({"dtype": str(dtype).removeprefix("torch."), "M": m, "H": h, "config": i,
                        "kernel": launch.kernel, "params": "x".join(map(str, launch.params)),
                        "default": launch == default, "us": round(t.device_us, 2), "kernel_us": round(t.kernel_us, 2),
                        "GBps": round(gbps, 1), "pct_copy": round(100 * gbps / copy, 1)})
            print(" ".join(f"{k}={v}" for k, v in out[-1].items()), flush=True)
    return out


def main() -> int:
    args = reports.bench_args(__doc__, "the issue's shapes only", "bfloat16,float32",
                              ("--sweep", "time every forward configuration at long rows instead"),
                              ("--add-only", "only the add+norm rows, kept beside the table's rows of other kinds"),
                              ("--linear", "time Linear(RMSNorm(x)) instead (table bench_rmsnorm_linear)"))
    if (status := reports.run_without_gpu(args, lambda: None, "bench_rmsnorm")) is not None:
        return status
    copy = copy_gbps()
    print(f"{reports.gpu_name()}: device copy {copy:.0f} GB/s", flush=True)
    rows: list[dict] = []
    if args.sweep:
        shapes = (reports.parse_shape(args.shape, 2),) if args.shape else SWEEP_SHAPES
        rows = [r for d in args.dtypes.split(",") for r in bench_sweep(getattr(torch, d), copy, shapes)]
        if args.shape:   # one shape's sweep: printed, the table kept
            reports.print_rows(rows, SWEEP_FIELDS)
            return 0
        reports.write_report(OUT / "bench_rmsnorm_fwd_sweep", rows, SWEEP_FIELDS,
                             f"GPU: {reports.gpu_name()}; commit {reports.commit()}; device copy {copy:.0f} GB/s",
                             "RMSNorm forward launch sweep (scripts/bench_rmsnorm.py --sweep)",
                             bench_sweep.__doc__.replace("\n    ", " "))
        return 0
    if args.linear:
        torch.backends.cuda.matmul.allow_tf32 = False
        shapes = (reports.parse_shape(args.shape, 3),) if args.shape else LINEAR_SHAPES[:2] if args.quick \
            else LINEAR_SHAPES
        rows = [r for d in args.dtypes.split(",") for r in bench_linear(getattr(torch, d), shapes)]
        if args.shape:
            reports.print_rows(rows, lnl_bench.FIELDS)
            return 0
        reports.write_report(OUT / "bench_rmsnorm_linear", rows, lnl_bench.FIELDS,
                             f"GPU: {reports.gpu_name()}; commit {reports.commit()}; TF32 off",
                             "RMSNorm + Linear benchmark (scripts/bench_rmsnorm.py --linear)", linear_doc())
        return 0
    kept = ""
    if args.add_only:
        rows = [r for d in args.dtypes.split(",") for norm in ADD_NORMS for r in bench_add(norm, getattr(torch, d),
                                                                                             QUICK, copy)]
        rows, kept = reports.appended("bench_rmsnorm", ",".join(f"add+{n}" for n in ADD_NORMS), rows, "kind")
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",") if not args.add_only):
        if args.shape:
            shape = (reports.parse_shape(args.shape, 2),)
            rows += [r for kind in ("fwd", "bwd", "train") for r in bench(kind, dtype, shape, copy)]
            continue
        rows += bench("fwd", dtype, QUICK if args.quick else FWD_SHAPES, copy)
        rows += bench("bwd", dtype, QUICK if args.quick else BWD_SHAPES, copy)
        rows += bench("train", dtype, TRAIN_SHAPES, copy)
        for norm in ADD_NORMS:
            rows += bench_add(norm, dtype, QUICK, copy)
    if args.shape:
        reports.print_rows(rows, FIELDS)
        return 0
    stamp = f"GPU: {reports.gpu_name()}; commit {reports.commit()}; device copy {copy:.0f} GB/s (read+write){kept}"
    reports.write_report(OUT / "bench_rmsnorm", rows, FIELDS, stamp, "RMSNorm benchmark (scripts/bench_rmsnorm.py)",
                         __doc__.split("\n\n")[1].replace("\n", " "))
    return 0


if __name__ == "__main__":
    sys.exit(main())
