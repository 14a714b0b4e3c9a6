"""RMSNorm's launches: the LayerNorm ops of ``ops/kernels/layernorm.mojo`` told the norm by their ``act`` code, with
the loop kernel on a GPU (the one that takes RMSNorm) and the CPU kernels otherwise."""

from __future__ import annotations

import torch

from ops.launch.bridge import GraphOp
from ops.layernorm import config as ln_config
from ops.layernorm.launch import CPU_BWD_LAUNCH, CPU_LAUNCH, bwd_parts, code_bwd_op, code_fwd_op, sm_count
from ops.rmsnorm.config import SEMANTICS


def fwd_op(x2: torch.Tensor, eps: float, semantics: str) -> GraphOp:
    """The forward's graph op for x2 [rows, h]: its inputs x, weight and (unused) beta; outputs y, mean (zeros) and
    rstd."""
    rows, h = x2.shape
    launch = (ln_config.fwd_launch(rows, h, x2.dtype, False, sms=sm_count(x2.device)) if x2.is_cuda
              else CPU_LAUNCH)   # vec_ok False: the loop kernel
    return code_fwd_op(SEMANTICS[semantics], float(eps), launch)


def bwd_op(x2: torch.Tensor, semantics: str) -> tuple[GraphOp, int]:
    """The backward's graph op for x2 [rows, h] and its partial rows (the op's "parts" size)."""
    rows, h = x2.shape
    parts = bwd_parts(rows, h, x2.dtype, x2.device)
    launch = ln_config.bwd_launch(parts, h, x2.dtype, False, sms=sm_count(x2.device)) if x2.is_cuda else CPU_BWD_LAUNCH
    return code_bwd_op(SEMANTICS[semantics], launch), ln_config.bwd_sizes(launch, parts)[1]
