"""LayerNorm library op: forward variants, backward, GELU, autograd, nn.Module, torch.compile, bad inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import compiled_double

from ops import layernorm as L
from ops.reference import layernorm_act_ref, layernorm_grads_ref, layernorm_stats_ref
from ops.tolerance import compare, compare_named

SHAPES = [(1, 1), (1, 7), (3, 37), (2, 5, 64), (4, 1000), (2, 1023), (3, 4097)]
GPU_SHAPES = [(1, 256), (32, 768), (5, 1024), (3, 8192), (3, 16384), (2, 32768), (2, 65536), (2, 65544), (1 << 17, 8)]


def make(shape: tuple[int, ...], dtype: torch.dtype, device: str, mean: float = 0.0,
         seed: int | None = None) -> tuple[torch.Tensor, ...]:
    """Fresh random x (rows shifted by ``mean``), weight, bias and upstream grad dy."""
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed())
    h = shape[-1]
    x = torch.randn(shape, generator=g, dtype=torch.float64) + mean
    w = 1.0 + 0.2 * torch.randn(h, generator=g, dtype=torch.float64)
    b = 0.2 * torch.randn(h, generator=g, dtype=torch.float64)
    dy = torch.randn(shape, generator=g, dtype=torch.float64)
    return tuple(t.to(device=device, dtype=dtype) for t in (x, w, b, dy))


def variants(device: str) -> list[str]:
    """Every forward variant on the GPU; the CPU kernel is a single one."""
    return list(L.VARIANTS) if device == "cuda" else ["fast"]


def check_forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, variant: str,
                  activation: str = "none", cond: float = 1.0) -> None:
    y, mean, rstd = L.layernorm_fwd(x, w, b, variant=variant, activation=activation)
    where = f"variant {variant}, {x.dtype}, shape {tuple(x.shape)}"
    assert y.dtype == x.dtype and mean.dtype == rstd.dtype == torch.float32, where
    assert (bad := compare(y, layernorm_act_ref(x, w, b, activation=activation), x.dtype, cond=cond)) is None, \
        f"y, {where}: {bad}"
    mean_ref, rstd_ref = layernorm_stats_ref(x)
    assert (bad := compare(mean, mean_ref, torch.float32, x.shape[-1], cond)) is None, f"mean, {where}: {bad}"
    assert (bad := compare(rstd / rstd_ref, torch.ones_like(rstd_ref), torch.float32, x.shape[-1], cond)) \
        is None, f"rstd, {where}: {bad}"


def check_backward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, dy: torch.Tensor,
                   activation: str = "none") -> None:
    _, mean, rstd = L.layernorm_fwd(x, w, b, activation=activation)
    got = L.layernorm_bwd(dy, x, w, b, mean, rstd, activation=activation)
    ref = layernorm_grads_ref(x, w, b, dy, activation=activation)
    h, rows = x.shape[-1], x.numel() // x.shape[-1]
    # dx = rstd * (...): rounding inside the bracket is scaled by rstd (316 for a constant row).
    cond = float(layernorm_stats_ref(x)[1].max())
    # dweight sums `rows` products dy * xhat, and each xhat carries the statistics' error, a sum over h terms
    # (the forward's mean and rstd are held to that): the CPU kernel's sequential float32 mean, 6e-6 off at
    # h = 4097, put dweight 2e-5 off where its own arithmetic was 6e-7 off (seed 71 of make).
    bad = compare_named(got, ref, (x, w, b), {"dx": (h, cond), "dweight": (rows * h, 1.0), "dbias": (rows, 1.0)},
                        x.dtype)
    assert bad is None, f"{x.dtype} {tuple(x.shape)}, {bad}"


@pytest.mark.parametrize("dtype", L.DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward(device: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x, w, b, _ = make(shape, dtype, device)
    for variant in variants(device):
        check_forward(x, w, b, variant)


@pytest.mark.parametrize("dtype", L.DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_backward(device: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    check_backward(*make(shape, dtype, device))


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("shape", [(3, 37), (4, 1024)], ids=str)
def test_gelu(device: str, activation: str, shape: tuple[int, ...]) -> None:
    x, w, b, dy = make(shape, torch.float32, device)
    for variant in variants(device):
        check_forward(x, w, b, variant, activation)
    check_backward(x, w, b, dy, activation)


def test_large_mean_rows(device: str) -> None:
    """Mean 1e4 times the spread: one-pass E[x^2] - E[x]^2 statistics would be garbage here."""
    x, w, b, dy = make((6, 1000), torch.float32, device, mean=1e4)
    for variant in variants(device):
        check_forward(x, w, b, variant, cond=1e4)
    _, mean, rstd = L.layernorm_fwd(x, w, b)
    dx, dw, db = L.layernorm_bwd(dy, x, w, b, mean, rstd)
    ref = layernorm_grads_ref(x, w, b, dy)
    assert compare(dx, ref[0], torch.float32, 1000, cond=1e4) is None
    assert compare(dw, ref[1], torch.float32, 6, cond=1e4) is None


def test_nan_and_inf_propagate(device: str) -> None:
    """A row holding NaN or Inf comes out non-finite (as in torch); other rows are untouched."""
    x, w, b, _ = make((4, 300), torch.float32, device)
    x[1, 17] = float("nan")
    x[2, 5] = float("inf")
    for variant in variants(device):
        y, _, _ = L.layernorm_fwd(x, w, b, variant=variant)
        assert not torch.isfinite(y[1:3]).any(), variant
        assert compare(y[[0, 3]], layernorm_act_ref(x[[0, 3]], w, b), torch.float32) is None, variant


def test_backward_is_deterministic(device: str) -> None:
    rows = 4096 if device == "cuda" else 300
    x, w, b, dy = make((rows, 1024), torch.float32, device)
    _, mean, rstd = L.layernorm_fwd(x, w, b)
    first = L.layernorm_bwd(dy, x, w, b, mean, rstd)
    for _ in range(10):
        again = L.layernorm_bwd(dy, x, w, b, mean, rstd)
        for a, g in zip(first, again, strict=True):
            assert torch.equal(a, g)


@pytest.mark.parametrize(("rows", "h", "dtype", "parts"), [
    (4096, 768, torch.bfloat16, 1056), (16384, 768, torch.bfloat16, 1056), (16384, 4096, torch.bfloat16, 264),
    (2048, 768, torch.bfloat16, 1056), (1024, 768, torch.float32, 528), (4096, 1024, torch.bfloat16, 1056),
    (4096, 768, torch.float32, 528), (4096, 8192, torch.float32, 132), (65536, 256, torch.float32, 1584),
    (512, 4096, torch.bfloat16, 132), (32, 4096, torch.float32, 32), (1, 7, torch.float16, 1)], ids=str)
def test_backward_row_groups(monkeypatch: pytest.MonkeyPatch, rows: int, h: int, dtype: torch.dtype,
                             parts: int) -> None:
    """The backward's row-group count on a 132-SM GPU at shapes of the H100 sweeps (the bench_layernorm_bwd_sweep
    table in results/layernorm.md, and ops/layernorm/config.py's notes): about 2 rows a group up to 1024-wide
    rows, 8 beyond, capped by row bytes."""
    monkeypatch.setattr(L.launch, "sm_count", lambda device: 132)
    assert L.launch.bwd_parts(rows, h, dtype, torch.device("cuda")) == parts
    assert L.launch.bwd_parts(rows, h, dtype, torch.device("cpu")) == 1


def test_forced_backward_parts_apply_within_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep's forced row groups (``forced_backward``) apply within it, capped by the rows, and the rules after."""
    monkeypatch.setattr(L.launch, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    with L.config.forced_backward(parts=5):
        assert L.launch.bwd_parts(4096, 768, torch.bfloat16, cuda) == 5 and L.config.FORCED_BWD_PARTS == 5
        assert L.launch.bwd_parts(3, 768, torch.bfloat16, cuda) == 3
    assert L.config.FORCED_BWD_PARTS is None and L.launch.bwd_parts(4096, 768, torch.bfloat16, cuda) == 1056


def test_backward_forced_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep's forced configuration (``forced_backward``) is one that holds the row, named where it does not, and
    off by default; the default is the first that holds the row."""
    from ops.layernorm import config as config

    assert config.bwd_config() is None
    default = config.bwd_launch(528, 768, torch.bfloat16, True)
    assert default.params == (8, *config.BWD_REGS[2]) and default.grid == (132, 1, 1) and default.block == 128
    with config.forced_backward(config=3):
        wide = config.bwd_launch(528, 768, torch.bfloat16, True, config.bwd_config())
    assert wide.params == (8, 2, 4, 1) and wide.grid == (528, 1, 1) and wide.block == 128
    with pytest.raises(ValueError, match="config: BWD_REGS.0. does not hold a row of 768"):
        config.bwd_launch(528, 768, torch.bfloat16, True, 0)
    # fewer row groups than give every SM a block of BWD_REGS[2]: one row per block instead (BWD_FEW_PARTS)
    for parts, blocks in ((1, 1), (128, 128), (264, 264)):
        few = config.bwd_launch(parts, 768, torch.bfloat16, True, sms=132)
        assert few.params == (8, *config.BWD_REGS[3]) and few.grid == (blocks, 1, 1)
    assert config.bwd_launch(528, 768, torch.bfloat16, True, sms=132).params == (8, *config.BWD_REGS[2])


@pytest.mark.parametrize(("parts", "h", "dtype", "sizes"), [
    (1056, 768, torch.bfloat16, (1056, 264)), (1001, 768, torch.bfloat16, (1004, 251)),
    (37, 768, torch.bfloat16, (37, 37)), (264, 4096, torch.bfloat16, (264, 132)),
    (132, 4096, torch.bfloat16, (132, 132)), (528, 770, torch.bfloat16, (528, 528))], ids=str)
def test_backward_partial_rows(parts: int, h: int, dtype: torch.dtype, sizes: tuple[int, int]) -> None:
    """(row groups, partial rows): ln_bwd_regs takes blocks * RPB groups and writes a partial row per block
    (4096x768 bf16: 264 rows of dgamma/dbeta partials, not 1056; at h 4096, two groups a block where that still gives
    every SM a block); ln_bwd_loop (770: not whole vectors) one per group."""
    from ops.layernorm import config as config

    launch = config.bwd_launch(parts, h, dtype, h % 8 == 0, sms=132)
    assert config.bwd_sizes(launch, parts) == sizes
    assert launch.grid[0] == (sizes[1] if launch.kernel == "ln_bwd_regs" else -(-parts // launch.params[1]))


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "h", "dtype"), [(4096, 4096, torch.bfloat16), (2048, 3072, torch.float16),
                                                  (2048, 2048, torch.float32)], ids=str)
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_gpu_backward_of_joined_row_groups(norm: str, rows: int, h: int, dtype: torch.dtype) -> None:
    """Shapes whose backward runs two row groups a block (``BWD_REGS`` (4, 4, 2): their dgamma/dbeta join in shared
    memory into one partial row): dx, dgamma (and dbeta) against float64, the same bits at a second call, and
    outputs poisoned with NaN first (a slot the kernels forgot would stay NaN)."""
    from ops.layernorm import config
    from ops.reference import rmsnorm_grads_ref
    from ops.rmsnorm import fwd_bwd as R

    parts = config.bwd_parts(rows, h, dtype, torch.device("cuda"), 132)
    assert config.bwd_launch(parts, h, dtype, True, sms=132).params[1:] == (4, 4, 2)
    x, w, b, dy = make((rows, h), dtype, "cuda", mean=3.0)
    results = []
    for _ in range(2):
        torch.cuda.empty_cache()
        torch.empty(8 * rows * h, dtype=dtype, device="cuda").fill_(float("nan"))   # the allocator's next blocks
        if norm == "layernorm":
            _, mean, rstd = L.layernorm_fwd(x, w, b)
            results.append(L.layernorm_bwd(dy, x, w, b, mean, rstd))
        else:
            _, mean, rstd = R.rms_norm_fwd(x, w, 1e-6, "torch")
            results.append(R.rms_norm_bwd(dy, x, w, mean, rstd, "torch"))
    assert all(torch.equal(a, g) for a, g in zip(*results, strict=True))
    want = (layernorm_grads_ref(x, w, b, dy) if norm == "layernorm" else rmsnorm_grads_ref(x, w, dy, 1e-6))
    names, sums = ("dx", "dweight", "dbias")[:len(want)], (h, rows, rows)[:len(want)]
    for name, got, ref, n in zip(names, results[0], want, sums, strict=True):
        assert (m := compare(got, ref, dtype, reduction=n)) is None, f"{name}: {m}"


def test_module_loads_torch_state_dict(device: str) -> None:
    torch_ln = torch.nn.LayerNorm(96, eps=1e-6, device=device)
    with torch.no_grad():
        torch_ln.weight.normal_(1.0, 0.2)
        torch_ln.bias.normal_(0.0, 0.2)
    ours = L.LayerNorm(96, eps=1e-6, device=device)
    ours.load_state_dict(torch_ln.state_dict())
    x = torch.randn(2, 9, 96, device=device, requires_grad=True)
    y = ours(x)
    assert compare(y, layernorm_act_ref(x.detach(), torch_ln.weight, torch_ln.bias, eps=1e-6), torch.float32) is None
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, ours.weight, ours.bias), dy)
    ref = layernorm_grads_ref(x, torch_ln.weight, torch_ln.bias, dy, eps=1e-6)
    for g, r, n in zip(got, ref, (96, 18, 18), strict=True):
        assert compare(g, r, torch.float32, reduction=n) is None
    gelu = L.LayerNorm.from_torch(torch_ln, activation="gelu")
    want = F.gelu(F.layer_norm(x.detach().double(), (96,), torch_ln.weight.double(), torch_ln.bias.double(), 1e-6))
    assert compare(gelu(x.detach()), want, torch.float32) is None


def test_module_without_affine(device: str) -> None:
    ours = L.LayerNorm(40, elementwise_affine=False, device=device)
    x = torch.randn(3, 40, device=device)
    assert compare(ours(x), F.layer_norm(x.double(), (40,)), torch.float32) is None
    assert not list(ours.parameters())


def test_compile_fullgraph(device: str, compiled_layernorm: str) -> None:
    ln = L.LayerNorm(64, device=device, activation="gelu_tanh")
    x = torch.randn(5, 64, device=device, requires_grad=True)
    y = compiled_double(ln, x, compiled_layernorm)
    want = 2.0 * F.gelu(F.layer_norm(x.detach().double(), (64,), ln.weight.double(), ln.bias.double()),
                        approximate="tanh")
    assert compare(y, want, torch.float32) is None
    ref_dx = layernorm_grads_ref(x, ln.weight, ln.bias, torch.full_like(x, 2.0), activation="gelu_tanh")[0]
    assert compare(x.grad, ref_dx, torch.float32, reduction=64) is None


def test_opcheck() -> None:
    x, w, b, dy = make((3, 32), torch.float32, "cpu")
    torch.library.opcheck(torch.ops.mojo.layernorm_fwd.default, (x, w, b, 1e-5, "fast", "none"),
                          test_utils=("test_schema", "test_faketensor"))
    _, mean, rstd = L.layernorm_fwd(x, w, b)
    torch.library.opcheck(torch.ops.mojo.layernorm_bwd.default, (dy, x, w, b, mean, rstd, "none"),
                          test_utils=("test_schema", "test_faketensor"))


def test_bad_inputs() -> None:
    x, w, b, dy = make((4, 16), torch.float32, "cpu")
    cases = [
        ((x, w.half(), b), TypeError, "weight"),
        ((x, w[:8], b), ValueError, "weight"),
        ((x, w, b[:15]), ValueError, "bias"),
        ((x.int(), w, b), TypeError, "x"),
        ((x.double(), w.double(), b.double()), TypeError, "x"),
        (([[1.0]], w, b), TypeError, "x"),
    ]
    for args, err, name in cases:
        with pytest.raises(err, match=f"^{name}:"):
            L.layernorm_fwd(*args)
    with pytest.raises(ValueError, match="^variant:"):
        L.layernorm_fwd(x, w, b, variant="nope")
    with pytest.raises(ValueError, match="^activation:"):
        L.layernorm_fwd(x, w, b, activation="relu")
    with pytest.raises(TypeError, match="^eps:"):
        L.layernorm_fwd(x, w, b, eps="0.1")
    _, mean, rstd = L.layernorm_fwd(x, w, b)
    with pytest.raises(ValueError, match="^dy:"):
        L.layernorm_bwd(dy[:2], x, w, b, mean, rstd)
    with pytest.raises(ValueError, match="^mean:"):
        L.layernorm_bwd(dy, x, w, b, mean[:2], rstd)
    with pytest.raises(TypeError, match="^rstd:"):
        L.layernorm_bwd(dy, x, w, b, mean, rstd.double())
    with pytest.raises(ValueError, match="^normalized_shape:"):
        L.LayerNorm((4, -1))


@pytest.mark.gpu
def test_mixed_devices_rejected() -> None:
    x, w, b, _ = make((4, 16), torch.float32, "cuda")
    with pytest.raises(ValueError, match="^weight:"):
        L.layernorm_fwd(x, w.cpu(), b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_shapes(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Long rows (one block per row up to 4096 vectors; fast: a cluster of blocks per row
    up to 16384; the loop fallback above), many short rows; fp32 also with a large mean."""
    x, w, b, dy = make(shape, dtype, "cuda")
    check_forward(x, w, b, "fast")
    check_forward(x, w, b, "vector")
    check_backward(x, w, b, dy)
    if dtype == torch.float32:  # each path's statistics on rows whose mean is 1e4 times their spread
        x, w, b, _ = make(shape, dtype, "cuda", mean=1e4)
        check_forward(x, w, b, "fast", cond=1e4)
        check_forward(x, w, b, "vector", cond=1e4)


@pytest.mark.gpu
@pytest.mark.parametrize("parts", [1, 7, 132, 1000, 4097])
def test_gpu_backward_any_row_groups(monkeypatch: pytest.MonkeyPatch, parts: int) -> None:
    """Every row-group count gives the same gradients (more groups than rows included)."""
    with L.config.forced_backward(parts=parts):
        for dtype, shape in ((torch.float32, (4097, 768)), (torch.bfloat16, (1000, 4096)), (torch.float32, (37, 1023))):
            check_backward(*make(shape, dtype, "cuda"))


# Cluster configs of the forward (layernorm.mojo): config -> vectors per row it holds.
CLUSTER_CONFIGS = {15: 2048, 16: 8192, 17: 16384}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", L.DTYPES, ids=str)
@pytest.mark.parametrize("config", list(CLUSTER_CONFIGS))
def test_gpu_cluster_configs(dtype: torch.dtype, config: int) -> None:
    """A row split over a cluster of blocks: full rows, rows that leave most blocks of the
    cluster empty, a partly filled last block, large-mean rows (fp32, sized to the config's
    capacity so the forced config runs), GELU, NaN in one block's slice."""
    vec = 16 // dtype.itemsize
    cap = CLUSTER_CONFIGS[config] * vec
    variant = f"config:{config}"
    for shape in [(3, cap), (2, 37 * vec), (5, cap // 2 + 3 * vec)]:
        x, w, b, _ = make(shape, dtype, "cuda")
        check_forward(x, w, b, variant)
    if dtype == torch.float32:  # a mean 1e4 times the spread is representable in fp32 only
        x, w, b, _ = make((4, cap - vec), dtype, "cuda", mean=1e4)
        check_forward(x, w, b, variant, cond=1e4)
    x, w, b, _ = make((2, cap), dtype, "cuda")
    check_forward(x, w, b, variant, "gelu")
    x[1, cap - 5] = float("nan")
    y, mean, rstd = L.layernorm_fwd(x, w, b, variant=variant)
    assert y[1].isnan().all() and mean[1].isnan() and rstd[1].isnan()
    assert compare(y[0], layernorm_act_ref(x[:1], w, b)[0], dtype) is None


@pytest.mark.gpu
def test_gpu_unaligned_views() -> None:
    """Contiguous views starting 4 bytes into their storage cannot take 16-byte loads: fallback path."""
    h = 256
    base = torch.randn(3 * h + 1, device="cuda")
    x = base[1:].view(3, h)
    _, w, b, dy = make((3, h), torch.float32, "cuda")
    check_forward(x, w, b, "fast")
    check_forward(x, w, b, "vector")
    dy = torch.randn(3 * h + 1, device="cuda")[1:].view(3, h)
    check_backward(x, w, b, dy)
