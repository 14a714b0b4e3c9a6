"""RMSNorm's choices: the kernels' codes for each semantics (read from ops/kernels/layernorm.mojo, whose loop and CPU
kernels take RMSNorm as bits of their ``act`` parameter) and the launches it runs."""

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
    """Every instantiation an RMSNorm launches on a GPU (the loop kernels at every row-length bracket, few rows and
    many, for each semantics and dtype), for ``poe build-kernels`` and the CPU machine's compile check."""
    specs: dict[KernelSpec, None] = {}
    for dtype in ln_config.DTYPES:
        for act in SEMANTICS.values():
            for h in (1024, 1025):   # the loops' two shapes each: up to 1024 columns, and beyond
                for rows in (1, 4096):   # the forward's UNROLL: 4 below the SM count, 1 above
                    specs[ln_config.fwd_launch(rows, h, dtype, False).spec(dtype, act)] = None
                specs[ln_config.bwd_launch(1, h, dtype, False).spec(dtype, act)] = None
    return list(specs)
