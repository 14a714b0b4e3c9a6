"""LayerNorm's input checks: the common case in a few attribute reads (``valid``), the named errors otherwise, and
the adaptation of what the kernels do not take as it comes (a strided x, float32 parameters of 16-bit x)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ops.inputs import (
    DTYPES,
    PLAIN_TENSORS,
    TORCH_TAKES,
    as_eps,
    as_shape,
    beyond_int32,
    check_cuda_rows,
    check_int32_rows,
    check_param,
    check_same,
    check_tensor,
    last_size,
    torch_answers,
    trailing_sizes,
)
from ops.layernorm import config
from ops.layernorm.config import ACTIVATIONS, F32


def check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: {activation!r} is not one of {list(ACTIVATIONS)}")


def validate(x: object, weight: object, bias: object, names: tuple[str, str, str] = ("x", "weight", "bias")) -> None:
    """Raise ValueError/TypeError naming the first bad argument (``names`` as the caller calls them). Strided or
    empty x and float32 weight and bias with 16-bit x pass: the entries adapt them (``adapt``, ``empty_fwd``)."""
    if valid(x, weight, bias):
        return
    nx, nw, nb = names
    check_tensor(nx, x, min_ndim=1, dtypes=DTYPES, layout=False)
    h = x.shape[-1]
    check_param(nw, weight, x, nx, h, f"{nx}'s last dim", DTYPES)
    check_param(nb, bias, x, nx, h, f"{nx}'s last dim", DTYPES)
    check_int32_rows(nx, x)


def adapt(x: torch.Tensor, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Validated x and its parameters as the kernels take them: contiguous (one copy of a strided tensor; with
    autograd, the copy's backward puts the gradient back in place) and the parameters in x's dtype (a float32
    parameter of 16-bit x is rounded to it; its gradient comes back in float32)."""
    return (x.contiguous(), *(p.to(x.dtype).contiguous() for p in params))


def valid(x: object, weight: object, bias: object) -> bool:
    """The common case in few attribute reads: three non-empty contiguous tensors of one supported dtype on
    one cpu/cuda device, weight and bias [H] with H x's last dim. False sends ``validate`` to its named checks."""
    try:
        dtype, device = x.dtype, x.device
        return (dtype in DTYPES and weight.dtype is dtype and bias.dtype is dtype
                and weight.device == device and bias.device == device and device.type in ("cuda", "cpu")
                and weight.dim() == 1 and bias.dim() == 1 and x.dim() >= 1
                and x.shape[-1] == weight.shape[0] == bias.shape[0] and x.numel() > 0
                and x.is_contiguous() and weight.is_contiguous() and bias.is_contiguous()
                and isinstance(x, torch.Tensor) and not beyond_int32(x))
    except (AttributeError, TypeError, RuntimeError):   # RuntimeError: a sparse tensor's is_contiguous
        return False


def classify(x: object, weight: object, bias: object) -> str:
    """The one input classifier of a drop-in LayerNorm call (``layernorm``): which route may take it, or the named
    error. The C++ entries' ``accepts`` (ops/launch/native/plans.h) is its mirror: it takes exactly the calls
    classified "kernels" (tests/test_classify.py compares the two).

    Returns:
        "torch": torch's own ops answer it (``torch_answers``; they name what is wrong, as torch would);
        "kernels": our kernels take it as it comes (``valid``, not under CUDA autocast);
        "adapt": they take it once adapted: under CUDA autocast (in float32), empty, strided x, float32 parameters
        of 16-bit x.

    Raises:
        TypeError, ValueError: ``validate``'s named error for anything else.
    """
    if torch_answers(x, weight, bias):
        return "torch"
    if valid(x, weight, bias):
        return "adapt" if autocast_to_fp32(x) else "kernels"
    validate(x, weight, bias)
    return "adapt"


def autocast_to_fp32(x: torch.Tensor) -> bool:
    """Whether torch would run a LayerNorm of x in float32 now: CUDA autocast puts ``layer_norm`` on its float32
    list (the CPU's leaves it in x's dtype)."""
    return x.is_cuda and torch.is_autocast_enabled("cuda")


def check_torch_call(x: object, weight: object, bias: object, eps: float, activation: str,
                     names: tuple[str, str, str] = ("x", "weight", "bias"), h: int | None = None) -> None:
    """``validate``'s named checks for a call torch's ops answer (float64 and the meta device taken; weight or
    bias None: absent, else 1-D of ``h`` elements: x's last dim where None), and eps and the activation."""
    nx, nw, nb = names
    check_tensor(nx, x, min_ndim=1, layout=False, **TORCH_TAKES)
    if x.is_cuda and not x.is_nested:
        check_cuda_rows(nx, x, x.shape[-1] if h is None else h)
    what = f"{nx}'s last dim" if h is None else "the normalized dims' elements"
    for name, p in ((nw, weight), (nb, bias)):
        if p is not None:
            check_param(name, p, x, nx, last_size(x) if h is None else h, what, **TORCH_TAKES)
    as_eps(eps)
    check_activation(activation)


