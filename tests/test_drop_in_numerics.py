"""Drop-in numerics (CPU, and the GPU where present): what torch's LayerNorm and Linear compute from strided,
negated, empty, mixed-precision, autocast, constant, NaN/inf, float64 and long inputs, ours computes, against float64
(``ops.reference``) with the dtype tolerance table; outputs are poisoned (conftest)."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.parametrizations
import torch.nn.utils.prune
from drop_in_helpers import dtypes, leaves, lnl_ref, ours_of, pair
from torch import nn

from ops import inputs
from ops import layernorm as L
from ops import layernorm_linear as LL
from ops.reference import layernorm_grads_ref
from ops.tolerance import compare

HALF = [torch.float16, torch.bfloat16]


def _grads(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], dy_seed: int = 1
           ) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """fn(*inputs) and the gradients of <fn(...), dy> for the inputs that require one (dy random, fixed seed)."""
    y = fn(*inputs)
    g = torch.Generator(device="cpu").manual_seed(dy_seed)
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.device, y.dtype)
    wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = torch.autograd.grad(y, wrt, dy, allow_unused=True) if y.numel() or wrt else ()
    return y, tuple(grads)


def _check_against_float64(ours: Callable[..., torch.Tensor], ref: Callable[..., torch.Tensor],
                           inputs: list[torch.Tensor | None], dtype: torch.dtype, reduction: int = 64) -> None:
    """ours(*inputs) and its gradients equal ref on the float64 copies of the inputs, within the table; each
    gradient in its input's dtype."""
    mine = leaves(*inputs)
    y, grads = _grads(ours, mine)
    want_y, want_grads = _grads(ref, leaves(*(None if t is None else t.double() for t in inputs)))
    assert y.dtype == dtype, f"output dtype {y.dtype}, expected {dtype}"
    assert (m := compare(y, want_y, dtype, reduction=4)) is None, f"y: {m}"
    for i, (g, w, t) in enumerate(zip(grads, want_grads, [t for t in mine if t is not None], strict=True)):
        assert g.dtype == t.dtype and g.shape == t.shape, f"grad {i}: {g.dtype} {tuple(g.shape)}"
        assert (m := compare(g, w, dtype, reduction=reduction)) is None, f"grad {i}: {m}"


