# Fused LayerNorm + Linear: y = LayerNorm(x) @ w^T + bias, x [batch, seq, k],
# w [n, k] (the Linear weight, read as is: no transpose), y [batch, seq, n].
# No normalized copy of x ever reaches device memory.
#
# p22_fused_naive, the first version: one thread per sequence position
# computes its row's statistics and then every output of the row. Correct,
# but each thread streams all of w on its own, so it loses to the tiled
# unfused path as soon as the sizes are realistic.
#
# p22_fused, the tiled version (what this puzzle is about): the GEMM tiling of
# p22_matmul (tiles.mojo: loads one k step ahead of the multiply), plus
#   1. a prologue where each warp computes mean and rstd of BM / N_WARPS rows
#      of the block's row strip, kept in shared memory. One pass of shifted
#      sums over all of a warp's rows at once: each lane keeps one load per
#      row in flight (the first version's two passes, row after row, waited
#      on memory). A block then computes col_tiles output tiles of that strip
#      one after the other, so the statistics are paid once per
#      col_tiles * BN outputs (with one tile per block, re-reading the strip
#      for every tile made the fused kernel 1.5x slower than the unfused path
#      on the H100 at 4096 x 768 -> 3072);
#   2. normalize-on-load: each x element is normalized, scaled by gamma and
#      shifted by beta as it is staged into the shared-memory tile. A thread
#      stages one tile row and four consecutive k columns of every k step,
#      of x and of w alike, so its row's mean and rstd sit in registers and
#      its x, gamma, beta and w values each come in one 4-element load (16
#      bytes in float32; where k % 4 == 0 and the pointers are aligned to 4
#      elements; else four scalar loads);
#   3. the bias added in the epilogue.
# Compared with the unfused path it saves the normalized tensor's write and
# read, the transposed weight, the bias pass, and three launches.
#
# col_tiles (picked at launch) trades the two costs a block pays: its
# strip's statistics, once, and its tiles, one after the other. An SM's time
# is about (blocks it runs) x (col_tiles + STATS_COST) tile-times. The
# driver's occupancy calculator says how many blocks an SM holds at once
# (per_sm); the scheduler may fill SMs that many at a time, so the busiest SM
# runs per_sm x ceil(blocks / (SMs x per_sm)) blocks, and the launcher picks
# the col_tiles that minimises that times the cost of a block.
# H100 sweeps of every count at three sizes (results/p22_realistic.txt,
# results/p22_col_tiles.txt) show how close the pick comes to the best.
# What this version changes over the previous one: the 16-byte loads of
# step 2, and the occupancy in the cost model. The previous version staged x
# as p22_matmul does (four rows, one k column per thread: four rows'
# statistics in registers, four scalar loads) and w with four scalar loads,
# in 247 registers. This one needs 127 (ptxas), so two blocks fit an SM; the
# cost model assumed one, and its pick (128 blocks of 6 tiles, which the
# scheduler packed two to an SM on half the GPU) took 704 us. Counting
# per_sm, it picks 3 tiles. H100 at 8 x 512 x 768 -> 3072, side by side in
# one experiment: fused 564 us against unfused 615 (0.92x), the previous
# kernel 596 (0.97x). results/p22_realistic.txt: fused 560 us against 611,
# the fused kernel 549 against the plain matmul's 532. Before that: 128 x 128
# tiles with loads one step ahead (tiles.mojo), and the cost model in place of
# "as many tiles as still fill the GPU", which left a half-empty last wave of
# blocks.

import extensibility
from extensibility import InputTensor, _MutableInputTensor
from max.gpu.host import DeviceContext
from max.gpu import thread_idx, block_idx, barrier, WARP_SIZE
from max.gpu.primitives import warp
from max.gpu.memory import AddressSpace
from std.math import ceildiv, rsqrt
from std.memory import stack_allocation
from std.os import getenv
from std.sys import size_of

from .common import EPS, Ptr
from .layernorm import row_stats_cpu
from .tiles import A_STRIDE, B_STRIDE, BK, BM, BN, THREADS, TN, Acc, accumulate_tile, store_tile

