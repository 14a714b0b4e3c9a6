"""LayerNorm+Linear's forward and backward without autograd (``layernorm_linear_fwd``, ``layernorm_linear_bwd``)
and their ``torch.library`` ops with fakes."""

from __future__ import annotations

import torch

from ops.inputs import (
    DTYPES,
    as_eps,
    check_same,
    check_tensor,
    torch_answers,
)
from ops.layernorm import checks as ln_checks
from ops.layernorm import fwd_bwd as ln_fwd_bwd
from ops.layernorm_linear import launch
from ops.layernorm_linear.algo import check_algo, pick_algo, sm90_unsupported
from ops.layernorm_linear.checks import adapted_fwd, empty_result, valid_linear, validate
from ops.layernorm_linear.launch import linear, linear_grads, zero_bias


def layernorm_linear_fwd(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, eps: float = 1e-5, algo: str = "auto"
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward alone, with the statistics the backward takes (no autograd).

    Args:
        x: the input ``[..., K]``, float32, float16 or bfloat16, on the CPU or a CUDA GPU; any layout.
        ln_weight, ln_bias: the LayerNorm's gamma and beta ``[K]``, x's dtype (or float32 for 16-bit x).
        weight: the Linear's ``[N, K]``, x's dtype.
        bias: the Linear's ``[N]``, or None.
        eps: the LayerNorm's (any float, as torch takes).
        algo: ``"auto"``, ``"fused"``, ``"sm90"`` or ``"unfused"`` (the module docstring).

    Shape:
        x: ``[..., K]``; y: ``[..., N]``; mean, rstd: ``[...]``.

    Returns:
        (y, mean, rstd): y in x's dtype, the LayerNorm's mean and rstd float32.

    Raises:
        TypeError: a non-tensor, an unsupported dtype or an eps that is not a number, named.
        ValueError: sizes, dtypes or devices that do not match, an unknown algo, or ``"sm90"`` where
            the Hopper kernel cannot run (the message says why).

    Example:
        >>> x, g, b, w = torch.randn(4, 8), torch.ones(8), torch.zeros(8), torch.randn(3, 8)
        >>> y, mean, rstd = layernorm_linear_fwd(x, g, b, w)
    """
    if torch_answers(x, ln_weight, ln_bias, weight, bias):   # as in ln_fwd_bwd.layernorm_fwd
        validate(x, ln_weight, ln_bias, weight, bias)
        as_eps(eps)
        check_algo(algo)
        bias = weight.new_zeros(weight.shape[0]) if bias is None else bias   # not zero_bias's: no fake kept
        return tuple(torch.ops.mojo.layernorm_linear_fwd(x, ln_weight, ln_bias, weight, bias, float(eps), algo))
    bias = zero_bias(weight) if bias is None else bias
    validate(x, ln_weight, ln_bias, weight, bias)
    eps = as_eps(eps)
    if not (ln_checks.valid(x, ln_weight, ln_bias) and valid_linear(x, weight, bias)):
        if (adapted := adapted_fwd(x, ln_weight, ln_bias, weight, bias, eps)) is None:
            pick_algo(algo, x.device, x.dtype, 1, 1)   # a bad algo is named here too
            _, mean, rstd = ln_fwd_bwd.layernorm_fwd(x, ln_weight, ln_bias, eps)
            return empty_result(x, ln_weight, ln_bias, weight, bias, eps), mean, rstd
        x, ln_weight, ln_bias, weight, bias = adapted
    k, n = x.shape[-1], weight.shape[0]
    picked = pick_algo(algo, x.device, x.dtype, x.numel() // k, n, k)
    if picked == "unfused":
        xn, mean, rstd = ln_fwd_bwd.layernorm_fwd(x, ln_weight, ln_bias, eps)
        return linear(xn, weight, bias), mean, rstd
    return _fused_fwd(x, ln_weight, ln_bias, weight, bias, eps, algo, picked)


def _fused_fwd(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor, eps: float, algo: str, picked: str) -> tuple[torch.Tensor, ...]:
    """``layernorm_linear_fwd`` of valid x that ``algo`` sends to "fused" or "sm90" (``picked``): through the C++
    entry where it runs, else the graph route; "sm90" where the Hopper kernel cannot take x runs "unfused" under
    "auto" and is a named error otherwise."""
    k, n = x.shape[-1], weight.shape[0]
    x2 = x.view(-1, k)
    if picked == "sm90" and (why := sm90_unsupported(x2, weight)) is not None:
        if algo != "auto":
            raise ValueError(f"algo: 'sm90' {why}")
        picked = "unfused"   # auto never raises: an x or weight view off 16-byte alignment takes cuBLAS
    if (out := launch.fused_direct(x, ln_weight, ln_bias, weight, bias, eps, algo, picked)) is not None:
        return out
    if picked == "fused":
        y, mean, rstd = launch.fused_fwd(x2, ln_weight, ln_bias, weight, bias, eps)
    elif picked == "sm90":
        y, mean, rstd = launch.sm90_fwd(x2, ln_weight, ln_bias, weight, bias, eps)
    else:
        xn, mean, rstd = ln_fwd_bwd.layernorm_fwd(x2, ln_weight, ln_bias, eps)
        y = linear(xn, weight, bias)
    return y.view(*x.shape[:-1], n), mean.view(x.shape[:-1]), rstd.view(x.shape[:-1])


def layernorm_linear_bwd(dy: torch.Tensor, x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
                         weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, eps: float = 1e-5,
                         xn: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """All five gradients from ``layernorm_linear_fwd``'s statistics (deterministic).

    Args:
        dy: the gradient of y, ``[..., N]``, x's dtype.
        x, ln_weight, ln_bias, weight: the forward's inputs (the backward never reads the Linear's bias).
        mean, rstd: the forward's statistics, float32 ``[...]``.
        eps: the forward's (used to recompute xn).
        xn: LayerNorm(x) ``[..., K]`` if the caller kept it; else it is recomputed.

    Shape:
        dy: ``[..., N]``; dx: ``[..., K]``; dln_weight, dln_bias: ``[K]``; dweight: ``[N, K]``; dbias: ``[N]``.

    Returns:
        (dx, dln_weight, dln_bias, dweight, dbias), each in its input's dtype.

    Raises:
        TypeError, ValueError: as ``layernorm_linear_fwd``, and for a dy or statistics of the wrong dtype or
            shape.

    Example:
        >>> x, g, b, w = torch.randn(4, 8), torch.ones(8), torch.zeros(8), torch.randn(3, 8)
        >>> y, mean, rstd = layernorm_linear_fwd(x, g, b, w)
        >>> dx, dg, db, dw, dbias = layernorm_linear_bwd(torch.ones_like(y), x, g, b, w, mean, rstd)
    """
    validate(x, ln_weight, ln_bias, weight, None)  # the backward never reads bias
    check_tensor("dy", dy, min_ndim=1, dtypes=DTYPES, layout=False)
    check_same({"x": x, "dy": dy})
    if dy.shape != (*x.shape[:-1], weight.shape[0]):
        raise ValueError(f"dy: shape {tuple(dy.shape)} does not match y {(*x.shape[:-1], weight.shape[0])}")
    if xn is not None:
        check_tensor("xn", xn, dtypes=DTYPES, layout=False)
        check_same({"x": x, "xn": xn})
        if xn.shape != x.shape:
            raise ValueError(f"xn: shape {tuple(xn.shape)} does not match x {tuple(x.shape)}")
    if torch_answers(dy, x, ln_weight, ln_bias, weight, mean, rstd, xn):   # as in layernorm_linear_fwd
        if xn is None:
            xn = torch.ops.mojo.layernorm_fwd(x, ln_weight, ln_bias, as_eps(eps), "fast", "none")[0]
        return tuple(torch.ops.mojo.layernorm_linear_bwd(dy, x, xn, ln_weight, ln_bias, weight, mean, rstd))
    if not (ln_checks.valid(x, ln_weight, ln_bias) and valid_linear(x, weight, None) and dy.is_contiguous()
            and mean.is_contiguous() and rstd.is_contiguous() and (xn is None or xn.is_contiguous())):
        return _adapted_bwd(dy, x, ln_weight, ln_bias, weight, mean, rstd, eps, xn)
    k = x.shape[-1]
    x2 = x.view(-1, k)
    if xn is None:
        xn = ln_fwd_bwd.layernorm_fwd(x2, ln_weight, ln_bias, eps)[0]
    dxn, dweight, dbias = linear_grads(dy, xn.view(-1, k), weight)
    dx, dln_weight, dln_bias = ln_fwd_bwd.layernorm_bwd(dxn, x2, ln_weight, ln_bias, mean.view(-1), rstd.view(-1))
    return dx.view(x.shape), dln_weight, dln_bias, dweight, dbias


def _adapted_bwd(dy: torch.Tensor, x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
                 weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, eps: float,
                 xn: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """``layernorm_linear_bwd`` of validated arguments the kernels do not take as they come: empty ones answered
    as torch's autograd answers them (zeros; dbias the sum of dy), the rest adapted as the forward's are; the
    LayerNorm parameters' gradients in their own dtypes."""
    if x.numel() == 0 or weight.numel() == 0:
        return (torch.zeros_like(x), torch.zeros_like(ln_weight), torch.zeros_like(ln_bias), torch.zeros_like(weight),
                dy.sum(tuple(range(dy.dim() - 1))) if dy.dim() > 1 else dy.clone())
    x2, lnw, lnb = ln_checks.adapt(x, ln_weight, ln_bias)
    dx, dlnw, dlnb, dweight, dbias = layernorm_linear_bwd(
        dy.contiguous(), x2, lnw, lnb, weight.contiguous(), mean.contiguous(), rstd.contiguous(), eps,
        None if xn is None else xn.contiguous())
    return dx, dlnw.to(ln_weight.dtype), dlnb.to(ln_bias.dtype), dweight, dbias


@torch.library.custom_op("mojo::layernorm_linear_fwd", mutates_args=())
def _fwd_custom(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor, eps: float, algo: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return layernorm_linear_fwd(x, ln_weight, ln_bias, weight, bias, eps, algo)


@_fwd_custom.register_fake
def _(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, weight: torch.Tensor,
      bias: torch.Tensor, eps: float, algo: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return x.new_empty(*x.shape[:-1], weight.shape[0]), stats, torch.empty_like(stats)


@torch.library.custom_op("mojo::layernorm_linear_bwd", mutates_args=())
def _bwd_custom(dy: torch.Tensor, x: torch.Tensor, xn: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
                weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return layernorm_linear_bwd(dy, x, ln_weight, ln_bias, weight, mean, rstd, xn=xn)


@_bwd_custom.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, xn: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
      weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (torch.empty_like(x), torch.empty_like(ln_weight), torch.empty_like(ln_bias),
            torch.empty_like(weight), weight.new_empty(weight.shape[0]))
