"""The p22 GPU kernels launched directly from their PTX, without MAX: what ``p22 --check`` can check a package's GPU
kernels through on a GPU machine, where a MAX compile of the package's GPU ops costs 15-21 s and the PTX of every
kernel about 2-4 s (``docs/learner_loop.md``).

``P22Direct(package)`` has the interface of ``P22Kernels`` that ``kernel_cases`` calls (``layernorm``,
``transpose``, ``matmul``, ``bias_add``, ``fused_op(variant)``, each returning a tuple of outputs), for float32 CUDA
tensors. Each launch is the one its op's ``execute`` makes on the GPU (the ``enqueue_function`` calls of the
package's ``.mojo`` files, which lie outside the fill-in regions): the same kernel, grid and block, with the tile
sizes read from the package's own source (``mojo_constants.constants_in``) and the fused kernel's tiles per block
chosen by its ``col_tiles``'s rule. Outputs are NaN-poisoned first where ``bridge.poison_outputs`` says so.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from ops.launch import bridge, direct
from ops.launch.mojo_constants import constants_in
from ops.launch.ptx import KernelSpec, build, target_for

# Each kernel: (file, function, its run-time arguments as KernelSpec.args spells them)
KERNELS = {
    "p22_layernorm": ("layernorm", "layernorm_kernel", "ppppi"),
    "p22_transpose": ("transpose", "transpose_kernel", "ppii"),
    "p22_matmul": ("matmul", "matmul_kernel", "pppiii"),
    "p22_bias_add": ("bias_add", "bias_add_kernel", "pppii"),
    "p22_fused_naive": ("fused", "fused_naive_kernel", "ppppppiii"),
    "p22_fused": ("fused", "fused_kernel", "ppppppiiii"),
}


def ceildiv(a: int, b: int) -> int:
    return -(-a // b)


class P22Direct:
    """A p22 package's GPU kernels (float32), built to PTX for the current GPU and launched on torch's stream.

    Args:
        package: the package folder (``problems/p22/op`` or a copy).
        skip: op names not to build (their files do not compile).
    """

    def __init__(self, package: Path, skip: frozenset[str] = frozenset()) -> None:
        self.package = Path(package).resolve()
        self.specs = {name: KernelSpec(module, fn, (torch.float32,), args, package=self.package)
                      for name, (module, fn, args) in KERNELS.items() if name not in skip}
        self.c = {k: v for m in ("tiles", "fused", "layernorm", "transpose", "bias_add")
                  for k, v in constants_in(self.package / f"{m}.mojo").items()}
        self._loaded: dict[tuple[str, int], direct.Kernel] = {}

    def build(self, target: str | None = None) -> None:
        """Compile every kernel's PTX for ``target`` (a name of ``ptx.TARGETS``; None: the current GPU's), cached by
        the package's digest.

        Raises:
            MojoCompileError: a kernel does not compile; its ``log`` has the compiler's file:line:col errors.
        """
        build(self.specs.values(), target or target_for(torch.cuda.get_device_capability())[0], quiet=True)

    def _kernel(self, name: str) -> direct.Kernel:
        """``name``'s kernel loaded on the current GPU by this object (not ``direct.kernel``'s process-wide table:
        an edited package is loaded again by the next ``P22Direct``, never found stale)."""
        index = torch.cuda.current_device()
        if (name, index) not in self._loaded:
            self._loaded[(name, index)] = direct.Kernel(self.specs[name], index)
        return self._loaded[(name, index)]

    def _launch(self, name: str, grid: tuple[int, ...], block: int | tuple[int, int, int], *args: object) -> None:
        stream = direct.current_stream(torch.cuda.current_device())
        self._kernel(name).launch(stream, (*grid, 1, 1)[:3], block, 0, *args)

    def _out(self, *shape: int) -> torch.Tensor:
        return bridge.output(shape, torch.float32, "cuda")

    def layernorm(self, x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor]:
        b, s, h = x.shape
        y = self._out(b, s, h)
        self._launch("p22_layernorm", (b, s), self.c["LN_BLOCK"], *_ptrs(y, x, gamma, beta), h)
        return (y,)

    def transpose(self, w: torch.Tensor) -> tuple[torch.Tensor]:
        rows, cols = w.shape
        wt, tile = self._out(cols, rows), self.c["TILE"]
        self._launch("p22_transpose", (ceildiv(cols, tile), ceildiv(rows, tile)), (tile, self.c["ROWS_PER_PASS"], 1),
                     *_ptrs(wt, w), rows, cols)
        return (wt,)

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor]:
        m, k, n = a.shape[0] * a.shape[1], a.shape[2], b.shape[1]
        c = self._out(a.shape[0], a.shape[1], n)
        self._launch("p22_matmul", (ceildiv(n, self.c["BN"]), ceildiv(m, self.c["BM"])), self._tile_block(),
                     *_ptrs(c, a, b), m, k, n)
        return (c,)

    def bias_add(self, c: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor]:
        y, total = self._out(*c.shape), c.numel()
        self._launch("p22_bias_add", (ceildiv(total, self.c["BIAS_BLOCK"]),), self.c["BIAS_BLOCK"],
                     *_ptrs(y, c, bias), total, c.shape[2])
        return (y,)

    def fused_op(self, variant: str = "tiled") -> Callable[..., tuple[torch.Tensor]]:
        """The fused kernel: "tiled" (``fused_kernel``) or "naive" (``fused_naive_kernel``)."""
        return self._fused_tiled if variant == "tiled" else self._fused_naive

    def _fused_naive(self, x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, w: torch.Tensor,
                     bias: torch.Tensor) -> tuple[torch.Tensor]:
        rows, k, n = x.shape[0] * x.shape[1], x.shape[2], w.shape[0]
        y = self._out(x.shape[0], x.shape[1], n)
        self._launch("p22_fused_naive", (ceildiv(rows, self.c["NAIVE_BLOCK"]),), self.c["NAIVE_BLOCK"],
                     *_ptrs(y, x, gamma, beta, w, bias), rows, k, n)
        return (y,)

    def _fused_tiled(self, x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, w: torch.Tensor,
                     bias: torch.Tensor) -> tuple[torch.Tensor]:
        rows, k, n = x.shape[0] * x.shape[1], x.shape[2], w.shape[0]
        y, ct = self._out(x.shape[0], x.shape[1], n), self.col_tiles(rows, n)
        self._launch("p22_fused", (ceildiv(n, self.c["BN"] * ct), ceildiv(rows, self.c["BM"])), self._tile_block(),
                     *_ptrs(y, x, gamma, beta, w, bias), rows, k, n, ct)
        return (y,)

    def _tile_block(self) -> tuple[int, int, int]:
        return (self.c["TN"], self.c["THREADS"] // self.c["TN"], 1)

    def col_tiles(self, rows: int, n: int) -> int:
        """fused.mojo's ``col_tiles`` (outside the fill-in regions): P22_FUSED_COL_TILES if set, else the count up to
        MAX_COL_TILES that minimises the busiest SM's time, for the blocks an SM holds at once."""
        try:
            return max(1, int(os.environ.get("P22_FUSED_COL_TILES", "")))
        except ValueError:
            pass
        from cuda.bindings import driver

        fn = self._kernel("p22_fused").function
        err, per_sm = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, self.c["THREADS"], 0)
        held = max(int(per_sm) if int(err) == 0 else 1, 1)
        sms = torch.cuda.get_device_properties().multi_processor_count
        strips, tiles = ceildiv(rows, self.c["BM"]), ceildiv(n, self.c["BN"])
        costs = {ct: ceildiv(strips * ceildiv(tiles, ct), sms * held) * held * (self.c["COST_SCALE"] * ct + 1)
                 for ct in range(1, min(self.c["MAX_COL_TILES"], tiles) + 1)}
        return min(costs, key=lambda ct: (costs[ct], ct))


def _ptrs(*tensors: torch.Tensor) -> list[int]:
    """Each tensor's device address (contiguous float32 CUDA tensors, as the kernels read them)."""
    for t in tensors:
        if not (t.is_cuda and t.is_contiguous() and t.dtype == torch.float32):
            raise ValueError(f"p22 direct launch: expected contiguous float32 CUDA tensors, got {t.dtype} {t.device}")
    return [t.data_ptr() for t in tensors]
