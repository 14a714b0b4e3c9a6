"""The float64 references every test and benchmark compares against."""

from __future__ import annotations

import torch


def layernorm_ref(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim of x [..., H] in float64 (two-pass statistics)."""
    x64 = x.double()
    mean = x64.mean(dim=-1, keepdim=True)
    var = ((x64 - mean) ** 2).mean(dim=-1, keepdim=True)
    return (x64 - mean) / torch.sqrt(var + eps) * gamma.double() + beta.double()


def layernorm_linear_ref(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor,
                         weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Linear(LayerNorm(x)) in float64: x [..., K], weight [N, K], bias [N] -> [..., N]."""
    return layernorm_ref(x, gamma, beta, eps) @ weight.double().T + bias.double()
