"""Helpers the LayerNorm + Linear tests share: inputs, the float64 checks of a forward and its gradients."""

from __future__ import annotations

import torch

from ops import layernorm_linear as LL
from ops.reference import layernorm_linear_ref, layernorm_stats_ref
from ops.tolerance import compare


def make(lead: tuple[int, ...], k: int, n: int, dtype: torch.dtype, device: str,
         mean: float = 0.0) -> tuple[torch.Tensor, ...]:
    """Fresh random x (rows shifted by ``mean``), ln_weight, ln_bias, weight (scaled by 1/sqrt(K)), bias, dy."""
    g = torch.Generator().manual_seed(torch.seed())
    f64 = {"generator": g, "dtype": torch.float64}
    ts = (torch.randn(*lead, k, **f64) + mean, 1.0 + 0.2 * torch.randn(k, **f64), 0.2 * torch.randn(k, **f64),
          torch.randn(n, k, **f64) / k ** 0.5, 0.2 * torch.randn(n, **f64), torch.randn(*lead, n, **f64))
    return tuple(t.to(device=device, dtype=dtype) for t in ts)


def check_forward(x: torch.Tensor, g: torch.Tensor, b: torch.Tensor, w: torch.Tensor, bias: torch.Tensor,
                  algo: str, cond: float = 1.0) -> None:
    y, mean, rstd = LL.layernorm_linear_fwd(x, g, b, w, bias, algo=algo)
    k = x.shape[-1]
    where = f"algo {algo}, {x.dtype}, x {tuple(x.shape)}, weight {tuple(w.shape)}"
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w.shape[0]), where
    bad = compare(y, layernorm_linear_ref(x, g, b, w, bias), x.dtype, reduction=k, cond=cond)
    assert bad is None, f"y, {where}: {bad}"
    mean_ref, rstd_ref = layernorm_stats_ref(x)
    assert (bad := compare(mean, mean_ref, torch.float32, k, cond)) is None, f"mean, {where}: {bad}"
    assert (bad := compare(rstd / rstd_ref, torch.ones_like(rstd_ref), torch.float32, k, cond)) is None, \
        f"rstd, {where}: {bad}"
