"""Helpers the route, CUDA-graph and compile tests share."""

from __future__ import annotations

import torch


def small_model(dtype: torch.dtype) -> torch.nn.Module:
    from ops.layernorm import LayerNorm
    from ops.layernorm_linear import FusedLayerNormLinear

    torch.manual_seed(0)
    return torch.nn.Sequential(FusedLayerNormLinear(96, 192), torch.nn.GELU(), FusedLayerNormLinear(192, 96),
                               LayerNorm(96)).to("cuda", dtype)
