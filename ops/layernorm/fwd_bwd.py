"""LayerNorm's forward and backward without autograd (``layernorm_fwd``, ``layernorm_bwd``), their ``torch.library``
ops with fakes (``torch.ops.mojo.layernorm_fwd`` / ``_bwd``), and the calls a torch.compile graph makes of them."""

from __future__ import annotations

import torch

from ops.common import empty, native_entry
from ops.inputs import as_eps, kernels_cannot_read, torch_answers
from ops.launch import direct
from ops.layernorm import config
from ops.layernorm.checks import (
    adapt,
    check_activation,
    check_bwd,
    check_call,
    empty_fwd,
    native_takes,
    valid,
    valid_bwd,
    validate,
)
from ops.layernorm.config import ACTIVATIONS, F32
from ops.layernorm.launch import (
    CPU_BWD_LAUNCH,
    CPU_LAUNCH,
    bwd_direct,
    bwd_op,
    bwd_parts,
    fwd_direct,
    fwd_launch,
    fwd_op,
    sm_count,
    vectors_fit,
)


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
    if native is not None and native_takes(x, weight, bias, eps, variant, activation) and not kernels_cannot_read(x):
        out = native(x, weight, bias, eps, ACTIVATIONS[activation])
        if out:   # empty: a call the C++ entry does not take (accepts, ops/launch/native/plans.h)
            return tuple(out)
    eps = as_eps(eps)
    check_call(x, weight, bias, eps, variant, activation)
    if torch_answers(x, weight, bias):   # a fake or subclass tensor, or a dispatch mode: the op, which they see
        return tuple(torch.ops.mojo.layernorm_fwd(x, weight, bias, float(eps), variant, activation))
    if not valid(x, weight, bias):
        if x.numel() == 0:
            return empty_fwd(x, weight, bias, eps)
        x, weight, bias = adapt(x, weight, bias)
    if direct.launches(x):
        stats = x.shape[:-1]
        mean, rstd = empty(stats, F32, x.device), empty(stats, F32, x.device)
        y = fwd_direct(x, weight, bias, float(eps), variant, ACTIVATIONS[activation], mean.data_ptr(), rstd.data_ptr())
        return y, mean, rstd
    h = x.shape[-1]
    x2 = x.view(-1, h)
    launch = fwd_launch(x2, weight, bias, variant) if x.is_cuda else CPU_LAUNCH
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
        if out:   # empty: a call the C++ entry does not take (accepts, ops/launch/native/plans.h)
            return tuple(out)
    if torch_answers(dy, x, weight, bias, mean, rstd):   # as in layernorm_fwd, after the named checks
        check_bwd(dy, x, weight, bias, mean, rstd)
        check_activation(activation)
        return tuple(torch.ops.mojo.layernorm_bwd(dy, x, weight, bias, mean, rstd, activation))
    if not (valid(x, weight, bias) and valid_bwd(dy, x, mean, rstd)):
        check_bwd(dy, x, weight, bias, mean, rstd)
        check_activation(activation)
        if x.numel() == 0:
            return torch.zeros_like(x), torch.zeros_like(weight), torch.zeros_like(bias)
        dx, dweight, dbias = layernorm_bwd(dy.contiguous(), *adapt(x, weight, bias), mean.contiguous(),
                                           rstd.contiguous(), activation)
        return dx, dweight.to(weight.dtype), dbias.to(bias.dtype)
    check_activation(activation)
    if direct.launches(x):
        return bwd_direct(dy, x, weight, bias, mean.data_ptr(), rstd.data_ptr(), ACTIVATIONS[activation])
    h = x.shape[-1]
    rows = x.numel() // h
    x2, dy2 = x.view(-1, h), dy.view(-1, h)
    parts = bwd_parts(rows, h, x.dtype, x.device)
    launch = CPU_BWD_LAUNCH
    if x.is_cuda:
        launch = config.bwd_launch(parts, h, x.dtype, vectors_fit(h, x.dtype, dy, x, weight, bias), config.bwd_config(),
                                   sm_count(x.device))
    dx, dweight, dbias, _, _ = bwd_op(activation, launch)(dy2, x2, weight, bias, mean.view(-1), rstd.view(-1),
                                                          sizes={"parts": config.bwd_sizes(launch, parts)[1]})
    return dx.view(x.shape), dweight, dbias


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


def fwd_call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, variant: str = "fast",
             activation: str = "none") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``layernorm_fwd`` in eager; under torch.compile the op its graph calls: on CUDA the C++ op
    ``torch.ops.mojo_direct.layernorm_fwd`` (no Python per call; default variant), else the torch.library op."""
    if not torch.compiler.is_compiling():
        return layernorm_fwd(x, weight, bias, eps, variant, activation)
    if x.is_cuda and variant == "fast" and activation in ACTIVATIONS and native_ops_traceable():
        return torch.ops.mojo_direct.layernorm_fwd(x, weight, bias, eps, ACTIVATIONS[activation])
    return torch.ops.mojo.layernorm_fwd(x, weight, bias, eps, variant, activation)


def infer_call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, variant: str = "fast",
               activation: str = "none") -> torch.Tensor:
    """y alone, as ``fwd_call`` runs it; on CUDA under torch.compile the C++ op that keeps no statistics."""
    if (torch.compiler.is_compiling() and x.is_cuda and variant == "fast" and activation in ACTIVATIONS
            and native_ops_traceable()):
        return torch.ops.mojo_direct.layernorm_infer(x, weight, bias, eps, ACTIVATIONS[activation])
    return fwd_call(x, weight, bias, eps, variant, activation)[0]


def bwd_call(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mean: torch.Tensor,
             rstd: torch.Tensor, activation: str = "none") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``layernorm_bwd`` in eager; under torch.compile the op its graph calls (as ``fwd_call``)."""
    if not torch.compiler.is_compiling():
        return layernorm_bwd(dy, x, weight, bias, mean, rstd, activation)
    if x.is_cuda and activation in ACTIVATIONS and native_ops_traceable():
        return torch.ops.mojo_direct.layernorm_bwd(dy, x, weight, bias, mean, rstd, ACTIVATIONS[activation])
    return torch.ops.mojo.layernorm_bwd(dy, x, weight, bias, mean, rstd, activation)


@torch.compiler.assume_constant_result
def native_ops_traceable() -> bool:
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
