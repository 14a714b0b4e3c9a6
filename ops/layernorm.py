"""LayerNorm (optionally followed by GELU) over the trailing dims, forward and backward, on our Mojo kernels.

Shapes: x [..., H]; weight (gamma) and bias (beta) [H] in x's dtype (float32, float16 or bfloat16), or float32
for 16-bit x; mean and rstd [...] float32. Kernels: ``ops/kernels/layernorm.mojo`` (registered
``layernorm_fwd`` and ``layernorm_bwd``); launch choices and tuning: ``ops/layernorm_config.py``.
Layers of API, lowest first:

* ``layernorm_fwd`` / ``layernorm_bwd``: validated calls of the two ops, no autograd;
* ``torch.ops.mojo.layernorm_fwd`` / ``layernorm_bwd``: the same as ``torch.library`` custom ops with fake
  implementations (torch.compile);
* ``layernorm`` (``LayerNormFunction``, and the C++ entry on CUDA): autograd over the last dim;
* ``layer_norm``: ``F.layer_norm``'s signature (any ``normalized_shape``, optional weight and bias);
* ``LayerNorm``: an ``nn.Module`` that loads an ``nn.LayerNorm`` state dict.
"""

from __future__ import annotations

import math
import numbers
import operator
import os
import struct
from collections.abc import Callable, Sequence
from functools import cache
from typing import NoReturn

import torch
from torch import nn
from torch.autograd import forward_ad

from ops import layernorm_config as config
from ops.launch import bridge, direct
from ops.launch.bridge import LIBRARY, GraphOp, Out
from ops.layernorm_config import DTYPES, VARIANTS, Launch
from ops.validate import (
    beyond_int32,
    check_cuda_rows,
    check_grad,
    check_int32_rows,
    check_param,
    check_same,
    check_tensor,
)

__all__ = ["VARIANTS", "LayerNorm", "layer_norm", "layernorm", "layernorm_bwd", "layernorm_fwd"]

# "gelu" is the erf form (torch's default), "gelu_tanh" the tanh approximation.
ACTIVATIONS = {"none": 0, "gelu_tanh": 1, "gelu": 2}
F32 = torch.float32

_ROWS_H = ("rows", "h")
# The CPU kernels take no launch choice; their ops compile once with these parameters.
_CPU_LAUNCH = Launch("ln_fwd_row_thread", (), (1, 1, 1), 1)
_CPU_BWD_LAUNCH = Launch("ln_bwd_loop", (1, 1), (1, 1, 1), 1)


def eps_bits(eps: float) -> int:
    """float32 bit pattern of eps (MAX op parameters are ints); past float32's range, +-inf, as a cast gives."""
    if abs(eps) > _F32_MAX:
        eps = math.copysign(math.inf, eps)
    return struct.unpack("<I", struct.pack("<f", eps))[0]


_F32_MAX = torch.finfo(torch.float32).max


