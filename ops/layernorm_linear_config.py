"""LayerNorm+Linear launch geometry for the direct route: which kernel instantiations the fused and Hopper
forwards launch for a shape, with which grids, blocks, shared memory and scratch.

The MAX ops (``layernorm_linear_fwd``, ``layernorm_linear_fwd_sm90``) make the same choices in their Mojo host
code (``fwd_gpu``, ``launch_fold``, ``launch_wgmma``); the constants below mirror that code's ``comptime``
values, and ``tests/test_direct.py`` checks them against the kernel sources (a CPU test) and checks both routes'
outputs bitwise on the GPU. Which algorithm runs at a shape (``pick_algo``) and the fused kernel's k splits
(``fused_splits``) stay in ``ops/layernorm_linear.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ops.direct import KernelSpec

MODULE, SM90_MODULE = "layernorm_linear", "layernorm_linear_sm90"
VECTOR_BYTES = 16   # ALIGN: one vector load

# ops/kernels/layernorm_linear.mojo
SK_THREADS, SK_BM, SK_BN, SK_GROUP = 128, 64, 64, 8   # fused kernels: threads, rows and columns per block
MMA_STAGES, MMA_BK = 3, 64                            # the 16-bit kernel's cp.async ring: steps, k per step
MMA_SMEM_BYTES = MMA_STAGES * ((SK_BM + SK_BN) * (MMA_BK + 8) + MMA_BK) * 2
FIN_ROWS, FIN_COLS = 4, 64                            # float32 finish kernel: rows x columns per block
FOLD_THREADS = 256                                    # fold kernel: one block per output column

# ops/kernels/layernorm_linear_sm90.mojo
PREP_WARPS = 8                                        # prep kernel: one warp per output column
WG_BM, WG_BN, WG_BK, WG_STAGES = 128, 256, 64, 3      # tile rows, columns, k per ring slot, ring slots
WG_THREADS, WG_ROWS, WG_BOX, WG_EXT_COLS = 384, 64, 64, 8
WG_SMEM_BYTES = (WG_STAGES * (WG_BM * WG_BK * 2 + WG_BN * WG_BK * 2 + WG_BN * WG_EXT_COLS * 2)
                 + 2 * WG_ROWS * 256 * 2 + 2 * WG_STAGES * 8)

# align_mask bits: k a whole number of vectors, then each tensor's address 16-byte aligned.
K_VEC, X_AL, W_AL, G_AL, B_AL = 1, 2, 4, 8, 16
FOLD_VEC_BITS = K_VEC | W_AL | G_AL | B_AL   # fold_vector_width: w, gamma, beta and k
MMA_VEC_BITS = K_VEC | X_AL | W_AL | G_AL    # fwd_gpu's vec_ok: x, w, gamma and k

# The plan kinds the C++ entry runs (ops/csrc/direct.cpp: FusedPlan).
KIND_FUSED16, KIND_FUSED32, KIND_SM90 = 1, 2, 3
TMA_BF16, TMA_F16 = 9, 6   # CUtensorMapDataType


@dataclass(frozen=True)
class Step:
    """One launch of a plan: the instantiation, its grid, threads per block and dynamic shared memory."""

    spec: KernelSpec
    grid: tuple[int, int, int]
    block: int
    smem: int = 0


@dataclass(frozen=True)
class FusedPlan:
    """What the C++ entry needs to run a fused or Hopper forward at one shape: its launches in order and
    ``sizes`` (kind-specific integers: see ``fused_plan`` and ``sm90_plan``)."""

    kind: int
    steps: tuple[Step, ...]
    sizes: tuple[int, ...]


def vector_width(dtype: torch.dtype) -> int:
    return VECTOR_BYTES // dtype.itemsize


def align_mask(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, weight: torch.Tensor) -> int:
    """The alignment facts the kernels' host code branches on, as ``*_AL`` / ``K_VEC`` bits (the C++ entry
    computes the same mask and keys its plans by it)."""
    bits = (x.shape[-1] % vector_width(x.dtype) == 0,) + tuple(
        t.data_ptr() % VECTOR_BYTES == 0 for t in (x, weight, ln_weight, ln_bias))
    return sum(int(b) << i for i, b in enumerate(bits))


def has(mask: int, bits: int) -> bool:
    return mask & bits == bits


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fold_step(dtype: torch.dtype, n: int, mask: int) -> Step:
    """``launch_fold``: fold [2, n] (G, B + bias) from w, gamma, beta, bias."""
    vec = vector_width(dtype) if has(mask, FOLD_VEC_BITS) else 1
    return Step(KernelSpec(MODULE, "lnl_fold_kernel", (dtype, vec), "pppppii"), (n, 1, 1), FOLD_THREADS)


def split_chunk(k: int, splits: int, dtype: torch.dtype) -> int:
    """``fwd_gpu``'s k chunk per split: whole steps of either fused kernel."""
    step = max(SK_GROUP * vector_width(dtype), MMA_BK)
    return cdiv(cdiv(k, splits), step) * step


