"""Linear(LayerNorm(x)), forward and backward, from Mojo (plus cuBLAS where the GEMM dominates).

Shapes: x [..., K]; ln_weight, ln_bias [K]; weight [N, K]; bias [N] (or None); y [..., N]. All the same dtype
(float32, float16 or bfloat16) and device. float32 is IEEE unless the caller enables TF32 in torch (the cuBLAS GEMMs
follow ``torch.backends.cuda.matmul.allow_tf32``; the Mojo kernels never use it).

Forward algorithms (``algo``):

* ``"fused"``: one read of x, no normalized tensor (``ops/kernels/layernorm_linear.mojo``): the GEMM runs on x - c
  (times gamma) as it is loaded (c: a per-row shift from the row's first 8 elements), the rows' statistics come from
  the same loads, and the normalization, beta and the bias are applied to the GEMM's result; k is split over several
  blocks whose partial sums are added in a fixed order; G and B + bias come from the fold kernel, run inside the same
  op at every call. fp16/bf16 on tensor cores.
* ``"sm90"`` (bfloat16 on an H100-class GPU, K and N multiples of 8): the same algorithm in one persistent Hopper
  kernel (TMA loads, wgmma, ``ops/kernels/layernorm_linear_sm90.mojo``); a ``ValueError`` names what is missing
  elsewhere.
* ``"unfused"``: our LayerNorm kernel, then the Linear by cuBLASLt (16-bit on a CUDA GPU, the bias and its gradient
  in the GEMMs' epilogues; ``docs/direct_launch.md``) or ``F.linear``.
* ``"auto"`` (default): the region table of ``config.py`` (``algo.pick_algo``; evidence in ``docs/tuning.md``).

``layernorm_linear_act``: act(Linear(LayerNorm(x))) for act GELU (erf or tanh form) or ReLU, a pre-norm MLP's first
half (GPT-2's, ViT's, OPT's), as one C++ op each way on a GPU (the weight may be a transposed view).
``linears``: several Linears of one input (an attention's q, k and v) as one C++ op each way on a GPU.

Backward (one path for all): dW = dy^T xn and dxn = dy W by cuBLAS, db = sum of dy, and dx, dgamma, dbeta by our
deterministic LayerNorm backward. The autograd forward of ``unfused`` keeps the normalized xn for it (as torch does);
after ``fused`` or ``sm90`` the backward recomputes xn, so with gradients to come fp16/bf16 ``auto`` takes
``unfused`` (``algo.autograd_algo``).

The files, each layer calling only those below it: ``module.py`` (``FusedLayerNormLinear``) → ``functional.py``
(``layernorm_linear``: check, route, call) → ``traced.py`` (the torch.compile form) → ``autograd.py`` →
``fwd_bwd.py`` (``layernorm_linear_fwd`` / ``_bwd`` and their ``torch.library`` ops) → ``algo.py`` (which algorithm)
→ ``checks.py`` → ``launch.py`` (graph ops, C++ plans, cuBLASLt) → ``config.py`` (tuning tables);
``inductor.py``:
the inductor pass that puts a GELU after the Linear into its GEMM.
"""

from ops.inputs import DTYPES
from ops.layernorm_linear.config import ALGOS
from ops.layernorm_linear.functional import layernorm_linear, layernorm_linear_act, linears
from ops.layernorm_linear.fwd_bwd import layernorm_linear_bwd, layernorm_linear_fwd
from ops.layernorm_linear.module import FusedLayerNormLinear

__all__ = ["ALGOS", "DTYPES", "FusedLayerNormLinear", "layernorm_linear", "layernorm_linear_act",
           "layernorm_linear_bwd", "layernorm_linear_fwd", "linears"]
