"""LayerNorm (optionally followed by GELU) over the trailing dims, forward and backward, on our Mojo kernels.

Shapes: x [..., H]; weight (gamma) and bias (beta) [H] in x's dtype (float32, float16 or bfloat16), or float32
for 16-bit x; mean and rstd [...] float32. Kernels: ``ops/kernels/layernorm.mojo``. The files, each layer
calling only those below it:

* ``module.py``: ``LayerNorm``, an ``nn.LayerNorm`` subclass that loads its state dict, and ``AddLayerNorm``, a
  pre-norm block's residual add and LayerNorm;
* ``functional.py``: ``layernorm`` (the last dim) and ``layer_norm`` (``F.layer_norm``'s signature), with autograd:
  check, pick the route, call it;
* ``autograd.py``: ``LayerNormFunction``, the form a torch.compile graph holds, and the one-pass add and norm
  (``add_norm``, for LayerNorm and RMSNorm);
* ``fwd_bwd.py``: ``layernorm_fwd`` / ``layernorm_bwd`` without autograd, and their ``torch.library`` ops;
* ``checks.py``: the inputs' checks and named errors;
* ``launch.py``: the MAX graph ops and the direct launches with their plans;
* ``config.py``: which kernel and launch each shape gets, and why (evidence: ``docs/tuning.md``).
"""

from ops.layernorm.config import DTYPES, VARIANTS
from ops.layernorm.functional import add_layer_norm, layer_norm, layernorm
from ops.layernorm.fwd_bwd import layernorm_bwd, layernorm_fwd
from ops.layernorm.module import AddLayerNorm, LayerNorm

__all__ = ["DTYPES", "VARIANTS", "AddLayerNorm", "LayerNorm", "add_layer_norm", "layer_norm", "layernorm",
           "layernorm_bwd", "layernorm_fwd"]
