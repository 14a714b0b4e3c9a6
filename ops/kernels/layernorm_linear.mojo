# layernorm_linear_fwd: y = LayerNorm(x) @ w^T + bias for x [rows, k],
# gamma/beta [k], w [n, k] (nn.Linear's weight), bias [n]; also mean and rstd
# per row (float32) for the backward. fp32, fp16 or bf16 in and out; the
# statistics, the normalization and every product are fp32 (IEEE: no TF32).
#
# GPU mapping: grid (ceil(n / (BN * col_tiles)), ceil(rows / BM)), 256
# threads. A block owns a strip of BM rows:
#   1. prologue: each warp computes mean and rstd of BM / 8 rows in one pass
#      of shifted sums (d = x - x[row, 0], so a mean 1e4 times the spread
#      does not cancel), all its rows at once so each lane keeps one load per
#      row in flight; the strip's statistics stay in shared memory;
#   2. main loop over k in steps of BK: x is normalized, scaled and shifted
#      while it is stored to shared memory (normalize-on-load), so the
#      normalized tensor never reaches device memory; w is read as [n, k]
#      (no transpose). Each thread accumulates a TM x TN patch from float4
#      shared-memory reads; the next k-step's global loads are issued into
#      registers before the current step's FMAs, hiding their latency;
#   3. epilogue: bias added, y stored in x's dtype.
# The block walks col_tiles output tiles of its strip, so the statistics are
# paid once per col_tiles * BN outputs; strips of 32 rows (not 64) when 64
# would leave SMs idle (few rows or small n).
#
# Why this kernel (and where it stands): it targets the shapes where
# LayerNorm's memory traffic dominates (small n), where skipping the write and
# read of the normalized tensor is most of the saving. Measured on the H100
# (results/bench_layernorm_linear.md): fp32 4096 x 4096 -> 64 in 196 us, just
# behind our LayerNorm + cuBLAS (185 us); at large n it runs at about a third of
# cuBLAS's fp32 GEMM and far below its bf16 tensor cores, so the Python op's
# "auto" picks LayerNorm + cuBLAS everywhere. A tensor-core (mma) version is
# the next step. MAX's tuned sm90 matmul takes an epilogue lambda, but it
# dispatches on n and k known at compile time (one compile per weight shape),
# so it is not used here.
# Version 2 (this one) over version 1: BK 64 instead of 16. A strip is
# latency-bound (few blocks, a long k loop); four times the loads in flight
# per step took 4096 x 4096 -> 64 fp32 from 265 to 196 us, but large n got
# slower (4096 x 768 -> 3072 fp32: 822 -> 1211 us; version 1 numbers: results at
# commit f92f4fe), where this kernel is not used.
# CPU: one row at a time, exact two-pass statistics, then the dot products.

import extensibility
from extensibility import InputTensor, _MutableInputTensor
from max.gpu.host import DeviceContext
from max.gpu import thread_idx, block_idx, barrier, WARP_SIZE
from max.gpu.primitives import warp
from max.gpu.memory import AddressSpace
from std.math import ceildiv, rsqrt
from std.memory import stack_allocation, bitcast

from .layernorm import F32, Ptr, load_f32, normalized, row_stats_cpu

comptime LL_THREADS = 256
comptime LL_BN = 64       # output columns per tile
comptime LL_BK = 64       # k per main-loop step (see version 2 above)
comptime LL_TN = 4        # columns per thread
comptime LL_TX = LL_BN // LL_TN
comptime LL_PAD = 4       # shared rows padded by 4 floats: stores by k-column stay (mostly) conflict-free
comptime LL_B_STRIDE = LL_BN + LL_PAD
comptime LL_WARPS = LL_THREADS // WARP_SIZE
comptime LL_MAX_COL_TILES = 4
comptime LL_MIN_BLOCKS_PER_SM = 4
comptime LL_VEC_ALIGN = 16


@always_inline
def strip_row(row0: Int, w: Int, rr: Int, rpw: Int, rows: Int) -> Int:
    """Matrix row of warp w's rr-th statistics row, clamped into the matrix (extra rows are never used)."""
    return min(row0 + w * rpw + rr, rows - 1)


