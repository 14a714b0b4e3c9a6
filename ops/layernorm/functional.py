"""LayerNorm's functions with autograd: ``layernorm`` (the last dim; the call ``LayerNorm`` makes) and ``layer_norm``
(``F.layer_norm``'s signature). Each checks, picks its route once, and calls it."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ops.common import add_residual, check_residual, constant, native_entry, native_takes_add, no_grad_to_come
from ops.inputs import as_eps, last_size, torch_answers
from ops.launch import direct
from ops.layernorm.autograd import LayerNormFunction, add_norm, compiled_layernorm
from ops.layernorm.checks import (
    ACT_FNS,
    adapt,
    autocast_to_fp32,
    check_call,
    check_options,
    check_torch_call,
    classify,
    native_takes,
    normalized_size,
)
from ops.layernorm.config import ACTIVATIONS
from ops.layernorm.fwd_bwd import infer_call
from ops.layernorm.launch import fwd_direct


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
    return ACT_FNS[activation](torch.nn.functional.layer_norm(x, shape, weight, bias, eps))


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
    if native is not None and native_takes(x, weight, bias, eps, variant, activation):
        y = native(x, weight, bias, eps, ACTIVATIONS[activation])
        if y is not None:   # None: a call the C++ entry does not take (accepts, ops/launch/native/plans.h)
            return y
    eps = as_eps(eps)
    way = route(x, weight, bias, variant)
    if way in _CHECKED_HERE:
        check_call(x, weight, bias, eps, variant, activation)
    return _ROUTES[way](x, weight, bias, eps, activation, variant)


def route(x: object, weight: object, bias: object, variant: str) -> str:
    """The one route decision of a ``layernorm`` call that the C++ entry did not take (bad tensors get
    ``classify``'s named error):

    * "torch": torch's own ops answer it (``torch_answers``: float64, fake or meta tensors, a dispatch mode, ...);
    * "adapt": our kernels do not take it as it comes (CUDA autocast, empty, strided, float32 parameters);
    * "compiled", "compiled_infer": torch.compile traces it (the default variant; or another, without a gradient);
    * "infer": a direct launch without a gradient to come (no statistics kept, no autograd node);
    * "autograd": ``LayerNormFunction``.
    """
    if (kind := classify(x, weight, bias)) != "kernels":
        return kind
    grad = not no_grad_to_come(x, weight, bias)
    if torch.compiler.is_compiling():
        if variant == "fast":
            return "compiled"
        return "autograd" if grad else "compiled_infer"
    return "infer" if not grad and direct.launches(x) else "autograd"


_CHECKED_HERE = frozenset({"compiled", "compiled_infer", "infer"})   # the others check inside
_ROUTES = {
    "torch": lambda x, w, b, eps, act, variant: torch_layernorm(x, w, b, eps, act),
    "adapt": lambda x, w, b, eps, act, variant: _layernorm_adapted(x, w, b, eps, act, variant),
    "compiled": lambda x, w, b, eps, act, variant: compiled_layernorm(x, w, b, eps, act),
    "compiled_infer": lambda x, w, b, eps, act, variant: infer_call(x, w, b, eps, variant, act),
    "infer": lambda x, w, b, eps, act, variant: fwd_direct(x, w, b, float(eps), variant, ACTIVATIONS[act]),
    "autograd": lambda x, w, b, eps, act, variant: LayerNormFunction.apply(x, w, b, eps, variant, act),
}


def _layernorm_adapted(x: object, weight: object, bias: object, eps: float, activation: str,
                       variant: str) -> torch.Tensor:
    """``layernorm`` of what the kernels do not take as it comes, answered as torch answers it: under CUDA
    autocast in float32; empty x by torch (nothing to compute); strided x and float32 parameters of 16-bit x
    adapted (``adapt``). ``classify`` checked the tensors."""
    check_options(eps, variant, activation)
    if autocast_to_fp32(x):
        with torch.autocast("cuda", enabled=False):
            return layernorm(x.float(), weight.float(), bias.float(), eps, activation, variant)
    if x.numel() == 0:
        y = torch.nn.functional.layer_norm(x, x.shape[-1:], weight.to(x.dtype), bias.to(x.dtype), eps)
        return ACT_FNS[activation](y)
    return layernorm(*adapt(x, weight, bias), eps, activation, variant)


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


def unit_affine(x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, bias) of an add-and-norm call, an absent one as the kept constant 1 or 0 [x's last dim] of x's dtype
    on x's device."""
    h = x.shape[-1]
    return (constant(1.0, h, x.dtype, x.device) if weight is None else weight,
            constant(0.0, h, x.dtype, x.device) if bias is None else bias)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, eps: float = 1e-5, *, add_bias: torch.Tensor | None = None,
                   residual_in_fp32: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm block's add and LayerNorm: s = x (+ add_bias) + residual, y = LayerNorm(s) over the last dim;
    returns both, with autograd (the backward adds the incoming gradient of s). On a GPU one kernel does both where
    it takes the call (``add_norm``: contiguous tensors of one dtype, rows a block holds, no ``residual_in_fp32``);
    otherwise this adds, then runs ``layer_norm``.

    Args:
        x, residual: ``[..., H]``, one shape and device.
        weight, bias: the LayerNorm's ``[H]``, or None.
        eps: the LayerNorm's.
        add_bias: ``[H]`` added to x first (the preceding Linear's bias), or None.
        residual_in_fp32: s in float32 (the residual stream kept in full precision), y in x's dtype.

    Shape:
        x, residual, y, s: ``[..., H]``.

    Returns:
        (y, s): y in x's dtype; s in x's dtype, or float32 with ``residual_in_fp32``.

    Raises:
        TypeError, ValueError: named, for residual or add_bias, and as ``layer_norm`` for the rest.

    Example:
        >>> y, s = add_layer_norm(torch.randn(2, 8), torch.randn(2, 8), torch.ones(8), torch.zeros(8))
    """
    native = native_entry("add_norm")
    if native is not None and not residual_in_fp32 and native_takes_add(x, residual, add_bias, weight, bias, eps):
        out = native(x, residual, add_bias, *unit_affine(x, weight, bias), eps, ACTIVATIONS["none"])
        if out:   # empty: a call the C++ entry does not take (add_norm_plan, ops/launch/native/add_norm.h)
            return out[0], out[1]
    check_residual(x, residual, add_bias)
    if not residual_in_fp32:   # the one-pass kernel, where it takes the call
        h = x.shape[-1]
        w, b = unit_affine(x, weight, bias)
        e = as_eps(eps)
        out = add_norm(x, residual, add_bias, w, b, float(e), ACTIVATIONS["none"],
                       lambda s: torch.nn.functional.layer_norm(s, (h,), w, b, e))
        if out is not None:
            return out
    s = add_residual(x, residual, add_bias, residual_in_fp32)
    params = [p if p is None or not residual_in_fp32 else p.float() for p in (weight, bias)]
    return layer_norm(s, s.shape[-1:], *params, eps).to(x.dtype), s
