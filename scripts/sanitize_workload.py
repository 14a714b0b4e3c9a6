"""A small run of every GPU kernel of the library, for compute-sanitizer (memcheck, racecheck).

    compute-sanitizer --tool memcheck python scripts/sanitize_workload.py

Runs LayerNorm forward (every variant), backward and the GELU forms, and the
p22 solution kernels, on shapes that hit each code path: short rows (a warp
per row), long rows (a block per row), the loop fallback (odd h, rows too
long for registers) and a partial last block. Exits non-zero on a wrong
result, so the sanitizer run also checks values.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from ops import layernorm as L  # noqa: E402
from ops import p22  # noqa: E402
from ops.reference import layernorm_act_ref, layernorm_linear_ref  # noqa: E402
from ops.tolerance import compare  # noqa: E402

SHAPES = [(7, 37), (2050, 64), (64, 1024), (5, 4097), (3, 8192), (2, 20000)]


def main() -> int:
    bad = 0
    for dtype in (torch.float32, torch.bfloat16):
        for m, h in SHAPES:
            x = torch.randn(m, h, device="cuda", dtype=dtype)
            w, b = torch.randn(h, device="cuda", dtype=dtype), torch.randn(h, device="cuda", dtype=dtype)
            for variant in L.VARIANTS:
                for act in ("none", "gelu") if variant == "fast" else ("none",):
                    y, mean, rstd = L.layernorm_fwd(x, w, b, variant=variant, activation=act)
                    if compare(y, layernorm_act_ref(x, w, b, activation=act), dtype, reduction=h) is not None:
                        print(f"wrong: fwd {variant} {act} {dtype} {m}x{h}")
                        bad += 1
            L.layernorm_bwd(torch.randn_like(x), x, w, b, mean, rstd)
    k = p22.P22Kernels(p22.SOLUTIONS)
    inputs = p22.make_inputs(2, 33, 70, 45, device="cuda")
    for path in (p22.unfused, p22.fused):
        if compare(path(k, *inputs), layernorm_linear_ref(*inputs), torch.float32, reduction=70) is not None:
            print(f"wrong: p22 {path.__name__}")
            bad += 1
    torch.cuda.synchronize()
    print(f"sanitize workload done: {bad} wrong results")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
