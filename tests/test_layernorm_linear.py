"""Fused LayerNorm + Linear (CPU, and the GPU where present): every forward algorithm, all five gradients, large
means, NaN, determinism, the nn.Module, torch.compile, the custom ops and bad inputs, against float64."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from conftest import compiled_double
from layernorm_linear_helpers import check_forward, make
from torch import nn

from ops import layernorm_linear as LL
from ops.launch import direct
from ops.layernorm_linear import config as LLC
from ops.reference import (
    activation_ref,
    layernorm_linear_act_ref,
    layernorm_linear_grads_ref,
    layernorm_linear_ref,
    layernorm_ref,
    layernorm_stats_ref,
)
from ops.tolerance import compare, compare_named

# (leading dims..., K, N): K and N off the 16/64 tiles, 1-element edges, a 2-D batch.
SHAPES = [(1, 1, 1), (7, 37, 5), (37, 64, 65), (3, 1000, 7), (5, 1023, 130), (2, 3, 24, 40), (70, 130, 64)]


GPU_SHAPES = [(4096, 768, 64), (513, 1024, 768), (1000, 4097, 33), (130, 256, 3072)]


def check_backward(x: torch.Tensor, g: torch.Tensor, b: torch.Tensor, w: torch.Tensor, bias: torch.Tensor,
                   dy: torch.Tensor, cond: float = 1.0) -> None:
    _, mean, rstd = LL.layernorm_linear_fwd(x, g, b, w, bias)
    got = LL.layernorm_linear_bwd(dy, x, g, b, w, mean, rstd)
    check_grads(got, x, g, b, w, bias, dy, cond)


def check_grads(got: tuple[torch.Tensor, ...], x: torch.Tensor, g: torch.Tensor, b: torch.Tensor, w: torch.Tensor,
                bias: torch.Tensor, dy: torch.Tensor, cond: float = 1.0, where: str = "") -> None:
    """(dx, dln_weight, dln_bias, dweight, dbias) against float64 autograd, each in its tensor's dtype."""
    ref = layernorm_linear_grads_ref(x, g, b, w, bias, dy)
    k, n = x.shape[-1], w.shape[0]
    rows = x.numel() // k
    # dx goes through dxn = dy W (n terms) and LayerNorm's backward (k terms, scaled by rstd).
    dx_cond = cond * float(layernorm_stats_ref(x)[1].max())
    # dweight = dy^T xn sums `rows` products that may be well above 1 and cancel (the table is for O(1) terms):
    # its tolerance grows with the largest mean |dy| |xn| of an element.
    xn = layernorm_ref(x, g, b).reshape(-1, k).abs()
    dw_cond = cond * max(1.0, float((dy.double().reshape(-1, n).abs().T @ xn).max()) / rows)
    sums = {"dx": (n * k, dx_cond), "dln_weight": (rows * n, cond), "dln_bias": (rows * n, 1.0),
            "dweight": (rows, dw_cond), "dbias": (rows, 1.0)}
    bad = compare_named(got, ref, (x, g, b, w, bias), sums, x.dtype)
    assert bad is None, f"{x.dtype}, x {tuple(x.shape)}, weight {tuple(w.shape)} {where}: {bad}"


