# LayerNorm + Linear forward: y = LayerNorm(x) @ w^T + bias for x [rows, k], gamma/beta [k], w [n, k] and
# bias [n], plus mean and rstd per row (float32). fp32, fp16 or bf16; fp32 statistics and accumulation.
# One read of x: the GEMM runs on d = x - c (c: a per-row shift) against w * gamma while the same loads give
# the row's sums, and the normalization is applied to the GEMM's result through the fold G = w gamma,
# B = w beta + bias (made at every call: nothing derived from the weights is kept).
# GPU mapping (launch plans: ops/layernorm_linear/config.py):
#   layernorm_linear_fold: a block of 256 threads per output column: G and B + bias, fixed-order sums.
#   layernorm_linear_fwd_mma (fp16/bf16): grid (rows / 64, n / 64, k splits), 4 warps of 16 x 64 outputs (mma.sync
#     m16n8k16, a cp.async ring); a tile's last block sums its splits in a fixed order and writes y.
#   layernorm_linear_fwd_splitk + layernorm_linear_fwd_splitk_finish (fp32, IEEE FMAs): the same grid, partials to scratch, then a
#     finish that sums them in a fixed order. Deterministic: no float atomics.
# Limits: wins where n is small and x long (auto's "fused" region); at large n cuBLAS wins ("unfused").
# The CPU path (fwd_cpu) takes one row at a time with exact two-pass statistics.
# Design, the GPU mapping in detail and the measurements behind it: docs/kernels/layernorm_linear.md.

import extensibility
from extensibility import InputTensor, _MutableInputTensor
from max.gpu.host import DeviceContext, FuncAttribute
from max.gpu import thread_idx, block_idx, grid_dim, barrier, WARP_SIZE
from max.gpu.intrinsics import threadfence
from std.atomic import Atomic, Ordering
from max.gpu.compute.mma import mma, ld_matrix
from max.gpu.primitives import warp
from max.gpu.memory import AddressSpace, async_copy, async_copy_commit_group, async_copy_wait_group, external_memory
from std.math import ceildiv
from std.memory import stack_allocation, bitcast
from std.sys import size_of
from std.utils.static_tuple import StaticTuple
from max.gpu import MAX_THREADS_PER_BLOCK_METADATA

from .layernorm import (ALIGN, F32, Ptr, aligned, group_sum, load_f32, normalized, row_stats_cpu, shifted_stats,
                        vector_width)

comptime TILE_THREADS = 128
comptime TILE_ROWS = 64          # rows per block: 4 warps x 16 mma rows
comptime TILE_COLS = 64          # columns per block: 8 mma tiles of 8
comptime STAGE_THREADS_PER_ROW = 8        # threads staging one row: 8 x 16 bytes per step
comptime STAGE_ROWS_PER_PASS = TILE_THREADS // STAGE_THREADS_PER_ROW
comptime STAGE_PASSES = TILE_ROWS // STAGE_ROWS_PER_PASS   # rows each thread stages per step
comptime OUTPUTS_PER_THREAD = TILE_ROWS * TILE_COLS // TILE_THREADS    # outputs per thread
comptime MMA_M = 16
comptime MMA_N = 8
comptime MMA_K = 16
comptime SIMT_TY = TILE_THREADS // STAGE_THREADS_PER_ROW        # fp32 patch: thread rows ty + 16 i, columns tx + 8 j
comptime SIMT_ROWS = TILE_ROWS // SIMT_TY
comptime SIMT_COLS = TILE_COLS // STAGE_THREADS_PER_ROW
comptime SIMT_PAD = 1         # fp32 shared rows of 32 + 1: the SIMT loop's column reads are conflict-free
comptime SHIFT_SAMPLE = 8    # elements averaged into a row's shift
comptime FINISH_COLS = 64       # finish kernel: 4 rows x 64 columns per block
comptime FINISH_ROWS = 4
# The 16-bit kernel's own finish, fp32 slots in its (then idle) shared memory: per row of the
# tile its sums (then m1 and rstd) and shift, per column G and B, and the "last block" flag.
comptime FINISH_AT_SUM1 = 0
comptime FINISH_AT_SUM2 = FINISH_AT_SUM1 + TILE_ROWS
comptime FINISH_AT_FOLD_G = FINISH_AT_SUM2 + TILE_ROWS
comptime FINISH_AT_FOLD_B = FINISH_AT_FOLD_G + TILE_COLS
comptime FINISH_AT_SHIFT = FINISH_AT_FOLD_B + TILE_COLS
comptime FINISH_AT_FLAG = FINISH_AT_SHIFT + TILE_ROWS


@always_inline
def stage_load[dtype: DType, VEC: Int](
    p: Ptr[dtype], r: Int, nrows: Int, stride: Int, kg: Int, k_hi: Int, vec_ok: Bool,
) -> SIMD[dtype, VEC]:
    """Elements kg.. kg + VEC of row r (zeros past the chunk end k_hi or past nrows)."""
    var v = SIMD[dtype, VEC](0)
    if r < nrows:
        if vec_ok and kg + VEC <= k_hi:
            v = p.unsafe_load[width=VEC, alignment=ALIGN](r * stride + kg)
        else:
            comptime for e in range(VEC):
                if kg + e < k_hi:
                    v[e] = p[unsafe_offset=r * stride + kg + e]
    return v


