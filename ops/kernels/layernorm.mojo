# LayerNorm over the last dim of x [rows, h]; fp32, fp16 or bf16 in and out, every sum in fp32.
# layernorm_fwd: y = act((x - mean) * rstd * gamma + beta) and mean, rstd per row (float32); act is 0 (none),
#   1 (GELU, tanh form) or 2 (GELU, erf form). layernorm_bwd: dx, dgamma, dbeta from dy, x, gamma, beta, mean, rstd.
# GPU mapping (ops/layernorm/config.py picks the kernel and its parameters for both launch routes):
#   ln_fwd_regs: WPR warps per row, RPB rows per block, the row held in registers (CH 16-byte vectors per
#     thread); the statistics take two exact passes over the registers.
#   ln_fwd_cluster (sm_90+): a row too long for one block, split over a cluster of CL blocks that merge their
#     (count, mean, M2) through distributed shared memory.
#   ln_fwd_row_thread, ln_fwd_block_smem, ln_fwd_loop: the teaching progression (variant=) and the fallbacks
#     (unaligned pointers, h not a multiple of the vector): one pass of shifted sums.
#   ln_bwd_regs / ln_bwd_loop: rows dealt round-robin to row groups that keep dgamma/dbeta partials;
#     ln_bwd_regs loads a group's next row while it reduces the current one (up to 4 vectors a thread) and writes
#     one partial row per block of RPB groups; ln_bwd_reduce sums the partials per column in a fixed order
#     (deterministic, no float atomics), REDUCE_UNROLL loads of a thread in flight.
# RMSNorm (ops/rmsnorm): the loop, register and cluster kernels and the CPU path take it as bits of act (NORM_RMS,
#   RMS_LLAMA, RMS_GEMMA below): no mean (the mean kept is 0), no beta, no mean term in the backward; the teaching
#   progression's first two kernels refuse them.
# Limits: rows and h below 2^31; the CPU path (fwd_cpu, bwd_cpu) takes one row at a time.
# Design notes, the kernel progression and the measurements behind each choice: docs/kernels/layernorm.md.

import extensibility
from extensibility import InputTensor, _MutableInputTensor
from max.gpu.host import DeviceContext, Dim
from max.gpu import thread_idx, block_idx, barrier, WARP_SIZE, MAX_THREADS_PER_BLOCK_METADATA
from max.gpu.primitives import warp
from max.gpu.primitives.cluster import block_rank_in_cluster, cluster_arrive_relaxed, cluster_sync, cluster_wait
from max.gpu.memory import AddressSpace
from std.math import ceildiv, rsqrt, erf, exp
from std.memory import stack_allocation, bitcast
from std.sys import llvm_intrinsic, size_of
from std.utils.static_tuple import StaticTuple

comptime F32 = DType.float32
comptime Ptr[dtype: DType] = Pointer[Scalar[dtype], MutAnyOrigin]

comptime ACT_NONE = 0
comptime ACT_GELU_TANH = 1
comptime ACT_GELU_ERF = 2
comptime ACT_BITS = 3   # act & ACT_BITS: the activation; the bits above choose the norm
# RMSNorm (act bits): y = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps), no
# mean and no beta (the mean kept is 0). Its semantics, as the models that use it compute it:
comptime NORM_RMS = 4    # torch's F.rms_norm: the product in fp32, one rounding to the dtype
comptime RMS_LLAMA = 8   # with NORM_RMS, Hugging Face Llama's: x * rstd rounded to the dtype, then times the weight
comptime RMS_GEMMA = 16  # with NORM_RMS, Hugging Face Gemma's: times (1 + weight), in fp32
comptime SQRT_2_OVER_PI: Float32 = 0.7978845608028654
comptime INV_SQRT_2: Float32 = 0.7071067811865476
comptime INV_SQRT_2PI: Float32 = 0.3989422804014327
comptime GELU_CUBIC: Float32 = 0.044715

# Which kernel a launch runs (the registered ops' `kernel` parameter; ops/layernorm/config.py chooses
# the kernel and its parameters for both launch routes).
comptime K_ROW_THREAD = 0
comptime K_BLOCK_SMEM = 1
comptime K_LOOP = 2
comptime K_REGS = 3
comptime K_CLUSTER = 4

comptime ROW_THREAD_BLOCK = 128
comptime ROW_THREAD_CHUNK = 64
comptime SMEM_BLOCK = 256
# The dgamma/dbeta reduction (ln_bwd_reduce[COLS, LEVELS]: COLS columns per block, 2^LEVELS threads per column):
# narrow blocks (more of them) for rows up to REDUCE_NARROW_MAX_H, wide ones beyond (ops/layernorm/config.py).
comptime REDUCE_NARROW_MAX_H = 1024
comptime REDUCE_NARROW_COLS = 8    # 8 floats: one 32-byte sector
comptime REDUCE_NARROW_LEVELS = 7
comptime REDUCE_WIDE_COLS = 32
comptime REDUCE_WIDE_LEVELS = 3
comptime REDUCE_UNROLL = 16        # partials a thread loads together: one at a time, the sums were latency-bound
comptime ALIGN = 16         # bytes per vector load
# ln_fwd_regs' register budget (.minnctapersm): registers for FWD_THREADS_PER_SM threads an SM (64 each) where a
# thread holds at most FWD_CAPPED_SLICE bytes of the row (ptxas had given some 66-80: one block of 512 an SM); a
# larger share keeps what it needs (under the budget it spilled and slowed). docs/kernels/layernorm.md
comptime FWD_THREADS_PER_SM = 1024
comptime FWD_CAPPED_SLICE = 64


# ---------------------------------------------------------------- math

@always_inline
def tanh_exact[w: Int](u: SIMD[F32, w]) -> SIMD[F32, w]:
    """Tanh through exp: the GPU's tanh is an approximation whose error shows in GELU's gradient."""
    return 1.0 - 2.0 / (exp(2.0 * u) + 1.0)


@always_inline
def activate[act: Int, w: Int](z: SIMD[F32, w]) -> SIMD[F32, w]:
    comptime if (act & ACT_BITS) == ACT_GELU_TANH:
        return 0.5 * z * (1.0 + tanh_exact(SQRT_2_OVER_PI * (z + GELU_CUBIC * z * z * z)))
    elif (act & ACT_BITS) == ACT_GELU_ERF:
        return 0.5 * z * (1.0 + erf(z * INV_SQRT_2))
    else:
        return z


@always_inline
def activate_grad[act: Int, w: Int](z: SIMD[F32, w]) -> SIMD[F32, w]:
    """Derivative of activate[act] at z."""
    comptime if (act & ACT_BITS) == ACT_GELU_TANH:
        var t = tanh_exact(SQRT_2_OVER_PI * (z + GELU_CUBIC * z * z * z))
        var du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_CUBIC * z * z)
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * du
    elif (act & ACT_BITS) == ACT_GELU_ERF:
        return 0.5 * (1.0 + erf(z * INV_SQRT_2)) + z * INV_SQRT_2PI * exp(-0.5 * z * z)
    else:
        return SIMD[F32, w](1.0)


@always_inline
def shifted_stats(s1: Float32, s2: Float32, shift: Float32, n: Int, eps: Float32) -> Tuple[Float32, Float32]:
    """Mean and rstd from sums of d = x - shift and d^2 over n elements."""
    var m1 = s1 / Float32(n)
    var v = s2 / Float32(n) - m1 * m1
    if v < 0.0:  # rounding only; a NaN fails the test and propagates
        v = 0.0
    return (shift + m1, rsqrt(v + eps))


@always_inline
def store_stats(mean_out: Ptr[F32], rstd_out: Ptr[F32], row: Int, mean: Float32, rstd: Float32):
    """Keep a row's statistics for the backward; a null mean_out (inference) keeps none."""
    if Int(mean_out) != 0:
        mean_out[unsafe_offset=row] = mean
        rstd_out[unsafe_offset=row] = rstd


@always_inline
def load_f32[dtype: DType](p: Ptr[dtype], i: Int) -> Float32:
    return p[unsafe_offset=i].cast[F32]()


@always_inline
def norm_weight[dtype: DType, act: Int](gamma: Ptr[dtype], i: Int) -> Float32:
    """The weight the output is multiplied by at column i, in fp32: gamma, or 1 + gamma for Gemma's RMSNorm."""
    comptime if (act & RMS_GEMMA) != 0:
        return 1.0 + load_f32(gamma, i)
    else:
        return load_f32(gamma, i)


@always_inline
def normalized[dtype: DType, act: Int = ACT_NONE](
    x: Ptr[dtype], gamma: Ptr[dtype], beta: Ptr[dtype], base: Int, i: Int, mean: Float32, rstd: Float32,
) -> Float32:
    """(x - mean) * rstd * gamma + beta at column i, in fp32; RMSNorm (``act``'s NORM_RMS): x * rstd times its
    weight (``norm_weight``), Llama's with x * rstd rounded to the dtype first."""
    comptime if (act & NORM_RMS) == 0:
        return (load_f32(x, base + i) - mean) * rstd * load_f32(gamma, i) + load_f32(beta, i)
    else:
        var xhat = load_f32(x, base + i) * rstd
        comptime if (act & RMS_LLAMA) != 0:
            xhat = xhat.cast[dtype]().cast[F32]()
        return xhat * norm_weight[dtype, act](gamma, i)


