"""LayerNorm+Linear launch geometry for the direct route: which kernel instantiations the fused and Hopper
forwards launch for a shape, with which grids, blocks, shared memory and scratch.

The MAX ops (``layernorm_linear_fwd``, ``layernorm_linear_fwd_sm90``) make the same choices in their Mojo host
code (``fwd_gpu``, ``launch_fold``, ``launch_wgmma``); the sizes below are that code's own ``comptime`` values, read
from the kernel sources (``ops/launch/mojo_constants.py``), and ``tests/test_routes.py`` checks both routes' outputs
bitwise on the GPU. The tuning that ``auto`` and the fused kernel's k splits follow (H100) is the last
section: its tables and choice functions (``fused_region``, ``sm90_region``, ``split_count``,
``training_algo``); ``algo.py`` and ``launch.py`` read them. The evidence for each is in docs/tuning.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ops.launch.mojo_constants import comptime
from ops.launch.ptx import KernelSpec

MODULE, SM90_MODULE = "layernorm_linear", "layernorm_linear_sm90"
ALGOS = ("auto", "fused", "sm90", "unfused")   # the op's algo argument: auto picks; the others force a route
ALGO_IDS = {a: i for i, a in enumerate(ALGOS)}   # the C++ entry's algo argument
_F, _H = comptime("layernorm_linear"), comptime("layernorm_linear_sm90")   # the kernels' constants: their one source
VECTOR_BYTES = comptime("layernorm")["ALIGN"]   # one vector load

# ops/kernels/layernorm_linear.mojo
TILE_THREADS, TILE_ROWS, TILE_COLS = _F["TILE_THREADS"], _F["TILE_ROWS"], _F["TILE_COLS"]   # fused: per block
STAGE_THREADS_PER_ROW = _F["STAGE_THREADS_PER_ROW"]    # threads staging one row (16 bytes each)
MMA_STAGES, MMA_STEP_K = _F["MMA_STAGES"], _F["MMA_STEP_K"]   # the 16-bit kernel's cp.async ring: steps, k per step
MMA_SMEM_BYTES = _F["MMA_SMEM_BYTES"]
FINISH_ROWS, FINISH_COLS = _F["FINISH_ROWS"], _F["FINISH_COLS"]   # float32 finish kernel: rows x columns per block
FOLD_THREADS = _F["FOLD_THREADS"]                                  # fold kernel: one block per output column

# ops/kernels/layernorm_linear_sm90.mojo
PREP_WARPS = _H["PREP_WARPS"]   # prep kernel: one warp per output column
WG_TILE_ROWS, WG_TILE_COLS = _H["WG_TILE_ROWS"], _H["WG_TILE_COLS"]   # the Hopper kernel's output tile
WG_SLOT_K, WG_STAGES = _H["WG_SLOT_K"], _H["WG_STAGES"]               # k per ring slot, slots
WG_THREADS, WG_ROWS, WG_BOX, WG_EXT_COLS = _H["WG_THREADS"], _H["WG_ROWS"], _H["WG_BOX"], _H["WG_EXT_COLS"]
WG_SMEM_BYTES = _H["WG_SMEM_BYTES"]

# align_mask bits: k a whole number of vectors, then each tensor's address 16-byte aligned.
K_VEC, X_AL, W_AL, G_AL, B_AL = 1, 2, 4, 8, 16
FOLD_VEC_BITS = K_VEC | W_AL | G_AL | B_AL   # fold_vector_width: w, gamma, beta and k
MMA_VEC_BITS = K_VEC | X_AL | W_AL | G_AL    # fwd_gpu's vec_ok: x, w, gamma and k

# The plan kinds the C++ entry runs (ops/launch/native/plans.h: FusedPlan).
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
    return Step(KernelSpec(MODULE, "layernorm_linear_fold", (dtype, vec), "pppppii"), (n, 1, 1), FOLD_THREADS)


def split_chunk(k: int, splits: int, dtype: torch.dtype) -> int:
    """``fwd_gpu``'s k chunk per split: whole steps of either fused kernel."""
    step = max(STAGE_THREADS_PER_ROW * vector_width(dtype), MMA_STEP_K)
    return cdiv(cdiv(k, splits), step) * step