def _op_parameters(launch: Launch, kernels: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    """A launch as the registered op's parameters: kernel (its index) and CH, WPR, RPB, CL, UNROLL (0: unused)."""
    p = dict.fromkeys(("CH", "WPR", "RPB", "CL", "UNROLL"), 0)
    if launch.kernel == "ln_fwd_loop":
        p["WPR"], p["RPB"], p["UNROLL"] = launch.params
    elif launch.kernel.endswith("_loop"):
        p["WPR"], p["RPB"] = launch.params
    elif launch.kernel.endswith("_regs"):
        _, p["CH"], p["WPR"], p["RPB"] = launch.params
    elif launch.kernel.endswith("_cluster"):
        _, p["CH"], p["WPR"], p["CL"] = launch.params
    return (("kernel", kernels.index(launch.kernel)), *p.items())


@cache
def fwd_op(activation: str, eps: float, launch: Launch = _CPU_LAUNCH) -> GraphOp:
    """The registered forward for one launch choice: outputs y [rows, h], mean [rows], rstd [rows]."""
    return GraphOp(
        "layernorm_fwd", LIBRARY,
        inputs=(_ROWS_H, ("h",), ("h",)),
        outputs=(Out(_ROWS_H), Out(("rows",), F32), Out(("rows",), F32)),
        parameters=(("act", ACTIVATIONS[activation]), ("eps_bits", eps_bits(eps)),
                    *_op_parameters(launch, config.FWD_KERNELS)),
        weights=frozenset({1, 2}),
    )


@cache
def bwd_op(activation: str, launch: Launch = _CPU_BWD_LAUNCH) -> GraphOp:
    """The registered backward: outputs dx [rows, h], dgamma, dbeta [h], two partials [parts, h]."""
    return GraphOp(
        "layernorm_bwd", LIBRARY,
        inputs=(_ROWS_H, _ROWS_H, ("h",), ("h",), ("rows",), ("rows",)),
        outputs=(Out(_ROWS_H), Out(("h",), 2), Out(("h",), 2),
                 Out(("parts", "h"), F32), Out(("parts", "h"), F32)),
        parameters=(("act", ACTIVATIONS[activation]),
                    *_op_parameters(launch, config.BWD_KERNELS)[:4]),
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


def _vec_ok(h: int, dtype: torch.dtype, *tensors: torch.Tensor) -> bool:
    """Rows of h split into whole 16-byte vectors and every tensor is 16-byte aligned (the vector kernels' loads)."""
    if h % config.VECTOR_WIDTH[dtype]:
        return False
    address = 0
    for t in tensors:
        address |= t.data_ptr()
    return not address % config.VECTOR_BYTES


def no_grad_to_come(*tensors: object) -> bool:
    """Whether no gradient will be taken through a call on ``tensors`` (grad mode off, or none requires one)."""
    return not (torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors))


def _empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer: uninitialised, or NaN in poison mode (tests: an unwritten element never passes)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    return t.fill_(float("nan")) if bridge.poison_outputs else t


def fwd_launch(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, variant: str) -> Launch:
    """The forward launch for validated CUDA x2 [rows, h] (``layernorm_config.fwd_launch``)."""
    rows, h = x2.shape
    vec_ok = _vec_ok(h, x2.dtype, x2, weight, bias)
    return config.fwd_launch(rows, h, x2.dtype, vec_ok, variant, has_clusters(x2.get_device()), sm_count(x2.device))


# What a direct call needs beyond its tensors, per (rows, h, dtype, vec_ok, variant, act, device index):
# the loaded kernel and its grid, block and cluster size. Depends on shapes and dtypes only.
_fwd_plans: dict[tuple, tuple[direct.Kernel, tuple[int, int, int], int, int]] = {}
# The backward's, per (parts, h, dtype, vec_ok, act, device index, forced config): parts and the forced config
# are worked out at every call, so OPS_LN_BWD_PARTS and OPS_LN_BWD_CONFIG take effect at once.
_bwd_plans: dict[tuple, tuple[direct.Kernel, tuple[int, int, int], int, direct.Kernel, tuple[int, int]]] = {}
_PLANS_MAX = direct.PLANS_MAX


def _fwd_plan(rows: int, h: int, dtype: torch.dtype, vec_ok: bool, variant: str, act: int,
              index: int) -> tuple[direct.Kernel, tuple[int, int, int], int, int]:
    launch = config.fwd_launch(rows, h, dtype, vec_ok, variant, has_clusters(index),
                               sm_count(torch.device("cuda", index)))
    if len(_fwd_plans) >= _PLANS_MAX:
        _fwd_plans.clear()
    plan = (direct.kernel(launch.spec(dtype, act), index), launch.grid, launch.block, launch.cluster)
    _fwd_plans[(rows, h, dtype, vec_ok, variant, act, index)] = plan
    direct.load_native()
    return plan


def _fwd_direct(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, variant: str, act: int,
                mean: int = 0, rstd: int = 0) -> torch.Tensor:
    """y like x from the forward on validated contiguous CUDA x [..., h]; the rows' statistics go to the float32
    buffers at addresses ``mean`` and ``rstd`` ([rows] each), or nowhere when ``mean`` is 0 (inference)."""
    h = x.shape[-1]
    rows = x.numel() // h if h else 0
    index = x.get_device()
    dtype = x.dtype
    vec_ok = _vec_ok(h, dtype, x, weight, bias)
    plan = _fwd_plans.get((rows, h, dtype, vec_ok, variant, act, index))
    if plan is None:
        plan = _fwd_plan(rows, h, dtype, vec_ok, variant, act, index)
    kernel, grid, block, cluster = plan
    if variant == "fast":   # the C++ entries take the default variant
        direct.remember(("ln_fwd", rows, h, dtype, vec_ok, act, index), lambda native: native.set_fwd_plan(
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


def _stats(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """A float32 [2, rows] buffer for the rows' mean and rstd (one allocation), and their two addresses."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    stats = _empty((2, rows), F32, x.device)
    return stats, *stat_addresses(stats)


def stat_views(stats: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean and rstd of x's rows in a ``_stats`` buffer, as tensors shaped like x's rows."""
    return stats[0].view(x.shape[:-1]), stats[1].view(x.shape[:-1])


def stat_addresses(stats: torch.Tensor) -> tuple[int, int]:
    """The addresses of the mean and rstd rows of a ``_stats`` buffer."""
    return stats.data_ptr(), stats.data_ptr() + 4 * stats.shape[1]


def _bwd_plan(parts: int, h: int, dtype: torch.dtype, vec_ok: bool, act: int, index: int,
              forced: int | None) -> tuple[direct.Kernel, tuple[int, int, int], int, direct.Kernel, tuple[int, int]]:
    """The row-group kernel, its grid and block, the column sums' kernel, and (row groups, partial rows) for
    ``parts`` row groups; ``forced``: the register configuration a benchmark's sweep forces (``bwd_config``)."""
    launch = config.bwd_launch(parts, h, dtype, vec_ok, forced, sm_count(torch.device("cuda", index)))
    if len(_bwd_plans) >= _PLANS_MAX:
        _bwd_plans.clear()
    plan = (direct.kernel(launch.spec(dtype, act), index), launch.grid, launch.block,
            direct.kernel(config.reduce_spec(dtype, h), index), config.bwd_sizes(launch, parts))
    _bwd_plans[(parts, h, dtype, vec_ok, act, index, forced)] = plan
    return plan


def _native_bwd_plan(rows: int, h: int, dtype: torch.dtype, vec_ok: bool, act: int, index: int,
                     plan: tuple[direct.Kernel, tuple[int, int, int], int, direct.Kernel, tuple[int, int]]) -> None:
    """Hand a backward plan to the C++ entries (keyed by rows: they do not work out the row groups), unless
    OPS_LN_BWD_PARTS or OPS_LN_BWD_CONFIG forces the launch (those calls stay on this route)."""
    if os.environ.get("OPS_LN_BWD_PARTS") or os.environ.get("OPS_LN_BWD_CONFIG"):
        return
    rows_kernel, grid, block, reduce, (groups, part_rows) = plan
    direct.remember(("ln_bwd", rows, h, dtype, vec_ok, act, index), lambda native: native.set_bwd_plan(
        rows, h, dtype, vec_ok, act, index, int(rows_kernel.function), grid, block, groups, part_rows,
        int(reduce.function), config.reduce_grid(h), config.reduce_block(h)))


def native_transpose(dtype: torch.dtype, index: int) -> None:
    """Hand the C++ entries the transposing copy of ``dtype`` on device ``index``: their ``dense`` takes an x
    whose last two dims are column-major (a transposed view) through it, without a gradient to come."""
    direct.remember(("transpose", dtype, index), lambda native: native.set_transpose_kernel(
        dtype, index, int(direct.kernel(config.transpose_spec(dtype), index).function)))


def _bwd_direct(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mean: int, rstd: int,
                act: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward on validated contiguous CUDA tensors, the statistics at addresses ``mean`` and ``rstd``:
    dx like x, dweight and dbias like weight."""
    h = x.shape[-1]
    rows = x.numel() // h if h else 0
    index = x.get_device()
    vec_ok = _vec_ok(h, x.dtype, dy, x, weight, bias)
    parts, forced = bwd_parts(rows, h, x.dtype, x.device), config.bwd_config()
    plan = _bwd_plans.get((parts, h, x.dtype, vec_ok, act, index, forced))
    if plan is None:
        plan = _bwd_plan(parts, h, x.dtype, vec_ok, act, index, forced)
    _native_bwd_plan(rows, h, x.dtype, vec_ok, act, index, plan)
    rows_kernel, grid, block, reduce, (groups, part_rows) = plan
    dx = _empty(x.shape, x.dtype, x.device)
    dweight, dbias = _empty(weight.shape, weight.dtype, x.device), _empty(weight.shape, weight.dtype, x.device)
    part = _empty((2, part_rows, h), F32, x.device)
    part_g, part_b = part.data_ptr(), part.data_ptr() + 4 * part_rows * h
    with direct.on_device(index) as stream:
        rows_kernel.launch(stream, grid, block, 0, dx.data_ptr(), part_g, part_b, dy.data_ptr(), x.data_ptr(),
                           weight.data_ptr(), bias.data_ptr(), mean, rstd, rows, h, groups)
        reduce.launch(stream, config.reduce_grid(h), config.reduce_block(h), 0, dweight.data_ptr(), dbias.data_ptr(),
                      part_g, part_b, part_rows, h)
    return dx, dweight, dbias


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: {activation!r} is not one of {list(ACTIVATIONS)}")


def validate(x: object, weight: object, bias: object, names: tuple[str, str, str] = ("x", "weight", "bias")) -> None:
    """Raise ValueError/TypeError naming the first bad argument (``names`` as the caller calls them). Strided or
    empty x and float32 weight and bias with 16-bit x pass: the entries adapt them (``adapt``, ``_empty_fwd``)."""
    if _valid(x, weight, bias):
        return
    nx, nw, nb = names
    check_tensor(nx, x, min_ndim=1, dtypes=DTYPES, layout=False)
    h = x.shape[-1]
    check_param(nw, weight, x, nx, h, f"{nx}'s last dim", DTYPES)
    check_param(nb, bias, x, nx, h, f"{nx}'s last dim", DTYPES)
    check_int32_rows(nx, x)


def adapt(x: torch.Tensor, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Validated x and its parameters as the kernels take them: contiguous (one copy of a strided tensor; with
    autograd, the copy's backward puts the gradient back in place) and the parameters in x's dtype (a float32
    parameter of 16-bit x is rounded to it; its gradient comes back in float32)."""
    return (x.contiguous(), *(p.to(x.dtype).contiguous() for p in params))


def _valid(x: object, weight: object, bias: object) -> bool:
    """The common case in few attribute reads: three non-empty contiguous tensors of one supported dtype on
    one cpu/cuda device, weight and bias [H] with H x's last dim. False sends ``validate`` to its named checks."""
    try:
        dtype, device = x.dtype, x.device
        return (dtype in DTYPES and weight.dtype is dtype and bias.dtype is dtype
                and weight.device == device and bias.device == device and device.type in ("cuda", "cpu")
                and weight.dim() == 1 and bias.dim() == 1 and x.dim() >= 1
                and x.shape[-1] == weight.shape[0] == bias.shape[0] and x.numel() > 0
                and x.is_contiguous() and weight.is_contiguous() and bias.is_contiguous()
                and isinstance(x, torch.Tensor) and not beyond_int32(x))
    except (AttributeError, TypeError, RuntimeError):   # RuntimeError: a sparse tensor's is_contiguous
        return False


# ---------------------------------------------------------------- what torch's ops answer

# check_tensor's dtypes and devices for a call torch's ops answer: float64 and the meta device too
TORCH_TAKES = {"dtypes": (*DTYPES, torch.float64), "devices": ("cpu", "cuda", "meta")}
_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)
# legacy vmap's batched tensors (autograd.grad's is_grads_batched); a torch without legacy vmap has none
_is_legacy_batched = getattr(torch._C._functorch, "is_legacy_batchedtensor", lambda t: False)


def native_entry(name: str) -> Callable | None:
    """The C++ entry ``name`` (``direct.NATIVE``) for an eager call to try first; None while torch.compile or
    torch.export traces (is_compiling first: dynamo must not read, and guard on, a builtin it cannot guard; the
    ops' fakes stand in) or ``torch.jit.trace`` records: a trace must record the same ops at every call, and the
    C++ entries decline a shape's first call (``torch_answers`` picks torch's ops then)."""
    if torch.compiler.is_compiling() or torch._C._is_tracing():
        return None
    return getattr(direct.NATIVE, name)


def torch_answers(*tensors: object) -> bool:
    """Whether a drop-in call (``layernorm``, ``layer_norm``, ``LayerNorm`` and the LayerNorm+Linear ones) is
    answered by torch's own ops, as torch's modules would answer it, instead of by our kernels: where a tensor is
    float64 (no kernel of ours takes it) and, outside torch.compile (which traces our ops through their fakes),
    where one is on the meta device, is a subclass other than ``nn.Parameter`` (a FakeTensor, a DTensor, ...) or a
    functorch transform's (vmap, grad, jacrev), or while a TorchDispatchMode is active (FakeTensorMode,
    FlopCounterMode, ...) or a forward-mode AD level (``forward_ad.dual_level``): our kernels cannot read those
    tensors, such a mode would not see them, and our autograd functions have no forward-mode rule. And while
    ``torch.jit.trace`` or ``torch.onnx.export`` records: a trace sees torch's ops, not our launches, and ONNX has
    torch's ops, not ours."""
    if any(isinstance(t, torch.Tensor) and t.dtype is torch.float64 for t in tensors):
        return True
    if torch.compiler.is_compiling():
        # torch.onnx.export's trace (torch.export, non-strict) takes torch's ops, which ONNX has (LayerNormalization,
        # Gemm) and our custom ops are not; dynamo folds the check to False while it traces.
        return torch.onnx.is_in_onnx_export()
    return (torch._C._len_torch_dispatch_stack() > 0 or forward_ad._current_level >= 0 or torch._C._is_tracing()
            or any(kernels_cannot_read(t) for t in tensors))


def kernels_cannot_read(t: object) -> bool:
    """Whether ``t`` is a tensor our kernels cannot read as it is: on the meta device, a subclass other than
    ``nn.Parameter`` (a jagged nested tensor is one), a nested tensor of the strided layout, not strided (sparse),
    a view whose memory holds the negated values (the negative bit: ``z.conj().imag``), an efficient zero tensor
    (no memory), wrapped by a functorch transform, or with rows or a last dim beyond int32 (``beyond_int32``)."""
    return isinstance(t, torch.Tensor) and (t.__class__ not in _PLAIN_TENSORS or t.is_meta or t.is_nested
                                            or t.layout is not torch.strided or t.is_neg() or t._is_zerotensor()
                                            or torch._C._functorch.is_functorch_wrapped_tensor(t)
                                            or _is_legacy_batched(t) or beyond_int32(t))


def trailing_sizes(x: torch.Tensor, n: int = 1) -> tuple[int, ...]:
    """x's last ``n`` dims; for a nested tensor, those its tensors share (a named error where they differ)."""
    if not x.is_nested:
        return tuple(x.shape[x.dim() - n:])
    try:
        return tuple(x.size(d) for d in range(x.dim() - n, x.dim()))
    except RuntimeError:
        dims = "last dim" if n == 1 else f"last {n} dims"
        raise ValueError(f"x: a nested tensor whose tensors differ in their {dims} (normalized)") from None


def last_size(x: torch.Tensor) -> int:
    """x's last dim (``trailing_sizes``)."""
    return x.shape[-1] if not x.is_nested else trailing_sizes(x)[0]


def check_torch_call(x: object, weight: object, bias: object, eps: float, activation: str,
                     names: tuple[str, str, str] = ("x", "weight", "bias"), h: int | None = None) -> None:
    """``validate``'s named checks for a call torch's ops answer (float64 and the meta device taken; weight or
    bias None: absent, else 1-D of ``h`` elements: x's last dim where None), and eps and the activation."""
    nx, nw, nb = names
    check_tensor(nx, x, min_ndim=1, layout=False, **TORCH_TAKES)
    if x.is_cuda and not x.is_nested:
        check_cuda_rows(nx, x, x.shape[-1] if h is None else h)
    what = f"{nx}'s last dim" if h is None else "the normalized dims' elements"
    for name, p in ((nw, weight), (nb, bias)):
        if p is not None:
            check_param(name, p, x, nx, last_size(x) if h is None else h, what, **TORCH_TAKES)
    as_eps(eps)
    _check_activation(activation)


def torch_layernorm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                    activation: str, shape: tuple[int, ...] | None = None,
                    names: tuple[str, str, str] = ("x", "weight", "bias")) -> torch.Tensor:
    """act(LayerNorm(x)) over ``shape`` (x's last dim if None) by torch's ops, for a call ``torch_answers``
    sends here (the named checks first, over x flattened to ``shape``'s size)."""
    h = math.prod(shape) if shape is not None and len(shape) > 1 else None
    def flat(p: object) -> object:   # a dense parameter of several normalized dims, as 1-D; anything else as it is
        return p.reshape(-1) if h is not None and isinstance(p, torch.Tensor) and p.layout is torch.strided else p
    check_torch_call(x, flat(weight), flat(bias), eps, activation, names, h)
    shape = (last_size(x),) if shape is None else shape
    return _ACT_FNS[activation](torch.nn.functional.layer_norm(x, shape, weight, bias, eps))


def as_eps(eps: object) -> float:
    """eps as a float, taken as torch's ``layer_norm`` takes it: a real number (Python's or NumPy's; a bool reads
    as 0 or 1) or a 0-dim real tensor that needs no gradient. Any value: torch takes 0, a negative eps, inf and
    NaN, and the kernels answer them as torch does (rstd = 1 / sqrt(var + eps): NaN where var + eps < 0)."""
    if eps.__class__ is float:
        return eps
    if isinstance(eps, numbers.Real) or (isinstance(eps, torch.Tensor) and eps.dim() == 0
                                         and not eps.requires_grad and not eps.is_complex()):
        return float(eps)
    raise TypeError(f"eps: expected a float, got {type(eps).__name__}")


def _native_takes(x: object, weight: object, bias: object, eps: object, variant: str, activation: str) -> bool:
    """Whether a call's arguments fit the C++ entries' schema and choices (tensors, a float eps, the default
    variant, a known activation). The entries check the rest."""
    return (variant == "fast" and isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
            and isinstance(bias, torch.Tensor) and eps.__class__ is float and activation in ACTIVATIONS
            and not x.is_nested)


def _empty_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, ...]:
    """The forward of validated empty x (no rows, or rows of nothing) as torch answers it: y like x, and the
    statistics [...] (for rows of nothing: mean 0, rstd NaN, as ``torch.native_layer_norm`` gives)."""
    y, mean, rstd = torch.native_layer_norm(x, x.shape[-1:], weight, bias, eps)
    return y.contiguous(), mean.reshape(x.shape[:-1]), rstd.reshape(x.shape[:-1])


def layernorm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5,
                  variant: str = "fast", activation: str = "none") -> tuple[torch.Tensor, ...]:
    """The forward alone, with the statistics the backward takes (no autograd).

    Args:
        x: the input ``[..., H]``, float32, float16 or bfloat16, on the CPU or a CUDA GPU; any layout.
        weight, bias: gamma and beta ``[H]``, x's dtype (or float32 for 16-bit x).
        eps: added to the variance (any float, as torch takes).
        variant: the forward kernel (``VARIANTS``; ``"fast"`` unless benchmarking the progression).
        activation: ``"none"``, ``"gelu"`` (erf) or ``"gelu_tanh"``, applied in the same pass.

    Shape:
        x, y: ``[..., H]``; mean, rstd: ``[...]``.

    Returns:
        (y, mean, rstd): y in x's dtype, mean and rstd (1 / sqrt(var + eps)) float32.

    Raises:
        TypeError: a non-tensor, an unsupported dtype or an eps that is not a number, named.
        ValueError: sizes or devices that do not match, an unknown variant or activation.

    Example:
        >>> y, mean, rstd = layernorm_fwd(torch.randn(4, 8), torch.ones(8), torch.zeros(8))
    """
    native = native_entry("layernorm_with_stats")
    # x checked first: vmap's fallback cannot loop this entry (it returns Tensor[]); see layernorm_bwd
    if native is not None and _native_takes(x, weight, bias, eps, variant, activation) and not kernels_cannot_read(x):
        out = native(x, weight, bias, eps, ACTIVATIONS[activation])
        if out:   # empty: a call the C++ entry does not take (see ops/launch/direct.cpp)
            return tuple(out)
    eps = as_eps(eps)
    _check_call(x, weight, bias, eps, variant, activation)
    if torch_answers(x, weight, bias):   # a fake or subclass tensor, or a dispatch mode: the op, which they see
        return tuple(torch.ops.mojo.layernorm_fwd(x, weight, bias, float(eps), variant, activation))
    if not _valid(x, weight, bias):
        if x.numel() == 0:
            return _empty_fwd(x, weight, bias, eps)
        x, weight, bias = adapt(x, weight, bias)
    if direct.launches(x):
        stats = x.shape[:-1]
        mean, rstd = _empty(stats, F32, x.device), _empty(stats, F32, x.device)
        y = _fwd_direct(x, weight, bias, float(eps), variant, ACTIVATIONS[activation], mean.data_ptr(), rstd.data_ptr())
        return y, mean, rstd
    h = x.shape[-1]
    x2 = x.view(-1, h)
    launch = fwd_launch(x2, weight, bias, variant) if x.is_cuda else _CPU_LAUNCH
    y, mean, rstd = fwd_op(activation, float(eps), launch)(x2, weight, bias)
    return y.view(x.shape), mean.view(x.shape[:-1]), rstd.view(x.shape[:-1])


def layernorm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                  mean: torch.Tensor, rstd: torch.Tensor, activation: str = "none") -> tuple[torch.Tensor, ...]:
    """The backward from ``layernorm_fwd``'s statistics (deterministic: no float atomics).

    Args:
        dy: the gradient of y, ``[..., H]``, x's dtype.
        x, weight, bias: the forward's inputs.
        mean, rstd: the forward's statistics, float32 ``[...]``.
        activation: the forward's activation.

    Shape:
        dy, x, dx: ``[..., H]``; dweight, dbias: ``[H]``.

    Returns:
        (dx, dweight, dbias) in x's dtype (dweight and dbias in the parameters' dtype).

    Raises:
        TypeError, ValueError: as ``layernorm_fwd``, and for a dy or statistics of the wrong dtype or shape.

    Example:
        >>> x, w, b = torch.randn(4, 8), torch.ones(8), torch.zeros(8)
        >>> y, mean, rstd = layernorm_fwd(x, w, b)
        >>> dx, dw, db = layernorm_bwd(torch.ones_like(y), x, w, b, mean, rstd)
    """
    native = native_entry("layernorm_bwd_with_plan")
    # dy checked first: a batched one (a vectorized jacobian's) would meet vmap's fallback, which cannot loop the
    # entry (it returns Tensor[]), before the entry's own check
    if native is not None and isinstance(activation, str) and activation in ACTIVATIONS and all(
            isinstance(t, torch.Tensor) for t in (dy, x, weight, bias, mean, rstd)) and not kernels_cannot_read(dy):
        out = native(dy, x, weight, bias, mean, rstd, ACTIVATIONS[activation])
        if out:   # empty: a call the C++ entry does not take (see ops/launch/direct.cpp)
            return tuple(out)
    if torch_answers(dy, x, weight, bias, mean, rstd):   # as in layernorm_fwd, after the named checks
        _check_bwd(dy, x, weight, bias, mean, rstd)
        _check_activation(activation)
        return tuple(torch.ops.mojo.layernorm_bwd(dy, x, weight, bias, mean, rstd, activation))
    if not (_valid(x, weight, bias) and _valid_bwd(dy, x, mean, rstd)):
        _check_bwd(dy, x, weight, bias, mean, rstd)
        _check_activation(activation)
        if x.numel() == 0:
            return torch.zeros_like(x), torch.zeros_like(weight), torch.zeros_like(bias)
        dx, dweight, dbias = layernorm_bwd(dy.contiguous(), *adapt(x, weight, bias), mean.contiguous(),
                                           rstd.contiguous(), activation)
        return dx, dweight.to(weight.dtype), dbias.to(bias.dtype)
    _check_activation(activation)
    if direct.launches(x):
        return _bwd_direct(dy, x, weight, bias, mean.data_ptr(), rstd.data_ptr(), ACTIVATIONS[activation])
    h = x.shape[-1]
    rows = x.numel() // h
    x2, dy2 = x.view(-1, h), dy.view(-1, h)
    parts = bwd_parts(rows, h, x.dtype, x.device)
    launch = _CPU_BWD_LAUNCH
    if x.is_cuda:
        launch = config.bwd_launch(parts, h, x.dtype, _vec_ok(h, x.dtype, dy, x, weight, bias), config.bwd_config(),
                                   sm_count(x.device))
    dx, dweight, dbias, _, _ = bwd_op(activation, launch)(dy2, x2, weight, bias, mean.view(-1), rstd.view(-1),
                                                          sizes={"parts": config.bwd_sizes(launch, parts)[1]})
    return dx.view(x.shape), dweight, dbias


