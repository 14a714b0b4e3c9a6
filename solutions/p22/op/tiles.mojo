# The register-blocked GEMM tile shared by p22_matmul and p22_fused.
#
# A block of TN x TM = THREADS threads computes a BM x BN tile of the output.
# Thread (tx, ty) owns an RM x RN patch made of 4 x 4 groups: rows
# g * 4 * TM + ty * 4 + (0..3) and columns g * 4 * TN + tx * 4 + (0..3), so
# each group is one 16-byte shared-memory load per k step, and neighbouring
# threads read neighbouring 16-byte words.
# K is walked BK at a time through two shared-memory tiles, both k-major:
#   a_s: element (m, k) at k * A_STRIDE + m     (the left operand, transposed on the way in)
#   b_s: element (k, n) at k * B_STRIDE + n     (the right operand / the weight)
# Rows are padded by PAD words: loads stay 16-byte aligned and the
# transposing stores spread over the banks.
# Global loads are issued one k step ahead into registers (ARegs, BRegs),
# so they are in flight while the block multiplies the tiles already staged.
# 256 threads x 8 x 8 outputs = 128 x 128; BK = 8 keeps the two staged
# tiles at 4.2 KB each.
#
# Over the first version (64 x 64 tiles, a 4 x 4 patch of single-word
# shared-memory loads, every global load waited on before the multiply):
# a thread's 8 x 8 patch reads 16 shared values per k step for 64 FMAs
# (the first: 8 for 16), 16 bytes at a time, and the next step's
# global loads overlap this step's multiply. On the H100 the 64 x 64 tile
# with only the 16-byte loads was no faster; the larger patch with the
# loads ahead was (per-kernel times in results/p22_realistic.txt).

from max.gpu.memory import AddressSpace

from .common import Ptr

comptime BM = 128
comptime BN = 128
comptime BK = 8
comptime TM = 16
comptime TN = 16
comptime THREADS = TM * TN
comptime RM = BM // TM
comptime RN = BN // TN
comptime PAD = 4
comptime A_STRIDE = BM + PAD
comptime B_STRIDE = BN + PAD
comptime A_LOADS = BM * BK // THREADS
comptime B_LOADS = BK * BN // THREADS

comptime Acc = SIMD[DType.float32, RM * RN]
comptime ARegs = SIMD[DType.float32, A_LOADS]
comptime BRegs = SIMD[DType.float32, B_LOADS]
comptime Shared = Pointer[Float32, MutUntrackedOrigin, address_space=AddressSpace.SHARED]


@always_inline
def a_row(tid: Int, l: Int) -> Int:
    """Tile row of this thread's l-th left-operand load (constant over k)."""
    return (tid + l * THREADS) // BK


@always_inline
def a_k(tid: Int) -> Int:
    """Column within the k step of every left-operand load of this thread (THREADS % BK == 0)."""
    return tid % BK


@always_inline
def load_a[dtype: DType](mut regs: ARegs, a: Ptr[dtype], row0: Int, k0: Int, m: Int, k: Int, tid: Int):
    """This thread's left-operand values of the k step at k0 (0 past the matrix edges)."""
    var kc = k0 + a_k(tid)
    comptime for l in range(A_LOADS):
        var r = row0 + a_row(tid, l)
        regs[l] = a[unsafe_offset=r * k + kc].cast[DType.float32]() if r < m and kc < k else 0.0


@always_inline
def store_a(a_s: Shared, regs: ARegs, tid: Int):
    """Stage this thread's left-operand values, transposed (k-major)."""
    comptime for l in range(A_LOADS):
        a_s[unsafe_offset=a_k(tid) * A_STRIDE + a_row(tid, l)] = regs[l]


@always_inline
def accumulate_tile(mut acc: Acc, a_s: Shared, b_s: Shared, ty: Int, tx: Int):
    """Add a_s[:, this thread's rows]^T @ b_s[:, this thread's columns] to acc."""
    comptime for kk in range(BK):
        var a_frag = SIMD[DType.float32, RM]()
        var b_frag = SIMD[DType.float32, RN]()
        comptime for g in range(RM // 4):
            a_frag = a_frag.insert[offset=4 * g](
                a_s.unsafe_load[width=4, alignment=16](kk * A_STRIDE + patch_row(4 * g, ty)))
        comptime for g in range(RN // 4):
            b_frag = b_frag.insert[offset=4 * g](
                b_s.unsafe_load[width=4, alignment=16](kk * B_STRIDE + patch_col(4 * g, tx)))
        comptime for i in range(RM):
            comptime for j in range(RN):
                acc[i * RN + j] += a_frag[i] * b_frag[j]


@always_inline
def patch_row(i: Int, ty: Int) -> Int:
    """Tile row of this thread's i-th patch row."""
    return (i // 4) * 4 * TM + ty * 4 + i % 4


@always_inline
def patch_col(j: Int, tx: Int) -> Int:
    """Tile column of this thread's j-th patch column."""
    return (j // 4) * 4 * TN + tx * 4 + j % 4


@always_inline
def store_tile[dtype: DType, add_bias: Bool](
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    bias: Pointer[Scalar[dtype], MutAnyOrigin],
    acc: Acc, row0: Int, col0: Int, ty: Int, tx: Int, m: Int, n: Int,
):
    """Write this thread's patch of the tile, skipping rows/columns past (m, n)."""
    comptime for i in range(RM):
        var r = row0 + patch_row(i, ty)
        comptime for j in range(RN):
            var c = col0 + patch_col(j, tx)
            if r < m and c < n:
                var v = acc[i * RN + j]
                comptime if add_bias:
                    v += bias[unsafe_offset=c].cast[DType.float32]()
                dst[unsafe_offset=r * n + c] = v.cast[dtype]()
