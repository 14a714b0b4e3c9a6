"""The one input classifier of each op (``classify`` in ops/layernorm/checks.py and ops/layernorm_linear/checks.py)
against its C++ mirror (``accepts`` and ``linear_accepts`` in ops/launch/native/plans.h): on every row of the
bad-input table, and on calls that our kernels take as they come, take once adapted, or leave to torch's ops, the
C++ side takes a call exactly where Python classifies it "kernels". CPU in CI (the C++ library builds there); the
GPU suite runs it on the GPU as well."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from test_bad_inputs import LN_CASES, LNL_CASES, X_KERNEL_CASES, K, N
from torch.autograd import forward_ad
from torch.utils.flop_counter import FlopCounterMode

from ops.launch import direct
from ops.layernorm import checks as ln_checks
from ops.layernorm_linear import checks as lnl_checks


class _Sub(torch.Tensor):
    """A Python subclass with no dispatch key of its own: torch's ops answer it, so that its __torch_function__
    sees them; the entries never hand it to the C++ side (``native_takes``)."""


def _on(v: object, device: str) -> object:
    """A table's value on ``device``: an expanded view stays a view (2**31 rows of no memory)."""
    if not isinstance(v, torch.Tensor) or v.is_meta or device == "cpu":
        return v
    if v.layout is torch.strided and 0 in v.stride():
        return v[:1].to(device).expand(v.shape)
    return v.to(device)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """t's values in a non-contiguous tensor of t's shape."""
    return torch.stack([t, t], -1)[..., 0]


def _f32_norm_params(a: dict, p: str) -> dict:
    """Everything bfloat16 but the LayerNorm's parameters (``p`` and its bias), float32."""
    norm = (p, p.replace("weight", "bias"))
    return {k: v if k in norm or v is None else v.bfloat16() for k, v in a.items()}