def _strided_views(device: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    base = torch.randn(6, 5, 40, device=device)
    return {"transposed": base.transpose(0, 1), "cls-slice": base[:, 0], "every-other-row": base[::2],
            "expanded": torch.randn(40, device=device).expand(3, 4, 40),
            "last-dim-strided": torch.randn(6, 80, device=device)[:, ::2]}


@pytest.mark.parametrize("view", ["transposed", "cls-slice", "every-other-row", "expanded", "last-dim-strided"])
def test_strided_layernorm(device: str, view: str) -> None:
    x = _strided_views(device)[view]
    w, b = torch.randn(40, device=device), torch.randn(40, device=device)
    _check_against_float64(L.layernorm, lambda x, w, b: F.layer_norm(x, (40,), w, b), [x, w, b], torch.float32)
    _check_against_float64(lambda x: L.LayerNorm(40, device=device)(x), lambda x: F.layer_norm(x, (40,)), [x],
                           torch.float32)
    y, mean, rstd = L.layernorm_fwd(x, w, b)
    assert compare(y, F.layer_norm(x.double(), (40,), w.double(), b.double()), torch.float32) is None
    torch.testing.assert_close(torch.ops.mojo.layernorm_fwd(x, w, b, 1e-5, "fast", "none")[0], y, rtol=0, atol=0)
    dy = torch.randn_like(x).transpose(0, -1).contiguous().transpose(0, -1)   # a strided dy too
    got = L.layernorm_bwd(dy, x, w, b, mean, rstd)
    for g, want in zip(got, layernorm_grads_ref(x, w, b, dy), strict=True):
        assert (m := compare(g, want, torch.float32, reduction=64)) is None, m


@pytest.mark.parametrize("view", ["transposed", "cls-slice", "expanded"])
def test_strided_layernorm_linear(device: str, view: str) -> None:
    x = _strided_views(device)[view]
    g, b, w, bias = (torch.randn(*s, device=device) for s in ((40,), (40,), (24, 40), (24,)))
    _check_against_float64(LL.layernorm_linear, lnl_ref, [x, g, b, w, bias], torch.float32)
    y, mean, rstd = LL.layernorm_linear_fwd(x, g, b, w.t().contiguous().t(), bias[None].expand(2, 24)[1])
    assert compare(y, lnl_ref(x.double(), g.double(), b.double(), w.double(), bias.double()), torch.float32,
                   reduction=4) is None
    grads = LL.layernorm_linear_bwd(torch.ones_like(y).transpose(0, -1).contiguous().transpose(0, -1), x, g, b,
                                    w, mean, rstd)
    assert compare(grads[4], torch.ones_like(y).sum(tuple(range(y.dim() - 1))), torch.float32, reduction=96) is None


def _negative_views(device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """[4, 3, 12] tensors whose memory is not their values: views with the negative bit (the memory holds the
    negated values; ``z.conj().imag`` makes a strided one, torch's private ``_neg_view`` a contiguous one), and an
    efficient zero tensor (no memory at all)."""
    torch.manual_seed(0)
    views = {"contiguous-negative": torch.randn(4, 3, 12, device=device, dtype=dtype)._neg_view(),
             "zero-tensor": torch._efficientzerotensor((4, 3, 12), device=device, dtype=dtype)}
    if dtype == torch.float32:
        views["conj-imag"] = torch.randn(4, 3, 12, device=device, dtype=torch.complex64).conj().imag
    return views


def test_negative_and_zero_views_read_as_their_values(device: str) -> None:
    """A view whose memory holds the negated values (the negative bit: ``z.conj().imag``) or none (an efficient zero
    tensor) is read as its values, as torch's ops read it, on every entry (x, a parameter, an upstream gradient):
    the modules' outputs and gradients are the float64 model's on the resolved values. Our kernels read memory, so
    these take torch's ops. Before: a contiguous negative view (torch's private ``_neg_view``; a one-element
    ``.imag``) was read as the negated values, silently (a strided one was right: the copy that made it contiguous
    resolved it), and a zero tensor crashed the CPU route (its null address)."""
    for dtype in dtypes(device):
        theirs, ours = pair(device, dtype)
        ref = copy.deepcopy(theirs).double()
        for name, x in _negative_views(device, dtype).items():
            for _ in range(2):   # on a GPU, a shape's later calls take the C++ route
                y, want = ours(x), ref(x.double())
                assert (m := compare(y, want, dtype, reduction=4)) is None, f"{name} {dtype}: {m}"
                dy = torch.randn_like(want)
                got = torch.autograd.grad(y, list(ours.parameters()), dy.to(dtype))
                for g, w in zip(got, torch.autograd.grad(want, list(ref.parameters()), dy), strict=True):
                    assert (m := compare(g, w, dtype, reduction=64)) is None, f"{name} {dtype} grad: {m}"
    x, dy = torch.randn(2, 5, 12, device=device), torch.randn(2, 5, 12, device=device)
    g, b, w, bias = (torch.randn(*s, device=device) for s in ((12,), (12,), (7, 12), (7,)))
    neg = {"x": x._neg_view(), "g": g._neg_view(), "w": w._neg_view(), "dy": dy._neg_view()}
    want = F.layer_norm(-x.double(), (12,), g.double(), b.double())
    for y in (L.layernorm_fwd(neg["x"], g, b)[0], L.layernorm(neg["x"], g, b), L.layer_norm(neg["x"], (12,), g, b)):
        assert compare(y, want, torch.float32) is None
    assert compare(L.layernorm(x, neg["g"], b), F.layer_norm(x.double(), (12,), -g.double(), b.double()),
                   torch.float32) is None
    _, mean, rstd = L.layernorm_fwd(x, g, b)
    for got, ref_grad in zip(L.layernorm_bwd(neg["dy"], x, g, b, mean, rstd), layernorm_grads_ref(x, g, b, -dy),
                             strict=True):
        assert compare(got, ref_grad, torch.float32, reduction=64) is None
    want = lnl_ref(x.double(), g.double(), b.double(), -w.double(), bias.double())
    for y in (LL.layernorm_linear(x, g, b, neg["w"], bias), LL.layernorm_linear_fwd(x, g, b, neg["w"], bias)[0]):
        assert compare(y, want, torch.float32, reduction=4) is None
    want = lnl_ref(-x.double(), g.double(), b.double(), w.double(), bias.double())
    assert compare(LL.layernorm_linear(neg["x"], g, b, w, bias), want, torch.float32, reduction=4) is None


def test_sparse_inputs_get_named_errors(device: str) -> None:
    """A sparse x (torch's LayerNorm refuses one too) gets our named error from the modules, on a GPU's C++ route
    as well (which asked a sparse x for its strides); test_bad_inputs covers every entry on the CPU."""
    x = torch.randn(4, 12, device=device)
    with warnings.catch_warnings():   # torch's sparse CSR support warns that it is in beta
        warnings.simplefilter("ignore")
        sparse = [x.to_sparse(), x.to_sparse_csr()]
    for module in (L.LayerNorm(12, device=device), LL.FusedLayerNormLinear(12, 5, device=device)):
        module(x)   # a plan for the shape, on a GPU
        for s in sparse:
            with pytest.raises(ValueError, match=r"^x: layout torch\.sparse_(coo|csr) is not supported"):
                module(s)


@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 16), (3, 0)])
def test_empty_layernorm(device: str, shape: tuple[int, ...]) -> None:
    h = shape[-1]
    x, w, b = leaves(torch.randn(shape, device=device), torch.randn(h, device=device), torch.randn(h, device=device))
    y = L.layernorm(x, w, b)
    want = F.layer_norm(x.detach(), (h,), w.detach(), b.detach())
    assert y.shape == want.shape and y.dtype == want.dtype
    y.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, 0 * b)
    y2, mean, rstd = L.layernorm_fwd(x.detach(), w.detach(), b.detach())
    assert y2.shape == x.shape and mean.shape == rstd.shape == x.shape[:-1]
    dx, dw, db = L.layernorm_bwd(torch.ones_like(y2), x.detach(), w.detach(), b.detach(), mean, rstd)
    assert dx.shape == x.shape and not dw.any() and not db.any()


