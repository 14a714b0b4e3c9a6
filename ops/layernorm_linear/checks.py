"""LayerNorm+Linear's input checks and named errors, and the adaptation of what the kernels do not take as it
comes."""

from __future__ import annotations

import torch

from ops.inputs import (
    DTYPES,
    INT32_MAX,
    PLAIN_TENSORS,
    TORCH_TAKES,
    check_int32_rows,
    check_same,
    check_size,
    check_tensor,
    last_size,
    torch_answers,
)
from ops.layernorm import checks as ln_checks
from ops.layernorm_linear.config import ALGO_IDS


def validate(x: object, ln_weight: object, ln_bias: object, weight: object, bias: object | None) -> None:
    """Raise ValueError/TypeError naming the first bad argument (bias None: not checked). Strided or empty x
    and float32 LayerNorm parameters with 16-bit x pass (the entries adapt them); the Linear's weight and bias
    must have x's dtype, as ``torch.nn.Linear`` needs outside autocast."""
    if ln_checks.valid(x, ln_weight, ln_bias) and valid_linear(x, weight, bias):
        return
    check_tensor("x", x, min_ndim=1, dtypes=DTYPES, layout=False)
    ln_checks.validate(x, ln_weight, ln_bias, names=("x", "ln_weight", "ln_bias"))
    check_linear(x, weight, bias, same_dtype=True)


def classify(x: object, ln_weight: object, ln_bias: object, weight: object, bias: object | None) -> str:
    """The one input classifier of a drop-in LayerNorm+Linear call (``layernorm_linear``): which route may take it,
    or the named error. The C++ entries' ``linear_accepts`` (ops/launch/native/plans.h) is its mirror: it takes
    exactly the calls classified "kernels" (tests/test_classify.py compares the two).

    Returns:
        "torch": torch's own ops answer it (``torch_answers``);
        "kernels": our kernels take it as it comes (both ``valid`` checks, not under autocast);
        "adapt": they take it once adapted: under autocast (which casts the Linear's parameters), empty, strided
        x, float32 LayerNorm parameters of 16-bit x.

    Raises:
        TypeError, ValueError: ``validate``'s named error for anything else (under autocast, the Linear's
        parameters may have another dtype).
    """
    if torch_answers(x, ln_weight, ln_bias, weight, bias):
        return "torch"
    autocast = isinstance(x, torch.Tensor) and torch.is_autocast_enabled(x.device.type)
    if ln_checks.valid(x, ln_weight, ln_bias) and valid_linear(x, weight, bias):
        return "adapt" if autocast else "kernels"
    if autocast:
        ln_checks.validate(x, ln_weight, ln_bias, names=("x", "ln_weight", "ln_bias"))
        check_linear(x, weight, bias, same_dtype=False)
    else:
        validate(x, ln_weight, ln_bias, weight, bias)
    return "adapt"


def native_takes(x: object, ln_weight: object, ln_bias: object, weight: object, bias: object | None, eps: object,
                 algo: str) -> bool:
    """Whether a call's arguments fit the C++ entries' schema and choices (plain tensors, bias None or one, a float
    eps, a known algorithm). The entries check the rest (``linear_accepts``, the mirror of ``classify``)."""
    return (x.__class__ in PLAIN_TENSORS and ln_weight.__class__ in PLAIN_TENSORS
            and ln_bias.__class__ in PLAIN_TENSORS and weight.__class__ in PLAIN_TENSORS
            and (bias is None or bias.__class__ in PLAIN_TENSORS) and eps.__class__ is float and algo in ALGO_IDS)


