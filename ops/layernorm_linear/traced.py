"""LayerNorm+Linear as a torch.compile graph holds it (``traced``): the C++ ops with their fakes, and the
inductor pass that puts a GELU after the Linear into its GEMM."""

from __future__ import annotations

import torch

from ops.common import (
    no_grad_to_come,
)
from ops.launch import direct
from ops.layernorm import autograd as ln_autograd
from ops.layernorm import fwd_bwd as ln_fwd_bwd
from ops.layernorm_linear import config
from ops.layernorm_linear.algo import autograd_algo, pick_algo
from ops.layernorm_linear.autograd import LayerNormLinearFunction
from ops.layernorm_linear.checks import validate
from ops.layernorm_linear.config import ALGO_IDS
from ops.layernorm_linear.launch import zero_bias


def traced(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor | None, eps: float, algo: str) -> torch.Tensor:
    """``layernorm_linear`` of valid inputs as torch.compile traces it. Unfused: the LayerNorm as
    ``layernorm.compiled_layernorm`` holds it, then the C++ op ``mojo_direct.linear`` without a gradient to come
    (the eager route's cuBLASLt plan: no heuristics query per call, as torch's addmm makes), with one
    ``mojo_direct.traced_linear`` (the same GEMM, its backward the C++ ``linear_grads``) where
    ``config.COMPILED_TRAINING_LINEAR`` is "ours" or, as a mark, for ``layernorm_linear.inductor``'s pass (a tanh
    GELU after it goes into the GEMM, other marks become ``F.linear``) where the training form
    (``config.compiled_training_form``) is "inductor", else ``F.linear`` (float32 always); with the form "ours", the
    whole of it as the C++ op ``traced_layernorm_linear``. Fused and Hopper: with a gradient to come, the autograd
    function around our ops; without, our forward alone."""
    tensors = (x, ln_weight, ln_bias, weight, bias)
    grad = not no_grad_to_come(*tensors)
    runs = autograd_algo(algo, tensors) if grad else algo
    validate(*tensors)
    k = x.shape[-1]
    rows = x.numel() // k
    if pick_algo(runs, x.device, x.dtype, rows, weight.shape[0], k) == "unfused":
        form = config.compiled_training_form(rows) if grad else None
        if form == "ours" and _layernorm_linear_traced(x, ln_weight, ln_bias):
            gelu_epilogue_pass_on()   # a tanh GELU after it goes into the GEMM (act 1)
            return torch.ops.mojo_direct.traced_layernorm_linear(x, ln_weight, ln_bias, weight, bias, eps)
        form = "inductor" if form == "ours" else form   # where the one op does not take these inputs
        xn = ln_autograd.compiled_layernorm(x, ln_weight, ln_bias, eps)
        if x.is_cuda and native_linear_traceable():
            if not grad:
                gelu_epilogue_pass_on()
                return torch.ops.mojo_direct.linear(xn, weight, bias)
            if x.dtype != torch.float32 and (config.COMPILED_TRAINING_LINEAR == "ours"
                                             or (form == "inductor" and gelu_epilogue_pass_on())):
                # with the pass, a mark: gelu(traced_linear) becomes traced_linear_gelu, traced_linear F.linear
                return torch.ops.mojo_direct.traced_linear(xn, weight, bias)
        return torch.nn.functional.linear(xn, weight, bias)
    if grad:
        return LayerNormLinearFunction.apply(*tensors, eps, runs)
    if x.is_cuda and native_linear_traceable():
        gelu_epilogue_pass_on()   # a tanh GELU after it: the pass's unfused form (layernorm_linear_inductor)
        # the C++ op: no Python per call in the compiled graph
        return torch.ops.mojo_direct.layernorm_linear_infer(x, ln_weight, ln_bias, weight, bias, eps, ALGO_IDS[algo])
    bias = zero_bias(weight) if bias is None else bias
    return torch.ops.mojo.layernorm_linear_fwd(x, ln_weight, ln_bias, weight, bias, eps, algo)[0]


def _layernorm_linear_traced(x: torch.Tensor, ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None) -> bool:
    """Whether a training graph whose form (``config.compiled_training_form``, read in the traced code, so that
    dynamo guards on the knobs) is "ours" may hold the unfused LayerNorm+Linear as the C++ op
    ``traced_layernorm_linear``: 16-bit CUDA x, both LayerNorm parameters, and the C++ ops loaded."""
    return (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and ln_weight is not None
            and ln_bias is not None and native_linear_traceable())