@pytest.mark.parametrize("rows_k_n", [(0, 16, 8), (3, 16, 0), (3, 0, 4)])
def test_empty_layernorm_linear(device: str, rows_k_n: tuple[int, int, int]) -> None:
    rows, k, n = rows_k_n
    torch.manual_seed(0)
    inputs = [torch.randn(*s, device=device) for s in ((rows, k), (k,), (k,), (n, k), (n,))]
    mine, theirs = leaves(*inputs), leaves(*inputs)
    y, want = LL.layernorm_linear(*mine), lnl_ref(*theirs)
    assert y.shape == want.shape
    torch.testing.assert_close(y, want)   # K = 0: y is the bias, as torch's
    y.sum().backward()
    want.sum().backward()
    for a, t in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a.grad, t.grad)
    y2, mean, rstd = LL.layernorm_linear_fwd(*inputs)
    assert y2.shape == want.shape
    grads = LL.layernorm_linear_bwd(torch.ones_like(y2), *inputs[:4], mean, rstd)
    for g, t in zip(grads, theirs, strict=True):
        torch.testing.assert_close(g, t.grad)


def test_layer_norm_is_functional_layer_norm(device: str) -> None:
    x, w = torch.randn(4, 3, 6, device=device), torch.randn(3, 6, device=device)
    _check_against_float64(lambda x, w: L.layer_norm(x, (3, 6), w, None, 1e-3),
                           lambda x, w: F.layer_norm(x, (3, 6), w, None, 1e-3), [x, w], torch.float32)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_mixed_precision_layernorm(device: str, dtype: torch.dtype) -> None:
    """16-bit x with float32 gamma and beta: output in x's dtype, each gradient in its input's dtype."""
    x = (torch.randn(8, 64, device=device) * 2 + 1).to(dtype)
    w, b = torch.randn(64, device=device), torch.randn(64, device=device)
    _check_against_float64(L.layernorm, lambda x, w, b: F.layer_norm(x, (64,), w, b), [x, w, b], dtype)
    ln = L.LayerNorm(64, device=device)
    assert ln(x).dtype == dtype


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_mixed_precision_layernorm_linear(device: str, dtype: torch.dtype) -> None:
    """A float32 LayerNorm before a 16-bit Linear, as models trained in mixed precision hold them."""
    x = torch.randn(8, 64, device=device).to(dtype)
    g, b = torch.randn(64, device=device), torch.randn(64, device=device)
    w, bias = (torch.randn(16, 64, device=device) / 8).to(dtype), torch.randn(16, device=device).to(dtype)
    _check_against_float64(LL.layernorm_linear, lnl_ref, [x, g, b, w, bias], dtype, reduction=512)


