"""RMSNorm's input checks (named errors) and its classifier: which calls our kernels take, and which torch's own
ops answer."""

from __future__ import annotations

import torch

from ops.inputs import DTYPES, PLAIN_TENSORS, TORCH_TAKES, as_eps, check_tensor
from ops.layernorm.checks import normalized_size
from ops.layernorm_linear.checks import check_linear
from ops.rmsnorm import config
from ops.rmsnorm.config import SEMANTICS


def check_semantics(semantics: object) -> str:
    """``semantics`` if it is one of ``SEMANTICS``; the named error otherwise."""
    if semantics not in SEMANTICS:
        raise ValueError(f"semantics: {semantics!r} is not one of {list(SEMANTICS)}")
    return semantics


DEFAULT_EPS = {dtype: torch.finfo(dtype).eps for dtype in DTYPES}   # eps=None's, by the dtypes our kernels take


def default_eps(eps: object, dtype: torch.dtype) -> float:
    """eps as torch's RMSNorm takes it: None is ``torch.finfo(x.dtype).eps``; otherwise a real number (``as_eps``)."""
    return torch.finfo(dtype).eps if eps is None else as_eps(eps)


def native_takes(x: object, normalized_shape: object, weight: object, eps: object, semantics: object) -> bool:
    """Whether a call's arguments fit the C++ entry's schema: plain tensors (a weight, not None), a float eps or None,
    a known semantics, and ``normalized_shape`` x's last dim alone. The entry checks the rest (``accepts``)."""
    if not (x.__class__ in PLAIN_TENSORS and weight.__class__ in PLAIN_TENSORS and semantics in SEMANTICS
            and (eps is None or eps.__class__ is float) and x.ndim >= 1):
        return False
    shape = (normalized_shape,) if normalized_shape.__class__ is int else normalized_shape
    return len(shape) == 1 and shape[0] == x.shape[-1]


def native_takes_linear(x: object, norm_weight: object, weight: object, bias: object, eps: object,
                        semantics: object) -> bool:
    """Whether an ``rms_norm_linear`` call's arguments fit the C++ entry's schema: plain tensors (a norm weight, not
    None; a bias or None), a float eps or None, a known semantics. The entry checks the rest (``linear_accepts``)."""
    return (x.__class__ in PLAIN_TENSORS and norm_weight.__class__ in PLAIN_TENSORS
            and weight.__class__ in PLAIN_TENSORS and (bias is None or bias.__class__ in PLAIN_TENSORS)
            and (eps is None or eps.__class__ is float) and semantics in SEMANTICS and x.ndim >= 1)


def check_call(x: object, normalized_shape: object, weight: object, semantics: object,
               by_torch: bool = False, name: str = "weight") -> tuple[tuple[int, ...], int]:
    """The named checks of an ``rms_norm`` call: x a tensor of a dtype taken (torch's too where torch answers it),
    ``normalized_shape`` x's trailing dims, weight None or a tensor of that shape on x's device, of x's dtype or
    float32; a known semantics. ``name``: the weight's in the message. Returns the shape and the elements it
    covers."""
    check_semantics(semantics)
    shape, h = normalized_size(x, normalized_shape, by_torch)
    if weight is not None:
        check_tensor(name, weight, layout=False, **(TORCH_TAKES if by_torch else {"dtypes": DTYPES}))
        if tuple(weight.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape} (normalized_shape), got {tuple(weight.shape)}")
        if weight.device != x.device:
            raise ValueError(f"{name}: on {weight.device}, but x is on {x.device}")
        if weight.dtype != x.dtype and weight.dtype != torch.float32:
            raise TypeError(f"{name}: dtype {weight.dtype}, but x is {x.dtype} (use x's dtype or float32)")
    return shape, h


def classify(x: torch.Tensor, weight: torch.Tensor | None, by_torch: bool) -> str:
    """Which route takes an ``rms_norm`` call whose arguments passed ``check_call``: "torch" (torch's ops: what
    ``torch_answers`` sends there, ``by_torch``; an empty x; a weight of another dtype than x's, whose product the
    modules take in float32; CUDA autocast, whose policy for the op torch applies; torch.compile's tracing, where
    ``config.COMPILED_RMSNORM`` is "inductor"), or "kernels" (our kernels; a strided x is copied once)."""
    if (by_torch or x.numel() == 0 or (weight is not None and weight.dtype != x.dtype)
            or (x.is_cuda and torch.is_autocast_enabled("cuda")) or compiled_by_inductor()):
        return "torch"
    return "kernels"


def compiled_by_inductor() -> bool:
    """Whether torch.compile is tracing and hands RMSNorm to inductor (``config.COMPILED_RMSNORM``)."""
    if config.COMPILED_RMSNORM not in config.COMPILED_FORMS:
        raise ValueError(f"COMPILED_RMSNORM: expected one of {config.COMPILED_FORMS}, got {config.COMPILED_RMSNORM!r}")
    return torch.compiler.is_compiling() and config.COMPILED_RMSNORM == "inductor"


def check_linear_call(x: object, norm_weight: object, weight: object, bias: object, semantics: object,
                      by_torch: bool) -> None:
    """The named checks of an ``rms_norm_linear`` call: x and ``norm_weight`` as ``check_call`` takes them over x's
    last dim, then the Linear's weight [N, K] and bias [N] (``check_linear``; of x's dtype unless CUDA autocast casts
    them)."""
    check_tensor("x", x, min_ndim=1, layout=False, **(TORCH_TAKES if by_torch else {"dtypes": DTYPES}))
    check_call(x, x.shape[-1:], norm_weight, semantics, by_torch, name="norm_weight")
    check_linear(x, weight, bias, same_dtype=not (x.is_cuda and torch.is_autocast_enabled("cuda")),
                 by_torch=by_torch)


def direct_takes(x: torch.Tensor, norm_weight: object, weight: object, bias: object, semantics: str) -> bool:
    """Whether checked arguments of ``rms_norm_linear`` take the direct route: eager on a GPU (``direct.launches``),
    plain contiguous non-empty tensors of one dtype, a norm weight [K], no CUDA autocast and a known semantics; the
    rest is ``rms_norm`` then ``F.linear``."""
    tensors = (x, norm_weight, weight) if bias is None else (x, norm_weight, weight, bias)
    return (all(t.__class__ in PLAIN_TENSORS and t.dtype == x.dtype and t.is_contiguous() for t in tensors)
            and semantics in SEMANTICS and x.numel() > 0 and weight.numel() > 0
            and not torch.is_autocast_enabled("cuda"))
