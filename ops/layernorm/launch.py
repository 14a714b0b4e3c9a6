"""LayerNorm's launches: the MAX graph ops of ``ops/kernels/layernorm.mojo`` and the direct launches, with their plans.

A plan (the loaded kernel, its grid, block and cluster) depends on shapes and dtypes only; it is made once per shape
here and handed to the C++ entries (``ops.launch.plans.remember``), which then launch that shape without Python."""

from __future__ import annotations

import math
import struct
from functools import cache, lru_cache

import torch

from ops.common import empty
from ops.launch import bridge, direct, plans
from ops.launch.bridge import LIBRARY, GraphOp, Out
from ops.launch.plans import PlanTable
from ops.layernorm import config
from ops.layernorm.config import ACTIVATIONS, F32, Launch

_ROWS_H = ("rows", "h")


# The CPU kernels take no launch choice; their ops compile once with these parameters.
CPU_LAUNCH = Launch("ln_fwd_row_thread", (), (1, 1, 1), 1)


CPU_BWD_LAUNCH = Launch("ln_bwd_loop", (1, 1), (1, 1, 1), 1)


def eps_bits(eps: float) -> int:
    """float32 bit pattern of eps (MAX op parameters are ints); past float32's range, +-inf, as a cast gives."""
    if abs(eps) > _F32_MAX:
        eps = math.copysign(math.inf, eps)
    return struct.unpack("<I", struct.pack("<f", eps))[0]


_F32_MAX = torch.finfo(torch.float32).max


def _op_parameters(launch: Launch) -> tuple[tuple[str, int], ...]:
    """A launch as the registered op's parameters: kernel (its code, ``config.KERNEL_CODES``) and CH, WPR, RPB, CL,
    UNROLL (0: unused)."""
    p = dict.fromkeys(("CH", "WPR", "RPB", "CL", "UNROLL"), 0)
    if launch.kernel == "ln_fwd_loop":
        p["WPR"], p["RPB"], p["UNROLL"] = launch.params
    elif launch.kernel.endswith("_loop"):
        p["WPR"], p["RPB"] = launch.params
    elif launch.kernel.endswith("_regs"):
        _, p["CH"], p["WPR"], p["RPB"] = launch.params
    elif launch.kernel.endswith("_cluster"):
        _, p["CH"], p["WPR"], p["CL"] = launch.params
    return (("kernel", config.KERNEL_CODES[launch.kernel]), *p.items())


def fwd_op(activation: str, eps: float, launch: Launch = CPU_LAUNCH) -> GraphOp:
    """The registered forward for one activation and launch choice: outputs y [rows, h], mean [rows], rstd [rows]."""
    return code_fwd_op(ACTIVATIONS[activation], eps, launch)


@lru_cache(maxsize=1024)   # by eps and launch: a few eps per model, a launch per row-length bracket
def code_fwd_op(act: int, eps: float, launch: Launch = CPU_LAUNCH) -> GraphOp:
    """``fwd_op`` by the kernels' ``act`` code (an activation, or an RMSNorm's bits: ops/rmsnorm/config.py)."""
    return GraphOp(
        "layernorm_fwd", LIBRARY,
        inputs=(_ROWS_H, ("h",), ("h",)),
        outputs=(Out(_ROWS_H), Out(("rows",), F32), Out(("rows",), F32)),
        parameters=(("act", act), ("eps_bits", eps_bits(eps)), *_op_parameters(launch)),
        weights=frozenset({1, 2}),
    )


def bwd_op(activation: str, launch: Launch = CPU_BWD_LAUNCH) -> GraphOp:
    """The registered backward: outputs dx [rows, h], dgamma, dbeta [h], two partials [parts, h]."""
    return code_bwd_op(ACTIVATIONS[activation], launch)


