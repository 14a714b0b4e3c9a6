"""Mojo packages built once per content digest, in the project's build cache; no torch here.

``compile_package`` runs ``mojo precompile`` into a folder named by the digest of the package's ``.mojo`` files,
so an edited kernel never reuses an old build and an unchanged one is built once per machine. Processes that
share the cache take a lock per build (``built_once``). ``precompile_soon`` starts packages building in a
thread, so that a program can import torch meanwhile (the puzzle's runner does).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

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


def cache_dir() -> Path:
    """The project's build cache (packages, PTX, the C++ launcher, saved modules): ``OPS_CACHE_DIR``, else a
    folder of this user's in the system's temporary directory."""
    base = os.environ.get("OPS_CACHE_DIR") or Path(tempfile.gettempdir()) / f"ops_cache_{os.getuid()}"
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def built_once(name: str) -> Iterator[None]:
    """Hold the cache's lock named ``name`` while building the thing it names, and log the build's time.

    Processes that share the cache (pytest-xdist workers, the ranks of one host) then build each package,
    graph or library once: the others wait, and find it in the cache (the graph in MAX's own, ~/.cache/modular)
    at a few seconds' cost instead of compiling it again at the same time. Where ``OPS_COMPILE_LOG`` names a
    file, each build appends a line to it: pid, seconds waited, seconds held, name (``scripts/gpu_check.sh``
    sums it up).
    """
    import fcntl

    locks = cache_dir() / "locks"
    locks.mkdir(exist_ok=True)
    start = time.perf_counter()
    with open(locks / f"{hashlib.sha256(name.encode()).hexdigest()[:24]}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)   # released when f closes
        held = time.perf_counter()
        yield
        if log := os.environ.get("OPS_COMPILE_LOG"):
            now = time.perf_counter()
            with open(log, "a") as out:
                out.write(f"{os.getpid()}\t{held - start:.1f}\t{now - held:.1f}\t{name}\n")


def built_file(path: Path, name: str, make: Callable[[], None]) -> Path:
    """``path``, made by ``make`` under the cache's lock ``name`` (``built_once``) unless it is there already or
    another process made it while this one waited for the lock."""
    if not path.is_file():
        with built_once(name):
            if not path.is_file():
                make()
    return path


def compile_package(package: Path) -> Path:
    """Return a ``.mojoc`` built from ``package`` as it is on disk now.

    The file lives under a directory named by the content digest, so an
    edited kernel never reuses an old build and an unchanged one is built once
    per machine (not once per graph, as MAX does for source directories).
    """
    package = Path(package).resolve()
    if not (package / "__init__.mojo").is_file():
        raise ValueError(f"package: {package} is not a Mojo package (no __init__.mojo)")
    digest = package_digest(package)
    final = cache_dir() / digest / f"{package.name}.mojoc"
    return built_file(final, f"package {final}", lambda: _precompile(package, final, digest))


def _precompile(package: Path, final: Path, digest: str) -> None:
    """``mojo precompile package`` into ``final``, published by an atomic rename."""
    from mojo.run import subprocess_run_mojo

    # The compiler bakes the file stem in as the module name, so the staging
    # copy must already carry the final file name; publish by atomic rename.
    staging = cache_dir() / f".staging-{digest}-{os.getpid()}"
    staging.mkdir(parents=True, exist_ok=True)
    built = staging / final.name
    proc = subprocess_run_mojo(["precompile", str(package), "-o", str(built)],
                               capture_output=True, text=True)
    if proc.returncode != 0:
        raise MojoCompileError(f"mojo precompile {package} failed:\n{proc.stdout}{proc.stderr}",
                               log=proc.stdout + proc.stderr, stage="package")
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(built, final)
    staging.rmdir()


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
            except (MojoCompileError, OSError, ValueError):
                pass   # compile_package raises it again where the package is needed

    thread = threading.Thread(target=build, name="precompile", daemon=True)
    thread.start()
    return thread