def _autocast_pair(device: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    theirs = nn.Sequential(nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 32)), nn.GELU(), nn.LayerNorm(32)).to(device)
    for p in theirs.parameters():
        nn.init.normal_(p, std=0.5)
    return theirs, ours_of(theirs)


def test_autocast_parity(device: str) -> None:
    """Under torch.autocast our modules give the dtypes torch's give, and their values (float32 parameters)."""
    theirs, ours = _autocast_pair(device)
    x = torch.randn(4, 8, 64, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        mine, ref = leaves(x), leaves(x)
        y, want = ours(*mine), theirs(*ref)
        inner, inner_want = ours[0](x), theirs[0](x)
    assert (y.dtype, inner.dtype) == (want.dtype, inner_want.dtype)
    torch.testing.assert_close(inner, inner_want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y, want, rtol=2e-2, atol=2e-2)
    y.float().sum().backward()
    want.float().sum().backward()
    torch.testing.assert_close(mine[0].grad, ref[0].grad, rtol=3e-2, atol=3e-2)
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert p.grad.dtype == q.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, q.grad, rtol=3e-2, atol=0.1 * q.grad.abs().max().item())


CONSTANTS = (0.1, -3.3, 1.0 / 3.0, 1e4 + 0.1, 7e-6)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
def test_constant_rows_give_bias(device: str, dtype: torch.dtype) -> None:
    """A row of one value c has mean exactly c, so y is exactly beta: every forward variant, widths on each side of
    the register forward's limits (8192 16-bit values; longer rows take the cluster forward), values whose sums
    round in fp32; float32 rows of 4096 or more take the plain mean at power-of-two lengths, the corrected one at
    others (5000)."""
    variants = L.VARIANTS if device == "cuda" else ("fast",)
    for h in (256, 768, 1000, 4096, 5000, 8192, 16384):
        x = torch.tensor(CONSTANTS, dtype=torch.float64)[:, None].expand(-1, h).to(device, dtype)
        w, b = torch.randn(h, device=device, dtype=dtype), torch.randn(h, device=device, dtype=dtype)
        for variant in variants:
            y = L.layernorm_fwd(x, w, b, variant=variant)[0]
            assert torch.equal(y, b.expand_as(x)), f"{variant}, {dtype}, h {h}: {(y - b).abs().amax(1).tolist()}"


