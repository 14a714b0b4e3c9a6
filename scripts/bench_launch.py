"""How our LayerNorm forward reaches the GPU, and what each way costs per call (the design note's evidence).

Contenders, bf16, at a launch-bound and a bandwidth-bound shape: torch's ``F.layer_norm`` and
``nn.LayerNorm``; the same Mojo kernel launched raw (outputs preallocated, no checks) through
cuda-bindings' ``cuLaunchKernel`` with a packed argument buffer and through ``cuda.core.launch``; our
validated call (``layernorm_fwd``: checks, allocation, launch), the same behind the ``torch.library``
custom op, and our ``LayerNorm`` module; and, where MAX is installed, the MAX graph route. Per call:
pipelined time (back-to-back calls, one sync, divided), host time and device time (ops/bench/timing.py).
Writes results/host.{csv,md} (table bench_launch).

    python scripts/bench_launch.py      (needs a CUDA GPU; MAX only for the graph route's rows)
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ops import layernorm as L  # noqa: E402
from ops.bench.reports import commit, gpu_name, write_report  # noqa: E402
from ops.bench.timing import measure  # noqa: E402
from ops.launch import direct  # noqa: E402

SHAPES = ((4, 768), (4096, 768), (16384, 4096))
FIELDS = ("M", "H", "impl", "pipelined_us", "host_us", "device_us", "vs_torch")


def contenders(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> dict[str, object]:
    """name -> a zero-argument call (each allocates what it returns, except the raw launches)."""
    from cuda.core import LaunchConfig, Stream, launch

    rows, h = x.shape
    launch_cfg = L.launch.fwd_launch(x, w, b, "fast")
    kernel = direct.kernel(launch_cfg.spec(x.dtype, 0), 0)
    y = torch.empty_like(x)
    mean, rstd = torch.empty(2, rows, device=x.device).unbind(0)
    args = (y.data_ptr(), mean.data_ptr(), rstd.data_ptr(), x.data_ptr(), w.data_ptr(), b.data_ptr(), rows, h, 1e-5)
    cfg = LaunchConfig(grid=launch_cfg.grid, block=launch_cfg.block)
    import numpy as np
    core_args = (*args[:6], np.int32(rows), np.int32(h), np.float32(1e-5))
    ln_t = torch.nn.LayerNorm(h, device=x.device, dtype=x.dtype)
    ln_o = L.LayerNorm.from_torch(ln_t)
    calls = {
        "torch:F.layer_norm": lambda: F.layer_norm(x, (h,), w, b, 1e-5),
        "raw:cuda-bindings": lambda: kernel.launch(direct.current_stream(0), launch_cfg.grid, launch_cfg.block, 0,
                                                   *args),
        "raw:cuda-core": lambda: launch(Stream.from_handle(direct.current_stream(0)), cfg, kernel.kernel,
                                        *core_args),
        "ours:layernorm_fwd": lambda: L.layernorm_fwd(x, w, b),
        "ours:custom_op": lambda: torch.ops.mojo.layernorm_fwd(x, w, b, 1e-5, "fast", "none"),
        "torch:nn.LayerNorm": lambda: ln_t(x),
        "ours:LayerNorm": lambda: ln_o(x),
    }
    if importlib.util.find_spec("max") is not None:
        def graph() -> object:
            direct.ROUTE = "graph"
            try:
                return L.layernorm_fwd(x, w, b)
            finally:
                direct.ROUTE = "direct"
        calls["ours:graph_route"] = graph
    return calls


def main() -> None:
    rows_out = []
    for m, h in SHAPES:
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        w = (1 + 0.1 * torch.randn(h, device="cuda")).bfloat16()
        b = (0.1 * torch.randn(h, device="cuda")).bfloat16()
        ref = F.layer_norm(x.float(), (h,), w.float(), b.float(), 1e-5)
        got = L.layernorm_fwd(x, w, b)[0].float()
        err = (got - ref).abs().max().item()
        assert err < 0.05, f"ours is wrong at {m}x{h}: max error {err}"
        base = None
        for name, fn in contenders(x, w, b).items():
            t = measure(lambda _, fn=fn: fn(), [(x,)], iters=100)
            base = t.pipelined_us if name == "torch:F.layer_norm" else base
            ratio = t.pipelined_us / base if base else None
            rows_out.append({"M": m, "H": h, "impl": name, "pipelined_us": round(t.pipelined_us, 2),
                             "host_us": round(t.host_us, 2), "device_us": round(t.device_us, 2),
                             "vs_torch": None if ratio is None else round(ratio, 3)})
            print(f"{m:>6}x{h:<5} {name:22} pipelined {t.pipelined_us:8.2f}  host {t.host_us:7.2f}  "
                  f"device {t.device_us:7.2f} us", flush=True)
    stamp = f"GPU: {gpu_name()}; commit {commit()}; torch {torch.__version__}"
    write_report(ROOT / "results" / "bench_launch", rows_out, FIELDS, stamp, "Launch cost per LayerNorm call",
                 "bf16 forward. raw:* launch the same PTX with preallocated outputs and no checks; ours:* are "
                 "the public calls. Pipelined: 200 back-to-back calls, one sync, divided (median of 5); "
                 "host: wall time for a call to return; device: CUDA events with the host kept ahead.")


if __name__ == "__main__":
    main()
