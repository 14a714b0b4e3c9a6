"""LayerNorm launch configurations: for a shape, which kernel instantiation runs, with which grid and block.

The one source of truth for both routes: the direct launcher (``ops/launch/direct.py``) launches what these
functions return, and the MAX ops (``layernorm_fwd``, ``layernorm_bwd`` in ``ops/kernels/layernorm.mojo``)
take the same choice as their compile-time parameters (``Launch.op_parameters``). Tuned on the H100;
each tuned constant's evidence is in docs/tuning.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache

import torch

from ops.inputs import DTYPES
from ops.launch.mojo_constants import comptime
from ops.launch.ptx import KernelSpec

K = comptime("layernorm")   # the kernels' own constants (ops/kernels/layernorm.mojo): the one source of each

# the activation after the norm, as the kernels' act parameter: "gelu" is the erf form (torch's default),
# "gelu_tanh" the tanh approximation
ACTIVATIONS = {"none": K["ACT_NONE"], "gelu_tanh": K["ACT_GELU_TANH"], "gelu": K["ACT_GELU_ERF"]}
F32 = torch.float32   # the statistics' dtype

WARP = 32
VECTOR_BYTES = K["ALIGN"]                 # one vector load
ROW_THREAD_BLOCK = K["ROW_THREAD_BLOCK"]   # ln_fwd_row_thread: rows per block (a thread per row)
SMEM_BLOCK = K["SMEM_BLOCK"]               # ln_fwd_block_smem: threads per row
# ln_bwd_reduce[COLS, LEVELS]: COLS columns per block, 2^LEVELS threads per column; narrow rows want many threads
# per column, wide ones many columns per block (docs/tuning.md)
REDUCE_NARROW_MAX_H = K["REDUCE_NARROW_MAX_H"]
REDUCE_NARROW_COLS, REDUCE_NARROW_LEVELS = K["REDUCE_NARROW_COLS"], K["REDUCE_NARROW_LEVELS"]
REDUCE_WIDE_COLS, REDUCE_WIDE_LEVELS = K["REDUCE_WIDE_COLS"], K["REDUCE_WIDE_LEVELS"]
REDUCE_UNROLL = K["REDUCE_UNROLL"]   # partials a thread of the column sums loads together
MULTI_ROW_MIN_ROWS = 2048  # below this, a warp per row leaves the GPU idle (H100 sweep)
# ln_fwd_loop's UNROLL: columns per thread whose loads go out together in a launch of fewer blocks than SMs (a few
# long rows are latency-bound); 1 otherwise, where it slowed launches of many blocks (docs/tuning.md)
LOOP_UNROLL = 4
H100_SMS = 132   # the SM count that the choice functions assume when not told the GPU's

# Each kernel's code, the `kernel` parameter its MAX op takes (K_* in the .mojo).
KERNEL_CODES = {"ln_fwd_row_thread": K["K_ROW_THREAD"], "ln_fwd_block_smem": K["K_BLOCK_SMEM"],
                "ln_fwd_loop": K["K_LOOP"], "ln_fwd_regs": K["K_REGS"], "ln_fwd_cluster": K["K_CLUSTER"],
                "ln_bwd_loop": K["K_LOOP"], "ln_bwd_regs": K["K_REGS"]}

# Register configurations of the forward (ln_fwd_regs): (CH vectors per thread, WPR warps per row,
# RPB rows per block); a row of up to CH * WPR * 32 vectors fits. Index = the "config:<i>" variant.
FWD_REGS = ((1, 1, 8), (2, 1, 8), (4, 1, 4), (8, 1, 4), (1, 8, 1), (2, 8, 1), (4, 8, 1), (4, 16, 1), (8, 16, 1),
            (2, 16, 1), (1, 16, 1), (4, 4, 1), (8, 8, 1), (1, 32, 1), (2, 32, 1))
# ... and with a cluster of CL blocks per row (ln_fwd_cluster, sm_90 and newer): (CH, WPR, CL), configs 15-17.
FWD_CLUSTERS = ((2, 16, 2), (4, 16, 4), (4, 16, 8))
# Backward register configurations (ln_bwd_regs), capped at 256 threads: it holds six register arrays. (4, 4, 2)
# before (4, 4, 1): two groups a block (at ~250 registers a thread, the same two per SM) write half the partials
# (docs/tuning.md).
BWD_REGS = ((1, 1, 8), (2, 1, 8), (4, 1, 4), (2, 4, 1), (4, 4, 2), (4, 4, 1), (4, 8, 1), (8, 8, 1))

# Under torch.compile, who runs the default LayerNorm: "inductor" (torch's layer_norm, which inductor fuses with the
# residual add before it) or "ours" (our C++ op); inductor's costs less host time per call (docs/tuning.md)
COMPILED_LAYERNORM = "inductor"

# The forward kernel progression (docs/kernels/layernorm.md says what each step changes).
VARIANTS = ("row_thread", "block_smem", "block_warp", "vector", "fast")

# Backward: rows are dealt to `parts` row groups whose dgamma/dbeta partials ([parts, H] float32 each) a second
# kernel reduces; a whole number of groups per SM, as many as 16 KiB of row bytes per SM allow, at most 12
# (docs/tuning.md)
BWD_ROW_BYTES_PER_SM = 16384
BWD_MAX_PER_SM = 12
BWD_ROWS_PER_GROUP = 8          # rows over REDUCE_NARROW_MAX_H
BWD_ROWS_PER_GROUP_NARROW = 2   # rows up to REDUCE_NARROW_MAX_H
# BWD_FEW_PARTS: with fewer row groups than SMs x rows per block, a configuration of one row per block keeps more
# SMs busy (docs/tuning.md)


@dataclass(frozen=True)
class Launch:
    """One kernel launch: the instantiation's name and compile-time parameters (after dtype and act),
    its grid (blocks, or clusters when ``cluster`` > 1) and threads per block."""

    kernel: str
    params: tuple[int, ...]
    grid: tuple[int, int, int]
    block: int
    cluster: int = 1

    def spec(self, dtype: torch.dtype, act: int) -> KernelSpec:
        args = "pppppppppiii" if self.kernel.startswith("ln_bwd") else "ppppppiif"
        return KernelSpec("layernorm", self.kernel, (dtype, act, *self.params), args)


def add_norm_spec(launch: Launch, dtype: torch.dtype, act: int, bias: bool) -> KernelSpec | None:
    """The one-pass add and norm (``add_norm_fwd_regs``) with ``launch``'s mapping, for a forward launch of the
    register kernel (a row a block or a warp holds); None for any other, whose add runs before the norm."""
    if launch.kernel != "ln_fwd_regs":
        return None
    return KernelSpec("layernorm", "add_norm_fwd_regs", (dtype, act, *launch.params, bias), "pppppppppiif")


VECTOR_WIDTH = {dtype: VECTOR_BYTES // dtype.itemsize for dtype in DTYPES}   # elements per 16-byte vector


def vector_width(dtype: torch.dtype) -> int:
    return VECTOR_WIDTH[dtype]


def fwd_capacity(config: int) -> int:
    """Vectors per row that forward config ``config`` holds in registers (0 for an unknown one)."""
    if 0 <= config < len(FWD_REGS):
        ch, wpr, _ = FWD_REGS[config]
        return ch * wpr * WARP
    if 0 <= config - len(FWD_REGS) < len(FWD_CLUSTERS):
        ch, wpr, cl = FWD_CLUSTERS[config - len(FWD_REGS)]
        return ch * wpr * WARP * cl
    return 0


def vector_config(nv: int, vec: int, clusters: bool, rms: bool = False) -> int:
    """A block (or, with ``clusters``, for long rows a cluster of blocks) per row; per row length, the
    fastest config of H100 sweeps (fp32 and bf16; results/layernorm.md; ``rms``: an RMSNorm's, of H200 sweeps,
    results/rmsnorm.md); -1: none holds the row."""
    if nv <= 256:
        return 4
    if nv <= 512:
        return 5
    if nv <= 1024:
        return 9
    # A 16-bit row of 1025-2048 vectors would take 32 values per thread in one block: a cluster
    # of two blocks of 16 keeps the occupancy (LayerNorm's; RMSNorm's one block is 15% faster at bf16 1024x16384,
    # docs/tuning.md). Past 4096 vectors one block cannot hold the row.
    if nv <= 2048:
        return 15 if clusters and vec != 4 and not rms else 7
    if nv <= 4096:
        return 8
    if clusters and nv <= 8192:
        return 16
    if clusters and nv <= 16384:
        return 17
    return -1


def fast_config(nv: int, rows: int, vec: int, clusters: bool, rms: bool = False) -> int:
    """Short rows and many of them: a warp per row, several rows per block; else as ``vector_config``."""
    if rows >= MULTI_ROW_MIN_ROWS:
        for config, capacity in ((0, 32), (1, 64), (2, 128)):
            if nv <= capacity:
                return config
    return vector_config(nv, vec, clusters, rms)


def variant_config(variant: str) -> int | None:
    """The forced register config of a ``"config:<i>"`` variant (benchmark sweeps); None for a named one."""
    if variant in VARIANTS:
        return None
    if variant.startswith("config:") and variant[7:].isdigit() and fwd_capacity(int(variant[7:])):
        return int(variant[7:])
    raise ValueError(f"variant: {variant!r} is not one of {list(VARIANTS)} (or config:<i>, "
                     f"i < {len(FWD_REGS) + len(FWD_CLUSTERS)})")


def _bwd_loop(wpr: int, rpb: int, parts: int) -> Launch:
    """``ln_bwd_loop[wpr, rpb]`` over ``parts`` row groups."""
    return Launch("ln_bwd_loop", (wpr, rpb), (-(-parts // rpb), 1, 1), wpr * rpb * WARP)


def _fwd_loop(wpr: int, rpb: int, rows: int, sms: int) -> Launch:
    """``ln_fwd_loop[wpr, rpb, UNROLL]``: UNROLL is LOOP_UNROLL for fewer blocks than ``sms``, else 1."""
    blocks = -(-rows // rpb)
    return Launch("ln_fwd_loop", (wpr, rpb, LOOP_UNROLL if blocks < sms else 1), (blocks, 1, 1), wpr * rpb * WARP)


@cache
def fwd_launch(rows: int, h: int, dtype: torch.dtype, vec_ok: bool, variant: str = "fast",
               clusters: bool = True, sms: int = H100_SMS, act: int = 0) -> Launch:
    """The forward launch for x [rows, h]. ``vec_ok``: h is a multiple of the vector width and x, y, gamma
    and beta are 16-byte aligned; ``clusters``: the GPU has thread block clusters (sm_90+); ``sms``: its SMs;
    ``act``: the kernels' code of the norm and activation (an RMSNorm's bits choose its own tuning)."""
    if variant == "row_thread":
        return Launch("ln_fwd_row_thread", (), (-(-rows // ROW_THREAD_BLOCK), 1, 1), ROW_THREAD_BLOCK)
    if variant == "block_smem":
        return Launch("ln_fwd_block_smem", (), (rows, 1, 1), SMEM_BLOCK)
    if variant == "block_warp":
        return _fwd_loop(8, 1, rows, sms)
    vec = vector_width(dtype)
    nv = h // vec
    forced = variant_config(variant)
    rms = bool(act & K["NORM_RMS"])
    config = fast_config(nv, rows, vec, clusters, rms) if variant == "fast" else vector_config(nv, vec, False, rms)
    if forced is not None and fwd_capacity(forced) >= nv and (clusters or forced < len(FWD_REGS)):
        config = forced
    if vec_ok and 0 <= config < len(FWD_REGS):
        ch, wpr, rpb = FWD_REGS[config]
        return Launch("ln_fwd_regs", (vec, ch, wpr, rpb), (-(-rows // rpb), 1, 1), wpr * rpb * WARP)
    if vec_ok and config >= len(FWD_REGS):
        ch, wpr, cl = FWD_CLUSTERS[config - len(FWD_REGS)]
        return Launch("ln_fwd_cluster", (vec, ch, wpr, cl), (rows, 1, 1), wpr * WARP, cluster=cl)
    return _fwd_loop(1, 8, rows, sms) if h <= 1024 else _fwd_loop(16, 1, rows, sms)


def bwd_parts(rows: int, h: int, dtype: torch.dtype, device: torch.device, sms: int) -> int:
    """Row groups of the backward (CPU: one, it runs the rows in order)."""
    if device.type != "cuda":
        return 1
    if FORCED_BWD_PARTS is not None:   # a benchmark's sweep (forced_backward)
        return min(rows, FORCED_BWD_PARTS)
    row_bytes = 1 << (h * dtype.itemsize - 1).bit_length()
    per_group = BWD_ROWS_PER_GROUP_NARROW if h <= REDUCE_NARROW_MAX_H else BWD_ROWS_PER_GROUP
    per_sm = min(BWD_MAX_PER_SM, max(1, BWD_ROW_BYTES_PER_SM // row_bytes), max(1, round(rows / (per_group * sms))))
    return min(rows, per_sm * sms)


@cache
def bwd_launch(parts: int, h: int, dtype: torch.dtype, vec_ok: bool, config: int | None = None,
               sms: int = H100_SMS) -> Launch:
    """The backward's row-group kernel for ``parts`` groups of rows of h (``vec_ok`` as in ``fwd_launch``,
    for dx, dy, x, gamma and beta) on a GPU of ``sms`` SMs: the first register configuration that holds the row
    and gives every SM a block; if none does, the first with the most blocks, then the fewest rows per block
    (``BWD_FEW_PARTS``). ``config`` forces ``BWD_REGS[config]`` (a benchmark's sweep, ``forced_backward``).

    Raises:
        ValueError: a forced configuration that does not hold the row (or a row the register kernel cannot take).
    """
    vec = vector_width(dtype)
    nv = h // vec
    held = [(ch, wpr, rpb) for ch, wpr, rpb in (BWD_REGS if config is None else BWD_REGS[config:config + 1])
            if vec_ok and nv <= ch * wpr * WARP]
    if held:
        blocks = lambda c: -(-parts // c[2])   # noqa: E731
        ch, wpr, rpb = next((c for c in held if blocks(c) >= sms), max(held, key=lambda c: (blocks(c), -c[2])))
        return Launch("ln_bwd_regs", (vec, ch, wpr, rpb), (blocks((ch, wpr, rpb)), 1, 1), wpr * rpb * WARP)
    if config is not None:
        raise ValueError(f"config: BWD_REGS[{config}] does not hold a row of {h} ({dtype}, vec_ok {vec_ok})")
    return _bwd_loop(1, 8, parts) if h <= 1024 else _bwd_loop(8, 1, parts)


def bwd_sizes(launch: Launch, parts: int) -> tuple[int, int]:
    """(row groups, partial rows) of a backward launch over ``parts`` row groups: ``ln_bwd_regs`` runs RPB groups per
    block (so blocks * RPB of them) and writes one partial row per block; ``ln_bwd_loop`` one per group."""
    if launch.kernel == "ln_bwd_regs":
        return launch.grid[0] * launch.params[3], launch.grid[0]
    return parts, parts


# A benchmark's sweep of the backward forces these (``forced_backward``); None: the rules above choose.
FORCED_BWD_PARTS: int | None = None
FORCED_BWD_CONFIG: int | None = None


def bwd_config() -> int | None:
    """The backward's register configuration a sweep forces (an index into ``BWD_REGS``), or None."""
    return FORCED_BWD_CONFIG


@contextmanager
def forced_backward(parts: int | None = None, config: int | None = None) -> Iterator[None]:
    """Within: the backward's row groups and register configuration forced (a benchmark's sweep, a test). Those calls
    take the Python route: no plan is handed to the C++ tables while forced, and they are cleared on the way in and
    out."""
    global FORCED_BWD_PARTS, FORCED_BWD_CONFIG
    from ops.launch import plans

    before = FORCED_BWD_PARTS, FORCED_BWD_CONFIG
    FORCED_BWD_PARTS, FORCED_BWD_CONFIG = parts, config
    plans.forget_plans()
    try:
        yield
    finally:
        FORCED_BWD_PARTS, FORCED_BWD_CONFIG = before
        plans.forget_plans()


def reduce_shape(h: int) -> tuple[int, int]:
    """The column reduction's (COLS, LEVELS) for rows of h."""
    if h <= REDUCE_NARROW_MAX_H:
        return REDUCE_NARROW_COLS, REDUCE_NARROW_LEVELS
    return REDUCE_WIDE_COLS, REDUCE_WIDE_LEVELS


def reduce_spec(dtype: torch.dtype, h: int, act: int = 0) -> KernelSpec:
    """The dgamma/dbeta column reduction's instantiation for rows of h after a backward of ``act`` (an RMSNorm's sums
    dgamma alone: it has no beta) (launch: ``reduce_grid``, ``reduce_block``)."""
    return KernelSpec("layernorm", "ln_bwd_reduce", (dtype, *reduce_shape(h), REDUCE_UNROLL, not act & K["NORM_RMS"]),
                      "ppppii")


def reduce_grid(h: int) -> tuple[int, int, int]:
    return (-(-h // reduce_shape(h)[0]), 1, 1)


def reduce_block(h: int) -> int:
    cols, levels = reduce_shape(h)
    return cols << levels


# The C++ route's copy of an x whose last two dims are column-major (a transposed view: torch's contiguous() moves
# those at 450-960 GB/s on the H100, results/layernorm.md's copy:strided rows); handed to the C++ side at loading.
TRANSPOSE_TILE = K["TRANSPOSE_TILE"]
TRANSPOSE_THREADS = K["TRANSPOSE_THREADS"]


def transpose_spec(dtype: torch.dtype) -> KernelSpec:
    """``copy_transposed``'s instantiation (grid: ceil(h / TRANSPOSE_TILE), ceil(r / TRANSPOSE_TILE), batches)."""
    return KernelSpec("layernorm", "copy_transposed", (dtype,), "ppiii")


ACTS = tuple(ACTIVATIONS.values())


def launch_specs(acts: tuple[int, ...], variants: tuple[str, ...],
                 add_norm_acts: tuple[int, ...] = ()) -> dict[KernelSpec, None]:
    """The forward's (``variants``) and backward's instantiations (its row groups' and column sums') for the kernels'
    ``acts`` codes at any shape on an sm_90 GPU (found by asking the choice functions at every row-length bracket),
    and the one-pass add and norm's for ``add_norm_acts``, in order, without repeats."""
    lengths = [2 ** e for e in range(16)] + [3 * 2 ** e for e in range(14)] + [65536, 131072]
    specs: dict[KernelSpec, None] = {}
    for dtype in DTYPES:
        for act in acts:
            for h in lengths:
                for rows, vec_ok in ((1, True), (1, False), (4096, True), (4096, False)):   # loops: both UNROLLs
                    for variant in variants:
                        specs[fwd_launch(rows, h, dtype, vec_ok, variant, act=act).spec(dtype, act)] = None
                    if act in add_norm_acts and (launch := fwd_launch(rows, h, dtype, vec_ok, act=act)).kernel == \
                            "ln_fwd_regs":
                        for bias in (False, True):
                            specs[add_norm_spec(launch, dtype, act, bias)] = None
                    specs[bwd_launch(rows, h, dtype, vec_ok).spec(dtype, act)] = None
                specs[reduce_spec(dtype, h, act)] = None
    return specs


def all_specs() -> list[KernelSpec]:
    """Every instantiation LayerNorm launches on an sm_90 GPU (``launch_specs`` of every activation and variant, the
    one-pass add and norm, the column sums, the transposing copy), for ``poe build-kernels``."""
    specs = launch_specs(ACTS, VARIANTS, (ACTIVATIONS["none"],))
    for dtype in DTYPES:
        specs[transpose_spec(dtype)] = None
    return list(specs)
