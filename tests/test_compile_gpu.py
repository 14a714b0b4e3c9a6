"""torch.compile on the GPU (GPU tests): full graphs, and the compiled code calling our C++ ops, the GEMM with GELU in
its epilogue, and torch's own program where that is the faster one."""

from __future__ import annotations

import pytest
import torch
from route_helpers import small_model

from ops.launch import direct, plans
from ops.layernorm import config as config
from ops.layernorm_linear import config as lnl_config


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_gpu_compile_fullgraph(mode: str, compiled_layernorm: str) -> None:
    """``torch.compile(fullgraph=True)`` of a model with our modules (no graph break: the device queries are
    constants to dynamo; the LayerNorms inductor's or our C++ ops, as COMPILED_LAYERNORM says), forward and
    backward as in eager."""
    model = small_model(torch.bfloat16)
    x = torch.randn(2, 32, 96, device="cuda", dtype=torch.bfloat16)
    eager_x = x.clone().requires_grad_()
    want_y = model(eager_x)
    want_y.float().pow(2).mean().backward()
    want = (want_y, eager_x.grad, *(p.grad for p in model.parameters()))
    torch._dynamo.reset()   # one process runs many compiled tests: their recompiles must not add up to the limit
    compiled = torch.compile(model, fullgraph=True, mode=mode)
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        cx = x.clone().requires_grad_()
        y = compiled(cx)
        y.float().pow(2).mean().backward()
    got = (y, cx.grad, *(p.grad for p in model.parameters()))
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2, msg=f"output {i}")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), want_y.detach(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "algo", "with_bias"), [(torch.bfloat16, "sm90", True),
                                                          (torch.float32, "fused", False)])
def test_gpu_compiled_inference_calls_the_cpp_op(dtype: torch.dtype, algo: str, with_bias: bool) -> None:
    """Inference of the fused and Hopper forwards under torch.compile: the graph calls the C++ op
    ``mojo_direct.layernorm_linear_infer`` (no Python per call), which gives eager's y bitwise, also on the
    call before Python has handed it a plan (its fallback through the torch.library op)."""
    from torch._inductor.utils import run_and_get_code

    from ops.layernorm_linear import layernorm_linear

    torch.manual_seed(0)
    x = torch.randn(4, 256, 768, device="cuda", dtype=dtype)
    lnw, lnb = torch.randn(768, device="cuda", dtype=dtype), torch.randn(768, device="cuda", dtype=dtype)
    w = torch.randn(512, 768, device="cuda", dtype=dtype) / 28
    bias = torch.randn(512, device="cuda", dtype=dtype) if with_bias else None
    direct.load_native()
    plans.forget_plans()
    torch._dynamo.reset()
    fn = torch.compile(lambda x: layernorm_linear(x, lnw, lnb, w, bias, 1e-5, algo), fullgraph=True)
    with torch.no_grad():
        first, codes = run_and_get_code(fn, x)
        again = fn(x)
        want = layernorm_linear(x, lnw, lnb, w, bias, 1e-5, algo)
    assert any("mojo_direct.layernorm_linear_infer" in code for code in codes)
    assert torch.equal(first, want) and torch.equal(again, want)


