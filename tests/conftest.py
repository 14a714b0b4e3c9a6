"""Shared fixtures: one pytest process shares every compiled model (ops/launch/bridge.py caches them); and the norm
tests' inputs and the Hugging Face RMSNorm forwards they compare with."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from ops.launch import bridge, direct
from ops.layernorm import config as layernorm_config
from ops.rmsnorm import config as rmsnorm_config

HAS_GPU = torch.cuda.is_available()
DEVICES = ["cpu", "cuda"] if HAS_GPU else ["cpu"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: compiles extra packages (edits, virtual GPU)")
    if HAS_GPU and config.getoption("numprocesses", default=None) and not hasattr(config, "workerinput"):
        # xdist's controller on a GPU machine: build the graphs the workers share, all at once
        import warm_graphs

        _warming.extend(warm_graphs.start())


_warming: list = []   # the processes warm_graphs.start() began


def pytest_unconfigure(config: pytest.Config) -> None:
    for proc in _warming:
        proc.kill()
        proc.wait()


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


@pytest.fixture(params=["inductor", "ours"])
def compiled_layernorm(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each choice of who runs the default LayerNorm under torch.compile (layernorm_config.COMPILED_LAYERNORM)."""
    monkeypatch.setattr(layernorm_config, "COMPILED_LAYERNORM", request.param)
    return request.param


@pytest.fixture(params=["inductor", "ours"])
def compiled_rmsnorm(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each choice of who runs RMSNorm under torch.compile (rmsnorm_config.COMPILED_RMSNORM)."""
    monkeypatch.setattr(rmsnorm_config, "COMPILED_RMSNORM", request.param)
    return request.param


def recording_backend() -> tuple[object, list[str]]:
    """A torch.compile backend that runs AOTAutograd's forward and backward graphs as they are (as aot_eager)
    and records each graph's code, so that a test can see which ops a compiled graph calls."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    codes: list[str] = []

    def keep(gm: torch.fx.GraphModule, inputs: list) -> object:
        codes.append(gm.code)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=keep, bw_compiler=keep), codes


def assert_compiled_layernorm(codes: list[str], compiled_layernorm: str) -> None:
    """The forward and backward graphs hold our ops ("ours") or torch's LayerNorm ("inductor"), not the other."""
    assert len(codes) == 2, f"expected a forward and a backward graph, got {len(codes)}"
    for code in codes:
        ours, torchs = "mojo" in code, "native_layer_norm" in code
        assert (ours, torchs) == (compiled_layernorm == "ours", compiled_layernorm == "inductor"), code


def compiled_double(module: torch.nn.Module, x: torch.Tensor, compiled_layernorm: str) -> torch.Tensor:
    """``module(x) * 2`` under ``torch.compile(fullgraph=True)``, its sum backpropagated into x.grad; checks that
    the compiled graphs hold the LayerNorm ``compiled_layernorm`` says. Returns the output."""
    backend, codes = recording_backend()
    y = torch.compile(lambda t: module(t) * 2.0, fullgraph=True, backend=backend)(x)
    y.sum().backward()
    assert_compiled_layernorm(codes, compiled_layernorm)
    return y


@pytest.fixture
def free_pre_grad_pass() -> Iterator[None]:
    """Inductor's pre-grad custom pass emptied for the test and restored after, by its ``config.patch``
    (monkeypatch would delete the entry on undo: a ConfigModule's options are not in its ``__dict__``)."""
    from torch._inductor import config as inductor_config

    with inductor_config.patch(pre_grad_custom_pass=None):
        yield


# ---------------------------------------------------------------- norms' test inputs and reference modules

class LlamaRMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm, as its forward computes (float32 statistics, x * rstd rounded to x's dtype,
    then times the weight)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(input_dtype)


class GemmaRMSNorm(nn.Module):
    """Hugging Face's GemmaRMSNorm, as its forward computes (everything in float32, times 1 + weight, one cast)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


def norm_rows(rows: int, h: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    """Random rows, one with a large mean and one constant row."""
    torch.manual_seed(0)
    x = torch.randn(rows, h)
    x[0] += 100.0
    x[-1] = 3.0
    return x.to(device, dtype)