comptime NAIVE_BLOCK = 128
comptime MAX_COL_TILES = 8
# A strip's statistics cost about 1/8 of one tile's multiply (fitted to an
# H100 sweep; both grow with k): STATS_COST = 1 / COST_SCALE.
comptime COST_SCALE = 8
comptime N_WARPS = THREADS // WARP_SIZE
comptime ROWS_PER_WARP = BM // N_WARPS
# Staging: THREADS_PER_ROW threads cover a tile row's BK columns, 4 each.
comptime THREADS_PER_ROW = BK // 4
comptime F4 = SIMD[DType.float32, 4]
# Alignment of one load4: the vector check below and the load itself both use it.
comptime LOAD4_ALIGN[dtype: DType] = 4 * size_of[dtype]()


def fused_naive_kernel[dtype: DType](
    y: Ptr[dtype], x: Ptr[dtype], gamma: Ptr[dtype], beta: Ptr[dtype],
    w: Ptr[dtype], bias: Ptr[dtype], rows: Int32, k: Int32, n: Int32,
):
    var r = Int(block_idx.x) * NAIVE_BLOCK + Int(thread_idx.x)
    var kk = Int(k)
    var nn = Int(n)
    if r >= Int(rows):
        return
    var base = r * kk
    var s: Float32 = 0.0
    for i in range(kk):
        s += x[unsafe_offset=base + i].cast[DType.float32]()
    var mean = s / Float32(kk)
    var ss: Float32 = 0.0
    for i in range(kk):
        var d = x[unsafe_offset=base + i].cast[DType.float32]() - mean
        ss += d * d
    var rstd = rsqrt(ss / Float32(kk) + EPS)
    for j in range(nn):
        var acc: Float32 = 0.0
        for i in range(kk):
            var xn = (x[unsafe_offset=base + i].cast[DType.float32]() - mean) * rstd
            xn = xn * gamma[unsafe_offset=i].cast[DType.float32]() + beta[unsafe_offset=i].cast[DType.float32]()
            acc += xn * w[unsafe_offset=j * kk + i].cast[DType.float32]()
        y[unsafe_offset=r * nn + j] = (acc + bias[unsafe_offset=j].cast[DType.float32]()).cast[dtype]()


@always_inline
def stats_row(row0: Int, warp_id: Int, rr: Int, mm: Int) -> Int:
    """Matrix row whose statistics warp `warp_id` computes as its rr-th, clamped into the matrix."""
    return min(row0 + warp_id * ROWS_PER_WARP + rr, mm - 1)


@always_inline
def load4[dtype: DType](p: Ptr[dtype], inside: Bool, base: Int, kc: Int, k: Int, vec: Bool) -> F4:
    """p[base + kc .. base + kc + 3] in fp32, 0 past k or when not `inside` the matrix.
    `vec`: k % 4 == 0 and p aligned to four elements, so one load reads all four."""
    var v = F4(0.0)
    if inside:
        if vec:
            if kc < k:
                v = p.unsafe_load[width=4, alignment=LOAD4_ALIGN[dtype]](base + kc).cast[DType.float32]()
        else:
            comptime for i in range(4):
                if kc + i < k:
                    v[i] = p[unsafe_offset=base + kc + i].cast[DType.float32]()
    return v


# ANCHOR: fused_normalize_on_load
@always_inline
def normalize(x: F4, mean: Float32, rstd: Float32, gamma: F4, beta: F4) -> F4:
    """Four x values of one row as they are staged: LayerNorm's output, before the matmul."""
    var v = F4(0.0)
    # FILL ME IN [fused_normalize_on_load] (roughly 1 line)
    # Hint: v = (x - mean) * rstd * gamma + beta, elementwise (a Float32 broadcasts over F4).
    pass  # stub
    # END FILL ME IN
    return v
# ANCHOR_END: fused_normalize_on_load


