"""LayerNorm+Linear's launches: the MAX graph ops of the fused and Hopper kernels, the C++ entry's plans
for them, and the unfused route's cuBLASLt Linear and its gradients."""

from __future__ import annotations

from collections import OrderedDict
from functools import cache, lru_cache

import torch

from ops.common import kept
from ops.inputs import DTYPES, check_tensor
from ops.launch import direct, plans
from ops.launch.bridge import LIBRARY, GraphOp, Out
from ops.layernorm import launch as ln_launch
from ops.layernorm_linear import config
from ops.layernorm_linear.config import ALGO_IDS


def configure_native(native: object) -> None:
    """This op's tuning of the C++ side's GEMMs and capture streams, handed over when the C++ entries load."""
    native.set_gemm_tuning(config.LT_NO_WORKSPACE_MAX_K_PER_N)
    native.set_capture_overlap(config.CAPTURED_WEIGHT_GRADS_BESIDE)
    native.set_accumulate_beside(config.CAPTURED_GRADS_ACCUMULATED_BESIDE_MAX_ROWS)


direct.on_native_load(configure_native)   # every C++ GEMM call comes through this module, so it is set first


@lru_cache(maxsize=64)   # by eps: a few per model
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
        parameters=(("eps_bits", ln_launch.eps_bits(eps)),),
        weights=frozenset({1, 2, 3, 4, 5}),
    )


output_tiles, scratch_sizes = config.output_tiles, config.scratch_sizes


_counters: dict[torch.device, torch.Tensor] = {}


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


@lru_cache(maxsize=64)
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
        parameters=(("eps_bits", ln_launch.eps_bits(eps)),),
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
    return config.split_count(rows, k, n, ln_launch.sm_count(device), dtype)


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


def fused_direct(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, weight: torch.Tensor,
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
        register_fused(x, ln_weight, ln_bias, weight, algo, picked)
        out = entry(*args)
    return tuple(out) if out else None


def register_fused(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, weight: torch.Tensor, algo: str,
                    picked: str) -> None:
    """Hand the C++ entry the launches of ``picked`` at x's shape and alignment (ops/layernorm_linear/config.py)."""
    k, n = x.shape[-1], weight.shape[0]
    rows, dtype, index = x.numel() // k, x.dtype, x.get_device()
    mask = config.align_mask(x, ln_weight, ln_bias, weight)
    counters = None
    if picked == "sm90":
        plan = config.sm90_plan(rows, k, n, dtype, mask, ln_launch.sm_count(x.device))
    else:
        plan = config.fused_plan(rows, k, n, dtype, mask, fused_splits(rows, k, n, x.device, dtype))
        if plan.kind == config.KIND_FUSED16:
            counters = tile_counters(x.device, output_tiles(rows, n))
    kernels = [int(direct.kernel(s.spec, index, s.smem).function) for s in plan.steps]
    ln_launch.native_transpose(dtype, index)
    grids = [g for s in plan.steps for g in s.grid]
    plans.remember(("fused", rows, k, n, dtype, index, ALGO_IDS[algo], mask), lambda native: native.set_fused_plan(
        rows, k, n, dtype, index, ALGO_IDS[algo], mask, plan.kind, kernels, grids, [s.block for s in plan.steps],
        [s.smem for s in plan.steps], list(plan.sizes), counters, zero_bias(weight)))


def linear(xn: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The unfused route's Linear: on a CUDA GPU the C++ entry's (cuBLASLt with the bias in its epilogue, the GEMM
    the C++ route runs), else ``F.linear``; ``F.linear`` too where autograd is to record it."""
    native = direct.NATIVE.linear
    if (native is None or not xn.is_cuda or torch.compiler.is_compiling()
            or (torch.is_grad_enabled() and (xn.requires_grad or weight.requires_grad
                                             or (bias is not None and bias.requires_grad)))):
        return torch.nn.functional.linear(xn, weight, bias)
    return native(xn, weight, bias)


def linear_grads(dy: torch.Tensor, xn: torch.Tensor, weight: torch.Tensor, bias_grad: bool = True,
                  weight_grad: bool = True) -> tuple[torch.Tensor | None, ...]:
    """The Linear's part of every backward path: from contiguous dy [..., N] and xn [..., K], dxn = dy W (shaped
    like xn), dW = dy^T xn (None, and no GEMM, without ``weight_grad``) and db = dy's column sums (None without
    ``bias_grad``); on a CUDA GPU by the C++ entry (ops/launch/native/cublaslt.h's linear_grads: cuBLASLt, db in dW's
    epilogue, as the C++ route's backward runs them), else (and under torch.compile, for inductor) by torch's ops."""
    native = direct.NATIVE.linear_grads
    if native is not None and dy.is_cuda and not torch.compiler.is_compiling():
        dxn, dweight, *dbias = native(dy, xn, weight, bias_grad, weight_grad)
        return dxn, dweight if weight_grad else None, dbias[0] if dbias else None
    n, k = weight.shape
    dy2 = dy.view(-1, n)
    return ((dy2 @ weight).view(xn.shape), dy2.T @ xn.reshape(-1, k) if weight_grad else None,
            dy2.sum(0) if bias_grad else None)


_zero_biases: OrderedDict[tuple[int, torch.dtype, torch.device], torch.Tensor] = OrderedDict()


def zero_bias(weight: object) -> torch.Tensor:
    """bias = 0 [N] for a Linear without bias (weight checked first, so a bad one is named): one zero tensor per
    (N, dtype, device), bounded (``common.kept``)."""
    check_tensor("weight", weight, ndim=2, dtypes=DTYPES, layout=False)
    return kept(_zero_biases, (weight.shape[0], weight.dtype, weight.device), lambda: weight.new_zeros(weight.shape[0]))
