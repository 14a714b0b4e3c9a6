"""The forms a torch.compile graph holds our ops in (no GPU: the C++ ops' fakes, autograd kernels and backward graphs
on the CPU), and the inductor pass that puts a tanh GELU into our Linear's GEMM."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ops.launch import direct
from ops.layernorm import config as config


@pytest.mark.parametrize("with_bias", [True, False])
def test_traced_linear_fake_and_autograd_kernel(with_bias: bool) -> None:
    """``mojo_direct.traced_linear`` (torch.compile's Linear in a training graph, COMPILED_TRAINING_LINEAR): its
    fake and its C++ autograd kernel (whose backward is ``linear_grads``) pass ``torch.library.opcheck``, and
    gradcheck in float64 on the CPU, where both ops run torch's GEMMs (a GPU test runs their cuBLASLt plans)."""
    from ops import layernorm_linear as LL

    assert direct.load_native().ops is not None, "the C++ launcher did not build (see the warning)"
    assert LL.traced.native_linear_traceable()
    torch.manual_seed(0)
    xn = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, dtype=torch.float64, requires_grad=True) if with_bias else None
    torch.library.opcheck(torch.ops.mojo_direct.traced_linear.default, (xn, w, bias))
    plain, dy = (xn.detach(), w.detach()), torch.randn(2, 5, 3, dtype=torch.float64)
    for weight_grad in (True, False):   # False: a frozen weight, dweight empty
        torch.library.opcheck(torch.ops.mojo_direct.linear_grads.default, (dy, *plain, with_bias, weight_grad))
    assert torch.autograd.gradcheck(lambda *t: torch.ops.mojo_direct.traced_linear(*t, bias), (xn, w))
    if with_bias:
        assert torch.autograd.gradcheck(lambda b: torch.ops.mojo_direct.traced_linear(xn, w, b), (bias,))


@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_gelu_fake_and_cpu_result(with_bias: bool) -> None:
    """``mojo_direct.linear_gelu`` (what the inductor pass puts in place of linear and a tanh GELU): its fake passes
    ``torch.library.opcheck``, and on the CPU (torch's ops) it is bitwise ``F.gelu(F.linear(..), "tanh")``."""
    from ops import layernorm_linear as LL

    assert direct.load_native().ops is not None, "the C++ launcher did not build (see the warning)"
    assert LL.traced.native_linear_traceable()
    torch.manual_seed(0)
    xn, w = torch.randn(2, 5, 8), torch.randn(3, 8)
    bias = torch.randn(3) if with_bias else None
    torch.library.opcheck(torch.ops.mojo_direct.linear_gelu.default, (xn, w, bias))
    want = torch.nn.functional.gelu(torch.nn.functional.linear(xn, w, bias), approximate="tanh")
    assert torch.equal(torch.ops.mojo_direct.linear_gelu(xn, w, bias), want)


