"""Build what the GPU tests load, all at once, while pytest-xdist starts its workers (``conftest.py`` starts
one process per item on a GPU machine).

Each MAX graph of ``graphs()`` (and the C++ launcher, item -1) is built in a process of its own, under its cache
lock (``ops.launch.cache.built_once``). A worker that needs one of them waits on that lock and then loads it
from the cache in a few seconds. Without this, whichever worker came first compiled each graph, one after
another (the puzzle's unfused path alone needs four), while the others waited: in the H100 run at 04393c2, 1186 s
of the workers' time went to waiting, 696 s to building (``results/gpu_tests.txt`` as of 0f47e5e). Only speed
depends on this list: a graph not on it is compiled where a test needs it.

    python tests/warm_graphs.py ITEM    # -1: the C++ launcher; 0..: graphs()[ITEM]
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def graphs() -> list[tuple[object, tuple[torch.dtype, ...], str]]:
    """(GraphOp, input dtypes, device) of each graph the GPU tests compile (bridge's compile log of a GPU run)."""
    from ops import layernorm_linear as LL
    from ops.puzzle.p22 import SOLUTIONS, P22Kernels

    f32 = torch.float32
    p22 = P22Kernels(SOLUTIONS)
    return [*((LL.launch.fwd_op(1e-5), (dtype,) * 5 + (torch.int32,), "cuda") for dtype in LL.DTYPES),
            (LL.launch.sm90_op(1e-5), (torch.bfloat16,) * 5, "cuda"),
            *((LL.launch.fold_op(), (dtype,) * 4, "cuda") for dtype in LL.DTYPES),
            (p22.layernorm, (f32,) * 3, "cuda"), (p22.transpose, (f32,), "cuda"), (p22.matmul, (f32,) * 2, "cuda"),
            (p22.bias_add, (f32,) * 2, "cuda"), (p22.fused_op("tiled"), (f32,) * 5, "cuda"),
            (p22.fused_op("naive"), (f32,) * 5, "cuda"), (p22.fused_op("tiled"), (f32,) * 5, "cpu")]


def start() -> list[subprocess.Popen]:
    """One background process per item; their output is dropped (a failure only costs a worker the build), and
    where the list cannot be made here (say, a bad P22_FUSED_COL_TILES), nothing is warmed."""
    try:
        items = [-1, *range(len(graphs()))]
    except Exception as e:   # speed only: the tests themselves report what is wrong
        print(f"warm_graphs: not warming ({e})", file=sys.stderr)
        return []
    return [subprocess.Popen([sys.executable, __file__, str(i)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for i in items]


def main(argv: list[str]) -> int:
    item = int(argv[0])
    if item == -1:
        from ops.launch import direct

        direct.build_native(quiet=True)
    else:
        from ops.launch import bridge

        op, dtypes, device = graphs()[item]
        bridge.load_model(op, dtypes, torch.device(device))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
