"""The Hugging Face blocks whose adds and projections around a norm ``apply_to`` fuses, and how (``FUSIONS``).

Each entry names a block class by (module, class), the digests of the forwards it reproduces (``forward_digest``:
a transformers version whose forward reads otherwise is skipped and reported, never run differently), the norm it
fuses (which ``apply_to`` must have made ours first) and the forward it installs on that instance:

* "residual": a pre-norm block's residual add and the norm after it as one ``add_rms_norm`` / ``add_layer_norm``
  (Llama, Mistral, Qwen2, Qwen3, ViT, OPT), and BERT's post-norm ``dense + dropout + add + LayerNorm``. The sum is
  the same rounded add as the block's own, so the values are the unfused block's.
* "projections": GPT-2's MLP norm, ``c_fc`` and GELU (its "gelu_new" is GELU's tanh form) as one
  ``layernorm_linear_gelu``; the norm's own forward then passes its input through.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import re
import types
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
from torch import nn

from ops.common import loaded_class_entry
from ops.layernorm import LayerNorm, add_layer_norm
from ops.layernorm_linear import layernorm_linear_gelu
from ops.rmsnorm import RMSNorm, add_rms_norm

Undo = Callable[[], None]


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


def named_arguments(self: nn.Module, hidden_states: torch.Tensor, args: tuple, kwargs: dict) -> dict:
    """A fused forward's arguments after ``hidden_states`` by the names the class's own forward gives them (a caller
    may pass them by position)."""
    if not args:
        return kwargs
    bound = inspect.signature(type(self).forward).bind(self, hidden_states, *args, **kwargs)
    named = {k: v for k, v in bound.arguments.items() if k not in ("self", "hidden_states", "kwargs")}
    return named | bound.arguments.get("kwargs", {})


# ---------------------------------------------------------------- the fused forwards

def llama_layer_forward(self: nn.Module, hidden_states: torch.Tensor, *args: object,
                        **kwargs: object) -> torch.Tensor:
    """A Llama-family decoder layer with its second residual add and ``post_attention_layernorm`` as one
    ``add_rms_norm``: the layer's arguments go to ``self_attn`` as its own forward passes them."""
    kwargs = named_arguments(self, hidden_states, args, kwargs)
    attention, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
    norm = self.post_attention_layernorm
    y, s = add_rms_norm(attention, hidden_states, norm.weight, norm.eps, semantics=norm.semantics)
    return s + self.mlp(y)


