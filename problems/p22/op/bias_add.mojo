# p22_bias_add: y[r, n] = c[r, n] + bias[n] for c [batch, seq, out].
#
# GPU mapping: a 1-D grid of BIAS_BLOCK-thread blocks, one thread per element.

import extensibility
from extensibility import InputTensor, _MutableInputTensor
from max.gpu.host import DeviceContext
from max.gpu import thread_idx, block_idx
from std.math import ceildiv

from .common import Ptr

comptime BIAS_BLOCK = 256


def bias_add_kernel[dtype: DType](y: Ptr[dtype], c: Ptr[dtype], bias: Ptr[dtype], total: Int32, n: Int32):
    var i = Int(block_idx.x) * BIAS_BLOCK + Int(thread_idx.x)
    if i < Int(total):
        y[unsafe_offset=i] = c[unsafe_offset=i] + bias[unsafe_offset=i % Int(n)]


@extensibility.register("p22_bias_add")
struct P22BiasAdd:
    @staticmethod
    def execute[target: StaticString, dtype: DType](
        y: _MutableInputTensor[dtype=dtype, rank=3, static_spec=_],
        c: InputTensor[dtype=dtype, rank=3, static_spec=_],
        bias: InputTensor[dtype=dtype, rank=1, static_spec=_],
        ctx: DeviceContext,
    ) raises:
        var n = c.dim_size(2)
        var total = c.dim_size(0) * c.dim_size(1) * n
        var yp = y.unsafe_ptr()
        var cp = c.unsafe_ptr()
        var bp = bias.unsafe_ptr()
        comptime if target == "gpu":
            comptime kernel = bias_add_kernel[dtype]
            ctx.enqueue_function[kernel](
                yp, cp, bp, Int32(total), Int32(n),
                grid_dim=ceildiv(total, BIAS_BLOCK), block_dim=BIAS_BLOCK,
            )
        else:
            for i in range(total):
                yp[unsafe_offset=i] = cp[unsafe_offset=i] + bp[unsafe_offset=i % n]