@cache
def code_bwd_op(act: int, launch: Launch = CPU_BWD_LAUNCH) -> GraphOp:
    """``bwd_op`` by the kernels' ``act`` code (as ``code_fwd_op``)."""
    return GraphOp(
        "layernorm_bwd", LIBRARY,
        inputs=(_ROWS_H, _ROWS_H, ("h",), ("h",), ("rows",), ("rows",)),
        outputs=(Out(_ROWS_H), Out(("h",), 2), Out(("h",), 2),
                 Out(("parts", "h"), F32), Out(("parts", "h"), F32)),
        parameters=(("act", act), *_op_parameters(launch)[:4]),
        weights=frozenset({2, 3}),
    )


@cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@cache
def has_clusters(index: int) -> bool:
    """Whether CUDA device ``index`` has thread block clusters (sm_90 and newer)."""
    return torch.cuda.get_device_capability(index) >= (9, 0)


def bwd_parts(rows: int, h: int, dtype: torch.dtype, device: torch.device) -> int:
    """Row groups of the backward (``layernorm_config.bwd_parts`` on this device's SM count)."""
    return config.bwd_parts(rows, h, dtype, device, sm_count(device) if device.type == "cuda" else 1)


def vectors_fit(h: int, dtype: torch.dtype, *tensors: torch.Tensor) -> bool:
    """Rows of h split into whole 16-byte vectors and every tensor is 16-byte aligned (the vector kernels' loads)."""
    if h % config.VECTOR_WIDTH[dtype]:
        return False
    address = 0
    for t in tensors:
        address |= t.data_ptr()
    return not address % config.VECTOR_BYTES


def fwd_launch(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, variant: str, act: int = 0) -> Launch:
    """The forward launch for validated CUDA x2 [rows, h] (``layernorm_config.fwd_launch``)."""
    rows, h = x2.shape
    vec_ok = vectors_fit(h, x2.dtype, x2, weight, bias)
    return config.fwd_launch(rows, h, x2.dtype, vec_ok, variant, has_clusters(x2.get_device()), sm_count(x2.device),
                             act)


# What a direct call needs beyond its tensors, per (rows, h, dtype, vec_ok, variant, act, device index):
# the loaded kernel and its grid, block and cluster size. Depends on shapes and dtypes only.
_fwd_plans = PlanTable()


# The backward's, per (parts, h, dtype, vec_ok, act, device index, forced config): parts and the forced config
# are worked out at every call, so a forced backward (``config.forced_backward``) takes effect at once.
_bwd_plans = PlanTable()



def _fwd_plan(rows: int, h: int, dtype: torch.dtype, vec_ok: bool, variant: str, act: int,
              index: int) -> tuple[direct.Kernel, tuple[int, int, int], int, int]:
    launch = config.fwd_launch(rows, h, dtype, vec_ok, variant, has_clusters(index),
                               sm_count(torch.device("cuda", index)), act)
    plan = (direct.kernel(launch.spec(dtype, act), index), launch.grid, launch.block, launch.cluster)
    direct.load_native()
    return _fwd_plans.keep((rows, h, dtype, vec_ok, variant, act, index), plan)


def fwd_direct(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, variant: str, act: int,
                mean: int = 0, rstd: int = 0) -> torch.Tensor:
    """y like x from the forward on validated contiguous CUDA x [..., h]; the rows' statistics go to the float32
    buffers at addresses ``mean`` and ``rstd`` ([rows] each), or nowhere when ``mean`` is 0 (inference)."""
    h = x.shape[-1]
    rows = x.numel() // h if h else 0
    index = x.get_device()
    dtype = x.dtype
    vec_ok = vectors_fit(h, dtype, x, weight, bias)
    plan = _fwd_plans.get((rows, h, dtype, vec_ok, variant, act, index))
    if plan is None:
        plan = _fwd_plan(rows, h, dtype, vec_ok, variant, act, index)
    kernel, grid, block, cluster = plan
    if variant == "fast":   # the C++ entries take the default variant
        plans.remember(("ln_fwd", rows, h, dtype, vec_ok, act, index), lambda native: native.set_fwd_plan(
            rows, h, dtype, vec_ok, act, index, int(kernel.function), grid, block, cluster))
        native_transpose(dtype, index)
    y = torch.empty_like(x)
    if bridge.poison_outputs:
        y.fill_(float("nan"))
    if rows:
        args = (y.data_ptr(), mean, rstd, x.data_ptr(), weight.data_ptr(), bias.data_ptr(), rows, h, eps)
        with direct.on_device(index) as stream:
            if cluster > 1:
                kernel.launch_cluster(stream, grid[0], cluster, block, *args)
            else:
                kernel.launch(stream, grid, block, 0, *args)
    return y