@torch.compiler.assume_constant_result
def native_linear_traceable() -> bool:
    """Whether the C++ ops ``mojo_direct::layernorm_linear_infer``, ``linear``, ``traced_linear`` (with its
    autograd kernel: ``linear_grads``) and ``linear_grads`` are loaded, with their fakes for tracing (and the
    LayerNorm's, which these graphs may hold too)."""
    return ln_fwd_bwd.native_ops_traceable() and direct.traceable(
        {"layernorm_linear_infer": _fake_infer, "linear": _fake_linear, "traced_linear": _fake_linear,
         "linear_gelu": _fake_linear, "traced_linear_gelu": _fake_traced_linear_gelu,
         "linear_gelu_aux": _fake_linear_gelu_aux, "linear_grads": _fake_linear_grads,
         "linear_gelu_grads": _fake_linear_gelu_grads, "traced_layernorm_linear": _fake_traced_layernorm_linear,
         "layernorm_linear_train_fwd": _fake_layernorm_linear_train_fwd,
         "layernorm_linear_grads": _fake_layernorm_linear_grads})


def gelu_epilogue_pass_on() -> bool:
    """Whether ``layernorm_linear.inductor``'s pass will rewrite this graph: ``config.COMPILED_LINEAR_GELU`` (read
    in the traced code, so that dynamo guards on it) and the pass installed (``_install_gelu_epilogue_pass``)."""
    return config.COMPILED_LINEAR_GELU and _install_gelu_epilogue_pass()


@torch.compiler.assume_constant_result
def _install_gelu_epilogue_pass() -> bool:
    """Install ``layernorm_linear.inductor``'s pass (a tanh GELU after our Linear into its GEMM's epilogue; False
    where another pre-grad pass holds its place), run where dynamo traces the call, not traced."""
    from ops.layernorm_linear import inductor as layernorm_linear_inductor

    return layernorm_linear_inductor.install()


def _fake_infer(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, eps: float, algo: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _fake_linear(xn: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return xn.new_empty(*xn.shape[:-1], weight.shape[0])


def _fake_traced_linear_gelu(xn: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             bias_grad_in_gemm: bool = True) -> torch.Tensor:
    return _fake_linear(xn, weight, bias)


def _fake_linear_grads(dy: torch.Tensor, xn: torch.Tensor, weight: torch.Tensor, bias_grad: bool,
                       weight_grad: bool = True) -> list:
    grads = [xn.new_empty(xn.shape), weight.new_empty(weight.shape if weight_grad else (0,))]
    return [*grads, weight.new_empty(weight.shape[0])] if bias_grad else grads


def _fake_linear_gelu_aux(xn: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return _fake_linear(xn, weight, bias), _fake_linear(xn, weight, bias)


def _fake_linear_gelu_grads(dy: torch.Tensor, xn: torch.Tensor, weight: torch.Tensor, h: torch.Tensor,
                            bias_grad: bool, weight_grad: bool = True) -> list:
    return _fake_linear_grads(dy, xn, weight, bias_grad, weight_grad)


def _fake_traced_layernorm_linear(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
                                  weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                                  act: int = 0) -> torch.Tensor:
    return _fake_linear(x, weight, bias)


def _fake_layernorm_linear_train_fwd(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
                                     weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                                     act: int) -> tuple:
    stats = x.new_empty(x.shape[:-1], dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
    h = _fake_linear(x, weight, bias) if act != 0 else x.new_empty(0)   # the act's input (none for act 0)
    return _fake_linear(x, weight, bias), x.new_empty(x.shape), stats, torch.empty_like(stats), h


def _fake_layernorm_linear_grads(dy: torch.Tensor, x: torch.Tensor, xn: torch.Tensor, ln_weight: torch.Tensor,
                                 ln_bias: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                                 h: torch.Tensor, act: int, bias_grad: bool, weight_grad: bool = True) -> list:
    return [x.new_empty(x.shape), ln_weight.new_empty(ln_weight.shape), ln_bias.new_empty(ln_bias.shape),
            *_fake_linear_grads(dy, xn, weight, bias_grad, weight_grad)[1:]]
