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
#      shifted by beta as it is staged into the shared-memory tile (a
#      thread's rows are fixed over k, so their mean and rstd sit in
#      registers; its loads share one k column, so one gamma and beta each);
#   3. the bias added in the epilogue.
# Compared with the unfused path it saves the normalized tensor's write and
# read, the transposed weight, the bias pass, and three launches.
#
# col_tiles (picked at launch) trades the two costs a block pays: its
# strip's statistics, once, and its tiles, one after the other. An SM's time
# is about (blocks it runs) x (col_tiles + STATS_COST) tile-times, so the
# launcher picks the col_tiles that minimises ceil(blocks / SMs) x that.
# H100 sweeps of every count at three sizes (results/p22_realistic.txt,
# results/p22_col_tiles.txt) show how close the pick comes to the best.
# What this version changes over the previous one: 128 x 128 tiles with
# loads one step ahead (tiles.mojo), the statistics in registers, and that
# cost model in place of "as many tiles as still fill the GPU", which left a
# half-empty last wave of blocks.

import extensibility
from extensibility import InputTensor, _MutableInputTensor
from max.gpu.host import DeviceContext
from max.gpu import thread_idx, block_idx, barrier, WARP_SIZE
from max.gpu.primitives import warp
from max.gpu.memory import AddressSpace
from std.math import ceildiv, rsqrt
from std.memory import stack_allocation
from std.os import getenv

from .common import EPS, Ptr
from .layernorm import row_stats_cpu
from .tiles import (
    A_LOADS, A_STRIDE, B_LOADS, B_STRIDE, BK, BM, BN, THREADS, TN, Acc, ARegs, BRegs,
    a_k, a_row, accumulate_tile, load_a, store_a, store_tile,
)

comptime NAIVE_BLOCK = 128
comptime MAX_COL_TILES = 8
# A strip's statistics cost about 1/8 of one tile's multiply (fitted to an
# H100 sweep; both grow with k): STATS_COST = 1 / COST_SCALE.
comptime COST_SCALE = 8
comptime N_WARPS = THREADS // WARP_SIZE
comptime ROWS_PER_WARP = BM // N_WARPS


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
def load_x[dtype: DType](
    mut regs: ARegs, mut g: Float32, mut b: Float32, x: Ptr[dtype], gamma: Ptr[dtype], beta: Ptr[dtype],
    row0: Int, k0: Int, m: Int, k: Int, tid: Int,
):
    """This thread's raw x values of the k step at k0, and gamma/beta of its k column
    (every load of a thread shares one column). 0 past the matrix edges."""
    load_a(regs, x, row0, k0, m, k, tid)
    var kc = k0 + a_k(tid)
    g = gamma[unsafe_offset=kc].cast[DType.float32]() if kc < k else 0.0
    b = beta[unsafe_offset=kc].cast[DType.float32]() if kc < k else 0.0


