# dispatch_N / dispatch_N_dps (N = 1, 3, 6): y[i] = sum of the N inputs' i-th
# elements. They exist to measure host dispatch cost (scripts/bench_dispatch.py):
# the kernel is trivial so the call's host overhead is what gets timed.
# dispatch_N returns a MAX-allocated output (the form CustomOpLibrary calls);
# dispatch_N_dps writes into a caller-allocated buffer (the form ops/launch/bridge.py calls).
#
# GPU mapping: a 1-D grid, one thread per element.

import extensibility
from extensibility import InputTensor, OutputTensor, _MutableInputTensor
from max.gpu.host import DeviceContext
from max.gpu import thread_idx, block_idx
from std.math import ceildiv

comptime BLOCK = 256
comptime Ptr[dtype: DType] = Pointer[Scalar[dtype], MutAnyOrigin]


def sum_kernel[dtype: DType, n_in: Int](
    y: Ptr[dtype], a: Ptr[dtype], b: Ptr[dtype], c: Ptr[dtype],
    d: Ptr[dtype], e: Ptr[dtype], f: Ptr[dtype], n: Int32,
):
    var i = Int(block_idx.x) * BLOCK + Int(thread_idx.x)
    if i >= Int(n):
        return
    var s = a[unsafe_offset=i]
    comptime if n_in >= 3:
        s += b[unsafe_offset=i] + c[unsafe_offset=i]
    comptime if n_in >= 6:
        s += d[unsafe_offset=i] + e[unsafe_offset=i] + f[unsafe_offset=i]
    y[unsafe_offset=i] = s


def launch[dtype: DType, n_in: Int, target: StaticString](
    y: Ptr[dtype], a: Ptr[dtype], b: Ptr[dtype], c: Ptr[dtype],
    d: Ptr[dtype], e: Ptr[dtype], f: Ptr[dtype], n: Int, ctx: DeviceContext,
) raises:
    comptime if target == "gpu":
        comptime kernel = sum_kernel[dtype, n_in]
        ctx.enqueue_function[kernel](y, a, b, c, d, e, f, Int32(n), grid_dim=ceildiv(n, BLOCK), block_dim=BLOCK)
    else:
        for i in range(n):
            var s = a[unsafe_offset=i]
            comptime if n_in >= 3:
                s += b[unsafe_offset=i] + c[unsafe_offset=i]
            comptime if n_in >= 6:
                s += d[unsafe_offset=i] + e[unsafe_offset=i] + f[unsafe_offset=i]
            y[unsafe_offset=i] = s


@extensibility.register("dispatch_1")
struct Dispatch1:
    @staticmethod
    def execute[target: StaticString, dtype: DType](
        y: OutputTensor[dtype=dtype, rank=1, static_spec=_],
        a: InputTensor[dtype=dtype, rank=1, static_spec=_],
        ctx: DeviceContext,
    ) raises:
        var p = a.unsafe_ptr()
        launch[dtype, 1, target](y.unsafe_ptr(), p, p, p, p, p, p, a.dim_size(0), ctx)


@extensibility.register("dispatch_1_dps")
struct Dispatch1Dps:
    @staticmethod
    def execute[target: StaticString, dtype: DType](
        y: _MutableInputTensor[dtype=dtype, rank=1, static_spec=_],
        a: InputTensor[dtype=dtype, rank=1, static_spec=_],
        ctx: DeviceContext,
    ) raises:
        var p = a.unsafe_ptr()
        launch[dtype, 1, target](y.unsafe_ptr(), p, p, p, p, p, p, a.dim_size(0), ctx)


@extensibility.register("dispatch_3")
struct Dispatch3:
    @staticmethod
    def execute[target: StaticString, dtype: DType](
        y: OutputTensor[dtype=dtype, rank=1, static_spec=_],
        a: InputTensor[dtype=dtype, rank=1, static_spec=_],
        b: InputTensor[dtype=dtype, rank=1, static_spec=_],
        c: InputTensor[dtype=dtype, rank=1, static_spec=_],
        ctx: DeviceContext,
    ) raises:
        var p = a.unsafe_ptr()
        launch[dtype, 3, target](y.unsafe_ptr(), p, b.unsafe_ptr(), c.unsafe_ptr(), p, p, p, a.dim_size(0), ctx)


@extensibility.register("dispatch_3_dps")
struct Dispatch3Dps:
    @staticmethod
    def execute[target: StaticString, dtype: DType](
        y: _MutableInputTensor[dtype=dtype, rank=1, static_spec=_],
        a: InputTensor[dtype=dtype, rank=1, static_spec=_],
        b: InputTensor[dtype=dtype, rank=1, static_spec=_],
        c: InputTensor[dtype=dtype, rank=1, static_spec=_],
        ctx: DeviceContext,
    ) raises:
        var p = a.unsafe_ptr()
        launch[dtype, 3, target](y.unsafe_ptr(), p, b.unsafe_ptr(), c.unsafe_ptr(), p, p, p, a.dim_size(0), ctx)


@extensibility.register("dispatch_6")
struct Dispatch6:
    @staticmethod
    def execute[target: StaticString, dtype: DType](
        y: OutputTensor[dtype=dtype, rank=1, static_spec=_],
        a: InputTensor[dtype=dtype, rank=1, static_spec=_],
        b: InputTensor[dtype=dtype, rank=1, static_spec=_],
        c: InputTensor[dtype=dtype, rank=1, static_spec=_],
        d: InputTensor[dtype=dtype, rank=1, static_spec=_],
        e: InputTensor[dtype=dtype, rank=1, static_spec=_],
        f: InputTensor[dtype=dtype, rank=1, static_spec=_],
        ctx: DeviceContext,
    ) raises:
        launch[dtype, 6, target](
            y.unsafe_ptr(), a.unsafe_ptr(), b.unsafe_ptr(), c.unsafe_ptr(),
            d.unsafe_ptr(), e.unsafe_ptr(), f.unsafe_ptr(), a.dim_size(0), ctx,
        )


@extensibility.register("dispatch_6_dps")
struct Dispatch6Dps:
    @staticmethod
    def execute[target: StaticString, dtype: DType](
        y: _MutableInputTensor[dtype=dtype, rank=1, static_spec=_],
        a: InputTensor[dtype=dtype, rank=1, static_spec=_],
        b: InputTensor[dtype=dtype, rank=1, static_spec=_],
        c: InputTensor[dtype=dtype, rank=1, static_spec=_],
        d: InputTensor[dtype=dtype, rank=1, static_spec=_],
        e: InputTensor[dtype=dtype, rank=1, static_spec=_],
        f: InputTensor[dtype=dtype, rank=1, static_spec=_],
        ctx: DeviceContext,
    ) raises:
        launch[dtype, 6, target](
            y.unsafe_ptr(), a.unsafe_ptr(), b.unsafe_ptr(), c.unsafe_ptr(),
            d.unsafe_ptr(), e.unsafe_ptr(), f.unsafe_ptr(), a.dim_size(0), ctx,
        )
