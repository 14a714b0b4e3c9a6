"""Dtype tolerance table and the one comparison used by tests, checks and benchmarks."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# (rtol, atol) for results of O(1) magnitude computed with fp32 accumulation.
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


@dataclass(frozen=True)
class Mismatch:
    """Where and by how much a result differs from its reference."""

    count: int
    total: int
    index: tuple[int, ...]
    expected: float
    got: float
    max_abs_err: float

    def __str__(self) -> str:
        return (f"{self.count}/{self.total} elements differ; first at index {self.index}: "
                f"expected {self.expected:.6g}, got {self.got:.6g} (max abs err {self.max_abs_err:.3g})")


def tolerance(dtype: torch.dtype, reduction: int = 1, cond: float = 1.0) -> tuple[float, float]:
    """(rtol, atol) for ``dtype``, widened by sqrt(reduction) for sums over ``reduction``
    terms and by ``cond``, the condition of the input (for LayerNorm, 1 + |row mean| /
    row std: the input's own rounding, relative to the spread, grows with it)."""
    rtol, atol = TOLERANCE[dtype]
    scale = math.sqrt(max(reduction, 1)) * max(cond, 1.0)
    return rtol * scale, atol * scale


def compare(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, reduction: int = 1,
            cond: float = 1.0) -> Mismatch | None:
    """None when ``got`` matches ``ref`` within the table; NaN or Inf where ref is finite never passes."""
    if got.shape != ref.shape:
        raise ValueError(f"shape {tuple(got.shape)} does not match reference {tuple(ref.shape)}")
    rtol, atol = tolerance(dtype, reduction, cond)
    g, r = got.detach().double().cpu(), ref.detach().double().cpu()
    ok = torch.isclose(g, r, rtol=rtol, atol=atol, equal_nan=False)
    if bool(ok.all()):
        return None
    bad = (~ok).nonzero()
    first = tuple(int(i) for i in bad[0])
    err = (g - r).abs().nan_to_num(nan=math.inf)
    return Mismatch(int(bad.shape[0]), g.numel(), first, float(r[first]), float(g[first]), float(err.max()))


def compare_named(got: Sequence[torch.Tensor], ref: Sequence[torch.Tensor], like: Sequence[torch.Tensor],
                  sums: dict[str, tuple[int, float]], dtype: torch.dtype) -> str | None:
    """The first wrong result of several, as a message naming it; None when all match.

    Args:
        got: the results, in the order of ``sums``.
        ref: their float64 references.
        like: per result, the tensor whose dtype it must have (a gradient: its input's).
        sums: per result name, ``(reduction, cond)`` for :func:`compare`.
        dtype: the dtype whose row of the table applies.
    """
    for (name, (reduction, cond)), g, r, t in zip(sums.items(), got, ref, like, strict=True):
        if g.dtype != t.dtype or g.shape != r.shape:
            return f"{name}: {g.dtype} {tuple(g.shape)}, expected {t.dtype} {tuple(r.shape)}"
        if (bad := compare(g, r, dtype, reduction=reduction, cond=cond)) is not None:
            return f"{name}: {bad}"
    return None
