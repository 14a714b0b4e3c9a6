"""RMSNorm on our kernels: ``rms_norm`` (``F.rms_norm``'s signature) and ``RMSNorm`` (a ``torch.nn.RMSNorm``), with
the semantics of torch's, Hugging Face Llama's and Gemma's RMSNorm. This first version runs the LayerNorm kernels'
loop (GPU) and CPU kernels through MAX graphs; the direct launch, the C++ entries, residual add and RMSNorm+Linear
are issue 70's next steps."""

from ops.rmsnorm.config import SEMANTICS
from ops.rmsnorm.functional import rms_norm
from ops.rmsnorm.module import RMSNorm

__all__ = ["RMSNorm", "SEMANTICS", "rms_norm"]