@pytest.mark.parametrize("dtype", LL.DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward(device: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x, g, b, w, bias, _ = make(shape[:-2], shape[-2], shape[-1], dtype, device)
    for algo in LL.algo.algos_for(x.view(-1, x.shape[-1]), w):
        check_forward(x, g, b, w, bias, algo)


@pytest.mark.parametrize("dtype", LL.DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES[1:5], ids=str)
def test_backward(device: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    check_backward(*make(shape[:-2], shape[-2], shape[-1], dtype, device))


def test_linear_grads_makes_only_what_is_wanted(device: str) -> None:
    """The Linear's part of every backward (``_linear_grads``): dxn = dy W, dW = dy^T xn, db = dy's column sums, in
    float64 against torch's; no dW without ``weight_grad`` (a frozen weight), no db without ``bias_grad``."""
    torch.manual_seed(0)
    dy, xn, w = (torch.randn(*s, dtype=torch.float64, device=device) for s in ((2, 5, 3), (2, 5, 8), (3, 8)))
    want = (dy @ w, dy.reshape(-1, 3).T @ xn.reshape(-1, 8), dy.reshape(-1, 3).sum(0))
    for weight_grad in (True, False):
        for bias_grad in (True, False):
            got = LL.launch.linear_grads(dy, xn, w, bias_grad, weight_grad)
            for g, ref, wanted in zip(got, want, (True, weight_grad, bias_grad), strict=True):
                if wanted:
                    torch.testing.assert_close(g, ref, rtol=1e-12, atol=1e-12)
                else:
                    assert g is None


def test_large_mean_rows(device: str) -> None:
    """Rows with mean 1e4 times their spread: the statistics must not cancel."""
    x, g, b, w, bias, dy = make((6,), 1000, 24, torch.float32, device, mean=1e4)
    for algo in LL.algo.algos_for(x, w):
        check_forward(x, g, b, w, bias, algo, cond=1e4)
    check_backward(x, g, b, w, bias, dy, cond=1e4)


def test_nan_propagates(device: str) -> None:
    x, g, b, w, bias, _ = make((4,), 300, 20, torch.float32, device)
    x[1, 17] = float("nan")
    for algo in LL.algo.algos_for(x, w):
        y, _, _ = LL.layernorm_linear_fwd(x, g, b, w, bias, algo=algo)
        assert torch.isnan(y[1]).all(), algo
        assert compare(y[[0, 2, 3]], layernorm_linear_ref(x[[0, 2, 3]], g, b, w, bias), torch.float32, 300) is None


def test_backward_is_deterministic(device: str) -> None:
    rows = 4096 if device == "cuda" else 200
    x, g, b, w, bias, dy = make((rows,), 512, 96, torch.float32, device)
    _, mean, rstd = LL.layernorm_linear_fwd(x, g, b, w, bias)
    first = LL.layernorm_linear_bwd(dy, x, g, b, w, mean, rstd)
    for _ in range(10):
        again = LL.layernorm_linear_bwd(dy, x, g, b, w, mean, rstd)
        for a, gv in zip(first, again, strict=True):
            assert torch.equal(a, gv)


def torch_block(k: int, n: int, device: str, bias: bool = True) -> nn.Sequential:
    seq = nn.Sequential(nn.LayerNorm(k, eps=1e-6), nn.Linear(k, n, bias=bias)).to(device)
    with torch.no_grad():
        seq[0].weight.normal_(1.0, 0.2)
        seq[0].bias.normal_(0.0, 0.2)
    return seq


@pytest.mark.parametrize(("bias", "algo"), [(True, "auto"), (True, "fused"), (False, "unfused")])
def test_module_matches_sequential(device: str, bias: bool, algo: str) -> None:
    seq = torch_block(48, 20, device, bias)
    ours = LL.FusedLayerNormLinear.from_torch(seq, algo=algo)
    assert ours.state_dict().keys() == seq.state_dict().keys()
    x = torch.randn(2, 5, 48, device=device, requires_grad=True)
    y = ours(x)
    lin_bias = seq[1].bias if bias else torch.zeros(20, device=device)
    want = layernorm_linear_ref(x.detach(), seq[0].weight, seq[0].bias, seq[1].weight, lin_bias, eps=1e-6)
    assert compare(y, want, torch.float32, 48) is None
    dy = torch.randn_like(y)
    params = [x, *ours.parameters()]
    got = torch.autograd.grad(y, params, dy)
    ref = layernorm_linear_grads_ref(x, seq[0].weight, seq[0].bias, seq[1].weight, lin_bias, dy, eps=1e-6)
    for gv, r in zip(got, ref, strict=False):  # without bias, ref's last entry (dbias) has no parameter
        assert compare(gv, r, torch.float32, reduction=48 * 20) is None


def test_compile_fullgraph(device: str, compiled_layernorm: str) -> None:
    ours = LL.FusedLayerNormLinear(64, 24, device=device)
    x = torch.randn(5, 64, device=device, requires_grad=True)
    y = compiled_double(ours, x, compiled_layernorm)
    ln, lin = ours[0], ours[1]
    assert compare(y, 2.0 * layernorm_linear_ref(x.detach(), ln.weight, ln.bias, lin.weight, lin.bias),
                   torch.float32, 64) is None
    ref_dx = layernorm_linear_grads_ref(x, ln.weight, ln.bias, lin.weight, lin.bias, torch.full_like(y, 2.0))[0]
    assert compare(x.grad, ref_dx, torch.float32, reduction=64 * 24, cond=10.0) is None


def test_opcheck() -> None:
    x, g, b, w, bias, dy = make((3,), 32, 8, torch.float32, "cpu")
    utils = ("test_schema", "test_faketensor")
    fwd, bwd = torch.ops.mojo.layernorm_linear_fwd.default, torch.ops.mojo.layernorm_linear_bwd.default
    torch.library.opcheck(fwd, (x, g, b, w, bias, 1e-5, "auto"), test_utils=utils)
    _, mean, rstd = LL.layernorm_linear_fwd(x, g, b, w, bias)
    xn = F.layer_norm(x, (32,), g, b)
    torch.library.opcheck(bwd, (dy, x, xn, g, b, w, mean, rstd), test_utils=utils)


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "algo"), [(torch.bfloat16, "sm90"), (torch.float32, "fused")])
def test_gpu_opcheck(dtype: torch.dtype, algo: str) -> None:
    """The custom op on the GPU's fused and Hopper forwards (the C++ entry's outputs): schema (no output aliases
    another or an input) and fake tensors, on a first call (Python hands over the plan) and a second."""
    x, g, b, w, bias, _ = make((2, 64), 64, 32, dtype, "cuda")
    for _ in range(2):
        torch.library.opcheck(torch.ops.mojo.layernorm_linear_fwd.default, (x, g, b, w, bias, 1e-5, algo),
                              test_utils=("test_schema", "test_faketensor"))


def test_bad_inputs() -> None:
    x, g, b, w, bias, dy = make((4,), 16, 8, torch.float32, "cpu")
    cases = [
        ((x, g, b, w[:, :15], bias), ValueError, "weight"),       # K mismatch
        ((x, g, b, w, bias[:7]), ValueError, "bias"),
        ((x, g[:15], b, w, bias), ValueError, "ln_weight"),
        ((x, g, b.half(), w, bias), TypeError, "ln_bias"),
        ((x, g, b, w.bfloat16(), bias), TypeError, "weight"),      # dtype mix
        ((x, g, b, w.t(), bias), ValueError, "weight"),            # strides (and shape)
        ((x, g, b, w[0], bias), ValueError, "weight"),
        ((x.double(), g, b, w, bias), TypeError, "x"),
    ]
    for args, err, name in cases:
        with pytest.raises(err, match=f"^{name}:"):
            LL.layernorm_linear_fwd(*args)
    with pytest.raises(ValueError, match="^algo:"):
        LL.layernorm_linear_fwd(x, g, b, w, bias, algo="nope")
    with pytest.raises(TypeError, match="^eps:"):
        LL.layernorm_linear_fwd(x, g, b, w, bias, eps=None)
    _, mean, rstd = LL.layernorm_linear_fwd(x, g, b, w, bias)
    with pytest.raises(ValueError, match="^dy:"):
        LL.layernorm_linear_bwd(dy[:, :7], x, g, b, w, mean, rstd)
    with pytest.raises(TypeError, match="^seq:"):
        LL.FusedLayerNormLinear.from_torch(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))