def output_tiles(rows: int, n: int) -> int:
    """How many TILE_ROWS x TILE_COLS output tiles the fused kernels' grid covers."""
    return cdiv(rows, TILE_ROWS) * cdiv(n, TILE_COLS)


def scratch_sizes(rows: int, n: int, dtype: torch.dtype) -> dict[str, int]:
    """Per-split scratch lengths of the fused kernel: float32 keeps [rows, n] products and [rows, 2]
    row sums; fp16/bf16 keep every 64 x 64 output tile's own (4096 products, 64 x 2 row sums), the
    layout its last block per tile reads back. Column sums need none: the fold holds them."""
    if dtype == torch.float32:
        return {"part_acc": rows * n, "part_rows": 2 * rows}
    tiles = output_tiles(rows, n)
    return {"part_acc": tiles * TILE_ROWS * TILE_COLS, "part_rows": 2 * TILE_ROWS * tiles}


def fused_plan(rows: int, k: int, n: int, dtype: torch.dtype, mask: int, splits: int) -> FusedPlan:
    """The fused forward (``fwd_gpu``) in ``splits`` k splits. sizes: (splits, chunk, part_acc and part_rows
    floats per split (``scratch_sizes``), vec_ok)."""
    chunk = split_chunk(k, splits, dtype)
    scratch = scratch_sizes(rows, n, dtype)
    vec_ok = has(mask, MMA_VEC_BITS)
    grid = (cdiv(rows, TILE_ROWS), cdiv(n, TILE_COLS), splits)
    if dtype == torch.float32:
        steps = (fold_step(dtype, n, mask),
                 Step(KernelSpec(MODULE, "layernorm_linear_fwd_splitk", (dtype,), "ppppppiiiii"), grid, TILE_THREADS),
                 Step(KernelSpec(MODULE, "layernorm_linear_fwd_splitk_finish", (dtype,), "ppppppiiiif"),
                      (cdiv(rows, FINISH_ROWS), cdiv(n, FINISH_COLS), 1), FINISH_ROWS * FINISH_COLS))
        kind = KIND_FUSED32
    else:
        steps = (fold_step(dtype, n, mask),
                 Step(KernelSpec(MODULE, "layernorm_linear_fwd_mma", (dtype, vec_ok), "ppppppppppiiiif"), grid,
                      TILE_THREADS, MMA_SMEM_BYTES))
        kind = KIND_FUSED16
    return FusedPlan(kind, steps, (splits, chunk, scratch["part_acc"], scratch["part_rows"], int(vec_ok)))


