"""The float64 references every test and benchmark compares against."""

from __future__ import annotations

import torch


def layernorm_ref(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim of x [..., H] in float64 (two-pass statistics)."""
    mean, rstd = layernorm_stats_ref(x, eps)
    return (x.double() - mean.unsqueeze(-1)) * rstd.unsqueeze(-1) * gamma.double() + beta.double()


def layernorm_linear_ref(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor,
                         weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Linear(LayerNorm(x)) in float64: x [..., K], weight [N, K], bias [N] -> [..., N]."""
    return layernorm_ref(x, gamma, beta, eps) @ weight.double().T + bias.double()


def layernorm_linear_act_ref(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor, eps: float = 1e-5, activation: str = "gelu") -> torch.Tensor:
    """activation(Linear(LayerNorm(x))) in float64 (``layernorm_linear_act``'s)."""
    return activation_ref(layernorm_linear_ref(x, gamma, beta, weight, bias, eps), activation)


def activation_ref(z: torch.Tensor, activation: str) -> torch.Tensor:
    """The activation by name ("none", "gelu" erf form, "gelu_tanh", "relu") in z's dtype."""
    if activation == "none":
        return z
    if activation == "relu":
        return torch.relu(z)
    return torch.nn.functional.gelu(z, approximate="tanh" if activation == "gelu_tanh" else "none")


def layernorm_act_ref(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float = 1e-5,
                      activation: str = "none") -> torch.Tensor:
    """act(LayerNorm(x)) in float64, x [..., H]."""
    return activation_ref(layernorm_ref(x, gamma, beta, eps), activation)


def layernorm_stats_ref(x: torch.Tensor, eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """Row mean and rstd of x [..., H] in float64 (two-pass)."""
    x64 = x.double()
    mean = x64.mean(dim=-1)
    var = ((x64 - mean.unsqueeze(-1)) ** 2).mean(dim=-1)
    return mean, 1.0 / torch.sqrt(var + eps)


def layernorm_grads_ref(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, dy: torch.Tensor,
                        eps: float = 1e-5, activation: str = "none") -> tuple[torch.Tensor, ...]:
    """(dx, dgamma, dbeta) of act(LayerNorm(x)) for upstream dy, by float64 autograd."""
    x64, g64, b64 = (t.detach().double().requires_grad_() for t in (x, gamma, beta))
    y = layernorm_act_ref(x64, g64, b64, eps, activation)
    return torch.autograd.grad(y, (x64, g64, b64), dy.double())


def layernorm_linear_grads_ref(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor, dy: torch.Tensor, eps: float = 1e-5) -> tuple[torch.Tensor, ...]:
    """(dx, dgamma, dbeta, dweight, dbias) of Linear(LayerNorm(x)) for upstream dy, by float64 autograd."""
    leaves = [t.detach().double().requires_grad_() for t in (x, gamma, beta, weight, bias)]
    y = layernorm_linear_ref(*leaves, eps=eps)
    return torch.autograd.grad(y, leaves, dy.double())


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float, semantics: str = "torch",
                dims: int = 1) -> torch.Tensor:
    """RMSNorm over x's last ``dims`` dims in float64: x / sqrt(mean(x^2) + eps) times the weight (torch's and
    Llama's) or 1 + weight (Gemma's); the semantics differ only in where their modules round, which float64 does
    not."""
    x64 = x.double()
    axes = tuple(range(-dims, 0))
    y = x64 * torch.rsqrt(x64.pow(2).mean(axes, keepdim=True) + eps)
    if weight is None:
        return y
    return y * (1.0 + weight.double()) if semantics == "gemma" else y * weight.double()


def rmsnorm_grads_ref(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, eps: float,
                      semantics: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) of ``rmsnorm_ref`` over the last dim for upstream dy, by float64 autograd."""
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, weight))
    return torch.autograd.grad(rmsnorm_ref(x64, w64, eps, semantics), (x64, w64), dy.double())


def rmsnorm_linear_ref(x: torch.Tensor, norm_weight: torch.Tensor | None, weight: torch.Tensor,
                       bias: torch.Tensor | None, eps: float, semantics: str = "torch") -> torch.Tensor:
    """Linear(RMSNorm(x)) in float64: x [..., K], norm_weight [K], weight [N, K], bias [N] or None -> [..., N]."""
    y = rmsnorm_ref(x, norm_weight, eps, semantics) @ weight.double().T
    return y if bias is None else y + bias.double()


def rmsnorm_linear_grads_ref(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                             dy: torch.Tensor, eps: float, semantics: str = "torch") -> tuple[torch.Tensor, ...]:
    """(dx, dnorm_weight, dweight, dbias) of ``rmsnorm_linear_ref`` for upstream dy, by float64 autograd."""
    leaves = [t.detach().double().requires_grad_() for t in (x, norm_weight, weight, bias)]
    return torch.autograd.grad(rmsnorm_linear_ref(*leaves, eps, semantics), leaves, dy.double())