def _valid_bwd(dy: object, x: torch.Tensor, mean: object, rstd: object) -> bool:
    """``_valid`` for the backward's other tensors: dy like x, mean and rstd float32 [...] on x's device."""
    try:
        stats = x.shape[:-1]
        return (dy.dtype is x.dtype and dy.shape == x.shape and dy.device == x.device and dy.is_contiguous()
                and mean.dtype is F32 and rstd.dtype is F32 and mean.shape == stats and rstd.shape == stats
                and mean.device == x.device and rstd.device == x.device
                and mean.is_contiguous() and rstd.is_contiguous() and isinstance(dy, torch.Tensor))
    except (AttributeError, TypeError, RuntimeError):   # RuntimeError: a sparse tensor's is_contiguous
        return False


def _check_bwd(dy: object, x: object, weight: object, bias: object, mean: object, rstd: object) -> None:
    """The backward's named checks (``layernorm_bwd``'s Raises)."""
    validate(x, weight, bias)
    check_tensor("dy", dy, dtypes=DTYPES, layout=False)
    check_same({"x": x, "dy": dy})
    if dy.shape != x.shape:
        raise ValueError(f"dy: shape {tuple(dy.shape)} does not match x {tuple(x.shape)}")
    for name, t in (("mean", mean), ("rstd", rstd)):
        check_tensor(name, t, min_ndim=0, dtypes=(torch.float32,), layout=False)
        if t.shape != x.shape[:-1] or t.device != x.device:
            raise ValueError(f"{name}: expected shape {tuple(x.shape[:-1])} on {x.device}, "
                             f"got {tuple(t.shape)} on {t.device}")


