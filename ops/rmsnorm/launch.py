"""RMSNorm's launches: LayerNorm's (``ops/kernels/layernorm.mojo``) told the norm by their ``act`` code: on a GPU
the direct launch (the kernel LayerNorm's choice picks for the shape, its plan handed to the C++ entries), else the
MAX graph ops (the CPU kernels; a GPU the direct route does not serve)."""

from __future__ import annotations

import torch

from ops.launch import direct
from ops.launch.bridge import GraphOp
from ops.layernorm import config as ln_config
from ops.layernorm.launch import (
    CPU_BWD_LAUNCH,
    CPU_LAUNCH,
    bwd_direct,
    bwd_parts,
    code_bwd_op,
    code_fwd_op,
    fwd_direct,
    fwd_launch,
    sm_count,
    vectors_fit,
)
from ops.rmsnorm.config import SEMANTICS, K

# the C++ entries' double backward computes each semantics as its module does: they learn the codes here
direct.on_native_load(lambda ops: ops.set_rms_codes(K["NORM_RMS"], K["RMS_LLAMA"], K["RMS_GEMMA"]))


def rms_fwd_direct(x: torch.Tensor, weight: torch.Tensor, eps: float, act: int, mean: int = 0,
                   rstd: int = 0) -> torch.Tensor:
    """y like x by one launch on contiguous CUDA x [..., h] and weight [h] of x's dtype; the rows' rstd (and a mean
    of 0) into float32 [rows] buffers at ``rstd`` and ``mean``, or nowhere when ``mean`` is 0."""
    return fwd_direct(x, weight, weight, eps, "fast", act, mean, rstd)   # beta: unused by RMSNorm


def rms_bwd_direct(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: int, rstd: int,
                   act: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) by the backward's two launches, from the statistics at addresses ``mean`` and ``rstd``."""
    dx, dweight, _ = bwd_direct(dy, x, weight, weight, mean, rstd, act)
    return dx, dweight


def fwd_op(x2: torch.Tensor, weight: torch.Tensor, eps: float, semantics: str) -> GraphOp:
    """The forward's graph op for x2 [rows, h] and weight [h]: its inputs x, weight and (unused) beta; outputs y, mean
    (zeros) and rstd."""
    launch = fwd_launch(x2, weight, weight, "fast", SEMANTICS[semantics]) if x2.is_cuda else CPU_LAUNCH
    return code_fwd_op(SEMANTICS[semantics], float(eps), launch)


def bwd_op(dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, semantics: str) -> tuple[GraphOp, int]:
    """The backward's graph op for dy2, x2 [rows, h] and weight [h], and its partial rows (the op's "parts" size)."""
    rows, h = x2.shape
    parts = bwd_parts(rows, h, x2.dtype, x2.device)
    vec_ok = vectors_fit(h, x2.dtype, dy2, x2, weight)
    launch = (ln_config.bwd_launch(parts, h, x2.dtype, vec_ok, sms=sm_count(x2.device))
              if x2.is_cuda else CPU_BWD_LAUNCH)
    return code_bwd_op(SEMANTICS[semantics], launch), ln_config.bwd_sizes(launch, parts)[1]
