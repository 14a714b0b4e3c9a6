"""Building the kernels and the C++ launcher (no GPU: CI runs these): PTX built once per kernel source and rebuilt
after an edit, a spec for every default launch, the kernels' constants read as Mojo defines them, and the C++
library's cache key following its sources."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from ops.launch import bridge, direct, packages
from ops.launch import ptx as ptxlib
from ops.layernorm import config as config
from ops.layernorm_linear import config as lnl_config

SPEC = config.reduce_spec(torch.float32, 768)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh cache directory (and fresh source digests) for this test."""
    monkeypatch.setenv("OPS_CACHE_DIR", str(tmp_path / "cache"))
    packages.forget_digests()
    yield tmp_path / "cache"
    packages.forget_digests()


def test_build_writes_ptx_once(cache: Path) -> None:
    assert ptxlib.build([SPEC], "H100", quiet=True) == 1
    ptx = ptxlib.ptx_path(SPEC, "H100").read_text()
    assert ".target sm_90a" in ptx
    name = ptxlib.entry_name(ptx)
    assert name.startswith("kernels_layernorm_ln_bwd_reduc")   # the module and the (shortened) function name
    # the entry takes what KernelSpec.args says: four pointers, then two Int32
    params = ptx[ptx.index(name + "("):ptx.index(")", ptx.index(name + "("))]
    assert params.count(".param .u64") == 4 and params.count(".param .b32") == 2
    assert ptxlib.build([SPEC], "H100", quiet=True) == 0   # cached


