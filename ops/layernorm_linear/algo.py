"""LayerNorm+Linear's algorithm: which forward algorithm ``auto`` runs for a shape (``pick_algo``), with a gradient
to come or not (``autograd_algo``), and the C++ entry told the same choice (``remember_algo``)."""

from __future__ import annotations

from functools import cache

import torch

from ops.launch import plans
from ops.layernorm import launch as ln_launch
from ops.layernorm_linear import config
from ops.layernorm_linear.config import ALGO_IDS, ALGOS, sm90_region


@cache
def _sm90_index(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


@torch.compiler.assume_constant_result
def _sm90_traceable(index: int) -> bool:
    """``_sm90_index`` as a constant to torch.compile (its device query would break the graph)."""
    return _sm90_index(index)


@torch.compiler.assume_constant_result
def _sms_traceable(index: int) -> int:
    """The SM count of CUDA device ``index``, a constant to torch.compile."""
    return ln_launch.sm_count(torch.device("cuda", index))


def capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph (never while torch.compile traces: the
    compiled graph keeps the eager choice)."""
    return (not torch.compiler.is_compiling() and torch.cuda.is_available()
            and torch.cuda.is_current_stream_capturing())


def is_sm90(device: torch.device) -> bool:
    """Whether ``device`` is an sm_90 (Hopper) GPU (asked once per device)."""
    return device.type == "cuda" and torch.cuda.is_available() and _sm90_traceable(device.index or 0)


def sm90_unsupported(x2: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why the Hopper kernel cannot take x2 [rows, K] and weight [N, K], or None when it can."""
    if not is_sm90(x2.device):
        return "needs an sm_90 (Hopper) GPU"
    if x2.dtype != torch.bfloat16:
        return f"needs bfloat16, got {x2.dtype}"
    k, n = x2.shape[1], weight.shape[0]
    if k % 8 or n % 8:
        return f"needs K and N multiples of 8 (TMA rows of 16-byte multiples), got K={k}, N={n}"
    if x2.data_ptr() % 16:
        return "needs x 16-byte aligned"
    if weight.data_ptr() % 16:
        return "needs weight 16-byte aligned"
    return None


def algos_for(x2: torch.Tensor, weight: torch.Tensor) -> tuple[str, ...]:
    """The forward algorithms that take x2 [rows, K] and weight [N, K] ("sm90" only where it can)."""
    return tuple(a for a in ALGOS if a != "sm90" or sm90_unsupported(x2, weight) is None)


def pick_algo(algo: str, device: torch.device, dtype: torch.dtype, rows: int, n: int, k: int = 0,
              captured: bool | None = None) -> str:
    """The forward algorithm ``auto`` resolves to (see the module docstring), under CUDA graph capture
    (``config.sm90_region``) where ``captured`` says so (None: whether the current stream is being captured)."""
    check_algo(algo)
    if algo != "auto":
        return algo
    if device.type != "cuda":
        return "unfused"
    if captured is None:
        captured = capturing()
    if dtype == torch.bfloat16 and is_sm90(device) and sm90_region(rows, n, k, _sms_traceable(device.index or 0),
                                                                    captured):
        return "sm90"
    return "fused" if config.fused_region(dtype, rows, n, k) else "unfused"


def check_algo(algo: str) -> None:
    """``algo`` must be one of ``ALGOS``."""
    if algo not in ALGOS:
        raise ValueError(f"algo: {algo!r} is not one of {list(ALGOS)}")


def autograd_algo(algo: str, tensors: tuple[object, ...]) -> str:
    """The algo the autograd forward runs on x = ``tensors[0]``: ``config.training_algo`` where a gradient will
    be taken, else ``algo`` (auto then picks as in inference)."""
    x = tensors[0]
    if (isinstance(x, torch.Tensor) and torch.is_grad_enabled()
            and any(getattr(t, "requires_grad", False) for t in tensors)):
        return config.training_algo(algo, x.dtype)
    return algo


def remember_algo(x: torch.Tensor, weight: torch.Tensor, algo: str, grad: bool, runs: str) -> None:
    """Tell the C++ entry whether ``algo`` on this shape (with or without a gradient to come), running ``runs``,
    resolves to "unfused", the one it runs (ops/launch/direct.py: remember), under graph capture and outside it
    alike: so a captured call after eager ones takes the C++ entry, as an eager call after captured ones does."""
    k, n = x.shape[-1], weight.shape[0]
    rows, dtype, index, code = x.numel() // k, x.dtype, x.get_device(), ALGO_IDS.get(algo, -1)
    device = x.device
    for captured in (False, True):
        plans.remember(("linear", rows, k, n, dtype, index, code, grad, captured),
                        lambda native, c=captured: native.set_linear_algo(
                            rows, k, n, dtype, index, code, grad, c,
                            pick_algo(runs, device, dtype, rows, n, k, c) == "unfused"))
