"""CUDA graphs (GPU tests): our calls captured and replayed, forward and backward, on side streams, with the weight
gradients and their accumulation beside the chain."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from route_helpers import small_model

from ops.bench.timing import captured
from ops.layernorm import config as config
from ops.layernorm_linear import config as lnl_config


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ["fused", "sm90"])
def test_gpu_cuda_graph_fused_inference(algo: str) -> None:
    """A captured inference forward of the fused or Hopper op (C++ entry) replays right on new input."""
    from ops import layernorm_linear as LL

    if algo == "sm90" and not LL.algo.is_sm90(torch.device("cuda")):
        pytest.skip("needs an sm_90 GPU")
    torch.manual_seed(0)
    m = LL.FusedLayerNormLinear(2048, 64, algo=algo).to("cuda", torch.bfloat16)
    x = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        graph, y = captured(lambda: m(x), warmup=2)
        x.copy_(torch.randn_like(x) * 4 + 1)
        graph.replay()
        assert torch.equal(y, m(x))


@pytest.mark.gpu
def test_gpu_cuda_graph_auto_fill_region_runs_unfused() -> None:
    """Below SM90_MIN_ROWS, where eager auto runs "sm90", a captured auto runs "unfused" (sm90_region): the
    replay on new input gives the unfused route's y bitwise, and eager calls after the capture still run sm90."""
    from ops import layernorm_linear as LL

    cuda, bf16, rows, k, n = torch.device("cuda"), torch.bfloat16, LL.config.SM90_FILL_ROWS, 768, 3072
    if not LL.algo.is_sm90(cuda) or LL.algo.pick_algo("auto", cuda, bf16, rows, n, k) != "sm90":
        pytest.skip("needs an sm_90 GPU whose grid this shape fills")
    torch.manual_seed(0)
    m = LL.FusedLayerNormLinear(k, n).to(cuda, bf16)
    torch.nn.init.normal_(m[0].weight, 1.0, 0.2)
    x = torch.randn(rows, k, device=cuda, dtype=bf16)
    ln, lin = m[0], m[1]
    with torch.no_grad():
        graph, y = captured(lambda: m(x), warmup=2)
        x.copy_(torch.randn_like(x) * 4 + 1)
        graph.replay()
        unfused = LL.layernorm_linear(x, ln.weight, ln.bias, lin.weight, lin.bias, ln.eps, "unfused")
        sm90 = LL.layernorm_linear(x, ln.weight, ln.bias, lin.weight, lin.bias, ln.eps, "sm90")
        assert not torch.equal(unfused, sm90)   # the two routes round differently: the check below can fail
        assert torch.equal(y, unfused)
        assert torch.equal(m(x), sm90)


def _outputs_and_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """y, then the gradients of sum(y) that its backward left on x and the model's parameters."""
    y.float().sum().backward()
    return (y.detach().clone(), x.grad.clone(), *(p.grad.clone() for p in model.parameters()))


