"""RMSNorm (ops/rmsnorm): values and gradients against the float64 reference for each semantics (torch's, Hugging
Face Llama's, Gemma's) and dtype, odd and power-of-two sizes, rows with a large mean and constant rows; outputs
within one ulp of the module each semantics stands for; the module's drop-in contract (parameters shared, state
dict, eps=None); named errors. On the CPU (MAX's CPU kernels) and, where there is one, the GPU (each kernel, and the
C++ entry)."""

from __future__ import annotations

import pytest
import torch
from conftest import GemmaRMSNorm, LlamaRMSNorm, norm_rows, recording_backend
from torch import nn

from ops.reference import rmsnorm_grads_ref, rmsnorm_linear_grads_ref, rmsnorm_linear_ref, rmsnorm_ref
from ops.rmsnorm import SEMANTICS, FusedRMSNormLinear, RMSNorm, rms_norm, rms_norm_linear
from ops.tolerance import compare


def _bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 values at |v| (8 significant bits)."""
    _, exponent = torch.frexp(v.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny))
    return torch.ldexp(torch.ones_like(v.float()), exponent - 8)


@pytest.mark.parametrize("h", [1, 37, 256, 1000])
@pytest.mark.parametrize("semantics", list(SEMANTICS))
def test_forward_and_gradients_against_float64(device: str, semantics: str, h: int) -> None:
    """y, dx and dweight against the float64 reference, float32 (every h), bfloat16 (two of them) and float16 (one)."""
    dtypes = {37: (torch.float32, torch.bfloat16), 256: (torch.float32, torch.bfloat16, torch.float16)}
    for dtype in dtypes.get(h, (torch.float32,)):
        x = norm_rows(5, h, device, dtype).requires_grad_()
        w = (torch.randn(h) * 0.5 + (0.0 if semantics == "gemma" else 1.0)).to(device, dtype).requires_grad_()
        y = rms_norm(x, h, w, 1e-6, semantics=semantics)
        dy = torch.randn_like(y)
        dx, dw = torch.autograd.grad(y, (x, w), dy)
        assert (m := compare(y, rmsnorm_ref(x, w, 1e-6, semantics), dtype)) is None, f"y {dtype}: {m}"
        want_dx, want_dw = rmsnorm_grads_ref(x, w, dy, 1e-6, semantics)
        assert (m := compare(dx, want_dx, dtype, reduction=h)) is None, f"dx {dtype}: {m}"
        assert (m := compare(dw, want_dw, dtype, reduction=5)) is None, f"dweight {dtype}: {m}"


@pytest.mark.parametrize("semantics,reference", [("torch", nn.RMSNorm), ("llama", LlamaRMSNorm),
                                                 ("gemma", GemmaRMSNorm)])
def test_within_one_ulp_of_the_module_it_stands_for(device: str, semantics: str, reference: type) -> None:
    """bfloat16: each semantics' output within one bfloat16 ulp of its module's (Llama's within two: it rounds x *
    rstd to bfloat16 before the weight, so where our rstd and the module's differ in their last float32 bit, that
    rounding can go the other way, and the weight's product lands up to two ulps off: 2 of 49152 elements here),
    and no further from float64 than the module's."""
    h = 768
    theirs = reference(h, eps=1e-6).to(device, torch.bfloat16)
    with torch.no_grad():
        theirs.weight.normal_(0.0 if semantics == "gemma" else 1.0, 0.3)
    ours = RMSNorm.from_module(theirs, None if semantics == "torch" else semantics)   # the copies here: named
    assert ours.semantics == semantics and ours.weight is theirs.weight
    x = norm_rows(64, h, device, torch.bfloat16)
    with torch.no_grad():
        got, want = ours(x).float(), theirs(x).float()
    ulps = (got - want).abs() / _bf16_ulp(want)
    assert ulps.max() <= (2 if semantics == "llama" else 1), ulps.max()
    exact = rmsnorm_ref(x, theirs.weight, 1e-6, semantics)
    assert (got - exact).abs().max() <= (want - exact).abs().max() * 1.0001


def test_module_is_a_torch_rmsnorm_with_eps_none(device: str) -> None:
    """A subclass of nn.RMSNorm: the same state dict keys, eps=None read as torch reads it, and from_torch keeps the
    parameter itself (an optimizer made before keeps training it)."""
    theirs = nn.RMSNorm(16).to(device)
    ours = RMSNorm.from_torch(theirs)
    assert isinstance(ours, nn.RMSNorm) and ours.weight is theirs.weight
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x = norm_rows(3, 16, device, torch.float32)
    assert (m := compare(ours(x), theirs(x), torch.float32)) is None, m
    assert RMSNorm(16, elementwise_affine=False).weight is None
    assert (m := compare(RMSNorm(16, elementwise_affine=False).to(device)(x), rmsnorm_ref(x, None, 1.19209e-07),
                         torch.float32)) is None, m


def test_answered_by_torch(device: str) -> None:
    """float64, an empty x and a float32 weight of 16-bit x: torch's ops (the modules' own arithmetic)."""
    x = torch.randn(3, 8, dtype=torch.float64, device=device)
    w = torch.randn(8, dtype=torch.float64, device=device)
    torch.testing.assert_close(rms_norm(x, 8, w, 1e-5), nn.functional.rms_norm(x, (8,), w, 1e-5))
    assert rms_norm(torch.empty(0, 8, device=device), 8).shape == (0, 8)
    xb, wf = torch.randn(3, 8, device=device).bfloat16(), torch.randn(8, device=device)
    torch.testing.assert_close(rms_norm(xb, 8, wf, 1e-5), nn.functional.rms_norm(xb, (8,), wf, 1e-5))


@pytest.mark.parametrize("call,err,name", [
    (lambda: rms_norm([[1.0]], 1), TypeError, "x"),
    (lambda: rms_norm(torch.ones(2, 8, dtype=torch.int32), 8), TypeError, "x"),
    (lambda: rms_norm(torch.ones(2, 8), 4), ValueError, "normalized_shape"),
    (lambda: rms_norm(torch.ones(2, 8), 8, torch.ones(7)), ValueError, "weight"),
    (lambda: rms_norm(torch.ones(2, 8), 8, torch.ones(8, dtype=torch.float16)), TypeError, "weight"),
    (lambda: rms_norm(torch.ones(2, 8), 8, eps="small"), TypeError, "eps"),
    (lambda: rms_norm(torch.ones(2, 8), 8, semantics="t5"), ValueError, "semantics"),
    (lambda: RMSNorm(8, semantics="t5"), ValueError, "semantics"),
    (lambda: RMSNorm.from_module(nn.LayerNorm(8)), TypeError, "m"),
    (lambda: RMSNorm.from_module(LlamaRMSNorm(8)), TypeError, "m"),   # a copy is not taken unless named
    (lambda: RMSNorm.from_module(nn.RMSNorm(8), "gemma"), TypeError, "semantics"),
    (lambda: rms_norm_linear(torch.ones(2, 8), torch.ones(7), torch.ones(3, 8)), ValueError, "norm_weight"),
    (lambda: rms_norm_linear(torch.ones(2, 8), torch.ones(8), torch.ones(3, 7)), ValueError, "weight"),
    (lambda: rms_norm_linear(torch.ones(2, 8), None, torch.ones(3, 8), torch.ones(4)), ValueError, "bias"),
    (lambda: rms_norm_linear(torch.ones(2, 8), None, torch.ones(3, 8).half()), TypeError, "weight"),
    (lambda: rms_norm_linear(torch.tensor(1.0), None, torch.ones(3, 1)), ValueError, "x"),
])
def test_bad_input_gets_a_named_error(call: object, err: type[Exception], name: str) -> None:
    with pytest.raises(err) as info:
        call()
    assert str(info.value).startswith(f"{name}:"), info.value


def test_forward_choice_is_rmsnorms_own_where_its_sweep_found_better() -> None:
    """16-bit rows of 1025-2048 vectors: one block per row for RMSNorm (its H200 sweep), LayerNorm's two-block
    cluster otherwise; every other row length launches what LayerNorm's choice picks."""
    from ops.layernorm import config as ln_config
    from ops.rmsnorm import config

    rms = config.SEMANTICS["llama"]
    for h in (8200, 16384):
        assert ln_config.fwd_launch(1024, h, torch.bfloat16, True, act=rms).kernel == "ln_fwd_regs"
        assert ln_config.fwd_launch(1024, h, torch.bfloat16, True).kernel == "ln_fwd_cluster"
    for rows, h, dtype in ((4096, 768, torch.bfloat16), (1, 4096, torch.float32), (256, 32768, torch.bfloat16),
                           (1024, 16384, torch.float32), (8, 65536, torch.bfloat16)):
        assert ln_config.fwd_launch(rows, h, dtype, True, act=rms) == ln_config.fwd_launch(rows, h, dtype, True)


def test_gpu_kernels_compile_for_sm90() -> None:
    """Every RMSNorm instantiation a GPU launches compiles to PTX for sm_90 on any machine (the GPU's graph route
    compiles the same kernels), one entry each, with the LayerNorm kernels' arguments."""
    from ops.launch import ptx
    from ops.rmsnorm import config

    specs = config.all_specs()
    kernels = {"ln_fwd_loop", "ln_fwd_regs", "ln_fwd_cluster", "ln_bwd_loop", "ln_bwd_regs", "add_norm_fwd_regs",
               "ln_bwd_reduce"}
    assert {s.name for s in specs} == kernels and len(specs) == len(set(specs))
    assert all(s.params[-1] is False for s in specs if s.name == "ln_bwd_reduce")   # dgamma's sums alone
    ptx.build(specs, "H100", quiet=True)
    for spec in specs:
        text = ptx.ptx_path(spec, "H100").read_text()
        assert text.count(".visible .entry") == 1, spec.expr
        entry = text[text.index(".visible .entry"):]
        assert entry[:entry.index(")")].count(".param .u64") == spec.args.count("p"), spec.expr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opinfo_rms_norm_samples(device: str, dtype: torch.dtype) -> None:
    """torch's own samples for ``nn.functional.rms_norm`` (several normalized dims, no weight, eps None, 0.5 and
    -0.5), forward and backward: torch's in float64 where finite, NaN exactly where torch's is (a negative eps)."""
    from torch.testing._internal.common_methods_invocations import op_db

    (op,) = [o for o in op_db if o.name == "nn.functional.rms_norm"]
    samples = list(op.sample_inputs(device, dtype, requires_grad=True))
    assert len(samples) >= 5 and any(s.kwargs.get("eps") is not None and s.kwargs["eps"] < 0 for s in samples)
    for s in samples:
        shape, *rest = s.args
        weight = rest[0] if rest else None
        eps = s.kwargs.get("eps")
        eps64 = torch.finfo(dtype).eps if eps is None else eps   # None: x's dtype's, not float64's
        leaves = [t for t in (s.input, weight) if t is not None]
        y = rms_norm(s.input, shape, weight, eps)
        want = nn.functional.rms_norm(s.input.double(), shape, None if weight is None else weight.double(), eps64)
        nan = want.isnan()
        assert y.dtype == dtype and torch.equal(y.isnan(), nan), f"{tuple(s.input.shape)} {shape} eps {eps}"
        assert (m := compare(y.masked_fill(nan, 0), want.masked_fill(nan, 0), dtype, reduction=4)) is None, m
        if s.input.numel() == 0 or bool(nan.any()):
            continue
        dy = torch.randn_like(y)
        got = torch.autograd.grad(y, leaves, dy)
        x64 = [t.detach().double().requires_grad_() for t in leaves]
        y64 = nn.functional.rms_norm(x64[0], shape, x64[1] if weight is not None else None, eps64)
        for g, w in zip(got, torch.autograd.grad(y64, x64, dy.double()), strict=True):
            assert (m := compare(g, w, dtype, reduction=64)) is None, f"{tuple(s.input.shape)} {shape}: {m}"


def test_ops_pass_torch_opcheck(device: str) -> None:
    """The torch ops behind rms_norm: schema, fake implementations, autograd registration and AOT dispatch, as
    torch.library.opcheck checks them."""
    x = torch.randn(6, 16, device=device, requires_grad=True)
    w = torch.randn(16, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.mojo.rms_norm_fwd.default, (x, w, 1e-6, "llama"))
    y, mean, rstd = torch.ops.mojo.rms_norm_fwd(x.detach(), w.detach(), 1e-6, "llama")
    assert torch.equal(mean, torch.zeros_like(mean))
    torch.library.opcheck(torch.ops.mojo.rms_norm_bwd.default, (torch.randn_like(y), x.detach(), w.detach(), mean,
                                                                rstd, "llama"))


def test_compiles_fullgraph_with_dynamic_shapes(device: str, compiled_rmsnorm: str) -> None:
    """torch.compile(fullgraph=True, dynamic=True) of RMSNorm and FusedRMSNormLinear: one graph for two batch sizes (no
    recompile); the forward and backward graphs hold our ops or torch's, as COMPILED_RMSNORM says; inductor's compiled
    values and gradients are eager's."""
    import torch._dynamo.testing

    torch._dynamo.reset()
    for m in (RMSNorm(32, eps=1e-6, semantics="gemma").to(device), FusedRMSNormLinear(32, 16, 1e-6).to(device)):
        counter = torch._dynamo.testing.CompileCounter()
        traced = torch.compile(m, fullgraph=True, dynamic=True, backend=counter)
        for rows in (3, 7):
            traced(torch.randn(rows, 32, device=device))
        assert counter.frame_count == 1
        x = torch.randn(5, 32, device=device, requires_grad=True)
        backend, codes = recording_backend()
        torch.compile(m, fullgraph=True, backend=backend)(x).sum().backward()
        torchs = ("rsqrt", "_fused_rms_norm")   # torch's RMSNorm, decomposed (the CPU) or fused (CUDA)
        assert [("mojo.rms_norm" in c, any(op in c for op in torchs)) for c in codes] == [
            (compiled_rmsnorm == "ours", compiled_rmsnorm == "inductor")] * 2, codes
        compiled = torch.compile(m, fullgraph=True)
        y, want = compiled(x), m(x)
        torch.testing.assert_close(y, want)
        g = torch.autograd.grad(y.square().sum(), (x, *m.parameters()))
        g_want = torch.autograd.grad(want.square().sum(), (x, *m.parameters()))
        for a, b in zip(g, g_want, strict=True):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("semantics,norm", [("torch", lambda k: nn.RMSNorm(k, eps=1e-6)),
                                            ("llama", lambda k: LlamaRMSNorm(k, eps=1e-6))])
def test_fused_rmsnorm_linear_is_the_sequential(device: str, semantics: str, norm: object) -> None:
    """FusedRMSNormLinear.from_torch of nn.Sequential(an RMSNorm, nn.Linear): the same parameters (shared), state
    dict keys, values and gradients as the pair's, to float64's distance."""
    torch.manual_seed(0)
    theirs = nn.Sequential(norm(48), nn.Linear(48, 24)).to(device)
    ours = FusedRMSNormLinear.from_torch(theirs, None if semantics == "torch" else semantics)
    assert ours[0].semantics == semantics and ours[1] is theirs[1] and ours[0].weight is theirs[0].weight
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x = norm_rows(6, 48, device, torch.float32).requires_grad_()
    y, want = ours(x), theirs(x)
    assert (m := compare(y, want, torch.float32, reduction=48)) is None, m
    grads = torch.autograd.grad(y.square().sum(), (x, *theirs.parameters()))
    want_grads = torch.autograd.grad(want.square().sum(), (x, *theirs.parameters()))
    for g, w in zip(grads, want_grads, strict=True):
        assert (m := compare(g, w, torch.float32, reduction=48 * 6)) is None, m
    with pytest.raises(TypeError, match="^seq:"):
        FusedRMSNormLinear.from_torch(nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 2)))
    gemma = FusedRMSNormLinear(16, 8, semantics="gemma", device=device)
    assert gemma(torch.randn(2, 16, device=device)).shape == (2, 8)


