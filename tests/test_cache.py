"""The build cache can never strand a user (no GPU: CI runs these): a damaged artifact is rebuilt, a read-only cache
works where everything is built and names the way out where not, a bad OPS_CACHE_DIR gets a named error, a killed
build leaves nothing a later run trips over, a new toolchain gets new builds, and the cache and the library's
in-memory caches stay bounded."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ops import common
from ops.launch import bridge, cache, packages
from ops.puzzle.p22 import SOLUTIONS

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache folder for this test, and a package (the puzzle's solution) to build into it."""
    monkeypatch.setenv("OPS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "_swept", False)
    packages.forget_digests()
    pkg = tmp_path / "src" / "op"
    shutil.copytree(SOLUTIONS, pkg)
    return pkg


@pytest.mark.parametrize("damage", ["empty", "half", "garbled", "no_checksum"])
def test_a_damaged_package_is_rebuilt(fresh: Path, damage: str, capfd: pytest.CaptureFixture) -> None:
    """A cached .mojoc truncated to 0 bytes or to half, garbled, or without its checksum (an older build) is found out
    when loaded, removed with a line saying so, and built again; the next load is quiet."""
    built = packages.compile_package(fresh)
    good = built.read_bytes()
    record = built.with_name(built.name + ".sha256")
    if damage == "empty":
        built.write_bytes(b"")
    elif damage == "half":
        built.write_bytes(good[:len(good) // 2])
    elif damage == "garbled":
        built.write_bytes(bytes(b ^ 0xFF for b in good[:64]) + good[64:])
    else:
        record.unlink()
    capfd.readouterr()
    assert packages.compile_package(fresh) == built
    assert "does not match its checksum" in capfd.readouterr().err
    assert built.read_bytes() == good and cache.verified(built)
    packages.compile_package(fresh)
    assert "checksum" not in capfd.readouterr().err


def _read_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a read-only file system answers (root too, where permissions would not stop a write): every write,
    folder made, rename or time stamp under the cache fails with EROFS; reads work."""
    import builtins
    import pathlib
    import tempfile

    root = str(cache.cache_dir())

    def inside(path: object) -> bool:
        return str(path).startswith(root)

    def guard(real: object, path_of: object, writes: object = lambda *a, **k: True) -> object:
        def wrapper(*args: object, **kwargs: object) -> object:
            if inside(path_of(*args, **kwargs)) and writes(*args, **kwargs):
                raise OSError(errno.EROFS, "Read-only file system")
            return real(*args, **kwargs)
        return wrapper

    def mode(*args: object, **kwargs: object) -> str:
        return str(args[1] if len(args) > 1 else kwargs.get("mode", "r"))

    monkeypatch.setattr(builtins, "open", guard(builtins.open, lambda *a, **k: a[0],
                                                lambda *a, **k: any(c in mode(*a, **k) for c in "wax+")))
    monkeypatch.setattr(pathlib.Path, "write_text", guard(pathlib.Path.write_text, lambda *a, **k: a[0]))
    monkeypatch.setattr(pathlib.Path, "write_bytes", guard(pathlib.Path.write_bytes, lambda *a, **k: a[0]))
    monkeypatch.setattr(pathlib.Path, "mkdir", guard(pathlib.Path.mkdir, lambda *a, **k: a[0],
                                                     lambda *a, **k: not pathlib.Path(a[0]).is_dir()))
    monkeypatch.setattr(os, "replace", guard(os.replace, lambda *a, **k: a[1]))
    monkeypatch.setattr(os, "utime", guard(os.utime, lambda *a, **k: a[0]))
    monkeypatch.setattr(tempfile, "mkdtemp", guard(tempfile.mkdtemp, lambda *a, **k: k.get("dir", "")))


def test_a_read_only_cache_serves_what_is_built(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Everything built: a read-only cache loads it (no lock file opened for writing). Something missing: a
    CacheError names the folder, what it needs and OPS_CACHE_DIR."""
    built = packages.compile_package(fresh)
    _read_only(monkeypatch)
    assert packages.compile_package(fresh) == built
    (fresh / "bias_add.mojo").write_text((fresh / "bias_add.mojo").read_text() + "\n# edited\n")
    packages.forget_digests()
    with pytest.raises(cache.CacheError, match=r"OPS_CACHE_DIR: the cache folder .* is read-only and package .*"
                                               r"op\.mojoc is not built there; point OPS_CACHE_DIR"):
        packages.compile_package(fresh)


def test_a_read_only_cache_serves_the_ptx_it_has(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The PTX likewise: built ones load from a read-only cache; a missing one is a CacheError naming the way out."""
    from ops.launch import ptx
    from ops.layernorm import config

    have, missing = config.reduce_spec(torch.float32, 768), config.reduce_spec(torch.float32, 4096)
    assert ptx.build([have], "H100", quiet=True) == 1
    _read_only(monkeypatch)
    assert ptx.build([have], "H100", quiet=True) == 0
    with pytest.raises(cache.CacheError, match=r"read-only and the PTX of 1 kernel\(s\) is not built there"):
        ptx.build([have, missing], "H100", quiet=True)


def test_a_bad_cache_dir_gets_a_named_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """OPS_CACHE_DIR naming a file, or a folder that cannot be made (under a file), is named, not a traceback."""
    a_file = tmp_path / "file"
    a_file.write_text("")
    monkeypatch.setenv("OPS_CACHE_DIR", str(a_file))
    with pytest.raises(cache.CacheError, match=r"OPS_CACHE_DIR: .*file is a file, not a folder"):
        cache.cache_dir()
    monkeypatch.setenv("OPS_CACHE_DIR", str(a_file / "below"))
    with pytest.raises(cache.CacheError, match=r"OPS_CACHE_DIR: cannot create the cache folder .*below"):
        cache.cache_dir()


def test_the_runner_names_a_bad_cache_dir(tmp_path: Path) -> None:
    """The puzzle's runner with OPS_CACHE_DIR at a file: the named error and a usage exit code, no traceback."""
    a_file = tmp_path / "file"
    a_file.write_text("")
    proc = subprocess.run([sys.executable, "scripts/p22.py", "--check", "--cpu"], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, OPS_CACHE_DIR=str(a_file)), stdin=subprocess.DEVNULL)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "OPS_CACHE_DIR" in proc.stderr and "Traceback" not in proc.stderr


def test_a_killed_build_leaves_nothing_in_the_way(fresh: Path) -> None:
    """A build killed mid-way leaves at most a staging folder and an artifact without its checksum: the sweep
    removes the dead process's staging folder and the next load rebuilds the artifact."""
    built = packages.compile_package(fresh)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    staging = cache.cache_dir() / f".staging-{dead}-x1"
    (staging / "op.mojoc").parent.mkdir()
    (staging / "op.mojoc").write_bytes(b"half")
    built.with_name(built.name + ".sha256").unlink()   # killed between the file and its record
    mine = cache.staging_dir()   # this process's: kept
    assert staging in cache.sweep(force=True) and not staging.exists() and mine.exists()
    assert packages.compile_package(fresh) == built and cache.verified(built)


def test_a_new_toolchain_builds_anew_and_the_old_builds_go(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The toolchain's versions are in the package's key: after an upgrade the old build is not loaded, and the
    sweep removes it once it is unused."""
    old = packages.compile_package(fresh)
    monkeypatch.setattr(cache, "toolchain", lambda: "mojo9.9.9-max99.9.9")
    new = packages.compile_package(fresh)
    assert new != old and new.parent.name.endswith("mojo9.9.9-max99.9.9")
    assert old.parent not in cache.sweep(force=True)   # just used: kept for now
    hour_ago = time.time() - cache.IN_USE_S - 60
    for f in old.parent.iterdir():
        os.utime(f, (hour_ago, hour_ago))
    assert old.parent in cache.sweep(force=True) and not old.parent.exists() and new.exists()


def test_the_cache_keeps_the_recently_used(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past KEEP builds of a kind, the least recently used (and not in use) are swept; ``clean`` empties it all."""
    monkeypatch.setitem(cache.KEEP, "packages", 2)
    root, hour_ago = cache.cache_dir(), time.time() - cache.IN_USE_S - 60
    for i in range(4):
        folder = root / f"{i:020x}-{cache.toolchain()}"
        folder.mkdir()
        (folder / "op.mojoc").write_bytes(b"x")
        os.utime(folder / "op.mojoc", (hour_ago + i, hour_ago + i))
    removed = cache.sweep(force=True)
    assert sorted(p.name[:2] for p in removed) == ["00", "00"] and len(list(root.glob("0000*"))) == 2
    assert cache.main(["clean"]) == 0 and not any(root.iterdir())


def test_in_memory_caches_are_bounded() -> None:
    """The library's in-memory caches of tensors stay bounded whatever the shapes a model sees: the absent-parameter
    constants (``layer_norm`` without weight, T = 1..400 rows of 256 made 800 tensors before) and the zero biases."""
    from ops import layernorm_linear
    from ops.layernorm import layer_norm
    from ops.layernorm_linear import launch as lnl_launch

    for t in range(1, 200):
        layer_norm(torch.randn(t, 4 + t), (4 + t,))
        layernorm_linear.layernorm_linear(torch.randn(2, 8), torch.ones(8), torch.zeros(8), torch.randn(t, 8))
    assert len(common._constants) <= common.CONSTANTS_MAX
    assert len(lnl_launch._zero_biases) <= common.CONSTANTS_MAX
    assert len(bridge._models) <= bridge.MODELS_MAX
