"""Fused LayerNorm + Linear: every forward algorithm, all five gradients, nn.Module, torch.compile, bad inputs."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from conftest import compiled_double
from torch import nn

from ops import layernorm_linear as LL
from ops.launch import plans
from ops.layernorm import launch as ln_launch
from ops.layernorm_linear import config as LLC
from ops.reference import layernorm_linear_grads_ref, layernorm_linear_ref, layernorm_ref, layernorm_stats_ref
from ops.tolerance import compare, compare_named

# (leading dims..., K, N): K and N off the 16/64 tiles, 1-element edges, a 2-D batch.
SHAPES = [(1, 1, 1), (7, 37, 5), (37, 64, 65), (3, 1000, 7), (5, 1023, 130), (2, 3, 24, 40), (70, 130, 64)]
GPU_SHAPES = [(4096, 768, 64), (513, 1024, 768), (1000, 4097, 33), (130, 256, 3072)]


def make(lead: tuple[int, ...], k: int, n: int, dtype: torch.dtype, device: str,
         mean: float = 0.0) -> tuple[torch.Tensor, ...]:
    """Fresh random x (rows shifted by ``mean``), ln_weight, ln_bias, weight (scaled by 1/sqrt(K)), bias, dy."""
    g = torch.Generator().manual_seed(torch.seed())
    f64 = {"generator": g, "dtype": torch.float64}
    ts = (torch.randn(*lead, k, **f64) + mean, 1.0 + 0.2 * torch.randn(k, **f64), 0.2 * torch.randn(k, **f64),
          torch.randn(n, k, **f64) / k ** 0.5, 0.2 * torch.randn(n, **f64), torch.randn(*lead, n, **f64))
    return tuple(t.to(device=device, dtype=dtype) for t in ts)


@pytest.fixture
def fused_in_splits(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., tuple[torch.Tensor, ...]]]:
    """``run(x, g, b, w, bias, splits=s)``: the "fused" forward (y, mean, rstd) through the route users run (the C++
    entry where it is built), its k split count forced to ``splits``. Each call hands its plan over afresh and
    checks that the plan asked for the split count; no forced plan outlives the test."""
    def run(*args: torch.Tensor, splits: int) -> tuple[torch.Tensor, ...]:
        asked: list[int] = []
        monkeypatch.setattr(LL.launch, "fused_splits", lambda *a, **kw: asked.append(splits) or splits)
        plans.forget_plans()
        out = LL.layernorm_linear_fwd(*args, eps=1e-5, algo="fused")
        assert asked, "the fused forward did not ask for its split count"
        return out

    yield run
    plans.forget_plans()


def check_forward(x: torch.Tensor, g: torch.Tensor, b: torch.Tensor, w: torch.Tensor, bias: torch.Tensor,
                  algo: str, cond: float = 1.0) -> None:
    y, mean, rstd = LL.layernorm_linear_fwd(x, g, b, w, bias, algo=algo)
    k = x.shape[-1]
    where = f"algo {algo}, {x.dtype}, x {tuple(x.shape)}, weight {tuple(w.shape)}"
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w.shape[0]), where
    bad = compare(y, layernorm_linear_ref(x, g, b, w, bias), x.dtype, reduction=k, cond=cond)
    assert bad is None, f"y, {where}: {bad}"
    mean_ref, rstd_ref = layernorm_stats_ref(x)
    assert (bad := compare(mean, mean_ref, torch.float32, k, cond)) is None, f"mean, {where}: {bad}"
    assert (bad := compare(rstd / rstd_ref, torch.ones_like(rstd_ref), torch.float32, k, cond)) is None, \
        f"rstd, {where}: {bad}"


def check_backward(x: torch.Tensor, g: torch.Tensor, b: torch.Tensor, w: torch.Tensor, bias: torch.Tensor,
                   dy: torch.Tensor, cond: float = 1.0) -> None:
    _, mean, rstd = LL.layernorm_linear_fwd(x, g, b, w, bias)
    got = LL.layernorm_linear_bwd(dy, x, g, b, w, mean, rstd)
    check_grads(got, x, g, b, w, bias, dy, cond)


def check_grads(got: tuple[torch.Tensor, ...], x: torch.Tensor, g: torch.Tensor, b: torch.Tensor, w: torch.Tensor,
                bias: torch.Tensor, dy: torch.Tensor, cond: float = 1.0, where: str = "") -> None:
    """(dx, dln_weight, dln_bias, dweight, dbias) against float64 autograd, each in its tensor's dtype."""
    ref = layernorm_linear_grads_ref(x, g, b, w, bias, dy)
    k, n = x.shape[-1], w.shape[0]
    rows = x.numel() // k
    # dx goes through dxn = dy W (n terms) and LayerNorm's backward (k terms, scaled by rstd).
    dx_cond = cond * float(layernorm_stats_ref(x)[1].max())
    # dweight = dy^T xn sums `rows` products that may be well above 1 and cancel (the table is for O(1) terms):
    # its tolerance grows with the largest mean |dy| |xn| of an element.
    xn = layernorm_ref(x, g, b).reshape(-1, k).abs()
    dw_cond = cond * max(1.0, float((dy.double().reshape(-1, n).abs().T @ xn).max()) / rows)
    sums = {"dx": (n * k, dx_cond), "dln_weight": (rows * n, cond), "dln_bias": (rows * n, 1.0),
            "dweight": (rows, dw_cond), "dbias": (rows, 1.0)}
    bad = compare_named(got, ref, (x, g, b, w, bias), sums, x.dtype)
    assert bad is None, f"{x.dtype}, x {tuple(x.shape)}, weight {tuple(w.shape)} {where}: {bad}"


