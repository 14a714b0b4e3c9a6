"""The p22 CPU kernels called without MAX: what ``p22 --check`` checks a package's CPU kernels through.

``P22Cpu(package)`` has the interface of ``P22Kernels`` that ``kernel_cases`` calls (``layernorm``, ``transpose``,
``matmul``, ``bias_add``, ``fused_op(variant)``, each returning a tuple of outputs), for float32 CPU tensors. Each
call runs the op's own ``execute`` for the CPU target, the code MAX runs, through a small shared library that
``mojo build`` makes from the package: one exported C function per op that wraps its pointers and sizes in the
tensor views ``execute`` takes. That build costs about 3.5 s on a 2-core machine where a MAX compile of the package's
CPU ops costs 7-8 s (17-19 s on the lent GPU machine's host); ``--unfused`` and ``--fused`` keep MAX, the route they
time. Outputs are NaN-poisoned first where ``bridge.poison_outputs`` says so.
"""

from __future__ import annotations

import ctypes
import hashlib
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from ops.launch import bridge
from ops.launch.cache import built_file, cache_dir, toolchain
from ops.launch.packages import MojoCompileError, package_digest

# Each op: (its file, its struct, the rank of its output and then of each input, in execute's order)
OPS = {
    "p22_layernorm": ("layernorm", "P22LayerNorm", (3, 3, 1, 1)),
    "p22_transpose": ("transpose", "P22Transpose", (2, 2)),
    "p22_matmul": ("matmul", "P22Matmul", (3, 3, 2)),
    "p22_bias_add": ("bias_add", "P22BiasAdd", (3, 3, 1)),
    "p22_fused_naive": ("fused", "P22FusedNaive", (3, 3, 1, 1, 2, 1)),
    "p22_fused": ("fused", "P22Fused", (3, 3, 1, 1, 2, 1)),
}
LIBRARY_NAME = "libp22_cpu.so"


def harness_source(package: str, ops: list[str]) -> str:
    """The Mojo source of the shared library: for each op, ``<op>(addrs, dims) -> status`` where ``addrs`` points to
    the output's and each input's address and ``dims`` to their sizes, one after another (0: done; 1: ``execute``
    raised)."""
    lines = ["from extensibility import ManagedTensorSlice, IOSpec",
             "from extensibility.managed_tensor_slice import StaticTensorSpec, _IndexListToTileLayout",
             "from max.gpu.host import DeviceContext",
             "from std.memory import AddressSpace",
             "from std.sys import align_of",
             "from std.utils import IndexList"]
    lines += [f"from {package}.{OPS[op][0]} import {OPS[op][1]}" for op in ops]
    lines += ["", "comptime F = Pointer[Float32, MutAnyOrigin]", "comptime I = Pointer[Int, MutAnyOrigin]"]
    for rank in (1, 2, 3):   # row-major float32 views of any size
        sizes, strides = ", ".join(["-1"] * rank), ", ".join(["-1"] * (rank - 1) + ["1"])
        lines.append(f"comptime S{rank} = StaticTensorSpec[DType.float32, {rank}, static_layout=_IndexListToTileLayout["
                     f"IndexList[{rank}]({sizes}), IndexList[{rank}]({strides})]](align_of[DType.float32](), "
                     "AddressSpace.GENERIC)")
    for op in ops:
        _, struct, ranks = OPS[op]
        views, at = [], 0
        for i, rank in enumerate(ranks):
            kind = "mut=True, io_spec=IOSpec.MutableInput" if i == 0 else "io_spec=IOSpec.Input"
            dims = ", ".join(f"d[unsafe_offset={at + j}]" for j in range(rank))
            views.append(f"            ManagedTensorSlice[{kind}, static_spec=S{rank}]("
                         f"F(unsafe_from_address=a[unsafe_offset={i}]), IndexList[{rank}]({dims})),")
            at += rank
        lines += ["", "", "@export", f"def {op}(addrs: Int, dims: Int) abi(\"C\") -> Int:",
                  "    var a = I(unsafe_from_address=addrs)", "    var d = I(unsafe_from_address=dims)", "    try:",
                  f"        {struct}.execute[target=\"cpu\"](", *views, "            DeviceContext(api=\"cpu\"),",
                  "        )", "    except:", "        return 1", "    return 0"]
    return "\n".join(lines) + "\n"


