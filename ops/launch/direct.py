"""The direct launcher: our Mojo kernels, compiled ahead to PTX, launched on torch's current CUDA stream.

The MAX graph route (``ops/launch/bridge.py``) costs 40-150 us of host time per call; a driver launch costs a few.
This module:

* compiles each kernel instantiation (a Mojo function with every compile-time parameter bound, a
  ``KernelSpec``) to PTX for the GPU's architecture with ``std.compile.compile_info`` in one
  ``mojo run`` per batch, into a cache keyed by the kernel package's content digest, the Mojo version and
  the target (an edited kernel is never stale); built lazily on first use with a progress line, or up front
  by ``poe build-kernels`` (``python -m ops.build_kernels``), on any machine, GPU or not;
* loads it with NVIDIA's ``cuda-core`` (``ObjectCode.from_ptx``) once per device;
* launches it with ``cuda-bindings``' ``cuLaunchKernel`` on ``torch.cuda.current_stream()`` (so it is
  ordered with torch's work and captured by ``torch.cuda.graph``), its arguments packed into one reused
  buffer (clustered launches go through ``cuda.core.launch``).

The launch configuration comes from each op's config module (the one that gives the MAX ops their parameters);
the plans made from it go to the C++ entries through ``plans.py``. Design note: docs/direct_launch.md.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import struct
import sys
import threading
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

from ops.launch.cache import built_file, cache_dir, verified
from ops.launch.ptx import KernelSpec, NoBuildError, build, entry_name, ptx_path, target_for

# --------------------------------------------------------------------------
# Loading and launching.
# --------------------------------------------------------------------------

_ARG_FORMAT = {"p": ("Q", 8, 8), "i": ("i", 4, 4), "f": ("f", 4, 4), "t": ("128s", 128, 64)}


def arg_layout(args: str) -> tuple[str, list[int], int]:
    """struct format (explicit padding), each argument's offset, and the total size."""
    fmt, offsets, at = "<", [], 0
    for a in args:
        code, size, align = _ARG_FORMAT[a]
        pad = -at % align
        fmt += "x" * pad
        at += pad
        offsets.append(at)
        fmt += code
        at += size
    return fmt, offsets, at


class Kernel:
    """One kernel loaded on one device; ``launch`` enqueues it on a raw CUDA stream handle."""

    def __init__(self, spec: KernelSpec, device_index: int, smem_max: int = 0) -> None:
        from cuda.bindings import driver
        from cuda.core import Device, ObjectCode

        name, _ = target_for(torch.cuda.get_device_capability(device_index))
        path = ptx_path(spec, name)
        if not verified(path):
            build([spec], name)
        ptx = path.read_text()
        # The library kernel's function in this device's primary context (torch's): launching a CUfunction
        # skips the driver's per-launch lookup of a context-less CUkernel. The thread's context is put back
        # after: left on another device, torch's next runtime calls (a graph capture's) would go there.
        previous = _unwrap(driver.cuCtxGetCurrent())
        Device(device_index).set_current()
        try:
            self.kernel = ObjectCode.from_ptx(ptx.encode(), name=spec.name).get_kernel(entry_name(ptx))
            self.function = _unwrap(driver.cuKernelGetFunction(self.kernel.handle))
        finally:
            _check(driver.cuCtxSetCurrent(previous))
        if smem_max > 48 * 1024:
            _check(driver.cuKernelSetAttribute(
                driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_max,
                self.kernel.handle, device_index))
        self.spec = spec
        self.device_index = device_index
        self._fmt, offsets, size = arg_layout(spec.args)
        self._buffer = ctypes.create_string_buffer(max(size, 8) + 64)
        base = (ctypes.addressof(self._buffer) + 63) // 64 * 64   # 64-byte aligned, as a TMA descriptor wants
        self._base = base - ctypes.addressof(self._buffer)
        self._pointers = (ctypes.c_void_p * max(len(offsets), 1))(*[base + o for o in offsets])
        self._params = ctypes.addressof(self._pointers)
        self._lock = threading.Lock()
        self._launch = driver.cuLaunchKernel

    def launch(self, stream: int, grid: tuple[int, int, int], block: int | tuple[int, int, int], smem: int,
               *args: object) -> None:
        """Enqueue on ``stream`` (a raw handle); ``block``: threads, or (x, y, z); ``args`` as ``spec.args`` says
        (pointers as ints)."""
        bx, by, bz = (block, 1, 1) if block.__class__ is int else block
        with self._lock:
            struct.pack_into(self._fmt, self._buffer, self._base, *args)
            err, = self._launch(self.function, grid[0], grid[1], grid[2], bx, by, bz, smem, stream, self._params, 0)
            if err == _INVALID_CONTEXT:   # a thread torch has not made the device current on (the legacy stream)
                from cuda.core import Device

                Device(self.device_index).set_current()
                err, = self._launch(self.function, grid[0], grid[1], grid[2], bx, by, bz, smem, stream,
                                    self._params, 0)
        if err:
            _check((err,))

    def launch_cluster(self, stream: int, clusters: int, cluster: int, block: int, *args: object) -> None:
        """Enqueue ``clusters`` clusters of ``cluster`` blocks (cuda.core's launch sets the attribute)."""
        import numpy as np
        from cuda.core import LaunchConfig, Stream, launch

        conv = {"p": int, "i": np.int32, "f": np.float32}
        values = [conv[a](v) for a, v in zip(self.spec.args, args, strict=True)]
        launch(Stream.from_handle(stream), LaunchConfig(grid=clusters, cluster=cluster, block=block), self.kernel,
               *values)