def sm90_plan(rows: int, k: int, n: int, dtype: torch.dtype, mask: int, sms: int) -> FusedPlan:
    """The Hopper forward (``launch_wgmma``): the prep kernel (the fold's ext rows), then the persistent wgmma
    kernel over ceil(tiles / SMs) tiles per block, launched as the prep's programmatic dependent. sizes: the TMA
    boxes (x, w, y, ext; rows then columns), ext's columns and the tensor map data type."""
    vec = vector_width(dtype) if has(mask, FOLD_VEC_BITS) else 1
    items = cdiv(rows, WG_TILE_ROWS) * cdiv(n, WG_TILE_COLS)
    per = cdiv(items, sms)
    steps = (Step(KernelSpec(SM90_MODULE, "layernorm_linear_wgmma_prep", (dtype, vec), "pppppii"),
                  (cdiv(n, PREP_WARPS), 1, 1), PREP_WARPS * 32),
             Step(KernelSpec(SM90_MODULE, "layernorm_linear_fwd_wgmma", (dtype,), "ttttpppiiif"),
                  (cdiv(items, per), 1, 1), WG_THREADS, WG_SMEM_BYTES))
    boxes = (WG_TILE_ROWS, WG_SLOT_K, WG_TILE_COLS, WG_SLOT_K, WG_ROWS, WG_BOX, WG_TILE_COLS // 8, 8 * WG_EXT_COLS)
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


# ---------------------------------------------------------------- auto's tuning (H100; evidence: docs/tuning.md)

FUSED_MAX_N = 128     # auto's "fused" region (GPU, float32): n up to this ...
FUSED_MIN_ROWS = 512  # ... and at least this many rows (a few rows cannot fill the GPU)
# fp16/bf16 "fused": the tensor-core kernel beats our LayerNorm + cuBLAS where x is long and n small
FUSED16_MAX_N, FUSED16_MIN_ROWS, FUSED16_MIN_K = 64, 2048, 2048
FUSED_TILE_ROWS, FUSED_TILE_COLS = TILE_ROWS, TILE_COLS  # rows and columns per block of the fused kernel
# k splits of the fused kernel (each adds a [rows, n] fp32 partial)
SPLIT_BLOCKS_PER_SM = 4     # float32: at least this many blocks per SM
SPLIT_BLOCKS_PER_SM_16 = 2  # fp16/bf16: at most this many (its loop is latency-bound: long blocks, few partials)
SPLIT_MIN_K = 128  # no chunk shorter than this
SPLIT_MAX = 16
# auto's "sm90" region (bf16 on an sm_90 GPU): from 16384 rows the Hopper kernel and its per-call prep beat our
# LayerNorm + cuBLAS at every region shape of the bf16 grid
SM90_MIN_ROWS = 16384
SM90_MIN_N, SM90_MAX_N = 768, 3072
# ... except where a block's run of consecutive tiles re-reads more x than L2 keeps (runs over SM90_SHORT_RUN tiles
# with x beyond SM90_RUN_MAX_X elements)
SM90_TILE = (WG_TILE_ROWS, WG_TILE_COLS)   # the Hopper kernel's output tile
SM90_SHORT_RUN = 4
SM90_RUN_MAX_X = 16384 * 768
# From SM90_FILL_ROWS rows: only where the persistent grid keeps SM90_FILL_MIN of the SMs busy and k is short
SM90_FILL_ROWS = 4096
SM90_FILL_MIN = 0.9
SM90_FILL_MAX_K = 1024
# ... and not under CUDA graph capture, where the Hopper route's edge (one launch gap less) is gone.

# The unfused forward's GEMM asks cuBLASLt for no workspace where k <= this * n (no memset node in a CUDA graph),
# else for up to 32 MiB (ops/launch/native/cublaslt.h: lt_max_workspace)
LT_NO_WORKSPACE_MAX_K_PER_N = 2


# Under CUDA graph capture, the C++ route's backward runs dW and db on a side stream, beside dxn's GEMM and the
# LayerNorm backward (ops/launch/native/layernorm_linear.h: LayerNormLinearFn); eager calls keep one stream
CAPTURED_WEIGHT_GRADS_BESIDE = True

# Under capture, forwards of at most this many rows accumulate their parameters' gradients (and the LayerNorm
# backward's column sums) on streams of their own, beside the rest of the backward; 0 turns it off
CAPTURED_GRADS_ACCUMULATED_BESIDE_MAX_ROWS = 1024

# Under torch.compile, a 16-bit training graph's unfused Linear: "inductor" (F.linear, torch's program) or "ours"
# (mojo_direct.traced_linear, its backward the C++ linear_grads); "ours" gained nothing beyond the noise
COMPILED_TRAINING_LINEAR = "inductor"

# Under torch.compile, how a 16-bit training graph holds the unfused LayerNorm+Linear (compiled_training_form):
# "ours" (the C++ op traced_layernorm_linear), "inductor" (torch's layer_norm, the Linear as
# COMPILED_TRAINING_LINEAR says), "torch" (no op of ours), or "auto": "ours" from _MIN_ROWS rows, "torch" below
COMPILED_TRAINING_LAYERNORM_LINEAR = "auto"
COMPILED_TRAINING_LAYERNORM_LINEAR_MIN_ROWS = 4096
COMPILED_TRAINING_FORMS = ("auto", "ours", "inductor", "torch")

# Under torch.compile, a tanh GELU right after the unfused Linear goes into its GEMM's cuBLASLt epilogue
# (ops/layernorm_linear/inductor.py): fewer kernels per call, as many as torch's or fewer
COMPILED_LINEAR_GELU = True

# In the "inductor" training form, db comes from dW's GEMM epilogue from this many rows up; below, from torch's sum
# beside gelu_backward (cuBLASLt would run the epilogue as a kernel of its own there)
COMPILED_GELU_BIAS_GRAD_IN_GEMM_MIN_ROWS = 4096


def lt_without_workspace(k: int, n: int) -> bool:
    """Whether the unfused forward's GEMM of x [.., k] @ weight [n, k]^T asks cuBLASLt for no workspace (the rule
    above; ops/launch/native/cublaslt.h's lt_max_workspace applies it, with the constant handed over at loading)."""
    return k <= LT_NO_WORKSPACE_MAX_K_PER_N * n


def fused_region(dtype: torch.dtype, rows: int, n: int, k: int) -> bool:
    """Whether auto picks "fused" for x [rows, k] @ weight [n, k]^T of ``dtype`` on a GPU (outside "sm90")."""
    if dtype == torch.float32:
        return n <= FUSED_MAX_N and rows >= FUSED_MIN_ROWS
    return n <= FUSED16_MAX_N and rows >= FUSED16_MIN_ROWS and k >= FUSED16_MIN_K


def sm90_region(rows: int, n: int, k: int, sms: int, captured: bool = False) -> bool:
    """Whether x [rows, k] @ weight [n, k]^T is in auto's "sm90" region on a GPU of ``sms`` SMs (see
    SM90_MIN_ROWS, SM90_RUN_MAX_X and SM90_FILL_ROWS; ``captured``: under CUDA graph capture)."""
    if rows < SM90_FILL_ROWS or not SM90_MIN_N <= n <= SM90_MAX_N or k % 8 or n % 8:
        return False
    tiles = -(-rows // SM90_TILE[0]) * -(-n // SM90_TILE[1])
    run = -(-tiles // sms)   # the kernel's tiles per block
    if rows < SM90_MIN_ROWS:
        return not captured and k <= SM90_FILL_MAX_K and -(-tiles // run) >= SM90_FILL_MIN * sms
    return run <= SM90_SHORT_RUN or rows * k <= SM90_RUN_MAX_X


def split_count(rows: int, k: int, n: int, sms: int, dtype: torch.dtype) -> int:
    """How many k chunks the fused GPU kernel splits into on a GPU of ``sms`` SMs.

    float32: enough blocks for SPLIT_BLOCKS_PER_SM per SM; fp16/bf16: as many as keep to
    SPLIT_BLOCKS_PER_SM_16 per SM. No chunk shorter than SPLIT_MIN_K (each split adds a
    [rows, n] fp32 partial to write and read).
    """
    tiles = output_tiles(rows, n)
    if dtype == torch.float32:
        want = -(-SPLIT_BLOCKS_PER_SM * sms // tiles)
    else:
        want = SPLIT_BLOCKS_PER_SM_16 * sms // tiles
    return max(1, min(want, k // SPLIT_MIN_K, SPLIT_MAX))


def compiled_training_form(rows: int) -> str:
    """How a training graph under torch.compile holds the 16-bit unfused LayerNorm+Linear of ``rows`` rows:
    ``COMPILED_TRAINING_LAYERNORM_LINEAR``, with "auto" as "ours" from ``COMPILED_TRAINING_LAYERNORM_LINEAR_MIN_ROWS``
    rows up and "torch" below (a symbolic ``rows`` makes dynamo guard on the comparison)."""
    form = COMPILED_TRAINING_LAYERNORM_LINEAR
    if form not in COMPILED_TRAINING_FORMS:
        raise ValueError(f"COMPILED_TRAINING_LAYERNORM_LINEAR: expected one of {COMPILED_TRAINING_FORMS}, got {form!r}")
    if form != "auto":
        return form
    return "ours" if rows >= COMPILED_TRAINING_LAYERNORM_LINEAR_MIN_ROWS else "torch"


def training_algo(algo: str, dtype: torch.dtype) -> str:
    """The forward algo when a gradient will be taken: ``auto`` on fp16/bf16 takes ``unfused``, since that path
    keeps xn for dW and the backward after ``fused`` or ``sm90`` must recompute it, which costs more than those
    save in the forward (docs/tuning.md)."""
    return "unfused" if algo == "auto" and dtype != torch.float32 else algo


# layernorm_linear_act's activations by name, as the C++ op traced_layernorm_linear's act codes
# (ops/launch/native/traced.h: TracedAct): the tanh GELU in the GEMM's epilogue, erf GELU and ReLU after it
TRACED_ACTS = {"gelu_tanh": 1, "gelu": 2, "relu": 3}