@pytest.mark.gpu
def test_mixed_devices_rejected() -> None:
    x, g, b, w, bias, _ = make((4,), 16, 8, torch.float32, "cuda")
    with pytest.raises(ValueError, match="^weight:"):
        LL.layernorm_linear_fwd(x, g, b, w.cpu(), bias)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LL.DTYPES, ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_shapes(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Transformer-sized shapes: every algorithm that takes them (and auto's pick) forward, and the backward."""
    x, g, b, w, bias, dy = make(shape[:-2], shape[-2], shape[-1], dtype, "cuda")
    for algo in LL.algo.algos_for(x.view(-1, x.shape[-1]), w):
        check_forward(x, g, b, w, bias, algo)
    check_backward(x, g, b, w, bias, dy)


UPDATE_WAYS = ("inplace_no_grad", "data_write", "data_assign", "set_", "load_state_dict", "adamw_foreach",
               "adamw_fused", "sgd_fused", "parametrize", "to_and_back")


class _Scale(nn.Module):
    """A parametrization: weight * s, with s [N, 1] a parameter of its own."""

    def __init__(self, n: int, ref: torch.Tensor) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.ones(n, 1, dtype=ref.dtype, device=ref.device))

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * self.s


def update(m: LL.FusedLayerNormLinear, way: str, x: torch.Tensor) -> None:
    """Change every parameter of m (LayerNorm and Linear) one way a user can."""
    ln, lin = m[0], m[1]
    params = (lin.weight, ln.weight, lin.bias, ln.bias)
    if way == "inplace_no_grad":
        with torch.no_grad():
            for p in params:
                p.mul_(1.5).add_(0.25)
    elif way == "data_write":   # does not bump the parameter's version counter
        for p in params:
            p.data.mul_(1.5).add_(0.25)
    elif way in ("data_assign", "set_"):   # a new tensor in the parameter's place
        with torch.no_grad():
            for p in params:
                v = p.detach() * 1.5 + 0.25
                if way == "set_":
                    p.set_(v)
                else:
                    p.data = v
    elif way == "load_state_dict":
        m.load_state_dict({k: v * 1.5 + 0.25 for k, v in m.state_dict().items()})
    elif way in ("adamw_foreach", "adamw_fused", "sgd_fused"):
        m(x).float().square().mean().backward()
        # AdamW moves each parameter by about lr (eps 1e-3: the default 1e-8 is 0 in float16, which turns a
        # zero second moment into NaN); SGD's lr, per parameter, makes each one's mean step 0.2
        if way == "sgd_fused":
            groups = [{"params": [p], "lr": 0.2 / float(p.grad.float().abs().mean())} for p in m.parameters()]
            opt = torch.optim.SGD(groups, lr=0.1, fused=True)
        else:
            kw = {"foreach": True} if way == "adamw_foreach" else {"fused": True}
            opt = torch.optim.AdamW(m.parameters(), lr=0.05, eps=1e-3, **kw)
        opt.step()
        opt.zero_grad()
    elif way == "parametrize":   # registered before the first call (see weight_update_module); s changes by .data
        lin.parametrizations.weight[0].s.data.mul_(1.5)
        for p in params[1:]:
            p.data.add_(0.25)
    elif way == "to_and_back":   # moved away (CPU, or float32 on the CPU), changed there, moved back
        dtype, device = lin.weight.dtype, lin.weight.device
        other = {"device": "cpu"} if device.type == "cuda" else {
            "dtype": torch.float32 if dtype != torch.float32 else torch.bfloat16}
        m.to(**other)
        for p in m.parameters():
            p.data.mul_(1.5).add_(0.25)
        m.to(device=device, dtype=dtype)
    else:
        raise AssertionError(way)


def weight_update_module(algo: str, dtype: torch.dtype, device: str, way: str) -> tuple:
    """A FusedLayerNormLinear and x, dy at a shape where ``algo`` runs its kernel (on the GPU, bf16 auto in
    inference runs sm90: the route the stale-weight report found)."""
    rows = LLC.SM90_MIN_ROWS if algo == "auto" and dtype == torch.bfloat16 else 4096
    lead, k, n = ((rows,), 256, 768) if device == "cuda" else ((37,), 64, 24)
    torch.manual_seed(0)
    m = LL.FusedLayerNormLinear(k, n, device=device, dtype=dtype, algo=algo)
    with torch.no_grad():
        m[0].weight.copy_(1.0 + 0.2 * torch.randn(k))
        m[0].bias.copy_(0.2 * torch.randn(k))
    if way == "parametrize":
        torch.nn.utils.parametrize.register_parametrization(m[1], "weight", _Scale(n, m[1].bias))
    x, *_, dy = make(lead, k, n, dtype, device)
    return m, x, dy


def params_now(m: LL.FusedLayerNormLinear) -> tuple[torch.Tensor, ...]:
    """ln_weight, ln_bias, weight (as the forward sees it), bias: the parameters as they are now."""
    return m[0].weight.detach(), m[0].bias.detach(), m[1].weight.detach(), m[1].bias.detach()


@pytest.mark.parametrize("way", UPDATE_WAYS)
@pytest.mark.parametrize("dtype", LL.DTYPES, ids=str)
@pytest.mark.parametrize("algo", LL.ALGOS)
def test_weight_update(device: str, algo: str, dtype: torch.dtype, way: str) -> None:
    """After any change a user can make to the parameters, forward (inference and autograd) and backward
    match float64 on the new parameters: nothing derived from the old weights is served. The old output
    fails against the new reference, so a stale answer could not pass."""
    if algo == "sm90" and (device != "cuda" or dtype != torch.bfloat16 or not LL.algo.is_sm90(torch.device(device))):
        pytest.skip("algo sm90 takes bfloat16 on an sm_90 GPU only")
    m, x, dy = weight_update_module(algo, dtype, device, way)
    with torch.no_grad():
        before = m(x)
    m(x.clone().requires_grad_()).backward(dy)   # a training call too, before the change
    m.zero_grad()
    update(m, way, x)
    g, b, w, bias = params_now(m)
    ref = layernorm_linear_ref(x, g, b, w, bias)
    k = x.shape[-1]
    where = f"algo {algo}, {dtype}, {device}, after {way}"
    assert compare(before, ref, dtype, reduction=k) is not None, f"{where}: the update changed nothing"
    with torch.no_grad():
        assert (bad := compare(m(x), ref, dtype, reduction=k)) is None, f"inference, {where}: {bad}"
    xl = x.clone().requires_grad_()
    with torch.nn.utils.parametrize.cached():
        weight = m[1].weight
        y = m(xl)
        assert (bad := compare(y, ref, dtype, reduction=k)) is None, f"autograd forward, {where}: {bad}"
        got = torch.autograd.grad(y, (xl, m[0].weight, m[0].bias, weight, m[1].bias), dy)
    check_grads(got, x, g, b, w, bias, dy, where=where)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("activation", "transposed"),
                         [("gelu_tanh", False), ("gelu_tanh", True), ("gelu", False), ("relu", True)])
