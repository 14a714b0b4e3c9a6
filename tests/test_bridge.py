"""ops/launch/bridge.py: compile caching, stale-source safety, weight cache, stream ordering."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ops.launch import bridge, cache, packages
from ops.puzzle.p22 import SOLUTIONS, P22Kernels

ROOT = Path(__file__).resolve().parent.parent


def bias_add(k: P22Kernels, c: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return k.bias_add(c, bias)[0]


def test_edited_kernel_is_what_runs_next(tmp_path: Path) -> None:
    """Edit a kernel in a temp copy: the next run (new process or cleared caches) runs the edit."""
    pkg = tmp_path / "op"
    shutil.copytree(SOLUTIONS, pkg)
    k = P22Kernels(pkg)
    c, bias = torch.randn(2, 3, 5), torch.randn(5)
    assert torch.equal(bias_add(k, c, bias), c + bias)
    src = pkg / "bias_add.mojo"
    src.write_text(src.read_text().replace("yp[unsafe_offset=i] = cp[unsafe_offset=i] + bp[unsafe_offset=i % n]",
                                           "yp[unsafe_offset=i] = cp[unsafe_offset=i] - bp[unsafe_offset=i % n]"))
    bridge.clear_caches()  # what a new process starts with
    assert torch.equal(bias_add(k, c, bias), c - bias)
    # A fresh interpreter sees the edit too (no stale .mojoc or MAX cache entry).
    code = (f"import torch; from ops.puzzle import p22; k = p22.P22Kernels(__import__('pathlib').Path(r'{pkg}'));"
            "c = torch.ones(1, 1, 3); b = torch.full((3,), 2.0); print(k.bias_add(c, b)[0].flatten().tolist())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[-1.0, -1.0, -1.0]"


def test_max_first_used_from_a_worker_thread_exits_cleanly() -> None:
    """A server's worker thread making the process's first MAX call (the CPU route): the right answer, and an exit
    with nothing printed (MAX enters its MLIR context in the importing thread and exits it from the main thread:
    before, "Unbalanced Context enter/exit" at exit)."""
    code = ("import threading, torch; from ops.layernorm import LayerNorm; out = []; x = torch.randn(3, 8);"
            "t = threading.Thread(target=lambda: out.append(LayerNorm(8)(x))); t.start(); t.join();"
            "want = torch.nn.functional.layer_norm(x, (8,));"
            "print(bool((out[0] - want).abs().max() < 1e-5))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "True"
    assert "Unbalanced" not in out.stderr and "Exception ignored" not in out.stderr, out.stderr


def test_weight_cache_sees_in_place_writes() -> None:
    k = P22Kernels(SOLUTIONS)
    c, bias = torch.randn(2, 3, 5), torch.randn(5)
    assert torch.equal(bias_add(k, c, bias), c + bias)
    bias.add_(1.0)  # bumps the version counter: the cached view must not be reused blindly
    assert torch.equal(bias_add(k, c, bias), c + bias)
    other = bias.clone()
    assert torch.equal(bias_add(k, c, other), c + other)


def test_derived_cache_single_source() -> None:
    """get1 hits only for the same, unchanged tensor object; in-place writes, in-place reshapes and a
    new tensor at a reused address all recompute; the oldest entry goes past capacity."""
    cache, calls = bridge.DerivedCache(capacity=2), []

    def compute(t: torch.Tensor, tag: str) -> tuple:
        calls.append(tag)
        return (tag, t.sum().item())

    w = torch.ones(4)
    assert cache.get1(w, compute, "a") == ("a", 4.0)
    assert cache.get1(w, compute, "b") == ("a", 4.0) and calls == ["a"]
    w.add_(1.0)
    assert cache.get1(w, compute, "c") == ("c", 8.0)
    w.unsqueeze_(0)  # same storage and version, new shape
    assert cache.get1(w, compute, "d") == ("d", 8.0)
    alias = w.view(4)  # same storage, another tensor object
    assert cache.get1(alias, compute, "e") == ("e", 8.0)
    cache.get1(torch.zeros(1), compute, "f")  # third entry: w's is the oldest and goes
    assert cache.get1(w, compute, "g") == ("g", 8.0)
    assert calls == ["a", "c", "d", "e", "f", "g"]


def test_package_digest_follows_content(tmp_path: Path) -> None:
    pkg = tmp_path / "op"
    shutil.copytree(SOLUTIONS, pkg)
    d1 = packages.package_digest(pkg)
    (pkg / "bias_add.mojo").write_text((pkg / "bias_add.mojo").read_text() + "\n# edit\n")
    assert packages.package_digest(pkg) == d1  # memoised within the process ...
    bridge.clear_caches()
    assert packages.package_digest(pkg) != d1  # ... and re-read after a reset


def test_compile_error_is_reported(tmp_path: Path) -> None:
    pkg = tmp_path / "op"
    shutil.copytree(SOLUTIONS, pkg)
    (pkg / "bias_add.mojo").write_text((pkg / "bias_add.mojo").read_text().replace("comptime BIAS_BLOCK = 256",
                                                                                  "comptime BIAS_BLOCK = oops"))
    with pytest.raises(packages.MojoCompileError, match="oops"):
        packages.compile_package(pkg)


def test_precompile_soon_builds_and_leaves_errors_to_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner starts its packages precompiling while torch loads: a good one is built and found; a broken one
    raises where it is needed, not in the thread."""
    monkeypatch.setenv("OPS_CACHE_DIR", str(tmp_path / "cache"))
    good, bad = tmp_path / "good" / "op", tmp_path / "bad" / "op"
    shutil.copytree(SOLUTIONS, good)
    shutil.copytree(SOLUTIONS, bad)
    (bad / "bias_add.mojo").write_text((bad / "bias_add.mojo").read_text() + "\noops here\n")
    packages.precompile_soon(tmp_path / "good", tmp_path / "bad").join(timeout=120)
    built = tmp_path / "cache" / f"{packages.package_digest(good)}-{cache.toolchain()}" / "op.mojoc"
    assert built.is_file() and packages.compile_package(good) == built
    assert not list((tmp_path / "cache").glob(f"{packages.package_digest(bad)}*"))
    with pytest.raises(packages.MojoCompileError, match="oops"):
        packages.compile_package(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["auto", "dlpack", "events"])