def fused_kernel[dtype: DType](
    y: Ptr[dtype], x: Ptr[dtype], gamma: Ptr[dtype], beta: Ptr[dtype],
    w: Ptr[dtype], bias: Ptr[dtype], rows: Int32, k: Int32, n: Int32, col_tiles: Int32,
):
    var a_s = stack_allocation[BK * A_STRIDE, DType.float32, address_space=AddressSpace.SHARED]()
    var b_s = stack_allocation[BK * B_STRIDE, DType.float32, address_space=AddressSpace.SHARED]()
    var mean_s = stack_allocation[BM, DType.float32, address_space=AddressSpace.SHARED]()
    var rstd_s = stack_allocation[BM, DType.float32, address_space=AddressSpace.SHARED]()
    var mm = Int(rows)
    var kk_n = Int(k)
    var nn = Int(n)
    var tx = Int(thread_idx.x)
    var ty = Int(thread_idx.y)
    var tid = ty * TN + tx
    var lane = tid % WARP_SIZE
    var warp_id = tid // WARP_SIZE
    var row0 = Int(block_idx.y) * BM

    # ANCHOR: fused_stats
    # FILL ME IN [fused_stats] (roughly 20 lines)
    # Hint: warp `warp_id` owns tile rows m = warp_id * ROWS_PER_WARP + rr for
    # rr in range(ROWS_PER_WARP); clamp the matrix row to mm - 1 so the last
    # strip reads valid memory (its extra rows are never used). One pass over
    # k: lanes stride (lane, lane + WARP_SIZE, ...) and, for every row at
    # once, sum d = x - shift and d * d, where shift is the row's first
    # element (sums of x and x * x would cancel when the mean is large).
    # warp.sum() combines the lanes: mean = shift + E[d],
    # var = E[d^2] - E[d]^2 (clamp at 0), rstd = rsqrt(var + EPS). Lane 0
    # stores mean_s[m] and rstd_s[m].
    pass  # stub
    # END FILL ME IN
    # Every warp reads rows other warps wrote: wait until all are there.
    barrier()
    # ANCHOR_END: fused_stats

    # Thread tid stages tile row `mine` and k columns kq .. kq + 3 of every k step.
    var mine = tid // THREADS_PER_ROW
    var kq = (tid % THREADS_PER_ROW) * 4
    var r = row0 + mine
    var row_mean = mean_s[unsafe_offset=mine]
    var row_rstd = rstd_s[unsafe_offset=mine]
    var vec = kk_n % 4 == 0 and (Int(x) | Int(gamma) | Int(beta) | Int(w)) % LOAD4_ALIGN[dtype] == 0

    # ANCHOR: fused_k_loop
    var ct = Int(col_tiles)
    for t in range(ct):
        var col0 = (Int(block_idx.x) * ct + t) * BN
        if col0 >= nn:
            break
        var c = col0 + mine  # the weight row (output column) this thread stages
        var acc = Acc(0)
        # Raw x, gamma, beta and w of the next k step, loaded one step ahead;
        # x is normalized when staged.
        var x4 = load4(x, r < mm, r * kk_n, kq, kk_n, vec)
        var g4 = load4(gamma, True, 0, kq, kk_n, vec)
        var b4 = load4(beta, True, 0, kq, kk_n, vec)
        var w4 = load4(w, c < nn, c * kk_n, kq, kk_n, vec)
        for k0 in range(0, kk_n, BK):
            var a4 = normalize(x4, row_mean, row_rstd, g4, b4)
            comptime for i in range(4):
                a_s[unsafe_offset=(kq + i) * A_STRIDE + mine] = a4[i]
                b_s[unsafe_offset=(kq + i) * B_STRIDE + mine] = w4[i]
            barrier()
            var kn = k0 + BK + kq
            if k0 + BK < kk_n:
                x4 = load4(x, r < mm, r * kk_n, kn, kk_n, vec)
                g4 = load4(gamma, True, 0, kn, kk_n, vec)
                b4 = load4(beta, True, 0, kn, kk_n, vec)
                w4 = load4(w, c < nn, c * kk_n, kn, kk_n, vec)
            accumulate_tile(acc, a_s, b_s, ty, tx)
            barrier()
        store_tile[dtype, True](y, bias, acc, row0, col0, ty, tx, mm, nn)
    # ANCHOR_END: fused_k_loop


def col_tiles(rows: Int, n: Int, sm_count: Int, per_sm: Int) -> Int:
    """Output tiles per block: the count (up to MAX_COL_TILES) minimising the time of the
    busiest SM, per_sm x ceil(blocks / (SMs x per_sm)) x (tiles per block + STATS_COST),
    for a kernel of which per_sm blocks fit an SM at once. P22_FUSED_COL_TILES overrides
    it for sweeps."""
    var forced = getenv("P22_FUSED_COL_TILES", "")
    if forced:
        try:
            return max(1, atol(forced))
        except:
            pass
    var strips = ceildiv(rows, BM)
    var tiles = ceildiv(n, BN)
    var held = max(per_sm, 1)
    var best = 1
    var best_cost = -1
    for ct in range(1, min(MAX_COL_TILES, tiles) + 1):
        var blocks = strips * ceildiv(tiles, ct)
        var cost = ceildiv(blocks, sm_count * held) * held * (COST_SCALE * ct + 1)
        if best_cost < 0 or cost < best_cost:
            best = ct
            best_cost = cost
    return best


