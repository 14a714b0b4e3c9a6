# p22_layernorm: y = (x - mean) * rstd * gamma + beta over the hidden dim of
# x [batch, seq, hidden] (rstd = 1 / sqrt(var + EPS)).
#
# GPU mapping: grid (batch, seq), one block of LN_BLOCK threads per sequence
# position. Thread t owns hidden elements t, t + LN_BLOCK, ...: a thread per
# hidden element when hidden <= LN_BLOCK, a strided loop when it is larger.
# Statistics take two passes over the row (mean, then squared deviations):
# the one-pass E[x^2] - E[x]^2 loses every digit when the mean is large
# against the spread.
# CPU: one row at a time with row_stats_cpu, then the same normalization.

import extensibility
from extensibility import InputTensor, _MutableInputTensor
from max.gpu.host import DeviceContext
from max.gpu import thread_idx, block_idx, grid_dim
from std.math import rsqrt

from .common import EPS, Ptr, block_sum

comptime LN_BLOCK = 128


# ANCHOR: layernorm_kernel
def layernorm_kernel[dtype: DType](
    y: Ptr[dtype],
    x: Ptr[dtype],
    gamma: Ptr[dtype],
    beta: Ptr[dtype],
    hidden: Int32,
):
    var h = Int(hidden)
    var row = Int(block_idx.x) * Int(grid_dim.y) + Int(block_idx.y)
    var base = row * h
    var tid = Int(thread_idx.x)
    # FILL ME IN [layernorm_kernel] (roughly 15 lines)
    # Hint: sum your elements (i = tid, tid + LN_BLOCK, ... below h) in float32
    # and call block_sum[LN_BLOCK] for the row total: that gives the mean. A
    # second pass sums squared deviations: rstd = rsqrt(var + EPS). A third
    # writes y = (x - mean) * rstd * gamma + beta, cast back with .cast[dtype]().
    # Element i of a pointer p is p[unsafe_offset=i].
    var s: Float32 = 0.0
    for i in range(tid, h, LN_BLOCK):
        s += x[unsafe_offset=base + i].cast[DType.float32]()
    var mean = block_sum[LN_BLOCK](s) / Float32(h)
    var ss: Float32 = 0.0
    for i in range(tid, h, LN_BLOCK):
        var d = x[unsafe_offset=base + i].cast[DType.float32]() - mean
        ss += d * d
    var rstd = rsqrt(block_sum[LN_BLOCK](ss) / Float32(h) + EPS)
    for i in range(tid, h, LN_BLOCK):
        var xn = (x[unsafe_offset=base + i].cast[DType.float32]() - mean) * rstd
        var g = gamma[unsafe_offset=i].cast[DType.float32]()
        var b = beta[unsafe_offset=i].cast[DType.float32]()
        y[unsafe_offset=base + i] = (xn * g + b).cast[dtype]()
    # END FILL ME IN
# ANCHOR_END: layernorm_kernel


# ANCHOR: row_stats_cpu
def row_stats_cpu[dtype: DType](x: Ptr[dtype], base: Int, hidden: Int) -> Tuple[Float32, Float32]:
    """Mean and rstd of x[unsafe_offset=base : base + hidden], two passes in float32."""
    # FILL ME IN [row_stats_cpu] (roughly 9 lines)
    # Hint: the same two passes as the GPU kernel, as plain loops; return
    # (mean, rsqrt(var + EPS)).
    var s: Float32 = 0.0
    for i in range(hidden):
        s += x[unsafe_offset=base + i].cast[DType.float32]()
    var mean = s / Float32(hidden)
    var ss: Float32 = 0.0
    for i in range(hidden):
        var d = x[unsafe_offset=base + i].cast[DType.float32]() - mean
        ss += d * d
    return (mean, rsqrt(ss / Float32(hidden) + EPS))
    # END FILL ME IN
# ANCHOR_END: row_stats_cpu


def layernorm_cpu[dtype: DType](
    y: Ptr[dtype], x: Ptr[dtype], gamma: Ptr[dtype], beta: Ptr[dtype], rows: Int, hidden: Int
):
    for r in range(rows):
        var base = r * hidden
        var stats = row_stats_cpu[dtype](x, base, hidden)
        for i in range(hidden):
            var xn = (x[unsafe_offset=base + i].cast[DType.float32]() - stats[0]) * stats[1]
            var v = xn * gamma[unsafe_offset=i].cast[DType.float32]() + beta[unsafe_offset=i].cast[DType.float32]()
            y[unsafe_offset=base + i] = v.cast[dtype]()


@extensibility.register("p22_layernorm")
struct P22LayerNorm:
    @staticmethod
    def execute[target: StaticString, dtype: DType](
        y: _MutableInputTensor[dtype=dtype, rank=3, static_spec=_],
        x: InputTensor[dtype=dtype, rank=3, static_spec=_],
        gamma: InputTensor[dtype=dtype, rank=1, static_spec=_],
        beta: InputTensor[dtype=dtype, rank=1, static_spec=_],
        ctx: DeviceContext,
    ) raises:
        var batch = x.dim_size(0)
        var seq = x.dim_size(1)
        var hidden = x.dim_size(2)
        comptime if target == "gpu":
            comptime kernel = layernorm_kernel[dtype]
            ctx.enqueue_function[kernel](
                y.unsafe_ptr(), x.unsafe_ptr(), gamma.unsafe_ptr(), beta.unsafe_ptr(),
                Int32(hidden), grid_dim=(batch, seq), block_dim=LN_BLOCK,
            )
        else:
            layernorm_cpu[dtype](
                y.unsafe_ptr(), x.unsafe_ptr(), gamma.unsafe_ptr(), beta.unsafe_ptr(),
                batch * seq, hidden,
            )
