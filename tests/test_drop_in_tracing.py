"""Drop-in under tracing (CPU, and the GPU where present): torch.fx, ONNX export, meta and fake tensors, functorch
transforms and dispatch modes get torch's answers or our recorded calls; nested tensors; torch.compile with dynamic
shapes and torch's own training graphs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.parametrizations
import torch.nn.utils.prune
from drop_in_helpers import PAIR_OUT, dtypes, ours_of, pair
from torch import nn

from ops import layernorm as L
from ops import layernorm_linear as LL
from ops.tolerance import compare


def test_fx_trace_records_our_calls(device: str) -> None:
    """``torch.fx.symbolic_trace`` of a model with our modules records their calls of our functions (so the graph
    runs our kernels) and gives the torch model's outputs and gradients; so do ``torch.export`` and
    ``torch.jit.trace`` (at another shape; it records torch's ops, with or without gradients to come, and the
    same ops twice: its own check compares two traces); ``torch.jit.script`` (deprecated by torch) gets our
    error."""
    theirs, ours = pair(device)
    traced = torch.fx.symbolic_trace(ours)
    calls = {n.target for n in traced.graph.nodes if n.op == "call_function"}
    assert {LL.functional.module_forward, L.layernorm} <= calls, calls
    no_affine = torch.fx.symbolic_trace(nn.Sequential(L.LayerNorm((4, 12), elementwise_affine=False)))
    assert {n.target for n in no_affine.graph.nodes if n.op == "call_function"} == {L.layer_norm}
    x = torch.randn(3, 4, 12, device=device)
    with torch.no_grad():
        jit_infer = torch.jit.trace(ours, x[:1, :2])
    jit_train = torch.jit.trace(ours, x[:1, :2])
    for jit in (jit_infer, jit_train):
        kinds = {n.kind() for n in jit.inlined_graph.nodes()}
        assert "aten::layer_norm" in kinds and not any(k.startswith(("prim::PythonOp", "mojo")) for k in kinds), kinds
    with torch.no_grad():
        assert (m := compare(jit_infer(x), theirs(x), torch.float32, reduction=12)) is None, m
    for model in (traced, jit_train, torch.export.export(ours, (x,)).module()):
        xs = [x.clone().requires_grad_() for _ in range(2)]
        y, want = model(xs[0]), theirs(xs[1])
        assert (m := compare(y, want, torch.float32, reduction=12)) is None, m
        y.square().sum().backward()
        want.square().sum().backward()
        assert (m := compare(xs[0].grad, xs[1].grad, torch.float32, reduction=64)) is None, m
    torch.testing.assert_close(no_affine(x), F.layer_norm(x, (4, 12)), rtol=1e-5, atol=1e-5)
    for module in (ours[0], ours[2]):
        with pytest.raises(TypeError, match="^torch.jit.script: "):
            torch.jit.script(module)


@pytest.mark.parametrize("algo", ["auto", "fused"])
def test_onnx_export_records_torchs_ops(device: str, algo: str, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """While ``torch.onnx.export`` traces (``torch.onnx.is_in_onnx_export()``; its default exporter traces with
    ``torch.export``, non-strict), the modules record torch's ops, which ONNX has (LayerNormalization, Gemm),
    never our custom ops, which it has not (the fused forward's, our C++ GEMM on a GPU); the program gives the
    torch model's outputs. The export itself runs where ``onnxscript`` is installed."""
    torch.manual_seed(0)
    theirs = nn.Sequential(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 8)), nn.GELU(), nn.LayerNorm(8)).to(device)
    ours = ours_of(theirs, algo)
    x = torch.randn(4, 16, device=device)
    with monkeypatch.context() as m:
        m.setattr(torch.onnx, "is_in_onnx_export", lambda: True)
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                program = torch.export.export(ours, (x,), strict=False)
            ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
            assert not any(op.startswith("mojo") for op in ops), ops
            assert {"aten.layer_norm.default", "aten.linear.default"} <= ops, ops
            assert (bad := compare(program.module()(x), theirs(x), torch.float32, reduction=16)) is None, bad
    if algo == "fused" or device == "cuda":   # without the check (auto on the CPU: torch's ops all the same)
        with torch.no_grad():
            program = torch.export.export(ours, (x,), strict=False)
        assert any(str(n.target).startswith("mojo") for n in program.graph.nodes if n.op == "call_function")
    try:
        import onnx
        import onnxscript  # noqa: F401  (torch.onnx.export needs it)
    except ImportError:
        return
    torch.onnx.export(ours, (x,), tmp_path / "ours.onnx", dynamo=True)
    assert {n.op_type for n in onnx.load(tmp_path / "ours.onnx").graph.node} == {"LayerNormalization", "Gemm", "Gelu"}


