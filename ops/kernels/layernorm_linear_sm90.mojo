# layernorm_linear_fwd_sm90: the bf16 forward of layernorm_linear.mojo (same algorithm, same outputs y, mean,
# rstd) on Hopper's TMA and warp-group MMA (wgmma).
#   layernorm_linear_wgmma_prep (every call, a warp per column): the fold's "ext" rows (G, B + bias) from w.
#   layernorm_linear_fwd_wgmma: a persistent grid of blocks of 384 threads, each taking a contiguous run of
#     WG_TILE_ROWS x WG_TILE_COLS output tiles. Warp group 0 (one thread) produces: TMA copies of x and w slices
#     into a ring of WG_STAGES slots, guarded by full/empty mbarriers. Warp groups 1 and 2 consume 64 rows each:
#     ldmatrix the A fragment, (x - c) * gamma in packed bf16 (c: the row's shift), wgmma m64n256k16
#     (A from registers, B = w from shared memory); on a row block's first tile they also sum d = x - c and d^2
#     for the statistics; a fold MMA applies G and B + bias; the epilogue scales by rstd and TMA-stores y.
# Limits: bf16 on sm_90; k and n multiples of 8, x, w and y 16-byte aligned (ops/layernorm_linear/ checks).
# Where it loses (long tile runs over x larger than L2; few tiles) auto takes another algo (sm90_region).
# Design, the GPU mapping in detail and the measurements behind it: docs/kernels/layernorm_linear.md.

import extensibility
from extensibility import InputTensor, _MutableInputTensor
from max.gpu import thread_idx, block_idx, grid_dim, barrier, WARP_SIZE, MAX_THREADS_PER_BLOCK_METADATA
from max.gpu.host import DeviceContext, DeviceBuffer, FuncAttribute
from max.gpu.host.device_attribute import DeviceAttribute
from max.gpu.host.nvidia.tma import TMADescriptor, TensorMapSwizzle, create_tma_descriptor
from max.gpu.memory import (AddressSpace, external_memory, cp_async_bulk_tensor_shared_cluster_global,
                            cp_async_bulk_tensor_global_shared_cta, fence_mbarrier_init, fence_async_view_proxy)
from max.gpu.sync import (mbarrier_init, mbarrier_arrive, mbarrier_arrive_expect_tx_shared,
                          mbarrier_try_wait_parity_shared, named_barrier, cp_async_bulk_commit_group,
                          cp_async_bulk_wait_group)
from max.gpu.intrinsics import warpgroup_reg_alloc, warpgroup_reg_dealloc
from max.gpu.compute.mma import (ld_matrix, wgmma_async, wgmma_fence_aligned, wgmma_commit_group_sync,
                                 wgmma_wait_group_sync, WGMMADescriptor)
from max.gpu.primitives import warp
from std.math import ceildiv, rsqrt
from std.memory import bitcast
from std.sys import inlined_assembly
from std.utils.index import Index
from std.utils.static_tuple import StaticTuple

from .layernorm import F32, Ptr, load_f32, vector_width
from .layernorm_linear import SHIFT_SAMPLE, fold_row, fold_vector_width, lanes_sum

comptime WG_TILE_ROWS = 128                  # rows per tile: two consumer warp groups of 64
comptime WG_TILE_COLS = 256                  # columns per tile: one wgmma m64n256 per k slice
comptime WG_SLOT_K = 64                   # k per ring slot: one 128-byte swizzled row of 16-bit values
comptime WG_MMA_K = 16
comptime WG_STAGES = 3                # ring slots of 52 KiB
comptime WG_OUT_COLS = 256             # columns staged per TMA store round (the staging buffer's width)
comptime WG_THREADS = 384             # producer + two consumer warp groups
comptime WG_GROUP = 128               # threads per warp group
comptime WG_ROWS = WG_TILE_ROWS // 2         # rows per consumer
comptime WG_BOX = 64                  # TMA store box: 64 x 64 values (128-byte rows)
comptime WG_A_BYTES = WG_TILE_ROWS * WG_SLOT_K * 2
comptime WG_B_BYTES = WG_TILE_COLS * WG_SLOT_K * 2
comptime WG_EXT_COLS = 8             # k values per column of the fold's MMA (ext: [n, 8] bf16)
comptime WG_EXT_BYTES = WG_TILE_COLS * WG_EXT_COLS * 2
comptime WG_LOAD = WG_A_BYTES + WG_B_BYTES      # bytes of a slot's x and wg tiles
comptime WG_SLOT = WG_LOAD + WG_EXT_BYTES       # a slot: x, wg, and (one slot per tile) the fold's ext rows
comptime WG_OUT = WG_STAGES * WG_SLOT           # staging: [2 consumers][boxes][64 rows][128 bytes]
comptime WG_OUT_BYTES = WG_ROWS * WG_OUT_COLS * 2
comptime WG_BAR = WG_OUT + 2 * WG_OUT_BYTES     # full[WG_STAGES], empty[WG_STAGES] mbarriers
comptime WG_SMEM_BYTES = WG_BAR + 2 * WG_STAGES * 8
comptime WG_PRODUCER_REGS = 40        # setmaxnreg: the producer needs few, the consumers hold 128 fp32 accumulators
comptime WG_CONSUMER_REGS = 232
comptime WG_WAIT_TICKS = 0x989680     # mbarrier try_wait suspend-time hint