def _unwrap(result: tuple) -> object:
    """The value of a cuda-bindings ``(error, value)`` result, raising on an error."""
    _check(result)
    return result[1]


def _check(result: tuple) -> None:
    err = result[0]
    if int(err) != 0:
        from cuda.bindings import driver

        _, text = driver.cuGetErrorString(err)
        raise RuntimeError(f"CUDA driver error {int(err)}: {text.decode() if text else err}")


def _invalid_context() -> object:
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    return driver.CUresult.CUDA_ERROR_INVALID_CONTEXT


_INVALID_CONTEXT = _invalid_context()
# Loaded kernels are kept for the process: the C++ plan tables hold their CUfunctions as raw pointers.
_kernels: dict[tuple[KernelSpec, int], Kernel] = {}


def kernel(spec: KernelSpec, device_index: int, smem_max: int = 0) -> Kernel:
    """``spec`` loaded on device ``device_index`` (built and loaded on first use, then kept)."""
    k = _kernels.get((spec, device_index))
    if k is None:
        k = _kernels[(spec, device_index)] = Kernel(spec, device_index, smem_max)
    return k


# torch's private getter of the current device (torch.cuda.current_device() without its checks; CUDA is
# initialised by the time a CUDA tensor reaches us).
_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
# torch's private getter of the current stream's raw handle (no torch.cuda.Stream object per call).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(device_index: int) -> int:
    """torch's current CUDA stream on the device, as a raw handle."""
    if _raw_stream is None:
        return torch.cuda.current_stream(device_index).cuda_stream
    return _raw_stream(device_index)


class on_device:
    """``with on_device(index) as stream``: torch's current stream on CUDA device ``index``, with that device
    current for the launches inside (only switched, and switched back, when another one is current)."""

    __slots__ = ("index", "guard")

    def __init__(self, index: int) -> None:
        self.index = index
        self.guard = None

    def __enter__(self) -> int:
        if _current_device() != self.index:
            self.guard = torch.cuda.device(self.index)
            self.guard.__enter__()
        return current_stream(self.index)

    def __exit__(self, *exc: object) -> None:
        if self.guard is not None:
            self.guard.__exit__(*exc)


# --------------------------------------------------------------------------
# The C++ host side (ops/launch/direct.cpp): the eager calls' allocation, launch and autograd node in C++.
# --------------------------------------------------------------------------

NATIVE_SOURCE = Path(__file__).resolve().parent / "direct.cpp"   # one translation unit: it includes the parts
NATIVE_PARTS = Path(__file__).resolve().parent / "native"        # ... by concern, ops/launch/native/*.h


