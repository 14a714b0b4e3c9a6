"""A pre-norm block's residual add and norm in one call (add_layer_norm, add_rms_norm, AddLayerNorm, AddRMSNorm):
s and y against float64 with their gradients, the one-pass kernel bit for bit against the add and then our norm (a
GPU), the modules' drop-in contract, torch.compile, named errors."""

from __future__ import annotations

import pytest
import torch
from conftest import GemmaRMSNorm, norm_rows
from torch import nn

from ops.reference import rmsnorm_ref
from ops.rmsnorm import rms_norm
from ops.tolerance import compare


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("residual_in_fp32", [False, True])
def test_add_and_norm_returns_both_with_gradients(device: str, norm: str, residual_in_fp32: bool) -> None:
    """add_layer_norm / add_rms_norm: s = x + add_bias + residual (float32 with residual_in_fp32, else x's dtype) and
    y = norm(s) in x's dtype; the gradients of a loss on both outputs (the backward adds s's incoming gradient)
    against float64; bad residual and add_bias named."""
    from ops.layernorm import add_layer_norm
    from ops.reference import layernorm_ref
    from ops.rmsnorm import add_rms_norm

    torch.manual_seed(0)
    h, dtype = 64, torch.bfloat16
    x = norm_rows(6, h, device, dtype).requires_grad_()
    r = torch.randn(6, h, device=device, dtype=dtype).requires_grad_()
    w, b, c = (torch.randn(h, device=device, dtype=dtype).requires_grad_() for _ in range(3))
    if norm == "layer_norm":
        call = lambda x, r, w, b, c, eps=1e-5: add_layer_norm(x, r, w, b, eps, add_bias=c,  # noqa: E731
                                                                 residual_in_fp32=residual_in_fp32)
        ref = lambda s, w, b: layernorm_ref(s, w, b, 1e-5)  # noqa: E731
    else:
        call = lambda x, r, w, b, c, eps=1e-6: add_rms_norm(x, r, w, eps, add_bias=c,  # noqa: E731
                                                               residual_in_fp32=residual_in_fp32)
        ref = lambda s, w, b: rmsnorm_ref(s, w, 1e-6)  # noqa: E731
    y, s = call(x, r, w, b, c)
    assert y.dtype == dtype and s.dtype == (torch.float32 if residual_in_fp32 else dtype)
    leaves = [x, r, w, c] + ([b] if norm == "layer_norm" else [])
    dy, ds = torch.randn_like(y), torch.randn_like(s)
    grads = torch.autograd.grad((y.float() * dy).sum() + (s.float() * ds).sum(), leaves)
    x64, r64, w64, b64, c64 = (t.detach().double().requires_grad_() for t in (x, r, w, b, c))
    s64 = x64 + c64 + r64
    assert (m := compare(s, s64, dtype)) is None, f"s: {m}"
    s64 = s64 + (s.detach().double() - s64).detach()   # the norm reads s as rounded (the gradient passes through)
    y64 = ref(s64, w64, b64)
    assert (m := compare(y, y64, dtype, cond=2.0)) is None, f"y: {m}"
    leaves64 = [x64, r64, w64, c64] + ([b64] if norm == "layer_norm" else [])
    want = torch.autograd.grad((y64 * dy.double()).sum() + (s64 * ds.double()).sum(), leaves64)
    for i, (g, w_) in enumerate(zip(grads, want, strict=True)):
        assert (m := compare(g, w_, dtype, reduction=h, cond=2.0)) is None, f"grad {i}: {m}"
    with pytest.raises(ValueError, match="^residual:"):
        call(x, r[:3], w, b, c)
    with pytest.raises(ValueError, match="^add_bias:"):
        call(x, r, w, b, c[:3])