@always_inline
def b_desc(addr: Int) -> Int64:
    """wgmma descriptor of a K-major [rows, 64] 16-bit tile with 128-byte swizzle at shared address addr:
    start >> 4, leading offset 1 (unused when swizzled), 1024 bytes between 8-row groups, swizzle mode 1."""
    return Int64(((addr & 0x3FFFF) >> 4) | (1 << 16) | ((1024 >> 4) << 32) | (1 << 62))


@always_inline
def ext_desc(addr: Int) -> Int64:
    """wgmma descriptor of the ext rows [WG_TILE_COLS, 8] (bf16, K-major, no swizzle) at shared address addr: core
    matrices of 8 columns x 16 bytes, 128 bytes apart (the stride offset); leading offset 0, so the k 8-15
    half reads the k 0-7 core matrices again, against the A fragment's zero second half. (The offsets the
    other way round gave wrong results on the H100.)"""
    return Int64(((addr & 0x3FFFF) >> 4) | ((128 >> 4) << 32))


@always_inline
def swz(row: Int, chunk: Int) -> Int:
    """Byte offset of 16-byte chunk `chunk` of row `row` in a 128-byte-swizzled tile (TMA SWIZZLE_128B)."""
    return row * 128 + ((chunk ^ (row % 8)) * 16)


@always_inline
def row_shift_quad[dtype: DType](a: SIMD[dtype, 8], h: Int, col: Int, k: Int, inv_sample: Float32) -> Float32:
    """The shift c of fragment row h (0: g, 1: g + 8): the mean of the row's first SHIFT_SAMPLE elements, from
    the first k-slice's fragment (elements 2h, 2h + 1 of the quad's four lanes, columns col, col + 1), rounded
    to dtype. inv_sample is 1 / min(k, SHIFT_SAMPLE). The statistics sum x - c in fp32 (exact: both are
    dtype values); the GEMM's operand (x - c) * gamma is formed in packed dtype arithmetic, with an error
    proportional to |x - c|, which a c near the mean keeps of the spread's size (a constant row: 0)."""
    var s: Float32 = 0.0
    comptime for e in range(2):
        if col + e < k:
            s += a[2 * h + e].cast[F32]()
    return (lanes_sum[4](s) * inv_sample).cast[dtype]().cast[F32]()


@always_inline
def row_stats(s1: Float32, s2: Float32, inv_k: Float32, eps: Float32) -> Tuple[Float32, Float32, Float32]:
    """m1 (mean - shift) and rstd from the sums of d and d^2 over k elements, inv_k = 1 / k: multiplied,
    not divided (shifted_stats), as a division's slow-path check sits on the tile's critical path."""
    var m1 = s1 * inv_k
    var v = s2 * inv_k - m1 * m1
    if v < 0.0:  # rounding only; a NaN propagates
        v = 0.0
    var r = rsqrt(v + eps)
    return (m1, r, (v + eps) * r)


