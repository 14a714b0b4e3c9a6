# p22_transpose: wt[c, r] = w[r, c] for w [rows, cols] (the Linear weight
# [out, hidden] becomes [hidden, out] so the matmul reads it row by row).
#
# GPU mapping: grid (ceil(cols/TILE), ceil(rows/TILE)), block (TILE, ROWS_PER_PASS).
# Each block stages a TILE x TILE tile in shared memory: reads are coalesced
# along w's rows, writes along wt's rows. The tile row is padded by one
# element so the column-wise reads hit 32 different banks.

import extensibility
from extensibility import InputTensor, _MutableInputTensor
from max.gpu.host import DeviceContext
from max.gpu import thread_idx, block_idx, barrier
from max.gpu.memory import AddressSpace
from std.math import ceildiv
from std.memory import stack_allocation

from .common import Ptr

comptime TILE = 32
comptime ROWS_PER_PASS = 8
comptime PADDED = TILE + 1


def transpose_kernel[dtype: DType](wt: Ptr[dtype], w: Ptr[dtype], rows: Int32, cols: Int32):
    var tile = stack_allocation[TILE * PADDED, dtype, address_space=AddressSpace.SHARED]()
    var r_n = Int(rows)
    var c_n = Int(cols)
    var tx = Int(thread_idx.x)
    var ty = Int(thread_idx.y)
    var c0 = Int(block_idx.x) * TILE
    var r0 = Int(block_idx.y) * TILE
    comptime for j in range(0, TILE, ROWS_PER_PASS):
        var r = r0 + ty + j
        var c = c0 + tx
        if r < r_n and c < c_n:
            tile[unsafe_offset=(ty + j) * PADDED + tx] = w[unsafe_offset=r * c_n + c]
    barrier()
    comptime for j in range(0, TILE, ROWS_PER_PASS):
        var out_r = c0 + ty + j
        var out_c = r0 + tx
        if out_r < c_n and out_c < r_n:
            wt[unsafe_offset=out_r * r_n + out_c] = tile[unsafe_offset=tx * PADDED + ty + j]


@extensibility.register("p22_transpose")
struct P22Transpose:
    @staticmethod
    def execute[target: StaticString, dtype: DType](
        wt: _MutableInputTensor[dtype=dtype, rank=2, static_spec=_],
        w: InputTensor[dtype=dtype, rank=2, static_spec=_],
        ctx: DeviceContext,
    ) raises:
        var rows = w.dim_size(0)
        var cols = w.dim_size(1)
        var wtp = wt.unsafe_ptr()
        var wp = w.unsafe_ptr()
        comptime if target == "gpu":
            comptime kernel = transpose_kernel[dtype]
            ctx.enqueue_function[kernel](
                wtp, wp, Int32(rows), Int32(cols),
                grid_dim=(ceildiv(cols, TILE), ceildiv(rows, TILE)),
                block_dim=(TILE, ROWS_PER_PASS),
            )
        else:
            for r in range(rows):
                for c in range(cols):
                    wtp[unsafe_offset=c * rows + r] = wp[unsafe_offset=r * cols + c]