def _nothing(device: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


# (case id, the change to a good call, made inside the context, and the context, a function of the device). "p":
# the op's first LayerNorm parameter (weight, ln_weight).
Change = Callable[[dict, str], dict]
MORE_CASES: list[tuple[str, Change, Callable[[str], contextlib.AbstractContextManager]]] = [
    ("good", lambda a, p: a, _nothing),
    ("bf16", lambda a, p: {k: v.bfloat16() for k, v in a.items()}, _nothing),
    ("fp16", lambda a, p: {k: v.half() for k, v in a.items()}, _nothing),
    ("x-3d", lambda a, p: a | {"x": a["x"].reshape(2, 2, K)}, _nothing),
    ("x-requires-grad", lambda a, p: a | {"x": a["x"].requires_grad_()}, _nothing),
    ("x-strided", lambda a, p: a | {"x": _strided(a["x"])}, _nothing),
    ("x-empty", lambda a, p: a | {"x": a["x"][:0]}, _nothing),
    ("f32-params-of-bf16-x", _f32_norm_params, _nothing),
    ("param-strided", lambda a, p: a | {p: _strided(a[p])}, _nothing),
    ("x-subclass", lambda a, p: a | {"x": a["x"].as_subclass(_Sub)}, _nothing),
    ("x-neg-view", lambda a, p: a | {"x": torch.complex(a["x"], a["x"]).conj().imag}, _nothing),
    ("x-float64", lambda a, p: a | {"x": a["x"].double()}, _nothing),
    ("dispatch-mode", lambda a, p: a, lambda d: FlopCounterMode(display=False)),
    ("forward-ad-level", lambda a, p: a, lambda d: forward_ad.dual_level()),
    ("forward-ad-dual", lambda a, p: a | {"x": forward_ad.make_dual(a["x"], torch.ones_like(a["x"]))},
     lambda d: forward_ad.dual_level()),
    ("autocast", lambda a, p: a, lambda d: torch.autocast(d, dtype=torch.bfloat16)),
]
LNL_MORE_CASES = [
    ("linear-weight-strided", lambda a, p: a | {"weight": _strided(a["weight"])}, _nothing),
    ("linear-no-bias", lambda a, p: a | {"bias": None}, _nothing),
    ("linear-bias-strided", lambda a, p: a | {"bias": _strided(a["bias"])}, _nothing),
]


def _ln_args(device: str) -> dict[str, object]:
    torch.manual_seed(0)
    return {"x": torch.randn(4, K, device=device), "weight": torch.randn(K, device=device),
            "bias": torch.randn(K, device=device)}


def _lnl_args(device: str) -> dict[str, object]:
    return {**dict(zip(("x", "ln_weight", "ln_bias"), _ln_args(device).values(), strict=True)),
            "weight": torch.randn(N, K, device=device), "bias": torch.randn(N, device=device)}


def _python(classify: Callable[..., str], args: dict[str, object]) -> str:
    """Python's verdict: the route class, or "error" (a named error)."""
    try:
        return classify(**args)
    except (TypeError, ValueError):
        return "error"


def _ln_cpp(args: dict[str, object]) -> bool:
    if not ln_checks.native_takes(*args.values(), 1e-5, "fast", "none"):
        return False   # the Python entry's gate: the C++ side is not called
    return direct.load_native().ops.layernorm_accepts(*args.values())


def _lnl_cpp(args: dict[str, object]) -> bool:
    if not lnl_checks.native_takes(*args.values(), 1e-5, "auto"):
        return False
    return direct.load_native().ops.layernorm_linear_accepts(*args.values())


OPS = {"layernorm": (_ln_args, ln_checks.classify, _ln_cpp, "weight"),
       "layernorm_linear": (_lnl_args, lnl_checks.classify, _lnl_cpp, "ln_weight")}


def _table_params() -> list:
    params = []
    for op, cases in (("layernorm", LN_CASES), ("layernorm_linear", LNL_CASES)):
        for case, arg, value, *_ in cases + X_KERNEL_CASES:
            if arg != "eps":   # not the classifier's (as_eps names it)
                params.append(pytest.param(op, arg, value, id=f"{op}-{case}"))
    return params


@pytest.fixture(scope="module", autouse=True)
def native() -> None:
    if direct.load_native().ops is None:
        pytest.fail("the C++ launcher did not build (see the warning)")


@pytest.mark.parametrize("op,arg,value", _table_params())
def test_bad_input_table(device: str, op: str, arg: str, value: object) -> None:
    """A bad input gets Python's named error or torch's ops, and the C++ side declines it."""
    make, classify, cpp, _ = OPS[op]
    args = make(device) | {arg: _on(value, device)}
    kind = _python(classify, args)
    assert kind in ("error", "torch"), f"Python classifies a bad input {kind!r}"
    assert not cpp(args), f"the C++ side takes a bad input Python classifies {kind!r}"


@pytest.mark.parametrize("case,change,context", MORE_CASES + LNL_MORE_CASES,
                         ids=[c[0] for c in MORE_CASES + LNL_MORE_CASES])
@pytest.mark.parametrize("op", OPS)
def test_cpp_takes_what_python_classifies_kernels(device: str, op: str, case: str, change: Change,
                                                   context: Callable[[str], contextlib.AbstractContextManager]) -> None:
    """Good calls, calls adapted first and calls torch's ops answer: the C++ side takes exactly the "kernels" ones."""
    if case.startswith("linear-") and op != "layernorm_linear":
        pytest.skip("a Linear's parameter")
    make, classify, cpp, first_param = OPS[op]
    with context(device):
        args = change(make(device), first_param)
        kind = _python(classify, args)
        assert kind != "error", f"{case}: Python refuses a call torch takes"
        assert cpp(args) == (kind == "kernels"), f"{case}: Python classifies it {kind!r}, the C++ side disagrees"


def test_classes_as_expected_on_the_cpu() -> None:
    """The classes themselves, so that the comparison cannot pass with both sides wrong the same way."""
    expected = {"good": "kernels", "bf16": "kernels", "x-strided": "adapt", "x-empty": "adapt",
                "f32-params-of-bf16-x": "adapt", "param-strided": "adapt", "x-subclass": "torch",
                "x-neg-view": "torch", "x-float64": "torch", "dispatch-mode": "torch", "forward-ad-level": "torch"}
    for case, change, context in MORE_CASES:
        if case in expected:
            with context("cpu"):
                args = change(_ln_args("cpu"), "weight")
                assert ln_checks.classify(**args) == expected[case], case
    with torch.autocast("cpu", dtype=torch.bfloat16):   # CPU autocast leaves a LayerNorm alone, not a Linear
        assert ln_checks.classify(**_ln_args("cpu")) == "kernels"
        assert lnl_checks.classify(**_lnl_args("cpu")) == "adapt"
