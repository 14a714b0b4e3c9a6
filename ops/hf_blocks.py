"""The Hugging Face blocks whose adds and projections around a norm ``apply_to`` fuses, and how (``FUSIONS``).

Each entry names a block class by (module, class) and its fusions in the order ``apply_to`` prefers them; each fusion
has the digests of the forwards it reproduces (``forward_digest``: a transformers version whose forward reads
otherwise is skipped and reported, never run differently), the norm it fuses (which ``apply_to`` must have made ours
first) and the forwards it installs on that instance:

* "projections": a pre-norm MLP's norm, first projection and activation as one ``layernorm_linear_act``: GPT-2's
  ``ln_2``, ``mlp.c_fc`` (a ``Conv1D``, its weight read transposed) and "gelu_new" (GELU's tanh form); ViT's
  ``layernorm_after``, ``mlp.fc1`` and GELU; OPT's ``final_layer_norm``, ``fc1`` and ReLU. The residual add before
  the norm stays the block's own.
* "residual": a pre-norm block's residual add and the norm after it as one ``add_rms_norm`` / ``add_layer_norm``
  (Llama, Mistral, Qwen2, Qwen3; ViT and OPT with ``projections=False``), and BERT's post-norm
  ``dense + dropout + add + LayerNorm``. The sum is the same rounded add as the block's own, so the values are the
  unfused block's.

A fused projection whose Linear or activation is no longer the one fused (a PEFT adapter put in its place after the
patch) runs as the unfused modules at that call, never without them.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import itertools
import re
import types
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
from torch import nn

from ops.layernorm import LayerNorm, add_layer_norm
from ops.layernorm_linear import layernorm_linear_act, linears
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


@cache
def forward_signature(cls: type) -> inspect.Signature:
    """``cls.forward``'s signature, read once per class (``inspect.signature`` costs tens of microseconds a call)."""
    return inspect.signature(cls.forward)


@cache
def positional_names(cls: type) -> tuple[str, ...]:
    """The names of ``cls.forward``'s parameters after ``self`` and ``hidden_states`` that a caller may pass by
    position."""
    params = list(forward_signature(cls).parameters.values())[2:]
    return tuple(p.name for p in itertools.takewhile(lambda p: p.kind is p.POSITIONAL_OR_KEYWORD, params))


def named_arguments(self: nn.Module, hidden_states: torch.Tensor, args: tuple, kwargs: dict) -> dict:
    """A fused forward's arguments after ``hidden_states`` by the names the class's own forward gives them (a caller
    may pass them by position: ViT's encoder passes the attention mask so)."""
    if not args:
        return kwargs
    names = positional_names(type(self))
    if len(args) <= len(names) and not kwargs.keys() & set(names[:len(args)]):   # the common case, without bind
        return dict(zip(names[:len(args)], args, strict=True)) | kwargs
    bound = forward_signature(type(self)).bind(self, hidden_states, *args, **kwargs)
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