_native_lock = threading.Lock()   # one build and load of the C++ library per process


class NativeBuildError(RuntimeError):
    """The C++ launcher could not be built here (no compiler, or the compile failed)."""


class NativeOps:
    """The loaded C++ entries (``torch.ops.mojo_direct``), or None in each while they are not loaded.

    ``layernorm`` and ``layernorm_linear`` are the ops' bound callables (no Python frame per call); they
    return None for a call they do not take (see the .cpp's header), and the caller runs its Python route.
    """

    layernorm: object = None
    layernorm_with_stats: object = None
    layernorm_bwd_with_plan: object = None
    layernorm_linear: object = None
    rms_norm: object = None
    rms_norm_linear: object = None
    add_norm: object = None
    layernorm_linear_with_stats: object = None
    linear: object = None         # the unfused route's Linear by cuBLASLt (y; torch's ops where it does not take it)
    linear_grads: object = None   # and its backward (dxn, dweight, dbias)
    layernorm_linear_act: object = None   # act(Linear(LayerNorm(x))), one C++ autograd node, or None (not taken)
    linears: object = None   # several Linears of one input, one C++ autograd node, or [] (not taken)
    ops: object = None


NATIVE = NativeOps()
_native_tried = False


def native_library_path() -> Path:
    """Where the C++ library built from ``NATIVE_SOURCE`` and its parts for this torch lives (named by the sources'
    digest, torch's version and C++ ABI: torch's C++ API is not stable across versions, so it is built per torch)."""
    key = hashlib.sha256(NATIVE_SOURCE.read_bytes())
    for part in sorted(NATIVE_PARTS.glob("*.h")):
        key.update(part.name.encode() + part.read_bytes())
    key.update(f"{torch.__version__}-{torch._C._GLIBCXX_USE_CXX11_ABI}".encode())
    return cache_dir() / "native" / key.hexdigest()[:24] / "mojo_direct.so"


def build_native(quiet: bool = False) -> Path:
    """Compile ``NATIVE_SOURCE`` against the installed torch (about 15 s, once per source and torch version).

    Raises:
        NativeBuildError: no C++ compiler, or the compile failed (its output in the message).
    """
    path = native_library_path()
    return built_file(path, f"native {path}", lambda staged: _compile_native(staged, quiet))