def _pairwise_sum(a: torch.Tensor) -> torch.Tensor:
    """Sum over the last (power-of-two) dim in halves: the order of Mojo's SIMD ``reduce_add`` and a butterfly
    ``warp.sum``, in float32."""
    while a.shape[-1] > 1:
        a = a[..., : a.shape[-1] // 2] + a[..., a.shape[-1] // 2:]
    return a[..., 0]


def _row_group_sum(per_thread: torch.Tensor, wpr: int, pairwise: bool = False) -> torch.Tensor:
    """``group_sum`` over [B, GT] per-thread partials: each warp's, then the WPR warps' in order (or, with
    ``pairwise``, in halves: ``warp_partials_sum``)."""
    warps = _pairwise_sum(per_thread.view(-1, wpr, 32))
    if pairwise:
        return _pairwise_sum(warps)
    total = torch.zeros_like(warps[:, 0])
    for w in range(wpr):
        total = total + warps[:, w]
    return total


def _register_forward_means(c: torch.Tensor, h: int, vec: int, ch: int, wpr: int,
                            pairwise: bool = False) -> tuple[torch.Tensor, ...]:
    """float32 model of ``ln_fwd_regs``'s mean of rows of the values c: the plain mean m0 (its warps' sums added
    pairwise or in order) and the corrected m0 + sum(x - m0) / h, with the kernel's partial sums in its order
    (thread gt holds chunks gt + k * GT)."""
    gt = wpr * 32
    row = torch.zeros(len(c), ch * gt * vec)
    row[:, :h] = c[:, None]
    held = row.view(-1, ch, gt, vec).transpose(1, 2)                  # [B, GT, CH, VEC]
    m0 = _row_group_sum(_pairwise_sum(held.reshape(-1, gt, ch * vec)), wpr, pairwise) / h
    d = held - m0[:, None, None, None]
    live = torch.arange(ch)[None, :] * gt + torch.arange(gt)[:, None] < h // vec   # [GT, CH]
    per = torch.zeros(len(c), gt)
    for k in range(ch):
        per = per + torch.where(live[:, k], _pairwise_sum(d[:, :, k, :]), 0.0)
    return m0, m0 + _row_group_sum(per, wpr) / h


def test_register_forward_mean_is_exact_for_constant_rows() -> None:
    """The argument behind ``ln_fwd_regs``'s mean of float32 rows of 4096 values or more (docs/kernels/layernorm.md),
    checked in float32 with the kernel's summation order at widths whose launch takes it: the plain mean, summed
    pairwise, is exact for a constant row of power-of-two length (the kernel takes it there) and often a few ulps off
    at other lengths, where the corrected one, which the kernel takes there, never is."""
    from ops.layernorm import config as layernorm_config
    g = torch.Generator().manual_seed(0)
    c = (torch.randn(300, generator=g, dtype=torch.float64)
         * 10.0 ** torch.randint(-6, 6, (300,), generator=g)).float()
    c = torch.cat([c, torch.tensor(CONSTANTS)])
    plain_off = 0
    for h in (2052, 3000, 4096, 5000, 6144, 8192, 16384):
        spec = layernorm_config.fwd_launch(4096, h, torch.float32, True).spec(torch.float32, 0)
        _, _, vec, ch, wpr, _ = spec.params
        assert spec.name == "ln_fwd_regs" and ch * vec * wpr * 32 >= 4096, spec.expr
        m0, mean = _register_forward_means(c, h, vec, ch, wpr, pairwise=True)
        if h & (h - 1) == 0:
            assert torch.equal(m0, c), f"h {h}: plain mean off for {c[m0 != c].tolist()}"
            in_order, _ = _register_forward_means(c, h, vec, ch, wpr)
            assert not torch.equal(in_order, c)   # the warps' sums in order would round
        else:
            assert torch.equal(mean, c), f"h {h}: corrected mean off for {c[mean != c].tolist()}"
            plain_off += int((m0 != c).sum())
    assert plain_off > 50   # the plain mean would fail there: the model sees the rounding the correction removes


@pytest.mark.parametrize(("dtype", "widths"), [(torch.bfloat16, (8192, 16384, 32768, 65536)),
                                               (torch.float16, (4096, 8192))], ids=str)
def test_register_forward_plain_mean_of_16_bit_rows_is_exact(dtype: torch.dtype, widths: tuple[int, ...]) -> None:
    """Where ``ln_fwd_regs`` keeps the plain mean of 16-bit rows (PLAIN_EXACT: bf16 rows up to 65536 values, fp16
    up to 8192), each partial sum of a constant row is exact in float32 (8 + 16 and 11 + 13 significant bits), so
    the mean is the value; a float32 row of the same widths is the control, whose plain mean rounds."""
    g = torch.Generator().manual_seed(1)
    c = (torch.randn(200, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-4, 4, (200,), generator=g))
    c16 = c.to(dtype).float()
    c32 = c.float()
    for h in widths:
        m0, _ = _register_forward_means(c16, h, 8, h // 4096 if h >= 4096 else 1, 16)
        assert torch.equal(m0, c16), f"{dtype} h {h}: plain mean off for {c16[m0 != c16].tolist()}"
        control, _ = _register_forward_means(c32, h, 8, h // 4096 if h >= 4096 else 1, 16)
        assert not torch.equal(control, c32)


def test_nan_and_inf_propagate_as_torch(device: str) -> None:
    x = torch.randn(4, 32, device=device)
    x[1, 3], x[2, 5] = float("nan"), float("inf")
    w, b = torch.ones(32, device=device), torch.zeros(32, device=device)
    y, want = L.layernorm(x, w, b), F.layer_norm(x, (32,), w, b)
    assert torch.equal(y[1:3].isnan(), want[1:3].isnan())
    torch.testing.assert_close(y[[0, 3]], want[[0, 3]])


def _opinfo_samples(device: str, dtype: torch.dtype) -> list:
    from torch.testing._internal.common_methods_invocations import op_db
    (op,) = [o for o in op_db if o.name == "nn.functional.layer_norm"]
    return list(op.sample_inputs(device, dtype, requires_grad=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opinfo_layer_norm_samples(device: str, dtype: torch.dtype) -> None:
    """torch's own samples for ``nn.functional.layer_norm``, forward and backward: each matches float64 (one of
    them has eps = -0.5)."""
    samples = _opinfo_samples(device, dtype)
    assert len(samples) >= 5 and any(s.kwargs.get("eps", 1e-5) < 0 for s in samples)
    for s in samples:
        shape, *params = s.args
        eps = s.kwargs.get("eps", 1e-5)
        inputs = [s.input, *params]
        _check_against_float64(lambda x, *p, shape=shape, eps=eps: L.layer_norm(x, shape, *p, eps=eps),
                               lambda x, *p, shape=shape, eps=eps: F.layer_norm(x, shape, *p, eps=eps),
                               inputs, dtype)


def test_eps_is_taken_as_torch_takes_it() -> None:
    """eps in any form torch's ``layer_norm`` takes, as a float; what it refuses, named."""
    for eps, want in ((np.float32(0.5), 0.5), (np.int64(2), 2.0), (True, 1.0), (torch.tensor(0.25), 0.25),
                      (torch.tensor(3, dtype=torch.int32), 3.0), (float("-inf"), float("-inf"))):
        assert inputs.as_eps(eps) == want and inputs.as_eps(eps).__class__ is float, eps
    for bad in ("1e-5", None, torch.tensor([1e-5]), torch.tensor(1e-5, requires_grad=True), 1j):
        with pytest.raises(TypeError, match="^eps:"):
            inputs.as_eps(bad)


# eps values torch takes and our kernels answer as it does (each is a compile-time parameter of the graph route's
# LayerNorm, so on the CPU each costs a compile: few values, each telling). The rows: random, then a constant row
# (var 0: NaN for eps <= 0, as torch's 0 * inf), then a row of small spread (var + eps < 0 for a negative eps).
EPS_VALUES = {"zero": 0.0, "negative": -1e-3, "inf": math.inf, "nan": math.nan}


@pytest.mark.parametrize("eps", EPS_VALUES.values(), ids=EPS_VALUES.keys())
def test_eps_values_torch_takes(device: str, eps: float) -> None:
    """eps = 0, negative, inf and NaN: every entry's output and gradients are torch's (float64) where torch's are
    finite, and NaN exactly where torch's are NaN. The modules take the same eps."""
    torch.manual_seed(0)
    x = torch.cat([torch.randn(5, 16), torch.full((1, 16), 3.0), 1e-2 * torch.randn(1, 16)]).to(device)
    gamma, beta = torch.randn(16, device=device), torch.randn(16, device=device)
    weight, bias = torch.randn(4, 16, device=device), torch.randn(4, device=device)
    cases = {
        "layer_norm": (lambda *t: L.layer_norm(t[0], (16,), *t[1:], eps=eps),
                       lambda *t: F.layer_norm(t[0], (16,), *t[1:], eps=eps), [x, gamma, beta]),
        "layernorm_linear": (lambda *t: LL.layernorm_linear(*t, eps=eps),
                             lambda x, g, b, w, c: F.linear(F.layer_norm(x, (16,), g, b, eps), w, c),
                             [x, gamma, beta, weight, bias]),
    }
    for name, (ours, ref, args) in cases.items():
        y, grads = _grads(ours, leaves(*args))
        want_y, want_grads = _grads(ref, leaves(*(t.double() for t in args)))
        for what, got, want in (("y", y, want_y), *((f"grad {i}", g, w) for i, (g, w) in
                                                    enumerate(zip(grads, want_grads, strict=True)))):
            nan = want.isnan()
            assert torch.equal(got.isnan().cpu(), nan.cpu()), f"{name} {what}: NaN where torch's is not, or not NaN"
            if math.isnan(eps):
                continue
            assert (m := compare(got.masked_fill(nan, 0), want.masked_fill(nan, 0), torch.float32,
                                 reduction=64)) is None, f"{name} {what}: {m}"
    if not math.isnan(eps):
        ln, ours_ln = nn.LayerNorm(16, eps=eps).to(device), L.LayerNorm(16, eps=eps).to(device)
        assert torch.equal(ours_ln(x).isnan(), ln(x).isnan())


def test_float64_is_torchs_answer(device: str) -> None:
    """float64 (no kernel of ours takes it) runs on torch's ops: the modules' outputs and gradients are the torch
    modules', and gradcheck passes through both ops."""
    theirs, ours = pair(device, torch.float64)
    x = torch.randn(3, 4, 12, device=device, dtype=torch.float64, requires_grad=True)
    y, want = ours(x), theirs(x)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    g = torch.autograd.grad(y.square().sum(), [x, *ours.parameters()])
    g_want = torch.autograd.grad(want.square().sum(), [x, *theirs.parameters()])
    for a, b in zip(g, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    p = [torch.randn(s, device=device, dtype=torch.float64, requires_grad=True) for s in ((12,), (12,), (5, 12), (5,))]
    assert torch.autograd.gradcheck(lambda x, *p: LL.layernorm_linear(x, *p), (x[0], *p))
    assert torch.autograd.gradcheck(lambda x, w, b: L.layernorm(x, w, b, activation="gelu"), (x[0], *p[:2]))


def _sampled_rows(rows: int) -> list[int]:
    return [0, 1, rows // 3, rows // 2 + 1, rows - 2, rows - 1]


@pytest.mark.gpu
def test_gpu_more_than_2_31_elements_on_our_kernels() -> None:
    """Long-context sizes: x of more than 2**31 elements (bf16 rows of 4096) runs our kernels (their element
    offsets are 64-bit), forward and backward and the LayerNorm+Linear forward of each algo: sampled rows, and
    dgamma and dbeta over all rows, equal float64 (the outputs were poisoned: an unwritten row fails)."""
    torch.manual_seed(0)
    rows, h = (1 << 31) // 4096 + 3, 4096
    x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
    w, b = (torch.randn(h, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    idx = _sampled_rows(rows)
    y, mean, rstd = L.layernorm_fwd(x, w, b)
    assert compare(y[idx], F.layer_norm(x[idx].double(), (h,), w.double(), b.double()), torch.bfloat16) is None
    del y
    dy = torch.randn_like(x)
    dx, dw, db = L.layernorm_bwd(dy, x, w, b, mean, rstd)
    want = layernorm_grads_ref(x[idx], w, b, dy[idx])
    assert compare(dx[idx], want[0], torch.bfloat16, reduction=64) is None
    del dx
    sums = torch.zeros(2, h, dtype=torch.float64, device="cuda")   # dgamma, dbeta in float64, by row chunks
    for chunk in range(0, rows, 1 << 16):
        xc, dyc = x[chunk:chunk + (1 << 16)].double(), dy[chunk:chunk + (1 << 16)].double()
        xhat = (xc - xc.mean(-1, keepdim=True)) * torch.rsqrt(xc.var(-1, unbiased=False, keepdim=True) + 1e-5)
        sums += torch.stack([(dyc * xhat).sum(0), dyc.sum(0)])
    for got, ref in zip((dw, db), sums, strict=True):
        scale = ref.abs().max().clamp_min(1)   # sums over 524k rows: the table's bound relative to their size
        assert compare(got / scale, ref / scale, torch.bfloat16) is None
    del dy, mean, rstd
    weight, bias = torch.randn(64, h, device="cuda", dtype=torch.bfloat16), torch.randn(64, device="cuda",
                                                                                        dtype=torch.bfloat16)
    want = F.linear(F.layer_norm(x[idx].double(), (h,), w.double(), b.double()), weight.double(), bias.double())
    for algo in ("unfused", "fused", "sm90"):
        got = LL.layernorm_linear_fwd(x, w, b, weight, bias, algo=algo)[0]
        assert (m := compare(got[idx], want, torch.bfloat16, reduction=h)) is None, f"{algo}: {m}"


@pytest.mark.gpu
def test_gpu_rows_or_rows_length_past_int32() -> None:
    """The kernels take rows and row lengths as int32. More than 2**31 - 1 rows get our named error on every entry
    (torch's CUDA LayerNorm refuses them too, with a raw error); a longer row is answered by torch's ops. Before,
    the C++ route cast both to int32: the rows wrapped negative, nothing computed, the output returned as it was."""
    rows = (1 << 31) + 5
    x = torch.randn(1, 1, device="cuda", dtype=torch.bfloat16).expand(rows, 1)   # no memory
    ln = L.LayerNorm(1, device="cuda", dtype=torch.bfloat16)
    calls = [ln, LL.FusedLayerNormLinear(1, 2, device="cuda", dtype=torch.bfloat16),
             lambda x: L.layernorm_fwd(x, ln.weight, ln.bias)]
    for call in calls:
        with pytest.raises(ValueError, match=rf"^x: {rows} rows"):
            call(x)
    h = (1 << 31) + 64
    x = torch.ones(1, h, device="cuda", dtype=torch.bfloat16)
    x[0, 1::2] = -1   # mean 0, variance 1: y = x * w / sqrt(1 + eps) + b
    w, b = torch.randn(h, device="cuda", dtype=torch.bfloat16), torch.randn(h, device="cuda", dtype=torch.bfloat16)
    cols = [0, 1, h // 2, h - 2, h - 1]
    want = x[0, cols].double() * w[cols].double() / math.sqrt(1 + 1e-5) + b[cols].double()
    for _ in range(2):
        y = L.layernorm(x, w, b)
        assert compare(y[0, cols], want, torch.bfloat16) is None
        del y
