# layernorm_linear_fwd: y = LayerNorm(x) @ w^T + bias for x [rows, k],
# gamma/beta [k], w [n, k] (nn.Linear's weight), bias [n]; also mean and rstd
# per row (float32) for the backward. fp32, fp16 or bf16 in and out; fp32
# statistics and accumulation; fp16/bf16 products on tensor cores (mma.sync
# m16n8k16), fp32 products as IEEE FMAs (no TF32).
#
# Algorithm (one read of x, no normalized tensor anywhere). With c the mean
# of the row's first SHIFT_SAMPLE elements (a per-row shift) and
# a = (x - c) * gamma:
#   y[r, j] = rstd * (sum_k a[r, k] w[j, k] - (mean - c) * G[j]) + B[j] + bias[j]
#   G[j] = sum_k gamma[k] w[j, k],   B[j] = sum_k beta[k] w[j, k]
# so the GEMM runs on x as it is loaded (shifted and scaled, not yet
# normalized) while the same loads give the row's shifted sums, and the
# normalization is applied to the GEMM's result. The shift keeps both the
# statistics and the GEMM free of cancellation when the mean is 1e4 times the
# spread (x - c is of the spread's size); it is FlashNorm's fold of gamma and
# beta into the weight, done on the fly instead of once per weight version.
# fp16/bf16 round a before the mma, with an error proportional to |x - c|, so c
# averages several elements: with c = x[r, 0], rows whose first element lay far
# from their mean lost accuracy against torch's normalized GEMM (the H100
# sanitizer workload caught it at 4100 x 100 -> 768, bf16, gamma ~ N(0, 1)).
#
# GPU mapping, two kernels:
#   lnl_splitk_kernel (fp32): grid (ceil(rows / 64), ceil(n / 64), splits),
#     128 threads. Block (i, j, z) multiplies rows 64i.. by columns 64j.. over
#     the z-th chunk of k, staging BK = 128 bytes of each of its 64 x rows and
#     64 w rows per step in shared memory (8 threads per row, 16-byte loads,
#     prefetched into registers one step ahead); each thread owns a 4 x 8
#     patch. It writes its fp32 partial products, and blocks of column 0 the
#     rows' partial shifted sums, blocks of row 0 the partial G and B, all to
#     [splits, ...] scratch buffers.
#   lnl_mma_kernel (fp16/bf16): the same grid plus one row of blocks, 128
#     threads. Raw x, w, gamma and beta tiles (MMA_BK = 64 elements of each
#     row per step) arrive by cp.async in a ring of MMA_STAGES steps; each warp
#     owns 16 rows x 64 columns (eight m16n8k16 mma tiles) and applies the
#     shift and gamma to its A fragments in registers, summing the rows'
#     shifted sums from the same fragments. The extra row of blocks forms G
#     and B from the same w tiles (its x copies fall past the rows). Launch
#     bounds cap it at 128 registers so 4 blocks fit an SM.
#   lnl_splitk_finish: grid (ceil(rows / 4), ceil(n / 64)), 256 threads, one
#     output each: sums the splits in a fixed order (deterministic, no atomics),
#     then statistics, correction, bias, y in x's dtype.
# The Python side picks splits so that the first kernel has a few blocks per
# SM: k is split exactly where LayerNorm fusion matters (small n, few output
# tiles). At large n every split costs a pass over an fp32 [rows, n] scratch,
# and the mma.sync loop (no wgmma, no TMA) is far from cuBLAS, so the op's
# "auto" keeps cuBLAS there.
#
# Version 4 (this one) over version 3: the fp16/bf16 path no longer stages
# through registers (a block loaded, waited at a barrier, then multiplied, and
# gamma was fetched each step: bf16 4096 x 4096 -> 64 took 47.6 us at its best
# split, behind our LayerNorm + cuBLAS at 41.9). The cp.async ring, the
# transform on the fragments and the register cap bring it to 35.9 us there
# (results/bench_layernorm_linear_splits.md, torch 49.2). What the ring
# taught: with 230 registers (two blocks per SM, one warp per scheduler) the
# loop was issue-bound - deeper rings, a wait for everything and removing the
# mma all timed the same; the register cap, not the ring depth, paid. Tried and not kept:
# two warp groups splitting each step's k (8 warps, partner sums folded in
# shared memory): slower; G and B from an extra mma in warp 0: 32 registers
# for every thread; G and B in a separate column-sum loop: latency-bound.
# Version 2 (prologue fusion, SIMT only) could not split k and lost at small n.
# MAX's tuned sm90 matmul takes an epilogue lambda, but it dispatches on n and
# k known at compile time (one compile per weight shape), so it is not used.
# CPU: one row at a time, exact two-pass statistics, then the dot products.

