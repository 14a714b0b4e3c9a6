"""An inductor pass for torch.compile graphs that hold our LayerNorm+Linear's Linear: the GELU after it in its epilogue.

A compiled inference graph of the unfused LayerNorm+Linear calls the C++ op ``mojo_direct.linear`` (a cuBLASLt GEMM
with the bias in its epilogue). Where a tanh GELU follows it, as in a GPT-2 MLP
(``F.gelu(ln_fc1(x), approximate="tanh")``), inductor would launch a triton kernel for the GELU after the GEMM;
this pass, run on the graph before inductor lowers it (its pre-grad custom pass), puts ``mojo_direct.linear_gelu``
in place of the two: the same GEMM with GELU in cuBLASLt's epilogue, applied before the result is rounded to its
dtype. One launch fewer per MLP, and one read and write of the activation fewer (docs/direct_launch.md).

It rewrites only nodes of our op: a graph without it is left as it is. It is installed, at most once per process,
the first time a graph takes our Linear, and only where no other pre-grad pass is set (torch's
``torch._inductor.config.pre_grad_custom_pass``: a user's own pass is left alone, and the GELU stays inductor's).
``layernorm_linear_config.COMPILED_LINEAR_GELU`` turns it off.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import fx

from ops import layernorm_linear_config as config

_GELUS = (torch._C._nn.gelu, torch.nn.functional.gelu)


def _is_tanh_gelu(node: fx.Node) -> bool:
    """Whether ``node`` is ``F.gelu(t, approximate="tanh")`` as dynamo records it."""
    return (node.op == "call_function" and node.target in _GELUS and len(node.args) == 1
            and node.kwargs == {"approximate": "tanh"})


def fuse_linear_gelu(graph: fx.Graph) -> int:
    """Rewrite ``gelu(mojo_direct.linear(xn, W, b), approximate="tanh")`` as ``mojo_direct.linear_gelu(xn, W, b)``
    wherever the GELU is the Linear's only user.

    Args:
        graph: a dynamo graph (torch-level ops), rewritten in place.

    Returns:
        How many GELUs went into a GEMM's epilogue.

    Example:
        >>> fuse_linear_gelu(gm.graph); gm.recompile()   # doctest: +SKIP
    """
    linear = torch.ops.mojo_direct.linear
    fused = torch.ops.mojo_direct.linear_gelu.default
    count = 0
    for node in list(graph.nodes):
        if not _is_tanh_gelu(node):
            continue
        source = node.args[0]
        if not (isinstance(source, fx.Node) and source.op == "call_function"
                and source.target in (linear, linear.default) and len(source.users) == 1 and not source.kwargs):
            continue
        with graph.inserting_before(node):
            replacement = graph.call_function(fused, tuple(source.args))
        replacement.meta.update(node.meta)
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
        graph.erase_node(source)
        count += 1
    return count


def _custom_graph_pass() -> type:
    """torch's base class for inductor passes with a cache key (``uuid``), or a plain object where it is missing."""
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:
        return object
    return CustomGraphPass


class LinearGeluPass(_custom_graph_pass()):
    """``fuse_linear_gelu`` as inductor's pre-grad custom pass, while ``config.COMPILED_LINEAR_GELU`` is on; its
    ``uuid`` (part of inductor's cache key) names this file's text and the switch."""

    def __call__(self, graph: fx.Graph) -> None:
        if config.COMPILED_LINEAR_GELU:
            fuse_linear_gelu(graph)

    def uuid(self) -> str:
        text = Path(__file__).read_bytes() + repr(config.COMPILED_LINEAR_GELU).encode()
        return hashlib.sha256(text).hexdigest()


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