# ---------------------------------------------------------------- torch.library

@torch.library.custom_op("mojo::layernorm_fwd", mutates_args=())
def _fwd_custom(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                variant: str, activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return layernorm_fwd(x, weight, bias, eps, variant, activation)


@_fwd_custom.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
      variant: str, activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return torch.empty_like(x), stats, torch.empty_like(stats)


@torch.library.custom_op("mojo::layernorm_bwd", mutates_args=())
def _bwd_custom(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                mean: torch.Tensor, rstd: torch.Tensor, activation: str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return layernorm_bwd(dy, x, weight, bias, mean, rstd, activation)


@_bwd_custom.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
      mean: torch.Tensor, rstd: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(bias)


# ---------------------------------------------------------------- what torch.compile's graphs call

def fwd_call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, variant: str = "fast",
             activation: str = "none") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``layernorm_fwd`` in eager; under torch.compile the op its graph calls: on CUDA the C++ op
    ``torch.ops.mojo_direct.layernorm_fwd`` (no Python per call; default variant), else the torch.library op."""
    if not torch.compiler.is_compiling():
        return layernorm_fwd(x, weight, bias, eps, variant, activation)
    if x.is_cuda and variant == "fast" and activation in ACTIVATIONS and _native_ops_traceable():
        return torch.ops.mojo_direct.layernorm_fwd(x, weight, bias, eps, ACTIVATIONS[activation])
    return torch.ops.mojo.layernorm_fwd(x, weight, bias, eps, variant, activation)


def infer_call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, variant: str = "fast",
               activation: str = "none") -> torch.Tensor:
    """y alone, as ``fwd_call`` runs it; on CUDA under torch.compile the C++ op that keeps no statistics."""
    if (torch.compiler.is_compiling() and x.is_cuda and variant == "fast" and activation in ACTIVATIONS
            and _native_ops_traceable()):
        return torch.ops.mojo_direct.layernorm_infer(x, weight, bias, eps, ACTIVATIONS[activation])
    return fwd_call(x, weight, bias, eps, variant, activation)[0]


def bwd_call(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mean: torch.Tensor,
             rstd: torch.Tensor, activation: str = "none") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``layernorm_bwd`` in eager; under torch.compile the op its graph calls (as ``fwd_call``)."""
    if not torch.compiler.is_compiling():
        return layernorm_bwd(dy, x, weight, bias, mean, rstd, activation)
    if x.is_cuda and activation in ACTIVATIONS and _native_ops_traceable():
        return torch.ops.mojo_direct.layernorm_bwd(dy, x, weight, bias, mean, rstd, ACTIVATIONS[activation])
    return torch.ops.mojo.layernorm_bwd(dy, x, weight, bias, mean, rstd, activation)


def compiled_layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                       activation: str = "none") -> torch.Tensor:
    """The default ("fast") act(LayerNorm(x)) of valid inputs as a torch.compile graph holds it
    (``config.COMPILED_LAYERNORM``): torch's ``layer_norm``, which inductor fuses with its neighbours, or our op
    (no statistics kept where no gradient is to come)."""
    if config.COMPILED_LAYERNORM == "inductor":
        return _ACT_FNS[activation](torch.nn.functional.layer_norm(x, x.shape[-1:], weight, bias, eps))
    if no_grad_to_come(x, weight, bias):
        return infer_call(x, weight, bias, eps, "fast", activation)
    return LayerNormFunction.apply(x, weight, bias, eps, "fast", activation)


