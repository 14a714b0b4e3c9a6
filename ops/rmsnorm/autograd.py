"""RMSNorm's autograd function: the forward keeps x and its rstd; the backward gives x's and the weight's
gradients (the casts of Llama's semantics pass the gradient through as torch's autograd does)."""

from __future__ import annotations

import torch

from ops.rmsnorm.fwd_bwd import rms_norm_bwd, rms_norm_fwd


class RMSNormFunction(torch.autograd.Function):
    """y = RMSNorm(x2) * weight by ``semantics``, x2 [rows, h] contiguous, weight [h] of x2's dtype."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x2: torch.Tensor, weight: torch.Tensor, eps: float,
                semantics: str) -> torch.Tensor:
        y, mean, rstd = rms_norm_fwd(x2, weight, eps, semantics)
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.semantics = semantics
        return y

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor) -> tuple:
        x2, weight, mean, rstd = ctx.saved_tensors
        dx, dweight = rms_norm_bwd(dy.contiguous(), x2, weight, mean, rstd, ctx.semantics)
        return (dx if ctx.needs_input_grad[0] else None, dweight if ctx.needs_input_grad[1] else None, None, None)