import extensibility
from extensibility import InputTensor, _MutableInputTensor
from max.gpu.host import DeviceContext, FuncAttribute
from max.gpu import thread_idx, block_idx, barrier, WARP_SIZE
from max.gpu.compute.mma import mma
from max.gpu.primitives import warp
from max.gpu.memory import AddressSpace, async_copy, async_copy_commit_group, async_copy_wait_group, external_memory
from std.math import ceildiv
from std.memory import stack_allocation, bitcast
from std.utils.static_tuple import StaticTuple
from max.gpu import MAX_THREADS_PER_BLOCK_METADATA

from .layernorm import ALIGN, F32, Ptr, aligned, load_f32, normalized, row_stats_cpu, shifted_stats, vector_width

comptime SK_THREADS = 128
comptime SK_BM = 64          # rows per block: 4 warps x 16 mma rows
comptime SK_BN = 64          # columns per block: 8 mma tiles of 8
comptime SK_GROUP = 8        # threads staging one row: 8 x 16 bytes per step
comptime SK_ROWS_PER_PASS = SK_THREADS // SK_GROUP
comptime SK_PASSES = SK_BM // SK_ROWS_PER_PASS   # rows each thread stages per step
comptime SK_ACC = SK_BM * SK_BN // SK_THREADS    # outputs per thread
comptime MMA_M = 16
comptime MMA_N = 8
comptime MMA_K = 16
comptime SIMT_TY = SK_THREADS // SK_GROUP        # fp32 patch: thread rows ty + 16 i, columns tx + 8 j
comptime SIMT_ROWS = SK_BM // SIMT_TY
comptime SIMT_COLS = SK_BN // SK_GROUP
comptime SIMT_PAD = 1         # fp32 shared rows of 32 + 1: the SIMT loop's column reads are conflict-free
comptime SHIFT_SAMPLE = 8    # elements averaged into a row's shift
comptime FIN_COLS = 64       # finish kernel: 4 rows x 64 columns per block
comptime FIN_ROWS = 4


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
    """Mean of row r's first min(k, SHIFT_SAMPLE) elements: both kernels compute it the same way."""
    var s: Float32 = 0.0
    if k >= SHIFT_SAMPLE:   # unrolled: the loads fly together (this starts every block)
        comptime for e in range(SHIFT_SAMPLE):
            s += load_f32(x, r * k + e)
        return s / Float32(SHIFT_SAMPLE)
    for e in range(k):
        s += load_f32(x, r * k + e)
    return s / Float32(k)


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
    mut acc: SIMD[F32, SK_ACC],
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
        bv[j] = b_s[unsafe_offset=(tx + SK_GROUP * j) * STRIDE + q].cast[F32]()
    comptime for i in range(SIMT_ROWS):
        var part = acc.slice[SIMT_COLS, offset=i * SIMT_COLS]() + av[i] * bv
        acc = acc.insert[offset=i * SIMT_COLS](part)