@torch.compiler.assume_constant_result
def _native_ops_traceable() -> bool:
    """Whether the C++ LayerNorm ops are loaded, with fake implementations for tracing (asked when dynamo traces;
    the first time, it builds and loads them)."""
    return direct.traceable({"layernorm_fwd": _fake_fwd, "layernorm_infer": _fake_infer, "layernorm_bwd": _fake_bwd})


def _fake_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, act: int) -> tuple:
    validate(x, weight, bias)
    as_eps(eps)
    stats = x.new_empty(x.shape[:-1], dtype=F32)
    return torch.empty_like(x), stats, torch.empty_like(stats)


def _fake_infer(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, act: int) -> torch.Tensor:
    return _fake_fwd(x, weight, bias, eps, act)[0]


def _fake_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mean: torch.Tensor,
              rstd: torch.Tensor, act: int) -> tuple:
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(bias)


# ---------------------------------------------------------------- autograd and nn.Module

class LayerNormFunction(torch.autograd.Function):
    """Autograd for act(LayerNorm(x)): gradients for x, weight and bias."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor, eps: float, variant: str, activation: str) -> torch.Tensor:
        ctx.activation, ctx.eps = activation, eps
        if not direct.launches(x):
            # torch.compile traces an op (fwd_call); the CPU runs the graph route
            y, mean, rstd = fwd_call(x, weight, bias, eps, variant, activation)
            ctx.save_for_backward(x, weight, bias, mean, rstd)
            return y
        # Eager on a GPU: checks, then one launch; mean and rstd share one buffer the backward reads.
        _check_call(x, weight, bias, eps, variant, activation)
        stats, mean, rstd = _stats(x)
        y = _fwd_direct(x, weight, bias, float(eps), variant, ACTIVATIONS[activation], mean, rstd)
        ctx.save_for_backward(x, weight, bias, stats)
        return y

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor) -> tuple:
        x, weight, bias, *stats = ctx.saved_tensors
        if create_graph():
            y = _ACT_FNS[ctx.activation](torch.nn.functional.layer_norm(x, x.shape[-1:], weight, bias, ctx.eps))
            return (*differentiable_grads(ctx, y, (x, weight, bias), dy), None, None, None)
        dy = dy.contiguous()
        if len(stats) == 2 or kernels_cannot_read(dy):   # a batched dy: the checked entry, which sends it to the op
            mean, rstd = stats if len(stats) == 2 else stat_views(stats[0], x)
            dx, dweight, dbias = bwd_call(dy, x, weight, bias, mean, rstd, ctx.activation)
        else:
            check_grad("dy", dy, x.dtype, x.shape, "x")
            dx, dweight, dbias = _bwd_direct(dy, x, weight, bias, *stat_addresses(stats[0]),
                                             ACTIVATIONS[ctx.activation])
        return dx, dweight, dbias, None, None, None


def create_graph() -> bool:
    """Whether a backward runs under ``create_graph=True`` (a double backward, a gradient penalty): grad mode is
    on in it. Not under torch.compile, whose AOTAutograd traces the backward itself."""
    return torch.is_grad_enabled() and not torch.compiler.is_compiling()


def differentiable_grads(ctx: torch.autograd.function.FunctionCtx, y: torch.Tensor,
                         inputs: tuple[torch.Tensor, ...], dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """A backward under ``create_graph``: the gradients of y (recomputed from the saved inputs by torch's
    differentiable ops) for the inputs that want one (``ctx.needs_input_grad``, from the first), so that they
    carry their own graph as torch's LayerNorm's do; our kernels' could not (ops/launch/direct.cpp does the same)."""
    wants = ctx.needs_input_grad[:len(inputs)]
    if not any(wants):
        return (None,) * len(inputs)
    grads = iter(torch.autograd.grad(y, [t for t, w in zip(inputs, wants, strict=True) if w], dy, create_graph=True,
                                     allow_unused=True))
    return tuple(next(grads) if w else None for w in wants)