@pytest.mark.parametrize("dtype", LL.DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward(device: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x, g, b, w, bias, _ = make(shape[:-2], shape[-2], shape[-1], dtype, device)
    for algo in LL.route.algos_for(x.view(-1, x.shape[-1]), w):
        check_forward(x, g, b, w, bias, algo)


@pytest.mark.parametrize("dtype", LL.DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES[1:5], ids=str)
def test_backward(device: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    check_backward(*make(shape[:-2], shape[-2], shape[-1], dtype, device))


def test_linear_grads_makes_only_what_is_wanted(device: str) -> None:
    """The Linear's part of every backward (``_linear_grads``): dxn = dy W, dW = dy^T xn, db = dy's column sums, in
    float64 against torch's; no dW without ``weight_grad`` (a frozen weight), no db without ``bias_grad``."""
    torch.manual_seed(0)
    dy, xn, w = (torch.randn(*s, dtype=torch.float64, device=device) for s in ((2, 5, 3), (2, 5, 8), (3, 8)))
    want = (dy @ w, dy.reshape(-1, 3).T @ xn.reshape(-1, 8), dy.reshape(-1, 3).sum(0))
    for weight_grad in (True, False):
        for bias_grad in (True, False):
            got = LL.launch.linear_grads(dy, xn, w, bias_grad, weight_grad)
            for g, ref, wanted in zip(got, want, (True, weight_grad, bias_grad), strict=True):
                if wanted:
                    torch.testing.assert_close(g, ref, rtol=1e-12, atol=1e-12)
                else:
                    assert g is None


def test_large_mean_rows(device: str) -> None:
    """Rows with mean 1e4 times their spread: the statistics must not cancel."""
    x, g, b, w, bias, dy = make((6,), 1000, 24, torch.float32, device, mean=1e4)
    for algo in LL.route.algos_for(x, w):
        check_forward(x, g, b, w, bias, algo, cond=1e4)
    check_backward(x, g, b, w, bias, dy, cond=1e4)


def test_nan_propagates(device: str) -> None:
    x, g, b, w, bias, _ = make((4,), 300, 20, torch.float32, device)
    x[1, 17] = float("nan")
    for algo in LL.route.algos_for(x, w):
        y, _, _ = LL.layernorm_linear_fwd(x, g, b, w, bias, algo=algo)
        assert torch.isnan(y[1]).all(), algo
        assert compare(y[[0, 2, 3]], layernorm_linear_ref(x[[0, 2, 3]], g, b, w, bias), torch.float32, 300) is None


def test_backward_is_deterministic(device: str) -> None:
    rows = 4096 if device == "cuda" else 200
    x, g, b, w, bias, dy = make((rows,), 512, 96, torch.float32, device)
    _, mean, rstd = LL.layernorm_linear_fwd(x, g, b, w, bias)
    first = LL.layernorm_linear_bwd(dy, x, g, b, w, mean, rstd)
    for _ in range(10):
        again = LL.layernorm_linear_bwd(dy, x, g, b, w, mean, rstd)
        for a, gv in zip(first, again, strict=True):
            assert torch.equal(a, gv)


def torch_block(k: int, n: int, device: str, bias: bool = True) -> nn.Sequential:
    seq = nn.Sequential(nn.LayerNorm(k, eps=1e-6), nn.Linear(k, n, bias=bias)).to(device)
    with torch.no_grad():
        seq[0].weight.normal_(1.0, 0.2)
        seq[0].bias.normal_(0.0, 0.2)
    return seq


@pytest.mark.parametrize(("bias", "algo"), [(True, "auto"), (True, "fused"), (False, "unfused")])
def test_module_matches_sequential(device: str, bias: bool, algo: str) -> None:
    seq = torch_block(48, 20, device, bias)
    ours = LL.FusedLayerNormLinear.from_torch(seq, algo=algo)
    assert ours.state_dict().keys() == seq.state_dict().keys()
    x = torch.randn(2, 5, 48, device=device, requires_grad=True)
    y = ours(x)
    lin_bias = seq[1].bias if bias else torch.zeros(20, device=device)
    want = layernorm_linear_ref(x.detach(), seq[0].weight, seq[0].bias, seq[1].weight, lin_bias, eps=1e-6)
    assert compare(y, want, torch.float32, 48) is None
    dy = torch.randn_like(y)
    params = [x, *ours.parameters()]
    got = torch.autograd.grad(y, params, dy)
    ref = layernorm_linear_grads_ref(x, seq[0].weight, seq[0].bias, seq[1].weight, lin_bias, dy, eps=1e-6)
    for gv, r in zip(got, ref, strict=False):  # without bias, ref's last entry (dbias) has no parameter
        assert compare(gv, r, torch.float32, reduction=48 * 20) is None


def test_compile_fullgraph(device: str, compiled_layernorm: str) -> None:
    ours = LL.FusedLayerNormLinear(64, 24, device=device)
    x = torch.randn(5, 64, device=device, requires_grad=True)
    y = compiled_double(ours, x, compiled_layernorm)
    ln, lin = ours[0], ours[1]
    assert compare(y, 2.0 * layernorm_linear_ref(x.detach(), ln.weight, ln.bias, lin.weight, lin.bias),
                   torch.float32, 64) is None
    ref_dx = layernorm_linear_grads_ref(x, ln.weight, ln.bias, lin.weight, lin.bias, torch.full_like(y, 2.0))[0]
    assert compare(x.grad, ref_dx, torch.float32, reduction=64 * 24, cond=10.0) is None


def test_opcheck() -> None:
    x, g, b, w, bias, dy = make((3,), 32, 8, torch.float32, "cpu")
    utils = ("test_schema", "test_faketensor")
    fwd, bwd = torch.ops.mojo.layernorm_linear_fwd.default, torch.ops.mojo.layernorm_linear_bwd.default
    torch.library.opcheck(fwd, (x, g, b, w, bias, 1e-5, "auto"), test_utils=utils)
    _, mean, rstd = LL.layernorm_linear_fwd(x, g, b, w, bias)
    xn = F.layer_norm(x, (32,), g, b)
    torch.library.opcheck(bwd, (dy, x, xn, g, b, w, mean, rstd), test_utils=utils)


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "algo"), [(torch.bfloat16, "sm90"), (torch.float32, "fused")])
def test_gpu_opcheck(dtype: torch.dtype, algo: str) -> None:
    """The custom op on the GPU's fused and Hopper forwards (the C++ entry's outputs): schema (no output aliases
    another or an input) and fake tensors, on a first call (Python hands over the plan) and a second."""
    x, g, b, w, bias, _ = make((2, 64), 64, 32, dtype, "cuda")
    for _ in range(2):
        torch.library.opcheck(torch.ops.mojo.layernorm_linear_fwd.default, (x, g, b, w, bias, 1e-5, algo),
                              test_utils=("test_schema", "test_faketensor"))


def test_bad_inputs() -> None:
    x, g, b, w, bias, dy = make((4,), 16, 8, torch.float32, "cpu")
    cases = [
        ((x, g, b, w[:, :15], bias), ValueError, "weight"),       # K mismatch
        ((x, g, b, w, bias[:7]), ValueError, "bias"),
        ((x, g[:15], b, w, bias), ValueError, "ln_weight"),
        ((x, g, b.half(), w, bias), TypeError, "ln_bias"),
        ((x, g, b, w.bfloat16(), bias), TypeError, "weight"),      # dtype mix
        ((x, g, b, w.t(), bias), ValueError, "weight"),            # strides (and shape)
        ((x, g, b, w[0], bias), ValueError, "weight"),
        ((x.double(), g, b, w, bias), TypeError, "x"),
    ]
    for args, err, name in cases:
        with pytest.raises(err, match=f"^{name}:"):
            LL.layernorm_linear_fwd(*args)
    with pytest.raises(ValueError, match="^algo:"):
        LL.layernorm_linear_fwd(x, g, b, w, bias, algo="nope")
    with pytest.raises(TypeError, match="^eps:"):
        LL.layernorm_linear_fwd(x, g, b, w, bias, eps=None)
    _, mean, rstd = LL.layernorm_linear_fwd(x, g, b, w, bias)
    with pytest.raises(ValueError, match="^dy:"):
        LL.layernorm_linear_bwd(dy[:, :7], x, g, b, w, mean, rstd)
    with pytest.raises(TypeError, match="^seq:"):
        LL.FusedLayerNormLinear.from_torch(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))


