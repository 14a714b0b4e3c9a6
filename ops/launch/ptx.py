"""PTX for our kernels: each kernel instantiation (a Mojo function with every compile-time parameter bound, a
``KernelSpec``) compiled for a GPU architecture with ``std.compile.compile_info``, in one ``mojo run`` per batch,
into a cache keyed by the kernel package's content digest, the Mojo version and the target (an edited kernel is
never stale). Built lazily on first use, or up front by ``poe build-kernels``, on any machine, GPU or not. The
package is the library's (``ops/kernels``) unless a spec names another (the puzzle's, ``ops/puzzle/p22_direct.py``)."""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ops.launch.bridge import LIBRARY
from ops.launch.cache import READ_ONLY, CacheError, built_once, cache_dir, publish, tool_version, verified
from ops.launch.packages import MojoCompileError, package_digest

# CUDA compute capability -> (the target's name in max.gpu.host.info, the PTX target it writes).
TARGETS = {(8, 0): ("A100", "sm_80"), (8, 9): ("L4", "sm_89"), (9, 0): ("H100", "sm_90a"),
           (10, 0): ("B200", "sm_100a")}
TORCH_TO_MOJO = {torch.float32: "DType.float32", torch.float16: "DType.float16", torch.bfloat16: "DType.bfloat16"}


@dataclass(frozen=True)
class KernelSpec:
    """One kernel instantiation: ``module.name[params...]`` in the kernel package (``ops/kernels``).

    Args:
        module: the ``.mojo`` file's stem, e.g. ``"layernorm"``.
        name: the kernel function, e.g. ``"ln_fwd_regs"``.
        params: every compile-time parameter, in order: torch dtypes, bools and ints.
        args: the kernel's run-time arguments, one letter each: ``p`` pointer, ``i`` Int32, ``f`` Float32,
            ``t`` a 128-byte TMA descriptor.
        package: the Mojo package holding ``module`` (None: the library's, ``ops/kernels``).
    """

    module: str
    name: str
    params: tuple
    args: str
    package: Path | None = None

    @property
    def expr(self) -> str:
        """The instantiation as Mojo spells it, e.g. ``ln_fwd_regs[DType.bfloat16, 0, 8, 1, 8, 1]``."""
        def mojo(p: object) -> str:
            return TORCH_TO_MOJO[p] if isinstance(p, torch.dtype) else str(p)
        return f"{self.name}[{', '.join(mojo(p) for p in self.params)}]" if self.params else self.name


class NoBuildError(RuntimeError):
    """The GPU's architecture has no direct build (the graph route runs instead)."""


# --------------------------------------------------------------------------
# Building PTX.
# --------------------------------------------------------------------------

def target_for(capability: tuple[int, int]) -> tuple[str, str]:
    """(Mojo target name, PTX arch) for a compute capability; NoBuildError when we have none."""
    try:
        return TARGETS[capability]
    except KeyError:
        raise NoBuildError(f"no direct build for sm_{capability[0]}{capability[1]} "
                           f"(built: {', '.join(a for _, a in TARGETS.values())})") from None


def package_of(spec: KernelSpec) -> Path:
    return spec.package or LIBRARY


def ptx_dir(target: str, package: Path | None = None) -> Path:
    """Where PTX for ``target`` from the kernel package (None: the library's) as it is on disk now lives: named by
    the sources' digest, the Mojo version that compiled them and the target. Where Mojo is not installed (a GPU
    machine running PTX built elsewhere), the build of these sources by any Mojo version."""
    root, digest = cache_dir() / "ptx", package_digest(package or LIBRARY)
    if (mojo := tool_version("mojo")) is None:
        found = sorted(root.glob(f"{digest}-mojo*-{target}"))
        return found[-1] if found else root / f"{digest}-mojo-missing-{target}"
    return root / f"{digest}-mojo{mojo}-{target}"


def ptx_path(spec: KernelSpec, target: str) -> Path:
    digest = hashlib.sha256(spec.expr.encode()).hexdigest()[:16]
    return ptx_dir(target, package_of(spec)) / f"{spec.module}.{digest}.ptx"


