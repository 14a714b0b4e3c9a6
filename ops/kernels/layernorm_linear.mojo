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
#   lnl_splitk_kernel: grid (ceil(rows / 64), ceil(n / 64), splits), 128
#     threads. Block (i, j, z) multiplies rows 64i.. by columns 64j.. over the
#     z-th chunk of k, staging BK = 128 bytes of each of its 64 x rows and 64 w
#     rows per step in shared memory (8 threads per row, 16-byte loads,
#     prefetched into registers one step ahead). Each warp owns 16 rows x 64
#     columns (eight m16n8 mma tiles); in fp32 each thread owns a 4 x 8 patch.
#     It writes its fp32 partial products, and blocks of column 0 the rows'
#     partial shifted sums, blocks of row 0 the partial G and B, all to
#     [splits, ...] scratch buffers.
#   lnl_splitk_finish: grid (ceil(rows / 4), ceil(n / 64)), 256 threads, one
#     output each: sums the splits in a fixed order (deterministic, no atomics),
#     then statistics, correction, bias, y in x's dtype.
# The Python side picks splits so that the first kernel has a few blocks per
# SM: k is split exactly where LayerNorm fusion matters (small n, few output
# tiles). At large n every split costs a pass over an fp32 [rows, n] scratch,
# and the simple mma loop (fragments read from shared memory, no wgmma, no TMA)
# is far from cuBLAS, so the op's "auto" keeps cuBLAS there.
#
# Version 3 (this one) over version 2: version 2 normalized x tiles while
# staging them (prologue fusion), so each 32- or 64-row strip first read its
# rows once for the statistics, SIMT FMAs only, and a strip could not be split
# along k: at 4096 x 4096 -> 64 only 64-128 blocks ran (bf16 395 us, fp32 196 us
# on the H100, behind our LayerNorm + cuBLAS at 42 and 185 us; commit e9f5947).
# Version 3 reads x once, splits k, and uses tensor cores for fp16/bf16.
# Where it stands (results/bench_layernorm_linear*.md): fp32 at small n is
# about half of torch's time; fp16/bf16 at small n run at 1-2 TB/s of x, just
# behind our LayerNorm + cuBLAS: a block stages, waits at a barrier, then
# multiplies, so too few loads are in flight. Tried and not kept: 128-row
# blocks of 8 warps with loads two steps ahead (bf16 no faster, fp32 slower
# with half the blocks). Next: a multi-stage cp.async/TMA pipeline with the
# shift and gamma applied to the mma fragments, and an in-block k split
# reduced through shared memory instead of the fp32 scratch.
# MAX's tuned sm90 matmul takes an epilogue lambda, but it dispatches on n and
# k known at compile time (one compile per weight shape), so it is not used.
# CPU: one row at a time, exact two-pass statistics, then the dot products.

import extensibility
from extensibility import InputTensor, _MutableInputTensor
from max.gpu.host import DeviceContext
from max.gpu import thread_idx, block_idx, barrier, WARP_SIZE
from max.gpu.compute.mma import mma
from max.gpu.primitives import warp
from max.gpu.memory import AddressSpace
from std.math import ceildiv
from std.memory import stack_allocation, bitcast

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
comptime SHIFT_SAMPLE = 8    # elements averaged into a row's shift
comptime FIN_COLS = 64       # finish kernel: 4 rows x 64 columns per block
comptime FIN_ROWS = 4


def sk_pad[dtype: DType]() -> Int:
    """Shared-row padding in elements. 16-bit rows of 64 + 8 elements put the
    8 rows an mma fragment load touches on distinct banks and keep rows 16-byte
    aligned; fp32 rows of 32 + 1 make the SIMT loop's column reads conflict-free."""
    return 1 if dtype == F32 else 8


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
    var count = min(k, SHIFT_SAMPLE)
    for e in range(count):
        s += load_f32(x, r * k + e)
    return s / Float32(count)


@always_inline
def group_sum8(v: Float32) -> Float32:
    """Sum over the SK_GROUP consecutive lanes that stage one row."""
    var s = v
    comptime for i in range(3):
        s += warp.shuffle_xor(s, UInt32(SK_GROUP >> (i + 1)))
    return s


@always_inline
def stage_store[dtype: DType, VEC: Int, STRIDE: Int](
    sh: Pointer[Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED], row: Int, col: Int,
    v: SIMD[dtype, VEC],
):
    comptime if dtype == F32:
        comptime for e in range(VEC):   # fp32 rows are padded to an odd length: no 16-byte alignment
            sh[unsafe_offset=row * STRIDE + col + e] = v[e]
    else:
        sh.unsafe_store[alignment=ALIGN](row * STRIDE + col, v)


