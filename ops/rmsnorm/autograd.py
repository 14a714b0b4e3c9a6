"""RMSNorm's autograd: ``RMSNormFunction`` (one launch forward, the backward on its saved statistics) for eager calls
on a GPU, and the rule registered on ``torch.ops.mojo.rms_norm_fwd`` itself (its backward is ``rms_norm_bwd``), which
torch.compile's graphs and the CPU differentiate. The casts of Llama's semantics pass the gradient through, as torch's
autograd does."""

from __future__ import annotations

import torch

from ops.common import create_graph, differentiable_grads
from ops.inputs import check_grad, kernels_cannot_read
from ops.launch import direct
from ops.layernorm_linear.launch import linear, linear_grads
from ops.rmsnorm.fwd_bwd import (
    rms_bwd_with_stats,
    rms_fwd_with_stats,
    rms_norm_bwd,
    rms_norm_fwd,
    torch_rms_norm,
)


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


class RMSNormFunction(torch.autograd.Function):
    """Autograd for an eager RMSNorm on a GPU: one launch forward (its statistics in one buffer), one backward."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x2: torch.Tensor, weight: torch.Tensor, eps: float,
                semantics: str) -> torch.Tensor:
        y, stats = rms_fwd_with_stats(x2, weight, eps, semantics)
        ctx.save_for_backward(x2, weight, stats)
        ctx.eps, ctx.semantics = eps, semantics
        return y

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor) -> tuple:
        x2, weight, stats = ctx.saved_tensors
        if create_graph():
            y = torch_rms_norm(x2, x2.shape[-1:], weight, ctx.eps, ctx.semantics)
            return (*differentiable_grads(ctx, y, (x2, weight), dy), None, None)
        dy = dy.contiguous()
        if kernels_cannot_read(dy):   # a batched dy (a vectorized jacobian's): the op, which vmap loops
            dx, dweight = rms_norm_bwd(dy, x2, weight, stats[0], stats[1], ctx.semantics)
        else:
            check_grad("dy", dy, x2.dtype, x2.shape, "x")
            dx, dweight = rms_bwd_with_stats(dy, x2, weight, stats, ctx.semantics)
        return dx, dweight, None, None


def rms_norm_rows(x2: torch.Tensor, weight: torch.Tensor, eps: float, semantics: str) -> torch.Tensor:
    """y = RMSNorm(x2) by ``semantics``, differentiable: x2 [rows, h] contiguous, weight [h] of x2's dtype. Eager on a
    GPU: ``RMSNormFunction``; traced or on the CPU: the op, with its registered autograd."""
    if direct.launches(x2):
        return RMSNormFunction.apply(x2, weight, eps, semantics)
    return rms_norm_fwd(x2, weight, eps, semantics)[0]


class RMSNormLinearFunction(torch.autograd.Function):
    """Autograd for an eager Linear(RMSNorm(x)) on a GPU, one node for the pair: our RMSNorm launched directly (its
    statistics in one buffer), then the Linear by cuBLASLt (the bias in its epilogue); xn is kept for dW, as torch's
    autograd keeps it. Backward: dxn, dW and db by cuBLASLt (db in dW's epilogue), then our RMSNorm backward."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x2: torch.Tensor, norm_weight: torch.Tensor,
                weight: torch.Tensor, bias: torch.Tensor | None, eps: float, semantics: str) -> torch.Tensor:
        xn, stats = rms_fwd_with_stats(x2, norm_weight, eps, semantics)
        ctx.save_for_backward(x2, xn, norm_weight, weight, stats)
        ctx.eps, ctx.semantics, ctx.has_bias = eps, semantics, bias is not None
        return linear(xn, weight, bias)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor) -> tuple:
        x2, xn, norm_weight, weight, stats = ctx.saved_tensors
        bias_grad, weight_grad = ctx.has_bias and ctx.needs_input_grad[3], ctx.needs_input_grad[2]
        if create_graph():   # as in RMSNormFunction; db = dy's column sums
            y = torch.nn.functional.linear(torch_rms_norm(x2, x2.shape[-1:], norm_weight, ctx.eps, ctx.semantics),
                                           weight)
            grads = differentiable_grads(ctx, y, (x2, norm_weight, weight), dy)
            return (*grads, dy.sum(0) if bias_grad else None, None, None)
        dy = dy.contiguous()
        if kernels_cannot_read(dy):   # a batched dy (a vectorized jacobian's): torch's GEMMs, then the op vmap loops
            dxn = dy @ weight
            dweight, dbias = dy.mT @ xn if weight_grad else None, dy.sum(0) if bias_grad else None
            dx, dnorm_weight = rms_norm_bwd(dxn, x2, norm_weight, stats[0], stats[1], ctx.semantics)
        else:
            check_grad("dy", dy, x2.dtype, (x2.shape[0], weight.shape[0]), "y")
            dxn, dweight, dbias = linear_grads(dy, xn, weight, bias_grad, weight_grad)
            dx, dnorm_weight = rms_bwd_with_stats(dxn, x2, norm_weight, stats, ctx.semantics)
        return dx, dnorm_weight, dweight, dbias, None, None