@always_inline
def slot_phase(it: Int) -> Tuple[Int, Int32]:
    """Ring slot and mbarrier parity of the ring's it-th use, in 32-bit arithmetic (Int's 64-bit
    division by WG_STAGES costs a dozen instructions and registers the MMAs need)."""
    comptime S = UInt32(WG_STAGES)
    var u = UInt32(it)
    return (Int(u % S), Int32((u // S) & 1))


@always_inline
def opaque(v: Int) -> Int:
    """v, hidden from the optimizer, so that what is derived from it is computed where it is used.
    Without it LLVM hoists the epilogue's 64 staging offsets out of the tile loop; they stay live
    across the MMAs and ptxas spills them."""
    return Int(inlined_assembly["mov.b32 $0, $1;", Int32, constraints="=r,r", has_side_effect=True](Int32(v)))


@always_inline
def wait_on_dependent_grids():
    """griddepcontrol.wait: until the grids this one depends on (a programmatic dependent launch) have ended and
    their writes are visible; returns at once for a plain launch. (The standard library's wrapper is compiled
    only under a build define, so the instruction is written here.)"""
    inlined_assembly["griddepcontrol.wait;", NoneType, constraints="~{memory}", has_side_effect=True]()


@always_inline
def launch_dependent_grids():
    """griddepcontrol.launch_dependents: this block lets the stream's next kernel, launched as a programmatic
    dependent, be scheduled (a no-op without one)."""
    inlined_assembly["griddepcontrol.launch_dependents;", NoneType, constraints="~{memory}", has_side_effect=True]()


comptime SPtr[T: AnyType] = Pointer[T, MutUntrackedOrigin, address_space=AddressSpace.SHARED]


@always_inline
def ring() -> Tuple[SPtr[UInt8], SPtr[Int64], SPtr[Int64]]:
    """The dynamic shared memory's base (ring slots, staging) and its "full" and "empty" mbarriers."""
    var base = external_memory[UInt8, address_space=AddressSpace.SHARED, alignment=1024]()
    var full = base.unsafe_offset(WG_BAR).unsafe_bitcast[Int64]()
    return (base, full, full.unsafe_offset(WG_STAGES))


@always_inline
def tile_origin(t: Int, tiles_n: Int) -> Tuple[Int, Int]:
    """(row0, col0) of tile t in row-major order."""
    return ((t // tiles_n) * WG_TILE_ROWS, (t % tiles_n) * WG_TILE_COLS)


@always_inline
def tile_range(items: Int) -> Tuple[Int, Int]:
    """This block's tiles [t0, t1): a contiguous run of the row-major order, so that consecutive tiles
    mostly share their 128 rows, whose statistics are then computed once."""
    var per = ceildiv(items, Int(grid_dim.x))
    var t0 = Int(block_idx.x) * per
    return (t0, min(t0 + per, items))


@always_inline
def fresh(t: Int, t0: Int, tiles_n: Int) -> Bool:
    """Whether tile t's rows need their statistics (the block's first tile, or a new row block)."""
    return t == t0 or t % tiles_n == 0


@always_inline
def producer(x_map: Pointer[NoneType, _], w_map: Pointer[NoneType, _], e_map: Pointer[NoneType, _], items: Int,
             tiles_n: Int, steps: Int):
    """One thread: every slot of every tile of this block, in the consumers' order. The fold's ext rows
    come with a tile's first slot when its statistics are known at its start, else with its last."""
    var base, full, empty = ring()
    var it = 0
    var t0, t1 = tile_range(items)
    for t in range(t0, t1):
        var row0, col0 = tile_origin(t, tiles_n)
        var ext_step = steps - 1 if fresh(t, t0, tiles_n) else 0
        for s in range(steps):
            var slot, phase = slot_phase(it)
            _ = mbarrier_try_wait_parity_shared(empty.unsafe_offset(slot), phase ^ 1, Int32(WG_WAIT_TICKS))
            var with_ext = s == ext_step
            mbarrier_arrive_expect_tx_shared(full.unsafe_offset(slot),
                                             Int32(WG_LOAD + (WG_EXT_BYTES if with_ext else 0)))
            var a_s = base.unsafe_offset(slot * WG_SLOT)
            cp_async_bulk_tensor_shared_cluster_global(a_s, x_map, full.unsafe_offset(slot), Index(s * WG_SLOT_K, row0))
            cp_async_bulk_tensor_shared_cluster_global(a_s.unsafe_offset(WG_A_BYTES), w_map, full.unsafe_offset(slot),
                                                       Index(s * WG_SLOT_K, col0))
            if with_ext:
                if t == t0:
                    # Launched as the prep's programmatic dependent (the C++ entry), the block may run before
                    # the prep has written ext: wait for it (x and w are inputs; a no-op for a plain launch).
                    wait_on_dependent_grids()
                cp_async_bulk_tensor_shared_cluster_global(a_s.unsafe_offset(WG_LOAD), e_map, full.unsafe_offset(slot),
                                                           Index(0, col0 // 8))
            it += 1


@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(WG_THREADS)),
    `nvvm.minctasm`=SIMDLength(1),
)
@__llvm_arg_metadata(x_map, `nvvm.grid_constant`)
@__llvm_arg_metadata(w_map, `nvvm.grid_constant`)
@__llvm_arg_metadata(y_map, `nvvm.grid_constant`)
@__llvm_arg_metadata(e_map, `nvvm.grid_constant`)
def layernorm_linear_fwd_wgmma[dtype: DType](
    x_map: TMADescriptor, w_map: TMADescriptor, y_map: TMADescriptor, e_map: TMADescriptor, mean_out: Ptr[F32],
    rstd_out: Ptr[F32], gamma: Ptr[dtype], rows: Int32, k: Int32, n: Int32, eps: Float32,
):
    var base, full, empty = ring()
    var tid = Int(thread_idx.x)
    var mm = Int(rows)
    var kk = Int(k)
    var nn = Int(n)
    var tiles_n = ceildiv(nn, WG_TILE_COLS)
    var items = ceildiv(mm, WG_TILE_ROWS) * tiles_n
    var steps = ceildiv(kk, WG_SLOT_K)
    if tid == 0:
        for s in range(WG_STAGES):
            mbarrier_init(full.unsafe_offset(s), 1)
            mbarrier_init(empty.unsafe_offset(s), Int32(2 * WG_GROUP // WARP_SIZE))  # per consumer warp
        fence_mbarrier_init()
    barrier()
    var wgi = tid // WG_GROUP
    if wgi == 0:
        warpgroup_reg_dealloc[WG_PRODUCER_REGS]()
        if tid == 0:
            producer(Pointer(to=x_map).unsafe_bitcast[NoneType](), Pointer(to=w_map).unsafe_bitcast[NoneType](),
                     Pointer(to=e_map).unsafe_bitcast[NoneType](), items, tiles_n, steps)
    else:
        warpgroup_reg_alloc[WG_CONSUMER_REGS]()
        consumer[dtype](wgi - 1, tid % WG_GROUP, Pointer(to=y_map).unsafe_bitcast[NoneType](), mean_out, rstd_out,
                        gamma, mm, kk, nn, items, tiles_n, steps, eps)


@always_inline
def gamma_lane[dtype: DType](gamma: Ptr[dtype], s: Int, lane: Int, kk: Int) -> SIMD[dtype, 2]:
    """The lane's share of ring step s's gamma: columns 64 s + 2 lane and the next (0 past k; k % 8 == 0, so a
    pair lies inside k or past it, and w's zero fill makes those products 0 as well). Loaded a step ahead of
    its use, so the loads fly while the MMAs run."""
    var c = s * WG_SLOT_K + 2 * lane
    var v = SIMD[dtype, 2](0)
    if c < kk:
        v = SIMD[dtype, 2](gamma[unsafe_offset=c], gamma[unsafe_offset=c + 1])
    return v


@always_inline
def k_step[dtype: DType, sums: Bool](
    mut acc: SIMD[F32, 128], mut s8: SIMD[F32, 8], mut q8: SIMD[F32, 8], a_s: SPtr[UInt8], lm_row: Int,
    lm_chunk: Int, shv: SIMD[dtype, 8], gl: SIMD[dtype, 2], s: Int, tq: Int, kk: Int,
):
    """One ring slot's four k slices: (sums) d = x - c into the rows' fp32 sums, and (x - c) * gamma in packed
    dtype arithmetic into the MMAs (gl: the lanes' gamma_lane shares, passed round by shuffles)."""
    var b_addr = Int(a_s) + WG_A_BYTES
    var tail = (s + 1) * WG_SLOT_K > kk
    var bits = bitcast[DType.uint32, 1](gl)
    comptime for kq in range(WG_SLOT_K // WG_MMA_K):
        # the A fragment's columns c, c + 1 (rows g, g + 8), then c + 8, c + 9; c = 16 kq + 2 tq within the slot
        var lo = bitcast[dtype, 2](warp.shuffle_idx(bits, UInt32(kq * 8 + tq)))
        var hi = bitcast[dtype, 2](warp.shuffle_idx(bits, UInt32(kq * 8 + tq + 4)))
        var x = ld_matrix[simd_width=8](
            a_s.unsafe_offset(swz(lm_row, 2 * kq + lm_chunk)).unsafe_bitcast[Scalar[dtype]]())
        comptime if sums:
            var d = x.cast[F32]() - shv.cast[F32]()
            if tail:   # zero-filled columns past k must not reach the sums
                var cols = SIMD[DType.int32, 8](0, 1, 0, 1, 8, 9, 8, 9) + Int32(s * WG_SLOT_K + kq * WG_MMA_K + 2 * tq)
                d = cols.lt(SIMD[DType.int32, 8](Int32(kk))).select(d, SIMD[F32, 8](0.0))
            s8 += d
            q8 = d.fma(d, q8)
        wgmma_fence_aligned()
        acc = wgmma_async[64, WG_TILE_COLS, WG_MMA_K, a_type=dtype, b_type=dtype](
            (x - shv) * lo.join(lo).join(hi.join(hi)), WGMMADescriptor[dtype](b_desc(b_addr + kq * WG_MMA_K * 2)),
            acc)


@always_inline
def split3(v: Float32) -> SIMD[F32, 4]:
    """v as hi + mid + lo parts exact in bf16 (about 24 bits together); the 4th lane is 0."""
    var hi = v.cast[DType.bfloat16]().cast[F32]()
    var r = v - hi
    var mid = r.cast[DType.bfloat16]().cast[F32]()
    return SIMD[F32, 4](hi, mid, r - mid, 0)


@always_inline
def ext_frag[dtype: DType](m1: SIMD[F32, 2], sigma: SIMD[F32, 2], tq: Int) -> SIMD[dtype, 8]:
    """The fold MMA's A fragment: k columns 2 tq, 2 tq + 1 of rows g, g + 8 (the second k half is 0), so that
    with the ext rows' (G hi, G hi | G mid, B hi | B hi, B mid | G hi, B hi) the MMA adds
    -m1 G + sigma B to each accumulator, to 2^-16 of each product."""
    var f = SIMD[dtype, 8](0)
    comptime for h in range(2):
        var m = split3(-m1[h])
        var sg = split3(sigma[h])
        var first = m[0] if tq < 2 else (sg[1] if tq == 2 else m[2])
        var second = m[1] if tq == 0 else (sg[0] if tq < 3 else sg[2])
        f[2 * h] = first.cast[dtype]()
        f[2 * h + 1] = second.cast[dtype]()
    return f


@always_inline
def fold_mma[dtype: DType](mut acc: SIMD[F32, 128], ef: SIMD[dtype, 8], a_s: SPtr[UInt8]):
    """acc += the fold (ext rows of slot a_s against A fragment ef); uncommitted."""
    wgmma_fence_aligned()
    acc = wgmma_async[64, WG_TILE_COLS, WG_MMA_K, a_type=dtype, b_type=dtype](
        ef, WGMMADescriptor[dtype](ext_desc(Int(a_s) + WG_LOAD)), acc)


@always_inline
def step_done(empty: SPtr[Int64], slot: Int, lane: Int):
    """Commit the step's MMAs and wait for them before the next step's fragments are loaded: they read their
    A operand from registers, and the next ldmatrix reuses those (ptxas gives every step the same ones, and
    changing the A registers of an unfinished wgmma is undefined in the PTX ISA). Then free the slot."""
    wgmma_commit_group_sync()
    wgmma_wait_group_sync[0]()
    if lane == 0:
        _ = mbarrier_arrive(empty.unsafe_offset(slot))


@always_inline
def consumer[dtype: DType](
    cw: Int, lt: Int, y_map: Pointer[NoneType, _], mean_out: Ptr[F32], rstd_out: Ptr[F32], gamma: Ptr[dtype],
    mm: Int, kk: Int, nn: Int, items: Int, tiles_n: Int, steps: Int, eps: Float32,
):
    """Consumer warp group cw (0, 1): rows 64 cw .. of every tile; lt is the thread's index in the group."""
    var base, full, empty = ring()
    var stage = base.unsafe_offset(WG_OUT + cw * WG_OUT_BYTES)
    var lane = lt % WARP_SIZE
    var wrow = cw * WG_ROWS + (lt // WARP_SIZE) * 16   # the warp's 16 rows in the tile
    var g = lane // 4
    var tq = lane % 4
    # ldmatrix x4: lanes 8q .. 8q + 7 address matrix q's rows (rows 0-7 / 8-15 by k 0-7 / 8-15)
    var lm_row = wrow + lane % 8 + 8 * ((lane // 8) % 2)
    var lm_chunk = lane // 16
    var it = 0
    var acc = SIMD[F32, 128](0.0)
    var inv_sample = Float32(1) / Float32(min(kk, SHIFT_SAMPLE))   # 0.125 (exact) when k >= 8
    var inv_k = Float32(1) / Float32(kk)
    var shv = SIMD[dtype, 8](0)      # the rows' shifts, as the A fragment's lanes
    var ef = SIMD[dtype, 8](0)       # the fold MMA's A fragment
    var rstd = SIMD[F32, 2](0.0)
    var gn = gamma_lane(gamma, 0, lane, kk)   # the next step's gamma share (a step ahead, across tiles too)
    var t0, t1 = tile_range(items)
    for t in range(t0, t1):
        var row0, col0 = tile_origin(t, tiles_n)
        var slot0, phase0 = slot_phase(it)
        var first = base.unsafe_offset(slot0 * WG_SLOT)
        _ = mbarrier_try_wait_parity_shared(full.unsafe_offset(slot0), phase0, Int32(WG_WAIT_TICKS))
        if fresh(t, t0, tiles_n):
            # The rows' shifts, from the first slot's first k slice (loaded again by the loop's first step).
            var a0 = ld_matrix[simd_width=8](first.unsafe_offset(swz(lm_row, lm_chunk)).unsafe_bitcast[Scalar[dtype]]())
            var sh = SIMD[F32, 2](row_shift_quad(a0, 0, 2 * tq, kk, inv_sample),
                                  row_shift_quad(a0, 1, 2 * tq, kk, inv_sample))
            shv = SIMD[F32, 8](sh[0], sh[0], sh[1], sh[1], sh[0], sh[0], sh[1], sh[1]).cast[dtype]()
            var s8 = SIMD[F32, 8](0.0)   # fragment-shaped sums of d and d^2 (rows g: 0, 1, 4, 5; g + 8: 2, 3, 6, 7)
            var q8 = SIMD[F32, 8](0.0)
            for s in range(steps - 1):
                var gs = gn
                gn = gamma_lane(gamma, s + 1, lane, kk)
                var slot, phase = slot_phase(it)
                _ = mbarrier_try_wait_parity_shared(full.unsafe_offset(slot), phase, Int32(WG_WAIT_TICKS))
                k_step[dtype, True](acc, s8, q8, base.unsafe_offset(slot * WG_SLOT), lm_row, lm_chunk, shv, gs, s, tq, kk)
                step_done(empty, slot, lane)
                it += 1
            # The last slot: its MMAs, the statistics while they run, then the fold's MMA. Peeled out of
            # the loop, as is the other path's first step: a fold MMA issued before the loop and committed
            # with the loop's first step made ptxas serialize every wgmma (C7515: register moves of the
            # accumulators inside an MMA group, where the loop's values join).
            var gs = gn
            gn = gamma_lane(gamma, 0, lane, kk)
            var slot, phase = slot_phase(it)
            _ = mbarrier_try_wait_parity_shared(full.unsafe_offset(slot), phase, Int32(WG_WAIT_TICKS))
            var a_s = base.unsafe_offset(slot * WG_SLOT)
            k_step[dtype, True](acc, s8, q8, a_s, lm_row, lm_chunk, shv, gs, steps - 1, tq, kk)
            var m1 = SIMD[F32, 2](0.0)
            var sigma = SIMD[F32, 2](0.0)
            comptime for h in range(2):
                var s1 = lanes_sum[4](s8[2 * h] + s8[2 * h + 1] + s8[2 * h + 4] + s8[2 * h + 5])
                var s2 = lanes_sum[4](q8[2 * h] + q8[2 * h + 1] + q8[2 * h + 4] + q8[2 * h + 5])
                var st = row_stats(s1, s2, inv_k, eps)
                m1[h] = st[0]
                rstd[h] = st[1]
                sigma[h] = st[2]
                var r = row0 + wrow + g + 8 * h
                if col0 == 0 and tq == 0 and r < mm:
                    # mean - shift is m1 = s1 / k itself: no rounding through a large mean
                    mean_out[unsafe_offset=r] = sh[h] + m1[h]
                    rstd_out[unsafe_offset=r] = rstd[h]
            ef = ext_frag[dtype](m1, sigma, tq)
            fold_mma[dtype](acc, ef, a_s)
            step_done(empty, slot, lane)
            it += 1
        else:
            # The statistics are the previous tile's: the fold's MMA first, with the first slot's.
            var s8 = SIMD[F32, 8](0.0)
            var q8 = SIMD[F32, 8](0.0)
            var gs = gn
            gn = gamma_lane(gamma, 1 if steps > 1 else 0, lane, kk)
            fold_mma[dtype](acc, ef, first)
            k_step[dtype, False](acc, s8, q8, first, lm_row, lm_chunk, shv, gs, 0, tq, kk)
            step_done(empty, slot0, lane)
            it += 1
            for s in range(1, steps):
                var gs = gn
                gn = gamma_lane(gamma, s + 1 if s + 1 < steps else 0, lane, kk)
                var slot, phase = slot_phase(it)
                _ = mbarrier_try_wait_parity_shared(full.unsafe_offset(slot), phase, Int32(WG_WAIT_TICKS))
                k_step[dtype, False](acc, s8, q8, base.unsafe_offset(slot * WG_SLOT), lm_row, lm_chunk, shv, gs, s, tq, kk)
                step_done(empty, slot, lane)
                it += 1
        epilogue[dtype](acc, rstd, stage, y_map, row0, col0, wrow, cw, lt, g, tq, nn)
        acc = SIMD[F32, 128](0.0)
    if lt == 0:
        cp_async_bulk_wait_group[0]()   # the last stores have read the staging buffer before the block ends


@always_inline
def epilogue[dtype: DType](
    acc: SIMD[F32, 128], rstd: SIMD[F32, 2], stage: SPtr[UInt8], y_map: Pointer[NoneType, _],
    row0: Int, col0: Int, wrow: Int, cw: Int, lt: Int, g: Int, tq: Int, nn: Int,
):
    """y = rstd * acc (the fold's MMA added -m1 G + sigma B) into the staging buffer, then TMA stores."""
    # The thread's rows lr, lr + 8 of the consumer's 64 (lr % 8 == g): swz(lr + 8 h, c) + 4 tq is
    # (sb ^ 16 c) + 1024 h, as a row's 128 bytes leave bits 4-6 to the chunk.
    var lr = wrow - cw * WG_ROWS + g
    var sb = opaque(lr * 128 + g * 16 + 4 * tq)
    comptime BOXES = WG_OUT_COLS // WG_BOX
    comptime for part in range(WG_TILE_COLS // WG_OUT_COLS):
        if lt == 0:
            cp_async_bulk_wait_group[0, True]()   # the previous stores have read the buffer
        named_barrier[WG_GROUP](Int32(1 + cw))
        comptime for jj in range(WG_OUT_COLS // 8):
            comptime j = part * (WG_OUT_COLS // 8) + jj
            comptime for h in range(2):
                var v = rstd[h] * acc.slice[2, offset=4 * j + 2 * h]()
                var off = (sb ^ ((jj % 8) * 16)) + (jj // 8) * (WG_ROWS * 128) + h * 1024
                stage.unsafe_offset(off).unsafe_bitcast[Scalar[dtype]]().unsafe_store[alignment=4](0, v.cast[dtype]())
        fence_async_view_proxy()   # the generic-proxy writes, visible to the TMA engine
        named_barrier[WG_GROUP](Int32(1 + cw))
        if lt == 0:
            comptime for b in range(BOXES):
                var cb = col0 + part * WG_OUT_COLS + b * WG_BOX
                if cb < nn:
                    cp_async_bulk_tensor_global_shared_cta(stage.unsafe_offset(b * WG_ROWS * 128), y_map,
                                                           Index(cb, row0 + cw * WG_ROWS))
            cp_async_bulk_commit_group()


comptime PREP_WARPS = 8   # prep kernel: one warp per column j, 8 per block
comptime PREP_UNROLL = 4  # vectors of w a lane loads before using them (fold_row)


def layernorm_linear_wgmma_prep[dtype: DType, VEC: Int](
    ext: Ptr[dtype], w: Ptr[dtype], gamma: Ptr[dtype], beta: Ptr[dtype], bias: Ptr[dtype], k: Int32, n: Int32,
):
    """Warp j: ext[j, :] = the fold MMA's rows of G[j] (exact products w * gamma) and B[j] + bias[j]."""
    # Launched (C++ entry) as the programmatic dependent of the stream's previous kernel, which may write the
    # weights: wait for it first. Then the wgmma kernel may be scheduled (it reads x, which that kernel may
    # have written, and waits for ext before reading it).
    wait_on_dependent_grids()
    launch_dependent_grids()
    var lane = Int(thread_idx.x) % WARP_SIZE
    var j = Int(block_idx.x) * PREP_WARPS + Int(thread_idx.x) // WARP_SIZE
    if j >= Int(n):
        return
    var gb = fold_row[dtype, VEC, False, PREP_UNROLL](w, gamma, beta, j, Int(k), lane, WARP_SIZE)
    var g = warp.sum(gb[0])
    var b = warp.sum(gb[1]) + load_f32(bias, j)
    if lane < WG_EXT_COLS:
        # per column: G hi, G hi, G mid, B hi, B hi, B mid, G hi, B hi (hi = round(v), mid = round(v - hi))
        var v = g if lane < 3 or lane == 6 else b
        var hi = v.cast[dtype]()
        ext[unsafe_offset=j * WG_EXT_COLS + lane] = (v - hi.cast[F32]()).cast[dtype]() if lane == 2 or lane == 5 else hi


def launch_wgmma[dtype: DType](
    ctx: DeviceContext, y: Ptr[dtype], mean: Ptr[F32], rstd: Ptr[F32], x: Ptr[dtype], ext: Ptr[dtype],
    w: Ptr[dtype], gamma: Ptr[dtype], beta: Ptr[dtype], bias: Ptr[dtype], rows: Int, k: Int, n: Int, eps: Float32,
) raises:
    """Enqueue layernorm_linear_wgmma_prep (ext from w, gamma, beta, bias), then layernorm_linear_fwd_wgmma (the
    caller checked k % 8 == 0, n % 8 == 0 and 16-byte alignment)."""
    comptime VEC = vector_width[dtype]()
    var blocks = ceildiv(n, PREP_WARPS)
    if fold_vector_width[dtype](k, Int(w), Int(gamma), Int(beta)) == VEC:
        comptime prep = layernorm_linear_wgmma_prep[dtype, VEC]
        ctx.enqueue_function[prep](ext, w, gamma, beta, bias, Int32(k), Int32(n), grid_dim=blocks,
                                   block_dim=PREP_WARPS * WARP_SIZE)
    else:
        comptime prep = layernorm_linear_wgmma_prep[dtype, 1]
        ctx.enqueue_function[prep](ext, w, gamma, beta, bias, Int32(k), Int32(n), grid_dim=blocks,
                                   block_dim=PREP_WARPS * WARP_SIZE)
    comptime SW = TensorMapSwizzle.SWIZZLE_128B
    var x_map = create_tma_descriptor[dtype, 2, SW](DeviceBuffer[dtype](ctx, x, rows * k, owning=False),
                                                    Index(rows, k), Index(k, 1), Index(WG_TILE_ROWS, WG_SLOT_K))
    var w_map = create_tma_descriptor[dtype, 2, SW](DeviceBuffer[dtype](ctx, w, n * k, owning=False),
                                                    Index(n, k), Index(k, 1), Index(WG_TILE_COLS, WG_SLOT_K))
    var y_map = create_tma_descriptor[dtype, 2, SW](DeviceBuffer[dtype](ctx, y, rows * n, owning=False),
                                                    Index(rows, n), Index(n, 1), Index(WG_ROWS, WG_BOX))
    var e_map = create_tma_descriptor[dtype, 2, TensorMapSwizzle.SWIZZLE_NONE](
        DeviceBuffer[dtype](ctx, ext, n * WG_EXT_COLS, owning=False), Index(n // 8, 8 * WG_EXT_COLS),
        Index(8 * WG_EXT_COLS, 1), Index(WG_TILE_COLS // 8, 8 * WG_EXT_COLS))
    var items = ceildiv(rows, WG_TILE_ROWS) * ceildiv(n, WG_TILE_COLS)
    # ceil(items / SMs) tiles per block (tile_range), so the grid can be a few blocks short of the SMs
    var per = ceildiv(items, ctx.get_attribute(DeviceAttribute.MULTIPROCESSOR_COUNT))
    comptime kernel = layernorm_linear_fwd_wgmma[dtype]
    ctx.enqueue_function[kernel](x_map, w_map, y_map, e_map, mean, rstd, gamma, Int32(rows), Int32(k), Int32(n), eps,
                                 grid_dim=ceildiv(items, per), block_dim=WG_THREADS, shared_mem_bytes=WG_SMEM_BYTES,
                                 func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(UInt32(WG_SMEM_BYTES)))


@extensibility.register("layernorm_linear_fwd_sm90")
struct LayerNormLinearFwdSm90:
    @staticmethod
    def execute[target: StaticString, dtype: DType, eps_bits: Int](
        y: _MutableInputTensor[dtype=dtype, rank=2, static_spec=_],
        mean: _MutableInputTensor[dtype=F32, rank=1, static_spec=_],
        rstd: _MutableInputTensor[dtype=F32, rank=1, static_spec=_],
        ext: _MutableInputTensor[dtype=dtype, rank=2, static_spec=_],
        x: InputTensor[dtype=dtype, rank=2, static_spec=_],
        w: InputTensor[dtype=dtype, rank=2, static_spec=_],
        gamma: InputTensor[dtype=dtype, rank=1, static_spec=_],
        beta: InputTensor[dtype=dtype, rank=1, static_spec=_],
        bias: InputTensor[dtype=dtype, rank=1, static_spec=_],
        ctx: DeviceContext,
    ) raises:
        """y [rows, n], mean, rstd [rows] from x [rows, k], w [n, k], gamma, beta [k] and bias [n] (bf16).
        Scratch, made at every call: the fold (G, B + bias) as the fold MMA's ext rows [n, 8] (per column
        G hi, G hi, G mid, B hi, B hi, B mid, G hi, B hi; fold_ext in ops/layernorm_linear/). GPU (sm_90) only."""
        comptime eps = bitcast[F32](UInt32(eps_bits))
        comptime if target != "gpu" or dtype != DType.bfloat16:
            raise Error("layernorm_linear_fwd_sm90: bfloat16 on an sm_90 GPU only")
        else:
            launch_wgmma[dtype](ctx, y.unsafe_ptr(), mean.unsafe_ptr(), rstd.unsafe_ptr(), x.unsafe_ptr(),
                                ext.unsafe_ptr(), w.unsafe_ptr(), gamma.unsafe_ptr(),
                                beta.unsafe_ptr(), bias.unsafe_ptr(), x.dim_size(0), x.dim_size(1), w.dim_size(0), eps)
