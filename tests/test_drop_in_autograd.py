"""Drop-in autograd (CPU, and the GPU where present): gradients as torch's autograd gives them under in-place
writes, activation checkpointing, batched and double backward, and saved-tensor hooks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.utils.parametrizations
import torch.nn.utils.prune
from drop_in_helpers import PAIR_OUT, compare_to_scale, dtypes, pair, step
from torch import nn

from ops import layernorm as L
from ops import layernorm_linear as LL


@pytest.mark.parametrize("written", ["x", "ln_weight", "weight"])
def test_inplace_write_before_backward_is_caught(device: str, written: str) -> None:
    """An in-place write, between the forward and the backward, to a tensor the backward needs gets autograd's
    error, as with torch's modules (our autograd functions save their inputs as torch's do), for each
    module and route; never a gradient of the changed values."""
    dtypes = [torch.float32, *([torch.bfloat16] if device == "cuda" else [])]   # bf16: the C++ route
    for dtype in dtypes:
        torch.manual_seed(0)
        models = {"layernorm": L.LayerNorm(12), "fused": LL.FusedLayerNormLinear(12, 5)}
        for name, model in models.items():
            if written == "weight" and name == "layernorm":
                continue
            model.to(device, dtype)
            x = torch.randn(4, 12, device=device, dtype=dtype, requires_grad=True)
            h = x * 1.0
            y = model(h)
            target = {"x": h, "ln_weight": model.weight if name == "layernorm" else model[0].weight,
                      "weight": model[1].weight if name == "fused" else None}[written]
            with torch.no_grad():
                target.add_(1.0)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_activation_checkpointing_matches_plain_backward(device: str, dtype: torch.dtype) -> None:
    """``torch.utils.checkpoint`` (non-reentrant: it checks that the recomputation saves what the forward saved;
    and reentrant) over our modules at shapes no call has seen: on a GPU the forward is a shape's first call (the
    Python route) and the recomputation its second (the C++ route); the gradients equal a plain backward's."""
    from torch.utils.checkpoint import checkpoint

    _, ours = pair(device, dtype)
    for rows, reentrant in ((77, False), (78, True)):
        x = torch.randn(rows, 12, device=device, dtype=dtype)
        leaves = [x.clone().requires_grad_() for _ in range(2)]
        ours.zero_grad(set_to_none=True)
        checkpoint(ours, leaves[0], use_reentrant=reentrant).float().square().sum().backward()
        got = [leaves[0].grad, *(p.grad.clone() for p in ours.parameters())]
        ours.zero_grad(set_to_none=True)
        ours(leaves[1]).float().square().sum().backward()
        want = [leaves[1].grad, *(p.grad for p in ours.parameters())]
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"rows {rows}: gradient {i}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_batched_backward_matches_torch(device: str, dtype: torch.dtype) -> None:
    """A backward whose dy is batched (``autograd.grad(is_grads_batched=True)``, which
    ``autograd.functional.jacobian(vectorize=True)`` and ``hessian`` use; legacy vmap's tensors): the modules'
    forward runs our kernels and the backward gives torch's Jacobian and Hessian (bf16 on a GPU: the C++ route).
    And the kernel entries under ``torch.vmap`` give what a loop over the batch gives."""
    from torch.autograd.functional import hessian, jacobian

    theirs, ours = pair(device, dtype)
    x = torch.randn(3, 12, device=device, dtype=dtype)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for a, b in ((ours[0], theirs[0]), (ours[2], theirs[2])):   # FusedLayerNormLinear, LayerNorm
        inp = x if a is ours[0] else torch.randn(3, PAIR_OUT, device=device, dtype=dtype)
        torch.testing.assert_close(jacobian(a, inp, vectorize=True), jacobian(b, inp, vectorize=True), **tol)
        xs = [inp.clone().requires_grad_() for _ in range(2)]
        ys = [m(t) for m, t in zip((a, b), xs, strict=True)]
        eye = torch.eye(ys[0].numel(), device=device, dtype=dtype).view(-1, *ys[0].shape)
        got, want = (torch.autograd.grad(y, t, eye, is_grads_batched=True)[0] for y, t in zip(ys, xs, strict=True))
        torch.testing.assert_close(got, want, **tol)
    w, b = ours[2].weight, ours[2].bias
    inp = torch.randn(4, 3, PAIR_OUT, device=device, dtype=dtype)
    y, mean, rstd = torch.vmap(lambda t: L.layernorm_fwd(t, w, b))(inp)   # the kernel entries under torch.vmap
    grads = torch.vmap(lambda dy, t, m, r: L.layernorm_bwd(dy, t, w, b, m, r))(inp, inp, mean, rstd)
    for i in range(inp.shape[0]):
        want = L.layernorm_fwd(inp[i], w, b)
        torch.testing.assert_close((y[i], mean[i], rstd[i]), want, **tol)
        torch.testing.assert_close(tuple(g[i] for g in grads), L.layernorm_bwd(inp[i], inp[i], w, b, *want[1:]), **tol)
    if dtype == torch.float32:
        f = lambda m: lambda t: m(t).pow(3).sum()  # noqa: E731
        torch.testing.assert_close(hessian(f(ours), x[:1], vectorize=True), hessian(f(theirs), x[:1], vectorize=True),
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("wrt", ["x", "parameters"])
def test_double_backward_matches_torch(device: str, wrt: str) -> None:
    """A backward under create_graph=True (a gradient penalty, a Hessian-vector product) gives gradients that carry
    their own graph, as torch's modules' do: the second-order gradients equal the float64 torch model's. (Our kernels'
    gradients are constants to autograd; a penalty built from them would silently add no gradient.)"""
    torch.manual_seed(0)
    theirs = nn.Sequential(nn.Sequential(nn.LayerNorm(12), nn.Linear(12, 5)), nn.Tanh(), nn.LayerNorm(5),
                           nn.Sequential(nn.LayerNorm(5), nn.Linear(5, 3, bias=False))).to(device)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    mine = copy.deepcopy(theirs)
    ours = nn.Sequential(LL.FusedLayerNormLinear.from_torch(mine[0]), nn.Tanh(),
                         L.LayerNorm.from_torch(mine[2], activation="gelu"),
                         LL.FusedLayerNormLinear.from_torch(mine[3]))
    theirs[2] = nn.Sequential(theirs[2], nn.GELU())
    theirs.double()   # the float64 reference
    x0 = torch.randn(6, 12, device=device)
    results = []
    for model in (ours, theirs):
        x = x0.clone().to(next(model.parameters()).dtype).requires_grad_(wrt == "x")
        inputs = [x] if wrt == "x" else list(model.parameters())
        first = torch.autograd.grad(model(x).pow(3).sum(), inputs, create_graph=True)
        assert all(g.grad_fn is not None for g in first)
        penalty = sum(g.square().sum() for g in first)
        penalty.backward()
        results.append([*first, *(t.grad for t in inputs)])
    for i, (a, b) in enumerate(zip(*results, strict=True)):   # second-order terms reach 1e4
        assert (m := compare_to_scale(a, b, torch.float32, 64)) is None, f"result {i}: {m}"


def test_saved_tensor_hooks_hold_what_the_backward_reads(device: str) -> None:
    """Our autograd functions save their tensors as torch's do, so ``saved_tensors_hooks`` (activation offloading:
    ``save_on_cpu``) hold everything the backward reads: with hooks that pack a copy, an in-place write to x and
    the weights after the forward changes no gradient (the backward reads the copies; without hooks autograd
    refuses it: ``test_inplace_write_before_backward_is_caught``), on every route."""
    packed: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t.shape)
        return t.detach().clone()

    for dtype in dtypes(device):
        _, ours = pair(device, dtype)
        x = torch.randn(9, 12, device=device, dtype=dtype)
        for _ in range(2):   # on a GPU the C++ route takes a shape's second call
            want = step(ours, x)
            ours.zero_grad(set_to_none=True)
            packed.clear()
            leaf = x.detach().clone().requires_grad_()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = ours(leaf)
            assert packed, "nothing was saved through the hooks"
            with torch.no_grad():
                leaf.add_(1.0)
                for p in ours.parameters():
                    p.mul_(-2.0)
            g = torch.Generator(device="cpu").manual_seed(1)
            y.backward(torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.device, y.dtype))
            got = [y, leaf.grad, *(p.grad for p in ours.parameters())]
            with torch.no_grad():
                for p in ours.parameters():
                    p.div_(-2.0)
            ours.zero_grad(set_to_none=True)
            for i, (a, b) in enumerate(zip(got, want, strict=True)):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"result {i}")
