"""RMSNorm's forward and backward on our kernels (``launch``), as torch ops (``torch.ops.mojo.rms_norm_fwd``,
``rms_norm_bwd``) with fake implementations, so that torch.compile traces them: rows of x [rows, h], contiguous, and
a weight [h] of x's dtype."""

from __future__ import annotations

import torch

from ops.rmsnorm.launch import bwd_op, fwd_op


@torch.library.custom_op("mojo::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x2: torch.Tensor, weight: torch.Tensor, eps: float,
                 semantics: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y [rows, h] and the statistics the backward takes: mean (zeros) and rstd [rows], float32."""
    y, mean, rstd = fwd_op(x2, eps, semantics)(x2, weight, weight)   # the op's beta: unused by RMSNorm
    return y, mean, rstd


@rms_norm_fwd.register_fake
def _(x2: torch.Tensor, weight: torch.Tensor, eps: float,
      semantics: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    stats = x2.new_empty(x2.shape[:1], dtype=torch.float32)
    return torch.empty_like(x2), stats, torch.empty_like(stats)


@torch.library.custom_op("mojo::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                 semantics: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [rows, h], dweight [h]) from the forward's statistics (deterministic: no float atomics)."""
    op, parts = bwd_op(x2, semantics)
    dx, dweight, _, _, _ = op(dy2, x2, weight, weight, mean, rstd, sizes={"parts": parts})
    return dx, dweight


@rms_norm_bwd.register_fake
def _(dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
      semantics: str) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x2), torch.empty_like(weight)


def torch_rms_norm(x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor | None, eps: float,
                   semantics: str) -> torch.Tensor:
    """The same RMSNorm by torch's ops, computed as the semantics' own modules compute it."""
    if semantics == "torch":
        return torch.nn.functional.rms_norm(x, shape, weight, eps)
    dims = tuple(range(-len(shape), 0))
    xf = x.float()
    xhat = xf * torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + eps)
    if semantics == "gemma":
        out = xhat if weight is None else xhat * (1.0 + weight.float())
        return out.type_as(x)
    xhat = xhat.to(x.dtype)
    return xhat if weight is None else weight * xhat
