"""Puzzle p22 from Python: the unfused and fused LayerNorm+Linear paths.

``P22Kernels(package)`` binds the six registered Mojo ops of one p22 package
(``problems/p22/op`` or ``solutions/p22/op``) through the bridge. Shapes:
x [batch, seq, hidden], gamma/beta [hidden], weight [out, hidden], bias [out],
all float32 on one device (CPU or CUDA).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from ops.inputs import check_same, check_size, check_tensor
from ops.launch.bridge import ROOT, GraphOp, Out
from ops.reference import layernorm_linear_ref, layernorm_ref

PROBLEMS = ROOT / "problems" / "p22" / "op"
SOLUTIONS = ROOT / "solutions" / "p22" / "op"
DTYPES = (torch.float32,)
EPS = 1e-5  # fixed in the kernels (common.mojo: EPS)

_X = ("batch", "seq", "hidden")
# How ``p22``'s verdicts (``--check``'s, and ``--unfused``/``--fused``'s before they time) run the kernels: "direct"
# (without MAX: the CPU ops through ops/puzzle/p22_cpu.py's shared library, the GPU kernels from their PTX,
# ops/puzzle/p22_direct.py; a few seconds to build, all at once, where a MAX compile costs 7-8 s on a 2-core machine
# and 15-21 s per device on the GPU machine) or "max" (the ops' MAX graphs, the route --unfused and --fused time)
CHECK_ROUTE = "direct"
_FUSED_INPUTS = (_X, ("hidden",), ("hidden",), ("out", "hidden"), ("out",))


class P22Kernels:
    """The p22 custom ops of one Mojo package, each callable on torch tensors.

    Attributes: ``layernorm``, ``transpose``, ``matmul``, ``bias_add`` and
    ``fused_op(variant)``; built once, so their compiled models are reused.
    """

    def __init__(self, package: Path) -> None:
        self.package = Path(package)
        op = partial(GraphOp, package=self.package)
        self.layernorm = op("p22_layernorm", inputs=(_X, ("hidden",), ("hidden",)), outputs=(Out(_X),),
                            weights=frozenset({1, 2}))
        self.transpose = op("p22_transpose", inputs=(("rows", "cols"),), outputs=(Out(("cols", "rows")),),
                            weights=frozenset({0}))
        self.matmul = op("p22_matmul", inputs=(("batch", "seq", "k"), ("k", "n")),
                         outputs=(Out(("batch", "seq", "n")),))  # b is a fresh intermediate: not cached
        self.bias_add = op("p22_bias_add", inputs=(("batch", "seq", "n"), ("n",)),
                           outputs=(Out(("batch", "seq", "n")),), weights=frozenset({1}))
        self._fused = {
            variant: op(name, inputs=_FUSED_INPUTS, outputs=(Out(("batch", "seq", "out")),),
                        weights=frozenset({1, 2, 3, 4}))
            for variant, name in (("tiled", "p22_fused"), ("naive", "p22_fused_naive"))
        }

    def all_ops(self) -> list[GraphOp]:
        """Every op of the package: LayerNorm, transpose, matmul, bias-add, fused tiled, fused naive."""
        return [self.layernorm, self.transpose, self.matmul, self.bias_add, *self._fused.values()]

    def op_names(self) -> frozenset[str]:
        """The registered names of every op of the package."""
        return frozenset(op.name for op in self.all_ops())

    def calls(self, skip: frozenset[str] = frozenset()) -> list[tuple[GraphOp, tuple[torch.dtype, ...]]]:
        """(op, input dtypes) of every op but those named in ``skip``: what ``together.load_groups`` builds in one
        MAX compile per device (a compile's fixed cost is most of it: six ops in one cost about what one does)."""
        return [(op, (torch.float32,) * len(op.inputs)) for op in self.all_ops() if op.name not in skip]

    def fused_op(self, variant: str = "tiled") -> GraphOp:
        """The fused kernel: "tiled" (the solution's main one) or "naive" (the first version)."""
        if variant not in self._fused:
            raise ValueError(f"variant: {variant!r} is not one of {sorted(self._fused)}")
        if variant == "tiled":
            check_col_tiles_override()
        return self._fused[variant]


def validate(x: object, gamma: object, beta: object, weight: object, bias: object) -> None:
    """Raise ValueError/TypeError naming the first bad argument."""
    check_tensor("x", x, ndim=3, dtypes=DTYPES)
    check_tensor("gamma", gamma, ndim=1, dtypes=DTYPES)
    check_tensor("beta", beta, ndim=1, dtypes=DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=DTYPES)
    check_tensor("bias", bias, ndim=1, dtypes=DTYPES)
    check_same({"x": x, "gamma": gamma, "beta": beta, "weight": weight, "bias": bias})
    hidden = x.shape[2]
    check_size("gamma", gamma, 0, hidden, "x's hidden size")
    check_size("beta", beta, 0, hidden, "x's hidden size")
    check_size("weight", weight, 1, hidden, "x's hidden size")
    check_size("bias", bias, 0, weight.shape[0], "weight's out size")


def unfused(k: P22Kernels, x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor,
            weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """LayerNorm -> transpose(weight) -> matmul -> bias-add: four launches, three intermediates."""
    validate(x, gamma, beta, weight, bias)
    (xn,) = k.layernorm(x, gamma, beta)
    (wt,) = k.transpose(weight)
    (mm,) = k.matmul(xn, wt)
    (y,) = k.bias_add(mm, bias)
    return y


def fused(k: P22Kernels, x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor,
          weight: torch.Tensor, bias: torch.Tensor, variant: str = "tiled") -> torch.Tensor:
    """One kernel, no intermediate tensor; ``variant`` is "tiled" (default) or "naive"."""
    validate(x, gamma, beta, weight, bias)
    (y,) = k.fused_op(variant)(x, gamma, beta, weight, bias)
    return y


def check_col_tiles_override() -> None:
    """The tiled fused kernel reads P22_FUSED_COL_TILES (tiles per block, for sweeps); a value it
    cannot use must fail here, not be ignored there."""
    forced = os.environ.get("P22_FUSED_COL_TILES", "")
    if forced and not (forced.isdigit() and int(forced) >= 1):
        raise ValueError(f"P22_FUSED_COL_TILES: {forced!r} is not a positive integer")


@contextmanager
def col_tiles_override(value: str) -> Iterator[None]:
    """P22_FUSED_COL_TILES set to ``value`` ("" lets the launcher pick) inside the block, restored after."""
    before = os.environ.get("P22_FUSED_COL_TILES")
    os.environ["P22_FUSED_COL_TILES"] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("P22_FUSED_COL_TILES")
        else:
            os.environ["P22_FUSED_COL_TILES"] = before


def make_inputs(batch: int, seq: int, hidden: int, out: int, device: str | torch.device = "cpu",
                mean: float = 0.0, seed: int | None = None) -> tuple[torch.Tensor, ...]:
    """Random p22 inputs (x, gamma, beta, weight, bias); ``mean`` shifts every row of x."""
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed())
    x = torch.randn(batch, seq, hidden, generator=g) + mean
    gamma = 1.0 + 0.1 * torch.randn(hidden, generator=g)
    beta = 0.1 * torch.randn(hidden, generator=g)
    weight = torch.randn(out, hidden, generator=g) / hidden**0.5
    bias = 0.1 * torch.randn(out, generator=g)
    return tuple(t.to(device) for t in (x, gamma, beta, weight, bias))


def kernel_cases(k: P22Kernels, inputs: tuple[torch.Tensor, ...],
                 skip: frozenset[str] = frozenset()) -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
    """Run each kernel of ``k`` alone but those in ``skip``: name -> (output, float64 reference, reduction length)."""
    x, gamma, beta, weight, bias = inputs
    xn64 = layernorm_ref(x, gamma, beta)
    xn = xn64.float()
    mm_ref = xn64 @ weight.double().T
    hidden = x.shape[2]
    ref = layernorm_linear_ref(*inputs)
    cases = {
        "p22_layernorm": (lambda: k.layernorm(x, gamma, beta), xn64, 1),
        "p22_transpose": (lambda: k.transpose(weight), weight.double().T.contiguous(), 1),
        "p22_matmul": (lambda: k.matmul(xn, weight.T.contiguous()), mm_ref, hidden),
        "p22_bias_add": (lambda: k.bias_add(mm_ref.float(), bias), mm_ref + bias.double(), 1),
        "p22_fused": (lambda: k.fused_op("tiled")(*inputs), ref, hidden),
        "p22_fused_naive": (lambda: k.fused_op("naive")(*inputs), ref, hidden),
    }
    return {name: (run()[0], want, red) for name, (run, want, red) in cases.items() if name not in skip}


# ---------------------------------------------------------------- torch.library
# The solution's paths as PyTorch custom ops: opaque to torch.compile (which
# traces them through the fake implementation) and usable in eager mode.

@torch.library.custom_op("p22::layernorm_linear", mutates_args=())
def layernorm_linear(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor,
                     weight: torch.Tensor, bias: torch.Tensor, fused_path: bool = True) -> torch.Tensor:
    """Linear(LayerNorm(x)) with the p22 solution kernels: x [b, s, k] -> [b, s, n], float32."""
    k = _solution_kernels()
    return (fused if fused_path else unfused)(k, x, gamma, beta, weight, bias)


@layernorm_linear.register_fake
def _(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor,
      weight: torch.Tensor, bias: torch.Tensor, fused_path: bool = True) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


_SOLUTION: list[P22Kernels] = []


def _solution_kernels() -> P22Kernels:
    if not _SOLUTION:
        _SOLUTION.append(P22Kernels(SOLUTIONS))
    return _SOLUTION[0]
