"""LayerNorm's autograd: ``LayerNormFunction`` (one launch forward, one backward on its saved statistics) and the
form a torch.compile graph holds (``compiled_layernorm``); and a pre-norm block's add and norm in one pass on a GPU,
for LayerNorm and RMSNorm alike (the kernels' ``act`` code says which): ``add_norm`` returns (y, s), s = x (+ add_bias)
+ residual and y = norm(s), with autograd (``AddNormFunction``), for a call whose tensors the one-pass kernel reads as
they are, or None (the caller adds, then normalizes)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ops.common import create_graph, differentiable_grads, no_grad_to_come
from ops.inputs import DTYPES, PLAIN_TENSORS, check_grad, kernels_cannot_read, torch_answers
from ops.launch import direct
from ops.layernorm import config
from ops.layernorm.checks import ACT_FNS, check_call
from ops.layernorm.config import ACTIVATIONS, K
from ops.layernorm.fwd_bwd import bwd_call, fwd_call, infer_call
from ops.layernorm.launch import (
    add_norm_direct,
    add_norm_plan,
    bwd_direct,
    fwd_direct,
    stat_addresses,
    stat_views,
    stats_buffer,
    vectors_fit,
)


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


# ---------------------------------------------------------------- a pre-norm block's add and norm, in one pass

def _plan(x: torch.Tensor, residual: torch.Tensor, add_bias: torch.Tensor | None, weight: torch.Tensor,
          bias: torch.Tensor, act: int) -> tuple | None:
    """The kernel's plan where it reads these as they are, else None: plain contiguous CUDA tensors of one dtype it
    takes, 16-byte aligned rows, launched directly now, no autocast; x and residual of one shape (checked before),
    the rest [h]; a shape whose norm launch is the register kernel."""
    tensors = (x, residual, weight, bias) if add_bias is None else (x, residual, weight, bias, add_bias)
    h = x.shape[-1] if x.dim() else 0
    if not (x.dtype in DTYPES and direct.launches(x) and x.numel() > 0 and not torch.is_autocast_enabled("cuda")
            and all(t.__class__ in PLAIN_TENSORS and t.dtype is x.dtype and t.device == x.device
                    and t.is_contiguous() for t in tensors)
            and all(t.shape == (h,) for t in tensors[2:]) and vectors_fit(h, x.dtype, *tensors)
            and not torch_answers(*tensors)):
        return None
    return add_norm_plan(x.numel() // h, h, x.dtype, act, add_bias is not None, x.get_device())


def add_norm(x: torch.Tensor, residual: torch.Tensor, add_bias: torch.Tensor | None, weight: torch.Tensor,
             bias: torch.Tensor, eps: float, act: int,
             torch_norm: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(y, s) by the one-pass kernel with autograd, or None for a call it does not take (``_plan``). ``bias``:
    LayerNorm's beta (RMSNorm: its weight again, unused); ``torch_norm``: the same norm of s by torch's ops, which a
    double backward differentiates."""
    plan = _plan(x, residual, add_bias, weight, bias, act)
    if plan is None:
        return None
    return AddNormFunction.apply(x, residual, add_bias, weight, bias, eps, act, plan, torch_norm)


class AddNormFunction(torch.autograd.Function):
    """Autograd for (y, s): the norm's backward on s (from its saved statistics), plus the incoming gradient of s,
    is the gradient of x and of residual (and, summed over rows, of add_bias)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, residual: torch.Tensor,
                add_bias: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float, act: int,
                plan: tuple, torch_norm: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        stats, mean, rstd = stats_buffer(x)
        y, s = add_norm_direct(plan, x, residual, add_bias, weight, bias, eps, mean, rstd)
        ctx.save_for_backward(x, residual, add_bias, weight, bias, s, stats)
        ctx.act, ctx.rms, ctx.torch_norm = act, bool(act & K["NORM_RMS"]), torch_norm
        return y, s

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor | None, ds: torch.Tensor | None) -> tuple:
        x, residual, add_bias, weight, bias, s, stats = ctx.saved_tensors
        dy = torch.zeros_like(s) if dy is None else dy
        if create_graph() or kernels_cannot_read(dy) or kernels_cannot_read(ds):
            # a double backward, or a batched gradient (a vectorized jacobian's): torch's ops, differentiated
            return _differentiable(ctx, x, residual, add_bias, weight, bias, dy, ds)
        dx, dweight, dbias = bwd_direct(dy.contiguous(), s, weight, bias, *stat_addresses(stats), ctx.act)
        if ds is not None:
            dx = dx.add_(ds)
        dadd = dx.reshape(-1, dx.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None
        return dx, dx, dadd, dweight, None if ctx.rms else dbias, None, None, None, None


def _differentiable(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, residual: torch.Tensor,
                    add_bias: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, dy: torch.Tensor,
                    ds: torch.Tensor | None) -> tuple:
    """``AddNormFunction``'s gradients by torch's ops, recomputed from the inputs (under create_graph they carry
    their own graph)."""
    graph = torch.is_grad_enabled()   # create_graph: the gradients keep theirs
    inputs = (x, residual, add_bias, weight, None if ctx.rms else bias)
    wants = [t is not None and w for t, w in zip(inputs, ctx.needs_input_grad[:5], strict=True)]
    with torch.enable_grad():
        s = (x if add_bias is None else x + add_bias) + residual
        outputs, grads = [ctx.torch_norm(s)], [dy]
        if ds is not None:
            outputs.append(s)
            grads.append(ds)
        found = iter(torch.autograd.grad(outputs, [t for t, w in zip(inputs, wants, strict=True) if w], grads,
                                         create_graph=graph, allow_unused=True))
    return (*(next(found) if w else None for w in wants), None, None, None, None)