def lnl_splitk_kernel[dtype: DType](   # float32 only (fp16/bf16: lnl_mma_kernel)
    part_acc: Ptr[F32], part_rows: Ptr[F32], part_cols: Ptr[F32], x: Ptr[dtype], gamma: Ptr[dtype],
    beta: Ptr[dtype], w: Ptr[dtype], rows: Int32, k: Int32, n: Int32, chunk: Int32, vec_ok: Int32,
):
    comptime VEC = vector_width[dtype]()
    comptime BK = SK_GROUP * VEC
    comptime STRIDE = BK + SIMT_PAD
    comptime W = SK_PASSES * VEC
    var a_s = stack_allocation[SK_BM * STRIDE, dtype, address_space=AddressSpace.SHARED]()
    var b_s = stack_allocation[SK_BN * STRIDE, dtype, address_space=AddressSpace.SHARED]()
    var mm = Int(rows)
    var kk = Int(k)
    var nn = Int(n)
    var tid = Int(thread_idx.x)
    var lr = tid // SK_GROUP
    var lc = (tid % SK_GROUP) * VEC
    var row0 = Int(block_idx.x) * SK_BM
    var col0 = Int(block_idx.y) * SK_BN
    var z = Int(block_idx.z)
    var k_lo = z * Int(chunk)
    var k_hi = min(kk, k_lo + Int(chunk))
    var vok = vec_ok != 0
    var col_sums = block_idx.x == 0   # only row-block 0 needs G and B (every block could)

    var shift = SIMD[F32, SK_PASSES](0.0)
    comptime for p in range(SK_PASSES):
        shift[p] = row_shift(x, min(row0 + lr + SK_ROWS_PER_PASS * p, mm - 1), kk)
    var s1 = SIMD[F32, SK_PASSES](0.0)
    var s2 = SIMD[F32, SK_PASSES](0.0)
    var cg = SIMD[F32, SK_PASSES](0.0)
    var cb = SIMD[F32, SK_PASSES](0.0)
    var acc = SIMD[F32, SK_ACC](0.0)
    var xr = SIMD[dtype, W](0)
    var wr = SIMD[dtype, W](0)
    comptime for p in range(SK_PASSES):
        var r = lr + SK_ROWS_PER_PASS * p
        xr = xr.insert[offset=p * VEC](stage_load[dtype, VEC](x, row0 + r, mm, kk, k_lo + lc, k_hi, vok))
        wr = wr.insert[offset=p * VEC](stage_load[dtype, VEC](w, col0 + r, nn, kk, k_lo + lc, k_hi, vok))

    for k0 in range(k_lo, k_hi, BK):
        var kg = k0 + lc
        var gv = stage_load[dtype, VEC](gamma, 0, 1, 0, kg, k_hi, vok).cast[F32]()
        var bv = SIMD[F32, VEC](0.0)
        if col_sums:
            bv = stage_load[dtype, VEC](beta, 0, 1, 0, kg, k_hi, vok).cast[F32]()
        comptime for p in range(SK_PASSES):
            var r = lr + SK_ROWS_PER_PASS * p
            var d = xr.slice[VEC, offset=p * VEC]().cast[F32]() - shift[p]
            if kg + VEC > k_hi:   # the chunk's tail: padding must not reach the sums
                comptime for e in range(VEC):
                    if kg + e >= k_hi:
                        d[e] = 0.0
            s1[p] += d.reduce_add()
            s2[p] += (d * d).reduce_add()
            stage_store[dtype, VEC, STRIDE](a_s, r, lc, (d * gv).cast[dtype]())
            var wv = wr.slice[VEC, offset=p * VEC]()
            stage_store[dtype, VEC, STRIDE](b_s, r, lc, wv)
            if col_sums:
                var wf = wv.cast[F32]()
                cg[p] += (wf * gv).reduce_add()
                cb[p] += (wf * bv).reduce_add()
        barrier()
        if k0 + BK < k_hi:   # next step's loads fly while this one computes
            comptime for p in range(SK_PASSES):
                var r = lr + SK_ROWS_PER_PASS * p
                xr = xr.insert[offset=p * VEC](stage_load[dtype, VEC](x, row0 + r, mm, kk, kg + BK, k_hi, vok))
                wr = wr.insert[offset=p * VEC](stage_load[dtype, VEC](w, col0 + r, nn, kk, kg + BK, k_hi, vok))
        comptime for q in range(BK):
            simt_step[dtype, STRIDE](acc, a_s, b_s, tid // SK_GROUP, tid % SK_GROUP, q)
        barrier()

    write_partials[dtype](part_acc, acc, row0, col0, z, mm, nn, tid)
    comptime for p in range(SK_PASSES):
        var t1 = lanes_sum[SK_GROUP](s1[p])
        var t2 = lanes_sum[SK_GROUP](s2[p])
        var tg = lanes_sum[SK_GROUP](cg[p])
        var tb = lanes_sum[SK_GROUP](cb[p])
        var r = lr + SK_ROWS_PER_PASS * p
        if tid % SK_GROUP == 0:
            if block_idx.y == 0 and row0 + r < mm:
                part_rows[unsafe_offset=2 * (z * mm + row0 + r)] = t1
                part_rows[unsafe_offset=2 * (z * mm + row0 + r) + 1] = t2
            if col_sums and col0 + r < nn:
                part_cols[unsafe_offset=2 * (z * nn + col0 + r)] = tg
                part_cols[unsafe_offset=2 * (z * nn + col0 + r) + 1] = tb


comptime SPtr[dtype: DType] = Pointer[Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED]
comptime MMA_STAGES = 3                   # k steps in flight per block (the cp.async ring)
comptime MMA_BK = 64                      # k elements per step: 128 bytes of each 16-bit row
comptime MMA_STRIDE = MMA_BK + 8          # shared rows: 16-byte aligned, fragment loads conflict-free
comptime MMA_CHUNKS = MMA_BK // 8         # 16-byte copies per row per step
comptime MMA_TILE = (SK_BM + SK_BN) * MMA_STRIDE + 2 * MMA_BK   # one step: x rows, w rows, gamma, beta
comptime MMA_COPIES = (SK_BM + SK_BN) * MMA_CHUNKS // SK_THREADS  # row copies per thread per step
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
    tile: SPtr[dtype], x: Ptr[dtype], gamma: Ptr[dtype], beta: Ptr[dtype], w: Ptr[dtype], row0: Int, col0: Int,
    mm: Int, nn: Int, kk: Int, k0: Int, k_hi: Int, tid: Int,
):
    """Starts the copies of one k step into tile: 64 x rows, 64 w rows, then gamma and beta."""
    comptime for i in range(MMA_COPIES):
        var idx = tid + SK_THREADS * i
        var r = idx // MMA_CHUNKS
        var kc = (idx % MMA_CHUNKS) * 8
        var dst = tile.unsafe_offset(r * MMA_STRIDE + kc)
        if r < SK_BM:
            chunk_copy[dtype, VEC_OK](dst, x, row0 + r, mm, kk, k0 + kc, k_hi)
        else:
            chunk_copy[dtype, VEC_OK](dst, w, col0 + r - SK_BM, nn, kk, k0 + kc, k_hi)
    if tid < 2 * MMA_CHUNKS:
        var kc = (tid % MMA_CHUNKS) * 8
        chunk_copy[dtype, VEC_OK](tile.unsafe_offset((SK_BM + SK_BN) * MMA_STRIDE + tid * 8),
                                  gamma if tid < MMA_CHUNKS else beta, 0, 1, kk, k0 + kc, k_hi)