@pytest.mark.gpu
def test_mixed_devices_rejected() -> None:
    x, g, b, w, bias, _ = make((4,), 16, 8, torch.float32, "cuda")
    with pytest.raises(ValueError, match="^weight:"):
        LL.layernorm_linear_fwd(x, g, b, w.cpu(), bias)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LL.DTYPES, ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_shapes(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Transformer-sized shapes: every algorithm that takes them (and auto's pick) forward, and the backward."""
    x, g, b, w, bias, dy = make(shape[:-2], shape[-2], shape[-1], dtype, "cuda")
    for algo in LL.route.algos_for(x.view(-1, x.shape[-1]), w):
        check_forward(x, g, b, w, bias, algo)
    check_backward(x, g, b, w, bias, dy)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LL.DTYPES, ids=str)
@pytest.mark.parametrize("splits", [1, 3, 7, 40])
def test_gpu_fused_splits(fused_in_splits: Callable, dtype: torch.dtype, splits: int) -> None:
    """Every split count gives the same answer: chunks ending mid-step (K = 1000), splits past the end of K
    (40 chunks of a 1000-long row leave the last ones empty), rows and columns off the 64-tiles."""
    x, g, b, w, bias, _ = make((130,), 1000, 70, dtype, "cuda", mean=3.0)
    y, mean, rstd = fused_in_splits(x, g, b, w, bias, splits=splits)
    assert (bad := compare(y, layernorm_linear_ref(x, g, b, w, bias), dtype, reduction=1000)) is None, bad
    mean_ref, rstd_ref = layernorm_stats_ref(x)
    assert (bad := compare(mean, mean_ref, torch.float32, 1000)) is None, bad
    assert (bad := compare(rstd / rstd_ref, torch.ones_like(rstd_ref), torch.float32, 1000)) is None, bad


@pytest.mark.gpu
def test_gpu_fused_forward_is_deterministic() -> None:
    x, g, b, w, bias, _ = make((4096,), 4096, 64, torch.bfloat16, "cuda")
    assert LL.launch.fused_splits(4096, 4096, 64, x.device) > 1  # the split path, whose sums must keep their order
    first = LL.layernorm_linear_fwd(x, g, b, w, bias, algo="fused")
    for _ in range(10):
        for a, again in zip(first, LL.layernorm_linear_fwd(x, g, b, w, bias, algo="fused"), strict=True):
            assert torch.equal(a, again)


def test_fused_splits_rules() -> None:
    """One split on the CPU; on a GPU never below 1, never a chunk under SPLIT_MIN_K, never above SPLIT_MAX."""
    assert LL.launch.fused_splits(4096, 4096, 64, torch.device("cpu")) == 1
    with pytest.raises(ValueError, match="^splits:"):
        LL.launch.fused_fwd(*make((4,), 16, 8, torch.float32, "cpu")[:5], 1e-5, 0)
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        assert LL.launch.fused_splits(65536, 4096, 4096, dev) == 1
        assert LL.launch.fused_splits(16, 100, 64, dev) == 1
        assert 1 < LL.launch.fused_splits(4096, 4096, 64, dev) <= min(LLC.SPLIT_MAX, 4096 // LLC.SPLIT_MIN_K)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        for rows in (2048, 4096, 16384):  # fp16/bf16: at most SPLIT_BLOCKS_PER_SM_16 blocks per SM
            tiles = rows // LLC.FUSED_TILE_ROWS
            sp = LL.launch.fused_splits(rows, 4096, 64, dev, torch.bfloat16)
            assert sp == max(1, min(LLC.SPLIT_BLOCKS_PER_SM_16 * sms // tiles, LLC.SPLIT_MAX)), (rows, sp)


def test_auto_rule() -> None:
    """auto: fused only on the GPU, small n, enough rows (fp16/bf16: long k too): the H100 sweeps' winners."""
    cuda, cpu, f32 = torch.device("cuda"), torch.device("cpu"), torch.float32
    assert LL.route.pick_algo("auto", cuda, f32, 4096, 64) == "fused"
    assert LL.route.pick_algo("auto", cuda, f32, 4096, LLC.FUSED_MAX_N + 1) == "unfused"
    assert LL.route.pick_algo("auto", cuda, f32, LLC.FUSED_MIN_ROWS - 1, 64) == "unfused"
    assert LL.route.pick_algo("auto", cuda, torch.bfloat16, 4096, 64) == "unfused"  # k unknown (0): too short
    bf16, k16 = torch.bfloat16, LLC.FUSED16_MIN_K
    assert LL.route.pick_algo("auto", cuda, bf16, LLC.FUSED16_MIN_ROWS, LLC.FUSED16_MAX_N, k16) == "fused"
    assert LL.route.pick_algo("auto", cuda, bf16, LLC.FUSED16_MIN_ROWS, LLC.FUSED16_MAX_N + 1, k16) == "unfused"
    assert LL.route.pick_algo("auto", cuda, bf16, LLC.FUSED16_MIN_ROWS - 1, LLC.FUSED16_MAX_N, k16) == "unfused"
    assert LL.route.pick_algo("auto", cuda, bf16, LLC.FUSED16_MIN_ROWS, LLC.FUSED16_MAX_N, k16 - 1) == "unfused"
    assert LL.route.pick_algo("auto", cpu, bf16, LLC.FUSED16_MIN_ROWS, LLC.FUSED16_MAX_N, k16) == "unfused"
    assert LL.route.pick_algo("auto", cpu, f32, 4096, 64) == "unfused"
    assert LL.route.pick_algo("fused", cpu, f32, 1, 1) == "fused"
    with pytest.raises(ValueError, match="^algo:"):
        LL.route.pick_algo("fast", cuda, f32, 4096, 64)


def test_auto_rule_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: sm90 for bf16 on an sm_90 GPU with enough rows and n in its range (K, N multiples of 8), bar long
    runs of tiles per block over a large x (132 SMs: 16384 rows, n 3072 are runs of 12) and, below
    SM90_MIN_ROWS, grids that leave SMs idle or long rows; else as before."""
    cuda, bf16, rows, n, k = torch.device("cuda"), torch.bfloat16, LLC.SM90_MIN_ROWS, LLC.SM90_MAX_N, 768
    monkeypatch.setattr(LL.route, "is_sm90", lambda device: device.type == "cuda")
    monkeypatch.setattr(ln_launch, "sm_count", lambda device: 132)
    assert LL.route.pick_algo("auto", cuda, bf16, rows, n, k) == "sm90"
    assert LL.route.pick_algo("auto", cuda, bf16, 16384, n, LLC.SM90_RUN_MAX_X // 16384) == "sm90"
    assert LL.route.pick_algo("auto", cuda, bf16, 16384, n, LLC.SM90_RUN_MAX_X // 16384 + 8) == "unfused"
    assert LL.route.pick_algo("auto", cuda, bf16, 16384, LLC.SM90_MIN_N, 4096) == "sm90"   # runs of 3
    # from SM90_FILL_ROWS rows: where the persistent grid fills 90% of the SMs, k at most SM90_FILL_MAX_K
    assert LL.route.pick_algo("auto", cuda, bf16, 4096, 3072, 768) == "sm90"       # 384 tiles: 128 blocks
    assert LL.route.pick_algo("auto", cuda, bf16, 4096, 3072, LLC.SM90_FILL_MAX_K) == "sm90"
    assert LL.route.pick_algo("auto", cuda, bf16, 4096, 3072, LLC.SM90_FILL_MAX_K + 8) == "unfused"
    assert LL.route.pick_algo("auto", cuda, bf16, 4096, 2304, 768) == "unfused"    # 288 tiles: 96 blocks
    assert LL.route.pick_algo("auto", cuda, bf16, 4096, 768, 768) == "unfused"     # 96 tiles
    assert LL.route.pick_algo("auto", cuda, bf16, LLC.SM90_FILL_ROWS - 128, 3072, 768) == "unfused"
    monkeypatch.setattr(LL.route, "capturing", lambda: True)   # inside a CUDA graph: not below SM90_MIN_ROWS
    assert LL.route.pick_algo("auto", cuda, bf16, 4096, 3072, 768) == "unfused"
    assert LL.route.pick_algo("auto", cuda, bf16, rows, n, k) == "sm90"
    monkeypatch.setattr(LL.route, "capturing", lambda: False)
    assert LL.route.pick_algo("auto", cuda, bf16, rows, LLC.SM90_MIN_N, k) == "sm90"
    assert LL.route.pick_algo("auto", cuda, bf16, rows - 1, n, k) == "sm90"            # the fill rule: 128 blocks
    assert LL.route.pick_algo("auto", cuda, bf16, rows - 1, n, 4096) == "unfused"      # ... but k > SM90_FILL_MAX_K
    assert LL.route.pick_algo("auto", cuda, bf16, rows, LLC.SM90_MAX_N + 8, k) == "unfused"
    assert LL.route.pick_algo("auto", cuda, bf16, rows, LLC.SM90_MIN_N - 8, k) == "unfused"
    assert LL.route.pick_algo("auto", cuda, bf16, rows, n, k + 4) == "unfused"       # TMA rows: K % 8 == 0
    assert LL.route.pick_algo("auto", cuda, torch.float16, rows, n, k) == "unfused"  # bf16 only
    assert LL.route.pick_algo("auto", torch.device("cpu"), bf16, rows, n, k) == "unfused"
    assert LL.route.pick_algo("unfused", cuda, bf16, rows, n, k) == "unfused"
    monkeypatch.setattr(LL.route, "is_sm90", lambda device: False)
    assert LL.route.pick_algo("auto", cuda, bf16, rows, n, k) == "unfused"


def test_autograd_algo() -> None:
    """With gradients to come, fp16/bf16 auto takes unfused (it keeps xn for the backward); fp32 auto, an
    explicit algo and a call without gradients keep theirs."""
    bf16 = torch.zeros(2, 8, dtype=torch.bfloat16)
    w = torch.zeros(4, 8, dtype=torch.bfloat16)
    grad_w = w.clone().requires_grad_()
    assert LL.route.autograd_algo("auto", (bf16, grad_w)) == "unfused"
    assert LL.route.autograd_algo("auto", (bf16.clone().requires_grad_(), w)) == "unfused"
    assert LL.route.autograd_algo("auto", (bf16, w)) == "auto"
    assert LL.route.autograd_algo("sm90", (bf16, grad_w)) == "sm90"
    assert LL.route.autograd_algo("auto", (bf16.float(), grad_w)) == "auto"
    assert LL.route.autograd_algo("auto", ([1.0], grad_w)) == "auto"   # left to the validation that follows
    with torch.no_grad():
        assert LL.route.autograd_algo("auto", (bf16, grad_w)) == "auto"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_fused_outlier_first_columns(fused_in_splits: Callable, dtype: torch.dtype) -> None:
    """The fused kernel shifts each row by a sample of its first elements before the 16-bit GEMM:
    rows that start 6 spreads off their mean (and gamma ~ N(0, 1)) must stay as accurate as the rest."""
    x, g, b, w, bias, _ = make((4100,), 100, 768, torch.float32, "cuda")
    x[:, :2] += 6.0
    g = torch.randn_like(g)
    args = [t.to(dtype) for t in (x, g, b, w, bias)]
    for splits in (1, 2):
        y = fused_in_splits(*args, splits=splits)[0]
        assert (bad := compare(y, layernorm_linear_ref(*args), dtype, reduction=100)) is None, bad


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("lead,k,n", [((64,), 64, 64), ((300,), 100, 130), ((1,), 7, 1), ((513,), 4096, 64)])
def test_gpu_fused16_large_mean_rows(fused_in_splits: Callable, dtype: torch.dtype, lead: tuple[int, ...], k: int,
                                     n: int) -> None:
    """Rows at mean 1e3, spread 1: in bf16 many short rows round to nearly one value (rstd up to ~300),
    which magnifies any mismatch between the GEMM's 16-bit w * gamma and the correction's G."""
    x, g, b, w, bias, _ = make(lead, k, n, dtype, "cuda", mean=1e3)
    for splits in (1, 3):
        y, mean, rstd = fused_in_splits(x, g, b, w, bias, splits=splits)
        where = f"{dtype}, x {tuple(x.shape)}, weight {tuple(w.shape)}, splits {splits}"
        assert (bad := compare(y, layernorm_linear_ref(x, g, b, w, bias), dtype, reduction=k)) is None, \
            f"y, {where}: {bad}"
        mean_ref, rstd_ref = layernorm_stats_ref(x)
        assert (bad := compare(mean, mean_ref, torch.float32, k, 1e3)) is None, f"mean, {where}: {bad}"
        assert (bad := compare(rstd / rstd_ref, torch.ones_like(rstd_ref), torch.float32, k, 1e3)) is None, \
            f"rstd, {where}: {bad}"


@pytest.mark.parametrize("dtype", LL.DTYPES, ids=str)
def test_fold(device: str, dtype: torch.dtype) -> None:
    """fold = (G, B + bias): G sums weight * ln_weight rounded to the dtype (the products the 16-bit GEMM
    uses), B sums weight * ln_bias in fp32; N and K off every tile."""
    _, g, b, w, bias, _ = make((1,), 1000, 37, dtype, device)
    got = LL.launch.folded(w, g, b, bias)
    w64 = w.double()
    ref = torch.stack(((w * g).double().sum(1), w64 @ b.double() + bias.double()))
    assert got.dtype == torch.float32 and got.shape == (2, 37)
    assert (bad := compare(got, ref, torch.float32, 1000)) is None, bad


def test_fold_ext() -> None:
    """The Hopper kernel's fold MMA rows: per column (G hi, G hi, G mid, B hi, B hi, B mid, G hi, B hi) in
    bf16, hi + mid within 2^-16 of the fold; made once per fold tensor, again for a new version."""
    fold = torch.randn(2, 24) * torch.logspace(-3, 3, 24)
    got = LL.launch.fold_ext(fold)
    assert got.shape == (24, 8) and got.dtype == torch.bfloat16 and got.is_contiguous()
    for v, (hi, mid) in zip(fold, ((0, 2), (3, 5)), strict=True):
        assert torch.equal(got[:, hi], v.to(torch.bfloat16))
        err = (got[:, hi].double() + got[:, mid].double() - v.double()).abs()
        assert bool((err <= 2.0 ** -16 * v.double().abs()).all()), err.max()
    assert torch.equal(got[:, (1, 6)], got[:, (0, 0)]) and torch.equal(got[:, (4, 7)], got[:, (3, 3)])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_gpu_fused_sees_weight_updates(dtype: torch.dtype) -> None:
    """The fold is made once per weight version: an in-place update of any weight must reach the output."""
    x, g, b, w, bias, _ = make((2048,), 4096, 64, dtype, "cuda")
    for t in (w, g, b, bias, None):
        if t is not None:
            t.mul_(1.5)
        y = LL.layernorm_linear_fwd(x, g, b, w, bias, algo="fused")[0]
        assert (bad := compare(y, layernorm_linear_ref(x, g, b, w, bias), dtype, 4096)) is None, bad


def test_sm90_refuses_what_it_cannot_take(device: str) -> None:
    """algo "sm90" names why it cannot run: no Hopper GPU, not bfloat16, K or N not multiples of 8."""
    for dtype, k, n in [(torch.float32, 64, 16), (torch.bfloat16, 36, 16), (torch.bfloat16, 64, 12)]:
        x, g, b, w, bias, _ = make((5,), k, n, dtype, device)
        why = LL.route.sm90_unsupported(x, w)
        assert why is not None and "sm90" not in LL.route.algos_for(x, w)
        with pytest.raises(ValueError, match="^algo: 'sm90' needs"):
            LL.layernorm_linear_fwd(x, g, b, w, bias, algo="sm90")


SM90_SHAPES = [(1, 8, 8), (37, 200, 264), (1000, 768, 3072), (513, 1032, 776), (4096, 1024, 256), (300, 4096, 64),
               (4999, 56, 1000), (4100, 1000, 1544)]   # these two: several tiles per block (tile runs)
needs_sm90 = pytest.mark.skipif(not LL.route.is_sm90(torch.device("cuda")), reason="algo sm90 needs an sm_90 GPU")


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("mean", [0.0, 3.0, 1e4])
@pytest.mark.parametrize("shape", SM90_SHAPES, ids=str)
def test_gpu_sm90(shape: tuple[int, int, int], mean: float) -> None:
    """The Hopper kernel against float64: rows and columns off its 128 x 256 tiles, K off its 64-steps,
    one row, rows of mean 1e4 (shifted), blocks with runs of several tiles (statistics reused; a run
    crossing into the next row block), and the poisoned outputs all written."""
    rows, k, n = shape
    x, g, b, w, bias, _ = make((rows,), k, n, torch.bfloat16, "cuda", mean=mean)
    check_forward(x, g, b, w, bias, "sm90", cond=max(1.0, mean))


def _spy_algos(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The fused and Hopper forwards the Python entries run, in order: through the C++ entry (``_fused_direct``,
    its ``picked`` argument) or through MAX (``sm90_fwd``, ``fused_fwd``). The C++ entry's plans are cleared first,
    so that no shape an earlier test ran bypasses the spies."""
    plans.forget_plans()
    ran: list[str] = []
    real_direct, real_sm90, real_fused = LL.launch.fused_direct, LL.launch.sm90_fwd, LL.launch.fused_fwd

    def via_cpp(*args: object) -> object:
        out = real_direct(*args)
        if out is not None:
            ran.append(args[-1])
        return out

    monkeypatch.setattr(LL.launch, "fused_direct", via_cpp)
    monkeypatch.setattr(LL.launch, "sm90_fwd", lambda *args: ran.append("sm90") or real_sm90(*args))
    monkeypatch.setattr(LL.launch, "fused_fwd", lambda *args, **kw: ran.append("fused") or real_fused(*args, **kw))
    return ran


@pytest.mark.gpu
@needs_sm90
def test_gpu_auto_takes_sm90_where_it_can(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto in the sm90 region runs the Hopper kernel (seen by a spy on the forwards run; bitwise equal to algo
    sm90; right against float64, also at mean 1e4); an x view off 16-byte alignment there takes the
    unfused path instead of raising."""
    calls = _spy_algos(monkeypatch)
    rows, k, n = LLC.SM90_MIN_ROWS, 256, LLC.SM90_MIN_N
    x, g, b, w, bias, _ = make((rows,), k, n, torch.bfloat16, "cuda")
    y = LL.layernorm_linear_fwd(x, g, b, w, bias)[0]
    assert calls == ["sm90"], f"auto in the sm90 region ran {calls}"
    assert torch.equal(y, LL.layernorm_linear_fwd(x, g, b, w, bias, algo="sm90")[0])
    check_forward(x, g, b, w, bias, "auto")
    x, g, b, w, bias, _ = make((rows,), k, n, torch.bfloat16, "cuda", mean=1e4)
    check_forward(x, g, b, w, bias, "auto", cond=1e4)
    calls.clear()
    flat = torch.randn(rows * k + 1, device="cuda").bfloat16()
    xs = flat[1:].view(rows, k)   # 2 bytes past an aligned start
    assert LL.route.sm90_unsupported(xs, w) is not None
    check_forward(xs, g, b, w, bias, "auto")
    assert "sm90" not in calls, "auto ran sm90 on a misaligned x view"


@pytest.mark.gpu
@needs_sm90
def test_gpu_auto_training_keeps_xn(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the sm90 region, layernorm_linear with gradients to come runs unfused (xn kept for dW; the
    gradients right against float64), and without gradients runs sm90."""
    calls = _spy_algos(monkeypatch)
    rows, k, n = LLC.SM90_MIN_ROWS, 256, LLC.SM90_MIN_N
    x, g, b, w, bias, dy = make((rows,), k, n, torch.bfloat16, "cuda")
    leaves = [t.clone().requires_grad_() for t in (x, g, b, w, bias)]
    y = LL.layernorm_linear(*leaves)
    assert not calls, "auto ran sm90 with gradients to come"
    y.backward(dy)
    ref = layernorm_linear_grads_ref(x, g, b, w, bias, dy)
    reductions = (n * k, rows * n, rows * n, rows, rows)
    for name, leaf, r, red in zip(("dx", "dln_weight", "dln_bias", "dweight", "dbias"), leaves, ref, reductions,
                                  strict=True):
        cond = float(layernorm_stats_ref(x)[1].max()) if name == "dx" else 1.0
        assert (bad := compare(leaf.grad, r, torch.bfloat16, reduction=red, cond=cond)) is None, f"{name}: {bad}"
    with torch.no_grad():
        y0 = LL.layernorm_linear(x, g, b, w, bias)
    assert calls == ["sm90"], f"auto without gradients ran {calls}, not sm90"
    assert torch.equal(y0, LL.layernorm_linear_fwd(x, g, b, w, bias, algo="sm90")[0])


@pytest.mark.gpu
@needs_sm90
def test_gpu_sm90_module_and_determinism() -> None:
    """FusedLayerNormLinear(algo="sm90") matches nn.Sequential forward and backward; 10 runs are bitwise equal."""
    torch.manual_seed(0)
    seq = nn.Sequential(nn.LayerNorm(256), nn.Linear(256, 512)).to("cuda", torch.bfloat16)
    ours = LL.FusedLayerNormLinear.from_torch(seq, algo="sm90")
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = ours(x)
    with torch.no_grad():
        ref = layernorm_linear_ref(x, seq[0].weight, seq[0].bias, seq[1].weight, seq[1].bias)
    assert (bad := compare(y, ref, torch.bfloat16, reduction=256)) is None, bad
    dy = torch.randn_like(y)
    y.backward(dy)
    x2 = x.detach().clone().requires_grad_(True)
    seq(x2).backward(dy)
    assert (bad := compare(x.grad, x2.grad, torch.bfloat16, reduction=256 * 512)) is None, bad
    runs = [ours(x.detach()) for _ in range(10)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])


@pytest.mark.gpu
@needs_sm90
def test_gpu_sm90_prep_matches_fold() -> None:
    """The Hopper op's per-call scratch: the ext rows hold (G, B + bias) in fold_ext's layout, with G the sum of
    the exact products weight * ln_weight (the kernel rounds (x - c) * ln_weight instead), hi + mid equal to the
    float64 sums up to fp32 summation; N and K off its tiles."""
    x, g, b, w, bias, _ = make((5,), 1000, 264, torch.bfloat16, "cuda")
    _, _, _, ext = LL.launch.sm90_op(1e-5)(x, w, g, b, bias)
    w64 = w.double()
    fold = torch.stack(((w64 * g.double()).sum(1), w64 @ b.double() + bias.double()))
    assert torch.equal(ext[:, (1, 6)], ext[:, (0, 0)]) and torch.equal(ext[:, (4, 7)], ext[:, (3, 3)])
    for v, (hi, mid) in zip(fold, ((0, 2), (3, 5)), strict=True):
        got = ext[:, hi].double() + ext[:, mid].double()
        assert (bad := compare(got, v, torch.float32, reduction=1000)) is None, bad


# ---------------------------------------------------------------- weight updates (nothing derived is kept)

UPDATE_WAYS = ("inplace_no_grad", "data_write", "data_assign", "set_", "load_state_dict", "adamw_foreach",
               "adamw_fused", "sgd_fused", "parametrize", "to_and_back")


class _Scale(nn.Module):
    """A parametrization: weight * s, with s [N, 1] a parameter of its own."""

    def __init__(self, n: int, ref: torch.Tensor) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.ones(n, 1, dtype=ref.dtype, device=ref.device))

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * self.s


def update(m: LL.FusedLayerNormLinear, way: str, x: torch.Tensor) -> None:
    """Change every parameter of m (LayerNorm and Linear) one way a user can."""
    ln, lin = m[0], m[1]
    params = (lin.weight, ln.weight, lin.bias, ln.bias)
    if way == "inplace_no_grad":
        with torch.no_grad():
            for p in params:
                p.mul_(1.5).add_(0.25)
    elif way == "data_write":   # does not bump the parameter's version counter
        for p in params:
            p.data.mul_(1.5).add_(0.25)
    elif way in ("data_assign", "set_"):   # a new tensor in the parameter's place
        with torch.no_grad():
            for p in params:
                v = p.detach() * 1.5 + 0.25
                if way == "set_":
                    p.set_(v)
                else:
                    p.data = v
    elif way == "load_state_dict":
        m.load_state_dict({k: v * 1.5 + 0.25 for k, v in m.state_dict().items()})
    elif way in ("adamw_foreach", "adamw_fused", "sgd_fused"):
        m(x).float().square().mean().backward()
        # AdamW moves each parameter by about lr (eps 1e-3: the default 1e-8 is 0 in float16, which turns a
        # zero second moment into NaN); SGD's lr, per parameter, makes each one's mean step 0.2
        if way == "sgd_fused":
            groups = [{"params": [p], "lr": 0.2 / float(p.grad.float().abs().mean())} for p in m.parameters()]
            opt = torch.optim.SGD(groups, lr=0.1, fused=True)
        else:
            kw = {"foreach": True} if way == "adamw_foreach" else {"fused": True}
            opt = torch.optim.AdamW(m.parameters(), lr=0.05, eps=1e-3, **kw)
        opt.step()
        opt.zero_grad()
    elif way == "parametrize":   # registered before the first call (see weight_update_module); s changes by .data
        lin.parametrizations.weight[0].s.data.mul_(1.5)
        for p in params[1:]:
            p.data.add_(0.25)
    elif way == "to_and_back":   # moved away (CPU, or float32 on the CPU), changed there, moved back
        dtype, device = lin.weight.dtype, lin.weight.device
        other = {"device": "cpu"} if device.type == "cuda" else {
            "dtype": torch.float32 if dtype != torch.float32 else torch.bfloat16}
        m.to(**other)
        for p in m.parameters():
            p.data.mul_(1.5).add_(0.25)
        m.to(device=device, dtype=dtype)
    else:
        raise AssertionError(way)


def weight_update_module(algo: str, dtype: torch.dtype, device: str, way: str) -> tuple:
    """A FusedLayerNormLinear and x, dy at a shape where ``algo`` runs its kernel (on the GPU, bf16 auto in
    inference runs sm90: the route the stale-weight report found)."""
    rows = LLC.SM90_MIN_ROWS if algo == "auto" and dtype == torch.bfloat16 else 4096
    lead, k, n = ((rows,), 256, 768) if device == "cuda" else ((37,), 64, 24)
    torch.manual_seed(0)
    m = LL.FusedLayerNormLinear(k, n, device=device, dtype=dtype, algo=algo)
    with torch.no_grad():
        m[0].weight.copy_(1.0 + 0.2 * torch.randn(k))
        m[0].bias.copy_(0.2 * torch.randn(k))
    if way == "parametrize":
        torch.nn.utils.parametrize.register_parametrization(m[1], "weight", _Scale(n, m[1].bias))
    x, *_, dy = make(lead, k, n, dtype, device)
    return m, x, dy


def params_now(m: LL.FusedLayerNormLinear) -> tuple[torch.Tensor, ...]:
    """ln_weight, ln_bias, weight (as the forward sees it), bias: the parameters as they are now."""
    return m[0].weight.detach(), m[0].bias.detach(), m[1].weight.detach(), m[1].bias.detach()


@pytest.mark.parametrize("way", UPDATE_WAYS)
@pytest.mark.parametrize("dtype", LL.DTYPES, ids=str)
@pytest.mark.parametrize("algo", LL.ALGOS)
def test_weight_update(device: str, algo: str, dtype: torch.dtype, way: str) -> None:
    """After any change a user can make to the parameters, forward (inference and autograd) and backward
    match float64 on the new parameters: nothing derived from the old weights is served. The old output
    fails against the new reference, so a stale answer could not pass."""
    if algo == "sm90" and (device != "cuda" or dtype != torch.bfloat16 or not LL.route.is_sm90(torch.device(device))):
        pytest.skip("algo sm90 takes bfloat16 on an sm_90 GPU only")
    m, x, dy = weight_update_module(algo, dtype, device, way)
    with torch.no_grad():
        before = m(x)
    m(x.clone().requires_grad_()).backward(dy)   # a training call too, before the change
    m.zero_grad()
    update(m, way, x)
    g, b, w, bias = params_now(m)
    ref = layernorm_linear_ref(x, g, b, w, bias)
    k = x.shape[-1]
    where = f"algo {algo}, {dtype}, {device}, after {way}"
    assert compare(before, ref, dtype, reduction=k) is not None, f"{where}: the update changed nothing"
    with torch.no_grad():
        assert (bad := compare(m(x), ref, dtype, reduction=k)) is None, f"inference, {where}: {bad}"
    xl = x.clone().requires_grad_()
    with torch.nn.utils.parametrize.cached():
        weight = m[1].weight
        y = m(xl)
        assert (bad := compare(y, ref, dtype, reduction=k)) is None, f"autograd forward, {where}: {bad}"
        got = torch.autograd.grad(y, (xl, m[0].weight, m[0].bias, weight, m[1].bias), dy)
    check_grads(got, x, g, b, w, bias, dy, where=where)
