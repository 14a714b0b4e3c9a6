"""An inductor pass for torch.compile graphs that hold our LayerNorm+Linear's Linear: the GELU after it in its epilogue.

A compiled graph of the unfused LayerNorm+Linear holds its Linear as a C++ op: ``mojo_direct.linear`` (a cuBLASLt
GEMM with the bias in its epilogue) without a gradient to come, and ``mojo_direct.traced_linear`` with one, there as
a mark for this pass. Where a tanh GELU follows it, as in a GPT-2 MLP (``F.gelu(ln_fc1(x), approximate="tanh")``),
inductor would launch a triton kernel for the GELU after the GEMM, and in training a reduction or two for the bias'
gradient in the backward. This pass, run on the graph before inductor lowers it (its pre-grad custom pass), puts in
place of the two the same GEMM with GELU in cuBLASLt's epilogue, applied before the result is rounded to its dtype:
``mojo_direct.linear_gelu``, or in training ``mojo_direct.traced_linear_gelu`` (which also writes GELU's input for
its backward: GELU's derivative by torch's ``gelu_backward``, then the C++ ``linear_grads``, db in dW's epilogue
for inputs of ``COMPILED_GELU_BIAS_GRAD_IN_GEMM_MIN_ROWS`` rows or more, else torch's sum beside gelu_backward).
Where the training form (``layernorm_linear_config.compiled_training_form``) is "ours" (by default from 4096 rows
up), a training graph holds the whole LayerNorm+Linear as ``mojo_direct.traced_layernorm_linear`` instead, and a
tanh GELU after it goes into that op (its ``act`` 1); where it is "torch" (by default below), there is no mark.
A mark not followed by a tanh GELU becomes ``F.linear`` again, so that training graphs are otherwise the torch
model's (unless ``COMPILED_TRAINING_LINEAR`` is "ours", which keeps ``traced_linear``). docs/direct_launch.md has the
measurements.

It rewrites only nodes of our ops: a graph without them is left as it is. It is installed, at most once per process,
the first time a graph takes our Linear, and only where no other pre-grad pass is set (torch's
``torch._inductor.config.pre_grad_custom_pass``: a user's own pass is left alone, and our Linear then leaves the
GELU to inductor). ``layernorm_linear_config.COMPILED_LINEAR_GELU`` turns it off.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from ops.layernorm import config as layernorm_config
from ops.layernorm_linear import config as config

_GELUS = (torch._C._nn.gelu, torch.nn.functional.gelu)


def _is_tanh_gelu(node: fx.Node) -> bool:
    """Whether ``node`` is ``F.gelu(t, approximate="tanh")`` as dynamo records it."""
    return (node.op == "call_function" and node.target in _GELUS and len(node.args) == 1
            and node.kwargs == {"approximate": "tanh"})


def _call_of(node: object, packet: object) -> bool:
    """Whether ``node`` calls the op ``packet`` (as dynamo records it, or its default overload)."""
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target in (packet, packet.default)
            and not node.kwargs)


def _unfused_in_place_of(graph: fx.Graph, source: fx.Node) -> tuple | None:
    """For ``mojo_direct.layernorm_linear_infer`` (the fused or Hopper forward auto picked) of 16-bit x with the
    default algo, under the default compiled LayerNorm (inductor's): ``(xn, W, b)``, with xn torch's ``layer_norm``
    of x inserted before ``source``; else None (an algo asked for by name, float32, or no metadata)."""
    x, ln_weight, ln_bias, weight, bias, eps, algo = source.args
    value = x.meta.get("example_value") if isinstance(x, fx.Node) else None
    if (algo != config.ALGO_IDS["auto"] or layernorm_config.COMPILED_LAYERNORM != "inductor"
            or getattr(value, "dtype", None) not in (torch.float16, torch.bfloat16)):
        return None
    with graph.inserting_before(source):
        shape = graph.call_function(getattr, (ln_weight, "shape"))
        xn = graph.call_function(torch.nn.functional.layer_norm, (x, shape, ln_weight, ln_bias, eps))
    return xn, weight, bias


def _bias_grad_in_gemm(xn: object) -> bool:
    """``traced_linear_gelu``'s ``bias_grad_in_gemm`` for input ``xn``: whether its rows reach
    ``config.COMPILED_GELU_BIAS_GRAD_IN_GEMM_MIN_ROWS`` (True where they are symbolic or unknown)."""
    shape = getattr(xn.meta.get("example_value") if isinstance(xn, fx.Node) else None, "shape", None)
    if shape is None or not all(isinstance(d, int) for d in shape):
        return True
    return math.prod(shape[:-1]) >= config.COMPILED_GELU_BIAS_GRAD_IN_GEMM_MIN_ROWS


def fuse_linear_gelu(graph: fx.Graph) -> int:
    """Rewrite ``gelu(mojo_direct.linear(xn, W, b), approximate="tanh")`` as ``mojo_direct.linear_gelu(xn, W, b)``
    and ``gelu(mojo_direct.traced_linear(..))`` as ``mojo_direct.traced_linear_gelu(.., bias_grad_in_gemm)``
    (``_bias_grad_in_gemm``), wherever the GELU is the Linear's only user; likewise
    ``gelu(mojo_direct.traced_layernorm_linear(..))`` (the training form "ours") as the same op with act 1. A GELU
    after the fused or Hopper inference forward (``layernorm_linear_infer``, which auto picks for longer 16-bit
    inputs) gets the unfused form: torch's ``layer_norm`` (which inductor fuses with the residual add before it),
    then ``linear_gelu``: one launch and one pass over the activation fewer than that forward, the add and the GELU.

    Args:
        graph: a dynamo graph (torch-level ops), rewritten in place.

    Returns:
        How many GELUs went into a GEMM's epilogue.

    Example:
        >>> fuse_linear_gelu(gm.graph); gm.recompile()   # doctest: +SKIP
    """
    ops = torch.ops.mojo_direct
    pairs = ((ops.linear, ops.linear_gelu.default), (ops.traced_linear, ops.traced_linear_gelu.default))
    count = 0
    for node in list(graph.nodes):
        if not _is_tanh_gelu(node):
            continue
        source = node.args[0]
        fused = next((f for linear, f in pairs if _call_of(source, linear)), None)
        args = tuple(source.args) if fused is not None else None
        if fused is ops.traced_linear_gelu.default:
            args = (*args, _bias_grad_in_gemm(source.args[0]))
        if fused is None and _call_of(source, ops.layernorm_linear_infer) and len(source.users) == 1:
            fused, args = ops.linear_gelu.default, _unfused_in_place_of(graph, source)
        if fused is None and _call_of(source, ops.traced_layernorm_linear) and len(source.args) == 6:
            fused, args = ops.traced_layernorm_linear.default, (*source.args, 1)   # act 1: the tanh GELU
        if args is None or len(source.users) != 1:
            continue
        with graph.inserting_before(node):
            replacement = graph.call_function(fused, args)
        replacement.meta.update(node.meta)
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
        graph.erase_node(source)
        count += 1
    return count


def unmark_linears(graph: fx.Graph) -> int:
    """Put ``F.linear`` back in place of each ``mojo_direct.traced_linear`` (the marks ``layernorm_linear`` leaves in
    a training graph for ``fuse_linear_gelu``); returns how many."""
    marks = [node for node in graph.nodes if _call_of(node, torch.ops.mojo_direct.traced_linear)]
    for node in marks:
        with graph.inserting_before(node):
            linear = graph.call_function(torch._C._nn.linear, tuple(node.args))
        linear.meta.update(node.meta)
        node.replace_all_uses_with(linear)
        graph.erase_node(node)
    return len(marks)


class LinearGeluPass(CustomGraphPass):
    """Inductor's pre-grad custom pass: ``fuse_linear_gelu`` while ``config.COMPILED_LINEAR_GELU`` is on, then
    ``unmark_linears`` unless ``config.COMPILED_TRAINING_LINEAR`` is "ours". Its ``uuid`` (part of inductor's cache
    key) names this file's text and the settings ``fuse_linear_gelu`` reads: both switches,
    ``config.COMPILED_GELU_BIAS_GRAD_IN_GEMM_MIN_ROWS`` and ``layernorm_config.COMPILED_LAYERNORM``."""

    def __call__(self, graph: fx.Graph) -> None:
        if config.COMPILED_LINEAR_GELU:
            fuse_linear_gelu(graph)
        if config.COMPILED_TRAINING_LINEAR != "ours":
            unmark_linears(graph)

    def uuid(self) -> str:
        switches = (config.COMPILED_LINEAR_GELU, config.COMPILED_TRAINING_LINEAR, layernorm_config.COMPILED_LAYERNORM,
                    config.COMPILED_GELU_BIAS_GRAD_IN_GEMM_MIN_ROWS)
        return hashlib.sha256(Path(__file__).read_bytes() + repr(switches).encode()).hexdigest()


PASS = LinearGeluPass()


def install() -> bool:
    """Make ``PASS`` inductor's pre-grad custom pass unless another pass holds that place.

    Returns:
        Whether ``PASS`` is installed.
    """
    from torch._inductor import config as inductor_config

    if inductor_config.pre_grad_custom_pass is None:
        inductor_config.pre_grad_custom_pass = PASS
    return inductor_config.pre_grad_custom_pass is PASS