@always_inline
def pair_vec[dtype: DType](p: SPtr[dtype], i: Int, j: Int) -> SIMD[F32, 8]:
    """An mma A fragment's column pattern: elements (i, i + 1) twice, then (j, j + 1) twice, as fp32."""
    var a = p.unsafe_load[width=2, alignment=4](i).cast[F32]()
    var b = p.unsafe_load[width=2, alignment=4](j).cast[F32]()
    return a.join(a).join(b.join(b))


@always_inline
def colsum_step[dtype: DType](
    mut cg: Float32, mut cb: Float32, b_s: SPtr[dtype], g_s: SPtr[dtype], tid: Int,
):
    """One step of G and B in a column-sum block: thread tid takes column tid % 64 and half the step's k."""
    comptime HALF = MMA_BK // 2
    var h = (tid // SK_BN) * HALF
    var wr = b_s.unsafe_offset((tid % SK_BN) * MMA_STRIDE + h)
    comptime for q in range(0, HALF, 8):
        var wv = wr.unsafe_load[width=8, alignment=ALIGN](q).cast[F32]()
        cg += (wv * g_s.unsafe_load[width=8, alignment=ALIGN](h + q).cast[F32]()).reduce_add()
        cb += (wv * g_s.unsafe_load[width=8, alignment=ALIGN](MMA_BK + h + q).cast[F32]()).reduce_add()


@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(SK_THREADS)),
    `nvvm.minctasm`=SIMDLength(MMA_MIN_BLOCKS),
)
def lnl_mma_kernel[dtype: DType, VEC_OK: Bool](
    part_acc: Ptr[F32], part_rows: Ptr[F32], part_cols: Ptr[F32], x: Ptr[dtype], gamma: Ptr[dtype],
    beta: Ptr[dtype], w: Ptr[dtype], rows: Int32, k: Int32, n: Int32, chunk: Int32,
):
    var mm = Int(rows)
    var kk = Int(k)
    var nn = Int(n)
    var tid = Int(thread_idx.x)
    var col0 = Int(block_idx.y) * SK_BN
    var z = Int(block_idx.z)
    var k_lo = z * Int(chunk)
    var k_hi = min(kk, k_lo + Int(chunk))
    # The extra row of blocks forms G and B from the same w tiles (its x copies fall past the rows).
    var col_block = Int(block_idx.x) * SK_BM >= mm
    var smem = external_memory[Scalar[dtype], address_space=AddressSpace.SHARED, alignment=ALIGN]()
    var lane = tid % WARP_SIZE
    var wrow = (tid // WARP_SIZE) * MMA_M
    var g = lane // 4
    var t = lane % 4
    var row0 = Int(block_idx.x) * SK_BM
    var steps = ceildiv(max(k_hi - k_lo, 0), MMA_BK)

    comptime for s in range(MMA_STAGES - 1):
        if s < steps:
            issue_step[dtype, VEC_OK](smem.unsafe_offset(s * MMA_TILE), x, gamma, beta, w, row0, col0, mm, nn, kk,
                                      k_lo + s * MMA_BK, k_hi, tid)
        async_copy_commit_group()   # empty groups keep the count uniform: step s is group s
    var r_top = row0 + wrow + g     # the thread's fragment rows: r_top, r_top + 8
    var sh0 = row_shift(x, min(r_top, mm - 1), kk)
    var sh1 = row_shift(x, min(r_top + 8, mm - 1), kk)
    var shv = SIMD[F32, 8](sh0, sh0, sh1, sh1, sh0, sh0, sh1, sh1)
    var s1 = SIMD[F32, 8](0.0)
    var s2 = SIMD[F32, 8](0.0)
    var acc = SIMD[F32, SK_ACC](0.0)
    var cg: Float32 = 0.0
    var cb: Float32 = 0.0
    var slot = 0                         # step s's ring slot (s % MMA_STAGES without a division)
    var fill = MMA_STAGES - 1            # the slot step s + MMA_STAGES - 1 goes to
    for s in range(steps):
        async_copy_wait_group(Int32(MMA_STAGES - 2))   # this thread's copies of step s have landed ...
        barrier()   # ... everyone's have, and everyone is done with the slot refilled next
        if s + MMA_STAGES - 1 < steps:
            issue_step[dtype, VEC_OK](smem.unsafe_offset(fill * MMA_TILE), x, gamma, beta, w, row0, col0, mm, nn,
                                      kk, k_lo + (s + MMA_STAGES - 1) * MMA_BK, k_hi, tid)
        async_copy_commit_group()
        var a_s = smem.unsafe_offset(slot * MMA_TILE)
        var b_s = a_s.unsafe_offset(SK_BM * MMA_STRIDE)
        var g_s = b_s.unsafe_offset(SK_BN * MMA_STRIDE)
        slot = 0 if slot == MMA_STAGES - 1 else slot + 1
        fill = 0 if fill == MMA_STAGES - 1 else fill + 1
        if col_block:
            colsum_step[dtype](cg, cb, b_s, g_s, tid)
            continue
        var tail = k_lo + (s + 1) * MMA_BK > k_hi   # the chunk's last step may hold zero-filled columns
        comptime for kq in range(0, MMA_BK, MMA_K):
            var c = kq + 2 * t
            var ar = (wrow + g) * MMA_STRIDE + c
            var af = a_s.unsafe_load[width=2, alignment=4](ar).join(
                a_s.unsafe_load[width=2, alignment=4](ar + 8 * MMA_STRIDE)).join(
                a_s.unsafe_load[width=2, alignment=4](ar + 8).join(
                    a_s.unsafe_load[width=2, alignment=4](ar + 8 * MMA_STRIDE + 8)))
            var d = af.cast[F32]() - shv
            if tail:   # zero-filled columns must not reach the sums
                var cols = SIMD[DType.int32, 8](0, 1, 0, 1, 8, 9, 8, 9) + Int32(k_lo + s * MMA_BK + c)
                d = cols.lt(SIMD[DType.int32, 8](Int32(k_hi))).select(d, SIMD[F32, 8](0.0))
            s1 += d
            s2 += d * d
            var a = (d * pair_vec[dtype](g_s, c, c + 8)).cast[dtype]()
            comptime for nt in range(SK_BN // MMA_N):
                var br = (nt * MMA_N + g) * MMA_STRIDE + c
                var bf = b_s.unsafe_load[width=2, alignment=4](br).join(
                    b_s.unsafe_load[width=2, alignment=4](br + 8))
                var dd = SIMD[F32, 4](0.0)
                mma(dd, a, bf, acc.slice[4, offset=nt * 4]())
                acc = acc.insert[offset=nt * 4](dd)

    if col_block:   # the two k halves of each column meet in the (now idle) pipeline memory
        barrier()
        var red = smem.unsafe_bitcast[Float32]()
        if tid >= SK_BN:
            red[unsafe_offset=tid - SK_BN] = cg
            red[unsafe_offset=tid] = cb
        barrier()
        if tid < SK_BN and col0 + tid < nn:
            part_cols[unsafe_offset=2 * (z * nn + col0 + tid)] = cg + red[unsafe_offset=tid]
            part_cols[unsafe_offset=2 * (z * nn + col0 + tid) + 1] = cb + red[unsafe_offset=tid + SK_BN]
        return
    write_partials[dtype](part_acc, acc, row0, col0, z, mm, nn, tid)
    if block_idx.y == 0:   # row g: elements 0, 1, 4, 5 of the fragment; row g + 8: 2, 3, 6, 7
        var t1 = SIMD[F32, 2](lanes_sum[4](s1[0] + s1[1] + s1[4] + s1[5]),
                              lanes_sum[4](s1[2] + s1[3] + s1[6] + s1[7]))
        var t2 = SIMD[F32, 2](lanes_sum[4](s2[0] + s2[1] + s2[4] + s2[5]),
                              lanes_sum[4](s2[2] + s2[3] + s2[6] + s2[7]))
        if t == 0:
            comptime for h in range(2):
                var r = r_top + 8 * h
                if r < mm:
                    part_rows[unsafe_offset=2 * (z * mm + r)] = t1[h]
                    part_rows[unsafe_offset=2 * (z * mm + r) + 1] = t2[h]


@always_inline
def write_partials[dtype: DType](
    part_acc: Ptr[F32], acc: SIMD[F32, SK_ACC], row0: Int, col0: Int, z: Int, mm: Int, nn: Int, tid: Int,
):
    """The block's fp32 products to part_acc[z, row0.., col0..] (mma fragment or SIMT patch layout)."""
    var base = z * mm * nn
    comptime if dtype == F32:
        var ty = tid // SK_GROUP
        var tx = tid % SK_GROUP
        comptime for i in range(SIMT_ROWS):
            var r = row0 + ty + SIMT_TY * i
            comptime for j in range(SIMT_COLS):
                var c = col0 + tx + SK_GROUP * j
                if r < mm and c < nn:
                    part_acc[unsafe_offset=base + r * nn + c] = acc[i * SIMT_COLS + j]
    else:
        var lane = tid % WARP_SIZE
        var r_top = row0 + (tid // WARP_SIZE) * MMA_M + lane // 4
        comptime for nt in range(SK_BN // MMA_N):
            comptime for h in range(4):   # c0, c1: row g; c2, c3: row g + 8; columns 2t, 2t + 1
                var r = r_top + 8 * (h // 2)
                var c = col0 + nt * MMA_N + 2 * (lane % 4) + h % 2
                if r < mm and c < nn:
                    part_acc[unsafe_offset=base + r * nn + c] = acc[nt * 4 + h]


def lnl_splitk_finish[dtype: DType](
    y: Ptr[dtype], mean_out: Ptr[F32], rstd_out: Ptr[F32], x: Ptr[dtype], bias: Ptr[dtype],
    part_acc: Ptr[F32], part_rows: Ptr[F32], part_cols: Ptr[F32], rows: Int32, k: Int32, n: Int32,
    splits: Int32, eps: Float32,
):
    var mm = Int(rows)
    var nn = Int(n)
    var kk = Int(k)
    var sp = Int(splits)
    var tid = Int(thread_idx.x)
    var r = Int(block_idx.x) * FIN_ROWS + tid // FIN_COLS
    var c = Int(block_idx.y) * FIN_COLS + tid % FIN_COLS
    if r >= mm:
        return
    var s1: Float32 = 0.0
    var s2: Float32 = 0.0
    for z in range(sp):   # fixed order: bitwise identical run to run
        s1 += part_rows[unsafe_offset=2 * (z * mm + r)]
        s2 += part_rows[unsafe_offset=2 * (z * mm + r) + 1]
    # rstd does not depend on the shift; only the thread that writes the mean reads the row's sample.
    var m1, rstd = shifted_stats(s1, s2, 0.0, kk, eps)
    if c == 0:
        mean_out[unsafe_offset=r] = row_shift(x, r, kk) + m1
        rstd_out[unsafe_offset=r] = rstd
    if c >= nn:
        return
    var acc: Float32 = 0.0
    var cg: Float32 = 0.0
    var cb: Float32 = 0.0
    for z in range(sp):
        acc += part_acc[unsafe_offset=(z * mm + r) * nn + c]
        cg += part_cols[unsafe_offset=2 * (z * nn + c)]
        cb += part_cols[unsafe_offset=2 * (z * nn + c) + 1]
    # mean - shift is m1 = s1 / k itself, never (shift + m1) - shift: no rounding through the large mean.
    var z_out = rstd * (acc - m1 * cg) + cb + load_f32(bias, c)
    y[unsafe_offset=r * nn + c] = z_out.cast[dtype]()


def launch_mma[dtype: DType, VEC_OK: Bool](
    ctx: DeviceContext, part_acc: Ptr[F32], part_rows: Ptr[F32], part_cols: Ptr[F32], x: Ptr[dtype],
    gamma: Ptr[dtype], beta: Ptr[dtype], w: Ptr[dtype], rows: Int, k: Int, n: Int, chunk: Int, splits: Int,
) raises:
    """The 16-bit kernel, with one more row of blocks for the column sums."""
    comptime kernel = lnl_mma_kernel[dtype, VEC_OK]
    ctx.enqueue_function[kernel](part_acc, part_rows, part_cols, x, gamma, beta, w, Int32(rows), Int32(k),
                                 Int32(n), Int32(chunk),
                                 grid_dim=(ceildiv(rows, SK_BM) + 1, ceildiv(n, SK_BN), splits),
                                 block_dim=SK_THREADS, shared_mem_bytes=MMA_SMEM_BYTES,
                                 func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(UInt32(MMA_SMEM_BYTES)))


def fwd_gpu[dtype: DType](
    ctx: DeviceContext, y: Ptr[dtype], mean: Ptr[F32], rstd: Ptr[F32], x: Ptr[dtype], gamma: Ptr[dtype],
    beta: Ptr[dtype], w: Ptr[dtype], bias: Ptr[dtype], part_acc: Ptr[F32], part_rows: Ptr[F32],
    part_cols: Ptr[F32], rows: Int, k: Int, n: Int, splits: Int, eps: Float32,
) raises:
    comptime VEC = vector_width[dtype]()
    comptime BK = SK_GROUP * VEC
    # Chunks are whole steps, so every step but a chunk's last is full and
    # vector loads stay aligned; a split past the end of k writes zeros.
    comptime STEP = max(BK, MMA_BK)   # powers of two: whole steps of either kernel
    var chunk = ceildiv(ceildiv(k, splits), STEP) * STEP
    var vec_ok = k % VEC == 0 and aligned(Int(x), Int(w), Int(gamma), Int(beta))
    comptime if dtype == F32:
        comptime kernel = lnl_splitk_kernel[dtype]
        ctx.enqueue_function[kernel](part_acc, part_rows, part_cols, x, gamma, beta, w, Int32(rows), Int32(k),
                                     Int32(n), Int32(chunk), Int32(1 if vec_ok else 0),
                                     grid_dim=(ceildiv(rows, SK_BM), ceildiv(n, SK_BN), splits),
                                     block_dim=SK_THREADS)
    else:
        if vec_ok:
            launch_mma[dtype, True](ctx, part_acc, part_rows, part_cols, x, gamma, beta, w, rows, k, n, chunk,
                                    splits)
        else:
            launch_mma[dtype, False](ctx, part_acc, part_rows, part_cols, x, gamma, beta, w, rows, k, n, chunk,
                                     splits)
    comptime finish = lnl_splitk_finish[dtype]
    ctx.enqueue_function[finish](y, mean, rstd, x, bias, part_acc, part_rows, part_cols, Int32(rows), Int32(k),
                                 Int32(n), Int32(splits), eps,
                                 grid_dim=(ceildiv(rows, FIN_ROWS), ceildiv(n, FIN_COLS)),
                                 block_dim=FIN_ROWS * FIN_COLS)


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
        part_acc: _MutableInputTensor[dtype=F32, rank=3, static_spec=_],
        part_rows: _MutableInputTensor[dtype=F32, rank=3, static_spec=_],
        part_cols: _MutableInputTensor[dtype=F32, rank=3, static_spec=_],
        x: InputTensor[dtype=dtype, rank=2, static_spec=_],
        gamma: InputTensor[dtype=dtype, rank=1, static_spec=_],
        beta: InputTensor[dtype=dtype, rank=1, static_spec=_],
        w: InputTensor[dtype=dtype, rank=2, static_spec=_],
        bias: InputTensor[dtype=dtype, rank=1, static_spec=_],
        ctx: DeviceContext,
    ) raises:
        """Scratch for the GPU path (the CPU path ignores it): part_acc [splits, rows, n],
        part_rows [splits, rows, 2], part_cols [splits, n, 2]; their first dim is the number of k splits."""
        comptime eps = bitcast[F32](UInt32(eps_bits))
        var rows = x.dim_size(0)
        var k = x.dim_size(1)
        var n = w.dim_size(0)
        comptime if target == "gpu":
            fwd_gpu[dtype](ctx, y.unsafe_ptr(), mean.unsafe_ptr(), rstd.unsafe_ptr(), x.unsafe_ptr(),
                           gamma.unsafe_ptr(), beta.unsafe_ptr(), w.unsafe_ptr(), bias.unsafe_ptr(),
                           part_acc.unsafe_ptr(), part_rows.unsafe_ptr(), part_cols.unsafe_ptr(),
                           rows, k, n, part_rows.dim_size(0), eps)
        else:
            fwd_cpu[dtype](y.unsafe_ptr(), mean.unsafe_ptr(), rstd.unsafe_ptr(), x.unsafe_ptr(),
                           gamma.unsafe_ptr(), beta.unsafe_ptr(), w.unsafe_ptr(), bias.unsafe_ptr(),
                           rows, k, n, eps)