def _unfused_case(with_bias: bool) -> tuple[torch.Tensor | None, ...]:
    """The compiled unfused tests' inputs, bf16 on the GPU, seeded: x [3, 37, 768] (mean 1, spread 3), the
    LayerNorm's weight and bias near 1 and 0, the Linear's weight [1000, 768] and bias [1000] (or None)."""
    torch.manual_seed(0)
    k, n = 768, 1000
    x = torch.randn(3, 37, k, device="cuda", dtype=torch.bfloat16) * 3 + 1
    lnw = 1 + 0.2 * torch.randn(k, device="cuda", dtype=torch.bfloat16)
    lnb = 0.2 * torch.randn(k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 28
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if with_bias else None
    return x, lnw, lnb, w, bias


@pytest.mark.gpu
@pytest.mark.parametrize("with_bias", [True, False])
def test_gpu_compiled_unfused_training_calls_the_cpp_linear(with_bias: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Unfused training under torch.compile (COMPILED_TRAINING_LINEAR "ours"): the forward's GEMM is the C++
    ``mojo_direct.traced_linear`` and the backward's the C++ ``linear_grads`` (no mm or addmm of torch's), and y
    and all five gradients are the float64 reference's within bf16's tolerance, on the second call too; with
    "inductor" the graph holds torch's GEMMs."""
    from torch._inductor.utils import run_and_get_code

    from ops.layernorm_linear import layernorm_linear
    from ops.reference import layernorm_linear_grads_ref, layernorm_linear_ref, layernorm_stats_ref
    from ops.tolerance import compare

    x, lnw, lnb, w, bias = _unfused_case(with_bias)
    k, n = w.shape[1], w.shape[0]
    dy = torch.randn(3, 37, n, device="cuda", dtype=torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (x, lnw, lnb, w, bias) if t is not None]
    direct.load_native()
    ref_bias = bias if with_bias else torch.zeros(n, device="cuda", dtype=torch.bfloat16)
    want_y = layernorm_linear_ref(*(t.double() for t in (x, lnw, lnb, w, ref_bias)))
    want = layernorm_linear_grads_ref(x, lnw, lnb, w, ref_bias, dy)[:len(leaves)]
    reductions = (n * k, 111 * n, 111 * n, 111, 111)
    cond = float(layernorm_stats_ref(x)[1].max())

    for choice in ("ours", "inductor"):
        monkeypatch.setattr(lnl_config, "COMPILED_TRAINING_LINEAR", choice)
        torch._dynamo.reset()
        fwd = torch.compile(lambda *t: layernorm_linear(*t[:4], t[4] if with_bias else None, 1e-5, "unfused"),
                            fullgraph=True)

        def step(fwd: object) -> torch.Tensor:
            for t in leaves:
                t.grad = None
            y = fwd(*leaves)
            y.backward(dy)
            return y

        for call in range(2):
            if call == 0:
                y, codes = run_and_get_code(step, fwd)
            else:
                y = step(fwd)
            assert (bad := compare(y, want_y, torch.bfloat16, reduction=k)) is None, f"{choice} y: {bad}"
            for i, (leaf, r, red) in enumerate(zip(leaves, want, reductions[:len(leaves)], strict=True)):
                assert (bad := compare(leaf.grad, r, torch.bfloat16, reduction=red,
                                       cond=cond if i == 0 else 1.0)) is None, f"{choice} call {call} grad {i}: {bad}"
        code = "\n".join(codes)
        ours = "mojo_direct.traced_linear" in code and "mojo_direct.linear_grads" in code
        assert ours == (choice == "ours"), choice
        assert ("extern_kernels.mm" in code or "extern_kernels.addmm" in code) == (choice == "inductor"), choice


@pytest.mark.gpu
def test_gpu_compiled_unfused_inference_calls_the_cpp_linear() -> None:
    """Unfused inference under torch.compile: the graph's GEMM is the C++ op ``mojo_direct.linear`` (the eager
    route's cuBLASLt plan), not torch's addmm, and y is eager's within bf16 rounding (the LayerNorm is
    inductor's); on the second call too."""
    from torch._inductor.utils import run_and_get_code

    from ops.layernorm_linear import layernorm_linear

    x, lnw, lnb, w, bias = _unfused_case(with_bias=True)
    direct.load_native()
    torch._dynamo.reset()
    fn = torch.compile(lambda x: layernorm_linear(x, lnw, lnb, w, bias, 1e-5, "unfused"), fullgraph=True)
    with torch.no_grad():
        first, codes = run_and_get_code(fn, x)
        again = fn(x)
        want = layernorm_linear(x, lnw, lnb, w, bias, 1e-5, "unfused")
    assert any("mojo_direct.linear.default" in code for code in codes)
    assert not any("addmm" in code for code in codes)
    torch.testing.assert_close(first, want, rtol=2e-2, atol=2e-2)
    assert torch.equal(again, first)


@pytest.mark.gpu
@pytest.mark.parametrize("with_bias", [True, False])
def test_gpu_compiled_inference_puts_tanh_gelu_in_the_gemm(with_bias: bool, monkeypatch: pytest.MonkeyPatch,
                                                           free_pre_grad_pass: None) -> None:
    """Compiled inference of ``gelu(FusedLayerNormLinear-like call, approximate="tanh")``: the graph calls
    ``mojo_direct.linear_gelu`` (GELU in the GEMM's epilogue, ops/layernorm_linear/inductor.py) and no separate
    Linear, and matches the float64 reference on both calls; the erf GELU, and the tanh one with
    COMPILED_LINEAR_GELU off, keep ``mojo_direct.linear`` and inductor's GELU."""
    from torch._inductor.utils import run_and_get_code

    from ops.layernorm_linear import layernorm_linear
    from ops.reference import activation_ref, layernorm_linear_ref
    from ops.tolerance import compare

    x, lnw, lnb, w, bias = _unfused_case(with_bias)
    n, k = w.shape
    ref_bias = bias if with_bias else torch.zeros(n, device="cuda", dtype=torch.bfloat16)
    direct.load_native()
    for approximate, switch, fused in (("tanh", True, True), ("none", True, False), ("tanh", False, False)):
        monkeypatch.setattr(lnl_config, "COMPILED_LINEAR_GELU", switch)
        torch._dynamo.reset()
        fn = torch.compile(lambda x, a=approximate: torch.nn.functional.gelu(
            layernorm_linear(x, lnw, lnb, w, bias, 1e-5, "unfused"), approximate=a), fullgraph=True)
        want = activation_ref(layernorm_linear_ref(*(t.double() for t in (x, lnw, lnb, w, ref_bias))),
                        "gelu_tanh" if approximate == "tanh" else "gelu")
        with torch.no_grad():
            y, codes = run_and_get_code(fn, x)
            again = fn(x)
        code = "\n".join(codes)
        case = f"{approximate}, switch {switch}"
        assert ("mojo_direct.linear_gelu.default" in code) == fused, case
        assert ("mojo_direct.linear.default" in code) == (not fused), case
        for got in (y, again):
            assert (bad := compare(got, want, torch.bfloat16, reduction=k)) is None, f"{case}: {bad}"


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ["auto", "sm90"])
def test_gpu_compiled_inference_gelu_after_the_hopper_forward(algo: str, free_pre_grad_pass: None) -> None:
    """GPT-2-small's 8x512 MLP input (bf16, 768 -> 3072), where auto picks the Hopper forward: compiled inference of
    ``gelu(.., approximate="tanh")`` after it holds inductor's LayerNorm and ``linear_gelu`` instead with "auto",
    and keeps the Hopper forward with "sm90" asked for by name; both match the float64 reference."""
    from torch._inductor.utils import run_and_get_code

    from ops.layernorm_linear import layernorm_linear
    from ops.layernorm_linear.algo import pick_algo
    from ops.reference import activation_ref, layernorm_linear_ref
    from ops.tolerance import compare

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper forward needs an sm_90 GPU")
    torch.manual_seed(0)
    k, n = 768, 3072
    x = torch.randn(8, 512, k, device="cuda", dtype=torch.bfloat16) * 3 + 1
    lnw, lnb = (1 + 0.2 * torch.randn(k, device="cuda")).bfloat16(), (0.2 * torch.randn(k, device="cuda")).bfloat16()
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 28
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    assert pick_algo("auto", x.device, x.dtype, 4096, n, k) == "sm90"
    direct.load_native()
    torch._dynamo.reset()
    fn = torch.compile(lambda x: torch.nn.functional.gelu(layernorm_linear(x, lnw, lnb, w, bias, 1e-5, algo),
                                                         approximate="tanh"), fullgraph=True)
    with torch.no_grad():
        y, codes = run_and_get_code(fn, x)
    code = "\n".join(codes)
    assert ("mojo_direct.linear_gelu.default" in code) == (algo == "auto"), algo
    assert ("mojo_direct.layernorm_linear_infer" in code) == (algo == "sm90"), algo
    want = activation_ref(layernorm_linear_ref(*(t.double() for t in (x, lnw, lnb, w, bias))), "gelu_tanh")
    assert (bad := compare(y, want, torch.bfloat16, reduction=k)) is None, f"{algo}: {bad}"