@always_inline
def store_normalized[dtype: DType, act: Int](
    y: Ptr[dtype], x: Ptr[dtype], gamma: Ptr[dtype], beta: Ptr[dtype],
    base: Int, i: Int, mean: Float32, rstd: Float32,
):
    """The scalar paths' output: y = act((x - mean) * rstd * gamma + beta) at column i (RMSNorm: ``normalized``)."""
    y[unsafe_offset=base + i] = activate[act, 1](
        normalized[dtype, act](x, gamma, beta, base, i, mean, rstd)).cast[dtype]()


@always_inline
def gamma_dy[dtype: DType, act: Int](
    dy: Ptr[dtype], gamma: Ptr[dtype], beta: Ptr[dtype], base: Int, i: Int, xhat: Float32,
) -> Tuple[Float32, Float32]:
    """(gamma, d) at column i of the scalar backward, d = dL/d(pre-activation): dy times act' (RMSNorm: its weight,
    ``norm_weight``, and no activation)."""
    var g = norm_weight[dtype, act](gamma, i)
    var d = load_f32(dy, base + i)
    comptime if (act & ACT_BITS) != ACT_NONE:
        d = d * activate_grad[act, 1](xhat * g + load_f32(beta, i))
    return (g, d)


# ---------------------------------------------------------------- reductions

comptime Shared = Pointer[Float32, MutUntrackedOrigin, address_space=AddressSpace.SHARED]


@always_inline
def warp_partials_sum[WPR: Int](sh: Shared, first: Int) -> Float32:
    """sh[first : first + WPR] (WPR <= 32), one per lane, summed by a butterfly warp.sum: pairwise, so partials of
    equal values add exactly (2^k c) and a row of one value of power-of-two length gets exactly its mean. Only
    where that matters: in every kernel, it took more registers than the in-order sum (bf16 4096x8192: 45, not 40)."""
    var lane = Int(thread_idx.x) % WARP_SIZE
    return warp.sum(sh[unsafe_offset=first + lane] if lane < WPR else Float32(0.0))