def test_meta_tensors_get_torchs_shapes() -> None:
    """On the meta device the modules answer as torch's do: meta outputs of the right shapes and dtypes."""
    theirs, ours = pair("meta", torch.bfloat16)
    x = torch.empty(2, 7, 12, device="meta", dtype=torch.bfloat16)
    for y, want in ((ours(x), theirs(x)), (L.layer_norm(x, (7, 12)), F.layer_norm(x, (7, 12)))):
        assert y.is_meta and y.shape == want.shape and y.dtype == want.dtype


@pytest.mark.parametrize("affine", [True, False])
def test_fake_tensors_get_torchs_shapes_and_nothing_fake_is_kept(device: str, affine: bool) -> None:
    """Under FakeTensorMode (outside torch.compile) every entry answers with fake tensors of torch's shapes instead of
    reading their (absent) data; the constants absent parameters stand for are not made there, so a real call after
    it still gets real values."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    theirs, ours = pair(device, affine=affine)
    x = torch.randn(3, 4, 12, device=device)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fx = mode.from_tensor(x).requires_grad_()
        y = ours(fx)
        assert isinstance(y, FakeTensor) and y.shape == (3, 4, PAIR_OUT)
        y.sum().backward()
        assert fx.grad.shape == fx.shape
        w, b = torch.ones(12, device=device), torch.zeros(12, device=device)
        y1, mean, rstd = L.layernorm_fwd(fx, w, b)
        outs = [y1, mean, rstd, *L.layernorm_bwd(torch.ones_like(y1), fx, w, b, mean, rstd)]
        lin = torch.randn(5, 12, device=device)
        y2, mean, rstd = LL.layernorm_linear_fwd(fx, w, b, lin)
        outs += [y2, *LL.layernorm_linear_bwd(torch.ones_like(y2), fx, w, b, lin, mean, rstd)]
        assert all(isinstance(t, FakeTensor) for t in outs)
        assert [tuple(t.shape) for t in outs] == [(3, 4, 12), (3, 4), (3, 4), (3, 4, 12), (12,), (12,), (3, 4, 5),
                                                   (3, 4, 12), (12,), (12,), (5, 12), (5,)]
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


def test_functorch_transforms_and_forward_ad_run_torchs_ops(device: str) -> None:
    """vmap, jacrev, per-sample gradients (functional_call under vmap and grad) and forward-mode AD (a dual level)
    give torch's answers."""
    import torch.autograd.forward_ad as fwAD

    theirs, ours = pair(device)
    x = torch.randn(6, 12, device=device)
    torch.testing.assert_close(torch.vmap(ours)(x), theirs(x), rtol=1e-5, atol=1e-5)
    tangents = []
    for model in (ours, theirs):
        with fwAD.dual_level():
            tangents.append(fwAD.unpack_dual(model(fwAD.make_dual(x, torch.ones_like(x)))).tangent)
    torch.testing.assert_close(*tangents, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.func.jacrev(ours)(x[0]), torch.func.jacrev(theirs)(x[0]), rtol=1e-5, atol=1e-5)

    def per_sample(model: nn.Module) -> dict[str, torch.Tensor]:
        params = {k: v.detach() for k, v in model.named_parameters()}
        loss = lambda p, xi: torch.func.functional_call(model, p, (xi[None],)).square().sum()  # noqa: E731
        return torch.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    for (k, a), b in zip(per_sample(ours).items(), per_sample(theirs).values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=k)