def _compile_native(path: Path, quiet: bool) -> None:
    """``build_native``'s compile into ``path`` (a staging file ``built_file`` publishes)."""
    import shutil
    import subprocess

    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise NativeBuildError("no C++ compiler (c++ or g++ on PATH, or CXX)")
    libs = cpp_extension.library_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [compiler, "-O2", "-std=c++20", "-fPIC", "-shared", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           *(f"-I{d}" for d in cpp_extension.include_paths()), f"-I{NATIVE_PARTS.parent}", str(NATIVE_SOURCE),
           *(f"-L{d}" for d in libs), "-lc10", "-ltorch_cpu", "-ltorch", *(f"-Wl,-rpath,{d}" for d in libs), "-ldl"]
    if not quiet:
        print(f"ops: building the C++ launcher {NATIVE_SOURCE.name} (once per torch version) ...", file=sys.stderr)
    proc = subprocess.run([*cmd, "-o", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise NativeBuildError(f"building {NATIVE_SOURCE} failed:\n{' '.join(cmd)}\n{proc.stderr[-4000:]}")


def load_native() -> NativeOps:
    """Build (if needed) and load the C++ entries into ``NATIVE``; tried once per process. Where it cannot be
    built (no compiler) or ``OPS_NATIVE=0``, ``NATIVE``'s entries stay None and the Python route runs
    (a warning says why)."""
    global _native_tried
    with _native_lock:
        if _native_tried:
            return NATIVE
        _native_tried = True
        if os.environ.get("OPS_NATIVE", "1") == "0":
            return NATIVE
        try:
            torch.ops.load_library(str(build_native()))
        except (NativeBuildError, OSError, RuntimeError) as e:
            import warnings

            warnings.warn(f"ops: the C++ launcher is not available, calls take the Python route: {e}", stacklevel=2)
            return NATIVE
        ops = torch.ops.mojo_direct
        NATIVE.ops = ops
        from ops.launch import bridge

        ops.set_poison(bool(bridge.poison_outputs))
        for configure in _on_load:   # the ops' tuning of the C++ side (on_native_load)
            configure(ops)
        # the overloads' own callables: no OpOverload.__call__ frame per call
        NATIVE.layernorm = getattr(ops.layernorm.default, "_op", ops.layernorm.default)
        NATIVE.rms_norm = getattr(ops.rms_norm.default, "_op", ops.rms_norm.default)
        NATIVE.rms_norm_linear = getattr(ops.rms_norm_linear.default, "_op", ops.rms_norm_linear.default)
        NATIVE.add_norm = getattr(ops.add_norm.default, "_op", ops.add_norm.default)
        NATIVE.layernorm_with_stats = getattr(ops.layernorm_with_stats.default, "_op",
                                              ops.layernorm_with_stats.default)
        NATIVE.layernorm_bwd_with_plan = getattr(ops.layernorm_bwd_with_plan.default, "_op",
                                                 ops.layernorm_bwd_with_plan.default)
        NATIVE.layernorm_linear = getattr(ops.layernorm_linear.default, "_op", ops.layernorm_linear.default)
        NATIVE.layernorm_linear_with_stats = getattr(ops.layernorm_linear_with_stats.default, "_op",
                                                     ops.layernorm_linear_with_stats.default)
        NATIVE.linear = getattr(ops.linear.default, "_op", ops.linear.default)
        NATIVE.linear_grads = getattr(ops.linear_grads.default, "_op", ops.linear_grads.default)
        NATIVE.layernorm_linear_act = getattr(ops.layernorm_linear_act.default, "_op",
                                              ops.layernorm_linear_act.default)
        NATIVE.linears = getattr(ops.linears.default, "_op", ops.linears.default)
    return NATIVE


_on_load: list[Callable[[object], None]] = []


def on_native_load(configure: Callable[[object], None]) -> None:
    """Call ``configure(torch.ops.mojo_direct)`` once the C++ entries are loaded, or now if they are: how an op
    module hands its tuning to the C++ side (the op imports this module, never the other way round)."""
    with _native_lock:
        if NATIVE.ops is None:
            _on_load.append(configure)
            return
    configure(NATIVE.ops)


_faked: set[str] = set()


def traceable(fakes: dict[str, Callable[..., object]]) -> bool:
    """Whether the C++ ops are loaded (the first call builds and loads them), with ``fakes`` (op name in
    ``mojo_direct`` -> fake implementation, for torch.compile's tracing) registered, each once."""
    if load_native().ops is None:
        return False
    for name, fake in fakes.items():
        if name not in _faked:
            _faked.add(name)
            torch.library.register_fake(f"mojo_direct::{name}")(fake)
    return True


def set_poison(on: bool) -> None:
    """Whether the C++ entries fill their outputs with NaN first (tests; ``bridge.poison_outputs`` for Python)."""
    if NATIVE.ops is not None:
        NATIVE.ops.set_poison(on)


# OPS_ROUTE=graph sends every op through the MAX graph route (tests and the bitwise comparison use it).
ROUTE = os.environ.get("OPS_ROUTE", "direct")


@cache
def _available(device_index: int) -> bool:
    try:
        import cuda.bindings.driver  # noqa: F401
        import cuda.core  # noqa: F401
    except ImportError:
        return False
    try:
        target_for(torch.cuda.get_device_capability(device_index))
    except NoBuildError:
        return False
    return True


def available(device: torch.device) -> bool:
    """Whether ops on ``device`` launch directly: a CUDA device of an architecture we build for, with
    cuda-core and cuda-bindings installed, and ``OPS_ROUTE`` not ``graph``."""
    return device.type == "cuda" and ROUTE != "graph" and _available(device.index or 0)


def launches(x: torch.Tensor) -> bool:
    """Whether a call on ``x`` launches directly now: ``x`` is on a device ``available`` names, and torch.compile
    is not tracing (it traces the custom ops instead)."""
    return x.is_cuda and not torch.compiler.is_compiling() and available(x.device)


