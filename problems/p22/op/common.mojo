# Shared pieces of the p22 kernels: the fixed epsilon, the block-wide sum used
# by the LayerNorm kernels, and the pointer type every kernel takes.
#
# block_sum: every thread of a block passes its partial sum and gets the
# block's total back. Warps reduce with shuffles first, so shared memory holds
# only one value per warp and the block needs two barriers, not log2(threads).

from max.gpu import thread_idx, barrier, WARP_SIZE
from max.gpu.primitives import warp
from max.gpu.memory import AddressSpace
from std.memory import stack_allocation

comptime EPS: Float32 = 1e-5
comptime MAX_WARPS = 32

comptime Ptr[dtype: DType] = Pointer[Scalar[dtype], MutAnyOrigin]


@always_inline
def block_sum[block_threads: Int](v: Float32) -> Float32:
    """Sum of `v` over all `block_threads` threads of the block, returned to every thread."""
    var partials = stack_allocation[
        MAX_WARPS, DType.float32, address_space=AddressSpace.SHARED
    ]()
    comptime n_warps = (block_threads + WARP_SIZE - 1) // WARP_SIZE
    var tid = Int(thread_idx.x)
    var lane = tid % WARP_SIZE
    var w = tid // WARP_SIZE
    var s = warp.sum(v)
    if lane == 0:
        partials[unsafe_offset=w] = s
    barrier()
    var total: Float32 = 0.0
    comptime for i in range(n_warps):
        total += partials[unsafe_offset=i]
    # The second barrier lets a following call reuse `partials` safely.
    barrier()
    return total
