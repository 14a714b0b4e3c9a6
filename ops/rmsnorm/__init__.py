"""RMSNorm on our kernels: ``rms_norm`` (``F.rms_norm``'s signature), ``RMSNorm`` (a ``torch.nn.RMSNorm``), a
pre-norm block's add and norm (``add_rms_norm``, ``AddRMSNorm``) and ``FusedRMSNormLinear`` (an
``nn.Sequential(RMSNorm, Linear)``), with the semantics of torch's, Hugging Face Llama's and Gemma's RMSNorm. The
kernels are LayerNorm's (``ops/kernels/layernorm.mojo``), told the norm by their ``act`` code: on a GPU launched
directly and then from the C++ entries, on the CPU through MAX graphs. ``rms_norm_linear`` is Linear(RMSNorm(x)): our
RMSNorm, then cuBLASLt (LayerNorm+Linear's fused and Hopper kernels do not take RMSNorm yet). The files, each
calling only those below it: ``module.py``, ``functional.py``, ``autograd.py``, ``fwd_bwd.py``, ``checks.py``,
``launch.py``, ``config.py``."""

from ops.rmsnorm.config import SEMANTICS
from ops.rmsnorm.functional import add_rms_norm, rms_norm, rms_norm_linear
from ops.rmsnorm.module import AddRMSNorm, FusedRMSNormLinear, RMSNorm

__all__ = ["AddRMSNorm", "FusedRMSNormLinear", "RMSNorm", "SEMANTICS", "add_rms_norm", "rms_norm", "rms_norm_linear"]