def test_layernorm_linear_act_values_and_gradients(device: str, dtype: torch.dtype, activation: str,
                                                   transposed: bool) -> None:
    """layernorm_linear_act (a GPU's C++ op, else layernorm_linear then the activation) and the C++ op itself, with a
    [N, K] weight and with the transpose of a [K, N] one (GPT-2's Conv1D), for each activation: values and all five
    gradients against float64 autograd of the reference, rows with a large mean among them, on outputs poisoned
    first."""
    torch.manual_seed(0)
    rows, k, n = 37, 96, 136
    x = (torch.randn(rows, k) + torch.where(torch.arange(rows) % 5 == 0, 40.0, 0.0)[:, None]).to(device, dtype)
    g, b = (1 + 0.1 * torch.randn(k)).to(device, dtype), (0.1 * torch.randn(k)).to(device, dtype)
    w = (torch.randn(k, n) / k**0.5).mT if transposed else torch.randn(n, k) / k**0.5
    w = w.to(device, dtype)
    bias = (0.1 * torch.randn(n)).to(device, dtype)
    dy = torch.randn(rows, n, device=device, dtype=dtype)
    leaves = [t.detach().requires_grad_() for t in (x, g, b, w, bias)]
    ref = layernorm_linear_act_ref(*(t.double() for t in leaves), activation=activation)
    fns = [lambda *t: LL.layernorm_linear_act(*t, activation=activation)]
    if direct.load_native().ops is not None:
        code = LLC.TRACED_ACTS[activation]
        fns.append(lambda *t: torch.ops.mojo_direct.traced_layernorm_linear(*t, 1e-5, code))
    for fn in fns:
        with torch.no_grad():   # the C++ entry's forward without an autograd node
            assert (m := compare(fn(*leaves), ref, dtype, reduction=k)) is None, f"no_grad: {m}"
        y = fn(*leaves)
        assert y.dtype == dtype and (m := compare(y, ref, dtype, reduction=k)) is None, m
        # ReLU's gradient jumps at 0: the reference takes its kink where the op's rounded pre-activation does
        lin = layernorm_linear_act_ref(*(t.double() for t in leaves), activation="none")
        want = torch.autograd.grad(lin * (y.detach() > 0) if activation == "relu" else activation_ref(lin, activation),
                                   leaves, dy.double())
        got = torch.autograd.grad(y, leaves, dy)
        for name, a, r in zip(("dx", "dln_weight", "dln_bias", "dweight", "dbias"), got, want, strict=True):
            cond = float(layernorm_stats_ref(x)[1].max()) if name == "dx" else 4.0
            assert (m := compare(a, r, dtype, reduction=max(rows, n), cond=cond)) is None, f"{name}: {m}"

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("biased", [True, False])
def test_linears_values_and_gradients(device: str, dtype: torch.dtype, biased: bool) -> None:
    """linears (a GPU's C++ op, else F.linear each) and the C++ op itself: three projections of one input (odd
    sizes) against float64 autograd, x's gradient the sum over the three; an output left out of the loss gives its
    weight and bias no gradient, as F.linear each does."""
    torch.manual_seed(0)
    rows, k, ns = 37, 96, (136, 24, 24)
    x = torch.randn(rows, k, device=device, dtype=dtype)
    ws = [(torch.randn(n, k) / k**0.5).to(device, dtype) for n in ns]
    bs = [(0.1 * torch.randn(n)).to(device, dtype) for n in ns] if biased else []
    dys = [torch.randn(rows, n, device=device, dtype=dtype) for n in ns]
    fns = [lambda x, ws, bs: LL.linears(x, ws, bs or None)]
    if direct.load_native().ops is not None:
        fns.append(torch.ops.mojo_direct.traced_linears)
    for fn in fns:
        leaves = [t.detach().requires_grad_() for t in (x, *ws, *bs)]
        lx, lws, lbs = leaves[0], leaves[1:4], leaves[4:]
        refs = [F.linear(lx.double(), w.double(), b.double() if biased else None)
                for w, b in zip(lws, lbs if biased else [None] * 3, strict=True)]
        want = torch.autograd.grad(refs[:2], leaves, [dy.double() for dy in dys[:2]], allow_unused=True)
        with torch.no_grad():
            for y, r in zip(fn(lx, lws, lbs), refs, strict=True):
                assert (m := compare(y, r, dtype, reduction=k)) is None, f"no_grad: {m}"
        ys = fn(lx, lws, lbs)
        for y, r in zip(ys, refs, strict=True):
            assert y.dtype == dtype and (m := compare(y, r, dtype, reduction=k)) is None, m
        got = torch.autograd.grad(ys[:2], leaves, dys[:2], allow_unused=True)   # the third output unused
        for i, (a, r) in enumerate(zip(got, want, strict=True)):
            if r is None:
                assert a is None, f"leaf {i}: a gradient for an unused output"
            else:
                assert (m := compare(a, r, dtype, reduction=max(rows, k))) is None, f"leaf {i}: {m}"


