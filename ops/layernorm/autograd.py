"""LayerNorm's autograd: ``LayerNormFunction`` (one launch forward, one backward on its saved statistics) and the
form a torch.compile graph holds (``compiled_layernorm``)."""

from __future__ import annotations

import torch

from ops.common import create_graph, differentiable_grads, no_grad_to_come
from ops.inputs import check_grad, kernels_cannot_read
from ops.launch import direct
from ops.layernorm import config
from ops.layernorm.checks import ACT_FNS, check_call
from ops.layernorm.config import ACTIVATIONS
from ops.layernorm.fwd_bwd import bwd_call, fwd_call, infer_call
from ops.layernorm.launch import bwd_direct, fwd_direct, stat_addresses, stat_views, stats_buffer


def compiled_layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                       activation: str = "none") -> torch.Tensor:
    """The default ("fast") act(LayerNorm(x)) of valid inputs as a torch.compile graph holds it
    (``config.COMPILED_LAYERNORM``): torch's ``layer_norm``, which inductor fuses with its neighbours, or our op
    (no statistics kept where no gradient is to come)."""
    if config.COMPILED_LAYERNORM == "inductor":
        return ACT_FNS[activation](torch.nn.functional.layer_norm(x, x.shape[-1:], weight, bias, eps))
    if no_grad_to_come(x, weight, bias):
        return infer_call(x, weight, bias, eps, "fast", activation)
    return LayerNormFunction.apply(x, weight, bias, eps, "fast", activation)


class LayerNormFunction(torch.autograd.Function):
    """Autograd for act(LayerNorm(x)): gradients for x, weight and bias."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor, eps: float, variant: str, activation: str) -> torch.Tensor:
        ctx.activation, ctx.eps = activation, eps
        if not direct.launches(x):
            # torch.compile traces an op (fwd_call); the CPU runs the graph route
            y, mean, rstd = fwd_call(x, weight, bias, eps, variant, activation)
            ctx.save_for_backward(x, weight, bias, mean, rstd)
            return y
        # Eager on a GPU: checks, then one launch; mean and rstd share one buffer the backward reads.
        check_call(x, weight, bias, eps, variant, activation)
        stats, mean, rstd = stats_buffer(x)
        y = fwd_direct(x, weight, bias, float(eps), variant, ACTIVATIONS[activation], mean, rstd)
        ctx.save_for_backward(x, weight, bias, stats)
        return y

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor) -> tuple:
        x, weight, bias, *stats = ctx.saved_tensors
        if create_graph():
            y = ACT_FNS[ctx.activation](torch.nn.functional.layer_norm(x, x.shape[-1:], weight, bias, ctx.eps))
            return (*differentiable_grads(ctx, y, (x, weight, bias), dy), None, None, None)
        dy = dy.contiguous()
        if len(stats) == 2 or kernels_cannot_read(dy):   # a batched dy: the checked entry, which sends it to the op
            mean, rstd = stats if len(stats) == 2 else stat_views(stats[0], x)
            dx, dweight, dbias = bwd_call(dy, x, weight, bias, mean, rstd, ctx.activation)
        else:
            check_grad("dy", dy, x.dtype, x.shape, "x")
            dx, dweight, dbias = bwd_direct(dy, x, weight, bias, *stat_addresses(stats[0]),
                                             ACTIVATIONS[ctx.activation])
        return dx, dweight, dbias, None, None, None
