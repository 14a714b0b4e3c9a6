"""LayerNorm+Linear launch geometry for the direct route: which kernel instantiations the fused and Hopper
forwards launch for a shape, with which grids, blocks, shared memory and scratch.

The MAX ops (``layernorm_linear_fwd``, ``layernorm_linear_fwd_sm90``) make the same choices in their Mojo host
code (``fwd_gpu``, ``launch_fold``, ``launch_wgmma``); the constants below mirror that code's ``comptime``
values, and ``tests/test_direct.py`` checks them against the kernel sources (a CPU test) and checks both routes'
outputs bitwise on the GPU. The tuning that ``auto`` and the fused kernel's k splits follow (H100) is the last
section: its tables and choice functions (``fused_region``, ``sm90_region``, ``split_count``,
``training_algo``), each citing its evidence; ``ops/layernorm_linear/`` (``pick_algo``, ``fused_splits``,
``autograd_algo``) reads them. A new GPU's tuning is a new table there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ops.launch.ptx import KernelSpec

MODULE, SM90_MODULE = "layernorm_linear", "layernorm_linear_sm90"
ALGOS = ("auto", "fused", "sm90", "unfused")   # the op's algo argument: auto picks; the others force a route
ALGO_IDS = {a: i for i, a in enumerate(ALGOS)}   # the C++ entry's algo argument
VECTOR_BYTES = 16   # ALIGN: one vector load

# ops/kernels/layernorm_linear.mojo
TILE_THREADS, TILE_ROWS, TILE_COLS = 128, 64, 64   # fused kernels: threads, rows and columns per block
STAGE_THREADS_PER_ROW = 8                          # threads staging one row (16 bytes each)
MMA_STAGES, MMA_STEP_K = 3, 64                     # the 16-bit kernel's cp.async ring: steps, k per step
MMA_SMEM_BYTES = MMA_STAGES * ((TILE_ROWS + TILE_COLS) * (MMA_STEP_K + 8) + MMA_STEP_K) * 2
FINISH_ROWS, FINISH_COLS = 4, 64                            # float32 finish kernel: rows x columns per block
FOLD_THREADS = 256                                    # fold kernel: one block per output column

# ops/kernels/layernorm_linear_sm90.mojo
PREP_WARPS = 8                                        # prep kernel: one warp per output column
WG_TILE_ROWS, WG_TILE_COLS, WG_SLOT_K, WG_STAGES = 128, 256, 64, 3   # tile rows, columns, k per slot, slots
WG_THREADS, WG_ROWS, WG_BOX, WG_EXT_COLS = 384, 64, 64, 8
WG_SMEM_BYTES = (WG_STAGES * (WG_TILE_ROWS * WG_SLOT_K * 2 + WG_TILE_COLS * WG_SLOT_K * 2
                              + WG_TILE_COLS * WG_EXT_COLS * 2)
                 + 2 * WG_ROWS * 256 * 2 + 2 * WG_STAGES * 8)

# align_mask bits: k a whole number of vectors, then each tensor's address 16-byte aligned.
K_VEC, X_AL, W_AL, G_AL, B_AL = 1, 2, 4, 8, 16
FOLD_VEC_BITS = K_VEC | W_AL | G_AL | B_AL   # fold_vector_width: w, gamma, beta and k
MMA_VEC_BITS = K_VEC | X_AL | W_AL | G_AL    # fwd_gpu's vec_ok: x, w, gamma and k

# The plan kinds the C++ entry runs (ops/launch/direct.cpp: FusedPlan).
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


# ---------------------------------------------------------------- auto's tuning (H100)

FUSED_MAX_N = 128     # auto's "fused" region (GPU, float32): n up to this ...
FUSED_MIN_ROWS = 512  # ... and at least this many rows (a few rows cannot fill the GPU)
# fp16/bf16 "fused" region (H100 sweep, results/bench_layernorm_linear_splits.md at 4b7006f, with the fold cached
# per weight version; the sweep is due a rerun with the per-call fold): the tensor-core kernel
# beats our LayerNorm + cuBLAS where x is long and n small; at k ~1000 they tie, at n 128 cuBLAS wins.
FUSED16_MAX_N, FUSED16_MIN_ROWS, FUSED16_MIN_K = 64, 2048, 2048
FUSED_TILE_ROWS, FUSED_TILE_COLS = TILE_ROWS, TILE_COLS  # rows and columns per block of the fused kernel
# k splits of the fused kernel: an H100 sweep (results/bench_layernorm_linear_splits.md at commit 7fc549e) had
# fp32 best near 256-1024 blocks, at 4b7006f the bf16 one; each split adds a [rows, n] fp32 partial.
SPLIT_BLOCKS_PER_SM = 4     # float32: at least this many blocks per SM
SPLIT_BLOCKS_PER_SM_16 = 2  # fp16/bf16: at most this many (its loop is latency-bound: long blocks, few partials)
SPLIT_MIN_K = 128  # no chunk shorter than this
SPLIT_MAX = 16
# auto's "sm90" region (bf16 on an sm_90 GPU). The op makes the fold's rows at every call (376322c: nothing
# derived from the weights is kept). With 16384 rows the Hopper kernel plus that prep beat our LayerNorm + cuBLAS
# by CUPTI kernel time at every region shape of the bf16 grid (results/bench_layernorm_linear.md, bf16 rows at
# 376322c: 16384 x 768 -> 3072 132.4 against 137.4 us).
SM90_MIN_ROWS = 16384
SM90_MIN_N, SM90_MAX_N = 768, 3072
# ... except where kernel version 6's runs re-read more x than L2 keeps: each block takes a run of
# ceil(tiles / SMs) consecutive SM90_TILE tiles and re-reads its x rows once per tile. Runs longer than
# SM90_SHORT_RUN tiles with x beyond SM90_RUN_MAX_X elements (24 MiB of bf16) lost to LayerNorm + cuBLAS
# (results/bench_layernorm_linear_sm90.md and bench_layernorm_linear.md at 8aa98c9: 16384 x 1024 -> 3072,
# runs of 12, 183.4 against 176.5 us; 16384 x 4096 -> 3072 694.4 against 620.5; version 5 had won both);
# shorter runs, or x within that, won at every region shape of the sweep.
SM90_TILE = (WG_TILE_ROWS, WG_TILE_COLS)   # the Hopper kernel's output tile
SM90_SHORT_RUN = 4
SM90_RUN_MAX_X = 16384 * 768
# From SM90_FILL_ROWS rows (up to SM90_MIN_ROWS): only where the persistent grid keeps SM90_FILL_MIN of the SMs
# busy and k is at most SM90_FILL_MAX_K. Since kernel version 8 (gamma on the A side: the prep only reads w, and
# the kernel is launched as the prep's programmatic dependent) 4096 x 768 -> 3072 (384 tiles, 128 of 132 SMs)
# took 39.15 us per call against LayerNorm + cuBLAS's 41.94 and torch's 46.49, while 4096 x 768 -> 2304 (288
# tiles: 96 SMs busy) lost, 36.12 against 33.15, and so did k = 4096 by kernel time (4096^3: 200.8 against
# 194.6 us; H100 run of scripts/bench_layernorm_linear.py --sm90 --quick, docs/kernels/layernorm_linear.md).
SM90_FILL_ROWS = 4096
SM90_FILL_MIN = 0.9
SM90_FILL_MAX_K = 1024
# ... but not inside a CUDA graph (stream capture). There a kernel costs its device time and a gap of about 0.4 us,
# and the Hopper route's edge over LayerNorm + cuBLAS (one launch gap less, and none spent in a memset of cuBLAS's
# workspace: LT_NO_WORKSPACE_MAX_K_PER_N) is gone: at 4096 x 768 -> 3072 LayerNorm + cuBLAS took 36.67 us of
# kernel time (results/bench_layernorm_linear_workspace.md at 4e12ba7) against the route's 38.43
# (bench_layernorm_linear.md, ours at 3fb4516), and the transformer's captured 8x512 inference, where ln_2 + fc1
# is this shape, ran faster with fc1 unfused (results/bench_transformer.md; docs/kernels/layernorm_linear.md).

# The unfused forward's GEMM (cuBLASLt) asks for no workspace where k <= LT_NO_WORKSPACE_MAX_K_PER_N * n, else
# for up to 32 MiB (ops/launch/direct.cpp: lt_max_workspace). With a workspace, the heuristics' first choice at
# 4096 x 768 -> 3072 is a kernel that zeroes part of it first (a memset node, and about 5 us of gaps, in a CUDA
# graph); without, a statically scheduled one of the same tile and no memset. Over the bf16 grid
# (results/bench_layernorm_linear_workspace.md at 4e12ba7) none was as fast as 32 MiB or faster by kernel time
# where k <= 1.33 n (within 1%, or 0.86x at 16 x 4096 -> 3072), and slower where the heuristics split a long k over
# few output tiles (k >= 5.3 n: 16 x 4096 -> 64 by 14%).
LT_NO_WORKSPACE_MAX_K_PER_N = 2


# Under CUDA graph capture, the C++ route's backward runs the weight's gradients (dW and db: a cuBLASLt GEMM and its
# bias reduction) on a side stream forked from the captured one and joined back before it returns, so that the
# graph runs them beside dxn's GEMM and the LayerNorm backward (ops/launch/direct.cpp: LayerNormLinearFn). Eager
# calls keep one stream (a fork and a join cost host time). Evidence: results/bench_transformer_capture_overlap.md
# at 42fdfcf (H100, medians over 5 processes): the captured training step 0.981 of torch's at 1x128 and 0.943 at
# 8x512, against 0.985 and 0.944 captured on one stream; inference, which has no backward, unchanged.
CAPTURED_WEIGHT_GRADS_BESIDE = True

# Under CUDA graph capture, the C++ route's forwards (LayerNorm+Linear unfused, and LayerNorm) of at most this many
# rows make their parameters' AccumulateGrad nodes on four streams of their own, so that the graph runs the
# gradients' accumulation into .grad (one add per parameter) beside the rest of the backward instead of in its
# chain, and the LayerNorm backward's column sums (dweight, dbias) beside it too, on the streams of those two
# parameters' accumulation (ops/launch/direct.cpp: accumulate_beside, sums_streams; 0 turns both off). Eager calls
# never do (an event per parameter costs host time). Evidence: results/bench_transformer_capture_overlap.md at
# 949a327 (H100, medians over 5 processes): GPT-2-small's captured 1x128 training step 0.948 of torch's, against
# 0.979 with this at 0 (ours_accumulate_in_chain). The limit keeps 8x512 (4096 rows) in the chain, where an ad hoc
# A/B with every size beside read 0.002-0.006 slower; where it sits between 128 and 4096 rows is a guess
# (docs/direct_launch.md).
CAPTURED_GRADS_ACCUMULATED_BESIDE_MAX_ROWS = 1024

# Under torch.compile, the unfused LayerNorm+Linear of a training forward holds its Linear as "inductor": F.linear,
# which inductor runs as addmm, and two mm and a column sum (fused with its neighbours) in the backward; or as
# "ours": the C++ op mojo_direct.traced_linear (the eager route's cuBLASLt plan), whose C++ autograd kernel's
# backward is the C++ op linear_grads (dxn's and dW's GEMMs, db in dW's epilogue: one call from inductor's code).
# 16-bit only: float32 keeps F.linear (the C++ ops would run torch's GEMMs). OPS_COMPILED_TRAINING_LINEAR
# overrides it. Evidence: GPT-2-small's training step under torch.compile on the H100, ratios to torch's, "ours"
# against "inductor" (torch's own program: tests/test_drop_in.py's test_compiled_training_graphs_are_torchs; so its
# ratio is the run's noise). Side by side in one process (bench_transformer.py --linear-ab, when "ours" was the
# default and "inductor" the contender ours_torch_linear: results/bench_transformer_compiled_linear_at_ba6218a.md,
# "ours"' autograd formula then in Python, and _at_988fb7a.md, in C++): 1x128 1.034 and 1.005 against 0.982 and
# 0.961, 8x512 0.995 and 0.980 against 0.961 and 0.960. Medians over 5 processes
# (results/bench_transformer_compiled_linear.md at dcbfc7f): 1x128 1.019 against 0.977, 8x512 1.056 against 1.073,
# per-process ratios spread over 0.83-1.15. No gain beyond the noise: torch's program stays.
COMPILED_TRAINING_LINEAR = os.environ.get("OPS_COMPILED_TRAINING_LINEAR", "inductor")

# Under torch.compile, the 16-bit unfused LayerNorm+Linear of a training forward as "ours": the C++ op
# mojo_direct.traced_layernorm_linear, one call each way in the compiled code (our LayerNorm and the cuBLASLt GEMM;
# in the backward the Linear's gradients and our LayerNorm backward), with a tanh GELU after it in the GEMM's
# epilogue (ops/layernorm_linear/inductor.py); as "inductor": torch's layer_norm (which inductor fuses with the
# residual add before it) and the Linear as COMPILED_TRAINING_LINEAR says, a tanh GELU after it in the GEMM's
# epilogue as COMPILED_LINEAR_GELU says; as "torch": torch's program, with no op of ours in it (the Linear as
# COMPILED_TRAINING_LINEAR says, no GELU epilogue). "auto" (the default) is "ours" for inputs of
# COMPILED_TRAINING_LAYERNORM_LINEAR_MIN_ROWS rows or more and "torch" below (compiled_training_form).
# OPS_COMPILED_TRAINING_LAYERNORM_LINEAR and OPS_COMPILED_TRAINING_LAYERNORM_LINEAR_MIN_ROWS override them.
# Evidence: GPT-2-small's compiled training step on the H100, every thread pinned to one core after compiling, 2
# steps x 121 rotated rounds per contender, the median of the per-round ratios to torch's model, in each of three
# processes (ad hoc runs at 09996e7, not committed; docs/direct_launch.md has them): at 1x128, torch_again (a second
# torch model: the noise floor) read 0.992-0.998, "torch" 0.988-0.995, "inductor" with the GELU epilogue 0.992-1.004
# and "ours" 1.016-1.021 (there each C++ call costs the host-bound step more than the kernels it saves); at 8x512,
# torch_again 0.989-0.998, "torch" 0.997-1.001, "inductor" 0.984-0.990 and "ours" 0.945-0.963. Committed, at 715b187
# (bench_transformer.py --pin-core 4 --inductor-form-ab --ln-linear-ab --control, 2 processes of 21 rounds of 10
# steps: results/bench_transformer_compiled_inductor_form.md, _compiled_ln_linear.md, _control.md): at 1x128 "auto"
# ("torch") 0.986, "inductor" 0.978, "ours" 1.007, torch_again 0.948 (0.884-1.012: "torch" and "inductor" are within
# the noise of each other); at 8x512 "auto" ("ours") 0.952, "inductor" 1.016, torch_again 0.982. Sizes between 128
# and 4096 rows are not measured: they take torch's program.
COMPILED_TRAINING_LAYERNORM_LINEAR = os.environ.get("OPS_COMPILED_TRAINING_LAYERNORM_LINEAR", "auto")
COMPILED_TRAINING_LAYERNORM_LINEAR_MIN_ROWS = int(os.environ.get("OPS_COMPILED_TRAINING_LAYERNORM_LINEAR_MIN_ROWS",
                                                                 "4096"))
COMPILED_TRAINING_FORMS = ("auto", "ours", "inductor", "torch")

# Under torch.compile, a tanh GELU right after the unfused LayerNorm+Linear's Linear goes into that GEMM's cuBLASLt
# epilogue, in inference and in training graphs of the "ours" and "inductor" forms (compiled_training_form; the
# evidence below is of "inductor", the default then) (ops/layernorm_linear/inductor.py). OPS_COMPILED_LINEAR_GELU=0
# turns it off.
# Evidence (H100, GPT-2-small): fewer kernels per compiled call than without it (as many as torch's): inference
# 97 (109) at 1x128 and 97 (121) at 8x512, where auto's Hopper forward becomes torch's layer_norm and that GEMM;
# training 398 (410) at 1x128 and 509 (545) at 8x512 (results/bench_transformer_compile_kernels.md at 32ff9d5). The
# pipelined A/B (results/bench_transformer_compiled_gelu.md at fe868af, before both later rewrites) was within the
# host's noise.
COMPILED_LINEAR_GELU = os.environ.get("OPS_COMPILED_LINEAR_GELU", "1") != "0"

# In the "inductor" training form, the bias gradient comes from dW's GEMM epilogue (cuBLASLt BGRADB) from this many rows
# of x up; below, from torch's sum over GELU's gradient, which inductor makes one kernel with gelu_backward. Evidence
# (H100, GPT-2-small, CUPTI): with db from the epilogue at every size, the 1x128 training step launched 410 kernels, as
# many as torch's (results/bench_transformer_compile_kernels.md at 941863e, commit a13f6f2; an ad hoc profile, not
# committed, showed cuBLASLt running that epilogue as a kernel of its own there, globalKernelBgradAB); with this choice,
# 398 at 1x128 and still 509 against torch's 545 at 8x512 (that report at 32ff9d5, every kernel in its _kernels.md).
# Sizes between 128 and 4096 rows are not measured: they take torch's sum, whose launches are torch's.
COMPILED_GELU_BIAS_GRAD_IN_GEMM_MIN_ROWS = int(os.environ.get("OPS_COMPILED_GELU_BIAS_GRAD_IN_GEMM_MIN_ROWS", "4096"))


def lt_without_workspace(k: int, n: int) -> bool:
    """Whether the unfused forward's GEMM of x [.., k] @ weight [n, k]^T asks cuBLASLt for no workspace (the rule
    above; ops/launch/direct.cpp's lt_max_workspace applies it, with the constant handed over at loading)."""
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
    save in the forward (H100, bf16, results at 95f7c88: backward 1.053x torch at (4096, 768 -> 3072) after sm90
    and 1.007x at (4096, 4096 -> 64) after fused, against 0.988x and 0.812x with xn kept at 4e65f40)."""
    return "unfused" if algo == "auto" and dtype != torch.float32 else algo