@always_inline
def group_sum[WPR: Int, RPB: Int, pairwise: Bool = False](v: Float32, sh: Shared, slot: Int) -> Float32:
    """Sum over the WPR warps that share a row; every thread of the group gets it. The warps' sums add in
    order, or with ``pairwise`` in a butterfly (``warp_partials_sum``).

    `sh` holds RPB * WPR floats per slot; a caller alternates slots so the next
    write never races the previous read (no trailing barrier).
    """
    var s = warp.sum(v)
    comptime if WPR == 1:
        return s
    else:
        var w = Int(thread_idx.x) // WARP_SIZE
        var base = slot * RPB * WPR
        if Int(thread_idx.x) % WARP_SIZE == 0:
            sh[unsafe_offset=base + w] = s
        barrier()
        var first = base + (w // WPR) * WPR
        comptime if pairwise:
            return warp_partials_sum[WPR](sh, first)
        var total: Float32 = 0.0
        comptime for i in range(WPR):
            total += sh[unsafe_offset=first + i]
        return total


@always_inline
def group_sum_pair[WPR: Int, RPB: Int](a: Float32, b: Float32, sh: Shared, slot: Int) -> Tuple[Float32, Float32]:
    """``group_sum`` of two values at once (one barrier), in slots ``slot`` and ``slot + 1``."""
    var sa = warp.sum(a)
    var sb = warp.sum(b)
    comptime if WPR == 1:
        return (sa, sb)
    else:
        var w = Int(thread_idx.x) // WARP_SIZE
        var base = slot * RPB * WPR
        if Int(thread_idx.x) % WARP_SIZE == 0:
            sh[unsafe_offset=base + w] = sa
            sh[unsafe_offset=base + RPB * WPR + w] = sb
        barrier()
        var ta: Float32 = 0.0
        var tb: Float32 = 0.0
        var first = base + (w // WPR) * WPR
        comptime for i in range(WPR):
            ta += sh[unsafe_offset=first + i]
            tb += sh[unsafe_offset=first + RPB * WPR + i]
        return (ta, tb)


# ---------------------------------------------------------------- register slices
# The register paths hold, per thread, the CH vectors first + c * GT + gt (c < CH)
# of a row: first = 0 with a block (or a warp group) per row, a block's slice
# offset in a cluster. They hold them in fp32 (Regs) or, in the one-block forward,
# as loaded (RT = dtype: half the registers for a 16-bit row), widened to fp32 at
# each use.

comptime Regs[VEC: Int, CH: Int] = SIMD[F32, CH * VEC]


@always_inline
def load_slice[dtype: DType, VEC: Int, CH: Int, GT: Int, RT: DType = F32](
    p: Ptr[dtype], base: Int, first: Int, gt: Int, nv: Int, valid: Bool,
) -> SIMD[RT, CH * VEC]:
    """This thread's vectors of the row at p + base as RT; 0 past nv vectors or when not valid."""
    var v = SIMD[RT, CH * VEC](0.0)
    comptime for c in range(CH):
        var j = first + c * GT + gt
        if valid and j < nv:
            v = v.insert[offset=c * VEC](p.unsafe_load[width=VEC, alignment=ALIGN](base + j * VEC).cast[RT]())
    return v


@always_inline
def store_slice[dtype: DType, VEC: Int, CH: Int, GT: Int](
    p: Ptr[dtype], v: Regs[VEC, CH], base: Int, first: Int, gt: Int, nv: Int,
):
    """Store this thread's vectors of v into the row at p + base (those below nv)."""
    comptime for c in range(CH):
        var j = first + c * GT + gt
        if j < nv:
            p.unsafe_store[alignment=ALIGN](base + j * VEC, v.slice[VEC, offset=c * VEC]().cast[dtype]())


@always_inline
def slice_sum[VEC: Int, CH: Int, RT: DType](v: SIMD[RT, CH * VEC]) -> Float32:
    """Sum of this thread's vectors in fp32 (zeros past the row add nothing)."""
    comptime if RT == F32:
        return v.reduce_add().cast[F32]()
    else:
        var s: Float32 = 0.0
        comptime for c in range(CH):
            s += v.slice[VEC, offset=c * VEC]().cast[F32]().reduce_add()
        return s


@always_inline
def slice_shifted_sum[VEC: Int, CH: Int, GT: Int, RT: DType = F32](
    v: SIMD[RT, CH * VEC], shift: Float32, first: Int, gt: Int, nv: Int,
) -> Float32:
    """Sum of x - shift over this thread's vectors of the row (those below nv)."""
    var s: Float32 = 0.0
    comptime for c in range(CH):
        if first + c * GT + gt < nv:
            s += (v.slice[VEC, offset=c * VEC]().cast[F32]() - shift).reduce_add()
    return s


@always_inline
def slice_deviation_sums[VEC: Int, CH: Int, GT: Int, RT: DType = F32](
    v: SIMD[RT, CH * VEC], mean: Float32, first: Int, gt: Int, nv: Int,
) -> Tuple[Float32, Float32]:
    """Sums of d = x - mean and of d^2 over this thread's vectors of the row (those below nv)."""
    var s: Float32 = 0.0
    var ss: Float32 = 0.0
    comptime for c in range(CH):
        if first + c * GT + gt < nv:
            var d = v.slice[VEC, offset=c * VEC]().cast[F32]() - mean
            s += d.reduce_add()
            ss += (d * d).reduce_add()
    return (s, ss)


@always_inline
def slice_m2[VEC: Int, CH: Int, GT: Int, RT: DType = F32](
    v: SIMD[RT, CH * VEC], mean: Float32, first: Int, gt: Int, nv: Int,
) -> Float32:
    """Sum of (x - mean)^2 over this thread's vectors of the row (those below nv)."""
    var ss: Float32 = 0.0
    comptime for c in range(CH):
        if first + c * GT + gt < nv:
            var d = v.slice[VEC, offset=c * VEC]().cast[F32]() - mean
            ss += (d * d).reduce_add()
    return ss


@always_inline
def store_normalized_slice[dtype: DType, act: Int, VEC: Int, CH: Int, GT: Int, RT: DType = F32](
    y: Ptr[dtype], gamma: Ptr[dtype], beta: Ptr[dtype], v: SIMD[RT, CH * VEC],
    mean: Float32, rstd: Float32, base: Int, first: Int, gt: Int, nv: Int,
):
    """y = act((x - mean) * rstd * gamma + beta) for this thread's vectors (RMSNorm: ``rms_vector``); gamma and beta
    are loaded one vector at a time, next to their use, to keep registers for the row."""
    comptime for c in range(CH):
        var j = first + c * GT + gt
        if j < nv:
            comptime if (act & NORM_RMS) != 0:
                var z = rms_vector[dtype, act, VEC](v.slice[VEC, offset=c * VEC]().cast[F32](), gamma, j, rstd)
                y.unsafe_store[alignment=ALIGN](base + j * VEC, z.cast[dtype]())
            else:
                var g = gamma.unsafe_load[width=VEC, alignment=ALIGN](j * VEC).cast[F32]()
                var b = beta.unsafe_load[width=VEC, alignment=ALIGN](j * VEC).cast[F32]()
                var z = (v.slice[VEC, offset=c * VEC]().cast[F32]() - mean) * rstd * g + b
                y.unsafe_store[alignment=ALIGN](base + j * VEC, activate[act, VEC](z).cast[dtype]())


@always_inline
def rms_vector[dtype: DType, act: Int, VEC: Int](xv: SIMD[F32, VEC], gamma: Ptr[dtype], j: Int,
                                                 rstd: Float32) -> SIMD[F32, VEC]:
    """RMSNorm's output at vector j of a row (``normalized``'s, a vector at a time): x * rstd (Llama's rounded to the
    dtype) times gamma (Gemma's 1 + gamma), in fp32."""
    var xhat = xv * rstd
    comptime if (act & RMS_LLAMA) != 0:
        xhat = xhat.cast[dtype]().cast[F32]()
    var g = gamma.unsafe_load[width=VEC, alignment=ALIGN](j * VEC).cast[F32]()
    comptime if (act & RMS_GEMMA) != 0:
        g = g + 1.0
    return xhat * g


# ---------------------------------------------------------------- forward, variants 1-3

def ln_fwd_row_thread[dtype: DType, act: Int](
    y: Ptr[dtype], mean_out: Ptr[F32], rstd_out: Ptr[F32], x: Ptr[dtype],
    gamma: Ptr[dtype], beta: Ptr[dtype], rows: Int32, h: Int32, eps: Float32,
):
    var row = Int(block_idx.x) * ROW_THREAD_BLOCK + Int(thread_idx.x)
    var n = Int(h)
    if row >= Int(rows):
        return
    var base = row * n
    var shift = load_f32(x, base)
    var s1: Float32 = 0.0
    var s2: Float32 = 0.0
    # Two-level sums: one running sum over 4096 squares drifts by ~n/2 ulps.
    for i0 in range(0, n, ROW_THREAD_CHUNK):
        var c1: Float32 = 0.0
        var c2: Float32 = 0.0
        for i in range(i0, min(i0 + ROW_THREAD_CHUNK, n)):
            var d = load_f32(x, base + i) - shift
            c1 += d
            c2 += d * d
        s1 += c1
        s2 += c2
    var st = shifted_stats(s1, s2, shift, n, eps)
    for i in range(n):
        store_normalized[dtype, act](y, x, gamma, beta, base, i, st[0], st[1])
    store_stats(mean_out, rstd_out, row, st[0], st[1])


def ln_fwd_block_smem[dtype: DType, act: Int](
    y: Ptr[dtype], mean_out: Ptr[F32], rstd_out: Ptr[F32], x: Ptr[dtype],
    gamma: Ptr[dtype], beta: Ptr[dtype], rows: Int32, h: Int32, eps: Float32,
):
    var sh1 = stack_allocation[SMEM_BLOCK, F32, address_space=AddressSpace.SHARED]()
    var sh2 = stack_allocation[SMEM_BLOCK, F32, address_space=AddressSpace.SHARED]()
    var row = Int(block_idx.x)
    var tid = Int(thread_idx.x)
    var n = Int(h)
    var base = row * n
    var shift = load_f32(x, base)
    var s1: Float32 = 0.0
    var s2: Float32 = 0.0
    for i in range(tid, n, SMEM_BLOCK):
        var d = load_f32(x, base + i) - shift
        s1 += d
        s2 += d * d
    sh1[unsafe_offset=tid] = s1
    sh2[unsafe_offset=tid] = s2
    barrier()
    comptime for level in range(8):  # log2(SMEM_BLOCK) halvings
        comptime stride = SMEM_BLOCK >> (level + 1)
        if tid < stride:
            sh1[unsafe_offset=tid] = sh1[unsafe_offset=tid] + sh1[unsafe_offset=tid + stride]
            sh2[unsafe_offset=tid] = sh2[unsafe_offset=tid] + sh2[unsafe_offset=tid + stride]
        barrier()
    var st = shifted_stats(sh1[unsafe_offset=0], sh2[unsafe_offset=0], shift, n, eps)
    for i in range(tid, n, SMEM_BLOCK):
        store_normalized[dtype, act](y, x, gamma, beta, base, i, st[0], st[1])
    if tid == 0:
        store_stats(mean_out, rstd_out, row, st[0], st[1])


def ln_fwd_loop[dtype: DType, act: Int, WPR: Int, RPB: Int, UNROLL: Int](
    y: Ptr[dtype], mean_out: Ptr[F32], rstd_out: Ptr[F32], x: Ptr[dtype],
    gamma: Ptr[dtype], beta: Ptr[dtype], rows: Int32, h: Int32, eps: Float32,
):
    """Variant 3 (WPR=8, RPB=1) and the fallback for any h: WPR warps per row, RPB rows per block. A thread
    takes UNROLL of its columns at a time, their loads in flight together (a launch of few blocks is
    latency-bound), then the rest one by one."""
    comptime GT = WPR * WARP_SIZE
    comptime STEP = UNROLL * GT
    var sh = stack_allocation[2 * RPB * WPR, F32, address_space=AddressSpace.SHARED]()
    var tid = Int(thread_idx.x)
    var gt = tid % GT
    var row = Int(block_idx.x) * RPB + tid // GT
    var valid = row < Int(rows)
    var n = Int(h)
    var base = row * n
    var shift: Float32 = 0.0
    var s1: Float32 = 0.0
    var s2: Float32 = 0.0
    var tail = gt   # this thread's first column after those taken UNROLL at a time
    comptime if UNROLL > 1:
        if gt < n:
            tail = gt + (n - gt) // STEP * STEP
    if valid:
        comptime if (act & NORM_RMS) == 0:   # RMSNorm: sums of x and x^2 (shift 0)
            shift = load_f32(x, base)
        comptime if UNROLL > 1:
            var a1 = SIMD[F32, UNROLL](0.0)
            var a2 = SIMD[F32, UNROLL](0.0)
            for i in range(gt, tail, STEP):
                var d = SIMD[F32, UNROLL](0.0)
                comptime for u in range(UNROLL):
                    d[u] = load_f32(x, base + i + u * GT)
                d -= shift
                a1 += d
                a2 += d * d
            s1 = a1.reduce_add()
            s2 = a2.reduce_add()
        for i in range(tail, n, GT):
            var d = load_f32(x, base + i) - shift
            s1 += d
            s2 += d * d
    # Every thread reaches the barriers inside group_sum, valid row or not.
    var st: Tuple[Float32, Float32]
    comptime if (act & NORM_RMS) == 0:
        st = shifted_stats(group_sum[WPR, RPB](s1, sh, 0), group_sum[WPR, RPB](s2, sh, 1), shift, n, eps)
    else:
        st = (Float32(0.0), rsqrt(group_sum[WPR, RPB](s2, sh, 1) / Float32(n) + eps))
    if not valid:
        return
    comptime if UNROLL > 1:
        for i in range(gt, tail, STEP):
            var v = SIMD[F32, UNROLL](0.0)
            comptime for u in range(UNROLL):
                v[u] = normalized[dtype, act](x, gamma, beta, base, i + u * GT, st[0], st[1])
            var out = activate[act, UNROLL](v)
            comptime for u in range(UNROLL):
                y[unsafe_offset=base + i + u * GT] = out[u].cast[dtype]()
    for i in range(tail, n, GT):
        store_normalized[dtype, act](y, x, gamma, beta, base, i, st[0], st[1])
    if gt == 0:
        store_stats(mean_out, rstd_out, row, st[0], st[1])


# ---------------------------------------------------------------- forward, register variants

def fwd_min_blocks(threads: Int, slice_bytes: Int) -> Int:
    """Blocks of ``threads`` an SM must hold (.minnctapersm, with .maxntid = threads) when each thread holds
    ``slice_bytes`` of the row(s): FWD_THREADS_PER_SM's worth up to FWD_CAPPED_SLICE bytes, else 1 (only the block's
    own launch bound)."""
    if slice_bytes > FWD_CAPPED_SLICE:
        return 1
    return max(1, FWD_THREADS_PER_SM // threads)


# RMSNorm's share counts half: with no centred second pass, its row of 128 bytes a thread fit 64 registers.
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(WPR * RPB * WARP_SIZE)),
    `nvvm.minctasm`=SIMDLength(fwd_min_blocks(WPR * RPB * WARP_SIZE,
                                              CH * VEC * size_of[dtype]() // (2 if (act & NORM_RMS) != 0 else 1))),
)
def ln_fwd_regs[dtype: DType, act: Int, VEC: Int, CH: Int, WPR: Int, RPB: Int](
    y: Ptr[dtype], mean_out: Ptr[F32], rstd_out: Ptr[F32], x: Ptr[dtype],
    gamma: Ptr[dtype], beta: Ptr[dtype], rows: Int32, h: Int32, eps: Float32,
):
    """Row in registers: thread gt of a row group holds vectors gt, gt + GT, ... (CH of them).

    Needs h % VEC == 0, h <= CH * VEC * GT and 16-byte aligned pointers.
    """
    comptime GT = WPR * WARP_SIZE
    comptime CORRECTED = dtype == F32 and CH * VEC * GT >= 4096   # the mean's correction (below): a third slot
    var sh = stack_allocation[(3 if CORRECTED else 2) * RPB * WPR, F32, address_space=AddressSpace.SHARED]()
    var tid = Int(thread_idx.x)
    var gt = tid % GT
    var row = Int(block_idx.x) * RPB + tid // GT
    var valid = row < Int(rows)
    var n = Int(h)
    var nv = n // VEC
    var base = row * n
    # All loads are issued before any arithmetic depends on them. The row stays in its
    # own type: fp16/bf16 rows take half the registers, which an H100 A/B turned into
    # more resident rows (exp/s12_ln.py on branch s12-exp).
    var v = load_slice[dtype, VEC, CH, GT, dtype](x, base, 0, gt, nv, valid)
    regs_row_forward[dtype, act, VEC, CH, WPR, RPB](y, mean_out, rstd_out, x, gamma, beta, v, sh, row, valid, gt,
                                                     n, base, eps)


# Its launch bound alone: it holds x and the residual at once, and no shape gained from ln_fwd_regs' budget.
@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(WPR * RPB * WARP_SIZE)))
def add_norm_fwd_regs[dtype: DType, act: Int, VEC: Int, CH: Int, WPR: Int, RPB: Int, BIAS: Bool](
    y: Ptr[dtype], s_out: Ptr[dtype], mean_out: Ptr[F32], rstd_out: Ptr[F32], x: Ptr[dtype], residual: Ptr[dtype],
    add_bias: Ptr[dtype], gamma: Ptr[dtype], beta: Ptr[dtype], rows: Int32, h: Int32, eps: Float32,
):
    """A pre-norm block's add and norm in one pass, ``ln_fwd_regs``'s mapping: s = x (+ add_bias) + residual, each
    add rounded to the dtype as torch's adds are, stored; then y = norm(s) (act: LayerNorm's or RMSNorm's) from the
    registers. Needs what ``ln_fwd_regs`` needs, of every pointer."""
    comptime GT = WPR * WARP_SIZE
    comptime CORRECTED = dtype == F32 and CH * VEC * GT >= 4096
    var sh = stack_allocation[(3 if CORRECTED else 2) * RPB * WPR, F32, address_space=AddressSpace.SHARED]()
    var tid = Int(thread_idx.x)
    var gt = tid % GT
    var row = Int(block_idx.x) * RPB + tid // GT
    var valid = row < Int(rows)
    var n = Int(h)
    var nv = n // VEC
    var base = row * n
    var v = load_slice[dtype, VEC, CH, GT, dtype](x, base, 0, gt, nv, valid)
    var r = load_slice[dtype, VEC, CH, GT, dtype](residual, base, 0, gt, nv, valid)
    comptime if BIAS:
        v = (v.cast[F32]() + load_slice[dtype, VEC, CH, GT](add_bias, 0, 0, gt, nv, valid)).cast[dtype]()
    v = (v.cast[F32]() + r.cast[F32]()).cast[dtype]()
    if valid:
        store_slice[dtype, VEC, CH, GT](s_out, v.cast[F32](), base, 0, gt, nv)
    barrier()   # s's first value, which the statistics' shift reads, is in memory for the whole row group
    regs_row_forward[dtype, act, VEC, CH, WPR, RPB](y, mean_out, rstd_out, s_out, gamma, beta, v, sh, row, valid, gt,
                                                     n, base, eps)


@always_inline
def regs_row_forward[dtype: DType, act: Int, VEC: Int, CH: Int, WPR: Int, RPB: Int](
    y: Ptr[dtype], mean_out: Ptr[F32], rstd_out: Ptr[F32], x: Ptr[dtype], gamma: Ptr[dtype], beta: Ptr[dtype],
    v: SIMD[dtype, CH * VEC], sh: Shared, row: Int, valid: Bool, gt: Int, n: Int, base: Int, eps: Float32,
):
    """``ln_fwd_regs``'s statistics and output for a row held in ``v`` (x: the row in memory, for its first value)."""
    comptime GT = WPR * WARP_SIZE
    comptime CORRECTED = dtype == F32 and CH * VEC * GT >= 4096
    var nv = n // VEC
    # A row of one value must get exactly that value as its mean (so y = beta); docs/kernels/layernorm.md has the
    # argument and the H100 numbers behind each choice:
    # - bf16 rows of at most 65536 values, fp16 ones of at most 8192 (PLAIN_EXACT): every partial sum of equal
    #   16-bit values is exact in fp32 there (8 + 16 and 11 + 13 significant bits), so the plain mean is.
    # - fp32 rows of 4096 or more values (CORRECTED): the plain mean m0, corrected by the mean of d = x - m0,
    #   which the variance's pass sums anyway; the shift below costs these 4 registers and 9% of their time.
    #   Rows of a power-of-two length skip the correction: every partial sum is pairwise (slice_sum's
    #   reduce_add, warp.sum, warp_partials_sum), so the partials of a row of c are 2^k c, exact, and m0 is c.
    # - otherwise (shorter fp32 rows, longer fp16 ones): the mean of x - x[0], plus x[0], which has less latency
    #   there than the correction's second reduction (up to 8%) and, at 32768, fewer registers (127 against
    #   133, over the 128 a 512-thread block may have).
    comptime PLAIN_EXACT = (dtype == DType.bfloat16 and CH * VEC * GT <= 65536) or (
        dtype == DType.float16 and CH * VEC * GT <= 8192)
    var mean: Float32
    var rstd: Float32
    comptime if (act & NORM_RMS) != 0:   # RMSNorm: the mean square (the mean kept is 0)
        mean = 0.0
        rstd = rsqrt(group_sum[WPR, RPB](slice_m2[VEC, CH, GT, dtype](v, 0.0, 0, gt, nv), sh, 1) / Float32(n) + eps)
    elif CORRECTED:
        var m0 = group_sum[WPR, RPB, pairwise=True](slice_sum[VEC, CH, dtype](v), sh, 0) / Float32(n)
        if (n & (n - 1)) == 0:   # the same for the whole block: its barriers stay in step
            mean = m0
            var ss = slice_m2[VEC, CH, GT, dtype](v, m0, 0, gt, nv)
            rstd = rsqrt(group_sum[WPR, RPB](ss, sh, 1) / Float32(n) + eps)
        else:
            var sums = slice_deviation_sums[VEC, CH, GT, dtype](v, m0, 0, gt, nv)
            var total = group_sum_pair[WPR, RPB](sums[0], sums[1], sh, 1)
            var st = shifted_stats(total[0], total[1], m0, n, eps)
            mean = st[0]
            rstd = st[1]
    else:
        comptime if not PLAIN_EXACT:
            var shift = load_f32(x, base) if valid else Float32(0.0)
            var s1 = slice_shifted_sum[VEC, CH, GT, dtype](v, shift, 0, gt, nv)
            mean = shift + group_sum[WPR, RPB](s1, sh, 0) / Float32(n)
        else:
            mean = group_sum[WPR, RPB](slice_sum[VEC, CH, dtype](v), sh, 0) / Float32(n)
        var ss = slice_m2[VEC, CH, GT, dtype](v, mean, 0, gt, nv)
        rstd = rsqrt(group_sum[WPR, RPB](ss, sh, 1) / Float32(n) + eps)
    if not valid:
        return
    store_normalized_slice[dtype, act, VEC, CH, GT, dtype](y, gamma, beta, v, mean, rstd, base, 0, gt, nv)
    if gt == 0:
        store_stats(mean_out, rstd_out, row, mean, rstd)


@always_inline
def slice_count(nv: Int, first: Int, slice_vectors: Int) -> Int:
    """Vectors of a row of nv vectors that fall in the slice [first, first + slice_vectors)."""
    return min(max(nv - first, 0), slice_vectors)


@always_inline
def peer_load(p: Shared, rank: Int, i: Int) -> Float32:
    """p[i] in the shared memory of cluster block `rank` (distributed shared memory)."""
    var g = p.unsafe_address_space_cast[AddressSpace.GENERIC]()
    var peer = llvm_intrinsic["llvm.nvvm.mapa", type_of(g)](g, Int32(rank))
    return peer[unsafe_offset=i]


def ln_fwd_cluster[dtype: DType, act: Int, VEC: Int, CH: Int, WPR: Int, CL: Int](
    y: Ptr[dtype], mean_out: Ptr[F32], rstd_out: Ptr[F32], x: Ptr[dtype],
    gamma: Ptr[dtype], beta: Ptr[dtype], rows: Int32, h: Int32, eps: Float32,
):
    """A cluster of CL blocks per row (sm_90): block rank r holds the row's slice of vectors
    r * SLICE + c * GT + gt (c < CH) in registers.

    Each block reduces its slice exactly (its mean, then its squared deviations from it),
    and every block merges the CL (count, mean, M2) pairs read from its peers' shared
    memory in the same order, so all of them get the same statistics. Needs h % VEC == 0,
    h <= CL * SLICE * VEC and 16-byte aligned pointers; the grid is rows * CL blocks.
    """
    comptime GT = WPR * WARP_SIZE
    comptime SLICE = CH * GT
    var sh = stack_allocation[2 * WPR, F32, address_space=AddressSpace.SHARED]()
    var part = stack_allocation[2, F32, address_space=AddressSpace.SHARED]()
    var rank = Int(block_rank_in_cluster())
    var gt = Int(thread_idx.x)
    var row = Int(block_idx.x) // CL
    var n = Int(h)
    var nv = n // VEC
    var first = rank * SLICE
    var base = row * n
    var v = load_slice[dtype, VEC, CH, GT](x, base, first, gt, nv, True)
    comptime if (act & NORM_RMS) != 0:   # RMSNorm: the blocks' sums of squares, added in rank order
        rms_cluster_finish[dtype, act, VEC, CH, WPR, CL](y, mean_out, rstd_out, gamma, v, sh, part, rank, gt, row,
                                                         first, base, n, eps)
        return
    var count = slice_count(nv, first, SLICE) * VEC
    # Means are of x - x[0] (x[0] added back at the end): a row of one value gets exactly it (so y = beta).
    var shift = load_f32(x, base)
    var local_mean = group_sum[WPR, 1](slice_shifted_sum[VEC, CH, GT](v, shift, first, gt, nv), sh, 0) / Float32(
        max(count, 1))
    var m2 = group_sum[WPR, 1](slice_m2[VEC, CH, GT](v, shift + local_mean, first, gt, nv), sh, 1)
    if gt == 0:
        part[unsafe_offset=0] = local_mean
        part[unsafe_offset=1] = m2
    # Release this block's pair, acquire the peers'.
    cluster_sync()
    # Merge: the count-weighted mean of the block means, then each block's M2 plus its
    # count times its mean's squared distance from that. (A one-pass Chan merge, with a
    # divide per block, ran 2-5% slower at 32 rows x 65536 on the H100.)
    var means = SIMD[F32, CL](0.0)
    var counts = SIMD[F32, CL](0.0)
    var mean: Float32 = 0.0
    comptime for q in range(CL):
        means[q] = peer_load(part, q, 0)
        counts[q] = Float32(slice_count(nv, q * SLICE, SLICE) * VEC)
        mean += counts[q] * means[q]
    mean /= Float32(n)
    var m2_total: Float32 = 0.0
    comptime for q in range(CL):
        var d = means[q] - mean
        m2_total += peer_load(part, q, 1) + counts[q] * d * d
    # Done with the peers' shared memory: they may exit once every block has said so.
    cluster_arrive_relaxed()
    var rstd = rsqrt(m2_total / Float32(n) + eps)
    mean += shift
    # store_normalized_slice's loop, written out: called here, ptxas gave this kernel up to
    # 8 more registers (local sm_90 builds), and that version ran 2-4% slower at 32 x 65536
    # on the H100 (exp/s11_merge.py on branch s11-exp).
    comptime for c in range(CH):
        var j = first + c * GT + gt
        if j < nv:
            var g = gamma.unsafe_load[width=VEC, alignment=ALIGN](j * VEC).cast[F32]()
            var b = beta.unsafe_load[width=VEC, alignment=ALIGN](j * VEC).cast[F32]()
            var z = (v.slice[VEC, offset=c * VEC]() - mean) * rstd * g + b
            y.unsafe_store[alignment=ALIGN](base + j * VEC, activate[act, VEC](z).cast[dtype]())
    if rank == 0 and gt == 0:
        store_stats(mean_out, rstd_out, row, mean, rstd)
    cluster_wait()


@always_inline
def rms_cluster_finish[dtype: DType, act: Int, VEC: Int, CH: Int, WPR: Int, CL: Int](
    y: Ptr[dtype], mean_out: Ptr[F32], rstd_out: Ptr[F32], gamma: Ptr[dtype], v: Regs[VEC, CH], sh: Shared,
    part: Shared, rank: Int, gt: Int, row: Int, first: Int, base: Int, n: Int, eps: Float32,
):
    """``ln_fwd_cluster``'s RMSNorm: each block's sum of squares through distributed shared memory, every block adding
    the CL of them in the same order (so all get the same rstd), then its slice's output."""
    comptime GT = WPR * WARP_SIZE
    var nv = n // VEC
    var ss = group_sum[WPR, 1](slice_m2[VEC, CH, GT](v, 0.0, first, gt, nv), sh, 0)
    if gt == 0:
        part[unsafe_offset=0] = ss
    cluster_sync()
    var total: Float32 = 0.0
    comptime for q in range(CL):
        total += peer_load(part, q, 0)
    cluster_arrive_relaxed()
    var rstd = rsqrt(total / Float32(n) + eps)
    store_normalized_slice[dtype, act, VEC, CH, GT](y, gamma, gamma, v, 0.0, rstd, base, first, gt, nv)
    if rank == 0 and gt == 0:
        store_stats(mean_out, rstd_out, row, 0.0, rstd)
    cluster_wait()


# ---------------------------------------------------------------- forward launchers

def launch_fwd_regs[dtype: DType, act: Int, VEC: Int, CH: Int, WPR: Int, RPB: Int](
    ctx: DeviceContext, y: Ptr[dtype], mean: Ptr[F32], rstd: Ptr[F32], x: Ptr[dtype],
    gamma: Ptr[dtype], beta: Ptr[dtype], rows: Int, h: Int, eps: Float32,
) raises:
    comptime kernel = ln_fwd_regs[dtype, act, VEC, CH, WPR, RPB]
    ctx.enqueue_function[kernel](y, mean, rstd, x, gamma, beta, Int32(rows), Int32(h), eps,
                                 grid_dim=ceildiv(rows, RPB), block_dim=WPR * RPB * WARP_SIZE)


def launch_fwd_cluster[dtype: DType, act: Int, VEC: Int, CH: Int, WPR: Int, CL: Int](
    ctx: DeviceContext, y: Ptr[dtype], mean: Ptr[F32], rstd: Ptr[F32], x: Ptr[dtype],
    gamma: Ptr[dtype], beta: Ptr[dtype], rows: Int, h: Int, eps: Float32,
) raises:
    comptime kernel = ln_fwd_cluster[dtype, act, VEC, CH, WPR, CL]
    ctx.enqueue_function[kernel](y, mean, rstd, x, gamma, beta, Int32(rows), Int32(h), eps,
                                 grid_dim=rows * CL, block_dim=WPR * WARP_SIZE, cluster_dim=Dim(CL))


def launch_fwd_loop[dtype: DType, act: Int, WPR: Int, RPB: Int, UNROLL: Int](
    ctx: DeviceContext, y: Ptr[dtype], mean: Ptr[F32], rstd: Ptr[F32], x: Ptr[dtype],
    gamma: Ptr[dtype], beta: Ptr[dtype], rows: Int, h: Int, eps: Float32,
) raises:
    comptime kernel = ln_fwd_loop[dtype, act, WPR, RPB, UNROLL]
    ctx.enqueue_function[kernel](y, mean, rstd, x, gamma, beta, Int32(rows), Int32(h), eps,
                                 grid_dim=ceildiv(rows, RPB), block_dim=WPR * RPB * WARP_SIZE)


def vector_width[dtype: DType]() -> Int:
    return ALIGN // size_of[Scalar[dtype]]()


def aligned(*addresses: Int) -> Bool:
    for a in addresses:
        if a % ALIGN != 0:
            return False
    return True


def fwd_gpu[dtype: DType, act: Int, kernel: Int, CH: Int, WPR: Int, RPB: Int, CL: Int, UNROLL: Int](
    ctx: DeviceContext, y: Ptr[dtype], mean: Ptr[F32], rstd: Ptr[F32], x: Ptr[dtype],
    gamma: Ptr[dtype], beta: Ptr[dtype], rows: Int, h: Int, eps: Float32,
) raises:
    """Enqueue the forward kernel `kernel` with its parameters (as ops/layernorm/config.py chose them)."""
    comptime assert (act & NORM_RMS) == 0 or kernel >= K_LOOP, "RMSNorm runs the loop, register or cluster kernel"
    comptime VEC = vector_width[dtype]()
    comptime if kernel == K_ROW_THREAD:
        comptime k = ln_fwd_row_thread[dtype, act]
        ctx.enqueue_function[k](y, mean, rstd, x, gamma, beta, Int32(rows), Int32(h), eps,
                                grid_dim=ceildiv(rows, ROW_THREAD_BLOCK), block_dim=ROW_THREAD_BLOCK)
    elif kernel == K_BLOCK_SMEM:
        comptime k = ln_fwd_block_smem[dtype, act]
        ctx.enqueue_function[k](y, mean, rstd, x, gamma, beta, Int32(rows), Int32(h), eps,
                                grid_dim=rows, block_dim=SMEM_BLOCK)
    elif kernel == K_LOOP:
        launch_fwd_loop[dtype, act, WPR, RPB, UNROLL](ctx, y, mean, rstd, x, gamma, beta, rows, h, eps)
    elif kernel == K_REGS:
        launch_fwd_regs[dtype, act, VEC, CH, WPR, RPB](ctx, y, mean, rstd, x, gamma, beta, rows, h, eps)
    else:
        comptime if ctx.default_device_info.compute >= 9.0:
            launch_fwd_cluster[dtype, act, VEC, CH, WPR, CL](ctx, y, mean, rstd, x, gamma, beta, rows, h, eps)


# ---------------------------------------------------------------- backward

def ln_bwd_regs[dtype: DType, act: Int, VEC: Int, CH: Int, WPR: Int, RPB: Int](
    dx: Ptr[dtype], part_g: Ptr[F32], part_b: Ptr[F32], dy: Ptr[dtype], x: Ptr[dtype],
    gamma: Ptr[dtype], beta: Ptr[dtype], mean: Ptr[F32], rstd: Ptr[F32],
    rows: Int32, h: Int32, parts: Int32,
):
    """Group p (of `parts`, RPB per block: parts = blocks * RPB) handles rows p, p + parts, ...;
    dx = rstd * (g*dy - E[g*dy] - xhat * E[g*dy*xhat]). dgamma/dbeta partials: one row per block (RMSNorm: dgamma's
    alone, part_b untouched)."""
    comptime GT = WPR * WARP_SIZE
    comptime W = CH * VEC
    comptime BETA = (act & NORM_RMS) == 0   # LayerNorm's dbeta partials; RMSNorm has no beta
    var sh = stack_allocation[4 * RPB * WPR, F32, address_space=AddressSpace.SHARED]()
    var tid = Int(thread_idx.x)
    var gt = tid % GT
    var group = Int(block_idx.x) * RPB + tid // GT
    var n = Int(h)
    var nv = n // VEC
    var p = Int(parts)
    var g = Regs[VEC, CH](0.0)
    var bt = Regs[VEC, CH](0.0)
    comptime for c in range(CH):
        var j = c * GT + gt
        if j < nv:
            g = g.insert[offset=c * VEC](gamma.unsafe_load[width=VEC, alignment=ALIGN](j * VEC).cast[F32]())
            comptime if (act & ACT_BITS) != ACT_NONE:
                bt = bt.insert[offset=c * VEC](beta.unsafe_load[width=VEC, alignment=ALIGN](j * VEC).cast[F32]())
    comptime if (act & RMS_GEMMA) != 0:   # Gemma's weight is 1 + gamma (1 past the row, where dy is 0)
        g = g + 1.0
    # dgamma/dbeta accumulators: in registers with one group per block, or several groups of several warps each
    # (joined through shared memory at the end: JOIN); with several one-warp groups, in shared memory, 16 bytes per
    # thread side by side (conflict-free), which leaves the registers for the next row's loads (with them in
    # registers as well, ptxas spilled).
    comptime SMEM_ACC = RPB > 1 and WPR == 1
    comptime JOIN = RPB > 1 and WPR > 1
    comptime Q = W // 4                # 16-byte quads per accumulator
    var local = tid // GT
    var acc_s = stack_allocation[(2 * RPB * Q * GT * 4) if SMEM_ACC else (2 * (RPB - 1) * Q * GT * 4) if JOIN else 1,
                                 F32, address_space=AddressSpace.SHARED]()
    var acc_g = SIMD[F32, W](0.0)
    var acc_b = SIMD[F32, W](0.0)
    comptime if SMEM_ACC:
        comptime for q in range(Q):
            acc_store(acc_s, quad_index[Q, GT](local, 0, q, gt), SIMD[F32, 4](0.0))
            comptime if BETA:
                acc_store(acc_s, quad_index[Q, GT](local, 1, q, gt), SIMD[F32, 4](0.0))
    var iters = ceildiv(Int(rows), p)
    # With AHEAD, row it + 1's x, dy and statistics load (as stored) while row it is reduced: two rows in flight a
    # warp. Not with 8 vectors a thread, where ptxas spills them (docs/kernels/layernorm.md).
    comptime AHEAD = CH <= 4
    var nx = SIMD[dtype, W](0)
    var ndy = SIMD[dtype, W](0)
    var nm: Float32 = 0.0
    var nr: Float32 = 0.0
    comptime if AHEAD:
        load_row[dtype, VEC, CH, GT](nx, ndy, nm, nr, x, dy, mean, rstd, group, group < p and group < Int(rows), n, gt,
                                     nv)
    for it in range(iters):
        var row = group + it * p
        var valid = group < p and row < Int(rows)
        var base = row * n
        comptime if not AHEAD:
            load_row[dtype, VEC, CH, GT](nx, ndy, nm, nr, x, dy, mean, rstd, row, valid, n, gt, nv)
        var xv = nx.cast[F32]()
        var dyv = ndy.cast[F32]()  # zero where invalid: contributes nothing below
        var m = nm
        var r = nr
        comptime if AHEAD:
            var nrow = row + p
            load_row[dtype, VEC, CH, GT](nx, ndy, nm, nr, x, dy, mean, rstd, nrow, group < p and nrow < Int(rows), n,
                                         gt, nv)
        var xhat = (xv - m) * r
        comptime if (act & ACT_BITS) != ACT_NONE:
            dyv = dyv * activate_grad[act, W](xhat * g + bt)
        var gdy = g * dyv
        var slot = 2 * (it % 2)
        var a: Float32 = 0.0   # RMSNorm: no mean, so no mean term (and no beta: its partials stay 0)
        comptime if (act & NORM_RMS) == 0:
            a = group_sum[WPR, RPB]((gdy).reduce_add(), sh, slot) / Float32(n)
        var b = group_sum[WPR, RPB]((gdy * xhat).reduce_add(), sh, slot + 1) / Float32(n)
        comptime if SMEM_ACC:
            var dg = dyv * xhat
            comptime for q in range(Q):
                if quad_in_row[VEC, GT](q, gt, nv):
                    var ig = quad_index[Q, GT](local, 0, q, gt)
                    acc_store(acc_s, ig, acc_load(acc_s, ig) + dg.slice[4, offset=q * 4]())
                    comptime if BETA:
                        var ib = quad_index[Q, GT](local, 1, q, gt)
                        acc_store(acc_s, ib, acc_load(acc_s, ib) + dyv.slice[4, offset=q * 4]())
        else:
            acc_g += dyv * xhat
            comptime if BETA:
                acc_b += dyv
        if valid:
            store_slice[dtype, VEC, CH, GT](dx, r * (gdy - a - xhat * b), base, 0, gt, nv)
    # One partial row per block: its RPB groups' sums add in order through shared memory (group 0 keeps its own).
    comptime if SMEM_ACC:
        barrier()
        if local > 0:
            return
        comptime for q in range(Q):
            if quad_in_row[VEC, GT](q, gt, nv):
                var tg = acc_load(acc_s, quad_index[Q, GT](0, 0, q, gt))
                comptime for k in range(1, RPB):
                    tg += acc_load(acc_s, quad_index[Q, GT](k, 0, q, gt))
                acc_g = acc_g.insert[offset=q * 4](tg)
                comptime if BETA:
                    var tb = acc_load(acc_s, quad_index[Q, GT](0, 1, q, gt))
                    comptime for k in range(1, RPB):
                        tb += acc_load(acc_s, quad_index[Q, GT](k, 1, q, gt))
                    acc_b = acc_b.insert[offset=q * 4](tb)
    comptime if JOIN:   # groups 1.. hand their registers over; group 0 adds them to its own in order
        if local > 0:
            comptime for q in range(Q):
                acc_store(acc_s, quad_index[Q, GT](local - 1, 0, q, gt), acc_g.slice[4, offset=q * 4]())
                comptime if BETA:
                    acc_store(acc_s, quad_index[Q, GT](local - 1, 1, q, gt), acc_b.slice[4, offset=q * 4]())
        barrier()
        if local > 0:
            return
        comptime for q in range(Q):
            var tg = acc_g.slice[4, offset=q * 4]()
            comptime for k in range(1, RPB):
                tg += acc_load(acc_s, quad_index[Q, GT](k - 1, 0, q, gt))
            acc_g = acc_g.insert[offset=q * 4](tg)
            comptime if BETA:
                var tb = acc_b.slice[4, offset=q * 4]()
                comptime for k in range(1, RPB):
                    tb += acc_load(acc_s, quad_index[Q, GT](k - 1, 1, q, gt))
                acc_b = acc_b.insert[offset=q * 4](tb)
    store_slice[F32, VEC, CH, GT](part_g, acc_g, Int(block_idx.x) * n, 0, gt, nv)
    comptime if BETA:
        store_slice[F32, VEC, CH, GT](part_b, acc_b, Int(block_idx.x) * n, 0, gt, nv)


@always_inline
def load_row[dtype: DType, VEC: Int, CH: Int, GT: Int](
    mut xv: SIMD[dtype, CH * VEC], mut dyv: SIMD[dtype, CH * VEC], mut m: Float32, mut r: Float32, x: Ptr[dtype],
    dy: Ptr[dtype], mean: Ptr[F32], rstd: Ptr[F32], row: Int, valid: Bool, n: Int, gt: Int, nv: Int,
):
    """This thread's vectors of row `row` of x and dy (as stored) and its statistics; zeros when not valid. x and dy
    in one loop, not two `load_slice` calls: ptxas then needs fewer registers."""
    xv = SIMD[dtype, CH * VEC](0)
    dyv = SIMD[dtype, CH * VEC](0)
    m = 0.0
    r = 0.0
    if valid:
        m = mean[unsafe_offset=row]
        r = rstd[unsafe_offset=row]
        comptime for c in range(CH):
            var j = c * GT + gt
            if j < nv:
                xv = xv.insert[offset=c * VEC](x.unsafe_load[width=VEC, alignment=ALIGN](row * n + j * VEC))
                dyv = dyv.insert[offset=c * VEC](dy.unsafe_load[width=VEC, alignment=ALIGN](row * n + j * VEC))


@always_inline
def quad_in_row[VEC: Int, GT: Int](q: Int, gt: Int, nv: Int) -> Bool:
    """Whether quad q of thread gt's accumulators lies in its vectors below nv (the row's; the rest stay unused)."""
    return (q * 4) // VEC * GT + gt < nv


@always_inline
def quad_index[Q: Int, GT: Int](local: Int, which: Int, q: Int, gt: Int) -> Int:
    """Float offset of quad q of thread gt's dgamma (which 0) or dbeta (1) accumulator in group `local`'s plane."""
    return (((2 * local + which) * Q + q) * GT + gt) * 4


@always_inline
def acc_load(p: Shared, i: Int) -> SIMD[F32, 4]:
    return p.unsafe_load[width=4, alignment=16](i)


@always_inline
def acc_store(p: Shared, i: Int, v: SIMD[F32, 4]):
    p.unsafe_store[alignment=16](i, v)


def ln_bwd_loop[dtype: DType, act: Int, WPR: Int, RPB: Int](
    dx: Ptr[dtype], part_g: Ptr[F32], part_b: Ptr[F32], dy: Ptr[dtype], x: Ptr[dtype],
    gamma: Ptr[dtype], beta: Ptr[dtype], mean: Ptr[F32], rstd: Ptr[F32],
    rows: Int32, h: Int32, parts: Int32,
):
    """Any h: two passes over each row; the partial sums live in part_g/part_b themselves.

    Each partial element is owned by one thread, so the read-modify-writes
    need no atomics and keep a fixed order.
    """
    comptime GT = WPR * WARP_SIZE
    comptime BETA = (act & NORM_RMS) == 0   # LayerNorm's dbeta partials; RMSNorm has no beta (part_b untouched)
    var sh = stack_allocation[4 * RPB * WPR, F32, address_space=AddressSpace.SHARED]()
    var tid = Int(thread_idx.x)
    var gt = tid % GT
    var group = Int(block_idx.x) * RPB + tid // GT
    var n = Int(h)
    var p = Int(parts)
    if group < p:
        for i in range(gt, n, GT):
            part_g[unsafe_offset=group * n + i] = 0.0
            comptime if BETA:
                part_b[unsafe_offset=group * n + i] = 0.0
    var iters = ceildiv(Int(rows), p)
    for it in range(iters):
        var row = group + it * p
        var valid = group < p and row < Int(rows)
        var base = row * n
        var m: Float32 = 0.0
        var r: Float32 = 0.0
        var sa: Float32 = 0.0
        var sb: Float32 = 0.0
        if valid:
            m = mean[unsafe_offset=row]
            r = rstd[unsafe_offset=row]
            for i in range(gt, n, GT):
                var xhat = (load_f32(x, base + i) - m) * r
                var g, d = gamma_dy[dtype, act](dy, gamma, beta, base, i, xhat)
                comptime if (act & NORM_RMS) == 0:   # RMSNorm: no mean term
                    sa += g * d
                sb += g * d * xhat
        var slot = 2 * (it % 2)
        var a: Float32 = 0.0   # RMSNorm: no mean, so no mean term (and no beta)
        comptime if (act & NORM_RMS) == 0:
            a = group_sum[WPR, RPB](sa, sh, slot) / Float32(n)
        var b = group_sum[WPR, RPB](sb, sh, slot + 1) / Float32(n)
        if valid:
            for i in range(gt, n, GT):
                var xhat = (load_f32(x, base + i) - m) * r
                var g, d = gamma_dy[dtype, act](dy, gamma, beta, base, i, xhat)
                dx[unsafe_offset=base + i] = (r * (g * d - a - xhat * b)).cast[dtype]()
                part_g[unsafe_offset=group * n + i] = part_g[unsafe_offset=group * n + i] + d * xhat
                comptime if BETA:
                    part_b[unsafe_offset=group * n + i] = part_b[unsafe_offset=group * n + i] + d


def ln_bwd_reduce[dtype: DType, COLS: Int, LEVELS: Int, UNROLL: Int, BETA: Bool](
    dgamma: Ptr[dtype], dbeta: Ptr[dtype], part_g: Ptr[F32], part_b: Ptr[F32], parts: Int32, h: Int32,
):
    """Column sums of part_g/part_b [parts, h] in a fixed order, COLS columns per block: 2^LEVELS threads per column
    each sum the parts s, s + 2^LEVELS, ..., UNROLL of them loaded together (their latencies overlap; added in the
    same order), then one thread sums those slices in order (LEVELS <= 3) or a pairwise tree over them in shared
    memory does (more slices: fewer steps, each a barrier). Without BETA (RMSNorm) part_b and dbeta are not touched:
    half the partials' reads."""
    comptime SLICES = 1 << LEVELS
    var sg = stack_allocation[SLICES * COLS, F32, address_space=AddressSpace.SHARED]()
    var sb = stack_allocation[SLICES * COLS if BETA else 1, F32, address_space=AddressSpace.SHARED]()
    var tid = Int(thread_idx.x)
    var c = tid % COLS
    var s = tid // COLS
    var col = Int(block_idx.x) * COLS + c
    var n = Int(h)
    var ag: Float32 = 0.0
    var ab: Float32 = 0.0
    if col < n:
        var q = s
        var stop = Int(parts)
        while q + (UNROLL - 1) * SLICES < stop:
            var vg = SIMD[F32, UNROLL](0.0)
            var vb = SIMD[F32, UNROLL](0.0)
            comptime for u in range(UNROLL):
                vg[u] = part_g[unsafe_offset=(q + u * SLICES) * n + col]
                comptime if BETA:
                    vb[u] = part_b[unsafe_offset=(q + u * SLICES) * n + col]
            comptime for u in range(UNROLL):
                ag += vg[u]
                comptime if BETA:
                    ab += vb[u]
            q += UNROLL * SLICES
        while q < stop:
            ag += part_g[unsafe_offset=q * n + col]
            comptime if BETA:
                ab += part_b[unsafe_offset=q * n + col]
            q += SLICES
    sg[unsafe_offset=tid] = ag
    comptime if BETA:
        sb[unsafe_offset=tid] = ab
    barrier()
    comptime if LEVELS <= 3:
        if s == 0 and col < n:
            var tg: Float32 = 0.0
            var tb: Float32 = 0.0
            comptime for i in range(SLICES):
                tg += sg[unsafe_offset=i * COLS + c]
                comptime if BETA:
                    tb += sb[unsafe_offset=i * COLS + c]
            dgamma[unsafe_offset=col] = tg.cast[dtype]()
            comptime if BETA:
                dbeta[unsafe_offset=col] = tb.cast[dtype]()
        return
    comptime for level in range(LEVELS):
        comptime half = SLICES >> (level + 1)
        if s < half:
            sg[unsafe_offset=tid] += sg[unsafe_offset=tid + half * COLS]
            comptime if BETA:
                sb[unsafe_offset=tid] += sb[unsafe_offset=tid + half * COLS]
        barrier()
    if s == 0 and col < n:
        dgamma[unsafe_offset=col] = sg[unsafe_offset=c].cast[dtype]()
        comptime if BETA:
            dbeta[unsafe_offset=col] = sb[unsafe_offset=c].cast[dtype]()


@always_inline
def launch_bwd_reduce[dtype: DType, COLS: Int, LEVELS: Int, BETA: Bool](
    ctx: DeviceContext, dgamma: Ptr[dtype], dbeta: Ptr[dtype], part_g: Ptr[F32], part_b: Ptr[F32], parts: Int,
    h: Int,
) raises:
    comptime reduce = ln_bwd_reduce[dtype, COLS, LEVELS, REDUCE_UNROLL, BETA]
    ctx.enqueue_function[reduce](dgamma, dbeta, part_g, part_b, Int32(parts), Int32(h),
                                 grid_dim=ceildiv(h, COLS), block_dim=COLS << LEVELS)


# ---------------------------------------------------------------- transposed x (the direct route's copy)

comptime TRANSPOSE_TILE = 32     # a tile of 32 x 32 elements per block
comptime TRANSPOSE_THREADS = 256  # 8 rows of 32 threads, 4 elements each way


def copy_transposed[dtype: DType](y: Ptr[dtype], x: Ptr[dtype], r: Int32, h: Int32, batch_stride: Int32):
    """y [batches, r, h] row-major from x whose [r, h] matrices are column-major (x[b * batch_stride + i + j * r]),
    through a shared-memory tile so that reads (along i) and writes (along j) are both coalesced.
    Grid (ceil(h / 32), ceil(r / 32), batches), block TRANSPOSE_THREADS."""
    comptime PITCH = TRANSPOSE_TILE + 1   # a padded tile row: a column's reads fall in distinct banks
    comptime STEP = TRANSPOSE_THREADS // TRANSPOSE_TILE
    var tile = stack_allocation[TRANSPOSE_TILE * PITCH, dtype, address_space=AddressSpace.SHARED]()
    var tx = Int(thread_idx.x) % TRANSPOSE_TILE
    var ty = Int(thread_idx.x) // TRANSPOSE_TILE
    var i0 = Int(block_idx.y) * TRANSPOSE_TILE
    var j0 = Int(block_idx.x) * TRANSPOSE_TILE
    var rows = Int(r)
    var cols = Int(h)
    var src = Int(block_idx.z) * Int(batch_stride)
    var dst = Int(block_idx.z) * rows * cols
    comptime for k in range(0, TRANSPOSE_TILE, STEP):
        var i = i0 + tx
        var j = j0 + ty + k
        if i < rows and j < cols:
            tile[unsafe_offset=(ty + k) * PITCH + tx] = x[unsafe_offset=src + i + j * rows]
    barrier()
    comptime for k in range(0, TRANSPOSE_TILE, STEP):
        var i = i0 + ty + k
        var j = j0 + tx
        if i < rows and j < cols:
            y[unsafe_offset=dst + i * cols + j] = tile[unsafe_offset=tx * PITCH + ty + k]


def launch_bwd_regs[dtype: DType, act: Int, VEC: Int, CH: Int, WPR: Int, RPB: Int](
    ctx: DeviceContext, dx: Ptr[dtype], part_g: Ptr[F32], part_b: Ptr[F32], dy: Ptr[dtype],
    x: Ptr[dtype], gamma: Ptr[dtype], beta: Ptr[dtype], mean: Ptr[F32], rstd: Ptr[F32],
    rows: Int, h: Int, parts: Int,
) raises:
    comptime kernel = ln_bwd_regs[dtype, act, VEC, CH, WPR, RPB]
    ctx.enqueue_function[kernel](dx, part_g, part_b, dy, x, gamma, beta, mean, rstd,
                                 Int32(rows), Int32(h), Int32(parts),
                                 grid_dim=ceildiv(parts, RPB), block_dim=WPR * RPB * WARP_SIZE)


def launch_bwd_loop[dtype: DType, act: Int, WPR: Int, RPB: Int](
    ctx: DeviceContext, dx: Ptr[dtype], part_g: Ptr[F32], part_b: Ptr[F32], dy: Ptr[dtype],
    x: Ptr[dtype], gamma: Ptr[dtype], beta: Ptr[dtype], mean: Ptr[F32], rstd: Ptr[F32],
    rows: Int, h: Int, parts: Int,
) raises:
    comptime kernel = ln_bwd_loop[dtype, act, WPR, RPB]
    ctx.enqueue_function[kernel](dx, part_g, part_b, dy, x, gamma, beta, mean, rstd,
                                 Int32(rows), Int32(h), Int32(parts),
                                 grid_dim=ceildiv(parts, RPB), block_dim=WPR * RPB * WARP_SIZE)


def bwd_gpu[dtype: DType, act: Int, kernel: Int, CH: Int, WPR: Int, RPB: Int](
    ctx: DeviceContext, dx: Ptr[dtype], dgamma: Ptr[dtype], dbeta: Ptr[dtype],
    part_g: Ptr[F32], part_b: Ptr[F32], dy: Ptr[dtype], x: Ptr[dtype], gamma: Ptr[dtype],
    beta: Ptr[dtype], mean: Ptr[F32], rstd: Ptr[F32], rows: Int, h: Int, parts: Int,
) raises:
    """The row-group kernel `kernel` (K_LOOP or K_REGS, as ops/layernorm/config.py chose), then the reduction of
    `parts` partial rows (K_REGS: a row per block of RPB groups; K_LOOP: a row per group)."""
    comptime VEC = vector_width[dtype]()
    comptime if kernel == K_REGS:
        launch_bwd_regs[dtype, act, VEC, CH, WPR, RPB](ctx, dx, part_g, part_b, dy, x, gamma, beta, mean, rstd,
                                                       rows, h, parts * RPB)
    else:
        launch_bwd_loop[dtype, act, WPR, RPB](ctx, dx, part_g, part_b, dy, x, gamma, beta, mean, rstd, rows, h, parts)
    comptime BETA = (act & NORM_RMS) == 0
    if h <= REDUCE_NARROW_MAX_H:
        launch_bwd_reduce[dtype, REDUCE_NARROW_COLS, REDUCE_NARROW_LEVELS, BETA](ctx, dgamma, dbeta, part_g, part_b,
                                                                               parts, h)
    else:
        launch_bwd_reduce[dtype, REDUCE_WIDE_COLS, REDUCE_WIDE_LEVELS, BETA](ctx, dgamma, dbeta, part_g, part_b,
                                                                           parts, h)


# ---------------------------------------------------------------- CPU

def row_stats_cpu[dtype: DType, act: Int = ACT_NONE](
    x: Ptr[dtype], base: Int, h: Int, eps: Float32
) -> Tuple[Float32, Float32]:
    """(mean, rstd) of x[base : base + h] by two exact passes (the mean of x - x[0], plus x[0]: a row of one value
    gets exactly it); RMSNorm (``act``'s NORM_RMS): (0, 1 / sqrt(mean(x^2) + eps))."""
    comptime if (act & NORM_RMS) != 0:
        var sq: Float32 = 0.0
        for i in range(h):
            var v = load_f32(x, base + i)
            sq += v * v
        return (Float32(0.0), rsqrt(sq / Float32(h) + eps))
    var shift = load_f32(x, base)
    var s: Float32 = 0.0
    for i in range(h):
        s += load_f32(x, base + i) - shift
    var mean = shift + s / Float32(h)
    var ss: Float32 = 0.0
    for i in range(h):
        var d = load_f32(x, base + i) - mean
        ss += d * d
    return (mean, rsqrt(ss / Float32(h) + eps))


def fwd_cpu[dtype: DType, act: Int](
    y: Ptr[dtype], mean_out: Ptr[F32], rstd_out: Ptr[F32], x: Ptr[dtype],
    gamma: Ptr[dtype], beta: Ptr[dtype], rows: Int, h: Int, eps: Float32,
):
    """Two exact passes per row (mean, then squared deviations), then the output."""
    for r in range(rows):
        var base = r * h
        var mean, rstd = row_stats_cpu[dtype, act](x, base, h, eps)
        for i in range(h):
            store_normalized[dtype, act](y, x, gamma, beta, base, i, mean, rstd)
        mean_out[unsafe_offset=r] = mean
        rstd_out[unsafe_offset=r] = rstd


def bwd_cpu[dtype: DType, act: Int](
    dx: Ptr[dtype], dgamma: Ptr[dtype], dbeta: Ptr[dtype], part_g: Ptr[F32], part_b: Ptr[F32],
    dy: Ptr[dtype], x: Ptr[dtype], gamma: Ptr[dtype], beta: Ptr[dtype],
    mean: Ptr[F32], rstd: Ptr[F32], rows: Int, h: Int,
):
    """Rows in order; dgamma/dbeta accumulate in part_g/part_b row 0."""
    for i in range(h):
        part_g[unsafe_offset=i] = 0.0
        part_b[unsafe_offset=i] = 0.0
    for r in range(rows):
        var base = r * h
        var m = mean[unsafe_offset=r]
        var rs = rstd[unsafe_offset=r]
        var sa: Float32 = 0.0
        var sb: Float32 = 0.0
        for i in range(h):
            var xhat = (load_f32(x, base + i) - m) * rs
            var g, d = gamma_dy[dtype, act](dy, gamma, beta, base, i, xhat)
            comptime if (act & NORM_RMS) == 0:   # RMSNorm: no mean term
                sa += g * d
            sb += g * d * xhat
        var a = sa / Float32(h) if (act & NORM_RMS) == 0 else Float32(0.0)   # RMSNorm: no mean term
        var b = sb / Float32(h)
        for i in range(h):
            var xhat = (load_f32(x, base + i) - m) * rs
            var g, d = gamma_dy[dtype, act](dy, gamma, beta, base, i, xhat)
            dx[unsafe_offset=base + i] = (rs * (g * d - a - xhat * b)).cast[dtype]()
            part_g[unsafe_offset=i] = part_g[unsafe_offset=i] + d * xhat
            comptime if (act & NORM_RMS) == 0:   # RMSNorm: no beta (its partials stay 0)
                part_b[unsafe_offset=i] = part_b[unsafe_offset=i] + d
    for i in range(h):
        dgamma[unsafe_offset=i] = part_g[unsafe_offset=i].cast[dtype]()
        dbeta[unsafe_offset=i] = part_b[unsafe_offset=i].cast[dtype]()


# ---------------------------------------------------------------- registered ops

@extensibility.register("layernorm_fwd")
struct LayerNormFwd:
    @staticmethod
    def execute[target: StaticString, dtype: DType, act: Int, eps_bits: Int, kernel: Int, CH: Int, WPR: Int,
                RPB: Int, CL: Int, UNROLL: Int](
        y: _MutableInputTensor[dtype=dtype, rank=2, static_spec=_],
        mean: _MutableInputTensor[dtype=F32, rank=1, static_spec=_],
        rstd: _MutableInputTensor[dtype=F32, rank=1, static_spec=_],
        x: InputTensor[dtype=dtype, rank=2, static_spec=_],
        gamma: InputTensor[dtype=dtype, rank=1, static_spec=_],
        beta: InputTensor[dtype=dtype, rank=1, static_spec=_],
        ctx: DeviceContext,
    ) raises:
        comptime eps = bitcast[F32](UInt32(eps_bits))
        var rows = x.dim_size(0)
        var h = x.dim_size(1)
        comptime if target == "gpu":
            fwd_gpu[dtype, act, kernel, CH, WPR, RPB, CL, UNROLL](
                ctx, y.unsafe_ptr(), mean.unsafe_ptr(), rstd.unsafe_ptr(), x.unsafe_ptr(), gamma.unsafe_ptr(),
                beta.unsafe_ptr(), rows, h, eps)
        else:
            fwd_cpu[dtype, act](y.unsafe_ptr(), mean.unsafe_ptr(), rstd.unsafe_ptr(),
                                x.unsafe_ptr(), gamma.unsafe_ptr(), beta.unsafe_ptr(), rows, h, eps)


@extensibility.register("layernorm_bwd")
struct LayerNormBwd:
    @staticmethod
    def execute[target: StaticString, dtype: DType, act: Int, kernel: Int, CH: Int, WPR: Int, RPB: Int](
        dx: _MutableInputTensor[dtype=dtype, rank=2, static_spec=_],
        dgamma: _MutableInputTensor[dtype=dtype, rank=1, static_spec=_],
        dbeta: _MutableInputTensor[dtype=dtype, rank=1, static_spec=_],
        part_g: _MutableInputTensor[dtype=F32, rank=2, static_spec=_],
        part_b: _MutableInputTensor[dtype=F32, rank=2, static_spec=_],
        dy: InputTensor[dtype=dtype, rank=2, static_spec=_],
        x: InputTensor[dtype=dtype, rank=2, static_spec=_],
        gamma: InputTensor[dtype=dtype, rank=1, static_spec=_],
        beta: InputTensor[dtype=dtype, rank=1, static_spec=_],
        mean: InputTensor[dtype=F32, rank=1, static_spec=_],
        rstd: InputTensor[dtype=F32, rank=1, static_spec=_],
        ctx: DeviceContext,
    ) raises:
        var rows = x.dim_size(0)
        var h = x.dim_size(1)
        var parts = part_g.dim_size(0)
        comptime if target == "gpu":
            bwd_gpu[dtype, act, kernel, CH, WPR, RPB](ctx, dx.unsafe_ptr(), dgamma.unsafe_ptr(), dbeta.unsafe_ptr(),
                                part_g.unsafe_ptr(), part_b.unsafe_ptr(), dy.unsafe_ptr(), x.unsafe_ptr(),
                                gamma.unsafe_ptr(), beta.unsafe_ptr(), mean.unsafe_ptr(), rstd.unsafe_ptr(),
                                rows, h, parts)
        else:
            bwd_cpu[dtype, act](dx.unsafe_ptr(), dgamma.unsafe_ptr(), dbeta.unsafe_ptr(),
                                part_g.unsafe_ptr(), part_b.unsafe_ptr(), dy.unsafe_ptr(), x.unsafe_ptr(),
                                gamma.unsafe_ptr(), beta.unsafe_ptr(), mean.unsafe_ptr(), rstd.unsafe_ptr(),
                                rows, h)
