# The register-blocked GEMM tile shared by p22_matmul and p22_fused.
#
# A block of TT x TT = 256 threads computes a BM x BN tile of the output,
# each thread an RM x RN patch (rows ty + TT*i, columns tx + TT*j, so the
# 16 threads of a half-warp read 16 consecutive shared-memory words). The K
# dimension is walked BK at a time through two shared-memory tiles:
#   a_s: element (m, k) at m * BK + k          BM x BK  (rows of the left operand)
#   b_s: element (k, n) at k * B_STRIDE + n    BK x BN  (padded by one word: the fused kernel
#                                    stores it column-wise, and the pad keeps
#                                    those stores free of bank conflicts)

from max.gpu.memory import AddressSpace

comptime BM = 64
comptime BN = 64
comptime BK = 16
comptime TT = 16
comptime THREADS = TT * TT
comptime RM = BM // TT
comptime RN = BN // TT
comptime B_STRIDE = BN + 1
comptime A_LOADS = BM * BK // THREADS
comptime B_LOADS = BK * BN // THREADS

comptime Acc = SIMD[DType.float32, RM * RN]
comptime Shared = Pointer[Float32, MutUntrackedOrigin, address_space=AddressSpace.SHARED]


@always_inline
def accumulate_tile(mut acc: Acc, a_s: Shared, b_s: Shared, ty: Int, tx: Int):
    """Add a_s[this thread's rows, :] @ b_s[:, this thread's columns] to acc."""
    comptime for kk in range(BK):
        var a_frag = SIMD[DType.float32, RM]()
        var b_frag = SIMD[DType.float32, RN]()
        comptime for i in range(RM):
            a_frag[i] = a_s[unsafe_offset=(ty + TT * i) * BK + kk]
        comptime for j in range(RN):
            b_frag[j] = b_s[unsafe_offset=kk * B_STRIDE + tx + TT * j]
        comptime for i in range(RM):
            comptime for j in range(RN):
                acc[i * RN + j] += a_frag[i] * b_frag[j]


@always_inline
def store_tile[dtype: DType, add_bias: Bool](
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    bias: Pointer[Scalar[dtype], MutAnyOrigin],
    acc: Acc, row0: Int, col0: Int, ty: Int, tx: Int, m: Int, n: Int,
):
    """Write this thread's patch of the tile, skipping rows/columns past (m, n)."""
    comptime for i in range(RM):
        var r = row0 + ty + TT * i
        comptime for j in range(RN):
            var c = col0 + tx + TT * j
            if r < m and c < n:
                var v = acc[i * RN + j]
                comptime if add_bias:
                    v += bias[unsafe_offset=c].cast[DType.float32]()
                dst[unsafe_offset=r * n + c] = v.cast[dtype]()