def stats_buffer(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """A float32 [2, rows] buffer for the rows' mean and rstd (one allocation), and their two addresses."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    stats = empty((2, rows), F32, x.device)
    return stats, *stat_addresses(stats)


def stat_views(stats: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean and rstd of x's rows in a ``stats_buffer`` buffer, as tensors shaped like x's rows."""
    return stats[0].view(x.shape[:-1]), stats[1].view(x.shape[:-1])


def stat_addresses(stats: torch.Tensor) -> tuple[int, int]:
    """The addresses of the mean and rstd rows of a ``stats_buffer`` buffer."""
    return stats.data_ptr(), stats.data_ptr() + 4 * stats.shape[1]


def _bwd_plan(parts: int, h: int, dtype: torch.dtype, vec_ok: bool, act: int, index: int,
              forced: int | None) -> tuple[direct.Kernel, tuple[int, int, int], int, direct.Kernel, tuple[int, int]]:
    """The row-group kernel, its grid and block, the column sums' kernel, and (row groups, partial rows) for
    ``parts`` row groups; ``forced``: the register configuration a benchmark's sweep forces (``bwd_config``)."""
    launch = config.bwd_launch(parts, h, dtype, vec_ok, forced, sm_count(torch.device("cuda", index)))
    plan = (direct.kernel(launch.spec(dtype, act), index), launch.grid, launch.block,
            direct.kernel(config.reduce_spec(dtype, h, act), index), config.bwd_sizes(launch, parts))
    return _bwd_plans.keep((parts, h, dtype, vec_ok, act, index, forced), plan)


def _native_bwd_plan(rows: int, h: int, dtype: torch.dtype, vec_ok: bool, act: int, index: int,
                     plan: tuple[direct.Kernel, tuple[int, int, int], int, direct.Kernel, tuple[int, int]]) -> None:
    """Hand a backward plan to the C++ entries (keyed by rows: they do not work out the row groups), unless
    a sweep forces the launch (``config.forced_backward``: those calls stay on this route)."""
    if config.FORCED_BWD_PARTS is not None or config.FORCED_BWD_CONFIG is not None:
        return
    rows_kernel, grid, block, reduce, (groups, part_rows) = plan
    plans.remember(("ln_bwd", rows, h, dtype, vec_ok, act, index), lambda native: native.set_bwd_plan(
        rows, h, dtype, vec_ok, act, index, int(rows_kernel.function), grid, block, groups, part_rows,
        int(reduce.function), config.reduce_grid(h), config.reduce_block(h)))


def native_transpose(dtype: torch.dtype, index: int) -> None:
    """Hand the C++ entries the transposing copy of ``dtype`` on device ``index``: their ``dense`` takes an x
    whose last two dims are column-major (a transposed view) through it, without a gradient to come."""
    plans.remember(("transpose", dtype, index), lambda native: native.set_transpose_kernel(
        dtype, index, int(direct.kernel(config.transpose_spec(dtype), index).function), config.TRANSPOSE_TILE,
        config.TRANSPOSE_THREADS))


def bwd_direct(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mean: int, rstd: int,
                act: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The backward on validated contiguous CUDA tensors, the statistics at addresses ``mean`` and ``rstd``:
    dx like x, dweight and dbias like weight (an RMSNorm's ``act``: None, it has no beta)."""
    h = x.shape[-1]
    rows = x.numel() // h if h else 0
    index = x.get_device()
    vec_ok = vectors_fit(h, x.dtype, dy, x, weight, bias)
    parts, forced = bwd_parts(rows, h, x.dtype, x.device), config.bwd_config()
    plan = _bwd_plans.get((parts, h, x.dtype, vec_ok, act, index, forced))
    if plan is None:
        plan = _bwd_plan(parts, h, x.dtype, vec_ok, act, index, forced)
    _native_bwd_plan(rows, h, x.dtype, vec_ok, act, index, plan)
    rows_kernel, grid, block, reduce, (groups, part_rows) = plan
    rms = bool(act & config.K["NORM_RMS"])   # no beta: no dbias, nor its partials (the kernels leave part_b)
    dx, dweight = empty(x.shape, x.dtype, x.device), empty(weight.shape, weight.dtype, x.device)
    dbias = None if rms else empty(weight.shape, weight.dtype, x.device)
    part = empty((1 if rms else 2, part_rows, h), F32, x.device)
    part_g = part.data_ptr()
    part_b = part_g if rms else part_g + 4 * part_rows * h
    with direct.on_device(index) as stream:
        rows_kernel.launch(stream, grid, block, 0, dx.data_ptr(), part_g, part_b, dy.data_ptr(), x.data_ptr(),
                           weight.data_ptr(), bias.data_ptr(), mean, rstd, rows, h, groups)
        reduce.launch(stream, config.reduce_grid(h), config.reduce_block(h), 0, dweight.data_ptr(),
                      (dweight if rms else dbias).data_ptr(), part_g, part_b, part_rows, h)
    return dx, dweight, dbias


# The one-pass add and norm's, per (rows, h, dtype, act, add_bias given, device index): its kernel, grid and block,
# or None where LayerNorm's launch for the shape is not the register kernel's (the add then runs before the norm).
_add_norm_plans = PlanTable()


def add_norm_plan(rows: int, h: int, dtype: torch.dtype, act: int, bias: bool,
                  index: int) -> tuple[direct.Kernel, tuple[int, int, int], int] | None:
    """The one-pass add and norm's launch for rows of h on device ``index`` (16-byte vectors), or None where the
    shape's norm launch is not the register kernel (``config.add_norm_spec``); made once, and handed to the C++
    entry (``add_norm`` in ops/launch/native/add_norm.h)."""
    key = (rows, h, dtype, act, bias, index)
    if key in _add_norm_plans:
        plan = _add_norm_plans[key]
    else:
        launch = config.fwd_launch(rows, h, dtype, True, "fast", has_clusters(index),
                                   sm_count(torch.device("cuda", index)), act)
        spec = config.add_norm_spec(launch, dtype, act, bias)
        plan = None if spec is None else (direct.kernel(spec, index), launch.grid, launch.block)
        _add_norm_plans.keep(key, plan)
        direct.load_native()
    if plan is not None:   # at every call: the C++ tables may have been cleared since (plans.forget_plans)
        kernel, grid, block = plan
        plans.remember(("add_norm", *key), lambda native: native.set_add_norm_plan(
            rows, h, dtype, act, bias, index, int(kernel.function), grid, block))
    return plan


def add_norm_direct(plan: tuple[direct.Kernel, tuple[int, int, int], int], x: torch.Tensor, residual: torch.Tensor,
                    add_bias: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float, mean: int,
                    rstd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, s) by ``plan``'s one launch (``add_norm_plan``): s = x (+ add_bias) + residual, y = norm(s), on contiguous
    CUDA tensors of one dtype, 16-byte aligned; the rows' statistics into the float32 [rows] buffers at ``mean`` and
    ``rstd``."""
    h = x.shape[-1]
    kernel, grid, block = plan
    y, s = empty(x.shape, x.dtype, x.device), empty(x.shape, x.dtype, x.device)
    with direct.on_device(x.get_device()) as stream:
        kernel.launch(stream, grid, block, 0, y.data_ptr(), s.data_ptr(), mean, rstd, x.data_ptr(),
                      residual.data_ptr(), x.data_ptr() if add_bias is None else add_bias.data_ptr(),
                      weight.data_ptr(), bias.data_ptr(), x.numel() // h, h, eps)
    return y, s
