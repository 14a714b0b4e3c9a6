"""What an input to an op is: the named checks (each error names the argument), and which calls torch's own ops
answer instead of our kernels (``torch_answers``). Every op's entries classify their inputs with these."""

from __future__ import annotations

import numbers
import operator
from collections.abc import Sequence

import torch
from torch import nn
from torch.autograd import forward_ad

DTYPES = (torch.float32, torch.float16, torch.bfloat16)   # what the kernels take
# the layouts a tensor's elements are stored densely in: torch.strided, and a jagged nested tensor's values
DENSE_LAYOUTS = (torch.strided, torch.jagged)


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    min_ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    layout: bool = True,
    devices: Sequence[str] = ("cpu", "cuda"),
) -> torch.Tensor:
    """Check that ``t`` is a tensor of a supported dtype, rank and device and, with ``layout`` (the default),
    non-empty and contiguous (the library's entries pass ``layout=False``: they copy a strided tensor once and
    answer an empty one as torch does); ``devices``: the device types taken. Always dense: a sparse (or mkldnn)
    tensor is refused, as torch's LayerNorm and Linear refuse it (a jagged nested tensor is dense).

    Raises:
        TypeError: ``t`` is not a tensor, or its dtype is not in ``dtypes``.
        ValueError: a sparse layout, wrong rank or unsupported device; with ``layout``, non-contiguous or empty.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout not in DENSE_LAYOUTS:
        raise ValueError(f"{name}: layout {t.layout} is not supported (use a dense tensor: {name}.to_dense())")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name}: dtype {str(t.dtype).removeprefix('torch.')} is not supported (use {allowed})")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} dimensions, got shape {tuple(t.shape)}")
    if t.device.type not in devices:
        raise ValueError(f"{name}: device {t.device} is not supported (use {' or '.join(devices)})")
    if not layout:
        return t
    if t.numel() == 0:
        raise ValueError(f"{name}: tensor is empty (shape {tuple(t.shape)})")
    if not t.is_contiguous():
        raise ValueError(f"{name}: tensor must be contiguous (call .contiguous()), got strides {t.stride()}")
    return t


INT32_MAX = 2**31 - 1


def beyond_int32(t: torch.Tensor) -> bool:
    """Whether ``t``'s last dim or its number of rows (elements over the last dim) exceeds int32, as the kernels
    take them (their element offsets are 64-bit, so more than 2**31 elements in all is fine). Symbolic sizes
    (torch.compile, torch.export) are not asked: a guard on them would constrain the traced program."""
    n = t.numel()
    if not isinstance(n, int) or n <= INT32_MAX:
        return False
    last = t.shape[-1] if t.dim() else 1
    return last > INT32_MAX or n // max(last, 1) > INT32_MAX


def check_int32_rows(name: str, t: torch.Tensor) -> None:
    """A kernel entry's check: ``t``'s rows and last dim each fit int32 (``beyond_int32``); the drop-in entries
    answer larger ones by torch's ops instead, where torch can (``check_cuda_rows``)."""
    if beyond_int32(t):
        rows = t.numel() // max(t.shape[-1], 1)
        raise ValueError(f"{name}: {rows} rows of {t.shape[-1]}; the kernels take at most {INT32_MAX} of each")


def check_cuda_rows(name: str, t: torch.Tensor, row_len: int) -> None:
    """A CUDA call that torch's ops answer: at most ``INT32_MAX`` rows of ``row_len``, as torch's CUDA LayerNorm
    takes (more get its raw error: a CUDA grid's limit). Symbolic sizes are not asked (``beyond_int32``)."""
    n = t.numel()
    if not (isinstance(n, int) and isinstance(row_len, int)):
        return
    rows = n // max(row_len, 1)
    if rows > INT32_MAX:
        raise ValueError(f"{name}: {rows} rows; a LayerNorm on a CUDA GPU takes at most {INT32_MAX} (torch's too)")


def check_same(args: dict[str, torch.Tensor]) -> None:
    """All tensors share one device and one dtype; the error names the odd one out."""
    (first_name, first), *rest = args.items()
    for name, t in rest:
        if t.device != first.device:
            raise ValueError(f"{name}: on {t.device}, but {first_name} is on {first.device}")
        if t.dtype != first.dtype:
            raise TypeError(f"{name}: dtype {t.dtype}, but {first_name} is {first.dtype}")


def check_param(name: str, t: object, x: torch.Tensor, x_name: str, size: int, what: str,
                dtypes: Sequence[torch.dtype], devices: Sequence[str] = ("cpu", "cuda")) -> None:
    """A 1-D parameter of ``x`` (any layout): a tensor of ``size`` elements (that of ``what``) on x's device, of x's
    dtype or, for 16-bit x, float32 (mixed precision, as torch's LayerNorm takes it)."""
    check_tensor(name, t, ndim=1, dtypes=dtypes, layout=False, devices=devices)
    if t.device != x.device:
        raise ValueError(f"{name}: on {t.device}, but {x_name} is on {x.device}")
    if t.dtype != x.dtype and not (t.dtype == torch.float32 and x.element_size() == 2):
        raise TypeError(f"{name}: dtype {t.dtype}, but {x_name} is {x.dtype} (use {x_name}'s dtype, or float32 "
                        f"for 16-bit {x_name})")
    check_size(name, t, 0, size, what)


def check_size(name: str, t: torch.Tensor, dim: int, expected: int, what: str) -> None:
    """``t.shape[dim]`` must equal ``expected`` (the size of ``what``)."""
    if t.shape[dim] != expected:
        raise ValueError(f"{name}: size {t.shape[dim]} at dim {dim} does not match {what} ({expected}); "
                         f"shape {tuple(t.shape)}")


def check_grad(name: str, grad: object, dtype: torch.dtype, shape: tuple[int, ...] | torch.Size, what: str) -> None:
    """An upstream gradient must be a tensor (any layout) of ``dtype`` and ``shape`` (that of ``what``, the forward's
    output) on a supported device."""
    if isinstance(grad, torch.Tensor) and grad.dtype is dtype and grad.shape == shape:
        return
    check_tensor(name, grad, dtypes=(dtype,), layout=False)
    raise ValueError(f"{name}: shape {tuple(grad.shape)} does not match {what} {tuple(shape)}")


def as_size(name: str, value: object) -> int:
    """``value`` as a size (an integer >= 0: Python's, NumPy's, anything ``operator.index`` takes), named if not."""
    try:
        size = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}") from None
    if size < 0:
        raise ValueError(f"{name}: expected a size >= 0, got {size}")
    return size


# ---------------------------------------------------------------- what torch's ops answer

# check_tensor's dtypes and devices for a call torch's ops answer: float64 and the meta device too
TORCH_TAKES = {"dtypes": (*DTYPES, torch.float64), "devices": ("cpu", "cuda", "meta")}


# what the entries may hand the C++ side (``t.__class__ in PLAIN_TENSORS``: a tensor, not a subclass): its
# ``accepts`` cannot see a Python subclass that carries no dispatch key, and torch's ops answer a subclass
# (``torch_answers``), so that its ``__torch_function__`` sees the call
PLAIN_TENSORS = (torch.Tensor, nn.Parameter)


# legacy vmap's batched tensors (autograd.grad's is_grads_batched); a torch without legacy vmap has none
_is_legacy_batched = getattr(torch._C._functorch, "is_legacy_batchedtensor", lambda t: False)


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
    return isinstance(t, torch.Tensor) and (t.__class__ not in PLAIN_TENSORS or t.is_meta or t.is_nested
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
