"""The project's build cache, shared by every process (and by default every checkout) of a user: the Mojo packages,
the PTX, the C++ launcher and the saved MAX modules. No torch here.

* ``cache_dir``: the folder (``OPS_CACHE_DIR``, else one of this user's in the temporary directory); a bad
  ``OPS_CACHE_DIR`` gets a named ``CacheError``.
* ``built_file``: an artifact built once under a lock per build (``built_once``), in a staging folder, and published
  by an atomic rename with a SHA-256 beside it. Every load checks that checksum (``verified``); a damaged or
  half-written artifact is removed and built again, with one line saying so.
* A read-only cache works where everything needed is built; where something is missing, ``CacheError`` names the
  folder, what it needs, and ``OPS_CACHE_DIR`` as the way out.
* ``sweep``: staging folders of dead processes, builds of other toolchains, and the least recently used past a
  bound are removed (once per process); ``python -m ops.launch.cache clean`` (``poe clean-cache``) empties it.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.metadata
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
KEEP = {"packages": 32, "ptx": 8, "native": 8}   # builds kept per kind (least recently used removed past these)
IN_USE_S = 3600   # a build used within this long is never swept (another process may be loading it)


class CacheError(RuntimeError):
    """The cache folder cannot serve a call: ``OPS_CACHE_DIR`` names a file or a folder that cannot be created, or
    the folder is read-only and lacks what the call needs built."""


@cache
def tool_version(tool: str) -> str | None:
    """The installed version of ``tool`` ("mojo", "max"), or None where its package metadata is absent (a machine
    running builds made elsewhere)."""
    try:
        return importlib.metadata.version(tool)
    except importlib.metadata.PackageNotFoundError:
        return None


def toolchain() -> str:
    """The versions of the tools whose output the cache holds, for the builds' keys."""
    return "-".join(f"{tool}{tool_version(tool) or '-unknown'}" for tool in ("mojo", "max"))


def cache_dir() -> Path:
    """The cache folder, created if missing.

    Raises:
        CacheError: ``OPS_CACHE_DIR`` names a file, or a folder that cannot be created.
    """
    path = Path(os.environ.get("OPS_CACHE_DIR") or Path(tempfile.gettempdir()) / f"ops_cache_{os.getuid()}")
    if path.exists() and not path.is_dir():
        raise CacheError(f"OPS_CACHE_DIR: {path} is a file, not a folder; point OPS_CACHE_DIR at a folder")
    if not path.is_dir():
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CacheError(f"OPS_CACHE_DIR: cannot create the cache folder {path} ({e.strerror}); point "
                             "OPS_CACHE_DIR at a writable folder") from None
    return path


def _lock_file(name: str) -> object | None:
    """The open lock file of build ``name``, or None where the cache cannot be written (a read-only cache: nothing
    can be built there, so no other process builds it either)."""
    locks = cache_dir() / "locks"
    try:
        locks.mkdir(exist_ok=True)
        return open(locks / f"{hashlib.sha256(name.encode()).hexdigest()[:24]}.lock", "w")
    except OSError as e:
        if e.errno in READ_ONLY:
            return None
        raise


@contextmanager
def built_once(name: str) -> Iterator[None]:
    """Hold the cache's lock named ``name`` while building the thing it names, and log the build's time.

    Processes that share the cache (pytest-xdist workers, the ranks of one host) then build each artifact once: the
    others wait and find it built. Where ``OPS_COMPILE_LOG`` names a file, each build appends a line to it: pid,
    seconds waited, seconds held, name (``scripts/gpu_check.sh`` sums it up).
    """
    import fcntl

    start = time.perf_counter()
    f = _lock_file(name)
    try:
        if f is not None:
            fcntl.flock(f, fcntl.LOCK_EX)   # released when f closes
        held = time.perf_counter()
        yield
        if log := os.environ.get("OPS_COMPILE_LOG"):
            with open(log, "a") as out:
                out.write(f"{os.getpid()}\t{held - start:.1f}\t{time.perf_counter() - held:.1f}\t{name}\n")
    finally:
        if f is not None:
            f.close()


def _checksum_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verified(path: Path) -> bool:
    """Whether ``path`` is there and matches the checksum published with it. One that does not (truncated, garbled,
    half-written, or from before checksums) is removed where the cache is writable, with a line saying so."""
    if not path.is_file():
        return False
    record = _checksum_path(path)
    try:
        if record.read_text().strip() == _sha256(path):
            return True
    except OSError:
        pass
    print(f"ops: {path} does not match its checksum (damaged or unfinished); building it again", file=sys.stderr)
    for p in (path, record):
        try:
            p.unlink()
        except OSError:
            pass   # a read-only cache: built_file names the folder
    return False


