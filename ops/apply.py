"""``apply_to``: put this library's norms into a model the user already has (a Hugging Face one, or any
``nn.Module``), in place and undoably, recognizing each norm by its type.

What it replaces: ``nn.LayerNorm`` (by our ``LayerNorm``), ``nn.RMSNorm`` and Hugging Face's RMSNorm classes
(``ops.rmsnorm.config.HF_RMSNORMS``: Llama, Mistral, Qwen2, Qwen3 with its per-head ``q_norm``/``k_norm``, Phi-3,
OLMo2, Gemma 1-3) by our ``RMSNorm`` with the class's semantics. Each replacement shares the original's parameters
(the same ``Parameter`` objects, so tied weights stay tied and an optimizer made before keeps training them) and has
its ``state_dict`` keys. With ``residual=True`` the decoder layers of ``FUSED_LAYERS`` (Llama, Mistral, Qwen2, Qwen3)
also run their second residual add and ``post_attention_layernorm`` as one ``add_rms_norm`` (an instance's own
``forward``; the same values, since the add is the same rounded sum). With ``projections=True`` the blocks of
``FUSED_MLPS`` (GPT-2's) run their MLP's norm, first projection and GELU as one ``layernorm_linear_gelu`` (the norm's
own forward then passes its input through: the MLP's applies it). Nothing global is patched: two models in one
process can differ. The other projections after a norm (Llama's q/k/v and gate/up, OPT's fc1, ViT's, BERT's) are not
fused yet (issue 71).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import re
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from types import TracebackType

import torch
from torch import nn

from ops.common import loaded_class_entry
from ops.layernorm import LayerNorm
from ops.layernorm.module import AddLayerNorm
from ops.layernorm_linear import layernorm_linear_gelu
from ops.rmsnorm import RMSNorm, add_rms_norm
from ops.rmsnorm.module import AddRMSNorm, known_rmsnorm

OURS = (LayerNorm, AddLayerNorm, RMSNorm, AddRMSNorm)   # already this library's: left as they are

# Hugging Face's decoder layers whose forward is input_layernorm, self_attn (given the layer's own arguments), the
# residual add, post_attention_layernorm, mlp and the residual add, by (module, class), with the digest
# ``forward_digest`` reads from that forward: a transformers version whose layer reads otherwise is not fused (and
# says so in the report), never run differently.
FUSED_LAYERS = {
    ("transformers.models.llama.modeling_llama", "LlamaDecoderLayer"): "a32bec294a26a7a2",
    ("transformers.models.mistral.modeling_mistral", "MistralDecoderLayer"): "a32bec294a26a7a2",
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2DecoderLayer"): "a32bec294a26a7a2",
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3DecoderLayer"): "a32bec294a26a7a2",
}


# Hugging Face's blocks whose norm before the MLP feeds the MLP alone, and whose MLP is a Conv1D (its weight stored
# [K, N]), GELU's tanh form ("gelu_new"), a Conv1D and dropout, by (module, class): the digests of the block's forward
# and of its MLP's (``forward_digest``), and the MLP's norm, projection and activation attributes with the
# activation classes that are GELU's tanh form.
FUSED_MLPS = {
    ("transformers.models.gpt2.modeling_gpt2", "GPT2Block"): ("a464301d3b835ef8", "3b3ccd7e357e4f06", "ln_2"),
}
MLP_START = "hidden_states = self.c_fc"   # where the digest of a FUSED_MLPS block's MLP forward starts
TANH_GELUS = {("transformers.activations", "NewGELUActivation"): True,
              ("transformers.activations", "GELUTanh"): True}


@dataclass
class Report:
    """What ``apply_to`` did, by each module's qualified name in the model: ``replaced`` (name, original class,
    replacement, with an RMSNorm's semantics), ``fused`` (name, class, what runs as one) and ``skipped`` (name, class,
    why) for modules that look like norms (a class name with "Norm") or decoder layers it left alone."""

    replaced: list[tuple[str, str, str]] = field(default_factory=list)
    fused: list[tuple[str, str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"replaced {len(self.replaced)}, fused {len(self.fused)}, skipped {len(self.skipped)}"]
        lines += [f"  replaced {name}: {old} -> {new}" for name, old, new in self.replaced]
        lines += [f"  fused {name}: {cls}: {what}" for name, cls, what in self.fused]
        lines += [f"  skipped {name}: {cls} ({why})" for name, cls, why in self.skipped]
        return "\n".join(lines)


class PatchHandle:
    """Undoes an ``apply_to``: ``remove()`` puts every original module back (also on leaving a ``with`` block).
    ``report`` says what was replaced and what was skipped."""

    def __init__(self, undo: list[Callable[[], None]], report: Report) -> None:
        self._undo = undo
        self.report = report

    def remove(self) -> None:
        """Put the original modules and forwards back, in the reverse order of the changes (a second call does
        nothing)."""
        for step in reversed(self._undo):
            step()
        self._undo = []

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.remove()


def replacement(m: nn.Module) -> tuple[nn.Module | None, str]:
    """Our module for ``m`` sharing its parameters, and a word on it (the class it became, or why not: None then)."""
    if isinstance(m, OURS):
        return None, "already this library's"
    known = known_rmsnorm(m)
    try:
        if isinstance(m, nn.LayerNorm):
            new, word = LayerNorm.from_torch(m), "LayerNorm"
        elif known is not None:
            new, word = RMSNorm.from_module(m), f"RMSNorm(semantics={known[0]!r})"
        else:
            return None, "a class this library does not know"
    except TypeError as e:   # e.g. a parametrized weight: no plain parameter to share
        return None, str(e)
    return new.train(m.training), word


def apply_to(model: nn.Module, *, norms: bool = True, residual: bool = True, projections: bool = True) -> PatchHandle:
    """Replace ``model``'s norms with this library's, in place, and fuse the residual adds before them where it knows
    the block (see the module docstring for which).

    Args:
        model: any ``nn.Module``; its submodules are swapped where they sit (every place a shared norm sits).
        norms: replace the norms (False: change nothing, report only).
        residual: with ``norms``, run a known decoder layer's residual add and the norm after it as one.
        projections: with ``norms``, run a known block's MLP norm, first projection and GELU as one op.

    Returns:
        A ``PatchHandle``: ``handle.remove()`` (or leaving ``with apply_to(model) as handle:``) restores the model;
        ``handle.report`` lists what was replaced, what was fused, and what was skipped and why.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, named.

    Example:
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
        >>> handle = apply_to(model)
        >>> type(model[1]).__name__
        'LayerNorm'
        >>> handle.remove()
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    report, undo = Report(), []
    swap_norms(model, norms, report, undo)
    if norms and residual:
        fuse_layers(model, report, undo)
    if norms and projections:
        fuse_mlps(model, report, undo)
    return PatchHandle(undo, report)


