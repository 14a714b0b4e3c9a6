"""The p22 solution as a torch.library custom op: eager, fake tensors, torch.compile(fullgraph=True)."""

from __future__ import annotations

import pytest
import torch

from ops.puzzle.p22 import layernorm_linear, make_inputs
from ops.reference import layernorm_linear_ref
from ops.tolerance import compare


@pytest.mark.parametrize("fused_path", [True, False])
def test_eager(device: str, fused_path: bool) -> None:
    inputs = make_inputs(2, 3, 37, 9, device=device)
    got = torch.ops.p22.layernorm_linear(*inputs, fused_path=fused_path)
    assert compare(got, layernorm_linear_ref(*inputs), torch.float32, reduction=37) is None


def test_opcheck() -> None:
    torch.library.opcheck(layernorm_linear, make_inputs(2, 3, 8, 5),
                          test_utils=("test_schema", "test_faketensor"))


def test_compile_fullgraph(device: str) -> None:
    inputs = make_inputs(2, 3, 16, 7, device=device)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def block(x, g, b, w, c):
        return torch.relu(layernorm_linear(x, g, b, w, c)) * 2.0

    got = block(*inputs)
    assert compare(got, torch.relu(layernorm_linear_ref(*inputs)) * 2.0, torch.float32, reduction=16) is None
