"""RMSNorm on our kernels: ``rms_norm`` (``F.rms_norm``'s signature), ``RMSNorm`` (a ``torch.nn.RMSNorm``) and
``FusedRMSNormLinear`` (an ``nn.Sequential(RMSNorm, Linear)``), with the semantics of torch's, Hugging Face Llama's
and Gemma's RMSNorm. This first version runs the LayerNorm kernels' loop (GPU) and CPU kernels through MAX graphs;
the direct launch, the C++ entries, residual add + norm and RMSNorm+Linear's fused routes are issue 70's next steps."""

from ops.rmsnorm.config import SEMANTICS
from ops.rmsnorm.functional import add_rms_norm, rms_norm
from ops.rmsnorm.module import FusedRMSNormLinear, RMSNorm

__all__ = ["FusedRMSNormLinear", "RMSNorm", "SEMANTICS", "add_rms_norm", "rms_norm"]