def _check_call(x: object, weight: object, bias: object, eps: float, variant: str, activation: str) -> None:
    """Every check of a forward call (named errors)."""
    validate(x, weight, bias)
    _check_activation(activation)
    as_eps(eps)
    if variant != "fast":
        config.variant_config(variant)


def layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5,
              activation: str = "none", variant: str = "fast") -> torch.Tensor:
    """act(LayerNorm(x)) over the last dim, with autograd (the call ``LayerNorm`` makes).

    Args:
        x: the input ``[..., H]``, float32, float16 or bfloat16, on the CPU or a CUDA GPU; any layout.
        weight, bias: gamma and beta ``[H]``, x's dtype (or float32 for 16-bit x).
        eps: added to the variance (any float, as torch takes).
        activation: ``"none"``, ``"gelu"`` (erf) or ``"gelu_tanh"``, applied in the same pass.
        variant: the forward kernel (``VARIANTS``).

    Shape:
        x and the output: ``[..., H]``.

    Returns:
        The normalized tensor in x's dtype (float32 under CUDA autocast, as torch's).

    Raises:
        TypeError: a non-tensor, an unsupported dtype or an eps that is not a number, named.
        ValueError: sizes or devices that do not match, an unknown variant or activation.

    Example:
        >>> y = layernorm(torch.randn(4, 8, requires_grad=True), torch.ones(8), torch.zeros(8))
        >>> y.sum().backward()
    """
    native = native_entry("layernorm")
    if native is not None and _native_takes(x, weight, bias, eps, variant, activation):
        y = native(x, weight, bias, eps, ACTIVATIONS[activation])
        if y is not None:   # None: a call the C++ entry does not take (see ops/launch/direct.cpp)
            return y
    eps = as_eps(eps)
    if torch_answers(x, weight, bias):
        return torch_layernorm(x, weight, bias, eps, activation)
    if not _valid(x, weight, bias) or autocast_to_fp32(x):
        return _layernorm_adapted(x, weight, bias, eps, activation, variant)
    if torch.compiler.is_compiling() and variant == "fast":
        _check_call(x, weight, bias, eps, variant, activation)
        return compiled_layernorm(x, weight, bias, eps, activation)
    if torch.compiler.is_compiling() and no_grad_to_come(x, weight, bias):
        _check_call(x, weight, bias, eps, variant, activation)
        return infer_call(x, weight, bias, eps, variant, activation)
    if isinstance(x, torch.Tensor) and direct.launches(x) and no_grad_to_come(x, weight, bias):
        # No gradient to come (inference): one launch that keeps no statistics, no autograd node.
        _check_call(x, weight, bias, eps, variant, activation)
        return _fwd_direct(x, weight, bias, float(eps), variant, ACTIVATIONS[activation])
    return LayerNormFunction.apply(x, weight, bias, eps, variant, activation)


