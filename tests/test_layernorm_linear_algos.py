"""LayerNorm + Linear's algorithms (CPU, and the GPU where present): auto's choice of fused, Hopper or unfused
(``algo.pick_algo``), the fused kernel's k splits, the fold, the Hopper kernel's refusals, prep and determinism, and
the fused kernels on rows that stress them."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from layernorm_linear_helpers import check_forward, make
from torch import nn

from ops import layernorm_linear as LL
from ops.launch import plans
from ops.layernorm import launch as ln_launch
from ops.layernorm_linear import config as LLC
from ops.reference import layernorm_linear_grads_ref, layernorm_linear_ref, layernorm_stats_ref
from ops.tolerance import compare


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
    assert LL.algo.pick_algo("auto", cuda, f32, 4096, 64) == "fused"
    assert LL.algo.pick_algo("auto", cuda, f32, 4096, LLC.FUSED_MAX_N + 1) == "unfused"
    assert LL.algo.pick_algo("auto", cuda, f32, LLC.FUSED_MIN_ROWS - 1, 64) == "unfused"
    assert LL.algo.pick_algo("auto", cuda, torch.bfloat16, 4096, 64) == "unfused"  # k unknown (0): too short
    bf16, k16 = torch.bfloat16, LLC.FUSED16_MIN_K
    assert LL.algo.pick_algo("auto", cuda, bf16, LLC.FUSED16_MIN_ROWS, LLC.FUSED16_MAX_N, k16) == "fused"
    assert LL.algo.pick_algo("auto", cuda, bf16, LLC.FUSED16_MIN_ROWS, LLC.FUSED16_MAX_N + 1, k16) == "unfused"
    assert LL.algo.pick_algo("auto", cuda, bf16, LLC.FUSED16_MIN_ROWS - 1, LLC.FUSED16_MAX_N, k16) == "unfused"
    assert LL.algo.pick_algo("auto", cuda, bf16, LLC.FUSED16_MIN_ROWS, LLC.FUSED16_MAX_N, k16 - 1) == "unfused"
    assert LL.algo.pick_algo("auto", cpu, bf16, LLC.FUSED16_MIN_ROWS, LLC.FUSED16_MAX_N, k16) == "unfused"
    assert LL.algo.pick_algo("auto", cpu, f32, 4096, 64) == "unfused"
    assert LL.algo.pick_algo("fused", cpu, f32, 1, 1) == "fused"
    with pytest.raises(ValueError, match="^algo:"):
        LL.algo.pick_algo("fast", cuda, f32, 4096, 64)


def test_auto_rule_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: sm90 for bf16 on an sm_90 GPU with enough rows and n in its range (K, N multiples of 8), bar long
    runs of tiles per block over a large x (132 SMs: 16384 rows, n 3072 are runs of 12) and, below
    SM90_MIN_ROWS, grids that leave SMs idle or long rows; else as before."""
    cuda, bf16, rows, n, k = torch.device("cuda"), torch.bfloat16, LLC.SM90_MIN_ROWS, LLC.SM90_MAX_N, 768
    monkeypatch.setattr(LL.algo, "is_sm90", lambda device: device.type == "cuda")
    monkeypatch.setattr(ln_launch, "sm_count", lambda device: 132)
    assert LL.algo.pick_algo("auto", cuda, bf16, rows, n, k) == "sm90"
    assert LL.algo.pick_algo("auto", cuda, bf16, 16384, n, LLC.SM90_RUN_MAX_X // 16384) == "sm90"
    assert LL.algo.pick_algo("auto", cuda, bf16, 16384, n, LLC.SM90_RUN_MAX_X // 16384 + 8) == "unfused"
    assert LL.algo.pick_algo("auto", cuda, bf16, 16384, LLC.SM90_MIN_N, 4096) == "sm90"   # runs of 3
    # from SM90_FILL_ROWS rows: where the persistent grid fills 90% of the SMs, k at most SM90_FILL_MAX_K
    assert LL.algo.pick_algo("auto", cuda, bf16, 4096, 3072, 768) == "sm90"       # 384 tiles: 128 blocks
    assert LL.algo.pick_algo("auto", cuda, bf16, 4096, 3072, LLC.SM90_FILL_MAX_K) == "sm90"
    assert LL.algo.pick_algo("auto", cuda, bf16, 4096, 3072, LLC.SM90_FILL_MAX_K + 8) == "unfused"
    assert LL.algo.pick_algo("auto", cuda, bf16, 4096, 2304, 768) == "unfused"    # 288 tiles: 96 blocks
    assert LL.algo.pick_algo("auto", cuda, bf16, 4096, 768, 768) == "unfused"     # 96 tiles
    assert LL.algo.pick_algo("auto", cuda, bf16, LLC.SM90_FILL_ROWS - 128, 3072, 768) == "unfused"
    monkeypatch.setattr(LL.algo, "capturing", lambda: True)   # inside a CUDA graph: not below SM90_MIN_ROWS
    assert LL.algo.pick_algo("auto", cuda, bf16, 4096, 3072, 768) == "unfused"
    assert LL.algo.pick_algo("auto", cuda, bf16, rows, n, k) == "sm90"
    monkeypatch.setattr(LL.algo, "capturing", lambda: False)
    assert LL.algo.pick_algo("auto", cuda, bf16, rows, LLC.SM90_MIN_N, k) == "sm90"
    assert LL.algo.pick_algo("auto", cuda, bf16, rows - 1, n, k) == "sm90"            # the fill rule: 128 blocks
    assert LL.algo.pick_algo("auto", cuda, bf16, rows - 1, n, 4096) == "unfused"      # ... but k > SM90_FILL_MAX_K
    assert LL.algo.pick_algo("auto", cuda, bf16, rows, LLC.SM90_MAX_N + 8, k) == "unfused"
    assert LL.algo.pick_algo("auto", cuda, bf16, rows, LLC.SM90_MIN_N - 8, k) == "unfused"
    assert LL.algo.pick_algo("auto", cuda, bf16, rows, n, k + 4) == "unfused"       # TMA rows: K % 8 == 0
    assert LL.algo.pick_algo("auto", cuda, torch.float16, rows, n, k) == "unfused"  # bf16 only
    assert LL.algo.pick_algo("auto", torch.device("cpu"), bf16, rows, n, k) == "unfused"
    assert LL.algo.pick_algo("unfused", cuda, bf16, rows, n, k) == "unfused"
    monkeypatch.setattr(LL.algo, "is_sm90", lambda device: False)
    assert LL.algo.pick_algo("auto", cuda, bf16, rows, n, k) == "unfused"


def test_autograd_algo() -> None:
    """With gradients to come, fp16/bf16 auto takes unfused (it keeps xn for the backward); fp32 auto, an
    explicit algo and a call without gradients keep theirs."""
    bf16 = torch.zeros(2, 8, dtype=torch.bfloat16)
    w = torch.zeros(4, 8, dtype=torch.bfloat16)
    grad_w = w.clone().requires_grad_()
    assert LL.algo.autograd_algo("auto", (bf16, grad_w)) == "unfused"
    assert LL.algo.autograd_algo("auto", (bf16.clone().requires_grad_(), w)) == "unfused"
    assert LL.algo.autograd_algo("auto", (bf16, w)) == "auto"
    assert LL.algo.autograd_algo("sm90", (bf16, grad_w)) == "sm90"
    assert LL.algo.autograd_algo("auto", (bf16.float(), grad_w)) == "auto"
    assert LL.algo.autograd_algo("auto", ([1.0], grad_w)) == "auto"   # left to the validation that follows
    with torch.no_grad():
        assert LL.algo.autograd_algo("auto", (bf16, grad_w)) == "auto"


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
        why = LL.algo.sm90_unsupported(x, w)
        assert why is not None and "sm90" not in LL.algo.algos_for(x, w)
        with pytest.raises(ValueError, match="^algo: 'sm90' needs"):
            LL.layernorm_linear_fwd(x, g, b, w, bias, algo="sm90")


SM90_SHAPES = [(1, 8, 8), (37, 200, 264), (1000, 768, 3072), (513, 1032, 776), (4096, 1024, 256), (300, 4096, 64),
               (4999, 56, 1000), (4100, 1000, 1544)]   # these two: several tiles per block (tile runs)


needs_sm90 = pytest.mark.skipif(not LL.algo.is_sm90(torch.device("cuda")), reason="algo sm90 needs an sm_90 GPU")


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
    assert LL.algo.sm90_unsupported(xs, w) is not None
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
