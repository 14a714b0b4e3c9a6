"""``layernorm_linear``: Linear(LayerNorm(x)) with autograd for all five inputs. It checks, picks its route
once, and calls it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ops.common import (
    constant,
    native_entry,
    no_grad_to_come,
)
from ops.inputs import (
    PLAIN_TENSORS,
    as_eps,
    torch_answers,
)
from ops.launch import direct
from ops.layernorm import functional as ln_functional
from ops.layernorm import launch as ln_launch
from ops.layernorm.checks import ACT_FNS
from ops.layernorm_linear.algo import autograd_algo, check_algo, pick_algo, remember_algo
from ops.layernorm_linear.autograd import LayerNormLinearFunction
from ops.layernorm_linear.checks import (
    adapted_fwd,
    check_linear,
    check_linears,
    classify,
    empty_result,
    native_takes,
)
from ops.layernorm_linear.config import ALGO_IDS, TRACED_ACTS
from ops.layernorm_linear.fwd_bwd import layernorm_linear_fwd
from ops.layernorm_linear.launch import linear
from ops.layernorm_linear.traced import traced


def layernorm_linear(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None, eps: float = 1e-5, algo: str = "auto") -> torch.Tensor:
    """Linear(LayerNorm(x)) with autograd for all five inputs (the call ``FusedLayerNormLinear`` makes).

    Args:
        x: the input ``[..., K]``, float32, float16 or bfloat16, on the CPU or a CUDA GPU; any layout.
        ln_weight, ln_bias: the LayerNorm's gamma and beta ``[K]``, x's dtype (or float32 for 16-bit x).
        weight: the Linear's ``[N, K]``; bias: its ``[N]`` or None.
        eps: the LayerNorm's (any float, as torch takes).
        algo: the forward algorithm; with gradients to come, 16-bit ``"auto"`` runs ``"unfused"``
            (``autograd_algo``).

    Shape:
        x: ``[..., K]``; output: ``[..., N]``.

    Returns:
        Linear(LayerNorm(x)) in x's dtype (under CUDA autocast, what the torch modules give).

    Raises:
        TypeError, ValueError: as ``layernorm_linear_fwd`` (named), in the forward and the backward.

    Example:
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> y = layernorm_linear(x, torch.ones(8), torch.zeros(8), torch.randn(3, 8), torch.zeros(3))
        >>> y.sum().backward()
    """
    native = native_entry("layernorm_linear")
    if native is not None and native_takes(x, ln_weight, ln_bias, weight, bias, eps, algo):
        y = native(x, ln_weight, ln_bias, weight, bias, eps, ALGO_IDS[algo])
        if y is not None:   # None: a call the C++ entry does not take (accepts, ops/launch/native/plans.h)
            return y
    eps = as_eps(eps)
    tensors = (x, ln_weight, ln_bias, weight, bias)
    return _ROUTES[route(*tensors)](tensors, eps, algo)


def route(x: object, ln_weight: object, ln_bias: object, weight: object, bias: object) -> str:
    """The one route decision of a ``layernorm_linear`` call that the C++ entry did not take (bad tensors get
    ``classify``'s named error):

    * "torch": torch's own ops answer it (``torch_answers``);
    * "adapt": our kernels do not take it as it comes (autocast, empty, strided, float32 LayerNorm parameters);
    * "traced": torch.compile traces it (``traced``);
    * "autograd": ``LayerNormLinearFunction`` (no direct launch here: the CPU, or ``OPS_ROUTE=graph``);
    * "train": the same on a GPU, the C++ entry told the algorithm for the shape's next call;
    * "infer": a direct forward without a gradient to come (no autograd node; unfused keeps no statistics).
    """
    if (kind := classify(x, ln_weight, ln_bias, weight, bias)) != "kernels":
        return kind
    if torch.compiler.is_compiling():
        return "traced"
    if not direct.launches(x):
        return "autograd"
    return "infer" if no_grad_to_come(x, ln_weight, ln_bias, weight, bias) else "train"


def _train(tensors: tuple, eps: float, algo: str) -> torch.Tensor:
    """The "train" route: autograd, and the C++ entry told what ``algo`` runs at this shape with a gradient."""
    x, weight = tensors[0], tensors[3]
    runs = autograd_algo(algo, tensors)
    y = LayerNormLinearFunction.apply(*tensors, eps, runs)
    remember_algo(x, weight, algo, True, runs)
    return y


def _infer(tensors: tuple, eps: float, algo: str) -> torch.Tensor:
    """The "infer" route: the forward alone, its algorithm remembered for the C++ entry."""
    x, ln_weight, ln_bias, weight, bias = tensors
    k = x.shape[-1]
    picked = pick_algo(algo, x.device, x.dtype, x.numel() // k, weight.shape[0], k)
    remember_algo(x, weight, algo, False, algo)
    if picked != "unfused":
        return layernorm_linear_fwd(*tensors, eps, algo)[0]
    return linear(ln_launch.fwd_direct(x, ln_weight, ln_bias, float(eps), "fast", 0), weight, bias)


_ROUTES = {
    "torch": lambda tensors, eps, algo: torch_layernorm_linear(*tensors, eps, algo),
    "adapt": lambda tensors, eps, algo: _layernorm_linear_adapted(*tensors, eps, algo),
    "traced": lambda tensors, eps, algo: traced(*tensors, eps, algo),
    "autograd": lambda tensors, eps, algo: LayerNormLinearFunction.apply(*tensors, eps, autograd_algo(algo, tensors)),
    "train": _train,
    "infer": _infer,
}


def torch_layernorm_linear(x: torch.Tensor, ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None,
                           weight: torch.Tensor, bias: torch.Tensor | None, eps: float, algo: str) -> torch.Tensor:
    """Linear(LayerNorm(x)) by torch's ops, for a call ``layernorm.torch_answers`` sends here: the named checks
    first, float64 and the meta device taken."""
    xn = ln_functional.torch_layernorm(x, ln_weight, ln_bias, eps, "none", names=("x", "ln_weight", "ln_bias"))
    check_linear(x, weight, bias, same_dtype=x.is_meta or not torch.is_autocast_enabled(x.device.type),
                  by_torch=True)
    check_algo(algo)
    return torch.nn.functional.linear(xn, weight, bias)


def _layernorm_linear_adapted(x: object, ln_weight: object, ln_bias: object, weight: object, bias: object,
                              eps: float, algo: str) -> torch.Tensor:
    """``layernorm_linear`` of what the kernels do not take as it comes, answered as torch's
    ``nn.Sequential(nn.LayerNorm, nn.Linear)`` answers it: under autocast our LayerNorm under torch's policy for
    it, then ``F.linear`` under autocast's; empty ones by torch (``empty_result``); strided x and float32
    LayerNorm parameters of 16-bit x adapted. ``classify`` checked the tensors."""
    if torch.is_autocast_enabled(x.device.type):
        pick_algo(algo, x.device, x.dtype, 1, 1)
        return torch.nn.functional.linear(ln_functional.layernorm(x, ln_weight, ln_bias, eps), weight, bias)
    pick_algo(algo, x.device, x.dtype, 1, 1)
    if (adapted := adapted_fwd(x, ln_weight, ln_bias, weight, bias, eps)) is None:
        return empty_result(x, ln_weight, ln_bias, weight, bias, eps)
    return layernorm_linear(*adapted, eps, algo)


def module_forward(x: torch.Tensor, normalized_shape: tuple[int, ...], ln_weight: torch.Tensor | None,
                   ln_bias: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                   algo: str) -> torch.Tensor:
    """``FusedLayerNormLinear``'s forward from its parameters (absent ones None): a function of its own, so that
    ``torch.fx.symbolic_trace`` records the module as this call."""
    if len(normalized_shape) > 1:
        return torch.nn.functional.linear(ln_functional.layer_norm(x, normalized_shape, ln_weight, ln_bias, eps),
                                          weight, bias)
    if ln_weight is None or ln_bias is None:
        if torch_answers(x, ln_weight, ln_bias, weight, bias):   # before a constant is made of a fake
            return torch_layernorm_linear(x, ln_weight, ln_bias, weight, bias, eps, algo)
        k, dtype, device = normalized_shape[0], weight.dtype, weight.device
        ln_weight = constant(1.0, k, dtype, device) if ln_weight is None else ln_weight
        ln_bias = constant(0.0, k, dtype, device) if ln_bias is None else ln_bias
    return layernorm_linear(x, ln_weight, ln_bias, weight, bias, eps, algo)


def layernorm_linear_act(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, eps: float = 1e-5, *, activation: str) -> torch.Tensor:
    """activation(Linear(LayerNorm(x))) with autograd for all five inputs: a pre-norm MLP's first half (GPT-2's
    ``ln_2``, ``mlp.c_fc`` and "gelu_new"; ViT's ``layernorm_after``, ``mlp.fc1`` and GELU; OPT's
    ``final_layer_norm``, ``fc1`` and ReLU). Eager on a GPU one C++ op each way (our LayerNorm, one GEMM, and the
    activation: the tanh GELU in the GEMM's epilogue, the others by torch's op on its output; torch's GEMM where
    cuBLASLt does not take the weight as it is, such as a transposed one); otherwise ``layernorm_linear``, then the
    activation by torch's op.

    Args:
        x: the input ``[..., K]``, float32, float16 or bfloat16 (float64 and the like by torch's ops).
        ln_weight, ln_bias: the LayerNorm's gamma and beta ``[K]``.
        weight: the Linear's ``[N, K]``, or the transpose of a contiguous ``[K, N]`` (``conv1d.weight.mT`` of GPT-2's
            ``Conv1D``); bias: its ``[N]`` or None.
        eps: the LayerNorm's.
        activation: ``"gelu"`` (``F.gelu``), ``"gelu_tanh"`` (``F.gelu(.., approximate="tanh")``) or ``"relu"``.

    Shape:
        x: ``[..., K]``; output: ``[..., N]``.

    Returns:
        The activation in x's dtype.

    Raises:
        TypeError, ValueError: as ``layernorm_linear`` (named), and a ValueError naming ``activation``.

    Example:
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> y = layernorm_linear_act(x, torch.ones(8), torch.zeros(8), torch.randn(3, 8), activation="gelu")
        >>> y.sum().backward()
    """
    act = TRACED_ACTS.get(activation) if activation.__class__ is str else None
    if act is None:
        raise ValueError(f"activation: expected one of {sorted(TRACED_ACTS)}, got {activation!r}")
    native = native_entry("layernorm_linear_act")
    if native is not None and native_takes(x, ln_weight, ln_bias, weight, bias, eps, "auto"):
        y = native(x, ln_weight, ln_bias, weight, bias, eps, act)
        if y is not None:   # None: a call the C++ entry does not take (linear_accepts, ops/launch/native/plans.h)
            return y
    return ACT_FNS[activation](layernorm_linear(x, ln_weight, ln_bias, weight, bias, eps))


def linears(x: torch.Tensor, weights: Sequence[torch.Tensor],
            biases: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Several Linears of one input, ``[F.linear(x, w, b) for w, b in zip(weights, biases)]``, with autograd: the
    projections that read one normalized input (an attention's q, k and v; a gated MLP's gate and up). Eager on a GPU
    one C++ op each way (one cuBLASLt GEMM per weight, as the unfused route's Linear; one autograd node); otherwise
    torch's ``F.linear`` each.

    Args:
        x: the input ``[..., K]``.
        weights: one or more ``[N_i, K]``, of x's dtype and device.
        biases: ``[N_i]`` each, as many as the weights, or None.

    Shape:
        x: ``[..., K]``; output i: ``[..., N_i]``.

    Returns:
        A list of the outputs, in the weights' order.

    Raises:
        TypeError, ValueError: named (``weights[1]``, ``biases``, ...).

    Example:
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> q, k, v = linears(x, [torch.randn(8, 8), torch.randn(2, 8), torch.randn(2, 8)])
        >>> (q.sum() + k.sum() + v.sum()).backward()
    """
    native = native_entry("linears")
    if (native is not None and x.__class__ in PLAIN_TENSORS and weights.__class__ in (list, tuple)
            and all(w.__class__ in PLAIN_TENSORS for w in weights)
            and (biases is None or (biases.__class__ in (list, tuple)
                                    and all(b.__class__ in PLAIN_TENSORS for b in biases)))):
        ys = native(x, weights, () if biases is None else biases)
        if ys:   # empty: a call the C++ entry does not take (ops/launch/native/traced.h: linears)
            return ys
    check_linears(x, weights, biases)
    return [torch.nn.functional.linear(x, w, None if biases is None else biases[i]) for i, w in enumerate(weights)]