def native_takes(x: object, weight: object, bias: object, eps: object, variant: str, activation: str) -> bool:
    """Whether a call's arguments fit the C++ entries' schema and choices (plain tensors, a float eps, the default
    variant, a known activation). The entries check the rest (``accepts``, the mirror of ``classify``)."""
    return (variant == "fast" and x.__class__ in PLAIN_TENSORS and weight.__class__ in PLAIN_TENSORS
            and bias.__class__ in PLAIN_TENSORS and eps.__class__ is float and activation in ACTIVATIONS)


def empty_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, ...]:
    """The forward of validated empty x (no rows, or rows of nothing) as torch answers it: y like x, and the
    statistics [...] (for rows of nothing: mean 0, rstd NaN, as ``torch.native_layer_norm`` gives)."""
    y, mean, rstd = torch.native_layer_norm(x, x.shape[-1:], weight, bias, eps)
    return y.contiguous(), mean.reshape(x.shape[:-1]), rstd.reshape(x.shape[:-1])


def valid_bwd(dy: object, x: torch.Tensor, mean: object, rstd: object) -> bool:
    """``valid`` for the backward's other tensors: dy like x, mean and rstd float32 [...] on x's device."""
    try:
        stats = x.shape[:-1]
        return (dy.dtype is x.dtype and dy.shape == x.shape and dy.device == x.device and dy.is_contiguous()
                and mean.dtype is F32 and rstd.dtype is F32 and mean.shape == stats and rstd.shape == stats
                and mean.device == x.device and rstd.device == x.device
                and mean.is_contiguous() and rstd.is_contiguous() and isinstance(dy, torch.Tensor))
    except (AttributeError, TypeError, RuntimeError):   # RuntimeError: a sparse tensor's is_contiguous
        return False


def check_bwd(dy: object, x: object, weight: object, bias: object, mean: object, rstd: object) -> None:
    """The backward's named checks (``layernorm_bwd``'s Raises)."""
    validate(x, weight, bias)
    check_tensor("dy", dy, dtypes=DTYPES, layout=False)
    check_same({"x": x, "dy": dy})
    if dy.shape != x.shape:
        raise ValueError(f"dy: shape {tuple(dy.shape)} does not match x {tuple(x.shape)}")
    for name, t in (("mean", mean), ("rstd", rstd)):
        check_tensor(name, t, min_ndim=0, dtypes=(torch.float32,), layout=False)
        if t.shape != x.shape[:-1] or t.device != x.device:
            raise ValueError(f"{name}: expected shape {tuple(x.shape[:-1])} on {x.device}, "
                             f"got {tuple(t.shape)} on {t.device}")


def check_call(x: object, weight: object, bias: object, eps: float, variant: str, activation: str) -> None:
    """Every check of a forward call (named errors): the tensors (``validate``), then the options."""
    validate(x, weight, bias)
    check_options(eps, variant, activation)


def check_options(eps: object, variant: str, activation: str) -> None:
    """The named checks of a forward call's options: the activation, eps and the variant."""
    check_activation(activation)
    as_eps(eps)
    if variant != "fast":
        config.variant_config(variant)


# torch's activation by name: LayerNorm's (config.ACTIVATIONS) and ops.layernorm_linear.layernorm_linear_act's
ACT_FNS = {"none": lambda y: y, "gelu": torch.nn.functional.gelu,
           "gelu_tanh": lambda y: torch.nn.functional.gelu(y, approximate="tanh"), "relu": torch.nn.functional.relu}


def normalized_size(x: object, normalized_shape: int | Sequence[int],
                    by_torch: bool = False) -> tuple[tuple[int, ...], int]:
    """``normalized_shape`` as a tuple and the number of elements it covers, checked against x's trailing dims
    (as ``torch.nn.functional.layer_norm`` takes it); ``by_torch``: x of a call torch's ops answer
    (``torch_answers``)."""
    shape = as_shape(normalized_shape)
    check_tensor("x", x, min_ndim=1, layout=False, **(TORCH_TAKES if by_torch else {"dtypes": DTYPES}))
    if trailing_sizes(x, min(len(shape), x.dim())) != shape:
        got = "a nested tensor" if x.is_nested else f"shape {tuple(x.shape)}"
        raise ValueError(f"normalized_shape: {shape} is not x's trailing dims (x: {got})")
    return shape, math.prod(shape)