def check_linear(x: torch.Tensor, weight: object, bias: object | None, same_dtype: bool,
                  by_torch: bool = False) -> None:
    """The Linear's named checks: weight [N, K] and bias [N] (or None) on x's device, of x's dtype unless
    ``same_dtype`` is False (autocast casts them); ``by_torch``: for a call torch's ops answer (float64 and the
    meta device taken)."""
    named = {"weight": weight}
    kw = TORCH_TAKES if by_torch else {"dtypes": DTYPES}
    check_tensor("weight", weight, ndim=2, layout=False, **kw)
    if bias is not None:
        check_tensor("bias", bias, ndim=1, layout=False, **kw)
        named["bias"] = bias
    for name, t in named.items():
        if t.device != x.device or (same_dtype and t.dtype != x.dtype):
            check_same({"x": x, name: t})
    check_size("weight", weight, 1, last_size(x), "x's last dim")
    if not by_torch:
        check_int32_rows("weight", weight)
    if bias is not None:
        check_size("bias", bias, 0, weight.shape[0], "weight's rows (out features)")


def check_linears(x: object, weights: object, biases: object) -> None:
    """``linears``' named checks: x a tensor; weights a non-empty list or tuple of 2-D tensors ``[N_i, K]`` and biases
    None or one 1-D ``[N_i]`` per weight, all on x's device and of its dtype (torch's ``F.linear`` takes any dtype)."""
    x = check_tensor("x", x, min_ndim=1, layout=False, **TORCH_TAKES)
    if weights.__class__ not in (list, tuple) or not weights:
        raise TypeError(f"weights: expected a non-empty list or tuple of tensors, got {type(weights).__name__}")
    if biases is not None and (biases.__class__ not in (list, tuple) or len(biases) != len(weights)):
        raise TypeError(f"biases: expected None or a list or tuple of {len(weights)} tensors (one per weight), "
                        f"got {type(biases).__name__}")
    for i, w in enumerate(weights):
        check_tensor(f"weights[{i}]", w, ndim=2, layout=False, **TORCH_TAKES)
        check_same({"x": x, f"weights[{i}]": w})
        check_size(f"weights[{i}]", w, 1, last_size(x), "x's last dim")
        if biases is not None:
            check_tensor(f"biases[{i}]", biases[i], ndim=1, layout=False, **TORCH_TAKES)
            check_same({"x": x, f"biases[{i}]": biases[i]})
            check_size(f"biases[{i}]", biases[i], 0, w.shape[0], f"weights[{i}]'s rows")


def adapted_fwd(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, ...] | None:
    """For validated arguments the kernels do not take as they come: (x, ln_weight, ln_bias, weight, bias) made
    contiguous and the LayerNorm parameters in x's dtype (``layernorm.adapt``); or None for empty x, K = 0 or
    N = 0, which torch answers (the caller's ``empty_result``)."""
    if x.numel() == 0 or weight.numel() == 0:
        return None
    x, ln_weight, ln_bias = ln_checks.adapt(x, ln_weight, ln_bias)
    return x, ln_weight, ln_bias, weight.contiguous(), None if bias is None else bias.contiguous()


def empty_result(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Linear(LayerNorm(x)) by torch where there is nothing to compute (no rows, K = 0 or N = 0): its shapes,
    its values (bias where K = 0) and, with autograd, its zero gradients."""
    xn = torch.nn.functional.layer_norm(x, x.shape[-1:], ln_weight.to(x.dtype), ln_bias.to(x.dtype), eps)
    return torch.nn.functional.linear(xn, weight, bias)


def valid_linear(x: torch.Tensor, weight: object, bias: object | None) -> bool:
    """The common case of the Linear's checks in few attribute reads (``validate`` names what is wrong)."""
    try:
        return (weight.dtype is x.dtype and weight.device == x.device and weight.dim() == 2
                and weight.shape[1] == x.shape[-1] and 0 < weight.shape[0] <= INT32_MAX and weight.is_contiguous()
                and isinstance(weight, torch.Tensor)
                and (bias is None or (bias.dtype is x.dtype and bias.device == x.device and bias.dim() == 1
                                      and bias.shape[0] == weight.shape[0] and bias.is_contiguous()
                                      and isinstance(bias, torch.Tensor))))
    except (AttributeError, TypeError, RuntimeError):   # RuntimeError: a sparse tensor's is_contiguous
        return False