def fused_cpu[dtype: DType](
    y: Ptr[dtype], x: Ptr[dtype], gamma: Ptr[dtype], beta: Ptr[dtype],
    w: Ptr[dtype], bias: Ptr[dtype], rows: Int, k: Int, n: Int,
):
    for r in range(rows):
        var base = r * k
        var stats = row_stats_cpu[dtype](x, base, k)
        for j in range(n):
            var acc: Float32 = 0.0
            for i in range(k):
                var xn = (x[unsafe_offset=base + i].cast[DType.float32]() - stats[0]) * stats[1]
                xn = xn * gamma[unsafe_offset=i].cast[DType.float32]() + beta[unsafe_offset=i].cast[DType.float32]()
                acc += xn * w[unsafe_offset=j * k + i].cast[DType.float32]()
            y[unsafe_offset=r * n + j] = (acc + bias[unsafe_offset=j].cast[DType.float32]()).cast[dtype]()


@extensibility.register("p22_fused_naive")
struct P22FusedNaive:
    @staticmethod
    def execute[target: StaticString, dtype: DType](
        y: _MutableInputTensor[dtype=dtype, rank=3, static_spec=_],
        x: InputTensor[dtype=dtype, rank=3, static_spec=_],
        gamma: InputTensor[dtype=dtype, rank=1, static_spec=_],
        beta: InputTensor[dtype=dtype, rank=1, static_spec=_],
        w: InputTensor[dtype=dtype, rank=2, static_spec=_],
        bias: InputTensor[dtype=dtype, rank=1, static_spec=_],
        ctx: DeviceContext,
    ) raises:
        var rows = x.dim_size(0) * x.dim_size(1)
        var k = x.dim_size(2)
        var n = w.dim_size(0)
        comptime if target == "gpu":
            comptime kernel = fused_naive_kernel[dtype]
            ctx.enqueue_function[kernel](
                y.unsafe_ptr(), x.unsafe_ptr(), gamma.unsafe_ptr(), beta.unsafe_ptr(),
                w.unsafe_ptr(), bias.unsafe_ptr(), Int32(rows), Int32(k), Int32(n),
                grid_dim=ceildiv(rows, NAIVE_BLOCK), block_dim=NAIVE_BLOCK,
            )
        else:
            fused_cpu[dtype](
                y.unsafe_ptr(), x.unsafe_ptr(), gamma.unsafe_ptr(), beta.unsafe_ptr(),
                w.unsafe_ptr(), bias.unsafe_ptr(), rows, k, n,
            )


@extensibility.register("p22_fused")
struct P22Fused:
    @staticmethod
    def execute[target: StaticString, dtype: DType](
        y: _MutableInputTensor[dtype=dtype, rank=3, static_spec=_],
        x: InputTensor[dtype=dtype, rank=3, static_spec=_],
        gamma: InputTensor[dtype=dtype, rank=1, static_spec=_],
        beta: InputTensor[dtype=dtype, rank=1, static_spec=_],
        w: InputTensor[dtype=dtype, rank=2, static_spec=_],
        bias: InputTensor[dtype=dtype, rank=1, static_spec=_],
        ctx: DeviceContext,
    ) raises:
        var rows = x.dim_size(0) * x.dim_size(1)
        var k = x.dim_size(2)
        var n = w.dim_size(0)
        comptime if target == "gpu":
            comptime kernel = fused_kernel[dtype]
            var func = ctx.compile_function[kernel]()
            var per_sm = func.occupancy_max_active_blocks_per_multiprocessor(THREADS, 0)
            var ct = col_tiles(rows, n, ctx.default_device_info.sm_count, per_sm)
            ctx.enqueue_function(
                func, y.unsafe_ptr(), x.unsafe_ptr(), gamma.unsafe_ptr(), beta.unsafe_ptr(),
                w.unsafe_ptr(), bias.unsafe_ptr(), Int32(rows), Int32(k), Int32(n), Int32(ct),
                grid_dim=(ceildiv(n, BN * ct), ceildiv(rows, BM)), block_dim=(TN, THREADS // TN),
            )
        else:
            fused_cpu[dtype](
                y.unsafe_ptr(), x.unsafe_ptr(), gamma.unsafe_ptr(), beta.unsafe_ptr(),
                w.unsafe_ptr(), bias.unsafe_ptr(), rows, k, n,
            )