def autocast_to_fp32(x: torch.Tensor) -> bool:
    """Whether torch would run a LayerNorm of x in float32 now: CUDA autocast puts ``layer_norm`` on its float32
    list (the CPU's leaves it in x's dtype)."""
    return x.is_cuda and torch.is_autocast_enabled("cuda")


def _layernorm_adapted(x: object, weight: object, bias: object, eps: float, activation: str,
                       variant: str) -> torch.Tensor:
    """``layernorm`` of what the kernels do not take as it comes, answered as torch answers it: under CUDA
    autocast in float32; empty x by torch (nothing to compute); strided x and float32 parameters of 16-bit x
    adapted (``adapt``). Anything else gets ``validate``'s named error."""
    _check_call(x, weight, bias, eps, variant, activation)
    if autocast_to_fp32(x):
        with torch.autocast("cuda", enabled=False):
            return layernorm(x.float(), weight.float(), bias.float(), eps, activation, variant)
    if x.numel() == 0:
        y = torch.nn.functional.layer_norm(x, x.shape[-1:], weight.to(x.dtype), bias.to(x.dtype), eps)
        return _ACT_FNS[activation](y)
    return layernorm(*adapt(x, weight, bias), eps, activation, variant)


_ACT_FNS = {"none": lambda y: y, "gelu": torch.nn.functional.gelu,
            "gelu_tanh": lambda y: torch.nn.functional.gelu(y, approximate="tanh")}


def as_shape(normalized_shape: object) -> tuple[int, ...]:
    """``normalized_shape`` as a tuple of ints, read as torch's ``nn.LayerNorm`` reads it: an integer (Python's or
    NumPy's) for the last dim alone, or a sequence of them (tuple, list, ``torch.Size``, a NumPy array); one or
    more sizes >= 0."""
    try:
        shape = ((operator.index(normalized_shape),) if isinstance(normalized_shape, numbers.Integral)
                 else tuple(operator.index(d) for d in normalized_shape))
    except TypeError:
        shape = ()
    if not shape or min(shape) < 0:
        raise ValueError(f"normalized_shape: expected one or more sizes >= 0, got {normalized_shape!r}")
    return shape


def normalized_size(x: object, normalized_shape: int | Sequence[int],
                    by_torch: bool = False) -> tuple[tuple[int, ...], int]:
    """``normalized_shape`` as a tuple and the number of elements it covers, checked against x's trailing dims
    (as ``torch.nn.functional.layer_norm`` takes it); ``by_torch``: x of a call torch's ops answer
    (``torch_answers``)."""
    shape = as_shape(normalized_shape)
    check_tensor("x", x, min_ndim=1, layout=False, **(TORCH_TAKES if by_torch else {"dtypes": DTYPES}))
    if trailing_sizes(x, min(len(shape), x.dim())) != shape:
        got = "a nested tensor" if x.is_nested else f"shape {tuple(x.shape)}"
        raise ValueError(f"normalized_shape: {shape} is not x's trailing dims (x: {got})")
    return shape, math.prod(shape)


def layer_norm(x: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5, *, activation: str = "none",
               variant: str = "fast") -> torch.Tensor:
    """``torch.nn.functional.layer_norm`` on our kernels: act(LayerNorm(x)) over x's trailing ``normalized_shape``
    dims, with autograd.

    Args:
        x: the input, ``[*, *normalized_shape]``, float32, float16 or bfloat16, on the CPU or a CUDA GPU; any
            layout (a strided x is copied once).
        normalized_shape: the trailing dims to normalize over (an int for the last dim alone).
        weight, bias: gamma and beta of ``normalized_shape``, or None (1 and 0); x's dtype, or float32 for
            16-bit x.
        eps: added to the variance (any float, as torch takes).
        activation: ``"none"``, ``"gelu"`` (erf) or ``"gelu_tanh"``, applied in the same pass.
        variant: the forward kernel's variant (``VARIANTS``; benchmarks).

    Shape:
        x and the output: ``[*, *normalized_shape]``.

    Returns:
        The normalized tensor, x's dtype (float32 under CUDA autocast, as torch's).

    Raises:
        TypeError: a non-tensor or unsupported dtype, named.
        ValueError: sizes that do not match, tensors on different devices, an unknown activation.

    Example:
        >>> y = layer_norm(torch.randn(2, 3, 4), (3, 4))
    """
    by_torch = torch_answers(x, weight, bias)
    shape, h = normalized_size(x, normalized_shape, by_torch)
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and not isinstance(p, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(p).__name__}")
        if p is not None and tuple(p.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape} (normalized_shape), got {tuple(p.shape)}")
    if by_torch:
        return torch_layernorm(x, weight, bias, eps, activation, shape)
    x2 = x.reshape(*x.shape[:x.dim() - len(shape)], h) if len(shape) > 1 else x
    weight = constant(1.0, h, x.dtype, x.device) if weight is None else weight.reshape(h)
    bias = constant(0.0, h, weight.dtype, x.device) if bias is None else bias.reshape(h)
    return layernorm(x2, weight, bias, eps, activation, variant).reshape(x.shape)


