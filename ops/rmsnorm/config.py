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


def all_specs() -> list[KernelSpec]:
    """Every instantiation an RMSNorm launches on an sm_90 GPU (LayerNorm's choices of kernel and the one-pass add and
    norm, for each semantics; the column sums and the copy are LayerNorm's), for ``poe build-kernels`` and the CPU
    machine's compile check."""
    return list(ln_config.launch_specs(tuple(SEMANTICS.values()), ("fast",), tuple(SEMANTICS.values())))