def output_tiles(rows: int, n: int) -> int:
    """How many SK_BM x SK_BN output tiles the fused kernels' grid covers."""
    return cdiv(rows, SK_BM) * cdiv(n, SK_BN)


def scratch_sizes(rows: int, n: int, dtype: torch.dtype) -> dict[str, int]:
    """Per-split scratch lengths of the fused kernel: float32 keeps [rows, n] products and [rows, 2]
    row sums; fp16/bf16 keep every 64 x 64 output tile's own (4096 products, 64 x 2 row sums), the
    layout its last block per tile reads back. Column sums need none: the fold holds them."""
    if dtype == torch.float32:
        return {"part_acc": rows * n, "part_rows": 2 * rows}
    tiles = output_tiles(rows, n)
    return {"part_acc": tiles * SK_BM * SK_BN, "part_rows": 2 * SK_BM * tiles}


def fused_plan(rows: int, k: int, n: int, dtype: torch.dtype, mask: int, splits: int) -> FusedPlan:
    """The fused forward (``fwd_gpu``) in ``splits`` k splits. sizes: (splits, chunk, part_acc and part_rows
    floats per split (``scratch_sizes``), vec_ok)."""
    chunk = split_chunk(k, splits, dtype)
    scratch = scratch_sizes(rows, n, dtype)
    vec_ok = has(mask, MMA_VEC_BITS)
    grid = (cdiv(rows, SK_BM), cdiv(n, SK_BN), splits)
    if dtype == torch.float32:
        steps = (fold_step(dtype, n, mask),
                 Step(KernelSpec(MODULE, "lnl_splitk_kernel", (dtype,), "ppppppiiiii"), grid, SK_THREADS),
                 Step(KernelSpec(MODULE, "lnl_splitk_finish", (dtype,), "ppppppiiiif"),
                      (cdiv(rows, FIN_ROWS), cdiv(n, FIN_COLS), 1), FIN_ROWS * FIN_COLS))
        kind = KIND_FUSED32
    else:
        steps = (fold_step(dtype, n, mask),
                 Step(KernelSpec(MODULE, "lnl_mma_kernel", (dtype, vec_ok), "ppppppppppiiiif"), grid, SK_THREADS,
                      MMA_SMEM_BYTES))
        kind = KIND_FUSED16
    return FusedPlan(kind, steps, (splits, chunk, scratch["part_acc"], scratch["part_rows"], int(vec_ok)))


def sm90_plan(rows: int, k: int, n: int, dtype: torch.dtype, mask: int, sms: int) -> FusedPlan:
    """The Hopper forward (``launch_wgmma``): the prep kernel (wg = w * gamma and the fold's ext rows), then the
    persistent wgmma kernel over ceil(tiles / SMs) tiles per block. sizes: the TMA boxes (x, wg, y, ext; rows
    then columns), ext's columns and the tensor map data type."""
    vec = vector_width(dtype) if has(mask, FOLD_VEC_BITS) else 1
    items = cdiv(rows, WG_BM) * cdiv(n, WG_BN)
    per = cdiv(items, sms)
    steps = (Step(KernelSpec(SM90_MODULE, "lnl_wgmma_prep_kernel", (dtype, vec), "ppppppii"),
                  (cdiv(n, PREP_WARPS), 1, 1), PREP_WARPS * 32),
             Step(KernelSpec(SM90_MODULE, "lnl_wgmma_kernel", (dtype,), "ttttppiiif"), (cdiv(items, per), 1, 1),
                  WG_THREADS, WG_SMEM_BYTES))
    boxes = (WG_BM, WG_BK, WG_BN, WG_BK, WG_ROWS, WG_BOX, WG_BN // 8, 8 * WG_EXT_COLS)
    return FusedPlan(KIND_SM90, steps, (*boxes, WG_EXT_COLS, TMA_BF16 if dtype == torch.bfloat16 else TMA_F16))


def all_specs() -> list[KernelSpec]:
    """Every instantiation the fused and Hopper forwards can launch, for ``poe build-kernels``."""
    specs: dict[KernelSpec, None] = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for mask in (0, 31):
            for step in fused_plan(64, 64, 64, dtype, mask, 1).steps:
                specs[step.spec] = None
    for mask in (0, 31):
        for step in sm90_plan(128, 64, 256, torch.bfloat16, mask, 132).steps:
            specs[step.spec] = None
    return list(specs)
