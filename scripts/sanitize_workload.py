"""A small run of every GPU kernel of the library, for compute-sanitizer (memcheck, racecheck).

    compute-sanitizer --tool memcheck python scripts/sanitize_workload.py

Runs LayerNorm forward (every variant), backward and the GELU forms, the
fused LayerNorm+Linear kernels (both strip heights, partial tiles; the Hopper one
on an sm_90 GPU), and the
p22 solution kernels (several strips and column tiles), on shapes that hit
each code path: short rows (a warp per row), long rows (a block per row),
longer rows (fast: a cluster of 2-8 blocks per row, with partly filled last
blocks), the loop fallback (odd h) and a partial last block; column-major x (transposed views of odd sizes,
off the 32 x 32 tiles of copy_transposed, which the C++ route copies them with). Exits non-zero
on a wrong result, so the sanitizer run also checks values.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from ops import layernorm as L  # noqa: E402
from ops import layernorm_linear as LL  # noqa: E402
from ops.puzzle import p22  # noqa: E402
from ops.reference import layernorm_act_ref, layernorm_linear_ref  # noqa: E402
from ops.tolerance import compare  # noqa: E402

SHAPES = [(7, 37), (2050, 64), (64, 1024), (5, 4097), (3, 8192), (3, 16384), (2, 20000), (2, 65536)]


def main() -> int:
    bad = layernorm_kernels() + fused_kernels() + hopper_kernels() + transposed_copies() + p22_kernels()
    torch.cuda.synchronize()
    print(f"sanitize workload done: {bad} wrong results")
    return 1 if bad else 0


def layernorm_kernels() -> int:
    """Every LayerNorm forward variant (the fast one with GELU too) and the backward, over SHAPES."""
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
    return bad


def fused_kernels() -> int:
    """The fused LayerNorm+Linear forward: rows, columns and k off the tiles and the 16-byte vectors; 3 splits of
    k = 70 (bf16: chunks of 64, so the third lies past the end of k), the picked split count, several column
    tiles, a long odd k."""
    bad = 0
    for dtype in (torch.float32, torch.bfloat16):
        for m, kk, n, splits in ((33, 70, 45, 3), (4100, 100, 768, None), (300, 1000, 64, 5)):
            x, g, b = (torch.randn(*s, device="cuda", dtype=dtype) for s in ((m, kk), (kk,), (kk,)))
            w, bias = torch.randn(n, kk, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
            y = LL.launch.fused_fwd(x, g, b, w, bias, 1e-5, splits)[0]
            if compare(y, layernorm_linear_ref(x, g, b, w, bias), dtype, reduction=kk) is not None:
                print(f"wrong: layernorm_linear fused {dtype} {m}x{kk}->{n}")
                bad += 1
    return bad


def hopper_kernels() -> int:
    """The Hopper kernel (TMA, mbarriers, wgmma), on an sm_90 GPU: rows, columns and k off its 128 x 256 x 64
    tiles."""
    bad = 0
    if not LL.algo.is_sm90(torch.device("cuda")):
        return bad
    for m, kk, n in ((37, 200, 264), (300, 776, 520)):
        x, g, b = (torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in ((m, kk), (kk,), (kk,)))
        w = torch.randn(n, kk, device="cuda", dtype=torch.bfloat16) / kk ** 0.5
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        y = LL.layernorm_linear_fwd(x, g, b, w, bias, algo="sm90")[0]
        if compare(y, layernorm_linear_ref(x, g, b, w, bias), torch.bfloat16, reduction=kk) is not None:
            print(f"wrong: layernorm_linear sm90 {m}x{kk}->{n}")
            bad += 1
    return bad


def transposed_copies() -> int:
    """LayerNorm of column-major x (transposed views of [..., h, r]), no gradient: from the second call of a shape,
    once Python handed its plan over, the C++ route copies x with copy_transposed."""
    bad = 0
    for dtype in (torch.float32, torch.bfloat16):
        for *lead, r, h in ((37, 1000), (3, 70, 45)):
            x = torch.randn(*lead, h, r, device="cuda", dtype=dtype).transpose(-1, -2)
            w, b = torch.randn(h, device="cuda", dtype=dtype), torch.randn(h, device="cuda", dtype=dtype)
            for call in range(2):
                if compare(L.layernorm(x, w, b), layernorm_act_ref(x, w, b), dtype, reduction=h) is not None:
                    print(f"wrong: layernorm of a transposed x, call {call + 1}, {dtype} {list(x.shape)}")
                    bad += 1
    return bad


def p22_kernels() -> int:
    """p22 solution, both paths: one partial strip and tile; then 3 strips (the last partial) x 3 column
    tiles with the picked tiles per block and with 2 (the second block's second tile lies past n)."""
    k = p22.P22Kernels(p22.SOLUTIONS)
    bad = 0
    for shape, col_tiles in (((2, 33, 70, 45), ""), ((3, 100, 200, 300), ""), ((3, 100, 200, 300), "2")):
        inputs = p22.make_inputs(*shape, device="cuda")
        for path in (p22.unfused, p22.fused):
            with p22.col_tiles_override(col_tiles):
                got = path(k, *inputs)
            if compare(got, layernorm_linear_ref(*inputs), torch.float32, reduction=shape[2]) is not None:
                print(f"wrong: p22 {path.__name__} {shape} col_tiles={col_tiles or 'picked'}")
                bad += 1
    return bad


if __name__ == "__main__":
    sys.exit(main())