def vit_layer_forward(self: nn.Module, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    """A ViT layer with its first residual add and ``layernorm_after`` as one ``add_layer_norm``."""
    kwargs = named_arguments(self, hidden_states, args, kwargs)
    attention, _ = self.attention(self.layernorm_before(hidden_states), kwargs.pop("attention_mask", None), **kwargs)
    norm = self.layernorm_after
    y, s = add_layer_norm(self.dropout(attention), hidden_states, norm.weight, norm.bias, norm.eps)
    return self.dropout(self.mlp(y)) + s


def opt_layer_forward(self: nn.Module, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    """An OPT decoder layer that norms before (``do_layer_norm_before``, checked when fused) with its first residual
    add and ``final_layer_norm`` as one ``add_layer_norm``."""
    kwargs = named_arguments(self, hidden_states, args, kwargs)
    kwargs.pop("use_cache", None)   # the layer's own forward takes it and passes it on to nothing
    attention, _ = self.self_attn(hidden_states=self.self_attn_layer_norm(hidden_states), **kwargs)
    attention = nn.functional.dropout(attention, p=self.dropout, training=self.training)
    norm = self.final_layer_norm
    y, s = add_layer_norm(attention, hidden_states, norm.weight, norm.bias, norm.eps)
    h = hidden_states.size(-1)
    out = self.fc2(self.activation_fn(self.fc1(y.reshape(-1, h))))
    out = nn.functional.dropout(out, p=self.dropout, training=self.training)
    return (s.reshape(-1, h) + out).view(hidden_states.shape)


def post_norm_forward(self: nn.Module, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
    """BERT's ``dense``, ``dropout``, residual add and ``LayerNorm`` with the add and the norm as one
    ``add_layer_norm``."""
    norm = self.LayerNorm
    y, _ = add_layer_norm(self.dropout(self.dense(hidden_states)), input_tensor, norm.weight, norm.bias, norm.eps)
    return y


def passthrough(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A fused norm's forward: its input as it is (the op after it applies the norm)."""
    return x


def gpt2_mlp_forward(mlp: nn.Module, norm: LayerNorm, conv: type, act: type, x: torch.Tensor) -> torch.Tensor:
    """GPT-2's MLP on the block's un-normalized x: the norm, ``c_fc`` and GELU by ``layernorm_linear_gelu`` (c_fc's
    [K, N] weight as its transpose), then ``c_proj`` and dropout. A ``c_fc`` or activation that is no longer the one
    fused (a PEFT adapter put in its place since) runs as the unfused MLP instead, never without it."""
    if type(mlp.c_fc) is not conv or type(mlp.act) is not act:
        return type(mlp).forward(mlp, type(norm).forward(norm, x))
    h = layernorm_linear_gelu(x, norm.weight, norm.bias, mlp.c_fc.weight.mT, mlp.c_fc.bias, norm.eps)
    return mlp.dropout(mlp.c_proj(h))


# ---------------------------------------------------------------- installing them

def own_forward(forward: Callable[..., torch.Tensor]) -> Callable[[nn.Module], list[Undo]]:
    """An install that makes ``forward`` the block's own."""
    def install(block: nn.Module) -> list[Undo]:
        block.forward = types.MethodType(forward, block)
        return [lambda: delattr(block, "forward")]
    return install


def install_gpt2_mlp(block: nn.Module) -> list[Undo]:
    """GPT-2's fused MLP forward on its ``mlp``, and ``ln_2`` passing its input through."""
    mlp, norm = block.mlp, block.ln_2
    mlp.forward = functools.partial(gpt2_mlp_forward, mlp, norm, type(mlp.c_fc), type(mlp.act))
    norm.forward = types.MethodType(passthrough, norm)
    return [lambda: delattr(mlp, "forward"), lambda: delattr(norm, "forward")]


# the activation classes that are GELU's tanh form, by (module, class)
TANH_GELUS = {("transformers.activations", "NewGELUActivation"): True,
              ("transformers.activations", "GELUTanh"): True}


CONV1D = ("transformers.pytorch_utils", "Conv1D")   # GPT-2's projection class, whose weight is read directly


def gpt2_refusal(block: nn.Module) -> str:
    """Why GPT-2's MLP is not fused: its c_fc is not exactly transformers' Conv1D (a PEFT adapter, a subclass: the
    fused op would read the base weight alone), or its activation is not GELU's tanh form."""
    conv = type(block.mlp.c_fc)
    if (conv.__module__, conv.__qualname__) != CONV1D:
        return f"its mlp.c_fc is {conv.__name__}, not the Conv1D the fusion reads"
    return "" if loaded_class_entry(block.mlp.act, TANH_GELUS) else "its MLP's activation is not GELU's tanh form"


def opt_refusal(block: nn.Module) -> str:
    return "" if block.do_layer_norm_before else "it norms after (do_layer_norm_before is False)"


@dataclass(frozen=True)
class Fusion:
    """How one block class is fused: ``kind`` ("residual" or "projections", the switch of ``apply_to`` that asks for
    it); ``digests``: (attribute, where the digest starts, digest) per forward it reproduces ("" the block's own);
    ``norm``: the attribute of the norm it fuses, which must be ``norm_type`` (ours) with its parameters;
    ``install``: puts the fused forwards on the block, returning what undoes that; ``refusal``: any other reason not
    to (else ''); ``what``: the report's words."""

    kind: str
    digests: tuple[tuple[str, str, str], ...]
    norm: str
    norm_type: type
    install: Callable[[nn.Module], list[Undo]]
    what: str
    refusal: Callable[[nn.Module], str] = lambda block: ""

    def why_not(self, block: nn.Module) -> str:
        """Why this block is not fused ('' if it is to be)."""
        for attr, start, digest in self.digests:
            part = getattr(block, attr, None) if attr else block
            if part is None or forward_digest(type(part), start) != digest:
                return f"its {attr + ' ' if attr else ''}forward is not the one the fusion knows"
        norm = getattr(block, self.norm, None)
        if type(norm) is not self.norm_type or norm.weight is None or getattr(norm, "bias", False) is None:
            return f"its {self.norm} is not ours, with its parameters"
        return self.refusal(block)


RESIDUAL = "residual = hidden_states"
LLAMA = Fusion("residual", (("", RESIDUAL, "a32bec294a26a7a2"),), "post_attention_layernorm", RMSNorm,
               own_forward(llama_layer_forward), "residual add + post_attention_layernorm")
POST_NORM = Fusion("residual", (("", "hidden_states = self.dense", "62965e52dacd60c8"),), "LayerNorm", LayerNorm,
                   own_forward(post_norm_forward), "residual add + LayerNorm")
FUSIONS = {
    ("transformers.models.llama.modeling_llama", "LlamaDecoderLayer"): LLAMA,
    ("transformers.models.mistral.modeling_mistral", "MistralDecoderLayer"): LLAMA,
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2DecoderLayer"): LLAMA,
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3DecoderLayer"): LLAMA,
    ("transformers.models.vit.modeling_vit", "ViTLayer"): Fusion(
        "residual", (("", RESIDUAL, "ec4a8d757f64a769"),), "layernorm_after", LayerNorm,
        own_forward(vit_layer_forward), "residual add + layernorm_after"),
    ("transformers.models.opt.modeling_opt", "OPTDecoderLayer"): Fusion(
        "residual", (("", RESIDUAL, "9ff6cb0dd94f4ba6"),), "final_layer_norm", LayerNorm,
        own_forward(opt_layer_forward), "residual add + final_layer_norm", opt_refusal),
    ("transformers.models.bert.modeling_bert", "BertSelfOutput"): POST_NORM,
    ("transformers.models.bert.modeling_bert", "BertOutput"): POST_NORM,
    ("transformers.models.gpt2.modeling_gpt2", "GPT2Block"): Fusion(
        "projections", (("", RESIDUAL, "a464301d3b835ef8"), ("mlp", "hidden_states = self.c_fc", "3b3ccd7e357e4f06")),
        "ln_2", LayerNorm, install_gpt2_mlp, "ln_2 + mlp.c_fc + GELU", gpt2_refusal),
}