@pytest.mark.parametrize("side_stream", [False, True])
def test_stream_ordering(side_stream: bool, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Our op reads a tensor a long torch kernel is still writing; torch then overwrites that input and
    reads our output at once, while our kernel is held back behind work on MAX's queue."""
    monkeypatch.setattr(bridge, "STREAM_MODE", mode)
    k = P22Kernels(SOLUTIONS)
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    max_queue = bridge.stream_sync(torch.device("cuda")).max_stream
    with torch.cuda.stream(stream):
        for trial in range(4):
            c = torch.zeros(64, 64, 256, device="cuda")
            bias = torch.randn(256, device="cuda")
            torch.cuda._sleep(50_000_000)  # ~30 ms of GPU time before c gets its values
            c.fill_(3.0)
            if trial % 2:
                with torch.cuda.stream(max_queue):
                    torch.cuda._sleep(50_000_000)  # our kernel runs ~30 ms late
            y = bias_add(k, c, bias)
            c.fill_(float("nan"))  # torch overwrites the input our kernel reads
            z = y * 2.0  # torch consumes the output immediately, on the same stream
            stream.synchronize()
            assert torch.equal(z, (3.0 + bias).expand_as(z) * 2.0)


@pytest.mark.gpu
def test_auto_mode_joins_only_where_cuda_does_not_order_the_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """"auto" makes no join on MAX's own queue, nor on torch's legacy default stream when MAX's queue
    blocks on it; a side stream of torch's always gets one."""
    monkeypatch.setattr(bridge, "STREAM_MODE", "auto")
    sync = bridge.stream_sync(torch.device("cuda"))
    joins = []
    after = bridge._StreamSync.after

    def counted(self: bridge._StreamSync, raw: int | None = None) -> None:
        joins.append(raw)
        after(self, raw)

    monkeypatch.setattr(bridge._StreamSync, "after", counted)
    k = P22Kernels(SOLUTIONS)
    c, bias = torch.ones(2, 4, 16, device="cuda"), torch.arange(16.0, device="cuda")
    expected = (1.0 + bias).expand_as(c)
    torch.cuda.synchronize()  # the inputs are ready before any stream reads them
    for stream, joined in [(sync.max_stream, 0), (torch.cuda.current_stream(), 0 if sync.legacy_ordered else 1),
                           (torch.cuda.Stream(), 1)]:
        joins.clear()
        with torch.cuda.stream(stream):
            y = bias_add(k, c, bias)
            stream.synchronize()
        assert len(joins) == joined
        assert torch.equal(y, expected)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a real GPU compiles every op in the GPU tests")
def test_gpu_kernels_compile_for_sm90() -> None:
    """Every registered op's GPU path compiles for a virtual H100 (sm_90) on a CPU-only machine."""
    proc = subprocess.run([sys.executable, "-m", "ops.compile_check"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all GPU graphs compiled for sm_90" in proc.stdout