def _compiled_unfused_training(with_bias: bool, gelu: bool) -> str:
    """Compile the unfused LayerNorm+Linear (of ``_unfused_case``; with ``gelu``, the tanh GELU after it), run two
    training calls, and check y and every gradient against float64 autograd on both; returns inductor's code."""
    from torch._inductor.utils import run_and_get_code

    from ops.layernorm_linear import layernorm_linear
    from ops.reference import activation_ref, layernorm_linear_ref, layernorm_stats_ref
    from ops.tolerance import compare

    x, lnw, lnb, w, bias = _unfused_case(with_bias)
    n, k = w.shape
    dy = torch.randn(3, 37, n, device="cuda", dtype=torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (x, lnw, lnb, w, bias) if t is not None]
    refs = [t.detach().double().requires_grad_() for t in leaves]
    want_y = layernorm_linear_ref(*refs[:4], refs[4] if with_bias else torch.zeros(n, device="cuda",
                                                                                  dtype=torch.float64))
    want_y = activation_ref(want_y, "gelu_tanh") if gelu else want_y
    want = torch.autograd.grad(want_y, refs, dy.double())
    reductions = (n * k, 111 * n, 111 * n, 111, 111)
    cond = float(layernorm_stats_ref(x)[1].max())
    direct.load_native()
    torch._dynamo.reset()

    def model(*t: torch.Tensor) -> torch.Tensor:
        y = layernorm_linear(*t[:4], t[4] if with_bias else None, 1e-5, "unfused")
        return torch.nn.functional.gelu(y, approximate="tanh") if gelu else y
    fwd = torch.compile(model, fullgraph=True)

    def step() -> torch.Tensor:
        for t in leaves:
            t.grad = None
        y = fwd(*leaves)
        y.backward(dy)
        return y

    y, codes = run_and_get_code(step)
    for call in range(2):
        y = step() if call else y
        assert (bad := compare(y, want_y, torch.bfloat16, reduction=k)) is None, f"call {call} y: {bad}"
        for i, (leaf, r, red) in enumerate(zip(leaves, want, reductions, strict=False)):
            bad = compare(leaf.grad, r, torch.bfloat16, reduction=red, cond=cond if i == 0 else 1.0)
            assert bad is None, f"call {call} grad {i}: {bad}"
    return "\n".join(codes)