def swap_norms(model: nn.Module, norms: bool, report: Report, undo: list[Callable[[], None]]) -> None:
    """``apply_to``'s norms: each module ``replacement`` knows swapped where it sits (one replacement per module)."""
    made: dict[int, nn.Module | None] = {}
    for qualified, child in list(model.named_modules(remove_duplicate=False)):   # every place a module sits
        if not qualified:
            continue
        parent_name, _, attr = qualified.rpartition(".")
        if id(child) not in made:
            new, word = replacement(child)
            made[id(child)] = new
            if new is not None and norms:
                report.replaced.append((qualified, type(child).__name__, word))
            elif "Norm" in type(child).__name__:
                report.skipped.append((qualified, type(child).__name__, "norms=False" if new is not None else word))
        if made[id(child)] is not None and norms:
            parent = model.get_submodule(parent_name)
            undo.append(lambda parent=parent, attr=attr, child=child: setattr(parent, attr, child))
            setattr(parent, attr, made[id(child)])


def fuse_layers(model: nn.Module, report: Report, undo: list[Callable[[], None]]) -> None:
    """``apply_to``'s residual fusion: each decoder layer of ``FUSED_LAYERS`` whose forward is the one known and whose
    ``post_attention_layernorm`` is ours gets ``fused_layer_forward`` as its own forward."""
    for qualified, layer in model.named_modules():
        known = loaded_class_entry(layer, FUSED_LAYERS)
        if known is None:
            continue
        if forward_digest(type(layer)) != known:
            report.skipped.append((qualified, type(layer).__name__, "its forward is not the one the fusion knows"))
        elif not isinstance(getattr(layer, "post_attention_layernorm", None), RMSNorm):
            report.skipped.append((qualified, type(layer).__name__, "its post_attention_layernorm is not ours"))
        else:
            layer.forward = types.MethodType(fused_layer_forward, layer)
            undo.append(lambda layer=layer: delattr(layer, "forward"))
            report.fused.append((qualified, type(layer).__name__, "residual add + post_attention_layernorm"))