_constants: dict[tuple, torch.Tensor] = {}


def constant(value: float, h: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A [h] tensor of ``value`` that stands in for an absent weight or bias: one per (value, h, dtype, device),
    never written (it depends on no tensor's values, so it cannot go stale)."""
    key = (value, h, dtype, device)
    t = _constants.get(key)
    if t is None:
        t = _constants[key] = torch.full((h,), value, dtype=dtype, device=device)
    return t


def weight_and_bias(module: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``module.weight`` and ``module.bias``, for the modules' forwards: read from ``_parameters`` (about a
    microsecond less per call than ``nn.Module.__getattr__``) where that is where they live (an ``nn.LayerNorm``,
    ``nn.Linear`` or our ``LayerNorm``, not a subclass, that holds both names there and not in its ``__dict__``);
    anything else (a parametrized or weight-normed module, a subclass, tracing) through ``getattr``."""
    params = module._parameters
    if (type(module) in _PLAIN_MODULES and "weight" in params and "bias" in params
            and "weight" not in module.__dict__ and "bias" not in module.__dict__
            and not torch.compiler.is_compiling()):
        return params["weight"], params["bias"]
    return module.weight, module.bias


def share_affine(dst: nn.LayerNorm, src: nn.LayerNorm) -> None:
    """``dst`` takes ``src``'s weight and bias themselves: parameters as parameters, buffers (a LayerNorm frozen into
    constants) as buffers, absent ones absent."""
    for name in ("weight", "bias"):
        p = getattr(src, name)
        if p is None or isinstance(p, nn.Parameter):
            setattr(dst, name, p)
        else:
            delattr(dst, name)
            dst.register_buffer(name, p)


class LayerNorm(nn.LayerNorm):
    """Drop-in for ``nn.LayerNorm`` on our kernels: a subclass (``isinstance(m, nn.LayerNorm)`` holds, so code that
    picks LayerNorms by type, such as weight-decay groups, treats it as one), with the same arguments, parameters
    and state dict; only the forward differs.

    Args:
        normalized_shape: the trailing dims to normalize over (an int for the last dim alone).
        eps: added to the variance.
        elementwise_affine: learnable gamma (ones) and beta (zeros) of ``normalized_shape``.
        bias: with ``elementwise_affine``, whether beta is learned (else it is 0).
        device, dtype: of the parameters (float32 parameters take 16-bit input, as torch's do).
        activation: ``"gelu"`` or ``"gelu_tanh"`` applies GELU in the same pass.
        variant: the forward kernel's variant (benchmarks).

    Shape:
        input and output: ``[*, *normalized_shape]``, any layout.

    Returns:
        ``forward(x)``: act(LayerNorm(x)) in x's dtype (float32 under CUDA autocast, as torch's).

    Raises:
        TypeError, ValueError: from ``forward``, for an input ``layer_norm`` refuses (named).

    Example:
        >>> ln = LayerNorm(768)
        >>> y = ln(torch.randn(4, 16, 768))
    """

    def __init__(self, normalized_shape: int | tuple[int, ...] | list[int], eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, device: torch.device | None = None,
                 dtype: torch.dtype | None = None, activation: str = "none", variant: str = "fast") -> None:
        _check_activation(activation)
        super().__init__(as_shape(normalized_shape), as_eps(eps), elementwise_affine, bias, device, dtype)
        self.activation, self.variant = activation, variant

    @classmethod
    def from_torch(cls, ln: nn.LayerNorm, activation: str | None = None) -> LayerNorm:
        """Ours in place of ``ln``, with its parameters themselves (the same ``nn.Parameter`` objects, as
        ``nn.SyncBatchNorm.convert_sync_batchnorm`` shares them): a tied weight stays tied, a frozen one frozen, and
        an optimizer made before the swap trains ours. Weights held as buffers stay the same buffers.

        Args:
            ln: an ``nn.LayerNorm`` (ours too); its hooks are not carried over.
            activation: ours' activation; None keeps ``ln``'s (``"none"`` for torch's).

        Returns:
            A ``LayerNorm`` of ``ln``'s shape and eps on ``ln``'s parameters.

        Raises:
            TypeError: ``ln`` is not an ``nn.LayerNorm``, or is parametrized or pruned (no plain parameters).

        Example:
            >>> torch_ln = torch.nn.LayerNorm(8)
            >>> ln = LayerNorm.from_torch(torch_ln)
            >>> assert ln.weight is torch_ln.weight
        """
        if not isinstance(ln, nn.LayerNorm):
            raise TypeError(f"ln: expected an nn.LayerNorm, got {type(ln).__name__}")
        m = cls(ln.normalized_shape, ln.eps, ln.elementwise_affine, ln.bias is not None, device="meta",
                activation=getattr(ln, "activation", "none") if activation is None else activation)
        have, want = ln.state_dict().keys(), m.state_dict().keys()
        if have != want:
            raise TypeError(f"ln: its state dict holds {sorted(have)}, not a LayerNorm's {sorted(want)} "
                            "(a parametrized or pruned LayerNorm); remove those first")
        share_affine(m, ln)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = weight_and_bias(self)
        if len(self.normalized_shape) > 1 or weight is None or bias is None:
            # absent parameters are 1 and 0 on x's device (``constant``), as torch's module has none to move
            return layer_norm(x, self.normalized_shape, weight, bias, self.eps, activation=self.activation,
                              variant=self.variant)
        return layernorm(x, weight, bias, self.eps, self.activation, self.variant)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation!r}"

    def __prepare_scriptable__(self) -> nn.Module:
        not_scriptable(self)


def not_scriptable(module: nn.Module) -> NoReturn:
    """What ``torch.jit.script`` meets first in our modules (their ``__prepare_scriptable__``): a named error.
    Their forwards run Python that TorchScript cannot compile (autograd functions, the choice of route); torch
    deprecates TorchScript for ``torch.export``, which takes them, as ``torch.jit.trace`` does."""
    raise TypeError(f"torch.jit.script: {type(module).__name__} cannot be scripted (TorchScript compiles no Python "
                    "calls); use torch.export or torch.jit.trace")


_PLAIN_MODULES = frozenset((nn.LayerNorm, nn.Linear, LayerNorm))   # weight_and_bias reads these directly
# torch.fx.symbolic_trace records the modules' calls of these as calls (the functions run at the graph's run, not
# while it is traced: their checks read tensors, which a trace has not)
torch.fx.wrap("layernorm")
torch.fx.wrap("layer_norm")