@always_inline
def row_shift[dtype: DType](x: Ptr[dtype], r: Int, k: Int) -> Float32:
    """Mean of row r's first min(k, SHIFT_SAMPLE) elements (16-bit rows: see snap_shift):
    both kernels compute it the same way."""
    var s: Float32 = 0.0
    var lo = Float32.MAX
    var hi = -Float32.MAX
    var n = min(k, SHIFT_SAMPLE)
    if k >= SHIFT_SAMPLE:   # unrolled: the loads fly together (this starts every block)
        comptime for e in range(SHIFT_SAMPLE):
            var v = load_f32(x, r * k + e)
            s += v
            lo = min(lo, v)
            hi = max(hi, v)
    else:
        for e in range(k):
            var v = load_f32(x, r * k + e)
            s += v
            lo = min(lo, v)
            hi = max(hi, v)
    comptime if dtype == F32:
        return s / Float32(n)
    return snap_shift(s / Float32(n), lo, hi)


@always_inline
def snap_shift(c: Float32, lo: Float32, hi: Float32) -> Float32:
    """The 16-bit kernel's shift: 0 unless the sample [lo, hi] sits within 1/16 of one value (a mean
    far above the spread), then c rounded to a multiple of 2^(e - 5), e the exponent of the larger end.

    That kernel forms x - c in 16-bit arithmetic, and its statistics must be fp32-exact. With c = 0,
    x - c is x; a far-off mean makes every x lie within 50% of c, whose spacing then divides the grid
    and |x - c| <= |x|, so x - c is exact too. An unrounded shift near the spread made every x of a
    binade round alike and the sums drift (mean errors of 1e-3 at bf16 in the H100 tests). The window
    was 25%: a row of mean 3 and spread 1 whose first 8 elements fell that close by chance shifted,
    its elements below c / 2 rounded, and its rstd came out 5e-4 off (H100, test_gpu_sm90).
    Within 1/16, a row shifts only if its mean is about 16 sample ranges from 0, so an element must lie
    8 such ranges out to fall outside the 50%."""
    var small = min(abs(lo), abs(hi))
    var big = max(abs(lo), abs(hi))
    if lo * hi <= 0.0 or big >= 1.0625 * small:
        return 0.0
    var e = UInt32(max(Int((bitcast[DType.uint32](big) >> 23) & 0xFF) - 5, 1))   # q's biased exponent
    var q = bitcast[F32](e << 23)
    # c * (1 / q) is c / q exactly (q is a power of two), without a division's slow-path check
    return round(c * bitcast[F32]((UInt32(254) - e) << 23)) * q


@always_inline
def lanes_sum[LANES: Int](v: Float32) -> Float32:
    """Sum over LANES consecutive lanes (a power of two; LANES-aligned groups), in a fixed order."""
    var s = v
    comptime for i in range(5):   # spans LANES / 2, LANES / 4, .., 1
        comptime span = LANES >> (i + 1)
        comptime if span > 0:
            s += warp.shuffle_xor(s, UInt32(span))
    return s


@always_inline
def stage_store[dtype: DType, VEC: Int, STRIDE: Int](
    sh: Pointer[Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED], row: Int, col: Int,
    v: SIMD[dtype, VEC],
):
    comptime for e in range(VEC):   # rows are padded to an odd length: no 16-byte alignment
        sh[unsafe_offset=row * STRIDE + col + e] = v[e]


