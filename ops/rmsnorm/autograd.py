"""RMSNorm's autograd: ``torch.ops.mojo.rms_norm_fwd``'s backward is ``rms_norm_bwd`` (x's and the weight's
gradients; the casts of Llama's semantics pass the gradient through as torch's autograd does). Registered on the op
itself, so eager calls and torch.compile's graphs differentiate alike."""

from __future__ import annotations

import torch

from ops.common import create_graph, differentiable_grads
from ops.rmsnorm.fwd_bwd import rms_norm_bwd, rms_norm_fwd, torch_rms_norm


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    x2, weight, eps, semantics = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x2, weight, mean, rstd)
    ctx.eps, ctx.semantics = eps, semantics


def _backward(ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor, dmean: object, drstd: object) -> tuple:
    x2, weight, mean, rstd = ctx.saved_tensors
    if create_graph():   # a double backward: gradients that carry their own graph, by torch's ops
        y = torch_rms_norm(x2, x2.shape[-1:], weight, ctx.eps, ctx.semantics)
        return (*differentiable_grads(ctx, y, (x2, weight), dy), None, None)
    dx, dweight = rms_norm_bwd(dy.contiguous(), x2, weight, mean, rstd, ctx.semantics)
    return dx, dweight, None, None


rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


def rms_norm_rows(x2: torch.Tensor, weight: torch.Tensor, eps: float, semantics: str) -> torch.Tensor:
    """y = RMSNorm(x2) by ``semantics``, differentiable: x2 [rows, h] contiguous, weight [h] of x2's dtype."""
    return rms_norm_fwd(x2, weight, eps, semantics)[0]
