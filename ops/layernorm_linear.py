"""Linear(LayerNorm(x)), forward and backward, from Mojo (plus cuBLAS where the GEMM dominates).

Shapes: x [..., K]; ln_weight, ln_bias [K]; weight [N, K]; bias [N] (or None);
y [..., N]. All the same dtype (float32, float16 or bfloat16) and device.
float32 is IEEE unless the caller enables TF32 in torch (the cuBLAS GEMMs
follow ``torch.backends.cuda.matmul.allow_tf32``; the Mojo kernel never uses it).

Forward algorithms (``algo``):

* ``"fused"``: one read of x, no normalized tensor (``ops/kernels/layernorm_linear.mojo``):
  the GEMM runs on x - c (times gamma) as it is loaded (c: a per-row shift from the row's
  first 8 elements), the rows' statistics come from the same loads, and the normalization, beta and the
  bias are applied to the GEMM's result; k is split over several blocks whose partial sums are added
  in a fixed order (float32: by a second kernel; fp16/bf16: by each output tile's last block), and
  G and B + bias come from the fold kernel, run inside the same op at every call. fp16/bf16 on tensor cores.
* ``"sm90"`` (bfloat16 on an H100-class GPU, K and N multiples of 8): the same algorithm in one
  persistent Hopper kernel (TMA loads, wgmma, ``ops/kernels/layernorm_linear_sm90.mojo``); a
  ``ValueError`` names what is missing elsewhere. ``auto`` picks it for bfloat16 on sm_90 with
  ``SM90_MIN_N`` <= n <= ``SM90_MAX_N`` and at least ``SM90_MIN_ROWS`` rows (bar large x at larger shapes),
  or at least ``SM90_FILL_ROWS`` where its grid fills the GPU and k is short, this last region not under CUDA
  graph capture (``sm90_region``: where it won the H100 benchmarks, results/bench_layernorm_linear.md,
  bench_layernorm_linear_sm90.md and bench_transformer.md).
* ``"unfused"``: our LayerNorm kernel, then the Linear by cuBLASLt (16-bit on a CUDA GPU, the bias and its
  gradient in the GEMMs' epilogues; ``docs/direct_launch.md``) or ``F.linear``.
* ``"auto"`` (default): ``sm90`` in its region (above), else ``fused`` on the GPU for float32 with n <= ``FUSED_MAX_N``
  and at least ``FUSED_MIN_ROWS`` rows, for fp16/bf16 with n <= ``FUSED16_MAX_N``,
  at least ``FUSED16_MIN_ROWS`` rows and k >= ``FUSED16_MIN_K``; else ``unfused`` (these tables and their
  evidence: ``ops/layernorm_linear_config.py``).
  On the H100 (results/bench_layernorm_linear*.md) the fused kernel's IEEE fp32
  FMAs beat cuBLAS's fp32 GEMM plus a separate LayerNorm where n is small; in
  fp16/bf16 the fused kernel (cp.async ring, mma.sync) wins where x is long and n
  small, cuBLAS's GEMM after our LayerNorm elsewhere; on the CPU torch's BLAS wins.

Backward (one path for all): dW = dy^T xn and dxn = dy W by cuBLAS, db = sum
of dy, and dx, dgamma, dbeta by our deterministic LayerNorm backward. The
autograd forward of ``unfused`` keeps the normalized xn for it (as torch does);
after ``fused`` or ``sm90`` the backward recomputes xn with our LayerNorm kernel, so
with gradients to come fp16/bf16 ``auto`` takes ``unfused`` (``autograd_algo``).
Layers: ``layernorm_linear_fwd`` / ``layernorm_linear_bwd`` (validated calls),
``torch.ops.mojo.layernorm_linear_fwd`` / ``_bwd`` (torch.library, with fakes),
``layernorm_linear`` (autograd), ``FusedLayerNormLinear`` (nn.Module).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from functools import cache

import torch
from torch import nn
from torch.nn.modules import module as _nn_module  # the global module hooks nn.Module.__call__ runs

from ops import layernorm
from ops import layernorm_linear_config as config
from ops.launch import direct
from ops.launch.bridge import LIBRARY, GraphOp, Out
from ops.layernorm_linear_config import (  # noqa: F401 (auto's tuning, read here and by the tests as LL.<name>)
    FUSED16_MAX_N,
    FUSED16_MIN_K,
    FUSED16_MIN_ROWS,
    FUSED_MAX_N,
    FUSED_MIN_ROWS,
    FUSED_TILE_COLS,
    FUSED_TILE_ROWS,
    SM90_FILL_MAX_K,
    SM90_FILL_ROWS,
    SM90_MAX_N,
    SM90_MIN_N,
    SM90_MIN_ROWS,
    SM90_RUN_MAX_X,
    SPLIT_BLOCKS_PER_SM,
    SPLIT_BLOCKS_PER_SM_16,
    SPLIT_MAX,
    SPLIT_MIN_K,
    sm90_region,
)
from ops.validate import INT32_MAX, as_size, check_grad, check_int32_rows, check_same, check_size, check_tensor

__all__ = ["ALGOS", "FusedLayerNormLinear", "layernorm_linear", "layernorm_linear_bwd", "layernorm_linear_fwd"]

DTYPES = layernorm.DTYPES
ALGOS, ALGO_IDS = config.ALGOS, config.ALGO_IDS   # public here: the API takes algo= by these names


def _configure_native(native: object) -> None:
    """This op's tuning of the C++ side's GEMMs and capture streams, handed over when the C++ entries load."""
    native.set_gemm_tuning(config.LT_NO_WORKSPACE_MAX_K_PER_N)
    native.set_capture_overlap(config.CAPTURED_WEIGHT_GRADS_BESIDE)
    native.set_accumulate_beside(config.CAPTURED_GRADS_ACCUMULATED_BESIDE_MAX_ROWS)


direct.on_native_load(_configure_native)   # every C++ GEMM call comes through this module, so it is set first


@cache
def fwd_op(eps: float) -> GraphOp:
    """The registered fused forward: y [rows, n], mean [rows], rstd [rows] (float32), then GPU scratch
    (flat per split, see ``scratch_sizes``): partial products and partial row sums, and the fold [2, n]
    (G, B + bias; the op makes it from the weights at every call, see ``folded``).
    Inputs: x, ln_weight, ln_bias, weight, bias, then the tile counters (``tile_counters``).
    Weights are passed as views (the bridge caches a tensor's zero-copy view, never a value derived from it)."""
    f32 = torch.float32
    return GraphOp(
        "layernorm_linear_fwd", LIBRARY,
        inputs=(("rows", "k"), ("k",), ("k",), ("n", "k"), ("n",), ("counters",)),
        outputs=(Out(("rows", "n")), Out(("rows",), f32), Out(("rows",), f32), Out(("splits", "part_acc"), f32),
                 Out(("splits", "part_rows"), f32), Out((2, "n"), f32)),
        parameters=(("eps_bits", layernorm.eps_bits(eps)),),
        weights=frozenset({1, 2, 3, 4, 5}),
    )


output_tiles, scratch_sizes = config.output_tiles, config.scratch_sizes


_counters: dict[torch.device, torch.Tensor] = {}
_zero_biases: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


@cache
def fold_op() -> GraphOp:
    """The registered fold: [2, N] float32 (G, B + bias) from weight, ln_weight, ln_bias, bias."""
    return GraphOp("layernorm_linear_fold", LIBRARY, inputs=(("n", "k"), ("k",), ("k",), ("n",)),
                   outputs=(Out((2, "n"), torch.float32),), weights=frozenset({0, 1, 2, 3}))


def folded(weight: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """float32 [2, N]: G = sum_k round(weight * ln_weight) and B = weight @ ln_bias + bias, by the fold kernel
    (FlashNorm's fold; see ``fold_row`` in the .mojo for why G sums the rounded products). The fused op runs
    the same kernel inside itself at every call (the Hopper op its own prep, whose G sums exact products), so no
    fold outlives a weight change; this standalone call is what tests check the kernel by."""
    return fold_op()(*(t.detach() for t in (weight, ln_weight, ln_bias, bias)))[0]


@cache
def sm90_op(eps: float) -> GraphOp:
    """The registered Hopper forward (``layernorm_linear_sm90.mojo``): y [rows, n], mean, rstd [rows]
    (float32), then scratch the op fills at every call from the weights: the fold's bf16 parts (``fold_ext``,
    with G's exact products) [n, 8].
    Inputs: x [rows, k], weight [n, k], ln_weight, ln_bias [k], bias [n]."""
    f32 = torch.float32
    return GraphOp(
        "layernorm_linear_fwd_sm90", LIBRARY,
        inputs=(("rows", "k"), ("n", "k"), ("k",), ("k",), ("n",)),
        outputs=(Out(("rows", "n")), Out(("rows",), f32), Out(("rows",), f32), Out(("n", 8), 1)),
        parameters=(("eps_bits", layernorm.eps_bits(eps)),),
        weights=frozenset({1, 2, 3, 4}),
    )


def fold_ext(fold: torch.Tensor) -> torch.Tensor:
    """G and B + bias [2, N] float32 as bfloat16 [N, 8], per column (G hi, G hi, G mid, B hi,
    B hi, B mid, G hi, B hi) with hi = bf16(v) and mid = bf16(v - hi): the 8 k values of the Hopper
    kernel's fold MMA, whose A fragment holds the rows' -(mean - shift) and 1 / rstd in hi/mid/lo parts,
    so that it adds their products with G and B to the accumulators to 2^-16. The op makes these rows
    itself at every call (``layernorm_linear_wgmma_prep``); this is the reference tests compare it with."""
    hi = fold.to(torch.bfloat16)
    (g_hi, b_hi), (g_mid, b_mid) = hi, (fold - hi.float()).to(torch.bfloat16)
    return torch.stack((g_hi, g_hi, g_mid, b_hi, b_hi, b_mid, g_hi, b_hi), dim=1).contiguous()


@cache
def _sm90_index(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


@torch.compiler.assume_constant_result
def _sm90_traceable(index: int) -> bool:
    """``_sm90_index`` as a constant to torch.compile (its device query would break the graph)."""
    return _sm90_index(index)


@torch.compiler.assume_constant_result
def _sms_traceable(index: int) -> int:
    """The SM count of CUDA device ``index``, a constant to torch.compile."""
    return layernorm.sm_count(torch.device("cuda", index))


def _capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph (never while torch.compile traces: the
    compiled graph keeps the eager choice)."""
    return (not torch.compiler.is_compiling() and torch.cuda.is_available()
            and torch.cuda.is_current_stream_capturing())


def is_sm90(device: torch.device) -> bool:
    """Whether ``device`` is an sm_90 (Hopper) GPU (asked once per device)."""
    return device.type == "cuda" and torch.cuda.is_available() and _sm90_traceable(device.index or 0)


def sm90_unsupported(x2: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why the Hopper kernel cannot take x2 [rows, K] and weight [N, K], or None when it can."""
    if not is_sm90(x2.device):
        return "needs an sm_90 (Hopper) GPU"
    if x2.dtype != torch.bfloat16:
        return f"needs bfloat16, got {x2.dtype}"
    k, n = x2.shape[1], weight.shape[0]
    if k % 8 or n % 8:
        return f"needs K and N multiples of 8 (TMA rows of 16-byte multiples), got K={k}, N={n}"
    if x2.data_ptr() % 16:
        return "needs x 16-byte aligned"
    if weight.data_ptr() % 16:
        return "needs weight 16-byte aligned"
    return None


def algos_for(x2: torch.Tensor, weight: torch.Tensor) -> tuple[str, ...]:
    """The forward algorithms that take x2 [rows, K] and weight [N, K] ("sm90" only where it can)."""
    return tuple(a for a in ALGOS if a != "sm90" or sm90_unsupported(x2, weight) is None)


def sm90_fwd(x2: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Hopper kernel on validated x2 [rows, K] that ``sm90_unsupported`` accepts: y [rows, N], mean, rstd [rows]."""
    y, mean, rstd, _ = sm90_op(float(eps))(x2, weight, ln_weight, ln_bias, bias)
    return y, mean, rstd


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """int32 zeros, at least ``tiles`` long, kept per device: the fp16/bf16 kernel counts each output
    tile's finished k splits there and its last block sets the count back to 0. One tensor object per
    device (grown when too short), so the bridge caches its MAX view like a weight's."""
    have = _counters.get(device)
    if have is None or have.numel() < tiles:
        have = _counters[device] = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
    return have


def fused_splits(rows: int, k: int, n: int, device: torch.device, dtype: torch.dtype = torch.float32) -> int:
    """How many k chunks the fused GPU kernel splits into (1 on the CPU; ``config.split_count`` on a GPU)."""
    if device.type != "cuda":
        return 1
    return config.split_count(rows, k, n, layernorm.sm_count(device), dtype)


def fused_fwd(x2: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor, eps: float, splits: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused kernel on validated x2 [rows, K]: y [rows, N], mean, rstd [rows].

    ``splits`` overrides ``fused_splits`` (benchmark sweeps); it must be >= 1.
    """
    rows, k = x2.shape
    if splits is None:
        splits = fused_splits(rows, k, weight.shape[0], x2.device, x2.dtype)
    elif splits < 1:
        raise ValueError(f"splits: {splits} is not >= 1")
    n = weight.shape[0]
    counters = tile_counters(x2.device, output_tiles(rows, n))
    y, mean, rstd, *_ = fwd_op(float(eps))(x2, ln_weight, ln_bias, weight, bias, counters,
                                           sizes={"splits": splits} | scratch_sizes(rows, n, x2.dtype))
    return y, mean, rstd


def _fused_direct(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor, eps: float, algo: str, picked: str) -> tuple[torch.Tensor, ...] | None:
    """(y, mean, rstd) of the "fused" or "sm90" forward (``picked``, what ``algo`` resolved to) on validated x
    through the C++ entry, handing it the shape's plan first; None for "unfused" (which it does not run) and where
    that route does not run (no C++ library, OPS_ROUTE=graph, a call it does not take): the graph route runs then."""
    if picked == "unfused" or not direct.launches(x):
        return None
    entry = direct.load_native().layernorm_linear_with_stats   # loaded here too: a process may run no LayerNorm
    if entry is None:
        return None
    args = (x, ln_weight, ln_bias, weight, bias, float(eps), ALGO_IDS[algo])
    out = entry(*args)
    if not out:
        _register_fused(x, ln_weight, ln_bias, weight, algo, picked)
        out = entry(*args)
    return tuple(out) if out else None


def _register_fused(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, weight: torch.Tensor, algo: str,
                    picked: str) -> None:
    """Hand the C++ entry the launches of ``picked`` at x's shape and alignment (ops/layernorm_linear_config.py)."""
    k, n = x.shape[-1], weight.shape[0]
    rows, dtype, index = x.numel() // k, x.dtype, x.get_device()
    mask = config.align_mask(x, ln_weight, ln_bias, weight)
    counters = None
    if picked == "sm90":
        plan = config.sm90_plan(rows, k, n, dtype, mask, layernorm.sm_count(x.device))
    else:
        plan = config.fused_plan(rows, k, n, dtype, mask, fused_splits(rows, k, n, x.device, dtype))
        if plan.kind == config.KIND_FUSED16:
            counters = tile_counters(x.device, output_tiles(rows, n))
    kernels = [int(direct.kernel(s.spec, index, s.smem).function) for s in plan.steps]
    layernorm.native_transpose(dtype, index)
    grids = [g for s in plan.steps for g in s.grid]
    direct.remember(("fused", rows, k, n, dtype, index, ALGO_IDS[algo], mask), lambda native: native.set_fused_plan(
        rows, k, n, dtype, index, ALGO_IDS[algo], mask, plan.kind, kernels, grids, [s.block for s in plan.steps],
        [s.smem for s in plan.steps], list(plan.sizes), counters, _zero_bias(weight)))


def validate(x: object, ln_weight: object, ln_bias: object, weight: object, bias: object | None) -> None:
    """Raise ValueError/TypeError naming the first bad argument (bias None: not checked). Strided or empty x
    and float32 LayerNorm parameters with 16-bit x pass (the entries adapt them); the Linear's weight and bias
    must have x's dtype, as ``torch.nn.Linear`` needs outside autocast."""
    if layernorm._valid(x, ln_weight, ln_bias) and _valid_linear(x, weight, bias):
        return
    check_tensor("x", x, min_ndim=1, dtypes=DTYPES, layout=False)
    layernorm.validate(x, ln_weight, ln_bias, names=("x", "ln_weight", "ln_bias"))
    _check_linear(x, weight, bias, same_dtype=True)


def _check_linear(x: torch.Tensor, weight: object, bias: object | None, same_dtype: bool,
                  by_torch: bool = False) -> None:
    """The Linear's named checks: weight [N, K] and bias [N] (or None) on x's device, of x's dtype unless
    ``same_dtype`` is False (autocast casts them); ``by_torch``: for a call torch's ops answer (float64 and the
    meta device taken)."""
    named = {"weight": weight}
    kw = layernorm.TORCH_TAKES if by_torch else {"dtypes": DTYPES}
    check_tensor("weight", weight, ndim=2, layout=False, **kw)
    if bias is not None:
        check_tensor("bias", bias, ndim=1, layout=False, **kw)
        named["bias"] = bias
    for name, t in named.items():
        if t.device != x.device or (same_dtype and t.dtype != x.dtype):
            check_same({"x": x, name: t})
    check_size("weight", weight, 1, layernorm.last_size(x), "x's last dim")
    if not by_torch:
        check_int32_rows("weight", weight)
    if bias is not None:
        check_size("bias", bias, 0, weight.shape[0], "weight's rows (out features)")


def _adapted_fwd(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, ...] | None:
    """For validated arguments the kernels do not take as they come: (x, ln_weight, ln_bias, weight, bias) made
    contiguous and the LayerNorm parameters in x's dtype (``layernorm.adapt``); or None for empty x, K = 0 or
    N = 0, which torch answers (the caller's ``_empty_result``)."""
    if x.numel() == 0 or weight.numel() == 0:
        return None
    x, ln_weight, ln_bias = layernorm.adapt(x, ln_weight, ln_bias)
    return x, ln_weight, ln_bias, weight.contiguous(), None if bias is None else bias.contiguous()


def _empty_result(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Linear(LayerNorm(x)) by torch where there is nothing to compute (no rows, K = 0 or N = 0): its shapes,
    its values (bias where K = 0) and, with autograd, its zero gradients."""
    xn = torch.nn.functional.layer_norm(x, x.shape[-1:], ln_weight.to(x.dtype), ln_bias.to(x.dtype), eps)
    return torch.nn.functional.linear(xn, weight, bias)


def _valid_linear(x: torch.Tensor, weight: object, bias: object | None) -> bool:
    """The common case of the Linear's checks in few attribute reads (``validate`` names what is wrong)."""
    try:
        return (weight.dtype is x.dtype and weight.device == x.device and weight.dim() == 2
                and weight.shape[1] == x.shape[-1] and 0 < weight.shape[0] <= INT32_MAX and weight.is_contiguous()
                and isinstance(weight, torch.Tensor)
                and (bias is None or (bias.dtype is x.dtype and bias.device == x.device and bias.dim() == 1
                                      and bias.shape[0] == weight.shape[0] and bias.is_contiguous()
                                      and isinstance(bias, torch.Tensor))))
    except (AttributeError, TypeError, RuntimeError):   # RuntimeError: a sparse tensor's is_contiguous
        return False


def pick_algo(algo: str, device: torch.device, dtype: torch.dtype, rows: int, n: int, k: int = 0,
              captured: bool | None = None) -> str:
    """The forward algorithm ``auto`` resolves to (see the module docstring), under CUDA graph capture
    (``config.sm90_region``) where ``captured`` says so (None: whether the current stream is being captured)."""
    check_algo(algo)
    if algo != "auto":
        return algo
    if device.type != "cuda":
        return "unfused"
    if captured is None:
        captured = _capturing()
    if dtype == torch.bfloat16 and is_sm90(device) and sm90_region(rows, n, k, _sms_traceable(device.index or 0),
                                                                    captured):
        return "sm90"
    return "fused" if config.fused_region(dtype, rows, n, k) else "unfused"


def check_algo(algo: str) -> None:
    """``algo`` must be one of ``ALGOS``."""
    if algo not in ALGOS:
        raise ValueError(f"algo: {algo!r} is not one of {list(ALGOS)}")


def _zero_bias(weight: object) -> torch.Tensor:
    """bias = 0 [N] for a Linear without bias (weight checked first, so a bad one is named). One zero tensor
    per (N, dtype, device), never written: it depends on no tensor's values, so it cannot go stale."""
    check_tensor("weight", weight, ndim=2, dtypes=DTYPES, layout=False)
    key = (weight.shape[0], weight.dtype, weight.device)
    zeros = _zero_biases.get(key)
    if zeros is None:
        zeros = _zero_biases[key] = weight.new_zeros(weight.shape[0])
    return zeros


def layernorm_linear_fwd(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, eps: float = 1e-5, algo: str = "auto"
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward alone, with the statistics the backward takes (no autograd).

    Args:
        x: the input ``[..., K]``, float32, float16 or bfloat16, on the CPU or a CUDA GPU; any layout.
        ln_weight, ln_bias: the LayerNorm's gamma and beta ``[K]``, x's dtype (or float32 for 16-bit x).
        weight: the Linear's ``[N, K]``, x's dtype.
        bias: the Linear's ``[N]``, or None.
        eps: the LayerNorm's (any float, as torch takes).
        algo: ``"auto"``, ``"fused"``, ``"sm90"`` or ``"unfused"`` (the module docstring).

    Shape:
        x: ``[..., K]``; y: ``[..., N]``; mean, rstd: ``[...]``.

    Returns:
        (y, mean, rstd): y in x's dtype, the LayerNorm's mean and rstd float32.

    Raises:
        TypeError: a non-tensor, an unsupported dtype or an eps that is not a number, named.
        ValueError: sizes, dtypes or devices that do not match, an unknown algo, or ``"sm90"`` where
            the Hopper kernel cannot run (the message says why).

    Example:
        >>> x, g, b, w = torch.randn(4, 8), torch.ones(8), torch.zeros(8), torch.randn(3, 8)
        >>> y, mean, rstd = layernorm_linear_fwd(x, g, b, w)
    """
    if layernorm.torch_answers(x, ln_weight, ln_bias, weight, bias):   # as in layernorm.layernorm_fwd
        validate(x, ln_weight, ln_bias, weight, bias)
        layernorm.as_eps(eps)
        check_algo(algo)
        bias = weight.new_zeros(weight.shape[0]) if bias is None else bias   # not _zero_bias's: no fake kept
        return tuple(torch.ops.mojo.layernorm_linear_fwd(x, ln_weight, ln_bias, weight, bias, float(eps), algo))
    bias = _zero_bias(weight) if bias is None else bias
    validate(x, ln_weight, ln_bias, weight, bias)
    eps = layernorm.as_eps(eps)
    if not (layernorm._valid(x, ln_weight, ln_bias) and _valid_linear(x, weight, bias)):
        if (adapted := _adapted_fwd(x, ln_weight, ln_bias, weight, bias, eps)) is None:
            pick_algo(algo, x.device, x.dtype, 1, 1)   # a bad algo is named here too
            _, mean, rstd = layernorm.layernorm_fwd(x, ln_weight, ln_bias, eps)
            return _empty_result(x, ln_weight, ln_bias, weight, bias, eps), mean, rstd
        x, ln_weight, ln_bias, weight, bias = adapted
    k, n = x.shape[-1], weight.shape[0]
    picked = pick_algo(algo, x.device, x.dtype, x.numel() // k, n, k)
    if picked == "unfused":
        xn, mean, rstd = layernorm.layernorm_fwd(x, ln_weight, ln_bias, eps)
        return _linear(xn, weight, bias), mean, rstd
    x2 = x.view(-1, k)
    if picked == "sm90" and (why := sm90_unsupported(x2, weight)) is not None:
        if algo != "auto":
            raise ValueError(f"algo: 'sm90' {why}")
        picked = "unfused"   # auto never raises: an x or weight view off 16-byte alignment takes cuBLAS
    if (out := _fused_direct(x, ln_weight, ln_bias, weight, bias, eps, algo, picked)) is not None:
        return out
    if picked == "fused":
        y, mean, rstd = fused_fwd(x2, ln_weight, ln_bias, weight, bias, eps)
    elif picked == "sm90":
        y, mean, rstd = sm90_fwd(x2, ln_weight, ln_bias, weight, bias, eps)
    else:
        xn, mean, rstd = layernorm.layernorm_fwd(x2, ln_weight, ln_bias, eps)
        y = _linear(xn, weight, bias)
    return y.view(*x.shape[:-1], n), mean.view(x.shape[:-1]), rstd.view(x.shape[:-1])


def layernorm_linear_bwd(dy: torch.Tensor, x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
                         weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, eps: float = 1e-5,
                         xn: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """All five gradients from ``layernorm_linear_fwd``'s statistics (deterministic).

    Args:
        dy: the gradient of y, ``[..., N]``, x's dtype.
        x, ln_weight, ln_bias, weight: the forward's inputs (the backward never reads the Linear's bias).
        mean, rstd: the forward's statistics, float32 ``[...]``.
        eps: the forward's (used to recompute xn).
        xn: LayerNorm(x) ``[..., K]`` if the caller kept it; else it is recomputed.

    Shape:
        dy: ``[..., N]``; dx: ``[..., K]``; dln_weight, dln_bias: ``[K]``; dweight: ``[N, K]``; dbias: ``[N]``.

    Returns:
        (dx, dln_weight, dln_bias, dweight, dbias), each in its input's dtype.

    Raises:
        TypeError, ValueError: as ``layernorm_linear_fwd``, and for a dy or statistics of the wrong dtype or
            shape.

    Example:
        >>> x, g, b, w = torch.randn(4, 8), torch.ones(8), torch.zeros(8), torch.randn(3, 8)
        >>> y, mean, rstd = layernorm_linear_fwd(x, g, b, w)
        >>> dx, dg, db, dw, dbias = layernorm_linear_bwd(torch.ones_like(y), x, g, b, w, mean, rstd)
    """
    validate(x, ln_weight, ln_bias, weight, None)  # the backward never reads bias
    check_tensor("dy", dy, min_ndim=1, dtypes=DTYPES, layout=False)
    check_same({"x": x, "dy": dy})
    if dy.shape != (*x.shape[:-1], weight.shape[0]):
        raise ValueError(f"dy: shape {tuple(dy.shape)} does not match y {(*x.shape[:-1], weight.shape[0])}")
    if xn is not None:
        check_tensor("xn", xn, dtypes=DTYPES, layout=False)
        check_same({"x": x, "xn": xn})
        if xn.shape != x.shape:
            raise ValueError(f"xn: shape {tuple(xn.shape)} does not match x {tuple(x.shape)}")
    if layernorm.torch_answers(dy, x, ln_weight, ln_bias, weight, mean, rstd, xn):   # as in layernorm_linear_fwd
        if xn is None:
            xn = torch.ops.mojo.layernorm_fwd(x, ln_weight, ln_bias, layernorm.as_eps(eps), "fast", "none")[0]
        return tuple(torch.ops.mojo.layernorm_linear_bwd(dy, x, xn, ln_weight, ln_bias, weight, mean, rstd))
    if not (layernorm._valid(x, ln_weight, ln_bias) and _valid_linear(x, weight, None) and dy.is_contiguous()
            and mean.is_contiguous() and rstd.is_contiguous() and (xn is None or xn.is_contiguous())):
        return _adapted_bwd(dy, x, ln_weight, ln_bias, weight, mean, rstd, eps, xn)
    k = x.shape[-1]
    x2 = x.view(-1, k)
    if xn is None:
        xn = layernorm.layernorm_fwd(x2, ln_weight, ln_bias, eps)[0]
    dxn, dweight, dbias = _linear_grads(dy, xn.view(-1, k), weight)
    dx, dln_weight, dln_bias = layernorm.layernorm_bwd(dxn, x2, ln_weight, ln_bias, mean.view(-1), rstd.view(-1))
    return dx.view(x.shape), dln_weight, dln_bias, dweight, dbias


def _adapted_bwd(dy: torch.Tensor, x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
                 weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, eps: float,
                 xn: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """``layernorm_linear_bwd`` of validated arguments the kernels do not take as they come: empty ones answered
    as torch's autograd answers them (zeros; dbias the sum of dy), the rest adapted as the forward's are; the
    LayerNorm parameters' gradients in their own dtypes."""
    if x.numel() == 0 or weight.numel() == 0:
        return (torch.zeros_like(x), torch.zeros_like(ln_weight), torch.zeros_like(ln_bias), torch.zeros_like(weight),
                dy.sum(tuple(range(dy.dim() - 1))) if dy.dim() > 1 else dy.clone())
    x2, lnw, lnb = layernorm.adapt(x, ln_weight, ln_bias)
    dx, dlnw, dlnb, dweight, dbias = layernorm_linear_bwd(
        dy.contiguous(), x2, lnw, lnb, weight.contiguous(), mean.contiguous(), rstd.contiguous(), eps,
        None if xn is None else xn.contiguous())
    return dx, dlnw.to(ln_weight.dtype), dlnb.to(ln_bias.dtype), dweight, dbias


def _linear(xn: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The unfused route's Linear: on a CUDA GPU the C++ entry's (cuBLASLt with the bias in its epilogue, the GEMM
    the C++ route runs), else ``F.linear``; ``F.linear`` too where autograd is to record it."""
    native = direct.NATIVE.linear
    if (native is None or not xn.is_cuda or torch.compiler.is_compiling()
            or (torch.is_grad_enabled() and (xn.requires_grad or weight.requires_grad
                                             or (bias is not None and bias.requires_grad)))):
        return torch.nn.functional.linear(xn, weight, bias)
    return native(xn, weight, bias)


def _linear_grads(dy: torch.Tensor, xn: torch.Tensor, weight: torch.Tensor, bias_grad: bool = True,
                  weight_grad: bool = True) -> tuple[torch.Tensor | None, ...]:
    """The Linear's part of every backward path: from contiguous dy [..., N] and xn [..., K], dxn = dy W (shaped
    like xn), dW = dy^T xn (None, and no GEMM, without ``weight_grad``) and db = dy's column sums (None without
    ``bias_grad``); on a CUDA GPU by the C++ entry (ops/launch/direct.cpp's linear_grads: cuBLASLt, db in dW's
    epilogue, as the C++ route's backward runs them), else (and under torch.compile, for inductor) by torch's ops."""
    native = direct.NATIVE.linear_grads
    if native is not None and dy.is_cuda and not torch.compiler.is_compiling():
        dxn, dweight, *dbias = native(dy, xn, weight, bias_grad, weight_grad)
        return dxn, dweight if weight_grad else None, dbias[0] if dbias else None
    n, k = weight.shape
    dy2 = dy.view(-1, n)
    return ((dy2 @ weight).view(xn.shape), dy2.T @ xn.reshape(-1, k) if weight_grad else None,
            dy2.sum(0) if bias_grad else None)


# ---------------------------------------------------------------- torch.library

@torch.library.custom_op("mojo::layernorm_linear_fwd", mutates_args=())
def _fwd_custom(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor, eps: float, algo: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return layernorm_linear_fwd(x, ln_weight, ln_bias, weight, bias, eps, algo)


@_fwd_custom.register_fake
def _(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, weight: torch.Tensor,
      bias: torch.Tensor, eps: float, algo: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return x.new_empty(*x.shape[:-1], weight.shape[0]), stats, torch.empty_like(stats)


@torch.library.custom_op("mojo::layernorm_linear_bwd", mutates_args=())
def _bwd_custom(dy: torch.Tensor, x: torch.Tensor, xn: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
                weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return layernorm_linear_bwd(dy, x, ln_weight, ln_bias, weight, mean, rstd, xn=xn)


@_bwd_custom.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, xn: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
      weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (torch.empty_like(x), torch.empty_like(ln_weight), torch.empty_like(ln_bias),
            torch.empty_like(weight), weight.new_empty(weight.shape[0]))


# ---------------------------------------------------------------- autograd and nn.Module

class LayerNormLinearFunction(torch.autograd.Function):
    """Autograd for Linear(LayerNorm(x)): gradients for x, ln_weight, ln_bias, weight and bias."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, ln_weight: torch.Tensor,
                ln_bias: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                algo: str) -> torch.Tensor:
        xn = None
        ctx.has_bias = bias is not None
        rows = x.numel() // max(x.shape[-1], 1)
        picked = pick_algo(algo, x.device, x.dtype, rows, weight.shape[0], x.shape[-1])
        ctx.eps = eps
        compiling = torch.compiler.is_compiling()
        if picked == "unfused" and direct.launches(x):
            # Eager on a GPU: our LayerNorm launched directly (its statistics in one buffer), then cuBLAS;
            # xn is kept for dW as torch's own autograd keeps it.
            validate(x, ln_weight, ln_bias, weight, bias)
            layernorm.as_eps(eps)
            stats, mean, rstd = layernorm._stats(x)
            xn = layernorm._fwd_direct(x, ln_weight, ln_bias, float(eps), "fast", 0, mean, rstd)
            ctx.save_for_backward(x, xn, ln_weight, ln_bias, weight, stats)
            return _linear(xn, weight, bias)
        # Otherwise the validated calls (torch.compile: the custom ops standing in for them).
        if picked == "unfused":
            validate(x, ln_weight, ln_bias, weight, bias)
            xn, mean, rstd = layernorm.fwd_call(x, ln_weight, ln_bias, eps)
            y = _linear(xn, weight, bias)
        else:
            # algo itself, so that auto's own fallbacks (layernorm_linear_fwd) still apply
            fwd = torch.ops.mojo.layernorm_linear_fwd if compiling else layernorm_linear_fwd
            y, mean, rstd = fwd(x, ln_weight, ln_bias, weight, _zero_bias(weight) if bias is None else bias, eps, algo)
        ctx.save_for_backward(x, xn, ln_weight, ln_bias, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor) -> tuple:
        x, xn, ln_weight, ln_bias, weight, *stats = ctx.saved_tensors
        if layernorm.create_graph():   # as in layernorm.LayerNormFunction; dbias = dy's column sums
            y = torch.nn.functional.linear(torch.nn.functional.layer_norm(x, x.shape[-1:], ln_weight, ln_bias,
                                                                          ctx.eps), weight)
            grads = layernorm.differentiable_grads(ctx, y, (x, ln_weight, ln_bias, weight), dy)
            dbias = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[4] else None
            return (*grads, dbias, None, None)
        dy = dy.contiguous()
        if len(stats) == 1:   # the eager GPU forward's one statistics buffer
            if not layernorm.kernels_cannot_read(dy):
                return (*_bwd_direct(dy, x, xn, ln_weight, ln_bias, weight, stats[0], *_linear_wants(ctx)),
                        None, None)
            stats = layernorm.stat_views(stats[0], x)   # a batched dy: the checked entry, as below
        mean, rstd = stats
        if xn is None:
            xn = layernorm.fwd_call(x, ln_weight, ln_bias, ctx.eps)[0]
        if torch.compiler.is_compiling():
            # the backward as torch ops (cuBLAS GEMMs inductor sees) and our LayerNorm backward's op
            dxn, dweight, dbias = _linear_grads(dy, xn, weight, *_linear_wants(ctx))
            grads = (*layernorm.bwd_call(dxn, x, ln_weight, ln_bias, mean, rstd), dweight, dbias)
        else:
            grads = layernorm_linear_bwd(dy, x, ln_weight, ln_bias, weight, mean, rstd, xn=xn)
        return (*grads[:4], grads[4] if ctx.has_bias else None, None, None)


def _linear_wants(ctx: torch.autograd.function.FunctionCtx) -> tuple[bool, bool]:
    """(bias_grad, weight_grad) for ``_linear_grads`` in LayerNormLinearFunction's backward: the bias' gradient where
    there is a bias that wants one, the weight's where it wants one (a frozen weight: no dW GEMM)."""
    return ctx.has_bias and ctx.needs_input_grad[4], ctx.needs_input_grad[3]


def _bwd_direct(dy: torch.Tensor, x: torch.Tensor, xn: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
                weight: torch.Tensor, stats: torch.Tensor, bias_grad: bool,
                weight_grad: bool) -> tuple[torch.Tensor | None, ...]:
    """The backward of the eager GPU forward: the Linear's gradients (``_linear_grads``; db only with
    ``bias_grad``, dW only with ``weight_grad``), then our LayerNorm backward launched directly on the saved
    statistics."""
    check_grad("dy", dy, x.dtype, (*x.shape[:-1], weight.shape[0]), "y")
    dxn, dweight, dbias = _linear_grads(dy, xn, weight, bias_grad, weight_grad)
    dx, dln_weight, dln_bias = layernorm._bwd_direct(dxn, x, ln_weight, ln_bias, *layernorm.stat_addresses(stats), 0)
    return dx, dln_weight, dln_bias, dweight, dbias


def autograd_algo(algo: str, tensors: tuple[object, ...]) -> str:
    """The algo the autograd forward runs on x = ``tensors[0]``: ``config.training_algo`` where a gradient will
    be taken, else ``algo`` (auto then picks as in inference)."""
    x = tensors[0]
    if (isinstance(x, torch.Tensor) and torch.is_grad_enabled()
            and any(getattr(t, "requires_grad", False) for t in tensors)):
        return config.training_algo(algo, x.dtype)
    return algo


def layernorm_linear(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None, eps: float = 1e-5, algo: str = "auto") -> torch.Tensor:
    """Linear(LayerNorm(x)) with autograd for all five inputs (the call ``FusedLayerNormLinear`` makes).

    Args:
        x: the input ``[..., K]``, float32, float16 or bfloat16, on the CPU or a CUDA GPU; any layout.
        ln_weight, ln_bias: the LayerNorm's gamma and beta ``[K]``, x's dtype (or float32 for 16-bit x).
        weight: the Linear's ``[N, K]``; bias: its ``[N]`` or None.
        eps: the LayerNorm's (any float, as torch takes).
        algo: the forward algorithm; with gradients to come, 16-bit ``"auto"`` runs ``"unfused"``
            (``autograd_algo``).

    Shape:
        x: ``[..., K]``; output: ``[..., N]``.

    Returns:
        Linear(LayerNorm(x)) in x's dtype (under CUDA autocast, what the torch modules give).

    Raises:
        TypeError, ValueError: as ``layernorm_linear_fwd`` (named), in the forward and the backward.

    Example:
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> y = layernorm_linear(x, torch.ones(8), torch.zeros(8), torch.randn(3, 8), torch.zeros(3))
        >>> y.sum().backward()
    """
    native = layernorm.native_entry("layernorm_linear")
    if (native is not None and isinstance(x, torch.Tensor) and isinstance(ln_weight, torch.Tensor)
            and isinstance(ln_bias, torch.Tensor) and isinstance(weight, torch.Tensor)
            and (bias is None or isinstance(bias, torch.Tensor)) and eps.__class__ is float and algo in ALGO_IDS
            and not x.is_nested):
        y = native(x, ln_weight, ln_bias, weight, bias, eps, ALGO_IDS[algo])
        if y is not None:   # None: a call the C++ entry does not take (see ops/launch/direct.cpp)
            return y
    eps = layernorm.as_eps(eps)
    tensors = (x, ln_weight, ln_bias, weight, bias)
    if layernorm.torch_answers(*tensors):
        return torch_layernorm_linear(*tensors, eps, algo)
    if not (layernorm._valid(x, ln_weight, ln_bias) and _valid_linear(x, weight, bias)) or torch.is_autocast_enabled(
            x.device.type):
        return _layernorm_linear_adapted(x, ln_weight, ln_bias, weight, bias, eps, algo)
    if torch.compiler.is_compiling():
        return _traced(x, ln_weight, ln_bias, weight, bias, eps, algo)
    if not (isinstance(x, torch.Tensor) and direct.launches(x)):
        return LayerNormLinearFunction.apply(*tensors, eps, autograd_algo(algo, tensors))
    if not layernorm.no_grad_to_come(*tensors):
        runs = autograd_algo(algo, tensors)
        y = LayerNormLinearFunction.apply(*tensors, eps, runs)
        _remember_algo(x, weight, algo, True, runs)
        return y
    # No gradient to come (inference): no autograd node, and the unfused path keeps no statistics.
    validate(*tensors)
    k = x.shape[-1]
    picked = pick_algo(algo, x.device, x.dtype, x.numel() // k, weight.shape[0], k)
    _remember_algo(x, weight, algo, False, algo)
    if picked != "unfused":
        return layernorm_linear_fwd(*tensors, eps, algo)[0]
    xn = layernorm._fwd_direct(x, ln_weight, ln_bias, float(eps), "fast", 0)
    return _linear(xn, weight, bias)


def torch_layernorm_linear(x: torch.Tensor, ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None,
                           weight: torch.Tensor, bias: torch.Tensor | None, eps: float, algo: str) -> torch.Tensor:
    """Linear(LayerNorm(x)) by torch's ops, for a call ``layernorm.torch_answers`` sends here: the named checks
    first, float64 and the meta device taken."""
    xn = layernorm.torch_layernorm(x, ln_weight, ln_bias, eps, "none", names=("x", "ln_weight", "ln_bias"))
    _check_linear(x, weight, bias, same_dtype=x.is_meta or not torch.is_autocast_enabled(x.device.type),
                  by_torch=True)
    check_algo(algo)
    return torch.nn.functional.linear(xn, weight, bias)


def _layernorm_linear_adapted(x: object, ln_weight: object, ln_bias: object, weight: object, bias: object,
                              eps: float, algo: str) -> torch.Tensor:
    """``layernorm_linear`` of what the kernels do not take as it comes, answered as torch's
    ``nn.Sequential(nn.LayerNorm, nn.Linear)`` answers it: under autocast our LayerNorm under torch's policy for
    it, then ``F.linear`` under autocast's; empty ones by torch (``_empty_result``); strided x and float32
    LayerNorm parameters of 16-bit x adapted. Anything else gets ``validate``'s named error."""
    if isinstance(x, torch.Tensor) and torch.is_autocast_enabled(x.device.type):
        layernorm.validate(x, ln_weight, ln_bias, names=("x", "ln_weight", "ln_bias"))
        _check_linear(x, weight, bias, same_dtype=False)
        pick_algo(algo, x.device, x.dtype, 1, 1)
        return torch.nn.functional.linear(layernorm.layernorm(x, ln_weight, ln_bias, eps), weight, bias)
    validate(x, ln_weight, ln_bias, weight, bias)
    pick_algo(algo, x.device, x.dtype, 1, 1)
    if (adapted := _adapted_fwd(x, ln_weight, ln_bias, weight, bias, eps)) is None:
        return _empty_result(x, ln_weight, ln_bias, weight, bias, eps)
    return layernorm_linear(*adapted, eps, algo)


def _traced(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor | None, eps: float, algo: str) -> torch.Tensor:
    """``layernorm_linear`` of valid inputs as torch.compile traces it. Unfused: the LayerNorm as
    ``layernorm.compiled_layernorm`` holds it, then the C++ op ``mojo_direct.linear`` without a gradient to come
    (the eager route's cuBLASLt plan: no heuristics query per call, as torch's addmm makes), with one
    ``mojo_direct.traced_linear`` (the same GEMM, its backward the C++ ``linear_grads``) where
    ``config.COMPILED_TRAINING_LINEAR`` is "ours" or, as a mark, for ``layernorm_linear_inductor``'s pass (a tanh
    GELU after it goes into the GEMM, other marks become ``F.linear``) where the training form
    (``config.compiled_training_form``) is "inductor", else ``F.linear`` (float32 always); with the form "ours", the
    whole of it as the C++ op ``traced_layernorm_linear``. Fused and Hopper: with a gradient to come, the autograd
    function around our ops; without, our forward alone."""
    tensors = (x, ln_weight, ln_bias, weight, bias)
    grad = not layernorm.no_grad_to_come(*tensors)
    runs = autograd_algo(algo, tensors) if grad else algo
    validate(*tensors)
    k = x.shape[-1]
    rows = x.numel() // k
    if pick_algo(runs, x.device, x.dtype, rows, weight.shape[0], k) == "unfused":
        form = config.compiled_training_form(rows) if grad else None
        if form == "ours" and _layernorm_linear_traced(x, ln_weight, ln_bias):
            _gelu_epilogue_pass_on()   # a tanh GELU after it goes into the GEMM (act 1)
            return torch.ops.mojo_direct.traced_layernorm_linear(x, ln_weight, ln_bias, weight, bias, eps)
        form = "inductor" if form == "ours" else form   # where the one op does not take these inputs
        xn = layernorm.compiled_layernorm(x, ln_weight, ln_bias, eps)
        if x.is_cuda and _native_linear_traceable():
            if not grad:
                _gelu_epilogue_pass_on()
                return torch.ops.mojo_direct.linear(xn, weight, bias)
            if x.dtype != torch.float32 and (config.COMPILED_TRAINING_LINEAR == "ours"
                                             or (form == "inductor" and _gelu_epilogue_pass_on())):
                # with the pass, a mark: gelu(traced_linear) becomes traced_linear_gelu, traced_linear F.linear
                return torch.ops.mojo_direct.traced_linear(xn, weight, bias)
        return torch.nn.functional.linear(xn, weight, bias)
    if grad:
        return LayerNormLinearFunction.apply(*tensors, eps, runs)
    if x.is_cuda and _native_linear_traceable():
        _gelu_epilogue_pass_on()   # a tanh GELU after it: the pass's unfused form (layernorm_linear_inductor)
        # the C++ op: no Python per call in the compiled graph
        return torch.ops.mojo_direct.layernorm_linear_infer(x, ln_weight, ln_bias, weight, bias, eps, ALGO_IDS[algo])
    bias = _zero_bias(weight) if bias is None else bias
    return torch.ops.mojo.layernorm_linear_fwd(x, ln_weight, ln_bias, weight, bias, eps, algo)[0]


def _layernorm_linear_traced(x: torch.Tensor, ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None) -> bool:
    """Whether a training graph whose form (``config.compiled_training_form``, read in the traced code, so that
    dynamo guards on the knobs) is "ours" may hold the unfused LayerNorm+Linear as the C++ op
    ``traced_layernorm_linear``: 16-bit CUDA x, both LayerNorm parameters, and the C++ ops loaded."""
    return (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and ln_weight is not None
            and ln_bias is not None and _native_linear_traceable())


@torch.compiler.assume_constant_result
def _native_linear_traceable() -> bool:
    """Whether the C++ ops ``mojo_direct::layernorm_linear_infer``, ``linear``, ``traced_linear`` (with its
    autograd kernel: ``linear_grads``) and ``linear_grads`` are loaded, with their fakes for tracing (and the
    LayerNorm's, which these graphs may hold too)."""
    return layernorm._native_ops_traceable() and direct.traceable(
        {"layernorm_linear_infer": _fake_infer, "linear": _fake_linear, "traced_linear": _fake_linear,
         "linear_gelu": _fake_linear, "traced_linear_gelu": _fake_traced_linear_gelu,
         "linear_gelu_aux": _fake_linear_gelu_aux, "linear_grads": _fake_linear_grads,
         "linear_gelu_grads": _fake_linear_gelu_grads, "traced_layernorm_linear": _fake_traced_layernorm_linear,
         "layernorm_linear_train_fwd": _fake_layernorm_linear_train_fwd,
         "layernorm_linear_grads": _fake_layernorm_linear_grads})


def _gelu_epilogue_pass_on() -> bool:
    """Whether ``layernorm_linear_inductor``'s pass will rewrite this graph: ``config.COMPILED_LINEAR_GELU`` (read
    in the traced code, so that dynamo guards on it) and the pass installed (``_install_gelu_epilogue_pass``)."""
    return config.COMPILED_LINEAR_GELU and _install_gelu_epilogue_pass()


@torch.compiler.assume_constant_result
def _install_gelu_epilogue_pass() -> bool:
    """Install ``layernorm_linear_inductor``'s pass (a tanh GELU after our Linear into its GEMM's epilogue; False
    where another pre-grad pass holds its place), run where dynamo traces the call, not traced."""
    from ops import layernorm_linear_inductor

    return layernorm_linear_inductor.install()


def _fake_infer(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, eps: float, algo: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _fake_linear(xn: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return xn.new_empty(*xn.shape[:-1], weight.shape[0])


def _fake_traced_linear_gelu(xn: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             bias_grad_in_gemm: bool = True) -> torch.Tensor:
    return _fake_linear(xn, weight, bias)


def _fake_linear_grads(dy: torch.Tensor, xn: torch.Tensor, weight: torch.Tensor, bias_grad: bool,
                       weight_grad: bool = True) -> list:
    grads = [xn.new_empty(xn.shape), weight.new_empty(weight.shape if weight_grad else (0,))]
    return [*grads, weight.new_empty(weight.shape[0])] if bias_grad else grads


def _fake_linear_gelu_aux(xn: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return _fake_linear(xn, weight, bias), _fake_linear(xn, weight, bias)


def _fake_linear_gelu_grads(dy: torch.Tensor, xn: torch.Tensor, weight: torch.Tensor, h: torch.Tensor,
                            bias_grad: bool, weight_grad: bool = True) -> list:
    return _fake_linear_grads(dy, xn, weight, bias_grad, weight_grad)


def _fake_traced_layernorm_linear(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
                                  weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                                  act: int = 0) -> torch.Tensor:
    return _fake_linear(x, weight, bias)


def _fake_layernorm_linear_train_fwd(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
                                     weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                                     act: int) -> tuple:
    stats = x.new_empty(x.shape[:-1], dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
    h = _fake_linear(x, weight, bias) if act == 1 else x.new_empty(0)
    return _fake_linear(x, weight, bias), x.new_empty(x.shape), stats, torch.empty_like(stats), h


def _fake_layernorm_linear_grads(dy: torch.Tensor, x: torch.Tensor, xn: torch.Tensor, ln_weight: torch.Tensor,
                                 ln_bias: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                                 h: torch.Tensor, act: int, bias_grad: bool, weight_grad: bool = True) -> list:
    return [x.new_empty(x.shape), ln_weight.new_empty(ln_weight.shape), ln_bias.new_empty(ln_bias.shape),
            *_fake_linear_grads(dy, xn, weight, bias_grad, weight_grad)[1:]]


def _remember_algo(x: torch.Tensor, weight: torch.Tensor, algo: str, grad: bool, runs: str) -> None:
    """Tell the C++ entry whether ``algo`` on this shape (with or without a gradient to come), running ``runs``,
    resolves to "unfused", the one it runs (ops/launch/direct.py: remember), under graph capture and outside it
    alike: so a captured call after eager ones takes the C++ entry, as an eager call after captured ones does."""
    k, n = x.shape[-1], weight.shape[0]
    rows, dtype, index, code = x.numel() // k, x.dtype, x.get_device(), ALGO_IDS.get(algo, -1)
    device = x.device
    for captured in (False, True):
        direct.remember(("linear", rows, k, n, dtype, index, code, grad, captured),
                        lambda native, c=captured: native.set_linear_algo(
                            rows, k, n, dtype, index, code, grad, c,
                            pick_algo(runs, device, dtype, rows, n, k, c) == "unfused"))


class FusedLayerNormLinear(nn.Sequential):
    """Drop-in for ``nn.Sequential(nn.LayerNorm(K), nn.Linear(K, N))`` on our kernels: the same submodules, so its
    state dict loads; the forward runs ``layernorm_linear``.

    Args:
        in_features, out_features: K and N.
        eps: the LayerNorm's.
        bias: whether the Linear has a bias (``nn.Linear``'s ``bias``).
        device, dtype: of the parameters.
        algo: the forward algorithm (``ALGOS``; see the module docstring).
        elementwise_affine, norm_bias: the LayerNorm's ``elementwise_affine`` and ``bias``.
        normalized_shape: the LayerNorm's, when it normalizes more than the last dim (its last entry must be K);
            such a module runs our LayerNorm, then ``F.linear``.

    Shape:
        input ``[*, K]`` (``[*, *normalized_shape]``), any layout; output ``[*, N]``.

    Returns:
        ``forward(x)``: Linear(LayerNorm(x)) in x's dtype (under CUDA autocast, what the torch modules give).

    Raises:
        TypeError, ValueError: from ``forward``, for an input ``layernorm_linear`` refuses (named).

    Example:
        >>> m = FusedLayerNormLinear(768, 3072)
        >>> y = m(torch.randn(8, 512, 768))
    """

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, bias: bool = True,
                 device: torch.device | None = None, dtype: torch.dtype | None = None, algo: str = "auto", *,
                 elementwise_affine: bool = True, norm_bias: bool = True,
                 normalized_shape: int | tuple[int, ...] | None = None) -> None:
        kw = {"device": device, "dtype": dtype}
        in_features, out_features = as_size("in_features", in_features), as_size("out_features", out_features)
        shape = (in_features,) if normalized_shape is None else layernorm.as_shape(normalized_shape)
        super().__init__(nn.LayerNorm(shape, layernorm.as_eps(eps), elementwise_affine, norm_bias, **kw),
                         nn.Linear(in_features, out_features, bias, **kw))
        if shape[-1] != in_features:
            raise ValueError(f"normalized_shape: its last entry must be in_features ({in_features}), got {shape}")
        pick_algo(algo, torch.device("cpu"), torch.float32, 1, out_features)  # reject a bad name now
        self.algo = algo

    @classmethod
    def from_torch(cls, seq: nn.Sequential, algo: str = "auto") -> FusedLayerNormLinear:
        """Ours in place of ``nn.Sequential(nn.LayerNorm(...), nn.Linear(K, N))``, with ``seq``'s children
        themselves, so their parameters (a tied weight stays tied, a frozen one frozen, and an optimizer made
        before the swap trains ours) and whatever they carry (hooks, parametrizations such as ``weight_norm``,
        pruning: the forward then runs them as ``nn.Sequential`` would).

        Args:
            seq: the Sequential; an ``ops.layernorm.LayerNorm`` first child (no activation) becomes an
                ``nn.LayerNorm`` on its parameters, so that the fused call runs.
            algo: the forward algorithm (``ALGOS``).

        Returns:
            A ``FusedLayerNormLinear`` whose children are ``seq``'s.

        Raises:
            TypeError: ``seq`` is not a LayerNorm then a Linear, or its LayerNorm applies an activation.
            ValueError: an unknown ``algo``.

        Example:
            >>> seq = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
            >>> m = FusedLayerNormLinear.from_torch(seq)
            >>> assert m[1] is seq[1]
        """
        if (not isinstance(seq, nn.Sequential) or len(seq) != 2 or not isinstance(seq[0], nn.LayerNorm)
                or not isinstance(seq[1], nn.Linear)):
            raise TypeError("seq: expected nn.Sequential(nn.LayerNorm(K), nn.Linear(K, N))")
        if getattr(seq[0], "activation", "none") != "none":
            raise TypeError(f"seq: its LayerNorm applies activation={seq[0].activation!r}, which the fused "
                            "module does not")
        ln, lin = seq[0], seq[1]
        m = cls(lin.in_features, lin.out_features, ln.eps, lin.bias is not None, device="meta", algo=algo,
                elementwise_affine=ln.elementwise_affine, norm_bias=ln.bias is not None,
                normalized_shape=ln.normalized_shape)
        if type(ln) is layernorm.LayerNorm and runs_as_its_class(ln):
            layernorm.share_affine(m[0], ln)
        else:
            m[0] = ln
        m[1] = lin
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        modules = self._modules
        if len(modules) == 2:
            ln, lin = modules.values()
            if type(ln) is nn.LayerNorm and type(lin) is nn.Linear and runs_as_its_class(ln, lin):
                ln_weight, ln_bias = layernorm.weight_and_bias(ln)
                weight, bias = layernorm.weight_and_bias(lin)
                return module_forward(x, ln.normalized_shape, ln_weight, ln_bias, weight, bias, ln.eps, self.algo)
        return _children_forward(x, modules.values())

    def __getitem__(self, idx: int | slice) -> nn.Module:
        """A child, as ``nn.Sequential`` gives it; a slice as an ``nn.Sequential`` of those children (a part of
        LayerNorm then Linear is no longer one)."""
        if isinstance(idx, slice):
            return nn.Sequential(OrderedDict(list(self._modules.items())[idx]))
        return super().__getitem__(idx)

    def __prepare_scriptable__(self) -> nn.Module:
        layernorm.not_scriptable(self)


def runs_as_its_class(*modules: nn.Module) -> bool:
    """Whether calling each of ``modules`` would run only its class's forward (what ``FusedLayerNormLinear``
    computes in place of a plain ``nn.LayerNorm`` and ``nn.Linear``): no hooks on it (pruning's, an observer's)
    nor global module hooks, and no ``forward`` patched onto it (accelerate's offload)."""
    if (_nn_module._global_forward_pre_hooks or _nn_module._global_forward_hooks
            or _nn_module._global_backward_pre_hooks or _nn_module._global_backward_hooks):
        return False
    for m in modules:
        if (m._forward_pre_hooks or m._forward_hooks or m._backward_pre_hooks or m._backward_hooks
                or "forward" in m.__dict__):
            return False
    return True


def _children_forward(x: torch.Tensor, modules: Iterable[nn.Module]) -> torch.Tensor:
    """x through ``modules`` as ``nn.Sequential`` runs them, for a ``FusedLayerNormLinear`` whose children are not
    a plain LayerNorm and Linear (replaced, subclassed, parametrized, hooked, more or fewer of them): each called
    (its hooks, its own forward), except a plain ``nn.LayerNorm`` (``runs_as_its_class``), run on our kernels."""
    for m in modules:
        if type(m) is nn.LayerNorm and runs_as_its_class(m):
            x = layernorm.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)
        else:
            x = m(x)
    return x


def module_forward(x: torch.Tensor, normalized_shape: tuple[int, ...], ln_weight: torch.Tensor | None,
                   ln_bias: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                   algo: str) -> torch.Tensor:
    """``FusedLayerNormLinear``'s forward from its parameters (absent ones None): a function of its own, so that
    ``torch.fx.symbolic_trace`` records the module as this call."""
    if len(normalized_shape) > 1:
        return torch.nn.functional.linear(layernorm.layer_norm(x, normalized_shape, ln_weight, ln_bias, eps),
                                          weight, bias)
    if ln_weight is None or ln_bias is None:
        if layernorm.torch_answers(x, ln_weight, ln_bias, weight, bias):   # before a constant is made of a fake
            return torch_layernorm_linear(x, ln_weight, ln_bias, weight, bias, eps, algo)
        k, dtype, device = normalized_shape[0], weight.dtype, weight.device
        ln_weight = layernorm.constant(1.0, k, dtype, device) if ln_weight is None else ln_weight
        ln_bias = layernorm.constant(0.0, k, dtype, device) if ln_bias is None else ln_bias
    return layernorm_linear(x, ln_weight, ln_bias, weight, bias, eps, algo)


torch.fx.wrap("module_forward")