MARK = "@@ops-kernel "


def emit_source(specs: Sequence[KernelSpec], target: str) -> str:
    """A Mojo program printing the PTX of each spec (all of one package) after a ``MARK`` line."""
    lines = ["from std.compile import compile_info", f"from max.gpu.host.info import {target}"]
    package = package_of(specs[0]).name
    for module in sorted({s.module for s in specs}):
        names = sorted({s.name for s in specs if s.module == module})
        lines.append(f"from {package}.{module} import {', '.join(names)}")
    lines.append("\ndef main():")
    for i, s in enumerate(specs):
        lines.append(f'    print("{MARK}{i}")')
        lines.append(f'    print(String(compile_info[{s.expr}, emission_kind="asm", target={target}.target]().asm))')
    return "\n".join(lines) + "\n"


_build_lock = threading.Lock()


def build(specs: Iterable[KernelSpec], target: str = "H100", quiet: bool = False) -> int:
    """Compile the specs whose PTX is not cached yet, in one ``mojo run`` per package; returns how many it built.

    Raises:
        MojoCompileError: a package's kernels do not compile (the compiler's log, with file:line:col).
    """
    specs = list(dict.fromkeys(specs))
    built = 0
    for package in dict.fromkeys(package_of(s) for s in specs):
        mine = [s for s in specs if package_of(s) == package]
        with _build_lock:
            if all(verified(ptx_path(s, target)) for s in mine):
                continue
            with built_once(f"ptx {ptx_dir(target, package)}"):
                built += _build_missing([s for s in mine if not verified(ptx_path(s, target))], target, quiet)
    return built


def _build_missing(missing: list[KernelSpec], target: str, quiet: bool) -> int:
    """``build``'s work on the specs whose PTX is missing, under its locks."""
    if not missing:
        return 0
    if not quiet:
        print(f"ops: compiling {len(missing)} GPU kernel(s) for {target} to PTX "
              f"(once per kernel source; cache {ptx_dir(target, package_of(missing[0]))})", file=sys.stderr,
              flush=True)
    from mojo.run import subprocess_run_mojo

    with tempfile.TemporaryDirectory() as tmp:
        emit = Path(tmp) / "emit_ptx.mojo"
        emit.write_text(emit_source(missing, target))
        proc = subprocess_run_mojo(["run", "-I", str(package_of(missing[0]).parent), str(emit)],
                                   capture_output=True, text=True)
    if proc.returncode != 0:
        log = proc.stdout[-2000:] + proc.stderr
        raise MojoCompileError(f"PTX build failed:\n{log}", log=log)
    parts = proc.stdout.split(MARK)[1:]
    if len(parts) != len(missing):
        raise MojoCompileError(f"PTX build printed {len(parts)} kernels, expected {len(missing)}")
    out = ptx_dir(target, package_of(missing[0]))
    try:
        out.mkdir(parents=True, exist_ok=True)
        for spec, part in zip(missing, parts, strict=True):
            ptx = part.split("\n", 1)[1]
            if ".entry" not in ptx:
                raise MojoCompileError(f"no kernel entry in the PTX of {spec.expr}")
            tmp_file = out / f".{os.getpid()}.tmp"
            tmp_file.write_text(ptx)
            publish(tmp_file, ptx_path(spec, target))
    except OSError as e:
        if e.errno in READ_ONLY:
            raise CacheError(f"OPS_CACHE_DIR: the cache folder {cache_dir()} is read-only and the PTX of "
                             f"{len(missing)} kernel(s) is not built there; point OPS_CACHE_DIR at a writable folder "
                             "(or build them there first: poe build-kernels)") from None
        raise
    return len(missing)


def entry_name(ptx: str) -> str:
    """The mangled kernel name from a PTX module's ``.visible .entry NAME(`` line."""
    start = ptx.index(".visible .entry ") + len(".visible .entry ")
    return ptx[start:ptx.index("(", start)]