def test_traced_linears_wants_a_bias_per_weight_or_none() -> None:
    """The C++ op itself (what torch.compile's graphs call), with and without autograd: one bias for two weights is
    refused by name."""
    if direct.load_native().ops is None:
        pytest.skip("the C++ launcher is not built here")
    x = torch.randn(3, 8, requires_grad=True)
    ws, bs = [torch.randn(4, 8), torch.randn(5, 8)], [torch.randn(4)]
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(RuntimeError, match="as many biases as weights, or none"):
            torch.ops.mojo_direct.traced_linears(x, ws, bs)


@pytest.mark.parametrize(("weights", "biases", "err", "name"), [
    ("not a list", None, TypeError, "weights"),
    ([], None, TypeError, "weights"),
    ([torch.ones(3, 8), torch.ones(3, 7)], None, ValueError, "weights[1]"),
    ([torch.ones(3, 8)], [torch.ones(3), torch.ones(3)], TypeError, "biases"),
    ([torch.ones(3, 8)], [torch.ones(4)], ValueError, "biases[0]"),
    ([torch.ones(3, 8, dtype=torch.float16)], None, TypeError, "weights[0]"),
])
def test_linears_bad_input_named(weights: object, biases: object, err: type[Exception], name: str) -> None:
    with pytest.raises(err, match=rf"^{re.escape(name)}:"):
        LL.linears(torch.ones(2, 8), weights, biases)
