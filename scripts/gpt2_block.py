"""GPT-2-small's blocks (no embeddings, no head) as the transformer benchmarks time them: the torch model, ours with
our drop-ins swapped in (same weights), and one inference call or training step in each mode (eager, CUDA graph,
torch.compile). Shared by ``bench_transformer.py``, ``profile_host.py`` and ``probe_captured_gemms.py``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from ops.layernorm import LayerNorm  # noqa: E402
from ops.layernorm_linear import FusedLayerNormLinear  # noqa: E402

D, HEADS, BLOCKS = 768, 12, 12
CONTROL_IMPL = "torch_again"   # --control: a second copy of torch's model; its vs_torch is an A/A ratio


class Block(nn.Module):
    """Pre-LN GPT-2 block: x + proj(attn(ln_1 + qkv)), then x + fc2(gelu(ln_2 + fc1))."""

    def __init__(self) -> None:
        super().__init__()
        self.ln_qkv = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 3 * D))
        self.proj = nn.Linear(D, D)
        self.ln_fc1 = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 4 * D))
        self.fc2 = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.ln_qkv(x).view(b, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, D))
        return x + self.fc2(F.gelu(self.ln_fc1(x), approximate="tanh"))


class GPT(nn.Module):
    """BLOCKS blocks and a final LayerNorm over hidden states [B, T, D] (no embeddings, no head)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.ln_f = nn.LayerNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)


def ours_from(model: GPT) -> GPT:
    """A copy of ``model`` with our drop-ins in place of its LayerNorms (same weights)."""
    import copy

    m = copy.deepcopy(model)
    for block in m.blocks:
        block.ln_qkv = FusedLayerNormLinear.from_torch(block.ln_qkv)
        block.ln_fc1 = FusedLayerNormLinear.from_torch(block.ln_fc1)
    m.ln_f = LayerNorm.from_torch(m.ln_f)
    return m


def reference(b: int, t: int) -> tuple[GPT, torch.Tensor]:
    """The seeded torch model (bf16, CUDA) whose weights every contender copies, and its input [b, t, D]."""
    torch.manual_seed(0)
    return GPT().cuda().bfloat16(), torch.randn(b, t, D, device="cuda", dtype=torch.bfloat16)


def contender(ref: GPT, impl: str) -> GPT:
    """A fresh model with ``ref``'s weights: torch's modules for "torch" and CONTROL_IMPL, our drop-ins
    (``ours_from``) otherwise."""
    model = GPT().cuda().bfloat16()
    model.load_state_dict(ref.state_dict())
    return model if impl in ("torch", CONTROL_IMPL) else ours_from(model)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def infer_call(model: nn.Module, x: torch.Tensor, mode: str) -> Callable[[], object]:
    """One forward under no_grad as ``mode`` runs it."""
    if mode == "compile":
        compiled = torch.compile(model)
        def fwd() -> object:
            with torch.no_grad():
                return compiled(x)
        return fwd
    if mode == "cuda_graph":
        from ops.bench.timing import captured  # here: compare_trees.py imports this file in trees without it
        with torch.no_grad():
            return captured(lambda: model(x))[0].replay
    def eager() -> object:
        with torch.no_grad():
            return model(x)
    return eager


def train_call(model: nn.Module, x: torch.Tensor, mode: str) -> Callable[[], object]:
    """One training step (forward, mean-square loss, backward, AdamW) as ``mode`` runs it."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=mode == "cuda_graph", foreach=True)
    fwd = torch.compile(model) if mode == "compile" else model

    def step() -> torch.Tensor:
        loss = fwd(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=mode != "cuda_graph")
        return loss
    if mode != "cuda_graph":
        return step
    from ops.bench.timing import captured
    return captured(step)[0].replay
