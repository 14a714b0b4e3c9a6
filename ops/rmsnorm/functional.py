"""``rms_norm``: ``torch.nn.functional.rms_norm`` on our kernels, with the semantics of the models that use it
(torch's, Hugging Face Llama's, Gemma's). It checks, picks its route once, and calls it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ops.common import add_residual, check_residual, constant, native_entry, native_takes_add, no_grad_to_come
from ops.inputs import torch_answers
from ops.launch import direct
from ops.layernorm.autograd import add_norm
from ops.layernorm_linear.launch import linear
from ops.rmsnorm.autograd import RMSNormLinearFunction, rms_norm_rows
from ops.rmsnorm.checks import (
    DEFAULT_EPS,
    check_call,
    check_linear_call,
    classify,
    default_eps,
    direct_takes,
    native_takes,
    native_takes_linear,
)
from ops.rmsnorm.config import SEMANTICS
from ops.rmsnorm.fwd_bwd import torch_rms_norm


def rms_norm(x: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
             eps: float | None = None, *, semantics: str = "torch") -> torch.Tensor:
    """RMSNorm over x's trailing ``normalized_shape`` dims, with autograd: ``F.rms_norm``'s signature.

    Args:
        x: the input ``[*, *normalized_shape]``, float32, float16 or bfloat16 (float64 and the like by torch's ops),
            on the CPU or a CUDA GPU; any layout (a strided x is copied once).
        normalized_shape: the trailing dims to normalize over (an int for the last dim alone).
        weight: the scale of ``normalized_shape``, or None (1).
        eps: added to the mean square; None: ``torch.finfo(x.dtype).eps``, as torch's.
        semantics: ``"torch"`` (``nn.RMSNorm``), ``"llama"`` (x * rstd rounded to x's dtype, then times the weight:
            Hugging Face's LlamaRMSNorm and its copies) or ``"gemma"`` (times 1 + weight, in float32).

    Shape:
        x and the output: ``[*, *normalized_shape]``.

    Returns:
        The normalized tensor in x's dtype (Llama's with a float32 weight: float32, as its module gives).

    Raises:
        TypeError: a non-tensor, an unsupported dtype or an eps that is not a number, named.
        ValueError: a shape that does not match, tensors on different devices, an unknown semantics.

    Example:
        >>> y = rms_norm(torch.randn(2, 8, requires_grad=True), 8, torch.ones(8))
        >>> y.sum().backward()
    """
    native = native_entry("rms_norm")
    if native is not None and native_takes(x, normalized_shape, weight, eps, semantics):
        y = native(x, weight, DEFAULT_EPS.get(x.dtype, 0.0) if eps is None else eps, SEMANTICS[semantics])
        if y is not None:   # None: a call the C++ entry does not take (accepts, ops/launch/native/plans.h)
            return y
    by_torch = torch_answers(x, weight)
    shape, h = check_call(x, normalized_shape, weight, semantics, by_torch)
    eps = default_eps(eps, x.dtype)
    if classify(x, weight, by_torch) == "torch":
        return torch_rms_norm(x, shape, weight, eps, semantics)
    w = unit_weight(x, h, semantics) if weight is None else weight.reshape(h)
    y = rms_norm_rows(x.reshape(-1, h).contiguous(), w, eps, semantics)
    return y.view(x.shape)


def unit_weight(x: torch.Tensor, h: int, semantics: str) -> torch.Tensor:
    """The weight a call without one normalizes by: [h] of x's dtype on x's device that multiplies by 1 under
    ``semantics`` (Gemma's 1 + weight: zeros), a kept constant (``constant``)."""
    return constant(0.0 if semantics == "gemma" else 1.0, h, x.dtype, x.device)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None,
                 eps: float | None = None, *, add_bias: torch.Tensor | None = None, residual_in_fp32: bool = False,
                 semantics: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm block's add and RMSNorm: s = x (+ add_bias) + residual, y = RMSNorm(s) over the last dim by
    ``semantics``; returns both, with autograd (the backward adds the incoming gradient of s). On a GPU one kernel
    does both where it takes the call (``add_norm``: contiguous tensors of one dtype, rows a block holds, no
    ``residual_in_fp32``); otherwise this adds, then runs ``rms_norm``.

    Args:
        x, residual: ``[..., H]``, one shape and device.
        weight: the RMSNorm's ``[H]``, or None.
        eps: the RMSNorm's; None: ``torch.finfo(x.dtype).eps``.
        add_bias: ``[H]`` added to x first (the preceding Linear's bias), or None.
        residual_in_fp32: s in float32 (the residual stream kept in full precision), y in x's dtype.
        semantics: as ``rms_norm``'s.

    Shape:
        x, residual, y, s: ``[..., H]``.

    Returns:
        (y, s): y in x's dtype; s in x's dtype, or float32 with ``residual_in_fp32``.

    Raises:
        TypeError, ValueError: named, for residual or add_bias, and as ``rms_norm`` for the rest.

    Example:
        >>> y, s = add_rms_norm(torch.randn(2, 8), torch.randn(2, 8), torch.ones(8))
    """
    native = native_entry("add_norm")
    if (native is not None and not residual_in_fp32 and semantics in SEMANTICS
            and native_takes_add(x, residual, add_bias, weight, None, 1.0 if eps is None else eps)):
        w = unit_weight(x, x.shape[-1], semantics) if weight is None else weight
        out = native(x, residual, add_bias, w, w, DEFAULT_EPS.get(x.dtype, 0.0) if eps is None else eps,
                     SEMANTICS[semantics])
        if out:   # empty: a call the C++ entry does not take (add_norm_plan, ops/launch/native/add_norm.h)
            return out[0], out[1]
    check_residual(x, residual, add_bias)
    eps = default_eps(eps, x.dtype)
    if not residual_in_fp32 and semantics in SEMANTICS:   # the one-pass kernel, where it takes the call
        h = x.shape[-1]
        w = unit_weight(x, h, semantics) if weight is None else weight
        out = add_norm(x, residual, add_bias, w, w, eps, SEMANTICS[semantics],
                       lambda s: torch_rms_norm(s, (h,), w, eps, semantics))
        if out is not None:
            return out
    s = add_residual(x, residual, add_bias, residual_in_fp32)
    w = weight.float() if weight is not None and residual_in_fp32 else weight
    return rms_norm(s, s.shape[-1:], w, eps, semantics=semantics).to(x.dtype), s


def rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor | None, weight: torch.Tensor,
                    bias: torch.Tensor | None = None, eps: float | None = None, *,
                    semantics: str = "torch") -> torch.Tensor:
    """Linear(RMSNorm(x)) over x's last dim, with autograd for every input (the call ``FusedRMSNormLinear`` makes).
    Eager on a GPU: our RMSNorm launched directly and the Linear by cuBLASLt, one autograd node for both (the C++
    entry's, once the first call, ``RMSNormLinearFunction``, has handed it the plans); otherwise (the CPU,
    torch.compile, autocast, mixed dtypes) ``rms_norm``, then ``F.linear``.

    Args:
        x: the input ``[..., K]``, float32, float16 or bfloat16 (float64 and the like by torch's ops).
        norm_weight: the RMSNorm's ``[K]`` (x's dtype or float32), or None.
        weight: the Linear's ``[N, K]``; bias: its ``[N]`` or None.
        eps: the RMSNorm's; None: ``torch.finfo(x.dtype).eps``.
        semantics: the RMSNorm's (``rms_norm``).

    Shape:
        x: ``[..., K]``; output: ``[..., N]``.

    Returns:
        Linear(RMSNorm(x)) in x's dtype (under CUDA autocast, what the torch modules give).

    Raises:
        TypeError, ValueError: named (x, norm_weight, weight, bias, eps, semantics).

    Example:
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> y = rms_norm_linear(x, torch.ones(8), torch.randn(3, 8), torch.zeros(3))
        >>> y.sum().backward()
    """
    native = native_entry("rms_norm_linear")
    if native is not None and native_takes_linear(x, norm_weight, weight, bias, eps, semantics):
        y = native(x, norm_weight, weight, bias, DEFAULT_EPS.get(x.dtype, 0.0) if eps is None else eps,
                   SEMANTICS[semantics])
        if y is not None:   # None: a call the C++ entry does not take (no plan yet, or not linear_accepts')
            return y
    check_linear_call(x, norm_weight, weight, bias, semantics, torch_answers(x, norm_weight, weight, bias))
    eps = default_eps(eps, x.dtype)
    if not (direct.launches(x) and direct_takes(x, norm_weight, weight, bias, semantics)):
        return torch.nn.functional.linear(rms_norm(x, x.shape[-1:], norm_weight, eps, semantics=semantics),
                                          weight, bias)
    k, n = x.shape[-1], weight.shape[0]
    if no_grad_to_come(x, norm_weight, weight, bias):
        return linear(rms_norm(x, k, norm_weight, eps, semantics=semantics), weight, bias)
    if x.ndim == 2:
        return RMSNormLinearFunction.apply(x, norm_weight, weight, bias, eps, semantics)
    return RMSNormLinearFunction.apply(x.view(-1, k), norm_weight, weight, bias, eps, semantics).view(*x.shape[:-1], n)