@always_inline
def mma_step[dtype: DType, STRIDE: Int](
    mut acc: SIMD[F32, SK_ACC],
    a_s: Pointer[Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    b_s: Pointer[Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    warp_row: Int, lane: Int, kq: Int,
):
    """One m16 x n64 x k16 slice of the warp's tile: A fragment rows g, g + 8 and
    columns 2t, 2t + 1 (+8); B fragment rows (k) 2t, 2t + 1 (+8) of column g."""
    var g = lane // 4
    var t = lane % 4
    var ar = (warp_row + g) * STRIDE + kq + 2 * t
    var af = a_s.unsafe_load[width=2, alignment=4](ar).join(
        a_s.unsafe_load[width=2, alignment=4](ar + 8 * STRIDE)).join(
        a_s.unsafe_load[width=2, alignment=4](ar + 8).join(
            a_s.unsafe_load[width=2, alignment=4](ar + 8 * STRIDE + 8)))
    comptime for nt in range(SK_BN // MMA_N):
        var br = (nt * MMA_N + g) * STRIDE + kq + 2 * t
        var bf = b_s.unsafe_load[width=2, alignment=4](br).join(b_s.unsafe_load[width=2, alignment=4](br + 8))
        var d = SIMD[F32, 4](0.0)
        mma(d, af, bf, acc.slice[4, offset=nt * 4]())
        acc = acc.insert[offset=nt * 4](d)


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


def lnl_splitk_kernel[dtype: DType](
    part_acc: Ptr[F32], part_rows: Ptr[F32], part_cols: Ptr[F32], x: Ptr[dtype], gamma: Ptr[dtype],
    beta: Ptr[dtype], w: Ptr[dtype], rows: Int32, k: Int32, n: Int32, chunk: Int32, vec_ok: Int32,
):
    comptime VEC = vector_width[dtype]()
    comptime BK = SK_GROUP * VEC
    comptime STRIDE = BK + sk_pad[dtype]()
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
        comptime if dtype == F32:
            comptime for q in range(BK):
                simt_step[dtype, STRIDE](acc, a_s, b_s, tid // SK_GROUP, tid % SK_GROUP, q)
        else:
            comptime for kq in range(0, BK, MMA_K):
                mma_step[dtype, STRIDE](acc, a_s, b_s, (tid // WARP_SIZE) * MMA_M, tid % WARP_SIZE, kq)
        barrier()

    write_partials[dtype](part_acc, acc, row0, col0, z, mm, nn, tid)
    comptime for p in range(SK_PASSES):
        var t1 = group_sum8(s1[p])
        var t2 = group_sum8(s2[p])
        var tg = group_sum8(cg[p])
        var tb = group_sum8(cb[p])
        var r = lr + SK_ROWS_PER_PASS * p
        if tid % SK_GROUP == 0:
            if block_idx.y == 0 and row0 + r < mm:
                part_rows[unsafe_offset=2 * (z * mm + row0 + r)] = t1
                part_rows[unsafe_offset=2 * (z * mm + row0 + r) + 1] = t2
            if col_sums and col0 + r < nn:
                part_cols[unsafe_offset=2 * (z * nn + col0 + r)] = tg
                part_cols[unsafe_offset=2 * (z * nn + col0 + r) + 1] = tb


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


def fwd_gpu[dtype: DType](
    ctx: DeviceContext, y: Ptr[dtype], mean: Ptr[F32], rstd: Ptr[F32], x: Ptr[dtype], gamma: Ptr[dtype],
    beta: Ptr[dtype], w: Ptr[dtype], bias: Ptr[dtype], part_acc: Ptr[F32], part_rows: Ptr[F32],
    part_cols: Ptr[F32], rows: Int, k: Int, n: Int, splits: Int, eps: Float32,
) raises:
    comptime VEC = vector_width[dtype]()
    comptime BK = SK_GROUP * VEC
    # Chunks are whole steps, so every step but a chunk's last is full and
    # vector loads stay aligned; a split past the end of k writes zeros.
    var chunk = ceildiv(ceildiv(k, splits), BK) * BK
    var vec_ok = k % VEC == 0 and aligned(Int(x), Int(w), Int(gamma), Int(beta))
    comptime kernel = lnl_splitk_kernel[dtype]
    ctx.enqueue_function[kernel](part_acc, part_rows, part_cols, x, gamma, beta, w, Int32(rows), Int32(k),
                                 Int32(n), Int32(chunk), Int32(1 if vec_ok else 0),
                                 grid_dim=(ceildiv(rows, SK_BM), ceildiv(n, SK_BN), splits),
                                 block_dim=SK_THREADS)
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