def _eager_reference(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The model's output and gradients on x's values, eager on the current stream."""
    model.zero_grad(set_to_none=True)
    x2 = x.detach().clone().requires_grad_()
    return _outputs_and_grads(model, x2, model(x2))


@pytest.mark.gpu
def test_gpu_cuda_graph_forward_and_backward() -> None:
    """``torch.cuda.graph`` captures a forward and backward through our modules; replayed on new input it gives
    what eager gives on that input."""
    model = small_model(torch.bfloat16)
    x = torch.randn(64, 96, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    def step() -> torch.Tensor:
        y = model(x)
        y.float().sum().backward()
        return y

    def clear_grads() -> None:
        model.zero_grad(set_to_none=True)
        x.grad = None
    # warm-up: plans made, the C++ entries take the calls
    graph, y = captured(step, before_capture=clear_grads)
    new = torch.randn_like(x)
    with torch.no_grad():
        x.copy_(new)
    graph.replay()
    got = (y.clone(), x.grad.clone(), *(p.grad.clone() for p in model.parameters()))
    for i, (a, b) in enumerate(zip(got, _eager_reference(model, new), strict=True)):
        assert torch.equal(a, b), f"output {i}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_side_stream_runs_after_its_producer(dtype: torch.dtype) -> None:
    """Under ``torch.cuda.stream(s)`` our calls, forward and backward, run on s after what was queued there before
    them: x is written on s behind a sleep of some milliseconds (the default stream does not wait), then the model
    runs on s; a launch on another stream would read x's poison. The results equal eager's on the default stream
    (float32: the Python route's launches; bf16: the C++ route and cuBLASLt)."""
    model = small_model(dtype)
    src = torch.randn(256, 96, device="cuda", dtype=dtype)
    want = _eager_reference(model, src)
    model.zero_grad(set_to_none=True)
    x = torch.full_like(src, float("nan")).requires_grad_()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)
        with torch.no_grad():
            x.copy_(src)
        got = _outputs_and_grads(model, x, model(x))
    torch.cuda.current_stream().wait_stream(s)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"output {i}"


@pytest.mark.gpu
def test_gpu_make_graphed_callables() -> None:
    """``torch.cuda.make_graphed_callables`` of a model of ours (its forward and backward graphs captured
    separately): replayed on new inputs, the outputs and gradients are eager's."""
    model = small_model(torch.bfloat16)
    x = torch.randn(64, 96, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = torch.cuda.make_graphed_callables(model, (x,))
    for _ in range(2):
        new = torch.randn_like(x).requires_grad_()
        model.zero_grad(set_to_none=True)
        got = _outputs_and_grads(model, new, graphed(new))
        for i, (a, b) in enumerate(zip(got, _eager_reference(model, new), strict=True)):
            assert torch.equal(a, b), f"output {i}"


def _eager_train_step(module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x's and module's gradients of sum(module(x)) in eager, from the second call (the first makes the plans; the
    second runs the C++ entry, as a captured graph does)."""
    for _ in range(2):
        module.zero_grad(set_to_none=True)
        x.grad = None
        module(x).float().sum().backward()
    return tuple(t.grad.clone() for t in (x, *module.parameters()))


def _captured_train_step(module: torch.nn.Module, x: torch.Tensor, dot: Path) -> tuple[torch.Tensor, ...]:
    """x's and module's gradients of sum(module(x)) from a captured forward and backward (``captured``: warm-up on a
    side stream first) replayed on x's values now, with the graph written to ``dot`` (cudaGraphDebugDotPrint)."""
    new = x.detach().clone()

    def step() -> None:
        module.zero_grad(set_to_none=False)
        x.grad = None
        module(x).float().sum().backward()
    graph, _ = captured(step, warmup=2, keep_graph=True)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
        graph.replay()
        x.copy_(new)
        graph.replay()
    graph.debug_dump(str(dot))
    return tuple(t.grad.clone() for t in (x, *module.parameters()))


def _forks(dot: Path) -> int:
    """How many nodes of a graph's DOT dump have more than one successor."""
    import collections
    import re

    edges = re.findall(r'^\s*"?(\w+)"?\s*->\s*"?(\w+)"?', dot.read_text(), re.M)
    assert edges, "no edges in the dump"
    return sum(1 for n in collections.Counter(a for a, _ in edges).values() if n > 1)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, k, n", [(128, 768, 2304), (4096, 768, 3072)])
def test_gpu_cuda_graph_backward_runs_weight_grads_beside(rows: int, k: int, n: int, tmp_path: Path) -> None:
    """Under capture, the unfused backward (C++ entry) forks dW and db onto a side stream: the captured graph has a
    fork with CAPTURED_WEIGHT_GRADS_BESIDE and none without, and both graphs give eager's gradients bitwise."""
    from ops.layernorm_linear import FusedLayerNormLinear

    torch.manual_seed(0)
    m = FusedLayerNormLinear(k, n).to("cuda", torch.bfloat16)
    torch.nn.init.normal_(m[0].weight, 1.0, 0.2)
    torch.nn.init.normal_(m[0].bias, 0.0, 0.2)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    want = _eager_train_step(m, x)
    assert lnl_config.CAPTURED_WEIGHT_GRADS_BESIDE
    got = {}
    torch.ops.mojo_direct.set_accumulate_beside(0)   # only this fork in the graph
    try:
        for beside in (True, False):
            torch.ops.mojo_direct.set_capture_overlap(beside)
            got[beside] = _captured_train_step(m, x, tmp_path / f"{beside}.dot")
    finally:
        torch.ops.mojo_direct.set_capture_overlap(lnl_config.CAPTURED_WEIGHT_GRADS_BESIDE)
        torch.ops.mojo_direct.set_accumulate_beside(lnl_config.CAPTURED_GRADS_ACCUMULATED_BESIDE_MAX_ROWS)
    assert _forks(tmp_path / "True.dot") >= 1
    assert _forks(tmp_path / "False.dot") == 0
    for beside, grads in got.items():
        for i, (a, b) in enumerate(zip(grads, want, strict=True)):
            assert torch.equal(a, b), f"beside={beside}: gradient {i}"


def _module_768(kind: str) -> torch.nn.Module:
    """A seeded bf16 CUDA module of ours over 768 features: FusedLayerNormLinear(768, 2304) or LayerNorm(768)."""
    from ops.layernorm import LayerNorm
    from ops.layernorm_linear import FusedLayerNormLinear

    torch.manual_seed(0)
    m = FusedLayerNormLinear(768, 2304) if kind == "layernorm_linear" else LayerNorm(768)
    return m.to("cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("module_kind", ["layernorm_linear", "layernorm"])
def test_gpu_cuda_graph_accumulates_param_grads_beside(module_kind: str, tmp_path: Path) -> None:
    """Under capture, a forward of at most CAPTURED_GRADS_ACCUMULATED_BESIDE_MAX_ROWS rows makes its parameters'
    AccumulateGrad nodes on streams of their own: the graph forks more than with the limit at 0, both give eager's
    gradients bitwise, and torch's stream-mismatch warning is off while the captured backward accumulates and on
    again after it."""
    rows = 128
    assert rows <= lnl_config.CAPTURED_GRADS_ACCUMULATED_BESIDE_MAX_ROWS
    m = _module_768(module_kind)
    x = torch.randn(rows, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    want = _eager_train_step(m, x)
    warn_on = torch._C._warn_on_accumulate_grad_stream_mismatch
    assert warn_on()
    seen: list[bool] = []   # the warning's switch as each parameter's gradient is accumulated
    hooks = [p.register_post_accumulate_grad_hook(lambda _: seen.append(warn_on())) for p in m.parameters()]
    got = {}
    torch.ops.mojo_direct.set_capture_overlap(False)   # only the accumulators' forks in the graph
    try:
        for max_rows in (lnl_config.CAPTURED_GRADS_ACCUMULATED_BESIDE_MAX_ROWS, 0):
            torch.ops.mojo_direct.set_accumulate_beside(max_rows)
            seen.clear()
            got[max_rows] = _captured_train_step(m, x, tmp_path / f"{max_rows}.dot")
            assert warn_on()
            # the captured step's accumulations (after the warm-up's) ran with the warning off only when beside
            assert seen[-len(hooks):] == [max_rows == 0] * len(hooks)
    finally:
        torch.ops.mojo_direct.set_capture_overlap(lnl_config.CAPTURED_WEIGHT_GRADS_BESIDE)
        torch.ops.mojo_direct.set_accumulate_beside(lnl_config.CAPTURED_GRADS_ACCUMULATED_BESIDE_MAX_ROWS)
        for h in hooks:
            h.remove()
    assert _forks(tmp_path / "0.dot") == 0
    assert _forks(tmp_path / f"{lnl_config.CAPTURED_GRADS_ACCUMULATED_BESIDE_MAX_ROWS}.dot") >= 1
    for max_rows, grads in got.items():
        for i, (a, b) in enumerate(zip(grads, want, strict=True)):
            assert torch.equal(a, b), f"limit {max_rows}: gradient {i}"


@pytest.mark.gpu
@pytest.mark.parametrize("module_kind", ["layernorm_linear", "layernorm"])
@pytest.mark.parametrize("held", [False, True])
def test_gpu_cuda_graph_autograd_grad_with_accumulators_beside(module_kind: str, held: bool) -> None:
    """torch.autograd.grad of a captured forward whose parameters' AccumulateGrad nodes were made beside (the
    LayerNorm's column sums then left on their stream) gives eager's gradients bitwise, as does a capture whose
    parameters' nodes were held from before (as DDP holds them, made on a stream of its own: they keep it)."""
    m = _module_768(module_kind)
    params = tuple(m.parameters())
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn_like(p), alpha=0.2)
    x = torch.randn(128, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(128, m(x).shape[-1], device="cuda", dtype=torch.bfloat16)

    def grads() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(m(x), (x, *params), dy)
    for _ in range(2):   # the first call makes the plans
        before = [t.clone() for t in grads()]
    with torch.cuda.stream(torch.cuda.Stream()):   # held nodes run on the stream current when they were made
        nodes = [p.view_as(p).grad_fn.next_functions[0][0] for p in params] if held else []   # noqa: F841
    graph, out = captured(grads, warmup=2)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    x_now = x.detach().clone().requires_grad_()
    want = torch.autograd.grad(m(x_now), (x_now, *params), dy)
    for i, (a, b) in enumerate(zip(out, want, strict=True)):
        assert torch.equal(a, b), f"gradient {i}"
    assert not torch.equal(before[0], want[0])   # the replay read the new x