def test_dispatch_modes_see_torchs_ops(device: str) -> None:
    """Under a TorchDispatchMode (here FlopCounterMode) the modules run torch's ops, so the mode sees what it sees
    for the torch model: the same FLOPs, and the same values."""
    from torch.utils.flop_counter import FlopCounterMode

    theirs, ours = pair(device)
    x = torch.randn(8, 12, device=device, requires_grad=True)
    counts, ys = [], []
    for model in (ours, theirs):
        with FlopCounterMode(display=False) as flops:
            ys.append(model(x))
            ys[-1].sum().backward()
        counts.append(flops.get_total_flops())
    assert counts[0] == counts[1] > 0
    torch.testing.assert_close(ys[0], ys[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_nested_tensors_as_torch(device: str, layout: torch.layout) -> None:
    """Nested tensors (rows of different lengths; ``torch.nested``'s default layout and the jagged one) are taken
    as torch's modules take them: their own answers and gradients (torch's ops run them), on every entry and,
    on a GPU, a shape's later calls too; tensors that differ in a normalized dim get a named error."""
    def nested(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.nested.nested_tensor([torch.randn(*s) for s in shapes], layout=layout, device=device,
                                          dtype=dtype, requires_grad=True)

    def same(a: torch.Tensor, b: torch.Tensor) -> None:
        assert a.is_nested == b.is_nested
        for u, v in zip(*((t.unbind() if t.is_nested else [t]) for t in (a, b)), strict=True):
            torch.testing.assert_close(u, v, rtol=0, atol=0)

    def grads(y: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        dy = y.detach() * y.detach() - 0.5   # not constant along a row: a LayerNorm's dx is then not 0
        return list(torch.autograd.grad(y, inputs, dy))

    for dtype in dtypes(device):
        theirs, ours = pair(device, dtype)
        calls = [(ours[0], theirs[0]), (ours[2], theirs[2])]   # FusedLayerNormLinear, LayerNorm
        for _ in range(2):
            for mine, torchs in calls:
                k = 12 if mine is ours[0] else PAIR_OUT
                x = nested((3, k), (5, k), dtype=dtype)
                ys = [m(x) for m in (mine, torchs)]
                assert ys[0].is_nested and ys[0].layout == layout
                same(*ys)
                params = [list(m.parameters()) for m in (mine, torchs)]
                for a, b in zip(grads(ys[0], [x, *params[0]]), grads(ys[1], [x, *params[1]]), strict=True):
                    same(a, b)
    if layout == torch.jagged:   # below: two normalized dims, and a ragged last dim (one jagged cannot hold)
        return
    x = nested((3, 4, 6), (5, 4, 6))
    w = torch.randn(4, 6, device=device)
    same(L.layer_norm(x, (4, 6), w, w), F.layer_norm(x, (4, 6), w, w))
    ragged_last = nested((3, 5), (4, 6))
    for call in (lambda: L.LayerNorm(5, device=device)(ragged_last),
                 lambda: LL.FusedLayerNormLinear(5, 2, device=device)(ragged_last)):
        with pytest.raises(ValueError, match="x: a nested tensor whose tensors differ in their last dim"):
            call()


def _small_model(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(LL.FusedLayerNormLinear(32, 48, device=device), nn.GELU(), nn.Linear(48, 32, device=device),
                         L.LayerNorm(32, device=device))


def test_compile_dynamic_shapes_no_recompile(device: str, compiled_layernorm: str) -> None:
    """Batch and sequence length vary; one compiled graph serves them all (a recompile fails the test)."""
    import torch._dynamo

    model = _small_model(device)
    torch._dynamo.reset()
    backend = "aot_eager" if device == "cpu" else "inductor"
    compiled = torch.compile(model, dynamic=True, fullgraph=True, backend=backend)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for b, t in ((2, 5), (3, 7), (5, 13), (4, 2)):   # sizes >= 2: dynamo specializes 0 and 1 for any model
            x = torch.randn(b, t, 32, device=device, requires_grad=True)
            y = compiled(x)
            want = model(x)
            torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
            y.sum().backward()


class _PreLNBlock(nn.Module):
    """A pre-LN transformer MLP block as bench_transformer.py's: x + fc2(gelu(ln + fc1(x))), then a final LayerNorm."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_fc1 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d))
        self.fc2 = nn.Linear(4 * d, d)
        self.ln_f = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.fc2(F.gelu(self.ln_fc1(x), approximate="tanh"))
        return self.ln_f(x)


def test_compiled_training_graphs_are_torchs() -> None:
    """Under torch.compile with the default knobs (COMPILED_LAYERNORM and COMPILED_TRAINING_LINEAR "inductor"),
    a model with our drop-ins traces, for training, to the forward and backward graphs of the same model with
    torch's modules, op for op (the graphs' inputs may come in another order), here on the CPU; on CUDA, the same
    holds below COMPILED_TRAINING_LAYERNORM_LINEAR_MIN_ROWS rows (the default "auto"; test_compile_gpu.py's GPU
    tests)."""
    from conftest import recording_backend

    from ops.layernorm import config as layernorm_config
    from ops.layernorm_linear import config as lnl_config

    assert layernorm_config.COMPILED_LAYERNORM == "inductor" and lnl_config.COMPILED_TRAINING_LINEAR == "inductor"
    torch.manual_seed(0)
    model = _PreLNBlock(32)
    ours = _PreLNBlock(32)
    ours.load_state_dict(model.state_dict())
    ours.ln_fc1, ours.ln_f = LL.FusedLayerNormLinear.from_torch(ours.ln_fc1), L.LayerNorm.from_torch(ours.ln_f)
    codes = {}
    for name, m in (("torch", model), ("ours", ours)):
        torch._dynamo.reset()
        backend, codes[name] = recording_backend()
        x = torch.randn(2, 5, 32, requires_grad=True)
        torch.compile(m, fullgraph=True, backend=backend)(x).sum().backward()
    ops = {name: [re.findall(r"torch\.ops\.[\w.]+", code) for code in graphs] for name, graphs in codes.items()}
    assert len(ops["torch"]) == 2 and all(ops["torch"]) and ops["ours"] == ops["torch"]
