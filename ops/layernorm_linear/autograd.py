"""LayerNorm+Linear's autograd: ``LayerNormLinearFunction``, whose eager GPU forward launches our LayerNorm and
cuBLAS directly and whose backward runs on the saved statistics."""

from __future__ import annotations

import torch

from ops.common import (
    create_graph,
    differentiable_grads,
)
from ops.inputs import (
    as_eps,
    check_grad,
    kernels_cannot_read,
)
from ops.launch import direct
from ops.layernorm import fwd_bwd as ln_fwd_bwd
from ops.layernorm import launch as ln_launch
from ops.layernorm_linear.algo import pick_algo
from ops.layernorm_linear.checks import validate
from ops.layernorm_linear.fwd_bwd import layernorm_linear_bwd, layernorm_linear_fwd
from ops.layernorm_linear.launch import linear, linear_grads, zero_bias


class LayerNormLinearFunction(torch.autograd.Function):
    """Autograd for Linear(LayerNorm(x)): gradients for x, ln_weight, ln_bias, weight and bias."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, ln_weight: torch.Tensor,
                ln_bias: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                algo: str) -> torch.Tensor:
        xn = None
        ctx.has_bias = bias is not None
        rows = x.numel() // max(x.shape[-1], 1)
        picked = pick_algo(algo, x.device, x.dtype, rows, weight.shape[0], x.shape[-1])
        ctx.eps = eps
        compiling = torch.compiler.is_compiling()
        if picked == "unfused" and direct.launches(x):
            # Eager on a GPU: our LayerNorm launched directly (its statistics in one buffer), then cuBLAS;
            # xn is kept for dW as torch's own autograd keeps it.
            validate(x, ln_weight, ln_bias, weight, bias)
            as_eps(eps)
            stats, mean, rstd = ln_launch.stats_buffer(x)
            xn = ln_launch.fwd_direct(x, ln_weight, ln_bias, float(eps), "fast", 0, mean, rstd)
            ctx.save_for_backward(x, xn, ln_weight, ln_bias, weight, stats)
            return linear(xn, weight, bias)
        # Otherwise the validated calls (torch.compile: the custom ops standing in for them).
        if picked == "unfused":
            validate(x, ln_weight, ln_bias, weight, bias)
            xn, mean, rstd = ln_fwd_bwd.fwd_call(x, ln_weight, ln_bias, eps)
            y = linear(xn, weight, bias)
        else:
            # algo itself, so that auto's own fallbacks (layernorm_linear_fwd) still apply
            fwd = torch.ops.mojo.layernorm_linear_fwd if compiling else layernorm_linear_fwd
            y, mean, rstd = fwd(x, ln_weight, ln_bias, weight, zero_bias(weight) if bias is None else bias, eps, algo)
        ctx.save_for_backward(x, xn, ln_weight, ln_bias, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor) -> tuple:
        x, xn, ln_weight, ln_bias, weight, *stats = ctx.saved_tensors
        if create_graph():   # as in ln_autograd.LayerNormFunction; dbias = dy's column sums
            y = torch.nn.functional.linear(torch.nn.functional.layer_norm(x, x.shape[-1:], ln_weight, ln_bias,
                                                                          ctx.eps), weight)
            grads = differentiable_grads(ctx, y, (x, ln_weight, ln_bias, weight), dy)
            dbias = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[4] else None
            return (*grads, dbias, None, None)
        dy = dy.contiguous()
        if len(stats) == 1:   # the eager GPU forward's one statistics buffer
            if not kernels_cannot_read(dy):
                return (*bwd_direct(dy, x, xn, ln_weight, ln_bias, weight, stats[0], *_linear_wants(ctx)),
                        None, None)
            stats = ln_launch.stat_views(stats[0], x)   # a batched dy: the checked entry, as below
        mean, rstd = stats
        if xn is None:
            xn = ln_fwd_bwd.fwd_call(x, ln_weight, ln_bias, ctx.eps)[0]
        if torch.compiler.is_compiling():
            # the backward as torch ops (cuBLAS GEMMs inductor sees) and our LayerNorm backward's op
            dxn, dweight, dbias = linear_grads(dy, xn, weight, *_linear_wants(ctx))
            grads = (*ln_fwd_bwd.bwd_call(dxn, x, ln_weight, ln_bias, mean, rstd), dweight, dbias)
        else:
            grads = layernorm_linear_bwd(dy, x, ln_weight, ln_bias, weight, mean, rstd, xn=xn)
        return (*grads[:4], grads[4] if ctx.has_bias else None, None, None)


def _linear_wants(ctx: torch.autograd.function.FunctionCtx) -> tuple[bool, bool]:
    """(bias_grad, weight_grad) for ``linear_grads`` in LayerNormLinearFunction's backward: the bias' gradient where
    there is a bias that wants one, the weight's where it wants one (a frozen weight: no dW GEMM)."""
    return ctx.has_bias and ctx.needs_input_grad[4], ctx.needs_input_grad[3]


def bwd_direct(dy: torch.Tensor, x: torch.Tensor, xn: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
                weight: torch.Tensor, stats: torch.Tensor, bias_grad: bool,
                weight_grad: bool) -> tuple[torch.Tensor | None, ...]:
    """The backward of the eager GPU forward: the Linear's gradients (``linear_grads``; db only with
    ``bias_grad``, dW only with ``weight_grad``), then our LayerNorm backward launched directly on the saved
    statistics."""
    check_grad("dy", dy, x.dtype, (*x.shape[:-1], weight.shape[0]), "y")
    dxn, dweight, dbias = linear_grads(dy, xn, weight, bias_grad, weight_grad)
    dx, dln_weight, dln_bias = ln_launch.bwd_direct(dxn, x, ln_weight, ln_bias, *ln_launch.stat_addresses(stats), 0)
    return dx, dln_weight, dln_bias, dweight, dbias