def penalty_grads(call: object, x: torch.Tensor, r: torch.Tensor, *rest: torch.Tensor | None) -> tuple:
    """x's and r's gradients of a gradient penalty through ``call(x, r, *rest)``'s y (a double backward)."""
    xr = [t.clone().detach().requires_grad_() for t in (x, r)]
    gx, = torch.autograd.grad(call(*xr, *rest)[0].float().square().sum(), xr[0], create_graph=True)
    gx.float().square().sum().backward()
    return xr[0].grad, xr[1].grad


@pytest.mark.gpu
@pytest.mark.parametrize("rows,h", [(4096, 768), (7, 4096), (16, 32768)])   # 32768: 512 threads a row
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm", "rms_norm:gemma"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gpu_add_norm_in_one_pass(norm: str, with_bias: bool, rows: int, h: int,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 on a GPU: add_layer_norm / add_rms_norm take the one-pass kernel (the unfused add is made to fail),
    and give bit for bit what the add and then our norm give: y, s and every gradient (x's and residual's the
    norm's plus s's own), at the first call (Python's route) and the second (the C++ entry's, Python's made to fail),
    and y and s under no_grad; a gradient penalty through it (the C++ entry's ATen form) matches the unfused one's."""
    from ops.launch import direct
    from ops.layernorm import add_layer_norm, layer_norm
    from ops.layernorm import autograd as ln_autograd
    from ops.layernorm import functional as ln_functional
    from ops.rmsnorm import add_rms_norm
    from ops.rmsnorm import functional as rms_functional

    torch.manual_seed(0)
    x, r = norm_rows(rows, h, "cuda", torch.bfloat16), torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
    w, b, c = (torch.randn(h, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    c = c if with_bias else None
    semantics = norm.partition(":")[2] or "torch"
    if norm == "layer_norm":
        fused = lambda x, r, w, b, c: add_layer_norm(x, r, w, b, 1e-5, add_bias=c)  # noqa: E731
        unfused_norm = lambda s, w, b: layer_norm(s, h, w, b, 1e-5)  # noqa: E731
    else:
        fused = lambda x, r, w, b, c: add_rms_norm(x, r, w, 1e-6, add_bias=c, semantics=semantics)  # noqa: E731
        unfused_norm = lambda s, w, b: rms_norm(s, h, w, 1e-6, semantics=semantics)  # noqa: E731
    leaves = [t.clone().requires_grad_() for t in (x, r, w, b) + ((c,) if with_bias else ())]
    dy, ds = torch.randn_like(x), torch.randn_like(x)

    def run(call: object, leaves: list) -> tuple:
        x, r, w, b, *c = leaves
        y, s = call(x, r, w, b, c[0] if c else None)
        return (y, s, *torch.autograd.grad((y, s), leaves if norm == "layer_norm" else leaves[:3] + leaves[4:],
                                           (dy, ds)))

    def unfused(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None) -> tuple:
        s = (x if c is None else x + c) + r
        return unfused_norm(s, w, b), s

    def no_add(*args: object) -> None:
        raise AssertionError("the unfused add ran")
    want = run(unfused, [t.clone().detach().requires_grad_() for t in leaves])
    monkeypatch.setattr(ln_functional, "add_residual", no_add)
    monkeypatch.setattr(rms_functional, "add_residual", no_add)
    got = run(fused, leaves)
    monkeypatch.setattr(ln_autograd.AddNormFunction, "apply", no_add)   # the second call: the C++ entry's
    again = run(fused, [t.clone().detach().requires_grad_() for t in leaves])
    for i, (g, v, a) in enumerate(zip(got, want, again, strict=True)):
        assert torch.equal(g, v) and torch.equal(a, v), f"output {i} differs"
    with torch.no_grad():   # the C++ entry's launch without an autograd node
        y, s = fused(x, r, w, b, c)
    assert torch.equal(y, want[0]) and torch.equal(s, want[1]), "no_grad: y or s differs"
    monkeypatch.undo()

    want = penalty_grads(unfused, *leaves[:2], w, b, c)
    by_cpp = penalty_grads(fused, *leaves[:2], w, b, c)   # the plan is the C++ entry's by now
    monkeypatch.setattr(direct.NATIVE, "add_norm", None)   # and Python's route
    for got in (by_cpp, penalty_grads(fused, *leaves[:2], w, b, c)):
        for g, v in zip(got, want, strict=True):
            torch.testing.assert_close(g, v, rtol=2e-2, atol=1e-2)


def test_add_norm_modules(device: str) -> None:
    """AddLayerNorm and AddRMSNorm: built from a block's own norm they share its parameters and state dict keys,
    and return (y, s) as add_layer_norm / add_rms_norm do, gradients reaching the shared weight; a norm of more than
    the last dim is a named error."""
    from ops.layernorm import AddLayerNorm, add_layer_norm
    from ops.rmsnorm import AddRMSNorm, add_rms_norm

    torch.manual_seed(0)
    x, r = norm_rows(4, 32, device, torch.float32), torch.randn(4, 32, device=device)
    for theirs, ours, call in (
            (nn.LayerNorm(32), AddLayerNorm.from_torch, lambda m: add_layer_norm(x, r, m.weight, m.bias, m.eps)),
            (GemmaRMSNorm(32), lambda m: AddRMSNorm.from_module(m, semantics="gemma"),
             lambda m: add_rms_norm(x, r, m.weight, m.eps, semantics="gemma"))):
        theirs = theirs.to(device)
        m = ours(theirs)
        assert m.weight is theirs.weight and m.state_dict().keys() == theirs.state_dict().keys()
        y, s = m(x, r)
        want_y, want_s = call(m)
        assert torch.equal(s, x + r) and torch.equal(y, want_y) and torch.equal(s, want_s)
        y.sum().backward()
        assert theirs.weight.grad is not None and theirs.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="^normalized_shape:"):
        AddLayerNorm((4, 8))
    with pytest.raises(ValueError, match="^normalized_shape:"):
        AddRMSNorm((4, 8))


@pytest.mark.parametrize("norm,form", [("add_rms_norm", "inductor"), ("add_rms_norm", "ours"),
                                       ("add_layer_norm", None)])
def test_add_norm_compiles_fullgraph(device: str, norm: str, form: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile(fullgraph=True) of add_rms_norm (under each COMPILED_RMSNORM) / add_layer_norm (the traced form
    adds, then runs the norm): y, s and the gradients are eager's."""
    from ops.layernorm import add_layer_norm
    from ops.rmsnorm import add_rms_norm
    from ops.rmsnorm import config as rmsnorm_config

    if form is not None:
        monkeypatch.setattr(rmsnorm_config, "COMPILED_RMSNORM", form)
    torch._dynamo.reset()
    torch.manual_seed(0)
    x, r = (torch.randn(6, 64, device=device, requires_grad=True) for _ in range(2))
    w = torch.randn(64, device=device, requires_grad=True)
    fn = ((lambda x, r, w: add_rms_norm(x, r, w, 1e-6, semantics="llama")) if norm == "add_rms_norm"
          else (lambda x, r, w: add_layer_norm(x, r, w, None, 1e-5)))
    got, want = torch.compile(fn, fullgraph=True)(x, r, w), fn(x, r, w)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    g = torch.autograd.grad(got[0].square().sum() + got[1].sum(), (x, r, w))
    g_want = torch.autograd.grad(want[0].square().sum() + want[1].sum(), (x, r, w))
    for a, b in zip(g, g_want, strict=True):
        torch.testing.assert_close(a, b)


def test_add_norm_names_a_zero_dim_x_with_the_cpp_entry_loaded() -> None:
    """A 0-dim x gets the add-and-norm's named error, also where the C++ entry is loaded (its pre-check reads x's
    last dim)."""
    from ops.launch import direct
    from ops.layernorm import add_layer_norm
    from ops.rmsnorm import add_rms_norm

    direct.load_native()
    for call in (add_layer_norm, add_rms_norm):
        with pytest.raises(ValueError, match="^x:"):
            call(torch.tensor(1.0), torch.tensor(1.0))
