"""The routes agree (GPU tests): the C++ entries give bitwise what the Python route gives, the fused and Hopper
forwards what the MAX graph route gives, strided inputs are taken, and auto's fallbacks hold."""

from __future__ import annotations

import pytest
import torch

from ops.bench.timing import kernel_times
from ops.launch import direct
from ops.layernorm import config as config

GPU_SHAPES = [(1, 7), (37, 1000), (4, 768), (2, 64, 1023), (3, 4096), (5, 12288)]


def _grads(y: torch.Tensor, inputs: list[torch.Tensor], dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (y, *torch.autograd.grad(y, inputs, dy))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", config.DTYPES)
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_native_layernorm_is_the_python_route(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """After a shape's first call (the Python route, which hands over the plan) the C++ entry takes the call and
    gives bitwise the Python route's output and gradients (the same kernels), with and without GELU; without a
    gradient to come too. Rows of 12288 bf16 take a clustered launch."""
    from ops.layernorm import layernorm, layernorm_bwd, layernorm_fwd
    from ops.layernorm.autograd import LayerNormFunction
    from ops.layernorm.config import ACTIVATIONS

    torch.manual_seed(0)
    h = shape[-1]
    x = (torch.randn(shape, device="cuda") * 3 + 1).to(dtype).requires_grad_()
    w, b = (torch.randn(h, device="cuda").to(dtype).requires_grad_() for _ in range(2))
    dy = torch.randn(shape, device="cuda").to(dtype)
    for activation in ("none", "gelu"):
        python = _grads(LayerNormFunction.apply(x, w, b, 1e-5, "fast", activation), [x, w, b], dy)
        layernorm(x, w, b, 1e-5, activation)   # the Python route; plans handed over
        assert direct.NATIVE.layernorm(x, w, b, 1e-5, ACTIVATIONS[activation]) is not None
        native = _grads(layernorm(x, w, b, 1e-5, activation), [x, w, b], dy)
        for name, got, want in zip(("y", "dx", "dweight", "dbias"), native, python, strict=True):
            assert torch.equal(got, want), f"{activation} {name}"
        with torch.no_grad():
            assert torch.equal(layernorm(x, w, b, 1e-5, activation), python[0])
            # the validated call (y, mean, rstd): the C++ entry too, with the statistics the backward reads
            assert direct.NATIVE.layernorm_with_stats(x, w, b, 1e-5, ACTIVATIONS[activation])
            y, mean, rstd = layernorm_fwd(x, w, b, 1e-5, "fast", activation)
            assert torch.equal(y, python[0])
            assert torch.equal(layernorm_bwd(dy, x, w, b, mean, rstd, activation)[0], python[1])
            # the functional backward: the C++ entry (plan handed over by the autograd call above), all three
            # gradients; a call it does not take (dy of another dtype) is left to Python, which names dy
            got = direct.NATIVE.layernorm_bwd_with_plan(dy, x, w, b, mean, rstd, ACTIVATIONS[activation])
            assert len(got) == 3
            for name, g, want in zip(("dx", "dweight", "dbias"), got, python[1:], strict=True):
                assert torch.equal(g, want), f"{activation} {name}"
            assert direct.NATIVE.layernorm_bwd_with_plan(dy.double(), x, w, b, mean, rstd, 0) == []
            with pytest.raises(TypeError, match="^dy"):
                layernorm_bwd(dy.double(), x, w, b, mean, rstd, activation)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_k_n", [(7, 37, 5), (128, 768, 2304), (300, 1023, 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_gpu_native_layernorm_linear_is_the_python_route(dtype: torch.dtype, rows_k_n: tuple[int, int, int],
                                                         bias: bool) -> None:
    """The unfused LayerNorm+Linear through the C++ entry: bitwise the Python route's output and five gradients
    (four without a bias), and its inference output."""
    from ops.layernorm_linear import FusedLayerNormLinear
    from ops.layernorm_linear.autograd import LayerNormLinearFunction
    from ops.layernorm_linear.config import ALGO_IDS

    rows, k, n = rows_k_n
    torch.manual_seed(0)
    seq = torch.nn.Sequential(torch.nn.LayerNorm(k), torch.nn.Linear(k, n, bias=bias)).to("cuda", dtype)
    m = FusedLayerNormLinear.from_torch(seq, algo="unfused")
    ln, lin = m[0], m[1]
    x = torch.randn(rows, k, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(rows, n, device="cuda", dtype=dtype)
    inputs = [x, *m.parameters()]
    python = _grads(LayerNormLinearFunction.apply(x, ln.weight, ln.bias, lin.weight, lin.bias, ln.eps, "unfused"),
                    inputs, dy)
    m(x)   # the Python route; plans handed over
    assert direct.NATIVE.layernorm_linear(x, ln.weight, ln.bias, lin.weight, lin.bias, ln.eps,
                                          ALGO_IDS["unfused"]) is not None
    native = _grads(m(x), inputs, dy)
    for i, (got, want) in enumerate(zip(native, python, strict=True)):
        assert torch.equal(got, want), f"output {i}"
    with torch.no_grad():
        m(x)
        assert torch.equal(m(x), python[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows_k_n", [(1, 768, 3072), (7, 37, 5), (300, 1023, 64), (2048, 768, 2304)])
def test_gpu_linear_ops_values_and_fallbacks(dtype: torch.dtype, rows_k_n: tuple[int, int, int]) -> None:
    """The unfused route's Linear ops (cuBLASLt for 16-bit, torch's ops otherwise): y, dxn, dW and db (the
    weight GEMM's epilogue) against float64, outputs poisoned first; after 16-bit calls some shape runs on
    cuBLASLt; a weight or bias off 256-byte alignment, and float32, give torch's own results bitwise."""
    import torch.nn.functional as F

    from ops.tolerance import compare

    rows, k, n = rows_k_n
    torch.manual_seed(0)
    xn = torch.randn(rows, k, device="cuda", dtype=dtype)
    aligned_w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(dtype)
    aligned_b = torch.randn(n, device="cuda", dtype=dtype)
    dy = torch.randn(rows, n, device="cuda", dtype=dtype)
    native = direct.load_native()
    y = native.linear(xn, aligned_w, aligned_b)
    dxn, dw, db = native.linear_grads(dy, xn, aligned_w, True)
    dxn_nb, dw_nb = native.linear_grads(dy, xn, aligned_w, False)
    x64, w64, dy64 = xn.double(), aligned_w.double(), dy.double()
    refs = {"y": (y, x64 @ w64.T + aligned_b.double(), k), "dxn": (dxn, dy64 @ w64, n),
            "dW": (dw, dy64.T @ x64, rows), "db": (db, dy64.sum(0), rows), "dW without db": (dw_nb, dy64.T @ x64, rows)}
    for name, (got, ref, reduction) in refs.items():
        assert (bad := compare(got, ref, dtype, reduction=reduction)) is None, f"{name}: {bad}"
    assert torch.equal(dxn_nb, dxn)   # one dxn GEMM, with or without the bias gradient
    if dtype == torch.float32:   # torch's ops, bitwise
        assert torch.equal(y, F.linear(xn, aligned_w, aligned_b)) and torch.equal(dw, dy.T @ xn)
    else:   # some shape (this one, or an earlier one in this process) runs on cuBLASLt
        assert native.ops.gemm_plan_count() > 0
        # torch's stricter reduced-precision setting (no 16-bit split-K reductions; plans of its own): right values
        matmul = torch.backends.cuda.matmul
        flag = "allow_bf16_reduced_precision_reduction" if dtype == torch.bfloat16 else \
            "allow_fp16_reduced_precision_reduction"
        before = getattr(matmul, flag)
        setattr(matmul, flag, False)
        try:
            strict = native.linear_grads(dy, xn, aligned_w, True)
        finally:
            setattr(matmul, flag, before)
        for name, got in zip(("dxn", "dW", "db"), strict, strict=True):
            ref, reduction = refs[name][1:]
            assert (bad := compare(got, ref, dtype, reduction=reduction)) is None, f"{name} (strict): {bad}"
    # a weight and bias 2 or 4 bytes off 256-byte alignment: torch's ops, bitwise
    off_w = torch.empty(n * k + 1, device="cuda", dtype=dtype)[1:].view(n, k).copy_(aligned_w)
    off_b = torch.empty(n + 1, device="cuda", dtype=dtype)[1:].copy_(aligned_b)
    assert torch.equal(native.linear(xn, off_w, off_b), F.linear(xn, off_w, off_b))
    got = native.linear_grads(dy, xn, off_w, True)
    for g, want in zip(got, (dy @ off_w, dy.T @ xn, dy.sum(0)), strict=True):
        assert torch.equal(g, want)


def _strided(base: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of base [64, 5, h] that the kernels do not take as they are (column-major: rows of h that are columns
    in memory, which ``copy_transposed`` copies where no gradient is to come)."""
    return {"transposed": base.transpose(0, 1), "cls-slice": base[:, 0], "expanded": base[0, 0].expand(3, 7, -1),
            "column-major": base.reshape(-1, base.shape[-1]).t().contiguous().t()}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_gpu_native_copies_column_major_x(dtype: torch.dtype) -> None:
    """An x whose last two dims are column-major (a transposed view of [..., h, r]) is copied by our
    ``copy_transposed`` on the C++ route, not by torch: bitwise the contiguous x's output (LayerNorm, the fused
    and unfused LayerNorm+Linear), 2-D, batched (leading dims one stride apart) and odd sizes; a batch whose
    leading dims are not one stride apart takes torch's copy, with the same values."""
    from ops.layernorm import layernorm
    from ops.layernorm_linear import FusedLayerNormLinear

    torch.manual_seed(0)
    # x [..., r, h] as a view of [..., h, r]; the last: its two leading dims swapped, not one stride apart
    for shape, one_stride in (((37, 1000), True), ((1023, 64), True), ((2, 3, 7, 768), True), ((2, 3, 5, 256), False)):
        *lead, r, h = shape
        base = torch.randn(*lead, h, r, device="cuda").to(dtype)
        x = base.transpose(-1, -2) if one_stride else base.permute(1, 0, 3, 2)
        assert x.stride(-2) == 1 and not x.is_contiguous()
        seq = torch.nn.Sequential(torch.nn.LayerNorm(h), torch.nn.Linear(h, 96)).to("cuda", dtype)
        ln = seq[0]
        calls = {"layernorm": lambda t, ln=ln: layernorm(t, ln.weight, ln.bias)}
        calls |= {a: FusedLayerNormLinear.from_torch(seq, algo=a) for a in ("fused", "unfused")}
        with torch.no_grad():
            for name, fn in calls.items():
                want = fn(x.contiguous())
                want = fn(x.contiguous())   # the second: the C++ route, plans handed over
                assert torch.equal(fn(x), want), (shape, name)
                kernels = kernel_times(lambda fn=fn, x=x: fn(x), 1)   # the CUDA kernels of a call, by name
                assert any("copy_transpo" in k for k in kernels) == one_stride, (shape, name, kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_native_takes_strided_x(dtype: torch.dtype) -> None:
    """A strided x goes through the C++ entries with one copy (ops/launch/native/capture.h's dense), not back to Python:
    bitwise the contiguous x's output and gradients (LayerNorm, unfused LayerNorm+Linear), statistics and fused
    forward."""
    from ops.layernorm import layernorm, layernorm_fwd
    from ops.layernorm_linear import FusedLayerNormLinear
    from ops.layernorm_linear.config import ALGO_IDS

    torch.manual_seed(0)
    base = torch.randn(64, 5, 768, device="cuda").to(dtype)
    seq = torch.nn.Sequential(torch.nn.LayerNorm(768), torch.nn.Linear(768, 96)).to("cuda", dtype)
    unfused, fused = (FusedLayerNormLinear.from_torch(seq, algo=a) for a in ("unfused", "fused"))
    ln, lin = unfused[0], unfused[1]
    lnl_args = (ln.weight, ln.bias, lin.weight, lin.bias, ln.eps)
    for view, x0 in _strided(base).items():
        x, dense = x0.detach().requires_grad_(), x0.contiguous().requires_grad_()
        for fn, params, n in ((lambda t: layernorm(t, ln.weight, ln.bias), [ln.weight, ln.bias], 768),
                              (unfused, list(unfused.parameters()), 96)):
            dy = torch.randn(*x.shape[:-1], n, device="cuda").to(dtype)
            want = _grads(fn(dense), [dense, *params], dy)
            want = _grads(fn(dense), [dense, *params], dy)   # the second: the C++ route, plans handed over
            got = _grads(fn(x), [x, *params], dy)
            for i, (a, b) in enumerate(zip(got, want, strict=True)):
                assert torch.equal(a, b), f"{view}, {n}: output {i}"
        with torch.no_grad():
            assert direct.NATIVE.layernorm(x, ln.weight, ln.bias, ln.eps, 0) is not None, view
            want = unfused(dense)   # without a gradient to come: a plan of its own, handed over here
            got = direct.NATIVE.layernorm_linear(x, *lnl_args, ALGO_IDS["unfused"])
            assert got is not None and torch.equal(got, want), view
            stats = direct.NATIVE.layernorm_with_stats(x, ln.weight, ln.bias, ln.eps, 0)
            assert stats, view
            for a, b in zip(stats, layernorm_fwd(dense, ln.weight, ln.bias), strict=True):
                assert torch.equal(a, b), view
            want = fused(dense)   # the plan handed over
            f_ln, f_lin = fused[0], fused[1]
            assert direct.NATIVE.layernorm_linear(x, f_ln.weight, f_ln.bias, f_lin.weight, f_lin.bias, f_ln.eps,
                                                  ALGO_IDS["fused"]) is not None, view
            assert torch.equal(fused(x), want), view


FUSED_CASES = [("fused", torch.float32, (300, 1023, 64)), ("fused", torch.float32, (2, 3, 256, 5)),
               ("fused", torch.bfloat16, (2, 1024, 2048, 64)), ("fused", torch.float16, (129, 768, 37)),
               ("sm90", torch.bfloat16, (300, 768, 264)), ("sm90", torch.bfloat16, (2, 2048, 1024, 768))]


@pytest.mark.gpu
@pytest.mark.parametrize("algo,dtype,shape", FUSED_CASES)
@pytest.mark.parametrize("offset", [0, 1])
def test_gpu_fused_forwards_are_the_graph_route(algo: str, dtype: torch.dtype, shape: tuple[int, ...],
                                                offset: int) -> None:
    """The fused and Hopper forwards through the C++ entry (plans from ops/layernorm_linear/config.py) give
    bitwise what the MAX ops give (their Mojo host code's own launches): y, mean and rstd, with and without a
    bias, on 16-byte-aligned x and on x one element off (the unaligned variants; the Hopper kernel takes
    aligned x only); and the module's inference output is that y."""
    from ops import layernorm_linear as LL

    if algo == "sm90" and not LL.algo.is_sm90(torch.device("cuda")):
        pytest.skip("needs an sm_90 GPU")
    if algo == "sm90" and offset:
        pytest.skip("the Hopper kernel takes 16-byte-aligned x only")
    torch.manual_seed(0)
    *lead, k, n = shape
    x = (torch.randn(torch.Size(lead).numel() * k + offset, device="cuda") * 2 + 3).to(dtype)[offset:].view(*lead, k)
    seq = torch.nn.Sequential(torch.nn.LayerNorm(k), torch.nn.Linear(k, n)).to("cuda", dtype)
    with torch.no_grad():
        for p in seq.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ln, lin = seq[0], seq[1]
    graph_fwd = LL.launch.fused_fwd if algo == "fused" else LL.launch.sm90_fwd
    for bias in (lin.bias, None):
        full = LL.launch.zero_bias(lin.weight) if bias is None else bias
        want = [t.view(*lead, -1) for t in graph_fwd(x.view(-1, k), ln.weight, ln.bias, lin.weight, full, ln.eps)]
        got = LL.layernorm_linear_fwd(x, ln.weight, ln.bias, lin.weight, bias, ln.eps, algo)
        code = LL.config.ALGO_IDS[algo]
        assert direct.NATIVE.layernorm_linear_with_stats(x, ln.weight, ln.bias, lin.weight, full, ln.eps,
                                                         code), "the C++ entry did not take the call"
        for name, a, b in zip(("y", "mean", "rstd"), got, want, strict=True):
            assert torch.equal(a, b.view(a.shape)), name
        with torch.no_grad():
            assert torch.equal(LL.layernorm_linear(x, ln.weight, ln.bias, lin.weight, bias, ln.eps, algo), got[0])
            assert direct.NATIVE.layernorm_linear(x, ln.weight, ln.bias, lin.weight, bias, ln.eps,
                                                  LL.config.ALGO_IDS[algo]) is not None


@pytest.mark.gpu
@pytest.mark.parametrize("off", ["x", "weight"])
def test_gpu_auto_falls_back_to_unfused_not_fused(off: str) -> None:
    """auto in the Hopper region on x or a weight that the Hopper kernel cannot take (not 16-byte aligned: its
    TMA reads both) runs "unfused", bitwise, and hands the C++ entry no fused plan for them (it once ran the
    fused kernel there)."""
    from ops import layernorm_linear as LL

    if not LL.algo.is_sm90(torch.device("cuda")):
        pytest.skip("needs an sm_90 GPU")
    torch.manual_seed(0)
    rows, k, n = LL.config.SM90_MIN_ROWS, 64, 768

    def values(rows: int, cols: int, misaligned: bool, scale: float = 1.0) -> torch.Tensor:
        """randn * scale [rows, cols], 2 bytes past an aligned start when misaligned."""
        flat = torch.randn(rows * cols + 1, device="cuda", dtype=torch.bfloat16) * scale
        return (flat[1:] if misaligned else flat[:-1]).view(rows, cols)

    x, w = values(rows, k, off == "x"), values(n, k, off == "weight", 1 / 8)
    g, b = torch.ones(k, device="cuda", dtype=x.dtype), torch.zeros(k, device="cuda", dtype=x.dtype)
    bias = torch.randn(n, device="cuda", dtype=x.dtype)
    assert LL.algo.pick_algo("auto", x.device, x.dtype, rows, n, k) == "sm90"
    assert LL.algo.sm90_unsupported(x, w) == f"needs {off} 16-byte aligned"
    for _ in range(2):
        got = LL.layernorm_linear_fwd(x, g, b, w, bias, 1e-5, "auto")
        want = LL.layernorm_linear_fwd(x, g, b, w, bias, 1e-5, "unfused")
        for a, c in zip(got, want, strict=True):
            assert torch.equal(a, c)
    assert direct.NATIVE.layernorm_linear_with_stats(x, g, b, w, bias, 1e-5, LL.config.ALGO_IDS["auto"]) == []