class P22Cpu:
    """A p22 package's CPU ops (float32), each its ``execute`` for the CPU, called through a shared library.

    Args:
        package: the package folder (``problems/p22/op`` or a copy).
        skip: op names not to build (their files do not compile).
    """

    def __init__(self, package: Path, skip: frozenset[str] = frozenset()) -> None:
        self.package = Path(package).resolve()
        self.ops = [op for op in OPS if op not in skip]
        self._lib: ctypes.CDLL | None = None

    def path(self) -> Path:
        """The library's place in the cache: named by the package's digest, the toolchain and the ops it holds."""
        ops = hashlib.sha256(",".join(self.ops).encode()).hexdigest()[:8]
        return cache_dir() / "p22_cpu" / f"{package_digest(self.package)}-{ops}-{toolchain()}" / LIBRARY_NAME

    def build(self) -> None:
        """Build the library (cached by the package's digest) and load it.

        Raises:
            MojoCompileError: the package does not compile; its ``log`` has the compiler's file:line:col errors.
        """
        path = self.path()
        self._lib = ctypes.CDLL(str(built_file(path, f"p22 cpu harness {path.parent.name}", self._make)))
        for op in self.ops:
            fn = getattr(self._lib, op)
            fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_void_p, ctypes.c_void_p]

    def _make(self, staged: Path) -> None:
        from mojo.run import subprocess_run_mojo

        with tempfile.TemporaryDirectory() as tmp:
            source = Path(tmp) / "p22_cpu.mojo"
            source.write_text(harness_source(self.package.name, self.ops))
            proc = subprocess_run_mojo(["build", "--emit", "shared-lib", "-I", str(self.package.parent), str(source),
                                        "-o", str(staged)], capture_output=True, text=True)
        if proc.returncode != 0:
            log = proc.stdout[-2000:] + proc.stderr
            raise MojoCompileError(f"p22 CPU harness build failed:\n{log}", log=log)

    def _call(self, op: str, out: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor]:
        if self._lib is None:
            self.build()
        tensors = (out, *inputs)
        for t in tensors:
            if t.device.type != "cpu" or t.dtype != torch.float32:
                raise ValueError(f"p22 CPU harness: expected float32 CPU tensors, got {t.dtype} {t.device}")
        tensors = tuple(t.contiguous() for t in tensors)
        addrs = (ctypes.c_int64 * len(tensors))(*(t.data_ptr() for t in tensors))
        sizes = [s for t in tensors for s in t.shape]
        dims = (ctypes.c_int64 * len(sizes))(*sizes)
        if getattr(self._lib, op)(ctypes.addressof(addrs), ctypes.addressof(dims)) != 0:
            raise RuntimeError(f"{op}: its execute raised on the CPU")
        return (tensors[0],)

    def _out(self, *shape: int) -> torch.Tensor:
        return bridge.output(shape, torch.float32, "cpu")

    def layernorm(self, x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor]:
        return self._call("p22_layernorm", self._out(*x.shape), x, gamma, beta)

    def transpose(self, w: torch.Tensor) -> tuple[torch.Tensor]:
        return self._call("p22_transpose", self._out(w.shape[1], w.shape[0]), w)

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor]:
        return self._call("p22_matmul", self._out(a.shape[0], a.shape[1], b.shape[1]), a, b)

    def bias_add(self, c: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor]:
        return self._call("p22_bias_add", self._out(*c.shape), c, bias)

    def fused_op(self, variant: str = "tiled") -> Callable[..., tuple[torch.Tensor]]:
        """The fused op: "tiled" (``p22_fused``) or "naive" (``p22_fused_naive``)."""
        op = "p22_fused" if variant == "tiled" else "p22_fused_naive"

        def run(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, w: torch.Tensor,
                bias: torch.Tensor) -> tuple[torch.Tensor]:
            return self._call(op, self._out(x.shape[0], x.shape[1], w.shape[0]), x, gamma, beta, w, bias)
        return run
