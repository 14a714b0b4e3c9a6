"""Mojo packages built once per content digest, in the project's build cache; no torch here.

``compile_package`` runs ``mojo precompile`` into a folder named by the digest of the package's ``.mojo`` files and
the toolchain's versions, so an edited kernel or a new Mojo never reuses an old build and an unchanged one is built
once per machine (``ops/launch/cache.py``: locks, checksums, the read-only case, the sweep). ``precompile_soon``
starts packages building in a thread, so that a program can import torch meanwhile (the puzzle's runner does).
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

from ops.launch import cache

_digests: dict[Path, str] = {}


def package_digest(package: Path) -> str:
    """SHA-256 over the relative paths and bytes of every .mojo file in ``package``.

    Memoised per process (the hot path must not re-read sources on every
    call); ``clear_caches()`` forgets it, and every new process re-reads.
    """
    package = Path(package)
    digest = _digests.get(package)
    if digest is None:
        digest = _digests[package] = _hash_sources(package)
    return digest


def _hash_sources(package: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(package.rglob("*.mojo")):
        h.update(str(f.relative_to(package)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:20]


def compile_package(package: Path) -> Path:
    """Return a ``.mojoc`` built from ``package`` as it is on disk now.

    The file lives under a directory named by the content digest, so an
    edited kernel never reuses an old build and an unchanged one is built once
    per machine (not once per graph, as MAX does for source directories).
    """
    package = Path(package).resolve()
    if not (package / "__init__.mojo").is_file():
        raise ValueError(f"package: {package} is not a Mojo package (no __init__.mojo)")
    final = cache.cache_dir() / f"{package_digest(package)}-{cache.toolchain()}" / f"{package.name}.mojoc"
    return cache.built_file(final, f"package {final}", lambda staged: _precompile(package, staged))


def _precompile(package: Path, staged: Path) -> None:
    """``mojo precompile package`` into ``staged`` (a file of the final name: the compiler bakes the file stem in as
    the module name)."""
    from mojo.run import subprocess_run_mojo

    proc = subprocess_run_mojo(["precompile", str(package), "-o", str(staged)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise MojoCompileError(f"mojo precompile {package} failed:\n{proc.stdout}{proc.stderr}",
                               log=proc.stdout + proc.stderr, stage="package")


class MojoCompileError(RuntimeError):
    """A Mojo package or graph failed to compile.

    ``log`` holds the compiler's own messages; ``stage`` is "package" when the package itself does not compile
    (``mojo precompile``: nothing in it can be built), "graph" when a graph of its ops does not.
    """

    def __init__(self, message: str, log: str = "", stage: str = "graph") -> None:
        super().__init__(message)
        self.log = log or message
        self.stage = stage


def forget_digests() -> None:
    """Forget the memoised digests (sources read again on the next call): for tests and ``clear_caches``."""
    _digests.clear()


def precompile_soon(*roots: Path) -> threading.Thread:
    """Start ``compile_package`` for every package below ``roots`` in a daemon thread, and return it. A later
    ``compile_package`` of the same package waits for it (the cache's lock) and finds it built; an error is
    left for that call to raise."""
    found = sorted({f.parent for root in roots for f in Path(root).rglob("__init__.mojo")})

    def build() -> None:
        for package in found:
            try:
                compile_package(package)
            except (MojoCompileError, cache.CacheError, OSError, ValueError):
                pass   # compile_package raises it again where the package is needed

    thread = threading.Thread(target=build, name="precompile", daemon=True)
    thread.start()
    return thread