@always_inline
def strip_stats[dtype: DType, BM: Int](
    mean_s: Pointer[Float32, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    rstd_s: Pointer[Float32, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    mean_out: Ptr[F32], rstd_out: Ptr[F32], x: Ptr[dtype], row0: Int, rows: Int, kk: Int,
    eps: Float32, write_out: Bool,
):
    """Mean and rstd of the strip's BM rows into shared memory (and to mean_out/rstd_out if write_out)."""
    comptime RPW = BM // LL_WARPS
    var tid = Int(thread_idx.x)
    var lane = tid % WARP_SIZE
    var w = tid // WARP_SIZE
    var shift = SIMD[F32, RPW](0.0)
    var s1 = SIMD[F32, RPW](0.0)
    var s2 = SIMD[F32, RPW](0.0)
    comptime for rr in range(RPW):
        shift[rr] = load_f32(x, strip_row(row0, w, rr, RPW, rows) * kk)
    for i in range(lane, kk, WARP_SIZE):
        comptime for rr in range(RPW):
            var d = load_f32(x, strip_row(row0, w, rr, RPW, rows) * kk + i) - shift[rr]
            s1[rr] += d
            s2[rr] += d * d
    comptime for rr in range(RPW):
        var m1 = warp.sum(s1[rr]) / Float32(kk)
        var v = max(warp.sum(s2[rr]) / Float32(kk) - m1 * m1, 0.0)
        var rstd = rsqrt(v + eps)
        var m = w * RPW + rr
        if lane == 0:
            mean_s[unsafe_offset=m] = shift[rr] + m1
            rstd_s[unsafe_offset=m] = rstd
            if write_out and row0 + m < rows:
                mean_out[unsafe_offset=row0 + m] = shift[rr] + m1
                rstd_out[unsafe_offset=row0 + m] = rstd


@always_inline
def fetch[A_PER: Int, B_PER: Int, M_STEP: Int, dtype: DType](
    mut ra: SIMD[F32, A_PER], mut rb: SIMD[F32, B_PER], x: Ptr[dtype], w: Ptr[dtype],
    r0: Int, c0: Int, kg: Int, rows: Int, n: Int, k: Int,
):
    """One k-step's global loads into registers: x rows r0 + M_STEP * l, w rows c0 + M_STEP * l, column kg (0 past the edges)."""
    comptime for l in range(A_PER):
        var r = r0 + M_STEP * l
        ra[l] = load_f32(x, r * k + kg) if r < rows and kg < k else 0.0
    comptime for l in range(B_PER):
        var c = c0 + M_STEP * l
        rb[l] = load_f32(w, c * k + kg) if c < n and kg < k else 0.0


def lnl_fwd_kernel[dtype: DType, BM: Int, TM: Int](
    y: Ptr[dtype], mean_out: Ptr[F32], rstd_out: Ptr[F32], x: Ptr[dtype], gamma: Ptr[dtype],
    beta: Ptr[dtype], w: Ptr[dtype], bias: Ptr[dtype], rows: Int32, k: Int32, n: Int32,
    col_tiles: Int32, eps: Float32,
):
    comptime A_STRIDE = BM + LL_PAD
    comptime A_PER = BM * LL_BK // LL_THREADS   # x elements each thread stages per k-step
    comptime B_PER = LL_BN * LL_BK // LL_THREADS
    comptime M_STEP = LL_THREADS // LL_BK       # rows between a thread's staged x elements
    var a_s = stack_allocation[LL_BK * A_STRIDE, F32, address_space=AddressSpace.SHARED]()
    var b_s = stack_allocation[LL_BK * LL_B_STRIDE, F32, address_space=AddressSpace.SHARED]()
    var mean_s = stack_allocation[BM, F32, address_space=AddressSpace.SHARED]()
    var rstd_s = stack_allocation[BM, F32, address_space=AddressSpace.SHARED]()
    var mm = Int(rows)
    var kk = Int(k)
    var nn = Int(n)
    var tid = Int(thread_idx.x)
    var tx = tid % LL_TX
    var ty = tid // LL_TX
    var row0 = Int(block_idx.y) * BM
    strip_stats[dtype, BM](mean_s, rstd_s, mean_out, rstd_out, x, row0, mm, kk, eps, Int(block_idx.x) == 0)
    barrier()

    # Staging map: thread tid stages k-column kc = tid % LL_BK of the step,
    # rows tid // LL_BK + M_STEP * l (x) and columns likewise (w): consecutive
    # threads read consecutive k, so global reads coalesce along rows.
    var kc = tid % LL_BK
    var m_first = tid // LL_BK
    var ct = Int(col_tiles)
    for t in range(ct):
        var col0 = (Int(block_idx.x) * ct + t) * LL_BN
        if col0 >= nn:
            break
        var acc = SIMD[F32, TM * LL_TN](0.0)
        var ra = SIMD[F32, A_PER](0.0)
        var rb = SIMD[F32, B_PER](0.0)

        fetch[A_PER, B_PER, M_STEP](ra, rb, x, w, row0 + m_first, col0 + m_first, kc, mm, nn, kk)
        for k0 in range(0, kk, LL_BK):
            var kg = k0 + kc
            var g: Float32 = 0.0
            var b: Float32 = 0.0
            if kg < kk:
                g = load_f32(gamma, kg)
                b = load_f32(beta, kg)
            comptime for l in range(A_PER):
                var m = m_first + M_STEP * l
                # Out-of-range k stays 0 (g = b = 0), so padding adds nothing to the dot products.
                a_s[unsafe_offset=kc * A_STRIDE + m] = (ra[l] - mean_s[unsafe_offset=m]) * rstd_s[unsafe_offset=m] * g + b
            comptime for l in range(B_PER):
                b_s[unsafe_offset=kc * LL_B_STRIDE + m_first + M_STEP * l] = rb[l]
            barrier()
            if k0 + LL_BK < kk:
                fetch[A_PER, B_PER, M_STEP](ra, rb, x, w, row0 + m_first, col0 + m_first, k0 + LL_BK + kc, mm, nn, kk)
            comptime for q in range(LL_BK):
                var av = a_s.unsafe_load[width=TM, alignment=4 * TM](q * A_STRIDE + ty * TM)
                var bv = b_s.unsafe_load[width=LL_TN, alignment=LL_VEC_ALIGN](q * LL_B_STRIDE + tx * LL_TN)
                comptime for i in range(TM):
                    var part = acc.slice[LL_TN, offset=i * LL_TN]() + av[i] * bv
                    acc = acc.insert[offset=i * LL_TN](part)
            barrier()
        comptime for i in range(TM):
            var r = row0 + ty * TM + i
            comptime for j in range(LL_TN):
                var c = col0 + tx * LL_TN + j
                if r < mm and c < nn:
                    y[unsafe_offset=r * nn + c] = (acc[i * LL_TN + j] + load_f32(bias, c)).cast[dtype]()


def col_tiles_for(rows: Int, n: Int, bm: Int, sm_count: Int) -> Int:
    """Tiles per block: up to LL_MAX_COL_TILES share one strip's statistics, fewer when the grid would underfill."""
    var ct = LL_MAX_COL_TILES
    while ct > 1 and ceildiv(n, LL_BN * ct) * ceildiv(rows, bm) < LL_MIN_BLOCKS_PER_SM * sm_count:
        ct //= 2
    return ct


def launch_fwd[dtype: DType, BM: Int, TM: Int](
    ctx: DeviceContext, y: Ptr[dtype], mean: Ptr[F32], rstd: Ptr[F32], x: Ptr[dtype], gamma: Ptr[dtype],
    beta: Ptr[dtype], w: Ptr[dtype], bias: Ptr[dtype], rows: Int, k: Int, n: Int, eps: Float32,
) raises:
    comptime kernel = lnl_fwd_kernel[dtype, BM, TM]
    var ct = col_tiles_for(rows, n, BM, ctx.default_device_info.sm_count)
    ctx.enqueue_function[kernel](y, mean, rstd, x, gamma, beta, w, bias, Int32(rows), Int32(k), Int32(n),
                                 Int32(ct), eps,
                                 grid_dim=(ceildiv(n, LL_BN * ct), ceildiv(rows, BM)), block_dim=LL_THREADS)


def fwd_gpu[dtype: DType](
    ctx: DeviceContext, y: Ptr[dtype], mean: Ptr[F32], rstd: Ptr[F32], x: Ptr[dtype], gamma: Ptr[dtype],
    beta: Ptr[dtype], w: Ptr[dtype], bias: Ptr[dtype], rows: Int, k: Int, n: Int, eps: Float32,
) raises:
    # 64-row strips (4x4 patches) unless that leaves fewer than two blocks per SM.
    if ceildiv(rows, 64) * ceildiv(n, LL_BN) >= 2 * ctx.default_device_info.sm_count:
        launch_fwd[dtype, 64, 4](ctx, y, mean, rstd, x, gamma, beta, w, bias, rows, k, n, eps)
    else:
        launch_fwd[dtype, 32, 2](ctx, y, mean, rstd, x, gamma, beta, w, bias, rows, k, n, eps)


def fwd_cpu[dtype: DType](
    y: Ptr[dtype], mean_out: Ptr[F32], rstd_out: Ptr[F32], x: Ptr[dtype], gamma: Ptr[dtype],
    beta: Ptr[dtype], w: Ptr[dtype], bias: Ptr[dtype], rows: Int, k: Int, n: Int, eps: Float32,
):
    var xn = List[Float32](length=k, fill=0.0)  # the row, normalized once for all n outputs
    for r in range(rows):
        var base = r * k
        var mean, rstd = row_stats_cpu(x, base, k, eps)
        mean_out[unsafe_offset=r] = mean
        rstd_out[unsafe_offset=r] = rstd
        for i in range(k):
            xn[i] = normalized(x, gamma, beta, base, i, mean, rstd)
        for j in range(n):
            var acc: Float32 = 0.0
            for i in range(k):
                acc += xn[i] * load_f32(w, j * k + i)
            y[unsafe_offset=r * n + j] = (acc + load_f32(bias, j)).cast[dtype]()


@extensibility.register("layernorm_linear_fwd")
struct LayerNormLinearFwd:
    @staticmethod
    def execute[target: StaticString, dtype: DType, eps_bits: Int](
        y: _MutableInputTensor[dtype=dtype, rank=2, static_spec=_],
        mean: _MutableInputTensor[dtype=F32, rank=1, static_spec=_],
        rstd: _MutableInputTensor[dtype=F32, rank=1, static_spec=_],
        x: InputTensor[dtype=dtype, rank=2, static_spec=_],
        gamma: InputTensor[dtype=dtype, rank=1, static_spec=_],
        beta: InputTensor[dtype=dtype, rank=1, static_spec=_],
        w: InputTensor[dtype=dtype, rank=2, static_spec=_],
        bias: InputTensor[dtype=dtype, rank=1, static_spec=_],
        ctx: DeviceContext,
    ) raises:
        comptime eps = bitcast[F32](UInt32(eps_bits))
        var rows = x.dim_size(0)
        var k = x.dim_size(1)
        var n = w.dim_size(0)
        comptime if target == "gpu":
            fwd_gpu[dtype](ctx, y.unsafe_ptr(), mean.unsafe_ptr(), rstd.unsafe_ptr(), x.unsafe_ptr(),
                           gamma.unsafe_ptr(), beta.unsafe_ptr(), w.unsafe_ptr(), bias.unsafe_ptr(),
                           rows, k, n, eps)
        else:
            fwd_cpu[dtype](y.unsafe_ptr(), mean.unsafe_ptr(), rstd.unsafe_ptr(), x.unsafe_ptr(),
                           gamma.unsafe_ptr(), beta.unsafe_ptr(), w.unsafe_ptr(), bias.unsafe_ptr(),
                           rows, k, n, eps)