@always_inline
def simt_step[dtype: DType, STRIDE: Int](
    mut acc: SIMD[F32, OUTPUTS_PER_THREAD],
    a_s: Pointer[Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    b_s: Pointer[Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    ty: Int, tx: Int, q: Int,
):
    """One k of the fp32 thread patch: rows ty + 16 i, columns tx + 8 j."""
    var av = SIMD[F32, SIMT_ROWS](0.0)
    var bv = SIMD[F32, SIMT_COLS](0.0)
    comptime for i in range(SIMT_ROWS):
        av[i] = a_s[unsafe_offset=(ty + SIMT_TY * i) * STRIDE + q].cast[F32]()
    comptime for j in range(SIMT_COLS):
        bv[j] = b_s[unsafe_offset=(tx + STAGE_THREADS_PER_ROW * j) * STRIDE + q].cast[F32]()
    comptime for i in range(SIMT_ROWS):
        var part = acc.slice[SIMT_COLS, offset=i * SIMT_COLS]() + av[i] * bv
        acc = acc.insert[offset=i * SIMT_COLS](part)


def layernorm_linear_fwd_splitk[dtype: DType](   # float32 only (fp16/bf16: layernorm_linear_fwd_mma)
    part_acc: Ptr[F32], part_rows: Ptr[F32], mean_out: Ptr[F32], x: Ptr[dtype], gamma: Ptr[dtype],
    w: Ptr[dtype], rows: Int32, k: Int32, n: Int32, chunk: Int32, vec_ok: Int32,
):
    comptime VEC = vector_width[dtype]()
    comptime BK = STAGE_THREADS_PER_ROW * VEC
    comptime STRIDE = BK + SIMT_PAD
    comptime W = STAGE_PASSES * VEC
    var a_s = stack_allocation[TILE_ROWS * STRIDE, dtype, address_space=AddressSpace.SHARED]()
    var b_s = stack_allocation[TILE_COLS * STRIDE, dtype, address_space=AddressSpace.SHARED]()
    var mm = Int(rows)
    var kk = Int(k)
    var nn = Int(n)
    var tid = Int(thread_idx.x)
    var lr = tid // STAGE_THREADS_PER_ROW
    var lc = (tid % STAGE_THREADS_PER_ROW) * VEC
    var row0 = Int(block_idx.x) * TILE_ROWS
    var col0 = Int(block_idx.y) * TILE_COLS
    var z = Int(block_idx.z)
    var k_lo = z * Int(chunk)
    var k_hi = min(kk, k_lo + Int(chunk))
    var vok = vec_ok != 0

    var shift = SIMD[F32, STAGE_PASSES](0.0)
    comptime for p in range(STAGE_PASSES):
        shift[p] = row_shift(x, min(row0 + lr + STAGE_ROWS_PER_PASS * p, mm - 1), kk)
    var s1 = SIMD[F32, STAGE_PASSES](0.0)
    var s2 = SIMD[F32, STAGE_PASSES](0.0)
    var acc = SIMD[F32, OUTPUTS_PER_THREAD](0.0)
    var xr = SIMD[dtype, W](0)
    var wr = SIMD[dtype, W](0)
    comptime for p in range(STAGE_PASSES):
        var r = lr + STAGE_ROWS_PER_PASS * p
        xr = xr.insert[offset=p * VEC](stage_load[dtype, VEC](x, row0 + r, mm, kk, k_lo + lc, k_hi, vok))
        wr = wr.insert[offset=p * VEC](stage_load[dtype, VEC](w, col0 + r, nn, kk, k_lo + lc, k_hi, vok))

    for k0 in range(k_lo, k_hi, BK):
        var kg = k0 + lc
        var gv = stage_load[dtype, VEC](gamma, 0, 1, 0, kg, k_hi, vok).cast[F32]()
        comptime for p in range(STAGE_PASSES):
            var r = lr + STAGE_ROWS_PER_PASS * p
            var d = xr.slice[VEC, offset=p * VEC]().cast[F32]() - shift[p]
            if kg + VEC > k_hi:   # the chunk's tail: padding must not reach the sums
                comptime for e in range(VEC):
                    if kg + e >= k_hi:
                        d[e] = 0.0
            s1[p] += d.reduce_add()
            s2[p] += (d * d).reduce_add()
            stage_store[dtype, VEC, STRIDE](a_s, r, lc, (d * gv).cast[dtype]())
            stage_store[dtype, VEC, STRIDE](b_s, r, lc, wr.slice[VEC, offset=p * VEC]())
        barrier()
        if k0 + BK < k_hi:   # next step's loads fly while this one computes
            comptime for p in range(STAGE_PASSES):
                var r = lr + STAGE_ROWS_PER_PASS * p
                xr = xr.insert[offset=p * VEC](stage_load[dtype, VEC](x, row0 + r, mm, kk, kg + BK, k_hi, vok))
                wr = wr.insert[offset=p * VEC](stage_load[dtype, VEC](w, col0 + r, nn, kk, kg + BK, k_hi, vok))
        comptime for q in range(BK):
            simt_step[dtype, STRIDE](acc, a_s, b_s, tid // STAGE_THREADS_PER_ROW, tid % STAGE_THREADS_PER_ROW, q)
        barrier()

    write_partials(part_acc, acc, row0, col0, z, mm, nn, tid)
    comptime for p in range(STAGE_PASSES):
        var t1 = lanes_sum[STAGE_THREADS_PER_ROW](s1[p])
        var t2 = lanes_sum[STAGE_THREADS_PER_ROW](s2[p])
        var r = lr + STAGE_ROWS_PER_PASS * p
        if tid % STAGE_THREADS_PER_ROW == 0:
            if block_idx.y == 0 and row0 + r < mm:
                part_rows[unsafe_offset=2 * (z * mm + row0 + r)] = t1
                part_rows[unsafe_offset=2 * (z * mm + row0 + r) + 1] = t2
                if z == 0:   # the finish adds the mean's shifted part
                    mean_out[unsafe_offset=row0 + r] = shift[p]


comptime SPtr[dtype: DType] = Pointer[Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED]
comptime MMA_STAGES = 3                   # k steps in flight per block (the cp.async ring)
comptime MMA_STEP_K = 64                      # k elements per step: 128 bytes of each 16-bit row
comptime MMA_STRIDE = MMA_STEP_K + 8          # shared rows: 16-byte aligned, fragment loads conflict-free
comptime MMA_CHUNKS = MMA_STEP_K // 8         # 16-byte copies per row per step
comptime MMA_TILE = (TILE_ROWS + TILE_COLS) * MMA_STRIDE + MMA_STEP_K   # one step: x rows, w rows, gamma
comptime MMA_COPIES = (TILE_ROWS + TILE_COLS) * MMA_CHUNKS // TILE_THREADS  # row copies per thread per step
comptime MMA_SMEM_BYTES = MMA_STAGES * MMA_TILE * 2
comptime MMA_MIN_BLOCKS = 4               # blocks per SM the register budget must allow


@always_inline
def chunk_copy[dtype: DType, VEC_OK: Bool](
    dst: SPtr[dtype], src: Ptr[dtype], r: Int, nrows: Int, k: Int, kg: Int, k_hi: Int,
):
    """Elements kg.. kg + 8 of row r of src (row length k) into dst, zeros past k_hi or nrows:
    an asynchronous 16-byte copy when rows are 16-byte aligned (then k_hi is a multiple of 8 and
    a chunk is whole or empty), element loads otherwise."""
    comptime if VEC_OK:
        var ok = r < nrows and kg < k_hi
        var g = src.unsafe_address_space_cast[AddressSpace.GLOBAL]()
        async_copy[16, fill=Scalar[dtype](0)](g.unsafe_offset(r * k + kg if ok else 0), dst,
                                              src_size=Int32(16 if ok else 0))
    else:
        dst.unsafe_store[alignment=ALIGN](0, stage_load[dtype, 8](src, r, nrows, k, kg, k_hi, False))


@always_inline
def issue_step[dtype: DType, VEC_OK: Bool](
    tile: SPtr[dtype], x: Ptr[dtype], gamma: Ptr[dtype], w: Ptr[dtype], row0: Int, col0: Int,
    mm: Int, nn: Int, kk: Int, k0: Int, k_hi: Int, tid: Int,
):
    """Starts the copies of one k step into tile: 64 x rows, 64 w rows, then gamma."""
    comptime for i in range(MMA_COPIES):
        var idx = tid + TILE_THREADS * i
        var r = idx // MMA_CHUNKS
        var kc = (idx % MMA_CHUNKS) * 8
        var dst = tile.unsafe_offset(r * MMA_STRIDE + kc)
        if r < TILE_ROWS:
            chunk_copy[dtype, VEC_OK](dst, x, row0 + r, mm, kk, k0 + kc, k_hi)
        else:
            chunk_copy[dtype, VEC_OK](dst, w, col0 + r - TILE_ROWS, nn, kk, k0 + kc, k_hi)
    if tid < MMA_CHUNKS:
        chunk_copy[dtype, VEC_OK](tile.unsafe_offset((TILE_ROWS + TILE_COLS) * MMA_STRIDE + tid * 8), gamma, 0, 1, kk,
                                  k0 + tid * 8, k_hi)


@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(TILE_THREADS)),
    `nvvm.minctasm`=SIMDLength(MMA_MIN_BLOCKS),
)
def layernorm_linear_fwd_mma[dtype: DType, VEC_OK: Bool](
    y: Ptr[dtype], mean_out: Ptr[F32], rstd_out: Ptr[F32], fold: Ptr[F32], part_acc: Ptr[F32],
    part_rows: Ptr[F32], counters: Ptr[DType.int32], x: Ptr[dtype], gamma: Ptr[dtype], w: Ptr[dtype],
    rows: Int32, k: Int32, n: Int32, chunk: Int32, eps: Float32,
):
    var mm = Int(rows)
    var kk = Int(k)
    var nn = Int(n)
    var tid = Int(thread_idx.x)
    var col0 = Int(block_idx.y) * TILE_COLS
    var z = Int(block_idx.z)
    var k_lo = z * Int(chunk)
    var k_hi = min(kk, k_lo + Int(chunk))
    var smem = external_memory[Scalar[dtype], address_space=AddressSpace.SHARED, alignment=ALIGN]()
    var lane = tid % WARP_SIZE
    var wid = tid // WARP_SIZE
    var wrow = wid * MMA_M
    var g = lane // 4
    var t = lane % 4
    var row0 = Int(block_idx.x) * TILE_ROWS
    var steps = ceildiv(max(k_hi - k_lo, 0), MMA_STEP_K)

    comptime for s in range(MMA_STAGES - 1):
        if s < steps:
            issue_step[dtype, VEC_OK](smem.unsafe_offset(s * MMA_TILE), x, gamma, w, row0, col0, mm, nn, kk,
                                      k_lo + s * MMA_STEP_K, k_hi, tid)
        async_copy_commit_group()   # empty groups keep the count uniform: step s is group s
    var r_top = row0 + wrow + g     # the thread's fragment rows: r_top, r_top + 8
    # ldmatrix x4 row addresses: lanes 8q.. 8q + 7 give matrix q's rows. A: q = 0..3 are rows 0-7 / 8-15
    # by k 0-7 / 8-15 (the fragment's register order); B: two n tiles, each k 0-7 then k 8-15.
    var a_lm = (wrow + lane % 8 + 8 * ((lane // 8) % 2)) * MMA_STRIDE + 8 * (lane // 16)
    var b_lm = (lane % 8 + 8 * (lane // 16)) * MMA_STRIDE + 8 * ((lane // 8) % 2)
    var sh0 = row_shift(x, min(r_top, mm - 1), kk)
    var sh1 = row_shift(x, min(r_top + 8, mm - 1), kk)
    var shv = SIMD[F32, 8](sh0, sh0, sh1, sh1, sh0, sh0, sh1, sh1).cast[dtype]()
    var ones = SIMD[dtype, 4](1)
    var s1 = SIMD[F32, 4](0.0)    # d @ ones: every column holds the row sums
    var s2a = SIMD[F32, 4](0.0)   # d @ d[0:8]^T: the diagonal holds rows 0-7's sums of squares
    var s2b = SIMD[F32, 4](0.0)   # d @ d[8:16]^T: rows 8-15
    var acc = SIMD[F32, OUTPUTS_PER_THREAD](0.0)
    var slot = 0                         # step s's ring slot (s % MMA_STAGES without a division)
    var fill = MMA_STAGES - 1            # the slot step s + MMA_STAGES - 1 goes to
    for s in range(steps):
        async_copy_wait_group(Int32(MMA_STAGES - 2))   # this thread's copies of step s have landed ...
        barrier()   # ... everyone's have, and everyone is done with the slot refilled next
        if s + MMA_STAGES - 1 < steps:
            issue_step[dtype, VEC_OK](smem.unsafe_offset(fill * MMA_TILE), x, gamma, w, row0, col0, mm, nn,
                                      kk, k_lo + (s + MMA_STAGES - 1) * MMA_STEP_K, k_hi, tid)
        async_copy_commit_group()
        var a_s = smem.unsafe_offset(slot * MMA_TILE)
        var b_s = a_s.unsafe_offset(TILE_ROWS * MMA_STRIDE)
        var g_s = b_s.unsafe_offset(TILE_COLS * MMA_STRIDE)
        slot = 0 if slot == MMA_STAGES - 1 else slot + 1
        fill = 0 if fill == MMA_STAGES - 1 else fill + 1
        var tail = k_lo + (s + 1) * MMA_STEP_K > k_hi   # the chunk's last step may hold zero-filled columns
        comptime for kq in range(0, MMA_STEP_K, MMA_K):
            var c = kq + 2 * t
            var af = ld_matrix[simd_width=8](a_s.unsafe_offset(a_lm + kq))
            var a = af - shv
            if tail:   # zero-filled columns must not reach the sums
                var cols = SIMD[DType.int32, 8](0, 1, 0, 1, 8, 9, 8, 9) + Int32(k_lo + s * MMA_STEP_K + c)
                a = cols.lt(SIMD[DType.int32, 8](Int32(k_hi))).select(a, SIMD[dtype, 8](0))
            var gm = g_s.unsafe_load[width=2, alignment=4](c).join(g_s.unsafe_load[width=2, alignment=4](c + 8))
            var t4 = SIMD[F32, 4](0.0)
            mma(t4, a, ones, s1)
            s1 = t4
            mma(t4, a, a.slice[2, offset=0]().join(a.slice[2, offset=4]()), s2a)
            s2a = t4
            mma(t4, a, a.slice[2, offset=2]().join(a.slice[2, offset=6]()), s2b)
            s2b = t4
            comptime for np in range(TILE_COLS // (2 * MMA_N)):
                var bq = ld_matrix[simd_width=8](b_s.unsafe_offset(b_lm + np * 2 * MMA_N * MMA_STRIDE + kq))
                comptime for h in range(2):
                    comptime nt = 2 * np + h
                    var dd = SIMD[F32, 4](0.0)
                    mma(dd, a, bq.slice[4, offset=4 * h]() * gm, acc.slice[4, offset=nt * 4]())
                    acc = acc.insert[offset=nt * 4](dd)

    # Diagonal (g, g) sits in lane 4g + g / 2, element g % 2 (rows 8-15: elements 2, 3).
    var src = UInt32(4 * g + g // 2)
    var odd = g % 2 == 1
    var q2 = SIMD[F32, 2](warp.shuffle_idx(s2a[1] if odd else s2a[0], src),
                          warp.shuffle_idx(s2b[3] if odd else s2b[2], src))
    barrier()   # the ring's memory is free: it now holds the tile's reductions (FINISH_AT_* offsets)
    var red = smem.unsafe_bitcast[Float32]()
    if t == 0:
        red[unsafe_offset=FINISH_AT_SHIFT + wrow + g] = sh0
        red[unsafe_offset=FINISH_AT_SHIFT + wrow + g + 8] = sh1
    var splits = Int(grid_dim.z)
    if splits == 1:   # the block holds the whole sums: straight to the finish
        if t == 0:
            comptime for h in range(2):
                red[unsafe_offset=FINISH_AT_SUM1 + wrow + g + 8 * h] = s1[2 * h]
                red[unsafe_offset=FINISH_AT_SUM2 + wrow + g + 8 * h] = q2[h]
    else:
        var tile = Int(block_idx.x) * Int(grid_dim.y) + Int(block_idx.y)
        var tiles = Int(grid_dim.x) * Int(grid_dim.y)
        var slab = z * tiles + tile   # this block's slot in the [splits, tiles, ...] scratch
        comptime for nt in range(TILE_COLS // MMA_N):   # fragment order: a warp's store is one 512-byte run
            part_acc.unsafe_store[alignment=16]((slab * 8 + nt) * 4 * TILE_THREADS + 4 * tid,
                                                acc.slice[4, offset=4 * nt]())
        if t == 0:
            comptime for h in range(2):
                part_rows.unsafe_store[alignment=8](slab * 2 * TILE_ROWS + 2 * (wrow + g + 8 * h),
                                                    SIMD[F32, 2](s1[2 * h], q2[h]))
        # The last of the tile's blocks to get here sums every split (threadFenceReduction's pattern).
        threadfence()
        barrier()
        if tid == 0:
            var last = Atomic[Int32, scope="device"].fetch_add[ordering=Ordering.RELAXED](
                counters.unsafe_offset(tile), Int32(1)) == Int32(splits - 1)
            if last:
                counters[unsafe_offset=tile] = 0   # ready for the next call
            red[unsafe_offset=FINISH_AT_FLAG] = 1.0 if last else 0.0
        barrier()
        if red[unsafe_offset=FINISH_AT_FLAG] == 0.0:
            return
        threadfence()
        # Every split in the fixed order 0, 1, ..: bitwise the same whichever block finishes.
        var rs = SIMD[F32, 2](0.0)   # thread tid < 64: (s1, s2) of row tid
        acc = SIMD[F32, OUTPUTS_PER_THREAD](0.0)
        for zz in range(splits):
            var sl = zz * tiles + tile
            comptime for nt in range(TILE_COLS // MMA_N):
                acc = acc.insert[offset=4 * nt](acc.slice[4, offset=4 * nt]() + part_acc.unsafe_load[
                    width=4, alignment=16]((sl * 8 + nt) * 4 * TILE_THREADS + 4 * tid))
            if tid < TILE_ROWS:
                rs += part_rows.unsafe_load[width=2, alignment=8](sl * 2 * TILE_ROWS + 2 * tid)
        if tid < TILE_ROWS:
            red[unsafe_offset=FINISH_AT_SUM1 + tid] = rs[0]
            red[unsafe_offset=FINISH_AT_SUM2 + tid] = rs[1]
    # G, then B + bias (FINISH_AT_FOLD_B = FINISH_AT_FOLD_G + 64): the tile's 64 columns of fold [2, n]
    var fc = col0 + tid % TILE_COLS
    red[unsafe_offset=FINISH_AT_FOLD_G + tid] = fold[unsafe_offset=(tid // TILE_COLS) * nn + fc] if fc < nn else 0.0
    barrier()
    if tid < TILE_ROWS:   # row statistics; mean and rstd out once per row (column-tile 0)
        var m1, rstd = shifted_stats(red[unsafe_offset=FINISH_AT_SUM1 + tid], red[unsafe_offset=FINISH_AT_SUM2 + tid], 0.0, kk, eps)
        red[unsafe_offset=FINISH_AT_SUM1 + tid] = m1
        red[unsafe_offset=FINISH_AT_SUM2 + tid] = rstd
        if block_idx.y == 0 and row0 + tid < mm:
            # mean - shift is m1 = s1 / k itself, never (shift + m1) - shift: no rounding through the large mean.
            mean_out[unsafe_offset=row0 + tid] = red[unsafe_offset=FINISH_AT_SHIFT + tid] + m1
            rstd_out[unsafe_offset=row0 + tid] = rstd
    barrier()
    comptime for h in range(2):
        var lr = wrow + g + 8 * h
        var r = row0 + lr
        var m1 = red[unsafe_offset=FINISH_AT_SUM1 + lr]
        var rstd = red[unsafe_offset=FINISH_AT_SUM2 + lr]
        comptime for nt in range(TILE_COLS // MMA_N):
            comptime for e in range(2):
                var cl = nt * MMA_N + 2 * t + e
                if r < mm and col0 + cl < nn:
                    var v = rstd * (acc[4 * nt + 2 * h + e] - m1 * red[unsafe_offset=FINISH_AT_FOLD_G + cl]) + red[
                        unsafe_offset=FINISH_AT_FOLD_B + cl]
                    y[unsafe_offset=r * nn + col0 + cl] = v.cast[dtype]()


@always_inline
def write_partials(part_acc: Ptr[F32], acc: SIMD[F32, OUTPUTS_PER_THREAD], row0: Int, col0: Int, z: Int, mm: Int, nn: Int,
                   tid: Int):
    """The fp32 block's products (thread patch: rows ty + 16 i, columns tx + 8 j) to part_acc[z, row0.., col0..]."""
    var base = z * mm * nn
    var ty = tid // STAGE_THREADS_PER_ROW
    var tx = tid % STAGE_THREADS_PER_ROW
    comptime for i in range(SIMT_ROWS):
        var r = row0 + ty + SIMT_TY * i
        comptime for j in range(SIMT_COLS):
            var c = col0 + tx + STAGE_THREADS_PER_ROW * j
            if r < mm and c < nn:
                part_acc[unsafe_offset=base + r * nn + c] = acc[i * SIMT_COLS + j]


def layernorm_linear_fwd_splitk_finish[dtype: DType](
    y: Ptr[dtype], mean_out: Ptr[F32], rstd_out: Ptr[F32], fold: Ptr[F32],
    part_acc: Ptr[F32], part_rows: Ptr[F32], rows: Int32, k: Int32, n: Int32,
    splits: Int32, eps: Float32,
):
    var mm = Int(rows)
    var nn = Int(n)
    var kk = Int(k)
    var sp = Int(splits)
    var tid = Int(thread_idx.x)
    var r = Int(block_idx.x) * FINISH_ROWS + tid // FINISH_COLS
    var c = Int(block_idx.y) * FINISH_COLS + tid % FINISH_COLS
    if r >= mm:
        return
    var s1: Float32 = 0.0
    var s2: Float32 = 0.0
    for z in range(sp):   # fixed order: bitwise identical run to run
        s1 += part_rows[unsafe_offset=2 * (z * mm + r)]
        s2 += part_rows[unsafe_offset=2 * (z * mm + r) + 1]
    # rstd does not depend on the shift; the first kernel left each row's shift in mean_out.
    var m1, rstd = shifted_stats(s1, s2, 0.0, kk, eps)
    if c == 0:
        mean_out[unsafe_offset=r] = mean_out[unsafe_offset=r] + m1
        rstd_out[unsafe_offset=r] = rstd
    if c >= nn:
        return
    var acc: Float32 = 0.0
    for z in range(sp):
        acc += part_acc[unsafe_offset=(z * mm + r) * nn + c]
    # mean - shift is m1 = s1 / k itself, never (shift + m1) - shift: no rounding through the large mean.
    var z_out = rstd * (acc - m1 * fold[unsafe_offset=c]) + fold[unsafe_offset=nn + c]
    y[unsafe_offset=r * nn + c] = z_out.cast[dtype]()


def launch_mma[dtype: DType, VEC_OK: Bool](
    ctx: DeviceContext, y: Ptr[dtype], mean: Ptr[F32], rstd: Ptr[F32], x: Ptr[dtype], gamma: Ptr[dtype],
    w: Ptr[dtype], fold: Ptr[F32], part_acc: Ptr[F32], part_rows: Ptr[F32], counters: Ptr[DType.int32],
    rows: Int, k: Int, n: Int, chunk: Int, splits: Int, eps: Float32,
) raises:
    """The 16-bit kernel: one launch, its last block per tile finishes the tile."""
    comptime kernel = layernorm_linear_fwd_mma[dtype, VEC_OK]
    ctx.enqueue_function[kernel](y, mean, rstd, fold, part_acc, part_rows, counters, x, gamma, w,
                                 Int32(rows), Int32(k), Int32(n), Int32(chunk), eps,
                                 grid_dim=(ceildiv(rows, TILE_ROWS), ceildiv(n, TILE_COLS), splits),
                                 block_dim=TILE_THREADS, shared_mem_bytes=MMA_SMEM_BYTES,
                                 func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(UInt32(MMA_SMEM_BYTES)))


def fwd_gpu[dtype: DType](
    ctx: DeviceContext, y: Ptr[dtype], mean: Ptr[F32], rstd: Ptr[F32], x: Ptr[dtype], gamma: Ptr[dtype],
    w: Ptr[dtype], part_acc: Ptr[F32], part_rows: Ptr[F32], counters: Ptr[DType.int32], fold: Ptr[F32],
    rows: Int, k: Int, n: Int, splits: Int, eps: Float32,
) raises:
    comptime VEC = vector_width[dtype]()
    comptime BK = STAGE_THREADS_PER_ROW * VEC
    # Chunks are whole steps, so every step but a chunk's last is full and
    # vector loads stay aligned; a split past the end of k writes zeros.
    comptime STEP = max(BK, MMA_STEP_K)   # powers of two: whole steps of either kernel
    var chunk = ceildiv(ceildiv(k, splits), STEP) * STEP
    var vec_ok = k % VEC == 0 and aligned(Int(x), Int(w), Int(gamma))
    comptime if dtype == F32:
        comptime kernel = layernorm_linear_fwd_splitk[dtype]
        ctx.enqueue_function[kernel](part_acc, part_rows, mean, x, gamma, w, Int32(rows), Int32(k),
                                     Int32(n), Int32(chunk), Int32(1 if vec_ok else 0),
                                     grid_dim=(ceildiv(rows, TILE_ROWS), ceildiv(n, TILE_COLS), splits),
                                     block_dim=TILE_THREADS)
        comptime finish = layernorm_linear_fwd_splitk_finish[dtype]
        ctx.enqueue_function[finish](y, mean, rstd, fold, part_acc, part_rows, Int32(rows), Int32(k),
                                     Int32(n), Int32(splits), eps,
                                     grid_dim=(ceildiv(rows, FINISH_ROWS), ceildiv(n, FINISH_COLS)),
                                     block_dim=FINISH_ROWS * FINISH_COLS)
    else:
        if vec_ok:
            launch_mma[dtype, True](ctx, y, mean, rstd, x, gamma, w, fold, part_acc, part_rows, counters, rows, k,
                                    n, chunk, splits, eps)
        else:
            launch_mma[dtype, False](ctx, y, mean, rstd, x, gamma, w, fold, part_acc, part_rows, counters, rows, k,
                                     n, chunk, splits, eps)


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


comptime FOLD_THREADS = 256   # fold kernel: one block per output column j
comptime FOLD_WARPS = FOLD_THREADS // WARP_SIZE


def layernorm_linear_fold[dtype: DType, VEC: Int](
    fold: Ptr[F32], w: Ptr[dtype], gamma: Ptr[dtype], beta: Ptr[dtype], bias: Ptr[dtype], k: Int32, n: Int32,
):
    """Block j: fold[0, j] = G[j], fold[1, j] = B[j] + bias[j] (see fold_row)."""
    var sh = stack_allocation[2 * FOLD_WARPS, Float32, address_space=AddressSpace.SHARED]()
    var j = Int(block_idx.x)
    var gb = fold_row[dtype, VEC, True](w, gamma, beta, j, Int(k), Int(thread_idx.x), FOLD_THREADS)
    var g = group_sum[FOLD_WARPS, 1](gb[0], sh, 0)
    var b = group_sum[FOLD_WARPS, 1](gb[1], sh, 1)
    if thread_idx.x == 0:
        fold[unsafe_offset=j] = g
        fold[unsafe_offset=Int(n) + j] = b + load_f32(bias, j)


def fold_vector_width[dtype: DType](k: Int, *addresses: Int) -> Int:
    """The fold kernels' load width: 16-byte vectors where k and every row start allow, else 1."""
    comptime VEC = vector_width[dtype]()
    for a in addresses:
        if a % ALIGN != 0:
            return 1
    return VEC if k % VEC == 0 else 1


def launch_fold[dtype: DType](
    ctx: DeviceContext, fold: Ptr[F32], w: Ptr[dtype], gamma: Ptr[dtype], beta: Ptr[dtype], bias: Ptr[dtype],
    k: Int, n: Int,
) raises:
    """Enqueue layernorm_linear_fold: fold [2, n] from w [n, k], gamma, beta [k], bias [n]."""
    comptime VEC = vector_width[dtype]()
    if fold_vector_width[dtype](k, Int(w), Int(gamma), Int(beta)) == VEC:
        comptime kernel = layernorm_linear_fold[dtype, VEC]
        ctx.enqueue_function[kernel](fold, w, gamma, beta, bias, Int32(k), Int32(n), grid_dim=n,
                                     block_dim=FOLD_THREADS)
    else:
        comptime kernel = layernorm_linear_fold[dtype, 1]
        ctx.enqueue_function[kernel](fold, w, gamma, beta, bias, Int32(k), Int32(n), grid_dim=n,
                                     block_dim=FOLD_THREADS)


@always_inline
def fold_row[dtype: DType, VEC: Int, ROUNDED: Bool, UNROLL: Int = 1](
    w: Ptr[dtype], gamma: Ptr[dtype], beta: Ptr[dtype], j: Int, k: Int, first: Int, step: Int,
) -> SIMD[F32, 2]:
    """Partial (G, B) of column j over the VEC-wide vectors first, first + step, .. of w's row j (VEC > 1: k a
    multiple of VEC, 16-byte aligned rows); B sums w * beta in fp32. ROUNDED: G sums w * gamma rounded to
    dtype, the very products the 16-bit fused GEMM multiplies x - c by, so the correction -(mean - c) * G
    cancels what the GEMM added exactly (with an exact G, rows whose values round nearly alike, rstd ~300 at
    bf16 and mean 1e3, were off by up to 15). Not ROUNDED: G sums the exact products in fp32 (the Hopper
    kernel rounds (x - c) * gamma instead, with c near the mean). UNROLL vectors are loaded before any is
    used (more loads in flight for a thread with several), summed in the same order as one at a time."""
    comptime A = ALIGN if VEC > 1 else size_of[Scalar[dtype]]()
    comptime W = VEC * UNROLL
    var acc = SIMD[F32, 2](0.0)
    var base = j * k
    var end = k // VEC
    for v0 in range(first, end, step * UNROLL):
        var wv = SIMD[dtype, W](0)
        var gv = SIMD[dtype, W](0)
        var bv = SIMD[dtype, W](0)
        comptime for u in range(UNROLL):
            var i = (v0 + u * step) * VEC
            if v0 + u * step < end:
                wv = wv.insert[offset=u * VEC](w.unsafe_load[width=VEC, alignment=A](base + i))
                gv = gv.insert[offset=u * VEC](gamma.unsafe_load[width=VEC, alignment=A](i))
                bv = bv.insert[offset=u * VEC](beta.unsafe_load[width=VEC, alignment=A](i))
        comptime for u in range(UNROLL):
            if v0 + u * step < end:
                var wr = wv.slice[VEC, offset=u * VEC]()
                var wu = wr.cast[F32]()
                var gu = gv.slice[VEC, offset=u * VEC]()
                comptime if ROUNDED:
                    acc[0] += (wr * gu).cast[F32]().reduce_add()
                else:
                    acc[0] += (wu * gu.cast[F32]()).reduce_add()
                acc[1] += (wu * bv.slice[VEC, offset=u * VEC]().cast[F32]()).reduce_add()
    return acc


@extensibility.register("layernorm_linear_fold")
struct LayerNormLinearFold:
    @staticmethod
    def execute[target: StaticString, dtype: DType](
        fold: _MutableInputTensor[dtype=F32, rank=2, static_spec=_],
        w: InputTensor[dtype=dtype, rank=2, static_spec=_],
        gamma: InputTensor[dtype=dtype, rank=1, static_spec=_],
        beta: InputTensor[dtype=dtype, rank=1, static_spec=_],
        bias: InputTensor[dtype=dtype, rank=1, static_spec=_],
        ctx: DeviceContext,
    ) raises:
        """fold [2, n] float32: G and B + bias of w [n, k] (the fused
        GPU forward applies them to its GEMM's result)."""
        var n = w.dim_size(0)
        var k = w.dim_size(1)
        comptime if target == "gpu":
            launch_fold[dtype](ctx, fold.unsafe_ptr(), w.unsafe_ptr(), gamma.unsafe_ptr(), beta.unsafe_ptr(),
                               bias.unsafe_ptr(), k, n)
        else:
            for j in range(n):
                var gb = fold_row[dtype, 1, True](w.unsafe_ptr(), gamma.unsafe_ptr(),
                                                   beta.unsafe_ptr(), j, k, 0, 1)
                fold.unsafe_ptr()[unsafe_offset=j] = gb[0]
                fold.unsafe_ptr()[unsafe_offset=n + j] = gb[1] + load_f32(bias.unsafe_ptr(), j)


@extensibility.register("layernorm_linear_fwd")
struct LayerNormLinearFwd:
    @staticmethod
    def execute[target: StaticString, dtype: DType, eps_bits: Int](
        y: _MutableInputTensor[dtype=dtype, rank=2, static_spec=_],
        mean: _MutableInputTensor[dtype=F32, rank=1, static_spec=_],
        rstd: _MutableInputTensor[dtype=F32, rank=1, static_spec=_],
        part_acc: _MutableInputTensor[dtype=F32, rank=2, static_spec=_],
        part_rows: _MutableInputTensor[dtype=F32, rank=2, static_spec=_],
        fold: _MutableInputTensor[dtype=F32, rank=2, static_spec=_],
        x: InputTensor[dtype=dtype, rank=2, static_spec=_],
        gamma: InputTensor[dtype=dtype, rank=1, static_spec=_],
        beta: InputTensor[dtype=dtype, rank=1, static_spec=_],
        w: InputTensor[dtype=dtype, rank=2, static_spec=_],
        bias: InputTensor[dtype=dtype, rank=1, static_spec=_],
        counters: InputTensor[dtype=DType.int32, rank=1, static_spec=_],
        ctx: DeviceContext,
    ) raises:
        """Scratch for the GPU path (the CPU path ignores it), first dim the number of k splits:
        part_acc, part_rows (fp32: [splits, rows * n], [splits, rows * 2]; fp16/bf16:
        [splits, tiles * 4096], [splits, tiles * 128], tiles = 64 x 64 output tiles).
        fold: [2, n] float32 scratch: G and B + bias, made by layernorm_linear_fold at every call (nothing
        derived from the weights outlives the call) and applied by the GPU kernels' correction.
        counters: int32 [>= tiles], zero before the call and left zero after it; the 16-bit kernel
        counts each tile's finished splits in it (its one write to an input; the caller keeps it)."""
        comptime eps = bitcast[F32](UInt32(eps_bits))
        var rows = x.dim_size(0)
        var k = x.dim_size(1)
        var n = w.dim_size(0)
        comptime if target == "gpu":
            var cnt = Ptr[DType.int32](unsafe_from_address=Int(counters.unsafe_ptr()))
            launch_fold[dtype](ctx, fold.unsafe_ptr(), w.unsafe_ptr(), gamma.unsafe_ptr(), beta.unsafe_ptr(),
                               bias.unsafe_ptr(), k, n)
            fwd_gpu[dtype](ctx, y.unsafe_ptr(), mean.unsafe_ptr(), rstd.unsafe_ptr(), x.unsafe_ptr(),
                           gamma.unsafe_ptr(), w.unsafe_ptr(), part_acc.unsafe_ptr(), part_rows.unsafe_ptr(), cnt,
                           fold.unsafe_ptr(), rows, k, n, part_rows.dim_size(0), eps)
        else:
            fwd_cpu[dtype](y.unsafe_ptr(), mean.unsafe_ptr(), rstd.unsafe_ptr(), x.unsafe_ptr(),
                           gamma.unsafe_ptr(), beta.unsafe_ptr(), w.unsafe_ptr(), bias.unsafe_ptr(),
                           rows, k, n, eps)
