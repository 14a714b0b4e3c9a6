"""The C++ entries on any machine (no GPU needed): loaded with the ops' tuning handed over, declining what they do not
take, never read while torch.compile traces, and their plan tables cleared with Python's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ops.launch import direct, plans
from ops.layernorm import config as config
from ops.layernorm_linear import config as lnl_config

ROOT = Path(__file__).resolve().parent.parent


class _Recorder:
    """Stands in for torch.ops.mojo_direct: records each setter's call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def __getattr__(self, name: str) -> object:
        return lambda value: self.calls.append((name, value))


def test_on_native_load_runs_at_loading_or_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hook given before the C++ entries load runs when they do; one given after, at once."""
    monkeypatch.setattr(direct, "_on_load", [])
    monkeypatch.setattr(direct.NATIVE, "ops", None)
    seen: list[object] = []
    direct.on_native_load(seen.append)
    assert seen == [] and direct._on_load == [seen.append]
    fake = _Recorder()
    monkeypatch.setattr(direct.NATIVE, "ops", fake)
    direct.on_native_load(seen.append)
    assert seen == [fake]


def test_layernorm_linear_hands_its_tuning_to_the_cpp_side() -> None:
    """ops.layernorm_linear registers its tuning of the C++ GEMMs when imported (checked in a fresh interpreter,
    before anything loads the C++ entries), with its config's values."""
    from ops import layernorm_linear as LL

    code = ("from ops import layernorm_linear as LL; from ops.launch import direct;"
            "print(direct.NATIVE.ops is None and LL.launch.configure_native in direct._on_load)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "True", out.stdout + out.stderr
    fake = _Recorder()
    LL.launch.configure_native(fake)
    assert fake.calls == [("set_gemm_tuning", lnl_config.LT_NO_WORKSPACE_MAX_K_PER_N),
                          ("set_capture_overlap", lnl_config.CAPTURED_WEIGHT_GRADS_BESIDE),
                          ("set_accumulate_beside", lnl_config.CAPTURED_GRADS_ACCUMULATED_BESIDE_MAX_ROWS)]


def test_native_builds_loads_and_declines_what_it_does_not_take() -> None:
    """The C++ library builds against the installed torch (CI has a compiler) and loads; its entries return None
    (the Python route runs) for CPU tensors, and its plan tables fill and clear."""
    native = direct.load_native()
    assert native.ops is not None, "the C++ launcher did not build (see the warning)"
    x, w, b = torch.randn(4, 8), torch.ones(8), torch.zeros(8)
    assert native.layernorm(x, w, b, 1e-5, 0) is None
    assert native.layernorm_linear(x, w, b, torch.randn(3, 8), None, 1e-5, 0) is None
    assert native.layernorm_linear_act(x, w, b, torch.randn(3, 8), None, 1e-5, 2) is None
    assert native.layernorm_bwd_with_plan(torch.ones(4, 8), x, w, b, torch.zeros(4), torch.ones(4), 0) == []
    native.ops.clear_plans()
    native.ops.set_fwd_plan(4, 8, torch.bfloat16, True, 0, 0, 1, [1, 1, 1], 32, 1)
    native.ops.set_linear_algo(4, 8, 3, torch.bfloat16, 0, 0, False, False, True)
    native.ops.set_fused_plan(4, 8, 3, torch.bfloat16, 0, 0, 31, lnl_config.KIND_FUSED16, [1, 2], [1, 1, 1, 2, 1, 1],
                              [256, 128], [0, 1024], [1, 64, 4096, 128, 1], None, torch.zeros(3))
    with pytest.raises(RuntimeError, match="inconsistent"):
        native.ops.set_fused_plan(4, 8, 3, torch.bfloat16, 0, 0, 31, 1, [1, 2], [1, 1, 1], [256], [0], [], None,
                                  torch.zeros(3))
    assert native.ops.plan_counts() == [1, 0, 1, 1]
    native.ops.clear_plans()
    assert native.ops.plan_counts() == [0, 0, 0, 0]


class _NoReads:
    """A stand-in for ``direct.NATIVE`` that fails any read of an entry."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"NATIVE.{name} read while torch.compile traces")


def test_no_native_entry_read_while_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """While dynamo traces, the public entries do not read the C++ entries: dynamo guards on what a traced frame
    reads, and on torch 2.11 a guard on a builtin function fails the compile (AssertionError 'Unexpected type'),
    which broke torch.compile of a model with our modules on the H100."""
    from ops import layernorm as L
    from ops import layernorm_linear as LL

    monkeypatch.setattr(direct, "NATIVE", _NoReads())
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    x, w, b = torch.randn(4, 8), torch.ones(8), torch.zeros(8)
    with torch.no_grad():
        assert torch.allclose(L.layernorm_fwd(x, w, b)[0], torch.nn.functional.layer_norm(x, (8,), w, b), atol=1e-5)
        assert L.layernorm(x, w, b).shape == (4, 8)
        assert LL.layernorm_linear(x, w, b, torch.randn(3, 8)).shape == (4, 3)
        assert LL.layernorm_linear_act(x, w, b, torch.randn(3, 8), activation="relu").shape == (4, 3)


def test_native_plans_cleared_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """``remember`` hands each plan over once, and at PLANS_MAX clears Python's record and the C++ tables
    together (a plan Python believes handed over is never missing there)."""
    native = direct.load_native().ops
    plans.forget_plans()
    monkeypatch.setattr(plans, "PLANS_MAX", 2)
    calls = []

    def register(rows: int) -> object:
        return lambda ops: (calls.append(rows), ops.set_fwd_plan(rows, 8, torch.float32, True, 0, 0, 1, [1, 1, 1],
                                                                 32, 1))
    for rows in (1, 2, 1, 2):
        plans.remember(("ln_fwd", rows), register(rows))
    assert calls == [1, 2] and native.plan_counts()[0] == 2
    plans.remember(("ln_fwd", 3), register(3))   # the third: both sides cleared, then 3 kept
    assert native.plan_counts()[0] == 1 and plans._native_keys == {("ln_fwd", 3)}
    plans.forget_plans()