@pytest.mark.gpu
@pytest.mark.parametrize("min_rows", [0, 4096])
@pytest.mark.parametrize("with_bias", [True, False])
def test_gpu_compiled_training_puts_tanh_gelu_in_the_gemm(with_bias: bool, min_rows: int,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          free_pre_grad_pass: None) -> None:
    """Compiled training of ``gelu(unfused LayerNorm+Linear, approximate="tanh")``: the forward graph calls
    ``linear_gelu_aux`` (GELU's output and input from one GEMM) and the backward ``linear_gelu_grads``, or with a
    bias and fewer rows (111) than COMPILED_GELU_BIAS_GRAD_IN_GEMM_MIN_ROWS ``linear_grads`` (db by inductor), with no
    torch GEMM for that Linear; y and every gradient match float64 autograd, on both calls."""
    monkeypatch.setattr(lnl_config, "COMPILED_GELU_BIAS_GRAD_IN_GEMM_MIN_ROWS", min_rows)
    monkeypatch.setattr(lnl_config, "COMPILED_TRAINING_LAYERNORM_LINEAR", "inductor")
    code = _compiled_unfused_training(with_bias, gelu=True)
    in_gemm = not with_bias or min_rows == 0
    assert "mojo_direct.linear_gelu_aux" in code and ("mojo_direct.linear_gelu_grads" in code) == in_gemm
    assert ("mojo_direct.linear_grads" in code) == (not in_gemm)
    assert "extern_kernels.mm" not in code and "extern_kernels.addmm" not in code


@pytest.mark.gpu
@pytest.mark.parametrize("knob", ["ours", "auto"])
@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("with_bias", [True, False])
def test_gpu_compiled_training_one_op_layernorm_linear(with_bias: bool, gelu: bool, knob: str,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       free_pre_grad_pass: None) -> None:
    """With COMPILED_TRAINING_LAYERNORM_LINEAR "ours", or "auto" at COMPILED_TRAINING_LAYERNORM_LINEAR_MIN_ROWS rows
    (here lowered to the case's 111), compiled training of the unfused LayerNorm+Linear (and of the tanh GELU after
    it) calls one op each way, ``layernorm_linear_train_fwd`` and ``layernorm_linear_grads`` (the GELU inside them: no
    triton kernel of it), with no torch GEMM and no inductor LayerNorm; y and every gradient match float64 autograd,
    on both calls."""
    import re

    monkeypatch.setattr(lnl_config, "COMPILED_TRAINING_LAYERNORM_LINEAR", knob)
    monkeypatch.setattr(lnl_config, "COMPILED_TRAINING_LAYERNORM_LINEAR_MIN_ROWS", 111)
    code = _compiled_unfused_training(with_bias, gelu)
    assert "mojo_direct.layernorm_linear_train_fwd" in code and "mojo_direct.layernorm_linear_grads" in code
    assert "extern_kernels.mm" not in code and "extern_kernels.addmm" not in code
    assert not re.search(r"triton_\w*(gelu|layer_norm)", code), re.findall(r"triton_\w+", code)


@pytest.mark.gpu
@pytest.mark.parametrize("with_bias", [True, False])
def test_gpu_compiled_training_below_the_one_op_rows_is_torchs_program(with_bias: bool,
                                                                       free_pre_grad_pass: None) -> None:
    """With the default "auto" and fewer rows (111) than COMPILED_TRAINING_LAYERNORM_LINEAR_MIN_ROWS, compiled
    training of the unfused LayerNorm+Linear and the tanh GELU after it is torch's program: no op of ours, torch's
    GEMMs; y and every gradient match float64 autograd, on both calls."""
    assert lnl_config.COMPILED_TRAINING_LAYERNORM_LINEAR == "auto"
    assert lnl_config.COMPILED_TRAINING_LAYERNORM_LINEAR_MIN_ROWS > 111
    code = _compiled_unfused_training(with_bias, gelu=True)
    assert "mojo_direct" not in code and "extern_kernels.mm" in code
