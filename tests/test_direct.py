"""The direct launcher's PTX build: runs on any machine (no GPU), so CI exercises it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ops import bridge, direct
from ops import layernorm_config as config

SPEC = config.reduce_spec(torch.float32)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh cache directory (and fresh source digests) for this test."""
    monkeypatch.setenv("OPS_CACHE_DIR", str(tmp_path / "cache"))
    bridge._digests.clear()
    yield tmp_path / "cache"
    bridge._digests.clear()


def test_build_writes_ptx_once(cache: Path) -> None:
    assert direct.build([SPEC], "H100", quiet=True) == 1
    ptx = direct.ptx_path(SPEC, "H100").read_text()
    assert ".target sm_90a" in ptx
    name = direct.entry_name(ptx)
    assert name.startswith("kernels_layernorm_ln_bwd_reduc")   # the module and the (shortened) function name
    # the entry takes what KernelSpec.args says: four pointers, then two Int32
    params = ptx[ptx.index(name + "("):ptx.index(")", ptx.index(name + "("))]
    assert params.count(".param .u64") == 4 and params.count(".param .b32") == 2
    assert direct.build([SPEC], "H100", quiet=True) == 0   # cached


def test_edited_kernel_is_rebuilt(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A changed kernel source gives a new cache directory: the old PTX is never launched for it."""
    package = tmp_path / "kernels"
    shutil.copytree(bridge.LIBRARY, package)
    monkeypatch.setattr(direct, "LIBRARY", package)
    before = direct.ptx_dir("H100")
    src = package / "layernorm.mojo"
    src.write_text(src.read_text() + "\n# edited\n")
    bridge._digests.clear()
    assert direct.ptx_dir("H100") != before
    assert direct.build([SPEC], "H100", quiet=True) == 1


def test_every_default_kernel_has_a_spec() -> None:
    """poe build-kernels covers what the choice functions launch, and each spec names a real kernel."""
    specs = config.all_specs()
    assert len(specs) == len(set(specs))
    assert {s.name for s in specs} >= {"ln_fwd_regs", "ln_fwd_cluster", "ln_fwd_loop", "ln_bwd_regs", "ln_bwd_loop",
                                       "ln_bwd_reduce", "ln_fwd_row_thread", "ln_fwd_block_smem"}
    source = (bridge.LIBRARY / "layernorm.mojo").read_text()
    assert all(f"def {s.name}[" in source for s in specs)


def test_unknown_architecture_has_no_build() -> None:
    with pytest.raises(direct.NoBuildError, match="sm_75"):
        direct.target_for((7, 5))
    assert direct.target_for((9, 0)) == ("H100", "sm_90a")


def test_argument_layout() -> None:
    """Pointers 8-aligned, Int32/Float32 4-aligned, TMA descriptors 64-aligned, as the PTX params are."""
    fmt, offsets, size = direct._layout("pif t".replace(" ", ""))
    assert offsets == [0, 8, 12, 64] and size == 192
