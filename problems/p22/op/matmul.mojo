# p22_matmul: c[r, n] = sum_k a[r, k] * b[k, n], a [batch, seq, k] (rows are
# batch * seq), b [k, n] (the transposed Linear weight), c [batch, seq, n].
#
# GPU mapping: grid (ceil(n/BN), ceil(rows/BM)), THREADS threads per block;
# see tiles.mojo for the tile layout. Loads past the matrix edges store 0 in
# shared memory, and store_tile skips out-of-range outputs, so any size works.
# CPU: the i-k-j loop order, so the innermost loop walks b and c row-wise.

import extensibility
from extensibility import InputTensor, _MutableInputTensor
from max.gpu.host import DeviceContext
from max.gpu import thread_idx, block_idx, barrier
from max.gpu.memory import AddressSpace
from std.math import ceildiv
from std.memory import stack_allocation

from .common import Ptr
from .tiles import (
    A_LOADS, B_LOADS, B_STRIDE, BK, BM, BN, THREADS, TT, Acc,
    accumulate_tile, store_tile,
)


def matmul_kernel[dtype: DType](c: Ptr[dtype], a: Ptr[dtype], b: Ptr[dtype], m: Int32, k: Int32, n: Int32):
    var a_s = stack_allocation[BM * BK, DType.float32, address_space=AddressSpace.SHARED]()
    var b_s = stack_allocation[BK * B_STRIDE, DType.float32, address_space=AddressSpace.SHARED]()
    var mm = Int(m)
    var kk_n = Int(k)
    var nn = Int(n)
    var tx = Int(thread_idx.x)
    var ty = Int(thread_idx.y)
    var tid = ty * TT + tx
    var row0 = Int(block_idx.y) * BM
    var col0 = Int(block_idx.x) * BN
    var acc = Acc(0)
    for k0 in range(0, kk_n, BK):
        comptime for l in range(A_LOADS):
            var idx = tid + l * THREADS
            var r = row0 + idx // BK
            var kc = k0 + idx % BK
            var v: Float32 = 0.0
            if r < mm and kc < kk_n:
                v = a[unsafe_offset=r * kk_n + kc].cast[DType.float32]()
            a_s[unsafe_offset=idx] = v
        comptime for l in range(B_LOADS):
            var idx = tid + l * THREADS
            var kr = k0 + idx // BN
            var col = col0 + idx % BN
            var v: Float32 = 0.0
            if kr < kk_n and col < nn:
                v = b[unsafe_offset=kr * nn + col].cast[DType.float32]()
            b_s[unsafe_offset=(idx // BN) * B_STRIDE + idx % BN] = v
        barrier()
        accumulate_tile(acc, a_s, b_s, ty, tx)
        barrier()
    store_tile[dtype, False](c, c, acc, row0, col0, ty, tx, mm, nn)


def matmul_cpu[dtype: DType](c: Ptr[dtype], a: Ptr[dtype], b: Ptr[dtype], m: Int, k: Int, n: Int):
    for r in range(m):
        for j in range(n):
            c[unsafe_offset=r * n + j] = 0
        for kc in range(k):
            var av = a[unsafe_offset=r * k + kc]
            for j in range(n):
                c[unsafe_offset=r * n + j] += av * b[unsafe_offset=kc * n + j]


@extensibility.register("p22_matmul")
struct P22Matmul:
    @staticmethod
    def execute[target: StaticString, dtype: DType](
        c: _MutableInputTensor[dtype=dtype, rank=3, static_spec=_],
        a: InputTensor[dtype=dtype, rank=3, static_spec=_],
        b: InputTensor[dtype=dtype, rank=2, static_spec=_],
        ctx: DeviceContext,
    ) raises:
        var m = a.dim_size(0) * a.dim_size(1)
        var k = a.dim_size(2)
        var n = b.dim_size(1)
        comptime if target == "gpu":
            comptime kernel = matmul_kernel[dtype]
            ctx.enqueue_function[kernel](
                c.unsafe_ptr(), a.unsafe_ptr(), b.unsafe_ptr(), Int32(m), Int32(k), Int32(n),
                grid_dim=(ceildiv(n, BN), ceildiv(m, BM)), block_dim=(TT, TT),
            )
        else:
            matmul_cpu[dtype](c.unsafe_ptr(), a.unsafe_ptr(), b.unsafe_ptr(), m, k, n)