@pytest.mark.parametrize("semantics", list(SEMANTICS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_bias", [True, False])
def test_rms_norm_linear_against_float64(device: str, semantics: str, dtype: torch.dtype, with_bias: bool) -> None:
    """rms_norm_linear of a 3-d x (a row with a large mean, a constant row): y and the four gradients against
    float64, with gradients to come (on a GPU one RMSNormLinearFunction node) and without (the same y)."""
    torch.manual_seed(0)
    k, n = 200, 72
    x = norm_rows(2 * 5, k, device, dtype).view(2, 5, k)
    nw = (torch.randn(k) * 0.5 + (0.0 if semantics == "gemma" else 1.0)).to(device, dtype)
    w = (torch.randn(n, k) / k ** 0.5).to(device, dtype)
    b = torch.randn(n).to(device, dtype) if with_bias else None
    dy = torch.randn(2, 5, n, device=device, dtype=dtype)
    leaves = [t.clone().requires_grad_() for t in (x, nw, w, *([b] if with_bias else []))]
    y = rms_norm_linear(*leaves[:3], leaves[3] if with_bias else None, 1e-6, semantics=semantics)
    assert (m := compare(y, rmsnorm_linear_ref(x, nw, w, b, 1e-6, semantics), dtype, reduction=k)) is None, f"y: {m}"
    with torch.no_grad():
        assert torch.equal(rms_norm_linear(x, nw, w, b, 1e-6, semantics=semantics), y)
    grads = torch.autograd.grad(y, leaves, dy)
    want = rmsnorm_linear_grads_ref(x, nw, w, b if with_bias else torch.zeros(n, device=device), dy, 1e-6, semantics)
    for name, g, r, red in zip(("dx", "dnorm_weight", "dweight", "dbias"), grads, want, (n * k, 10 * n, 10, 10),
                               strict=False):
        assert (m := compare(g, r, dtype, reduction=red, cond=4.0)) is None, f"{name}: {m}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_rms_norm_linear_node_frozen_batched_and_double_backward(dtype: torch.dtype) -> None:
    """On a GPU: one autograd node from y to the leaves, at the first call (Python's RMSNormLinearFunction, which
    hands the C++ entry its plans) and the second (the C++ entry's), both bit for bit alike; a frozen Linear (no dW)
    gives the same dx; a batched dy (``is_grads_batched``) gives each row's gradient; a gradient penalty matches
    float64's."""
    from ops.launch import direct

    torch.manual_seed(0)
    m, k, n = 64, 256, 96
    x = norm_rows(m, k, "cuda", dtype)
    nw, w, b = (t.to("cuda", dtype) for t in (torch.randn(k), torch.randn(n, k) / 16, torch.randn(n)))
    dy = torch.randn(m, n, device="cuda", dtype=dtype)
    leaves = [t.clone().requires_grad_() for t in (x, nw, w, b)]
    runs = []
    for _ in range(2):
        y = rms_norm_linear(*leaves, 1e-6)
        assert {type(f).__name__ for f, _ in y.grad_fn.next_functions} == {"AccumulateGrad"}, y.grad_fn
        runs.append((y, *torch.autograd.grad(y, leaves, dy)))
    assert direct.NATIVE.rms_norm_linear is None or "RMSNormLinearFunction" not in type(y.grad_fn).__name__
    assert all(torch.equal(a, c) for a, c in zip(*runs, strict=True))
    y, dx, dnw, dw, db = runs[1]
    xf = x.clone().requires_grad_()
    dx_frozen, = torch.autograd.grad(rms_norm_linear(xf, nw, w, b, 1e-6), xf, dy)
    assert torch.equal(dx_frozen, dx)
    dys = torch.stack((dy, 2 * dy))
    dx_b, = torch.autograd.grad(rms_norm_linear(*leaves, 1e-6), leaves[0], dys, is_grads_batched=True)
    assert (m2 := compare(dx_b[1], 2 * dx.float(), dtype, reduction=n * k)) is None, m2
    x64, nw64, w64 = (t.double().requires_grad_() for t in (x, nw, w))
    g64, = torch.autograd.grad(rmsnorm_linear_ref(x64, nw64, w64, None, 1e-6).square().sum(), x64, create_graph=True)
    g64.square().sum().backward()
    xg, nwg, wg = (t.clone().requires_grad_() for t in (x, nw, w))
    g, = torch.autograd.grad(rms_norm_linear(xg, nwg, wg, None, 1e-6).square().sum(), xg, create_graph=True)
    g.square().sum().backward()
    for got, want in ((xg.grad, x64.grad), (nwg.grad, nw64.grad), (wg.grad, w64.grad)):
        assert (m2 := compare(got, want, dtype, reduction=n * k, cond=8.0)) is None, m2


@pytest.mark.parametrize("semantics", list(SEMANTICS))
def test_double_backward(device: str, semantics: str) -> None:
    """A gradient penalty (create_graph=True) through rms_norm: the second-order gradients are float64's, at the
    first call and the second (on a GPU: the Python route's autograd, then the C++ entry's)."""
    torch.manual_seed(0)
    x0 = torch.randn(4, 16, device=device)
    w0 = torch.randn(16, device=device)
    x64, w64 = (t.double().requires_grad_() for t in (x0, w0))
    g64, = torch.autograd.grad(rmsnorm_ref(x64, w64, 1e-6, semantics).square().sum(), x64, create_graph=True)
    g64.square().sum().backward()
    for _ in range(2):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        g, = torch.autograd.grad(rms_norm(x, 16, w, 1e-6, semantics=semantics).square().sum(), x, create_graph=True)
        g.square().sum().backward()
        for got, want in ((x.grad, x64.grad), (w.grad, w64.grad)):
            assert (m := compare(got, want, torch.float32, reduction=64, cond=4.0)) is None, m


@pytest.mark.gpu
@pytest.mark.parametrize("rows,h", [(5, 1000), (8, 768), (4096, 768), (3, 4096), (4096, 4096), (2, 16384),
                                    (2, 65536)])
@pytest.mark.parametrize("semantics", list(SEMANTICS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_every_kernel_and_the_cpp_entry(semantics: str, rows: int, h: int, dtype: torch.dtype,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, at shapes that pick each kernel (the loop for h not a multiple of the vector, a warp per row, a
    block per row, a cluster per row): y, dx and dweight against float64, at the first call (the Python route, which
    hands the plans to the C++ side) and bit for bit the same at the second, which the C++ entry must take."""
    from ops.rmsnorm import autograd as rms_autograd
    from ops.rmsnorm import fwd_bwd as rms_fwd_bwd

    x = norm_rows(rows, h, "cuda", dtype)
    w = (torch.randn(h) * 0.5 + (0.0 if semantics == "gemma" else 1.0)).to("cuda", dtype)
    dy = torch.randn_like(x)
    results = []
    for _ in range(2):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = rms_norm(xg, h, wg, 1e-6, semantics=semantics)
        results.append((y, *torch.autograd.grad(y, (xg, wg), dy)))
        def python_route(*args: object) -> None:
            raise AssertionError("the second call took the Python route")
        monkeypatch.setattr(rms_autograd.RMSNormFunction, "apply", python_route)
        monkeypatch.setattr(rms_fwd_bwd, "rms_bwd_direct", python_route)
    (y, dx, dw), again = results
    assert all(torch.equal(a, b) for a, b in zip(results[0], again, strict=True))
    assert (m := compare(y, rmsnorm_ref(x, w, 1e-6, semantics), dtype)) is None, f"y: {m}"
    want_dx, want_dw = rmsnorm_grads_ref(x, w, dy, 1e-6, semantics)
    assert (m := compare(dx, want_dx, dtype, reduction=h)) is None, f"dx: {m}"
    assert (m := compare(dw, want_dw, dtype, reduction=rows)) is None, f"dweight: {m}"


def test_strided_x_and_gradients_in_place(device: str) -> None:
    """A transposed x is copied once: values and x's gradient (in x's own layout) are those of its contiguous copy."""
    torch.manual_seed(0)
    base = torch.randn(24, 6, device=device)
    x = base.t().requires_grad_()   # [6, 24], strided
    w = torch.randn(24, device=device)
    y = rms_norm(x, 24, w, 1e-6)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    want_dx, _ = rmsnorm_grads_ref(x, w, dy, 1e-6)
    assert (m := compare(y, rmsnorm_ref(x, w, 1e-6), torch.float32)) is None, m
    assert dx.shape == x.shape and (m := compare(dx, want_dx, torch.float32, reduction=24)) is None, m


@pytest.mark.gpu
@pytest.mark.parametrize("norm", ["rms_norm", "rms_norm:llama", "add_rms_norm", "add_layer_norm"])
def test_gpu_cpp_backward_before_python_made_its_plan(norm: str) -> None:
    """A shape's first call without a gradient hands the C++ entry its forward plan only; the next call with one
    runs the C++ forward, whose backward finds no plan and goes through the Python op (which makes it): its
    gradients are those of a shape whose plans were all made before."""
    from ops.launch import plans
    from ops.layernorm import add_layer_norm
    from ops.rmsnorm import add_rms_norm

    torch.manual_seed(0)
    rows, h = 37, 1536   # a shape no other test runs
    x, r = norm_rows(rows, h, "cuda", torch.bfloat16), torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
    w, b = (torch.randn(h, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    semantics = norm.partition(":")[2] or "torch"
    call = {"rms_norm": lambda x, w: rms_norm(x, h, w, 1e-6, semantics=semantics),
            "add_rms_norm": lambda x, w: add_rms_norm(x, r, w, 1e-6)[0],
            "add_layer_norm": lambda x, w: add_layer_norm(x, r, w, b, 1e-5)[0]}[norm.partition(":")[0]]
    dy = torch.randn_like(x)

    def grads() -> tuple[torch.Tensor, ...]:
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = call(xg, wg)
        return (y, *torch.autograd.grad(y, (xg, wg), dy))
    plans.forget_plans()
    with torch.no_grad():
        call(x, w)
    first = grads()   # the C++ forward, the backward through Python
    for got, want in zip(first, grads(), strict=True):   # every plan made by now
        assert torch.equal(got, want)


@pytest.mark.gpu
def test_gpu_cuda_graph_captures_rms_norm_and_add_norm() -> None:
    """``torch.cuda.graph`` captures rms_norm and add_rms_norm, forward and backward (the C++ entries' launches on
    the capture stream); replayed on new input, every output and gradient is eager's on that input, bit for bit."""
    from ops.bench.timing import captured
    from ops.rmsnorm import add_rms_norm

    torch.manual_seed(0)
    x, r = (torch.randn(256, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    w = torch.randn(768, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step() -> tuple[torch.Tensor, ...]:
        y, s = add_rms_norm(x, r, w, 1e-6, semantics="llama")
        z = rms_norm(y, 768, w, 1e-6)
        (z.float().square().sum() + s.float().sum()).backward()
        return y, s, z

    def clear() -> None:
        for t in (x, r, w):
            t.grad = None

    def eager() -> list[torch.Tensor]:
        clear()
        return [t.clone() for t in step()] + [t.grad.clone() for t in (x, r, w)]
    graph, out = captured(step, before_capture=clear)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
        r.copy_(torch.randn_like(r))
    graph.replay()
    got = [t.clone() for t in out] + [t.grad.clone() for t in (x, r, w)]
    for i, (a, b) in enumerate(zip(got, eager(), strict=True)):
        assert torch.equal(a, b), f"output {i}"