def publish(staged: Path, path: Path) -> None:
    """Move ``staged`` to ``path`` atomically, its checksum first (a reader never finds the file without it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = _checksum_path(path)
    tmp = record.with_name(f".{record.name}.{os.getpid()}.tmp")
    tmp.write_text(_sha256(staged) + "\n")
    os.replace(tmp, record)
    os.replace(staged, path)


def staging_dir() -> Path:
    """A fresh staging folder of this process in the cache (``sweep`` removes those of dead processes)."""
    return Path(tempfile.mkdtemp(prefix=f".staging-{os.getpid()}-", dir=cache_dir()))


def built_file(path: Path, name: str, make: Callable[[Path], None]) -> Path:
    """``path``, verified; else made by ``make(staged)`` (which writes the artifact at ``staged``, a file of
    ``path``'s name in a staging folder) under the cache's lock ``name`` and published.

    Raises:
        CacheError: the cache is read-only and ``path`` is not built there.
    """
    if verified(path):
        touch(path)
        return path
    sweep()
    with built_once(name):
        if verified(path):
            return path
        try:
            staging = staging_dir()
        except OSError as e:
            if e.errno in READ_ONLY:
                raise CacheError(f"OPS_CACHE_DIR: the cache folder {cache_dir()} is read-only and {name} is not "
                                 "built there; point OPS_CACHE_DIR at a writable folder") from None
            raise
        try:
            make(staging / path.name)
            publish(staging / path.name, path)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return path


def touch(path: Path) -> None:
    """Mark ``path`` used now (the sweep's least recently used order); nothing on a read-only cache."""
    try:
        os.utime(path)
    except OSError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_swept = False


def sweep(force: bool = False) -> list[Path]:
    """Remove (once per process, or now with ``force``) what no build will use again: staging folders of dead
    processes; packages and PTX of other toolchains; past ``KEEP`` builds of a kind, the least recently used; lock
    files. Nothing used within ``IN_USE_S``. Returns the build folders it removed."""
    global _swept
    if _swept and not force:
        return []
    _swept = True
    root, removed, now = cache_dir(), [], time.time()
    for staging in root.glob(".staging-*"):
        pid = staging.name.split("-")[1]
        if pid.isdigit() and not _alive(int(pid)):
            removed.append(staging)
    for kind, folders in _builds(root).items():
        current = [f for f in folders if _of_this_toolchain(kind, f.name)]
        removed += [f for f in folders if f not in current and now - _used(f) > IN_USE_S]
        current.sort(key=_used, reverse=True)
        removed += [f for f in current[KEEP[kind]:] if now - _used(f) > IN_USE_S]
    locks = root / "locks"
    stale_locks = [f for f in locks.glob("*.lock") if now - f.stat().st_mtime > IN_USE_S] if locks.is_dir() else []
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    for lock in stale_locks:   # one per build ever made; a lock taken again is made again
        try:
            lock.unlink(missing_ok=True)
        except OSError:
            pass   # a read-only cache
    return removed


def _builds(root: Path) -> dict[str, list[Path]]:
    """The cache's build folders by kind: packages (``<digest>-<toolchain>``, or a bare digest from before), PTX
    (``ptx/<digest>-mojo<version>-<target>``) and C++ launchers (``native/<key>``)."""
    packages = [f for f in root.iterdir() if f.is_dir() and len(f.name) >= 20
                and all(c in "0123456789abcdef" for c in f.name[:20])]
    return {"packages": packages,
            "ptx": [f for f in (root / "ptx").glob("*") if f.is_dir()] if (root / "ptx").is_dir() else [],
            "native": [f for f in (root / "native").glob("*") if f.is_dir()] if (root / "native").is_dir() else []}


def _of_this_toolchain(kind: str, name: str) -> bool:
    if "unknown" in toolchain():
        return True   # a machine running builds made elsewhere cannot tell them apart: keep them
    if kind == "packages":
        return name.endswith("-" + toolchain())
    if kind == "ptx":
        return f"-mojo{tool_version('mojo')}-" in name
    return True   # the C++ launcher's key holds torch's version


def _used(folder: Path) -> float:
    """When a build folder was last used: its newest file's time (``touch`` marks a use)."""
    times = [f.stat().st_mtime for f in folder.iterdir() if f.is_file()]
    return max(times, default=folder.stat().st_mtime)


def clean() -> int:
    """Empty the cache folder (``poe clean-cache``); the next call builds what it needs. Returns the bytes freed."""
    root = cache_dir()
    freed = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    for entry in root.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    return freed


def main(argv: list[str]) -> int:
    """``python -m ops.launch.cache clean``: empty the cache; ``sweep``: sweep it now."""
    if argv == ["clean"]:
        print(f"ops: removed {clean() / 2**20:.1f} MiB from {cache_dir()}")
        return 0
    if argv == ["sweep"]:
        print("\n".join(f"ops: removed {p}" for p in sweep(force=True)) or "ops: nothing to sweep")
        return 0
    print("usage: python -m ops.launch.cache clean|sweep", file=sys.stderr)
    return 4


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
