# p22_matmul: c[r, n] = sum_k a[r, k] * b[k, n], a [batch, seq, k] (rows are
# batch * seq), b [k, n] (the transposed Linear weight), c [batch, seq, n].
#
# GPU mapping: grid (ceil(n/BN), ceil(rows/BM)), THREADS threads per block;
# see tiles.mojo for the tile layout. Each k step stages the values loaded
# during the previous one, then issues the next step's loads before it
# multiplies. Loads past the matrix edges give 0, and store_tile skips
# out-of-range outputs, so any size works.
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
    A_STRIDE, B_LOADS, B_STRIDE, BK, BM, BN, THREADS, TN, Acc, ARegs, BRegs,
    accumulate_tile, load_a, store_a, store_tile,
)


@always_inline
def load_b[dtype: DType](mut regs: BRegs, b: Ptr[dtype], col0: Int, k0: Int, k: Int, n: Int, tid: Int):
    """This thread's values of b [k, n] for the k step at k0: n runs fastest across threads."""
    comptime for l in range(B_LOADS):
        var idx = tid + l * THREADS
        var kr = k0 + idx // BN
        var col = col0 + idx % BN
        regs[l] = b[unsafe_offset=kr * n + col].cast[DType.float32]() if kr < k and col < n else 0.0


def matmul_kernel[dtype: DType](c: Ptr[dtype], a: Ptr[dtype], b: Ptr[dtype], m: Int32, k: Int32, n: Int32):
    var a_s = stack_allocation[BK * A_STRIDE, DType.float32, address_space=AddressSpace.SHARED]()
    var b_s = stack_allocation[BK * B_STRIDE, DType.float32, address_space=AddressSpace.SHARED]()
    var mm = Int(m)
    var kk_n = Int(k)
    var nn = Int(n)
    var tx = Int(thread_idx.x)
    var ty = Int(thread_idx.y)
    var tid = ty * TN + tx
    var row0 = Int(block_idx.y) * BM
    var col0 = Int(block_idx.x) * BN
    var acc = Acc(0)
    var a_regs = ARegs(0)
    var b_regs = BRegs(0)
    load_a(a_regs, a, row0, 0, mm, kk_n, tid)
    load_b(b_regs, b, col0, 0, kk_n, nn, tid)
    for k0 in range(0, kk_n, BK):
        store_a(a_s, a_regs, tid)
        comptime for l in range(B_LOADS):
            var idx = tid + l * THREADS
            b_s[unsafe_offset=(idx // BN) * B_STRIDE + idx % BN] = b_regs[l]
        barrier()
        if k0 + BK < kk_n:
            load_a(a_regs, a, row0, k0 + BK, mm, kk_n, tid)
            load_b(b_regs, b, col0, k0 + BK, kk_n, nn, tid)
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
                grid_dim=(ceildiv(n, BN), ceildiv(m, BM)), block_dim=(TN, THREADS // TN),
            )
        else:
            matmul_cpu[dtype](c.unsafe_ptr(), a.unsafe_ptr(), b.unsafe_ptr(), m, k, n)
