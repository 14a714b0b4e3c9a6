"""The Hopper kernel (layernorm_linear algo "sm90") beside torch, our default and cuBLAS alone, bfloat16.

Each shape is first checked against the float64 reference (rows of mean 0 and of mean 1e4), then every
contender is timed side by side: CUPTI kernel time and CUDA-event device time (median of 100 calls after
warm-up, x rotated over 4 inputs), TF32 off. "cublas" is F.linear on x alone (no LayerNorm): the floor
a fused kernel has to approach. Writes results/bench_layernorm_linear_sm90.{csv,md}.

    poe bench-layernorm-linear-sm90      (needs an sm_90 GPU)
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ops import layernorm_linear as LL  # noqa: E402
from ops.reference import layernorm_linear_ref  # noqa: E402
from ops.timing import commit, gpu_name, measure, write_report  # noqa: E402
from ops.tolerance import compare  # noqa: E402

SHAPES = [(4096, 768, 3072), (16384, 768, 3072), (4096, 1024, 4096), (4096, 4096, 4096)]
FIELDS = ["M", "K", "N", "contender", "kernel_us", "device_us", "host_us", "kernel_vs_torch", "max_err",
          "torch_max_err"]


def inputs(m: int, k: int, n: int, mean: float = 0.0, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """x [m, k] (rows shifted by mean), ln_weight, ln_bias [k], weight [n, k], bias [n]: bfloat16 on the GPU."""
    g = torch.Generator().manual_seed(seed)
    f64 = {"generator": g, "dtype": torch.float64}
    ts = (torch.randn(m, k, **f64) + mean, 1.0 + 0.2 * torch.randn(k, **f64), 0.2 * torch.randn(k, **f64),
          torch.randn(n, k, **f64) / k ** 0.5, 0.2 * torch.randn(n, **f64))
    return tuple(t.to("cuda", torch.bfloat16) for t in ts)


def checked(m: int, k: int, n: int, mean: float) -> tuple[float, float]:
    """Max |error| of sm90 and of torch against float64; raises when sm90 is outside the tolerance table."""
    x, g, b, w, bias = inputs(m, k, n, mean, seed=7)
    y = LL.layernorm_linear_fwd(x, g, b, w, bias, algo="sm90")[0]
    ref = layernorm_linear_ref(x, g, b, w, bias)
    bad = compare(y, ref, torch.bfloat16, reduction=k, cond=max(1.0, mean))
    if bad is not None:
        raise SystemExit(f"sm90 wrong at {m}x{k}->{n}, mean {mean}: {bad}")
    yt = F.linear(F.layer_norm(x, (k,), g, b), w, bias)
    return float((y.double() - ref).abs().max()), float((yt.double() - ref).abs().max())


def bench(m: int, k: int, n: int) -> list[dict]:
    sets = [inputs(m, k, n, seed=i) for i in range(4)]
    _, g, b, w, bias = sets[0]
    xs = [(s[0],) for s in sets]
    contenders = {
        "torch": lambda x: F.linear(F.layer_norm(x, (k,), g, b), w, bias),
        "ours auto": lambda x: LL.layernorm_linear_fwd(x, g, b, w, bias, algo="auto")[0],
        "ours sm90": lambda x: LL.layernorm_linear_fwd(x, g, b, w, bias, algo="sm90")[0],
        "cublas alone": lambda x: F.linear(x, w, bias),
    }
    times = {name: measure(fn, xs, iters=100, warmup=10, kernels=True) for name, fn in contenders.items()}
    err, err_torch = checked(m, k, n, 0.0)
    rows = []
    for name, t in times.items():
        rows.append({"M": m, "K": k, "N": n, "contender": name, "kernel_us": f"{t.kernel_us:.1f}",
                     "device_us": f"{t.device_us:.1f}", "host_us": f"{t.host_us:.1f}",
                     "kernel_vs_torch": f"{t.kernel_us / times['torch'].kernel_us:.3f}",
                     "max_err": f"{err:.3g}" if name == "ours sm90" else None,
                     "torch_max_err": f"{err_torch:.3g}" if name == "ours sm90" else None})
        print(" | ".join(str(v) for v in rows[-1].values()), flush=True)
    return rows


def main() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit("bench_layernorm_linear_sm90: needs an sm_90 GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    for m, k, n in [(37, 200, 264), (1000, 768, 3072)]:
        for mean in (0.0, 1e4):
            checked(m, k, n, mean)
    rows = [r for shape in SHAPES for r in bench(*shape)]
    stamp = f"{gpu_name()}, commit {commit()}, bfloat16, torch {torch.__version__}"
    note = ("CUPTI kernel time and CUDA-event device time in us (medians of 100 calls); max_err: sm90's and "
            "torch's largest |error| against float64 at mean 0.")
    write_report(ROOT / "results" / "bench_layernorm_linear_sm90", rows, FIELDS, stamp,
                 "LayerNorm + Linear: the Hopper kernel (algo sm90)", note)


if __name__ == "__main__":
    main()
