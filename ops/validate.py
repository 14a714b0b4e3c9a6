"""Input checks run before MAX sees a tensor; each error names the argument."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

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