@always_inline
def load_w[dtype: DType](mut regs: BRegs, w: Ptr[dtype], col0: Int, k0: Int, k: Int, n: Int, tid: Int):
    """This thread's values of w [n, k] for the k step at k0: k runs fastest across threads,
    so w is read coalesced as it is stored (no transpose)."""
    comptime for l in range(B_LOADS):
        var idx = tid + l * THREADS
        var kr = k0 + idx % BK
        var col = col0 + idx // BK
        regs[l] = w[unsafe_offset=col * k + kr].cast[DType.float32]() if kr < k and col < n else 0.0


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
    var shift = SIMD[DType.float32, ROWS_PER_WARP](0.0)
    var s1 = SIMD[DType.float32, ROWS_PER_WARP](0.0)
    var s2 = SIMD[DType.float32, ROWS_PER_WARP](0.0)
    comptime for rr in range(ROWS_PER_WARP):
        shift[rr] = x[unsafe_offset=stats_row(row0, warp_id, rr, mm) * kk_n].cast[DType.float32]()
    # All rows in one loop: ROWS_PER_WARP independent loads in flight per lane.
    for i in range(lane, kk_n, WARP_SIZE):
        comptime for rr in range(ROWS_PER_WARP):
            var d = x[unsafe_offset=stats_row(row0, warp_id, rr, mm) * kk_n + i].cast[DType.float32]() - shift[rr]
            s1[rr] += d
            s2[rr] += d * d
    comptime for rr in range(ROWS_PER_WARP):
        var m1 = warp.sum(s1[rr]) / Float32(kk_n)
        var var_ = max(warp.sum(s2[rr]) / Float32(kk_n) - m1 * m1, 0.0)
        if lane == 0:
            mean_s[unsafe_offset=warp_id * ROWS_PER_WARP + rr] = shift[rr] + m1
            rstd_s[unsafe_offset=warp_id * ROWS_PER_WARP + rr] = rsqrt(var_ + EPS)
    # END FILL ME IN
    # Every warp reads rows other warps wrote: wait until all are there.
    barrier()

    # Each thread's tile rows are fixed over k: keep their statistics in registers.
    var row_mean = ARegs(0)
    var row_rstd = ARegs(0)
    comptime for l in range(A_LOADS):
        row_mean[l] = mean_s[unsafe_offset=a_row(tid, l)]
        row_rstd[l] = rstd_s[unsafe_offset=a_row(tid, l)]

    var ct = Int(col_tiles)
    for t in range(ct):
        var col0 = (Int(block_idx.x) * ct + t) * BN
        if col0 >= nn:
            break
        var acc = Acc(0)
        # Raw x, gamma and beta of the next k step, loaded one step ahead;
        # they are normalized when staged.
        var x_regs = ARegs(0)
        var g_reg: Float32 = 0.0
        var b_reg: Float32 = 0.0
        var w_regs = BRegs(0)
        load_x(x_regs, g_reg, b_reg, x, gamma, beta, row0, 0, mm, kk_n, tid)
        load_w(w_regs, w, col0, 0, kk_n, nn, tid)
        for k0 in range(0, kk_n, BK):
            var a_regs = ARegs(0)
            var kc = k0 + a_k(tid)
            comptime for l in range(A_LOADS):
                var v: Float32 = 0.0
                if row0 + a_row(tid, l) < mm and kc < kk_n:
                    # FILL ME IN [fused_normalize_on_load] (roughly 2 lines)
                    # Hint: v = (x - mean) * rstd * gamma + beta, with this load's x_regs[l],
                    # row_mean[l], row_rstd[l] and the k column's g_reg, b_reg.
                    var xn = (x_regs[l] - row_mean[l]) * row_rstd[l]
                    v = xn * g_reg + b_reg
                    # END FILL ME IN
                a_regs[l] = v
            store_a(a_s, a_regs, tid)
            comptime for l in range(B_LOADS):
                var idx = tid + l * THREADS
                b_s[unsafe_offset=(idx % BK) * B_STRIDE + idx // BK] = w_regs[l]
            barrier()
            if k0 + BK < kk_n:
                load_x(x_regs, g_reg, b_reg, x, gamma, beta, row0, k0 + BK, mm, kk_n, tid)
                load_w(w_regs, w, col0, k0 + BK, kk_n, nn, tid)
            accumulate_tile(acc, a_s, b_s, ty, tx)
            barrier()
        store_tile[dtype, True](y, bias, acc, row0, col0, ty, tx, mm, nn)


def col_tiles(rows: Int, n: Int, sm_count: Int) -> Int:
    """Output tiles per block: the count (up to MAX_COL_TILES) minimising
    ceil(blocks / SMs) x (tiles per block + STATS_COST), the time of the
    busiest SM. P22_FUSED_COL_TILES overrides it for sweeps."""
    var forced = getenv("P22_FUSED_COL_TILES", "")
    if forced:
        try:
            return max(1, atol(forced))
        except:
            pass
    var strips = ceildiv(rows, BM)
    var tiles = ceildiv(n, BN)
    var best = 1
    var best_cost = -1
    for ct in range(1, min(MAX_COL_TILES, tiles) + 1):
        var blocks = strips * ceildiv(tiles, ct)
        var cost = ceildiv(blocks, sm_count) * (COST_SCALE * ct + 1)
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
            var ct = col_tiles(rows, n, ctx.default_device_info.sm_count)
            ctx.enqueue_function[kernel](
                y.unsafe_ptr(), x.unsafe_ptr(), gamma.unsafe_ptr(), beta.unsafe_ptr(),
                w.unsafe_ptr(), bias.unsafe_ptr(), Int32(rows), Int32(k), Int32(n), Int32(ct),
                grid_dim=(ceildiv(n, BN * ct), ceildiv(rows, BM)), block_dim=(TN, THREADS // TN),
            )
        else:
            fused_cpu[dtype](
                y.unsafe_ptr(), x.unsafe_ptr(), gamma.unsafe_ptr(), beta.unsafe_ptr(),
                w.unsafe_ptr(), bias.unsafe_ptr(), rows, k, n,
            )