def test_edited_kernel_is_rebuilt(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A changed kernel source gives a new cache directory: the old PTX is never launched for it."""
    package = tmp_path / "kernels"
    shutil.copytree(bridge.LIBRARY, package)
    monkeypatch.setattr(ptxlib, "LIBRARY", package)
    before = ptxlib.ptx_dir("H100")
    src = package / "layernorm.mojo"
    src.write_text(src.read_text() + "\n# edited\n")
    packages.forget_digests()
    assert ptxlib.ptx_dir("H100") != before
    assert ptxlib.build([SPEC], "H100", quiet=True) == 1


def test_every_default_kernel_has_a_spec() -> None:
    """poe build-kernels covers what the choice functions launch, and each spec names a real kernel."""
    specs = config.all_specs()
    assert len(specs) == len(set(specs))
    assert {s.name for s in specs} >= {"ln_fwd_regs", "ln_fwd_cluster", "ln_fwd_loop", "ln_bwd_regs", "ln_bwd_loop",
                                       "ln_bwd_reduce", "ln_fwd_row_thread", "ln_fwd_block_smem"}
    source = (bridge.LIBRARY / "layernorm.mojo").read_text()
    assert all(f"def {s.name}[" in source for s in specs)
    # what the choice functions pick at odd and even shapes, few rows and many, aligned or not, is among them
    aligned = lambda h, dtype, vec_ok: vec_ok and h % config.vector_width(dtype) == 0   # noqa: E731
    chosen = {config.fwd_launch(rows, h, dtype, aligned(h, dtype, vec_ok), variant).spec(dtype, act)
              for dtype in config.DTYPES for act in config.ACTS for variant in config.VARIANTS
              for rows in (1, 7, 131, 132, 4096) for h in (1, 37, 768, 1023, 1025, 4096, 65536, 131072)
              for vec_ok in (True, False)}
    chosen |= {config.bwd_launch(parts, h, dtype, aligned(h, dtype, vec_ok)).spec(dtype, act)
               for dtype in config.DTYPES for act in config.ACTS for parts in (1, 128, 132, 264, 1584)
               for h in (1, 37, 768, 1025, 4096, 65536) for vec_ok in (True, False)}
    assert chosen <= set(specs), sorted(s.expr for s in chosen - set(specs))


@pytest.mark.parametrize(("norm", "rows", "h", "dtype", "bias", "min_blocks"), [
    ("rms", 1024, 16384, torch.float32, None, 2),      # 128 bytes of the row a thread: RMSNorm's count half
    ("ln", 1024, 16384, torch.float32, None, 1),       # LayerNorm's do not
    ("ln", 4096, 4096, torch.bfloat16, None, 4),       # 32 bytes, 256 threads
    ("ln", 4096, 768, torch.bfloat16, None, 8),        # four rows of a warp: 128 threads
    ("ln", 256, 32768, torch.bfloat16, True, None),    # the add: its launch bound alone
    ("rms", 256, 32768, torch.bfloat16, False, None),
])
def test_register_forwards_bound_their_blocks(norm: str, rows: int, h: int, dtype: torch.dtype, bias: bool | None,
                                              min_blocks: int | None) -> None:
    """A register forward's PTX declares its launch's block as ``.maxntid``, so ptxas never gives a thread more
    registers than that block can launch with (the add and norm of bfloat16 rows of 32768, 512 threads a row, took
    130-176 registers a thread without it: too many resources to launch); ``ln_fwd_regs`` adds its register
    budget's ``.minnctapersm``."""
    from ops.rmsnorm.config import SEMANTICS

    act = SEMANTICS["torch"] if norm == "rms" else 0
    launch = config.fwd_launch(rows, h, dtype, True, act=act)
    spec = launch.spec(dtype, act) if bias is None else config.add_norm_spec(launch, dtype, act, bias)
    assert launch.kernel == "ln_fwd_regs" and spec is not None
    ptxlib.build([spec], "H100", quiet=True)
    text = ptxlib.ptx_path(spec, "H100").read_text()
    head = text[text.index(".visible .entry"):]
    head = head[head.index(")"):head.index("{")]   # the directives between the parameters and the body
    bound = re.search(r"\.maxntid (\d+)\s", head)
    budget = re.search(r"\.minnctapersm (\d+)\s", head)
    assert bound is not None and int(bound.group(1)) == launch.block, head
    assert (int(budget.group(1)) if budget else None) == min_blocks, head


# Constants the config modules take from the kernel sources (ops/launch/mojo_constants.py), by kernel module.
READ = {"layernorm_linear": ("TILE_THREADS", "TILE_ROWS", "TILE_COLS", "STAGE_THREADS_PER_ROW", "MMA_STAGES",
                                 "MMA_STEP_K", "MMA_SMEM_BYTES", "FINISH_ROWS", "FINISH_COLS", "FOLD_THREADS"),
            "layernorm_linear_sm90": ("PREP_WARPS", "WG_TILE_ROWS", "WG_TILE_COLS", "WG_SLOT_K", "WG_STAGES",
                                      "WG_THREADS", "WG_ROWS", "WG_BOX", "WG_EXT_COLS", "WG_SMEM_BYTES"),
            "layernorm": ("REDUCE_NARROW_MAX_H", "REDUCE_NARROW_COLS", "REDUCE_NARROW_LEVELS", "REDUCE_WIDE_COLS",
                          "REDUCE_WIDE_LEVELS", "TRANSPOSE_TILE", "TRANSPOSE_THREADS")}


CONFIGS = {"layernorm_linear": lnl_config, "layernorm_linear_sm90": lnl_config, "layernorm": config}


def test_kernel_constants_are_read_as_mojo_defines_them(cache: Path) -> None:
    """The config modules launch what the Mojo host code launches: the constants they read from the kernel sources
    (ops/launch/mojo_constants.py) are the values Mojo itself prints, and every fused, Hopper and copy instantiation
    builds to PTX whose entry takes the arguments its spec lists (pointers, 32-bit scalars, 128-byte TMA descriptors
    aligned to 64)."""
    from mojo.run import subprocess_run_mojo

    names = [(module, name) for module, names in READ.items() for name in names]
    program = cache / "constants.mojo"
    program.parent.mkdir(parents=True)
    program.write_text("".join(f"from kernels.{m} import {n}\n" for m, n in names)
                       + "\ndef main():\n" + "".join(f"    print({n})\n" for _, n in names))
    proc = subprocess_run_mojo(["run", "-I", str(bridge.LIBRARY.parent), str(program)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert dict(zip([n for _, n in names], map(int, proc.stdout.split()), strict=True)) == {
        n: getattr(CONFIGS[m], n) for m, n in names}
    specs = [*lnl_config.all_specs(), *(config.transpose_spec(d) for d in config.DTYPES)]
    assert ptxlib.build(specs, "H100", quiet=True) == len(specs)
    for spec in specs:
        ptx = ptxlib.ptx_path(spec, "H100").read_text()
        head = ptx[ptx.index(".visible .entry"):]
        params = head[:head.index(")")]
        assert params.count(".param .u64") == spec.args.count("p"), spec.expr
        assert params.count(".param .b32") + params.count(".param .f32") == spec.args.count("i") + spec.args.count(
            "f"), spec.expr
        assert params.count(".param .align 64 .b8") == spec.args.count("t"), spec.expr


def test_unknown_architecture_has_no_build() -> None:
    with pytest.raises(ptxlib.NoBuildError, match="sm_75"):
        ptxlib.target_for((7, 5))
    assert ptxlib.target_for((9, 0)) == ("H100", "sm_90a")


def test_argument_layout() -> None:
    """Pointers 8-aligned, Int32/Float32 4-aligned, TMA descriptors 64-aligned, as the PTX params are."""
    fmt, offsets, size = direct.arg_layout("pif t".replace(" ", ""))
    assert offsets == [0, 8, 12, 64] and size == 192


def test_native_library_follows_its_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An edited C++ source or part (or another torch) gets another library path: an old build is never
    loaded for it."""
    before = direct.native_library_path()
    src = tmp_path / "direct.cpp"
    src.write_text(direct.NATIVE_SOURCE.read_text() + "\n// edited\n")
    monkeypatch.setattr(direct, "NATIVE_SOURCE", src)
    edited = direct.native_library_path()
    parts = tmp_path / "native"
    shutil.copytree(direct.NATIVE_PARTS, parts)
    (parts / "layernorm.h").write_text((parts / "layernorm.h").read_text() + "\n// edited\n")
    monkeypatch.setattr(direct, "NATIVE_PARTS", parts)
    part_edited = direct.native_library_path()
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert len({before, edited, part_edited, direct.native_library_path()}) == 4
