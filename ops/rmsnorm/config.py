"""RMSNorm's choices: the kernels' codes for each semantics (read from ops/kernels/layernorm.mojo, whose kernels take
RMSNorm as bits of their ``act`` parameter) and the instantiations it launches."""

from __future__ import annotations

from ops.launch.mojo_constants import comptime
from ops.launch.ptx import KernelSpec
from ops.layernorm import config as ln_config

K = comptime("layernorm")   # the kernels' own constants: the one source of each

# How the models that use an RMSNorm compute it, as the kernels' act code: "torch" is torch's F.rms_norm and
# nn.RMSNorm (x * rstd * weight in fp32, rounded once), "llama" Hugging Face's LlamaRMSNorm and its copies (x * rstd
# rounded to x's dtype, then times the weight), "gemma" GemmaRMSNorm (x * rstd * (1 + weight) in fp32)
SEMANTICS = {"torch": K["NORM_RMS"], "llama": K["NORM_RMS"] | K["RMS_LLAMA"], "gemma": K["NORM_RMS"] | K["RMS_GEMMA"]}

# Under torch.compile, who runs RMSNorm (and the add before it, and the norm of RMSNorm+Linear): "inductor" (the
# semantics' own torch ops, which inductor fuses with their neighbours) or "ours" (our ops, called through Python in
# the compiled graph); "ours" cost 1.4-1.7x the compiled unpatched model's time (docs/tuning.md)
COMPILED_RMSNORM = "inductor"
COMPILED_FORMS = ("inductor", "ours")


def all_specs() -> list[KernelSpec]:
    """Every instantiation an RMSNorm launches on an sm_90 GPU (LayerNorm's choices of kernel and the one-pass add and
    norm, for each semantics, and the column sums of dgamma alone; the copy is LayerNorm's), for ``poe build-kernels``
    and the CPU machine's compile check."""
    return list(ln_config.launch_specs(tuple(SEMANTICS.values()), ("fast",), tuple(SEMANTICS.values())))


# Hugging Face's RMSNorm classes by (module, class name), each with its semantics and the attribute holding its eps,
# read from the classes' own forwards: the Llama family casts x * rstd to x's dtype, then multiplies (Mistral, Qwen2,
# Qwen3 and its per-head q_norm/k_norm, Phi-3 are copies); OLMo2 multiplies in float32 and casts once, which is
# torch's; Gemma's multiply by 1 + weight in float32. Matched by isinstance against the class itself, where the model's
# module is loaded (transformers is never imported for it).
HF_RMSNORMS = {
    ("transformers.models.llama.modeling_llama", "LlamaRMSNorm"): ("llama", "variance_epsilon"),
    ("transformers.models.mistral.modeling_mistral", "MistralRMSNorm"): ("llama", "variance_epsilon"),
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2RMSNorm"): ("llama", "variance_epsilon"),
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3RMSNorm"): ("llama", "variance_epsilon"),
    ("transformers.models.phi3.modeling_phi3", "Phi3RMSNorm"): ("llama", "variance_epsilon"),
    ("transformers.models.olmo2.modeling_olmo2", "Olmo2RMSNorm"): ("torch", "variance_epsilon"),
    ("transformers.models.gemma.modeling_gemma", "GemmaRMSNorm"): ("gemma", "eps"),
    ("transformers.models.gemma2.modeling_gemma2", "Gemma2RMSNorm"): ("gemma", "eps"),
    ("transformers.models.gemma3.modeling_gemma3", "Gemma3RMSNorm"): ("gemma", "eps"),
}