def vit_attention(self: nn.Module, hidden_states: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
    """A ViT layer's first half up to its residual add: the attention's output after dropout."""
    kwargs = named_arguments(self, hidden_states, args, kwargs)
    attention, _ = self.attention(self.layernorm_before(hidden_states), kwargs.pop("attention_mask", None), **kwargs)
    return self.dropout(attention)


def vit_layer_forward(self: nn.Module, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    """A ViT layer with its first residual add and ``layernorm_after`` as one ``add_layer_norm``."""
    norm = self.layernorm_after
    y, s = add_layer_norm(vit_attention(self, hidden_states, args, kwargs), hidden_states, norm.weight, norm.bias,
                          norm.eps)
    return self.dropout(self.mlp(y)) + s


def vit_projection_forward(self: nn.Module, hidden_states: torch.Tensor, *args: object,
                           **kwargs: object) -> torch.Tensor:
    """A ViT layer with ``layernorm_after``, ``mlp.fc1`` and its activation as one ``layernorm_linear_act``."""
    s = vit_attention(self, hidden_states, args, kwargs) + hidden_states
    mlp = self.mlp
    return self.dropout(mlp.fc2(norm_projection(self.layernorm_after, mlp.fc1, mlp.activation_fn, s))) + s


def opt_attention(self: nn.Module, hidden_states: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
    """An OPT decoder layer's first half up to its residual add (it norms before: ``do_layer_norm_before``, checked
    when fused): the attention's output after dropout."""
    kwargs = named_arguments(self, hidden_states, args, kwargs)
    kwargs.pop("use_cache", None)   # the layer's own forward takes it and passes it on to nothing
    attention, _ = self.self_attn(hidden_states=self.self_attn_layer_norm(hidden_states), **kwargs)
    return nn.functional.dropout(attention, p=self.dropout, training=self.training)


def opt_mlp(self: nn.Module, s: torch.Tensor, h: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """An OPT decoder layer's last part from the residual sum s and ``fc1``'s activated output h, both [rows, H]:
    ``fc2``, dropout and the second residual add, in the layer's shape."""
    out = nn.functional.dropout(self.fc2(h), p=self.dropout, training=self.training)
    return (s + out).view(shape)


def opt_layer_forward(self: nn.Module, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    """An OPT decoder layer with its first residual add and ``final_layer_norm`` as one ``add_layer_norm``."""
    norm = self.final_layer_norm
    y, s = add_layer_norm(opt_attention(self, hidden_states, args, kwargs), hidden_states, norm.weight, norm.bias,
                          norm.eps)
    h = hidden_states.size(-1)
    return opt_mlp(self, s.reshape(-1, h), self.activation_fn(self.fc1(y.reshape(-1, h))), hidden_states.shape)


def opt_projection_forward(self: nn.Module, hidden_states: torch.Tensor, *args: object,
                           **kwargs: object) -> torch.Tensor:
    """An OPT decoder layer with ``final_layer_norm``, ``fc1`` and its activation as one ``layernorm_linear_act``."""
    s = (hidden_states + opt_attention(self, hidden_states, args, kwargs)).reshape(-1, hidden_states.size(-1))
    h = norm_projection(self.final_layer_norm, self.fc1, self.activation_fn, s)
    return opt_mlp(self, s, h, hidden_states.shape)


def post_norm_forward(self: nn.Module, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
    """BERT's ``dense``, ``dropout``, residual add and ``LayerNorm`` with the add and the norm as one
    ``add_layer_norm``."""
    norm = self.LayerNorm
    y, _ = add_layer_norm(self.dropout(self.dense(hidden_states)), input_tensor, norm.weight, norm.bias, norm.eps)
    return y


def passthrough(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A fused norm's forward: its input as it is (the op after it applies the norm)."""
    return x


# the activation modules ``layernorm_linear_act`` computes, by (module, class): its activation's name
ACTIVATIONS = {("transformers.activations", "GELUActivation"): "gelu",
               ("transformers.activations", "NewGELUActivation"): "gelu_tanh",   # "gelu_new"
               ("transformers.activations", "GELUTanh"): "gelu_tanh",
               ("torch.nn.modules.activation", "ReLU"): "relu"}
LINEAR = ("torch.nn.modules.linear", "Linear")
# the projection classes a fusion reads the weight of: nn.Linear's [N, K], and GPT-2's Conv1D's [K, N] transposed
PROJECTIONS = {LINEAR: False, ("transformers.pytorch_utils", "Conv1D"): True}


def class_key(obj: object) -> tuple[str, str]:
    return type(obj).__module__, type(obj).__qualname__


def norm_projection(norm: LayerNorm, linear: nn.Module, act: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """act(linear(norm(x))) as one ``layernorm_linear_act`` where linear is exactly a class of ``PROJECTIONS`` and
    act one of ``ACTIVATIONS``; else the three modules (a PEFT adapter put in linear's place since the patch)."""
    transposed, name = PROJECTIONS.get(class_key(linear)), ACTIVATIONS.get(class_key(act))
    if transposed is None or name is None:
        return act(linear(type(norm).forward(norm, x)))
    weight = linear.weight.mT if transposed else linear.weight
    return layernorm_linear_act(x, norm.weight, norm.bias, weight, linear.bias, norm.eps, activation=name)


def gpt2_mlp_forward(mlp: nn.Module, norm: LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """GPT-2's MLP on the block's un-normalized x (its ``ln_2`` passes x through): the norm, ``c_fc`` and GELU by
    ``norm_projection``, then ``c_proj`` and dropout."""
    return mlp.dropout(mlp.c_proj(norm_projection(norm, mlp.c_fc, mlp.act, x)))


# ---------------------------------------------------------------- projections of one input

class Answer(nn.Module):
    """A projection's stand-in during one call of a ``shared_input_forward``: its output for that call's input (the
    very tensor, unmodified since), computed with the other projections of that input; for any other input, the
    projection itself. Not a child module: the model's modules and state dict stay as they were."""

    def __init__(self) -> None:
        super().__init__()
        self.__dict__.update(projection=None, given=None, version=-1, out=None)   # set per call, past __setattr__

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x is self.given and x._version == self.version:
            return self.out
        return self.projection(x)


def takes_shared(projections: list[nn.Module]) -> bool:
    """Whether ``linears`` can stand in for these projections: each exactly ``nn.Linear`` with no hooks of its own,
    and all with a bias or none."""
    return (all(class_key(p) == LINEAR and not (p._forward_hooks or p._forward_pre_hooks or p._backward_hooks
                                                  or p._backward_pre_hooks) for p in projections)
            and len({p.bias is None for p in projections}) == 1)


def shared_input_forward(self: nn.Module, names: tuple[str, ...], answers: tuple[Answer, ...], first: str,
                         *args: object, **kwargs: object) -> object:
    """The class's own forward, with its projections ``names`` of its input (its first argument, ``first`` by name)
    computed by one ``linears`` call first and answered from it. Under torch.compile, or where ``takes_shared``
    does not hold (a PEFT adapter, a hook), the class's forward as it is."""
    projections = [self._modules[n] for n in names]
    x = args[0] if args else kwargs.get(first)
    if torch.compiler.is_compiling() or not isinstance(x, torch.Tensor) or not takes_shared(projections):
        return type(self).forward(self, *args, **kwargs)
    biases = None if projections[0].bias is None else [p.bias for p in projections]
    outs = linears(x, [p.weight for p in projections], biases)
    for name, answer, projection, out in zip(names, answers, projections, outs, strict=True):
        answer.__dict__.update(projection=projection, given=x, version=x._version, out=out)
        self._modules[name] = answer
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        for name, answer, projection in zip(names, answers, projections, strict=True):
            self._modules[name] = projection
            answer.__dict__.update(projection=None, given=None, out=None)


def install_shared(*names: str) -> Callable[[nn.Module], list[Undo]]:
    """An install of ``shared_input_forward`` for the projections ``names`` (attributes of the block)."""
    def install(block: nn.Module) -> list[Undo]:
        first = list(forward_signature(type(block)).parameters)[1]   # after self: the input
        answers = tuple(Answer() for _ in names)
        block.forward = functools.partial(shared_input_forward, block, names, answers, first)
        return [lambda: delattr(block, "forward")]
    return install


def shared_refusal(*names: str) -> Callable[[nn.Module], str]:
    """Why a block's projections ``names`` are not computed together (else '')."""
    def refusal(block: nn.Module) -> str:
        projections = [getattr(block, n, None) for n in names]
        if any(not isinstance(p, nn.Module) for p in projections):
            return f"it has no {' / '.join(names)}"
        return "" if takes_shared(projections) else f"its {' / '.join(names)} are not plain nn.Linear alike"
    return refusal


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
    mlp.forward = functools.partial(gpt2_mlp_forward, mlp, norm)
    norm.forward = types.MethodType(passthrough, norm)
    return [lambda: delattr(mlp, "forward"), lambda: delattr(norm, "forward")]


def projection_refusal(linear: str, act: str) -> Callable[[nn.Module], str]:
    """Why a block's projection ``linear`` and activation ``act`` (attribute paths) are not fused: the projection is
    not exactly a class of ``PROJECTIONS`` (a PEFT adapter, a subclass: the fused op would read the base weight
    alone), or the activation not one of ``ACTIVATIONS``."""
    def refusal(block: nn.Module) -> str:
        proj, fn = block.get_submodule(linear), block.get_submodule(act)
        if class_key(proj) not in PROJECTIONS:
            return f"its {linear} is {type(proj).__name__}, not a projection the fusion reads"
        return "" if class_key(fn) in ACTIVATIONS else f"its {act} is {type(fn).__name__}, not one it computes"
    return refusal


def opt_refusal(block: nn.Module) -> str:
    return "" if block.do_layer_norm_before else "it norms after (do_layer_norm_before is False)"


def opt_projection_refusal(block: nn.Module) -> str:
    return opt_refusal(block) or projection_refusal("fc1", "activation_fn")(block)


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
        norm = getattr(block, self.norm, None) if self.norm else None
        if self.norm and (type(norm) is not self.norm_type or norm.weight is None
                          or getattr(norm, "bias", False) is None):
            return f"its {self.norm} is not ours, with its parameters"
        return self.refusal(block)


RESIDUAL = "residual = hidden_states"
LLAMA = (Fusion("residual", (("", RESIDUAL, "a32bec294a26a7a2"),), "post_attention_layernorm", RMSNorm,
                own_forward(llama_layer_forward), "residual add + post_attention_layernorm"),)
POST_NORM = (Fusion("residual", (("", "hidden_states = self.dense", "62965e52dacd60c8"),), "LayerNorm", LayerNorm,
                    own_forward(post_norm_forward), "residual add + LayerNorm"),)
VIT = (("", RESIDUAL, "ec4a8d757f64a769"),)
OPT = (("", RESIDUAL, "9ff6cb0dd94f4ba6"),)
# The attention and MLP classes whose projections of one input run as one ``linears`` ("shared", with
# projections=True while SHARED_INPUT_PROJECTIONS is on): (module, classes, the projections' attributes). Their
# forwards need no digest: an answer is given only for the very input it was computed from.
SHARED_INPUT = [
    ("transformers.models.llama.modeling_llama", ("LlamaAttention",), ("q_proj", "k_proj", "v_proj")),
    ("transformers.models.mistral.modeling_mistral", ("MistralAttention",), ("q_proj", "k_proj", "v_proj")),
    ("transformers.models.qwen2.modeling_qwen2", ("Qwen2Attention",), ("q_proj", "k_proj", "v_proj")),
    ("transformers.models.qwen3.modeling_qwen3", ("Qwen3Attention",), ("q_proj", "k_proj", "v_proj")),
    ("transformers.models.llama.modeling_llama", ("LlamaMLP",), ("gate_proj", "up_proj")),
    ("transformers.models.mistral.modeling_mistral", ("MistralMLP",), ("gate_proj", "up_proj")),
    ("transformers.models.qwen2.modeling_qwen2", ("Qwen2MLP",), ("gate_proj", "up_proj")),
    ("transformers.models.qwen3.modeling_qwen3", ("Qwen3MLP",), ("gate_proj", "up_proj")),
    ("transformers.models.vit.modeling_vit", ("ViTAttention",), ("q_proj", "k_proj", "v_proj")),
    ("transformers.models.opt.modeling_opt", ("OPTAttention",), ("q_proj", "k_proj", "v_proj")),
    ("transformers.models.bert.modeling_bert", ("BertSelfAttention",), ("query", "key", "value")),
]
# Off until timed on a GPU (bench_models --ab-shared; docs/tuning.md): it saves two Python Linear calls an attention
# and one a gated MLP, for one C++ call and the stand-ins' module calls
SHARED_INPUT_PROJECTIONS = False
# each block class's fusions, the preferred first (ViT, OPT: the projection's saves more host time than the add's,
# docs/tuning.md)
FUSIONS: dict[tuple[str, str], tuple[Fusion, ...]] = {
    ("transformers.models.llama.modeling_llama", "LlamaDecoderLayer"): LLAMA,
    ("transformers.models.mistral.modeling_mistral", "MistralDecoderLayer"): LLAMA,
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2DecoderLayer"): LLAMA,
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3DecoderLayer"): LLAMA,
    ("transformers.models.vit.modeling_vit", "ViTLayer"): (
        Fusion("projections", (*VIT, ("mlp", "hidden_states = self.fc1", "1ed06fd533533541")), "layernorm_after",
               LayerNorm, own_forward(vit_projection_forward), "layernorm_after + mlp.fc1 + activation",
               projection_refusal("mlp.fc1", "mlp.activation_fn")),
        Fusion("residual", VIT, "layernorm_after", LayerNorm, own_forward(vit_layer_forward),
               "residual add + layernorm_after")),
    ("transformers.models.opt.modeling_opt", "OPTDecoderLayer"): (
        Fusion("projections", OPT, "final_layer_norm", LayerNorm, own_forward(opt_projection_forward),
               "final_layer_norm + fc1 + activation", opt_projection_refusal),
        Fusion("residual", OPT, "final_layer_norm", LayerNorm, own_forward(opt_layer_forward),
               "residual add + final_layer_norm", opt_refusal)),
    ("transformers.models.bert.modeling_bert", "BertSelfOutput"): POST_NORM,
    ("transformers.models.bert.modeling_bert", "BertOutput"): POST_NORM,
    **{(module, cls): (Fusion("shared", (), "", nn.Module, install_shared(*names),
                              f"{' + '.join(names)} as one linears", shared_refusal(*names)),)
       for module, classes, names in SHARED_INPUT for cls in classes},
    ("transformers.models.gpt2.modeling_gpt2", "GPT2Block"): (Fusion(
        "projections", (("", RESIDUAL, "a464301d3b835ef8"), ("mlp", "hidden_states = self.c_fc", "3b3ccd7e357e4f06")),
        "ln_2", LayerNorm, install_gpt2_mlp, "ln_2 + mlp.c_fc + GELU", projection_refusal("mlp.c_fc", "mlp.act")),),
}
