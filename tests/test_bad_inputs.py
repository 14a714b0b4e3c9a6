"""One table of bad inputs against every public entry of both ops, forward and backward: each gets our named
error (its type, and a message that starts with the argument's name), never a raw torch error, a crash or a
result. CPU, so CI runs it; the GPU's own cases (devices mixed) are in the op tests."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch

from ops import layernorm as L
from ops import layernorm_linear as LL
from ops import rmsnorm as R

K, N = 16, 8


def _csr(t: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():   # torch warns that its sparse CSR support is in beta
        warnings.simplefilter("ignore")
        return t.to_sparse_csr()


def _ln_args() -> dict[str, object]:
    torch.manual_seed(0)
    return {"x": torch.randn(4, K), "weight": torch.randn(K), "bias": torch.randn(K), "eps": 1e-5}


# (case id, argument changed, its bad value, error, name the message starts with)
LN_CASES = [
    ("x-list", "x", [[1.0] * K], TypeError, "x"),
    ("x-int", "x", torch.ones(4, K, dtype=torch.int32), TypeError, "x"),
    ("x-0d", "x", torch.tensor(1.0), ValueError, "x"),
    ("x-sparse", "x", torch.randn(4, K).to_sparse(), ValueError, "x"),   # torch's LayerNorm refuses them too
    ("x-sparse-csr", "x", _csr(torch.randn(4, K)), ValueError, "x"),
    ("weight-sparse", "weight", torch.randn(K).to_sparse(), ValueError, "weight"),
    ("weight-half", "weight", torch.ones(K, dtype=torch.float16), TypeError, "weight"),
    ("weight-size", "weight", torch.ones(K - 1), ValueError, "weight"),
    ("weight-2d", "weight", torch.ones(1, K), ValueError, "weight"),
    ("weight-none-type", "weight", "ones", TypeError, "weight"),
    ("bias-size", "bias", torch.zeros(K + 1), ValueError, "bias"),
    ("bias-int", "bias", torch.zeros(K, dtype=torch.int64), TypeError, "bias"),
    ("bias-meta", "bias", torch.zeros(K, device="meta"), ValueError, "bias"),
    ("eps-string", "eps", "1e-5", TypeError, "eps"),
    ("eps-none", "eps", None, TypeError, "eps"),
    ("eps-1d-tensor", "eps", torch.tensor([1e-5]), TypeError, "eps"),   # torch takes a 0-dim tensor, not this
]

# float64, meta x and rows past int32: the kernel entries refuse them; the drop-in entries take them as torch does
# (by torch's ops, ops.layernorm.torch_answers), so there the float32 cpu parameters are what is wrong, as for torch
X_KERNEL_CASES = [
    ("x-float64", "x", torch.randn(4, K, dtype=torch.float64), TypeError, "x"),
    ("x-meta", "x", torch.empty(4, K, device="meta"), ValueError, "x"),
    ("x-rows-past-int32", "x", torch.zeros(1, K).expand(2**31, K), ValueError, "x"),   # a view: no memory
]
X_DROP_IN_CASES = [   # the name: the op's LayerNorm weight (_every_entry)
    ("x-float64-float32-params", "x", torch.randn(4, K, dtype=torch.float64), TypeError, None),
    ("x-meta-cpu-params", "x", torch.empty(4, K, device="meta"), ValueError, None),
]

LN_ENTRIES: dict[str, Callable[..., object]] = {
    "layernorm_fwd": lambda x, weight, bias, eps: L.layernorm_fwd(x, weight, bias, eps),
    "layernorm": lambda x, weight, bias, eps: L.layernorm(x, weight, bias, eps),
    "layernorm-grad": lambda x, weight, bias, eps: L.layernorm(
        x, weight.requires_grad_() if isinstance(weight, torch.Tensor) and weight.is_floating_point() else weight,
        bias, eps),
    "layer_norm": lambda x, weight, bias, eps: L.layer_norm(x, (K,), weight, bias, eps),
}


def _raises(fn: Callable[[], object], err: type[Exception], name: str) -> None:
    with pytest.raises(err) as info:
        fn()
    assert str(info.value).startswith(f"{name}:"), f"the error does not name {name}: {info.value}"


LN_MORE = [
    ("activation", lambda a: L.layernorm(a["x"], a["weight"], a["bias"], activation="relu"), ValueError, "activation"),
    ("variant", lambda a: L.layernorm_fwd(a["x"], a["weight"], a["bias"], variant="nope"), ValueError, "variant"),
    ("normalized_shape-trailing", lambda a: L.layer_norm(a["x"], (3, K)), ValueError, "normalized_shape"),
    ("normalized_shape-negative", lambda a: L.layer_norm(a["x"], (-1,)), ValueError, "normalized_shape"),
    ("normalized_shape-module", lambda a: L.LayerNorm((4, -1)), ValueError, "normalized_shape"),
    ("layer_norm-weight-shape", lambda a: L.layer_norm(a["x"].view(4, 2, 8), (2, 8), a["weight"]), ValueError,
     "weight"),
    ("module-x-string", lambda a: L.LayerNorm(K)("x"), TypeError, "x"),
    ("module-x-size", lambda a: L.LayerNorm(K + 1)(a["x"]), ValueError, "weight"),
    ("module-double-params", lambda a: L.LayerNorm(K, dtype=torch.float64)(a["x"].half()), TypeError, "weight"),
]


@pytest.mark.parametrize("fn,err,name", [c[1:] for c in LN_MORE], ids=[c[0] for c in LN_MORE])
def test_layernorm_bad_option(fn: Callable[[dict], object], err: type[Exception], name: str) -> None:
    _raises(lambda: fn(_ln_args()), err, name)


def _ln_bwd_args() -> dict[str, object]:
    a = _ln_args()
    y, mean, rstd = L.layernorm_fwd(a["x"], a["weight"], a["bias"])
    return {"dy": torch.randn_like(y), "x": a["x"], "weight": a["weight"], "bias": a["bias"], "mean": mean,
            "rstd": rstd}


LN_BWD_CASES = [
    ("dy-shape", "dy", torch.randn(4, K - 1), ValueError, "dy"),
    ("dy-dtype", "dy", torch.randn(4, K, dtype=torch.float64), TypeError, "dy"),
    ("dy-list", "dy", [[0.0] * K] * 4, TypeError, "dy"),
    ("mean-shape", "mean", torch.zeros(3), ValueError, "mean"),
    ("rstd-dtype", "rstd", torch.zeros(4, dtype=torch.float64), TypeError, "rstd"),
    ("weight-size", "weight", torch.ones(K - 1), ValueError, "weight"),
]


@pytest.mark.parametrize("entry", ["layernorm_bwd", "custom_op"])
@pytest.mark.parametrize("case,arg,value,err,name", LN_BWD_CASES, ids=[c[0] for c in LN_BWD_CASES])
def test_layernorm_backward_bad_input(entry: str, case: str, arg: str, value: object, err: type[Exception],
                                      name: str) -> None:
    a = _ln_bwd_args() | {arg: value}
    if entry == "custom_op":
        if not isinstance(value, torch.Tensor):
            pytest.skip("a list is refused by the op's schema, before our code")
        fn = lambda: torch.ops.mojo.layernorm_bwd(*a.values(), "none")  # noqa: E731
    else:
        fn = lambda: L.layernorm_bwd(*a.values())  # noqa: E731
    _raises(fn, err, name)


def test_autograd_backward_bad_grad_output_is_refused_before_our_code() -> None:
    """A grad_output of the wrong shape never reaches a backward: torch's engine refuses it (its own error, as
    for any torch op), and nothing is returned."""
    a = _ln_args()
    x = a["x"].requires_grad_()
    y = L.layernorm(x, a["weight"], a["bias"])
    with pytest.raises(RuntimeError, match="shape"):
        y.backward(torch.ones(4, K - 1))
    assert x.grad is None


def _lnl_args() -> dict[str, object]:
    torch.manual_seed(0)
    return {"x": torch.randn(4, K), "ln_weight": torch.randn(K), "ln_bias": torch.randn(K),
            "weight": torch.randn(N, K), "bias": torch.randn(N), "eps": 1e-5}


LNL_CASES = [
    ("x-list", "x", [[1.0] * K], TypeError, "x"),
    ("ln_weight-size", "ln_weight", torch.ones(K - 1), ValueError, "ln_weight"),
    ("ln_bias-half", "ln_bias", torch.zeros(K, dtype=torch.float16), TypeError, "ln_bias"),
    ("weight-k", "weight", torch.randn(N, K - 1), ValueError, "weight"),
    ("weight-sparse", "weight", torch.randn(N, K).to_sparse(), ValueError, "weight"),
    ("x-sparse-csr", "x", _csr(torch.randn(4, K)), ValueError, "x"),
    ("weight-1d", "weight", torch.randn(K), ValueError, "weight"),
    ("weight-3d", "weight", torch.randn(1, N, K), ValueError, "weight"),
    ("weight-int", "weight", torch.ones(N, K, dtype=torch.int32), TypeError, "weight"),
    ("weight-bf16", "weight", torch.randn(N, K, dtype=torch.bfloat16), TypeError, "weight"),
    ("weight-empty-1d", "weight", torch.empty(0), ValueError, "weight"),
    ("weight-list", "weight", [[0.0] * K] * N, TypeError, "weight"),
    ("weight-meta", "weight", torch.empty(N, K, device="meta"), ValueError, "weight"),
    ("bias-size", "bias", torch.zeros(N + 1), ValueError, "bias"),
    ("bias-2d", "bias", torch.zeros(1, N), ValueError, "bias"),
    ("bias-bf16", "bias", torch.zeros(N, dtype=torch.bfloat16), TypeError, "bias"),
    ("eps-string", "eps", "small", TypeError, "eps"),
    ("eps-grad-tensor", "eps", torch.tensor(1e-5, requires_grad=True), TypeError, "eps"),
]

LNL_ENTRIES: dict[str, Callable[..., object]] = {
    "layernorm_linear_fwd": LL.layernorm_linear_fwd,
    "layernorm_linear": LL.layernorm_linear,
    "layernorm_linear-grad": lambda x, ln_weight, **kw: LL.layernorm_linear(
        x, ln_weight.requires_grad_() if isinstance(ln_weight, torch.Tensor) and ln_weight.is_floating_point()
        else ln_weight, **kw),
}


LNL_ACT_ENTRIES: dict[str, Callable[..., object]] = {
    "layernorm_linear_act": lambda activation="gelu", **kw: LL.layernorm_linear_act(**kw, activation=activation),
    "layernorm_linear_act-grad": lambda x, ln_weight, activation="gelu", **kw: LL.layernorm_linear_act(
        x, ln_weight.requires_grad_() if isinstance(ln_weight, torch.Tensor) and ln_weight.is_floating_point()
        else ln_weight, **kw, activation=activation),
}
LNL_ACT_CASES = LNL_CASES + [("activation", "activation", "silu", ValueError, "activation"),
                             ("activation-none", "activation", None, ValueError, "activation")]


def _every_entry(entries: dict[str, Callable[..., object]], make_args: Callable[[], dict[str, object]],
                 cases: list[tuple], kernel_entry: str, ln_weight: str) -> list:
    """Each case of an op's table on each of its entries, and X_KERNEL_CASES on ``kernel_entry`` or
    X_DROP_IN_CASES (naming the LayerNorm's weight, ``ln_weight``) on the others, as pytest params."""
    params = []
    for e in entries:
        x_cases = X_KERNEL_CASES if e == kernel_entry else [(*c[:4], ln_weight) for c in X_DROP_IN_CASES]
        params += [pytest.param(entries[e], make_args, arg, value, err, name, id=f"{e}-{case}")
                   for case, arg, value, err, name in cases + x_cases]
    return params


def _rms_args() -> dict[str, object]:
    torch.manual_seed(0)
    return {"x": torch.randn(4, K), "weight": torch.randn(K), "eps": 1e-6}


# RMSNorm: weight and eps may be None (eps: x's dtype's); float64 and meta x are torch's to answer (no kernel entry)
RMS_CASES = [c for c in LN_CASES if c[1] != "bias" and c[0] not in ("weight-none-type", "eps-none")] + [
    ("weight-3d", "weight", torch.ones(1, 1, K), ValueError, "weight"),
    ("semantics", "semantics", "t5", ValueError, "semantics"),
]
RMS_ENTRIES: dict[str, Callable[..., object]] = {
    "rms_norm": lambda x, weight, eps, semantics="torch": R.rms_norm(x, K, weight, eps, semantics=semantics),
    "rms_norm-grad": lambda x, weight, eps, semantics="torch": R.rms_norm(
        x, K, weight.requires_grad_() if isinstance(weight, torch.Tensor) and weight.is_floating_point() else weight,
        eps, semantics=semantics),
}


def _rms_linear_args() -> dict[str, object]:
    torch.manual_seed(0)
    return {"x": torch.randn(4, K), "norm_weight": torch.randn(K), "weight": torch.randn(N, K), "bias": torch.randn(N),
            "eps": 1e-6}


# RMSNorm+Linear: RMSNorm's cases on the norm's weight (named norm_weight), LayerNorm+Linear's on the Linear's
RMS_LINEAR_CASES = ([(f"norm_{c[0]}", "norm_weight", c[2], c[3], "norm_weight") for c in RMS_CASES
                     if c[1] == "weight"]
                    + [c for c in LNL_CASES if c[1] in ("x", "weight", "bias", "eps") and c[0] != "eps-grad-tensor"]
                    + [("semantics", "semantics", "t5", ValueError, "semantics")])
RMS_LINEAR_ENTRIES: dict[str, Callable[..., object]] = {
    "rms_norm_linear": lambda x, norm_weight, weight, bias, eps, semantics="torch": R.rms_norm_linear(
        x, norm_weight, weight, bias, eps, semantics=semantics),
    "rms_norm_linear-grad": lambda x, norm_weight, weight, bias, eps, semantics="torch": R.rms_norm_linear(
        x.requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() and x.layout == torch.strided
        else x, norm_weight, weight, bias, eps, semantics=semantics),
}


@pytest.mark.parametrize("entry,make_args,arg,value,err,name",
                         _every_entry(LN_ENTRIES, _ln_args, LN_CASES, "layernorm_fwd", "weight")
                         + _every_entry(LNL_ENTRIES, _lnl_args, LNL_CASES, "layernorm_linear_fwd", "ln_weight")
                         + _every_entry(LNL_ACT_ENTRIES, _lnl_args, LNL_ACT_CASES, "", "ln_weight")
                         + [pytest.param(RMS_ENTRIES[e], _rms_args, *c[1:], id=f"{e}-{c[0]}")
                            for e in RMS_ENTRIES for c in RMS_CASES]
                         + [pytest.param(RMS_LINEAR_ENTRIES[e], _rms_linear_args, *c[1:], id=f"{e}-{c[0]}")
                            for e in RMS_LINEAR_ENTRIES for c in RMS_LINEAR_CASES])
def test_bad_input(entry: Callable[..., object], make_args: Callable[[], dict[str, object]], arg: str, value: object,
                   err: type[Exception], name: str) -> None:
    args = make_args() | {arg: value}
    _raises(lambda: entry(**args), err, name)


def test_layernorm_linear_bad_algo() -> None:
    a = _lnl_args()
    for entry in LNL_ENTRIES.values():
        _raises(lambda entry=entry: entry(**a, algo="fastest"), ValueError, "algo")
    _raises(lambda: LL.FusedLayerNormLinear(K, N, algo="fastest"), ValueError, "algo")


def _lnl_bwd_args() -> dict[str, object]:
    a = _lnl_args()
    y, mean, rstd = LL.layernorm_linear_fwd(a["x"], a["ln_weight"], a["ln_bias"], a["weight"], a["bias"])
    return {"dy": torch.randn_like(y), "x": a["x"], "ln_weight": a["ln_weight"], "ln_bias": a["ln_bias"],
            "weight": a["weight"], "mean": mean, "rstd": rstd}


LNL_BWD_CASES = [
    ("dy-shape", "dy", torch.randn(4, N + 1), ValueError, "dy"),
    ("dy-dtype", "dy", torch.randn(4, N, dtype=torch.bfloat16), TypeError, "dy"),
    ("dy-list", "dy", [[0.0] * N] * 4, TypeError, "dy"),
    ("weight-k", "weight", torch.randn(N, K + 1), ValueError, "weight"),
]


@pytest.mark.parametrize("case,arg,value,err,name", LNL_BWD_CASES, ids=[c[0] for c in LNL_BWD_CASES])
def test_layernorm_linear_backward_bad_input(case: str, arg: str, value: object, err: type[Exception],
                                             name: str) -> None:
    a = _lnl_bwd_args() | {arg: value}
    _raises(lambda: LL.layernorm_linear_bwd(**a), err, name)
    xn = torch.nn.functional.layer_norm(_lnl_args()["x"], (K,))
    _raises(lambda: LL.layernorm_linear_bwd(**a, xn=xn), err, name)


def test_layernorm_linear_bad_xn() -> None:
    a = _lnl_bwd_args()
    _raises(lambda: LL.layernorm_linear_bwd(**a, xn=torch.randn(4, K + 1)), ValueError, "xn")
    _raises(lambda: LL.layernorm_linear_bwd(**a, xn=torch.randn(4, K).double()), TypeError, "xn")


def test_layernorm_linear_backward_bad_eps() -> None:
    """eps, which the backward reads only to recompute xn: named on the kernels' route and on the op's (fake
    tensors, as under FakeTensorMode)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _raises(lambda: LL.layernorm_linear_bwd(**_lnl_bwd_args(), eps="small"), TypeError, "eps")
    with FakeTensorMode() as mode:
        a = {k: mode.from_tensor(v) for k, v in _lnl_bwd_args().items()}
        _raises(lambda: LL.layernorm_linear_bwd(**a, eps="small"), TypeError, "eps")


def test_module_from_torch_refuses_other_modules() -> None:
    _raises(lambda: LL.FusedLayerNormLinear.from_torch(torch.nn.Sequential(torch.nn.Linear(K, K),
                                                                           torch.nn.LayerNorm(K))), TypeError, "seq")
    _raises(lambda: LL.FusedLayerNormLinear.from_torch(torch.nn.LayerNorm(K)), TypeError, "seq")
    _raises(lambda: L.LayerNorm.from_torch(torch.nn.Linear(K, K)), TypeError, "ln")
    _raises(lambda: LL.FusedLayerNormLinear(K, N, normalized_shape=(K, 3)), ValueError, "normalized_shape")


def test_module_sizes_are_named() -> None:
    """The modules' sizes: what torch's take (NumPy integers, a NumPy array of them) builds the same module;
    anything else gets our error (torch's modules raise a raw TypeError from inside for a float size)."""
    assert L.LayerNorm(np.int64(K)).normalized_shape == (K,)
    assert L.LayerNorm(np.array([3, K])).normalized_shape == (3, K)
    assert LL.FusedLayerNormLinear(np.int32(K), np.int64(N))[1].weight.shape == (N, K)
    _raises(lambda: L.LayerNorm(float(K)), ValueError, "normalized_shape")
    _raises(lambda: L.LayerNorm((K, "3")), ValueError, "normalized_shape")
    _raises(lambda: LL.FusedLayerNormLinear(float(K), N), TypeError, "in_features")
    _raises(lambda: LL.FusedLayerNormLinear(K, -1), ValueError, "out_features")
    _raises(lambda: LL.FusedLayerNormLinear(K, N, eps="small"), TypeError, "eps")

