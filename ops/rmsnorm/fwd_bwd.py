"""RMSNorm's forward and backward without autograd, as torch ops (``torch.ops.mojo.rms_norm_fwd``, ``rms_norm_bwd``)
with fake implementations, so that torch.compile traces them: rows of x [rows, h], contiguous, and a weight [h] of x's
dtype. On a GPU they launch directly (``launch``: and hand the shape's plan to the C++ entries), else through MAX."""

from __future__ import annotations

import torch

from ops.common import empty
from ops.launch import direct
from ops.layernorm.launch import stat_addresses, stats_buffer
from ops.rmsnorm.config import SEMANTICS
from ops.rmsnorm.launch import bwd_op, fwd_op, rms_bwd_direct, rms_fwd_direct


@torch.library.custom_op("mojo::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x2: torch.Tensor, weight: torch.Tensor, eps: float,
                 semantics: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y [rows, h] and the statistics the backward takes: mean (zeros) and rstd [rows], float32."""
    if direct.launches(x2):   # two buffers: an op's outputs may not share memory
        mean, rstd = (empty(x2.shape[:1], torch.float32, x2.device) for _ in range(2))
        y = rms_fwd_direct(x2, weight, eps, SEMANTICS[semantics], mean.data_ptr(), rstd.data_ptr())
        return y, mean, rstd
    y, mean, rstd = fwd_op(x2, weight, eps, semantics)(x2, weight, weight)   # the op's beta: unused by RMSNorm
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
    if direct.launches(x2):
        mean, rstd = mean.contiguous(), rstd.contiguous()
        return rms_bwd_direct(dy2, x2, weight, mean.data_ptr(), rstd.data_ptr(), SEMANTICS[semantics])
    op, parts = bwd_op(dy2, x2, weight, semantics)
    dx, dweight, _, _, _ = op(dy2, x2, weight, weight, mean, rstd, sizes={"parts": parts})
    return dx, dweight


@rms_norm_bwd.register_fake
def _(dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
      semantics: str) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x2), torch.empty_like(weight)


def rms_fwd_with_stats(x2: torch.Tensor, weight: torch.Tensor, eps: float,
                       semantics: str) -> tuple[torch.Tensor, torch.Tensor]:
    """y and one float32 [2, rows] buffer of the statistics (mean zeros, then rstd) by a direct launch: the eager
    autograd forward's, with no op dispatch."""
    stats, mean, rstd = stats_buffer(x2)
    return rms_fwd_direct(x2, weight, eps, SEMANTICS[semantics], mean, rstd), stats


def rms_bwd_with_stats(dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, stats: torch.Tensor,
                       semantics: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_fwd_with_stats``'s backward: (dx, dweight) by the direct launches."""
    return rms_bwd_direct(dy2, x2, weight, *stat_addresses(stats), SEMANTICS[semantics])


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
