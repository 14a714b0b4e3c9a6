"""Shared fixtures: one pytest process shares every compiled model (ops/bridge.py caches them)."""

from __future__ import annotations

import pytest
import torch

from ops import bridge, direct

HAS_GPU = torch.cuda.is_available()
DEVICES = ["cpu", "cuda"] if HAS_GPU else ["cpu"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: compiles extra packages (edits, virtual GPU)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every output starts as NaN in tests, so an unwritten element always fails."""
    monkeypatch.setattr(bridge, "poison_outputs", True)
    direct.set_poison(True)   # the C++ entries' own switch (set again at their loading from bridge's)


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param