@pytest.mark.parametrize("bias_grad_in_gemm", [True, False])
@pytest.mark.parametrize("shape", [(2, 5, 8), (8,)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_traced_linear_gelu_fake_and_autograd_kernel(with_bias: bool, shape: tuple[int, ...],
                                                     bias_grad_in_gemm: bool) -> None:
    """``mojo_direct.traced_linear_gelu`` (the pass's GEMM with GELU in a training graph): it and its forward and
    backward ops (``linear_gelu_aux``: GELU's output and input; ``linear_gelu_grads``) pass ``opcheck``, and its C++
    autograd kernel gradcheck in float64 on the CPU (torch's ops there; a GPU test runs the cuBLASLt plans), with
    db from the GEMM's op or from torch's sum (``bias_grad_in_gemm``), for x of any rank."""
    from ops import layernorm_linear as LL

    assert direct.load_native().ops is not None and LL.traced.native_linear_traceable()
    ops = torch.ops.mojo_direct
    torch.manual_seed(0)
    xn = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, dtype=torch.float64, requires_grad=True) if with_bias else None
    torch.library.opcheck(ops.traced_linear_gelu.default, (xn, w, bias, bias_grad_in_gemm))
    y, h = ops.linear_gelu_aux(xn, w, bias)
    assert torch.equal(h, torch.nn.functional.linear(xn, w, bias))
    assert torch.equal(y, torch.nn.functional.gelu(h, approximate="tanh"))
    dy = torch.randn_like(y)
    plain = [None if t is None else t.detach() for t in (xn, w, bias, h)]
    torch.library.opcheck(ops.linear_gelu_aux.default, tuple(plain[:3]))
    for weight_grad in (True, False):   # False: a frozen weight, dweight empty
        torch.library.opcheck(ops.linear_gelu_grads.default, (dy, plain[0], plain[1], plain[3], with_bias, weight_grad))
    assert torch.autograd.gradcheck(lambda *t: ops.traced_linear_gelu(*t, bias, bias_grad_in_gemm), (xn, w))
    if with_bias:
        assert torch.autograd.gradcheck(lambda b: ops.traced_linear_gelu(xn, w, b, bias_grad_in_gemm), (bias,))


def _call_targets(gm: torch.fx.GraphModule) -> list:
    """The ops ``gm``'s graph calls, in order."""
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _aot_graphs(fn: Callable, args: list, names: tuple[str, ...]) -> list[torch.fx.GraphModule]:
    """``fn(*args)`` through AOTAutograd, its graphs run as they are: asserts that the gradients of its sum equal
    eager autograd's for the args that want one (each named by ``names``) and returns its forward and backward
    graphs."""
    from functorch.compile import aot_function, make_boxed_func

    graphs = []

    def keep(gm: torch.fx.GraphModule, _: object) -> Callable:
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    wanted = [(name, a) for name, a in zip(names, args, strict=True) if a is not None and a.requires_grad]
    leaves = [a for _, a in wanted]
    got = torch.autograd.grad(aot_function(fn, fw_compiler=keep, bw_compiler=keep)(*args).sum(), leaves)
    for (name, _), g, want in zip(wanted, got, torch.autograd.grad(fn(*args).sum(), leaves), strict=True):
        assert torch.equal(g, want), name
    return graphs


def _aot_call_targets(fn: Callable, args: list, names: tuple[str, ...]) -> list[list]:
    """``_aot_graphs``' checks; the ops its forward and backward graphs call."""
    return [_call_targets(gm) for gm in _aot_graphs(fn, args, names)]


@pytest.mark.parametrize("bias_grad_in_gemm", [True, False])
def test_traced_linear_gelu_backward_graph(bias_grad_in_gemm: bool) -> None:
    """AOTAutograd's backward graph of ``traced_linear_gelu`` with a bias: ``linear_gelu_grads`` (db in the GEMM's
    epilogue), or torch's ``gelu_backward`` and ``sum`` (for inductor to make one kernel) and ``linear_grads`` without
    db; its gradients equal eager autograd's."""
    from ops import layernorm_linear as LL

    assert direct.load_native().ops is not None and LL.traced.native_linear_traceable()
    ops = torch.ops.mojo_direct
    args = _linear_leaves()
    fn = lambda *t: ops.traced_linear_gelu(*t, bias_grad_in_gemm)  # noqa: E731
    backward = set(_aot_call_targets(fn, args, ("x", "w", "b"))[1])
    assert (ops.linear_gelu_grads.default in backward) == bias_grad_in_gemm, backward
    assert ({torch.ops.aten.gelu_backward.default, torch.ops.aten.sum.dim_IntList, ops.linear_grads.default}
            <= backward) == (not bias_grad_in_gemm), backward


def _linear_leaves() -> list:
    """float64 CPU leaves (xn [4, 5, 8], W [3, 8], bias [3]) that want grads."""
    torch.manual_seed(0)
    return [torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in ((4, 5, 8), (3, 8), (3,))]


def _layernorm_linear_leaves(shape: tuple[int, ...], with_bias: bool) -> list:
    """float64 CPU leaves (x of ``shape``, LayerNorm's weight and bias, W [3, K], bias or None) that want grads."""
    torch.manual_seed(0)
    k = shape[-1]
    leaves = [torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in (shape, (k,), (k,), (3, k))]
    return [*leaves, torch.randn(3, dtype=torch.float64, requires_grad=True) if with_bias else None]


@pytest.mark.parametrize("act", [0, 1])
@pytest.mark.parametrize("shape", [(2, 5, 8), (8,)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_traced_layernorm_linear_fake_and_autograd_kernel(with_bias: bool, shape: tuple[int, ...], act: int) -> None:
    """``mojo_direct.traced_layernorm_linear`` (the training graph's one-op LayerNorm+Linear, act 1 with the tanh
    GELU): it and its forward and backward ops pass ``opcheck``; y, xn, the statistics and GELU's input equal torch's
    ops' (float64 on the CPU: torch's ops there; a GPU test runs ours), and its C++ autograd kernel gradchecks, for x
    of any rank."""
    from ops import layernorm_linear as LL

    assert direct.load_native().ops is not None and LL.traced.native_linear_traceable()
    ops, F = torch.ops.mojo_direct, torch.nn.functional
    x, lnw, lnb, w, bias = leaves = _layernorm_linear_leaves(shape, with_bias)
    torch.library.opcheck(ops.traced_layernorm_linear.default, (*leaves, 1e-5, act))
    plain = [None if t is None else t.detach() for t in leaves]
    torch.library.opcheck(ops.layernorm_linear_train_fwd.default, (*plain, 1e-5, act))
    y, xn, mean, rstd, h = ops.layernorm_linear_train_fwd(*plain, 1e-5, act)
    want_xn = F.layer_norm(plain[0], shape[-1:], plain[1], plain[2], 1e-5)
    torch.testing.assert_close(xn, want_xn, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mean, plain[0].mean(-1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rstd, (plain[0].var(-1, unbiased=False) + 1e-5).rsqrt(), rtol=1e-12, atol=1e-12)
    want_h = F.linear(xn, plain[3], plain[4])
    assert torch.equal(h, want_h if act else h.new_empty(0))
    assert torch.equal(y, F.gelu(want_h, approximate="tanh") if act else want_h)
    dy = torch.randn_like(y)
    for weight_grad in (True, False):   # False: a frozen weight, dweight empty
        torch.library.opcheck(ops.layernorm_linear_grads.default, (dy, plain[0], xn, *plain[1:4], mean, rstd, h, act,
                                                                   with_bias, weight_grad))
    wanted = [t for t in leaves if t is not None]
    assert torch.autograd.gradcheck(lambda *t: ops.traced_layernorm_linear(*t[:4], t[4] if with_bias else None,
                                                                           1e-5, act), tuple(wanted))


@pytest.mark.parametrize("act", [0, 1])
def test_traced_layernorm_linear_backward_graph(act: int) -> None:
    """AOTAutograd's graphs of ``traced_layernorm_linear``: one op each way (``layernorm_linear_train_fwd``, then
    ``layernorm_linear_grads``), and gradients equal to eager autograd's."""
    from ops import layernorm_linear as LL

    assert direct.load_native().ops is not None and LL.traced.native_linear_traceable()
    ops = torch.ops.mojo_direct
    args = _layernorm_linear_leaves((4, 5, 8), True)
    fn = lambda *t: ops.traced_layernorm_linear(*t, 1e-5, act)  # noqa: E731
    graphs = _aot_call_targets(fn, args, ("x", "lnw", "lnb", "w", "b"))
    forward, backward = ([t for t in g if getattr(t, "namespace", None) == "mojo_direct"] for g in graphs)
    assert forward == [ops.layernorm_linear_train_fwd.default], graphs[0]
    assert backward == [ops.layernorm_linear_grads.default], graphs[1]


@pytest.mark.parametrize("frozen", [("w",), ("b",), ("w", "b")])
@pytest.mark.parametrize("op", ["traced_linear", "traced_linear_gelu", "traced_layernorm_linear"])
def test_traced_backward_skips_a_frozen_parameters_gradient(op: str, frozen: tuple[str, ...]) -> None:
    """A weight or bias that wants no gradient (fine-tuning part of a model): the traced ops' backward graph asks its
    gradients' op for no dW (weight_grad False: no GEMM for it) and no db, and the inputs that want gradients get
    eager autograd's."""
    from ops import layernorm_linear as LL

    assert direct.load_native().ops is not None and LL.traced.native_linear_traceable()
    ops = torch.ops.mojo_direct
    if op == "traced_layernorm_linear":
        args, names = _layernorm_linear_leaves((4, 5, 8), True), ("x", "lnw", "lnb", "w", "b")
        fn, grads_op = (lambda *t: ops.traced_layernorm_linear(*t, 1e-5, 1)), ops.layernorm_linear_grads.default
    else:
        args = _linear_leaves()
        names, fn = ("xn", "w", "b"), getattr(ops, op)
        grads_op = ops.linear_grads.default if op == "traced_linear" else ops.linear_gelu_grads.default
    for name, a in zip(names, args, strict=True):
        a.requires_grad_(name not in frozen)
    backward = _aot_graphs(fn, args, names)[1]
    calls = [n for n in backward.graph.nodes if n.target == grads_op]
    assert len(calls) == 1, backward.graph
    schema = {a.name: i for i, a in enumerate(grads_op._schema.arguments)}
    given = calls[0].args
    wants = {flag: given[schema[flag]] if len(given) > schema[flag] else calls[0].kwargs.get(flag, True)
             for flag in ("weight_grad", "bias_grad")}
    assert wants == {"weight_grad": "w" not in frozen, "bias_grad": "b" not in frozen}, calls[0]


def _gelu_after(linear: object, approximate: str = "tanh", second_user: bool = False) -> torch.fx.GraphModule:
    """A graph of ``gelu(linear(xn, w, b))`` as dynamo records it (``torch._C._nn.gelu``), with the Linear's output
    also returned where ``second_user``."""
    def f(xn: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> object:
        y = linear(xn, w, b)
        out = torch._C._nn.gelu(y, approximate=approximate)
        return (out, y) if second_user else out
    return torch.fx.symbolic_trace(f)


@pytest.mark.parametrize(("case", "fused"), [("ours", 1), ("ours_overload", 1), ("erf", 0),
                                             ("second_user", 0), ("torch_linear", 0), ("switched_off", 0)])
def test_gelu_epilogue_pass_rewrites_only_our_linears_tanh_gelu(case: str, fused: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """ops/layernorm_linear/inductor.py: a tanh GELU that is our Linear's only user becomes ``linear_gelu``, with the
    graph's results unchanged (bitwise, on the CPU); the erf GELU, a Linear used twice, torch's own Linear, and
    everything while COMPILED_LINEAR_GELU is off stay as they are."""
    from ops import layernorm_linear as LL
    from ops.layernorm_linear import config as layernorm_linear_config
    from ops.layernorm_linear import inductor as LLI

    assert direct.load_native().ops is not None and LL.traced.native_linear_traceable()
    ours = torch.ops.mojo_direct.linear
    gm = {"ours": lambda: _gelu_after(ours), "ours_overload": lambda: _gelu_after(ours.default),
          "erf": lambda: _gelu_after(ours, "none"), "second_user": lambda: _gelu_after(ours, second_user=True),
          "torch_linear": lambda: _gelu_after(torch.nn.functional.linear),
          "switched_off": lambda: _gelu_after(ours)}[case]()
    monkeypatch.setattr(layernorm_linear_config, "COMPILED_LINEAR_GELU", case != "switched_off")
    torch.manual_seed(0)
    args = (torch.randn(4, 8), torch.randn(3, 8), torch.randn(3))
    before = gm(*args)
    had = _call_targets(gm)
    LLI.PASS(gm.graph)
    gm.recompile()
    after = _call_targets(gm)
    assert after.count(torch.ops.mojo_direct.linear_gelu.default) == fused
    assert after == had if not fused else len(after) == len(had) - 1
    assert all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(gm(*args)),
                                                 torch.utils._pytree.tree_leaves(before), strict=True))


@pytest.mark.parametrize(("case", "unfused"), [("auto", True), ("sm90_by_name", False), ("float32", False),
                                               ("our_compiled_layernorm", False)])
def test_gelu_epilogue_pass_unfuses_the_fused_inference_forward(case: str, unfused: bool,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A tanh GELU after ``layernorm_linear_infer`` (auto's fused or Hopper forward) of 16-bit x becomes torch's
    ``layer_norm`` then ``linear_gelu`` (bitwise the unfused expression, on the CPU); an algo asked for by name,
    float32 x, and our own compiled LayerNorm keep the forward and inductor's GELU."""
    from ops import layernorm_linear as LL
    from ops.layernorm import config as layernorm_config
    from ops.layernorm_linear import inductor as LLI

    assert direct.load_native().ops is not None and LL.traced.native_linear_traceable()
    ops = torch.ops.mojo_direct
    algo = LL.config.ALGO_IDS["sm90" if case == "sm90_by_name" else "auto"]
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    monkeypatch.setattr(layernorm_config, "COMPILED_LAYERNORM", "ours" if case == "our_compiled_layernorm" else
                        "inductor")
    gm = torch.fx.symbolic_trace(lambda x, lnw, lnb, w, b: torch._C._nn.gelu(
        ops.layernorm_linear_infer(x, lnw, lnb, w, b, 1e-5, algo), approximate="tanh"))
    torch.manual_seed(0)
    args = [t.to(dtype) for t in (torch.randn(4, 8) * 3 + 1, 1 + torch.randn(8) / 5, torch.randn(8) / 5,
                                  torch.randn(6, 8), torch.randn(6))]
    next(iter(gm.graph.nodes)).meta["example_value"] = args[0]
    assert LLI.fuse_linear_gelu(gm.graph) == unfused
    gm.recompile()
    targets = _call_targets(gm)
    if not unfused:
        assert targets == [ops.layernorm_linear_infer, torch._C._nn.gelu]
        return
    assert targets == [getattr, torch.nn.functional.layer_norm, ops.linear_gelu.default]
    x, lnw, lnb, w, b = args
    want = torch.nn.functional.gelu(torch.nn.functional.linear(
        torch.nn.functional.layer_norm(x, (8,), lnw, lnb, 1e-5), w, b), approximate="tanh")
    assert torch.equal(gm(*args), want)


@pytest.mark.parametrize("training_linear", ["inductor", "ours"])
def test_gelu_epilogue_pass_on_training_marks(training_linear: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a training graph the pass turns ``gelu(traced_linear)`` (tanh) into ``traced_linear_gelu`` and each other
    ``traced_linear`` (a mark) back into ``F.linear``, unless COMPILED_TRAINING_LINEAR is "ours", which keeps it; the
    values and gradients stay (bitwise, on the CPU)."""
    from ops import layernorm_linear as LL
    from ops.layernorm_linear import config as layernorm_linear_config
    from ops.layernorm_linear import inductor as LLI

    assert direct.load_native().ops is not None and LL.traced.native_linear_traceable()
    ops = torch.ops.mojo_direct
    monkeypatch.setattr(layernorm_linear_config, "COMPILED_TRAINING_LINEAR", training_linear)
    monkeypatch.setattr(layernorm_linear_config, "COMPILED_LINEAR_GELU", True)

    def f(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        a = ops.traced_linear(x, w1, b1)
        return ops.traced_linear(torch._C._nn.gelu(a, approximate="tanh"), w2, None)
    gm = torch.fx.symbolic_trace(f)
    torch.manual_seed(0)
    args = [torch.randn(4, 8, dtype=torch.float64, requires_grad=True), torch.randn(6, 8, dtype=torch.float64),
            torch.randn(6, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)]
    before = torch.autograd.grad(gm(*args).sum(), args[0])[0]
    LLI.PASS(gm.graph)
    gm.recompile()
    targets = _call_targets(gm)
    second = ops.traced_linear if training_linear == "ours" else torch._C._nn.linear
    assert targets == [ops.traced_linear_gelu.default, second]
    assert torch.equal(torch.autograd.grad(gm(*args).sum(), args[0])[0], before)


def test_gelu_epilogue_pass_puts_the_gelu_into_the_one_op_layernorm_linear() -> None:
    """The pass turns ``gelu(traced_layernorm_linear(..))`` (tanh, its only user) into ``traced_layernorm_linear(..,
    act=1)``; the values and gradients stay (bitwise, on the CPU). A second user keeps the GELU apart."""
    from ops import layernorm_linear as LL
    from ops.layernorm_linear import inductor as LLI

    assert direct.load_native().ops is not None and LL.traced.native_linear_traceable()
    ops = torch.ops.mojo_direct
    args = _layernorm_linear_leaves((4, 8), True)

    def alone(x: torch.Tensor, lnw: torch.Tensor, lnb: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> object:
        return torch._C._nn.gelu(ops.traced_layernorm_linear(x, lnw, lnb, w, b, 1e-5), approximate="tanh")

    def used_twice(x: torch.Tensor, lnw: torch.Tensor, lnb: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> object:
        y = ops.traced_layernorm_linear(x, lnw, lnb, w, b, 1e-5)
        return torch._C._nn.gelu(y, approximate="tanh") + y

    for second_user, f in ((False, alone), (True, used_twice)):
        gm = torch.fx.symbolic_trace(f)
        before = gm(*args)
        grads = torch.autograd.grad(before.sum(), args)
        assert LLI.fuse_linear_gelu(gm.graph) == (0 if second_user else 1)
        gm.recompile()
        (node,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (
            ops.traced_layernorm_linear, ops.traced_layernorm_linear.default)]
        assert node.args[6:] == (() if second_user else (1,)), node.args
        after = gm(*args)
        assert torch.equal(after, before)
        assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(after.sum(), args), grads, strict=True))


@pytest.mark.parametrize("rows, in_gemm", [(None, True), (128, False), (4094, False), (4096, True), (8192, True)])
def test_gelu_epilogue_pass_picks_where_the_bias_grad_is_made(rows: int | None, in_gemm: bool) -> None:
    """``traced_linear_gelu``'s ``bias_grad_in_gemm`` from the pass: True from COMPILED_GELU_BIAS_GRAD_IN_GEMM_MIN_ROWS
    rows of x up (x as 2 x rows/2 x 8, so rows count every dimension but the last) and where x's shape is unknown."""
    from ops import layernorm_linear as LL
    from ops.layernorm_linear import config as layernorm_linear_config
    from ops.layernorm_linear import inductor as LLI

    assert layernorm_linear_config.COMPILED_GELU_BIAS_GRAD_IN_GEMM_MIN_ROWS == 4096
    assert direct.load_native().ops is not None and LL.traced.native_linear_traceable()
    ops = torch.ops.mojo_direct
    gm = torch.fx.symbolic_trace(lambda x, w: torch._C._nn.gelu(ops.traced_linear(x, w, w[0]), approximate="tanh"))
    if rows is not None:
        next(iter(gm.graph.nodes)).meta["example_value"] = torch.empty(2, rows // 2, 8, device="meta")
    assert LLI.fuse_linear_gelu(gm.graph) == 1
    (node,) = [n for n in gm.graph.nodes if n.target is ops.traced_linear_gelu.default]
    assert node.args[3] is in_gemm


@pytest.mark.parametrize(("knob", "rows", "form"), [("auto", 1, "torch"), ("auto", 128, "torch"),
                                                    ("auto", 4095, "torch"), ("auto", 4096, "ours"),
                                                    ("auto", 8192, "ours"), ("ours", 1, "ours"),
                                                    ("inductor", 8192, "inductor"), ("torch", 8192, "torch")])
def test_compiled_training_form(knob: str, rows: int, form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``compiled_training_form``: "auto" (the default) is "ours" from COMPILED_TRAINING_LAYERNORM_LINEAR_MIN_ROWS rows
    up and "torch" below; a form named by the knob stands at every size."""
    from ops.layernorm_linear import config as layernorm_linear_config

    assert layernorm_linear_config.COMPILED_TRAINING_LAYERNORM_LINEAR == "auto"
    assert layernorm_linear_config.COMPILED_TRAINING_LAYERNORM_LINEAR_MIN_ROWS == 4096
    monkeypatch.setattr(layernorm_linear_config, "COMPILED_TRAINING_LAYERNORM_LINEAR", knob)
    assert layernorm_linear_config.compiled_training_form(rows) == form


def test_compiled_training_form_names_a_bad_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    """A knob value that is no form is a ValueError naming the knob and the forms, not a silent default."""
    from ops.layernorm_linear import config as layernorm_linear_config

    monkeypatch.setattr(layernorm_linear_config, "COMPILED_TRAINING_LAYERNORM_LINEAR", "Ours")
    with pytest.raises(ValueError, match=r"COMPILED_TRAINING_LAYERNORM_LINEAR: expected one of .*'auto'.*'Ours'"):
        layernorm_linear_config.compiled_training_form(4096)


def test_gelu_epilogue_pass_installs_only_in_a_free_place(monkeypatch: pytest.MonkeyPatch,
                                                          free_pre_grad_pass: None) -> None:
    """The pass takes inductor's pre-grad custom pass only where none is set, once; a user's pass is left alone. Its
    cache key changes with each switch it reads."""
    from torch._inductor import config as inductor_config

    from ops.layernorm import config as layernorm_config
    from ops.layernorm_linear import config as layernorm_linear_config
    from ops.layernorm_linear import inductor as LLI

    assert LLI.install() and LLI.install() and inductor_config.pre_grad_custom_pass is LLI.PASS
    theirs = lambda graph: None  # noqa: E731
    inductor_config.pre_grad_custom_pass = theirs
    assert not LLI.install() and inductor_config.pre_grad_custom_pass is theirs
    on = LLI.PASS.uuid()
    monkeypatch.setattr(layernorm_linear_config, "COMPILED_LINEAR_GELU", False)
    off = LLI.PASS.uuid()
    monkeypatch.setattr(layernorm_config, "COMPILED_LAYERNORM", "ours")
    assert len({on, off, LLI.PASS.uuid()}) == 3