@cache
def forward_digest(cls: type, start_at: str = "residual = hidden_states") -> str:
    """A digest of ``cls.forward`` from its first ``start_at`` on, comments, whitespace and arguments passed on under
    their own names (``x=x``) left out; '' where its source cannot be read or has no ``start_at``."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""
    start = source.find(start_at)
    body = re.sub(r"\s+", "", re.sub(r"\b(\w+)=\1\b,?", "", re.sub(r"#[^\n]*", "", source[start:])))
    return hashlib.sha256(body.encode()).hexdigest()[:16] if start >= 0 else ""


def fused_layer_forward(self: nn.Module, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    """A ``FUSED_LAYERS`` layer's forward with its second residual add and norm as one ``add_rms_norm`` (s = attention
    + residual, rounded as the layer's own add; y = the norm of s): the layer's arguments go to ``self_attn`` as its
    own forward passes them."""
    if args:   # positional arguments after hidden_states: named as the layer's own forward names them
        bound = inspect.signature(type(self).forward).bind(self, hidden_states, *args, **kwargs)
        kwargs = {k: v for k, v in bound.arguments.items() if k not in ("self", "hidden_states", "kwargs")}
        kwargs |= bound.arguments.get("kwargs", {})
    attention, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
    norm = self.post_attention_layernorm
    y, s = add_rms_norm(attention, hidden_states, norm.weight, norm.eps, semantics=norm.semantics)
    return s + self.mlp(y)


def fuse_mlps(model: nn.Module, report: Report, undo: list[Callable[[], None]]) -> None:
    """``apply_to``'s projection fusion: each block of ``FUSED_MLPS`` whose forwards are the ones known, whose norm
    is our LayerNorm and whose activation is GELU's tanh form gets ``fused_mlp_forward`` as its MLP's forward, and
    its norm passes its input through."""
    for qualified, block in model.named_modules():
        known = loaded_class_entry(block, FUSED_MLPS)
        if known is None:
            continue
        block_digest, mlp_digest, norm_name = known
        norm, mlp = getattr(block, norm_name, None), getattr(block, "mlp", None)
        why = ("its forward is not the one the fusion knows" if forward_digest(type(block)) != block_digest
               else "its MLP's forward is not the one the fusion knows"
               if mlp is None or forward_digest(type(mlp), MLP_START) != mlp_digest
               else f"its {norm_name} is not ours, with a weight and a bias"
               if type(norm) is not LayerNorm or norm.weight is None or norm.bias is None
               else "its MLP's activation is not GELU's tanh form" if not loaded_class_entry(mlp.act, TANH_GELUS)
               else "")
        if why:
            report.skipped.append((qualified, type(block).__name__, why))
            continue
        mlp.forward = functools.partial(fused_mlp_forward, mlp, norm, type(mlp.c_fc), type(mlp.act))
        norm.forward = types.MethodType(passthrough, norm)
        undo.append(lambda mlp=mlp, norm=norm: (delattr(mlp, "forward"), delattr(norm, "forward")))
        report.fused.append((qualified, type(block).__name__, f"{norm_name} + mlp.c_fc + GELU"))


def passthrough(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A fused norm's forward: its input as it is (the op after it applies the norm)."""
    return x


def fused_mlp_forward(mlp: nn.Module, norm: LayerNorm, conv: type, act: type, x: torch.Tensor) -> torch.Tensor:
    """A ``FUSED_MLPS`` MLP's forward on the block's un-normalized x: norm, c_fc and GELU by ``layernorm_linear_gelu``
    (c_fc's [K, N] weight as its transpose), then c_proj and dropout. A c_fc or activation that is no longer the
    one fused (a PEFT adapter put in its place since) runs as the unfused MLP instead, never without it."""
    if type(mlp.c_fc) is not conv or type(mlp.act) is not act:
        return type(mlp).forward(mlp, type(norm).forward(norm, x))
    h = layernorm_linear_gelu(x, norm.weight, norm.bias, mlp.c_fc.weight.mT, mlp.c_fc.bias, norm.eps)
    return mlp.dropout(mlp.c_proj(h))
